"""Everything one trainer GPU holds during an RL step, by component, and what would make a
layout fit.

Components (bytes on the heaviest rank; first and last pipeline stage both evaluated):

- parameters, gradients, optimizer states: ``launch.memory.estimate_memory``.
- activations: the decoder's saved activations of the micro-batches in flight
  (``launch.activation_memory``): one micro-batch without pipeline parallelism; under 1F1B the
  first stage holds PP of them.
- recompute working set: under ``"full"`` recompute, one chunk's activations rebuilt inside
  the backward.
- logits and loss: the last stage's float32 logits copy that the vocab-parallel cross entropy
  keeps, the bf16 logits beside it, the final norm and output layer inputs.
- micro-batch and R3 routes: the micro-batch being trained, moved to the device one at a time
  (the step's assumption: each micro-batch is staged on the host, copied just before its
  forward and freed after its backward), its compact routes (uint8 up to 256 experts, else
  int16), the int64 router targets of the stage's MoE layers (``RoutingReplay.routes_for``)
  and the routing maps the R3 agreement metric captures (bool [tokens, E] per MoE layer).
- no-grad pass results: the float32 log-probs [B, S] of every micro-batch of the step from
  each no-grad pass of ``training.pass_plan.plan_passes`` (they stay on the device until the
  training pass reads them); last stage only.
- reference policy: with ``objective.kl_coef > 0`` and ``train.reference_on_device``, a second
  copy of the parameters (``training.reference``); else 0 (pinned host memory, swapped in for
  its pass), and the plan says in a note whether it would fit on the device.
- CUDA context, NCCL and TE workspaces: ``launch.reserved_memory_gib``.
- allocator fragmentation: :data:`FRAGMENTATION` of the dynamic components (activations,
  recompute, logits, micro-batch), the caching allocator's slack between block sizes.

The micro-batch the plan sizes is the largest one the configuration allows: with
``train.max_tokens_per_micro_batch``, that many tokens per rank (x CP) in rows up to the
longest sample; else ``train.micro_batch_size`` rows of the longest sample. The longest sample
is ``launch.max_prompt_tokens + rollout.max_new_tokens``, padded to the TP multiple.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_sat.launch.activation_memory import (
    ActivationLayout,
    ModelDims,
    decoder_activations,
    output_activations,
)
from megatron_sat.launch.memory import GIB, MemoryEstimate
from megatron_sat.training.micro_batches import padded_length
from megatron_sat.training.pass_plan import plan_passes

# Caching-allocator slack on top of the dynamic components (PyTorch rounds blocks up and keeps
# freed blocks of other sizes; ``expandable_segments`` lowers it, the plan does not count on it).
FRAGMENTATION = 0.10
# Per token of the micro-batch on the device (training.batching.MicroBatch): input_ids,
# position_ids, labels, response_versions (int64), loss_mask, rollout_log_probs (float32),
# routes_valid (bool).
BATCH_BYTES_PER_TOKEN = 4 * 8 + 2 * 4 + 1


@dataclass(frozen=True)
class MicroBatchShape:
    """The largest micro-batch of a configuration.

    Attributes:
        tokens: tokens of the micro-batch before the CP split (rows x padded length).
        seq_len: the longest padded row.
        source: the config fields it comes from, as printed.
    """

    tokens: int
    seq_len: int
    source: str


@dataclass(frozen=True)
class StepMemory:
    """Per-GPU memory of one RL step by component.

    Attributes:
        components: name -> bytes (insertion order = print order).
        limit_bytes: ``launch.gpu_memory_gib`` in bytes.
        shape: the micro-batch it was sized for.
        kernels: ``"transformer_engine"`` (CUDA) or ``"local"`` (CPU).
        recompute_granularity: ``train.recompute_granularity``.
    """

    components: dict[str, int]
    limit_bytes: int
    shape: MicroBatchShape
    kernels: str
    recompute_granularity: str

    @property
    def total(self) -> int:
        """The sum of every component, bytes."""
        return sum(self.components.values())

    @property
    def fits(self) -> bool:
        """Whether the total is within the device's memory."""
        return self.total <= self.limit_bytes


def longest_sample(cfg: Any, tp: int, sequence_parallel: bool) -> int:
    """Tokens of the longest sample, padded as the trainer pads it under SP."""
    tokens = cfg.launch.max_prompt_tokens + cfg.rollout.max_new_tokens
    return padded_length(tokens, tp if sequence_parallel else 1)


def micro_batch_shape(cfg: Any, *, tp: int, cp: int, sequence_parallel: bool) -> MicroBatchShape:
    """The largest micro-batch ``cfg`` lets a rank train (module docstring)."""
    seq = longest_sample(cfg, tp, sequence_parallel)
    budget = cfg.train.max_tokens_per_micro_batch
    if budget is not None:
        return MicroBatchShape(
            budget * cp, min(seq, budget * cp), f"train.max_tokens_per_micro_batch={budget}"
        )
    mbs = cfg.train.micro_batch_size
    return MicroBatchShape(
        mbs * seq,
        seq,
        f"train.micro_batch_size={mbs} x {seq} tokens (launch.max_prompt_tokens="
        f"{cfg.launch.max_prompt_tokens} + rollout.max_new_tokens={cfg.rollout.max_new_tokens})",
    )


def _stage_dynamic(
    cfg: Any,
    dims: ModelDims,
    layout: ActivationLayout,
    shape: MicroBatchShape,
    *,
    kernels: str,
    layers: range,
    in_flight: int,
    last: bool,
    dp: int,
) -> dict[str, int]:
    """The dynamic components of one pipeline stage."""
    train = cfg.train
    kw = dict(tokens=shape.tokens, seq_len=shape.seq_len, kernels=kernels)
    dec = decoder_activations(
        dims,
        layout,
        layers=layers,
        granularity=train.recompute_granularity,
        recompute_num_layers=train.recompute_num_layers,
        **kw,
    )
    out = dict.fromkeys(("activations", "recompute working set", "logits and loss"), 0)
    out["activations"] = dec.saved_bytes * in_flight
    out["recompute working set"] = dec.recompute_bytes
    if last:
        entropy = cfg.objective.entropy_coef > 0
        out["logits and loss"] = output_activations(dims, layout, entropy=entropy, **kw).peak_bytes
    tokens = shape.tokens // layout.cp
    sp = layout.tp if layout.sequence_parallel else 1
    moe_layers = sum(dims.moe_layers[i] for i in layers)
    route_bytes = 1 if dims.num_experts <= 256 else 2
    out["micro-batch and R3 routes"] = in_flight * (
        tokens * (BATCH_BYTES_PER_TOKEN + len(dims.moe_layers) * dims.top_k * route_bytes)
        + (tokens // sp) * moe_layers * (dims.top_k * 8 + dims.num_experts)
        if train.use_r3
        else tokens * BATCH_BYTES_PER_TOKEN
    )
    passes = plan_passes(
        cfg.objective,
        use_r3=train.use_r3,
        diagnostic=train.routing_diagnostic_interval > 0,
        split_batch=True,
    )
    num_results = sum((passes.live, passes.replayed, passes.reference))
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size // dp
    seq = longest_sample(cfg, layout.tp, layout.sequence_parallel)
    out["no-grad pass results"] = num_results * samples * seq * 4 if last else 0
    return out


def step_memory(
    cfg: Any,
    hf_config: dict[str, Any],
    static: MemoryEstimate,
    *,
    tp: int,
    pp: int,
    cp: int,
    ep: int,
    etp: int,
    dp: int,
    sequence_parallel: bool,
) -> StepMemory:
    """Per-GPU memory of one RL step of ``cfg`` (a ``RunConfig``) on the layout.

    Args:
        cfg: the run config (``train``, ``rollout``, ``objective``, ``launch``).
        hf_config: the model's parsed config.json.
        static: parameters, gradients and optimizer states (``estimate_memory``).
        tp, pp, cp, ep, etp, dp, sequence_parallel: the trainer layout.

    Raises:
        ValueError: for a model without an activation formula (``ModelDims.from_hf``).
    """
    dims = ModelDims.from_hf(hf_config)
    layout = ActivationLayout(tp=tp, cp=cp, ep=ep, etp=etp, sequence_parallel=sequence_parallel)
    shape = micro_batch_shape(cfg, tp=tp, cp=cp, sequence_parallel=sequence_parallel)
    kernels = "transformer_engine" if cfg.launch.device == "cuda" else "local"
    per_stage = len(dims.moe_layers) // pp
    stages = [
        _stage_dynamic(
            cfg,
            dims,
            layout,
            shape,
            kernels=kernels,
            layers=range(s * per_stage, (s + 1) * per_stage),
            in_flight=pp - s,
            last=s == pp - 1,
            dp=dp,
        )
        for s in sorted({0, pp - 1})
    ]
    dynamic = max(stages, key=lambda d: sum(d.values()))
    components = {
        "parameters": static.param_bytes,
        "gradients": static.grad_bytes,
        "optimizer states": static.optimizer_bytes,
        **dynamic,
        "reference policy": static.param_bytes
        if cfg.objective.kl_coef > 0 and cfg.train.reference_on_device
        else 0,
        "CUDA/NCCL/TE workspaces": int(cfg.launch.reserved_memory_gib * GIB),
    }
    fragmented = sum(v for k, v in dynamic.items() if k != "no-grad pass results")
    components["allocator fragmentation"] = int(FRAGMENTATION * fragmented)
    limit = int(cfg.launch.gpu_memory_gib * GIB)
    return StepMemory(components, limit, shape, kernels, cfg.train.recompute_granularity)


def with_train(cfg: Any, **changes: Any) -> Any:
    """``cfg`` with ``train`` fields changed (for the alternatives the refusal names)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def largest_fitting_budget(
    fits: Callable[[int], bool], longest: int, tokens: int, step: int = 1024
) -> int | None:
    """The largest token budget in ``[longest, tokens)`` (multiples of ``step``, and
    ``longest`` itself) for which ``fits(budget)`` holds; None when even ``longest`` does not
    fit. ``fits`` must be monotone (fewer tokens never need more memory)."""
    candidates = [longest] + list(range(-(-longest // step) * step, tokens, step))
    lo, hi = 0, len(candidates) - 1
    if not fits(candidates[0]):
        return None
    while lo < hi:  # bisect on the last candidate that fits
        mid = (lo + hi + 1) // 2
        if fits(candidates[mid]):
            lo = mid
        else:
            hi = mid - 1
    return candidates[lo]


def _alternatives(
    cfg: Any,
    hf_config: dict[str, Any],
    static: MemoryEstimate,
    toggled: MemoryEstimate | None,
    layout: dict[str, Any],
    step: StepMemory,
) -> list[str]:
    """What would make ``cfg`` fit, each with its total: full recompute, the largest token
    budget that fits (with the current recompute, then with full recompute), and the
    optimizer offload."""

    def total(c: Any, st: MemoryEstimate = static) -> StepMemory:
        return step_memory(c, hf_config, st, **layout)

    def say(fields: str, s: StepMemory) -> str:
        return f"{fields} ({s.total / GIB:.1f} GiB{'' if s.fits else ', still too much'})"

    out = []
    train = cfg.train
    cp = layout["cp"]  # a sample's tokens per rank are split over CP
    longest = -(-longest_sample(cfg, layout["tp"], layout["sequence_parallel"]) // cp)
    tokens = step.shape.tokens // cp
    granularities = [train.recompute_granularity]
    if train.recompute_granularity != "full":
        granularities.append("full")
        out.append(
            say(
                "train.recompute_granularity=full",
                total(with_train(cfg, recompute_granularity="full")),
            )
        )
    for gran in granularities:

        def fits(budget: int, gran: str = gran) -> bool:
            c = with_train(cfg, recompute_granularity=gran, max_tokens_per_micro_batch=budget)
            return total(c).fits

        budget = largest_fitting_budget(fits, longest, tokens)
        if budget is not None:
            fields = f"train.max_tokens_per_micro_batch={budget}"
            if gran != train.recompute_granularity:
                fields += f" with train.recompute_granularity={gran}"
            c = with_train(cfg, recompute_granularity=gran, max_tokens_per_micro_batch=budget)
            out.append(say(fields, total(c)))
            break
    if toggled is not None and not train.optimizer_cpu_offload:
        offload = say(
            "train.optimizer_cpu_offload=true and train.use_distributed_optimizer=true",
            total(cfg, toggled),
        )
        out.append(offload)
    if not out:
        out.append("none of the token budget, recompute or offload alone: raise TP/EP/PP")
    return out


def step_memory_errors(
    cfg: Any,
    hf_config: dict[str, Any],
    static: MemoryEstimate,
    toggled: MemoryEstimate | None,
    layout: dict[str, Any],
    notes: list[str],
) -> tuple[StepMemory | None, list[str]]:
    """The step's memory on a CUDA layout and, when it does not fit ``launch.gpu_memory_gib``,
    one error naming the largest component and the fields that would make it fit. Adds notes
    on the reference policy and the plan's assumptions.

    Args:
        layout: ``tp, pp, cp, ep, etp, dp, sequence_parallel`` of :func:`step_memory`.

    Returns:
        (the step's memory, or None for a model without an activation formula, which a note
        then names; the errors).
    """
    launch = cfg.launch
    try:
        step = step_memory(cfg, hf_config, static, **layout)
    except ValueError as e:
        notes.append(f"activations not estimated ({e}): the check covers the static state only")
        too_much = launch.device == "cuda" and static.trainer_bytes > launch.gpu_memory_gib * GIB
        return None, [
            f"launch.gpu_memory_gib={launch.gpu_memory_gib:g}: a trainer rank needs "
            f"{static.trainer_bytes / GIB:.1f} GiB for parameters, gradients and optimizer "
            "states alone; raise TP/EP/PP or set train.optimizer_cpu_offload=true"
        ] if too_much else []
    notes.append(
        f"memory plan: {step.kernels} kernels; largest micro-batch {step.shape.tokens:,} tokens "
        f"({step.shape.source}); micro-batches moved to the device one at a time; routes "
        "assumed balanced over the expert-parallel ranks"
    )
    room = step.limit_bytes - step.total
    if cfg.objective.kl_coef > 0 and not cfg.train.reference_on_device:
        notes.append(
            f"reference policy in host memory ({2 * static.param_bytes / GIB:.1f} GiB per "
            "trainer rank while it is swapped in for its pass: its weights and the policy's); "
            f"on the device it would take {static.param_bytes / GIB:.1f} GiB, "
            + (
                "which fits"
                if static.param_bytes <= room
                else f"more than the {room / GIB:.1f} GiB left"
            )
        )
    if cfg.train.optimizer_cpu_offload and toggled is not None:
        notes.append(
            f"optimizer offload: {toggled.optimizer_bytes / GIB:.1f} GiB of host memory per "
            "trainer rank (fp32 main weights and Adam moments)"
        )
    if launch.device != "cuda" or step.fits:
        return step, []
    dynamic = {
        k: v
        for k, v in step.components.items()
        if k not in ("parameters", "gradients", "optimizer states")
    }
    name, largest = max(dynamic.items(), key=lambda kv: kv[1])
    options = _alternatives(cfg, hf_config, static, toggled, layout, step)
    return step, [
        f"launch.gpu_memory_gib={launch.gpu_memory_gib:g}: a trainer GPU needs "
        f"{step.total / GIB:.1f} GiB for one RL step (static state "
        f"{static.trainer_bytes / GIB:.1f} GiB; largest other part: {name} "
        f"{largest / GIB:.1f} GiB with micro-batches of {step.shape.source}, "
        f"train.recompute_granularity={cfg.train.recompute_granularity}); what each change "
        "gives: " + "; or ".join(options)
    ]
