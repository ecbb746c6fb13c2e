"""The resolved launch plan: who runs where, which process groups and servers exist, and
whether it all fits, computed from the run config alone (no GPU, no torch.distributed).

:func:`resolve_plan` validates the configuration across sections and raises one
``ValueError`` listing every problem found, each naming its config field; :func:`format_plan`
prints the topology. The rank groups are computed exactly as megatron-core's ``RankGenerator``
computes them (order ``tp-cp-ep-dp-pp``; tests compare against it).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_sat.config.launch import LaunchConfig
from megatron_sat.config.layout import (
    context_parallel_errors,
    layout_errors,
    parallel_option,
    read_model_config,
)
from megatron_sat.launch.host_memory import host_memory, host_memory_errors, host_memory_line
from megatron_sat.launch.memory import (
    GIB,
    MemoryEstimate,
    ParameterCount,
    count_parameters,
    estimate_memory,
)
from megatron_sat.launch.step_memory import StepMemory, step_memory_errors
from megatron_sat.rollout.engines import server_launch
from megatron_sat.rollout.pool_memory import PoolMemory, pool_memory_errors, rollout_pool_memory
from megatron_sat.training.optimizer_layout import OptimizerLayout, resolve_optimizer_layout

ORDER = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class TrainerRank:
    """One trainer process: where it runs and its coordinate in every parallel dimension."""

    rank: int
    node: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    edp: int
    cp: int = 0


@dataclass(frozen=True)
class RolloutServer:
    """One rollout server: node index, device ids on that node, port, weight-sync group ranks."""

    index: int
    node: int
    devices: tuple[int, ...]
    port: int
    sync_ranks: tuple[int, ...]


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the renderers and the dry-run print need.

    Attributes:
        launch: the launch section it was resolved from.
        run_name: the run directory's name.
        model_config_path: the HF config.json that was read.
        hf_config: its parsed content.
        params: the model's parameter count.
        world_size, tp, pp, ep, etp, dp, edp, cp: trainer world and parallel sizes.
        sequence_parallel: whether the trainer shards activations over TP.
        ranks: one entry per trainer rank.
        groups: megatron-core process groups by name (lists of global ranks).
        servers: rollout servers the launcher starts (empty: external or trainer-started).
        server_source: "launcher", "external" (rollout.server_urls) or "trainer" (the trainer
            starts ``rollout.num_embedded_servers`` embedded servers itself).
        sync_world_size: ranks of the weight-update group (trainer rank 0 + server ranks).
        sync_backend: "nccl" or "gloo".
        samples_per_step, micro_batches_per_dp_rank: the trainer batch (0 micro-batches:
            ``train.max_tokens_per_micro_batch``, whose count depends on the lengths).
        memory: static memory estimate.
        notes: assumptions the plan made, printed by the dry-run.
    """

    launch: LaunchConfig
    run_name: str
    model_config_path: str
    hf_config: dict[str, Any]
    params: ParameterCount
    world_size: int
    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    edp: int
    sequence_parallel: bool
    ranks: list[TrainerRank]
    groups: dict[str, list[list[int]]]
    servers: list[RolloutServer]
    server_source: str
    sync_world_size: int
    sync_backend: str
    samples_per_step: int
    micro_batches_per_dp_rank: int
    memory: MemoryEstimate
    notes: list[str]
    cp: int = 1
    optimizer_layout: OptimizerLayout | None = None
    memory_offload_toggled: MemoryEstimate | None = None
    step_memory: StepMemory | None = None
    pool_memory: str = ""  # rollout.pool_memory's report line
    host_memory: str = ""  # launch.host_memory's report line

    @property
    def trainer_nodes(self) -> list[int]:
        """Indices of the nodes that run trainer ranks."""
        return list(range(self.launch.trainer_nodes))


def _decompose(index: int, sizes: list[int]) -> list[int]:
    """Mixed-radix digits of ``index``, first size fastest (megatron-core's convention)."""
    digits = []
    for size in sizes:
        digits.append(index % size)
        index //= size
    return digits


def rank_groups(sizes: dict[str, int], names: tuple[str, ...]) -> list[list[int]]:
    """Process groups over the dimensions ``names`` of a rank grid laid out in ``ORDER``.

    Equivalent to megatron-core's ``RankGenerator(...).get_ranks("-".join(names))``: ranks are
    numbered with ``tp`` fastest and ``pp`` slowest; each group holds the ranks that differ only
    in ``names``, in increasing order of those coordinates.

    Args:
        sizes: size of every dimension of ``ORDER`` ("tp", "cp", "ep", "dp", "pp").
        names: the dimensions a group spans.
    """
    dims = [sizes[d] for d in ORDER]
    strides = [math.prod(dims[:i]) for i in range(len(dims))]
    inside = [i for i, d in enumerate(ORDER) if d in names]
    outside = [i for i, d in enumerate(ORDER) if d not in names]
    groups = []
    for o in range(math.prod(dims[i] for i in outside)):
        base = sum(
            c * strides[i]
            for c, i in zip(_decompose(o, [dims[i] for i in outside]), outside, strict=True)
        )
        groups.append(
            [
                base
                + sum(
                    c * strides[i]
                    for c, i in zip(_decompose(m, [dims[i] for i in inside]), inside, strict=True)
                )
                for m in range(math.prod(dims[i] for i in inside))
            ]
        )
    return groups


def resolve_plan(cfg: Any, hf_config: dict[str, Any] | None = None) -> LaunchPlan:
    """Validate ``cfg`` (a :class:`~megatron_sat.config.RunConfig`) for launching and resolve
    its plan.

    Args:
        cfg: the run config; its ``launch`` section says where the job runs.
        hf_config: the model's parsed config.json; None reads it (see :func:`read_model_config`).

    Raises:
        ValueError: listing every problem, one per line, each naming its config field
            (``parallel.*``, ``launch.*``, ``train.*``, ``rollout.*``).
    """
    launch: LaunchConfig = cfg.launch
    if hf_config is None:
        model_path, hf_config = read_model_config(cfg)
    else:
        model_path = "<given>"
    params = count_parameters(hf_config)
    par = cfg.parallel
    tp = par.tensor_model_parallel_size
    pp = par.pipeline_model_parallel_size
    ep = par.expert_model_parallel_size
    notes: list[str] = []
    etp = par.expert_tensor_parallel_size
    sp = parallel_option(par, "sequence_parallel")
    if sp is None:
        sp = tp > 1  # transformer_config_from_hf's rule
    world = launch.trainer_nodes * launch.trainer_ranks_per_node
    cp = parallel_option(par, "context_parallel_size") or 1

    errors = layout_errors(hf_config, world, tp, pp, ep, etp, sp)
    errors += context_parallel_errors(cfg, world, tp, cp, pp)
    if errors:
        raise ValueError("invalid launch configuration:\n  " + "\n  ".join(errors))
    dp, edp = world // (tp * cp * pp), world // (etp * ep * pp)
    groups, ranks = _groups_and_ranks(launch, world, tp, cp, pp, dp, etp, ep, edp)
    servers, source, errors = _servers(cfg, launch)
    errors += _batch_errors(cfg, dp, hf_config)
    layout = _optimizer_layout(cfg, dp * cp, edp, errors)

    sizes = dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp, sequence_parallel=sp)
    memory, toggled, step = _memory(cfg, hf_config, params, layout, sizes, edp, errors, notes)
    errors += _memory_errors(cfg, memory, bool(servers), notes)
    host = host_memory(cfg, memory, toggled, _pool_memory(cfg, hf_config)[0], dp)
    errors += host_memory_errors(launch.host_memory_gib, host)
    if errors:
        raise ValueError("invalid launch configuration:\n  " + "\n  ".join(errors))
    samples, mbs = cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.train.micro_batch_size
    return LaunchPlan(
        launch=launch,
        run_name=Path(cfg.run_dir).name,
        model_config_path=model_path,
        hf_config=hf_config,
        params=params,
        world_size=world,
        tp=tp,
        pp=pp,
        ep=ep,
        etp=etp,
        dp=dp,
        edp=edp,
        sequence_parallel=sp,
        ranks=ranks,
        groups=groups,
        servers=servers,
        server_source=source,
        sync_world_size=_sync_world_size(cfg, servers, source, notes),
        sync_backend="nccl" if launch.device == "cuda" else "gloo",
        samples_per_step=samples,
        micro_batches_per_dp_rank=(
            samples // (dp * mbs) if cfg.train.max_tokens_per_micro_batch is None else 0
        ),
        memory=memory,
        notes=notes,
        cp=cp,
        optimizer_layout=layout,
        memory_offload_toggled=toggled,
        step_memory=step,
        pool_memory=_pool_memory(cfg, hf_config)[1],
        host_memory=host_memory_line(host),
    )


def _memory(
    cfg: Any,
    hf_config: dict[str, Any],
    params: ParameterCount,
    layout: OptimizerLayout,
    sizes: dict[str, Any],
    edp: int,
    errors: list[str],
    notes: list[str],
) -> tuple[MemoryEstimate, MemoryEstimate | None, StepMemory | None]:
    """The static memory as built and with ``train.optimizer_cpu_offload`` toggled (offload
    needs the distributed optimizer, which then also runs at DP 1: printed by the dry-run,
    named when the layout cannot fit), and the whole step's (``launch.step_memory``), whose
    refusal is added to ``errors``."""
    dense_shards = sizes["dp"] * sizes["cp"]

    def memory_for(opt_layout: OptimizerLayout) -> MemoryEstimate:
        return estimate_memory(
            params,
            tp=sizes["tp"],
            pp=sizes["pp"],
            ep=sizes["ep"],
            etp=sizes["etp"],
            layout=opt_layout,
            dense_shards=dense_shards,
            expert_shards=edp,
            server_tp=cfg.launch.rollout_server_tp,
        )

    memory = memory_for(layout)
    toggled = None
    if layout.params_dtype == "bf16":
        toggled = memory_for(
            dataclasses.replace(
                layout,
                use_distributed_optimizer=True,
                optimizer_cpu_offload=not layout.optimizer_cpu_offload,
            )
        )
    step, step_errors = step_memory_errors(cfg, hf_config, memory, toggled, sizes, notes)
    errors += step_errors
    return memory, toggled, step


def _groups_and_ranks(
    launch: LaunchConfig,
    world: int,
    tp: int,
    cp: int,
    pp: int,
    dp: int,
    etp: int,
    ep: int,
    edp: int,
) -> tuple[dict[str, list[list[int]]], list[TrainerRank]]:
    """megatron-core's process groups by name, and every trainer rank's coordinates."""
    sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert_sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    groups = {
        "tensor parallel": rank_groups(sizes, ("tp",)),
        "pipeline parallel": rank_groups(sizes, ("pp",)),
        "data parallel": rank_groups(sizes, ("dp",)),
        "model parallel (tp-pp)": rank_groups(sizes, ("tp", "pp")),
        "expert parallel": rank_groups(expert_sizes, ("ep",)),
        "expert tensor parallel": rank_groups(expert_sizes, ("tp",)),
        "expert data parallel": rank_groups(expert_sizes, ("dp",)),
    }
    if cp > 1:  # dense gradients are reduced over DP x CP (megatron-core's dp-cp group)
        groups["context parallel"] = rank_groups(sizes, ("cp",))
        groups["data-context parallel (dp-cp)"] = rank_groups(sizes, ("cp", "dp"))
    ranks = []
    for r in range(world):
        t, c, _, d, p = _decompose(r, [sizes[k] for k in ORDER])
        et, _, e, ed, _ = _decompose(r, [expert_sizes[k] for k in ORDER])
        node, local = divmod(r, launch.trainer_ranks_per_node)
        ranks.append(TrainerRank(r, node, local, t, p, d, e, et, ed, c))
    return groups, ranks


def _pool_memory(cfg: Any, hf_config: dict[str, Any]) -> tuple[PoolMemory, str]:
    """The rollout pool's host memory and its report line (``rollout.pool_memory``)."""
    return rollout_pool_memory(
        cfg.rollout,
        hf_config,
        with_routes=cfg.rollout.return_routed_experts,
        max_prompt_tokens=cfg.launch.max_prompt_tokens,
    )


def _batch_errors(cfg: Any, dp: int, hf_config: dict[str, Any]) -> list[str]:
    """The step's batch against the data-parallel size, the micro-batch size and the pool's
    host memory limit (``rollout.pool_host_memory_gib``)."""
    ro = cfg.rollout
    pool_errors = pool_memory_errors(ro, _pool_memory(cfg, hf_config)[0])
    if pool_errors:
        return pool_errors
    samples = ro.prompts_per_step * ro.group_size
    mbs = cfg.train.micro_batch_size
    if ro.prompts_per_step % dp:
        return [
            f"rollout.prompts_per_step={ro.prompts_per_step} is not divisible by DP {dp}: the "
            "trainer scatters whole groups, so the data-parallel ranks would get unequal shares"
        ]
    if cfg.train.max_tokens_per_micro_batch is None and samples % (dp * mbs):
        return [
            f"train.micro_batch_size={mbs}: the {samples} samples of a step "
            f"(rollout.prompts_per_step={ro.prompts_per_step} x rollout.group_size="
            f"{ro.group_size}) are not divisible by DP {dp} x micro-batch {mbs}"
        ]
    return []


def _optimizer_layout(cfg: Any, dense_shards: int, edp: int, errors: list[str]) -> OptimizerLayout:
    """The trainer's own optimizer layout rule (``training.optimizer_layout``) from the same
    ``train.*`` fields; a refused layout is added to ``errors`` and the plan goes on with the
    layout without offload and precision-aware moments, so that every other problem is listed
    too."""
    launch = cfg.launch
    try:
        layout = resolve_optimizer_layout(
            cfg.train, device_type=launch.device, dp=dense_shards, edp=edp
        )
    except ValueError as e:
        errors.append(str(e))
        layout = resolve_optimizer_layout(
            dataclasses.replace(
                cfg.train, optimizer_cpu_offload=False, use_precision_aware_optimizer=False
            ),
            device_type=launch.device,
            dp=dense_shards,
            edp=edp,
        )
    if launch.params_dtype != layout.params_dtype:
        errors.append(
            f"launch.params_dtype={launch.params_dtype!r} but the trainer will build "
            f"train.params_dtype={layout.params_dtype!r} on device {launch.device} "
            f"(train.params_dtype={cfg.train.params_dtype!r}): set them alike"
        )
    return layout


def _memory_errors(
    cfg: Any, memory: MemoryEstimate, has_servers: bool, notes: list[str]
) -> list[str]:
    """A rollout server's weights against ``launch.gpu_memory_gib`` (on CUDA); a note on the
    CPU. The trainer's side is ``step_memory.step_memory_errors``."""
    launch = cfg.launch
    errors = []
    if launch.device != "cuda":
        notes.append("device cpu: memory estimate printed, not checked against a device size")
    elif has_servers and memory.server_weight_bytes_per_gpu > launch.gpu_memory_gib * GIB:
        errors.append(
            f"launch.rollout_server_tp={launch.rollout_server_tp}: a server's bf16 weights "
            f"need {memory.server_weight_bytes_per_gpu / GIB:.1f} GiB per GPU, more than "
            f"launch.gpu_memory_gib={launch.gpu_memory_gib}"
        )
    return errors


def _sync_world_size(cfg: Any, servers: list[RolloutServer], source: str, notes: list[str]) -> int:
    """The weight-update group's size: the trainer's sender plus every server rank."""
    if source == "external":
        notes.append(
            "external servers (rollout.server_urls): weight-sync ranks are assigned when the "
            "trainer connects (1 per server unless the servers run TP)"
        )
        return 1 + len(cfg.rollout.server_urls)
    if source == "trainer":
        return 1 + cfg.rollout.num_embedded_servers
    return 1 + sum(len(s.devices) for s in servers)


def _servers(cfg: Any, launch: LaunchConfig) -> tuple[list[RolloutServer], str, list[str]]:
    """Rollout servers on the devices the trainer leaves free; where servers come from."""
    errors: list[str] = []
    servers: list[RolloutServer] = []
    free = []
    for node in range(launch.num_nodes):
        first = launch.trainer_ranks_per_node if node < launch.trainer_nodes else 0
        free.append(list(range(first, launch.gpus_per_node)))
    stp = launch.rollout_server_tp
    for node, devices in enumerate(free):
        if len(devices) % stp:
            errors.append(
                f"launch.rollout_server_tp={stp} does not divide the {len(devices)} rollout "
                f"devices of node {node} (servers do not span nodes)"
            )
            continue
        for k in range(len(devices) // stp):
            offset = 1 + sum(len(s.devices) for s in servers)
            servers.append(
                RolloutServer(
                    index=len(servers),
                    node=node,
                    devices=tuple(devices[k * stp : (k + 1) * stp]),
                    port=launch.rollout_base_port + k,
                    sync_ranks=tuple(range(offset, offset + stp)),
                )
            )
    urls = cfg.rollout.server_urls
    if servers and urls:
        errors.append(
            f"rollout.server_urls={urls} while the launcher starts {len(servers)} server(s) on "
            "the free devices: leave server_urls empty (the script passes the URLs)"
        )
    if servers:
        return servers, "launcher", errors
    if urls:
        return [], "external", errors
    if launch.device == "cpu" or any(free):  # any(free): the divisibility error says it all
        return [], "trainer" if launch.device == "cpu" else "none", errors
    errors.append(
        "launch.trainer_gpus_per_node: every device runs a trainer rank and rollout.server_urls "
        "is empty: leave devices for rollout servers (or add nodes with launch.num_nodes)"
    )
    return [], "none", errors


def _span(values: list[int]) -> str:
    return f"{values[0]}" if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _rank_holds(plan: LaunchPlan, r: TrainerRank) -> str:
    """What one rank holds: its layers, attention shard, experts and vocab rows."""
    num_layers = len(plan.params.per_layer_tp)
    per_stage = num_layers // plan.pp
    layers = list(range(r.pp * per_stage, (r.pp + 1) * per_stage))
    num_experts = int(
        plan.hf_config.get("num_experts")
        or plan.hf_config.get("num_local_experts")
        or plan.hf_config.get("n_routed_experts")
    )
    local = num_experts // plan.ep
    vocab = int(plan.hf_config["vocab_size"]) // plan.tp
    parts = [f"layers {_span(layers)}", f"attention shard {r.tp}/{plan.tp}"]
    parts.append(f"experts {_span(list(range(r.ep * local, (r.ep + 1) * local)))}")
    if plan.etp > 1:
        parts[-1] += f" (shard {r.etp}/{plan.etp})"
    if r.pp == 0:
        parts.append(f"embedding rows {r.tp * vocab}-{(r.tp + 1) * vocab - 1}")
    if r.pp == plan.pp - 1 and not plan.hf_config.get("tie_word_embeddings", False):
        parts.append("output layer shard")
    return ", ".join(parts)


def _step_memory_lines(plan: LaunchPlan) -> list[str]:
    """The step's memory per trainer device, one line per component."""
    step = plan.step_memory
    if step is None:
        return []
    unit = "GPU" if plan.launch.device == "cuda" else "process"
    lines = [
        f"memory per trainer {unit}, one RL step ({step.kernels} kernels; largest micro-batch "
        f"{step.shape.tokens:,} tokens, {step.shape.source}; train.recompute_granularity="
        f"{step.recompute_granularity}):"
    ]
    lines += [f"  {name:<28} {value / GIB:8.2f} GiB" for name, value in step.components.items()]
    verdict = "fits" if step.fits else "DOES NOT FIT"
    lines.append(
        f"  {'total':<28} {step.total / GIB:8.2f} GiB of {step.limit_bytes / GIB:g} GiB: {verdict}"
    )
    return lines


def format_plan(plan: LaunchPlan, max_rows: int = 64) -> str:
    """The dry-run's human-readable topology and memory report (several lines)."""
    lines = _topology_lines(plan, max_rows)
    lines += _servers_and_batch_lines(plan)
    lines += _static_memory_lines(plan)
    lines += _step_memory_lines(plan)
    la, m = plan.launch, plan.memory
    if plan.servers:
        lines.append(
            f"memory per rollout device: bf16 weights {m.server_weight_bytes_per_gpu / GIB:.1f}"
            f" GiB (TP {la.rollout_server_tp}); the rest is the server's KV cache"
        )
    lines += [plan.pool_memory] if plan.pool_memory else []
    lines += [plan.host_memory] if plan.host_memory else []
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _topology_lines(plan: LaunchPlan, max_rows: int) -> list[str]:
    """Model, allocation, the trainer's ranks (at most ``max_rows``) and process groups."""
    la, hf = plan.launch, plan.hf_config
    unit = "GPUs" if la.device == "cuda" else "CPU processes"
    rollout_devices = sum(len(s.devices) for s in plan.servers)
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
    lines = [
        f"launch plan for {plan.run_name}: launcher {la.launcher}, device {la.device}",
        f"model: {(hf.get('architectures') or ['?'])[0]} from {plan.model_config_path}: "
        f"{plan.params.total:,} parameters ({plan.params.non_embedding:,} without embeddings),"
        f" {len(plan.params.per_layer_tp)} layers, {num_experts} experts, top-"
        f"{hf.get('num_experts_per_tok')}",
        f"allocation: {la.num_nodes} node(s) x {la.gpus_per_node} {unit} = "
        f"{la.num_nodes * la.gpus_per_node}; trainer {plan.world_size} (nodes "
        f"{_span(plan.trainer_nodes)}, devices 0-{la.trainer_ranks_per_node - 1}), rollout "
        f"{rollout_devices} ({len(plan.servers)} {la.rollout_engine} server(s) x TP "
        f"{la.rollout_server_tp})",
        f"trainer: world {plan.world_size} = TP {plan.tp} x PP {plan.pp} x DP {plan.dp} (CP "
        f"{plan.cp});"
        f" experts: EP {plan.ep} x expert-TP {plan.etp} x expert-DP {plan.edp}; sequence "
        f"parallel {'on' if plan.sequence_parallel else 'off'}",
        "  rank node dev  tp pp dp  ep etp edp  holds",
    ]
    for r in plan.ranks[:max_rows]:
        lines.append(
            f"  {r.rank:<4} {r.node:<4} {r.local_rank:<4} {r.tp:<2} {r.pp:<2} {r.dp:<3} "
            f"{r.ep:<2} {r.etp:<3} {r.edp:<4} {_rank_holds(plan, r)}"
        )
    if len(plan.ranks) > max_rows:
        lines.append(f"  ... {len(plan.ranks) - max_rows} more ranks")
    lines.append("process groups (megatron-core order tp-cp-ep-dp-pp):")
    for name, groups in plan.groups.items():
        shown = json.dumps(groups[:8]) + (f" ... ({len(groups)} groups)" if len(groups) > 8 else "")
        lines.append(f"  {name:<24} {shown}")
    return lines


def _servers_and_batch_lines(plan: LaunchPlan) -> list[str]:
    """The rollout servers, the weight-sync group and the batch."""
    la = plan.launch
    lines = []
    lines.append(f"rollout servers ({plan.server_source}):")
    for s in plan.servers:
        lines.append(
            f"  server {s.index}: node {s.node}, devices {','.join(map(str, s.devices))}, port "
            f"{s.port}, {la.rollout_engine}"
            + server_launch(la.rollout_engine).plan_flags(la)
            + f" --enable-return-routed-experts; weight-sync ranks {_span(list(s.sync_ranks))}"
        )
    if not plan.servers:
        lines.append(f"  none started by the launcher ({plan.server_source})")
    lines.append(
        f"weight sync: one group of {plan.sync_world_size} ranks (trainer rank 0 = group rank 0,"
        f" hosts the store; {plan.sync_world_size - 1} server ranks), backend "
        f"{plan.sync_backend}"
    )
    per_rank = plan.samples_per_step // plan.dp
    lines.append(
        f"batch: {plan.samples_per_step} samples per step; per DP rank {per_rank} = "
        + (
            f"{plan.micro_batches_per_dp_rank} micro-batches"
            if plan.micro_batches_per_dp_rank
            else "token-budget micro-batches (count set by the lengths)"
        )
    )
    return lines


def _static_memory_lines(plan: LaunchPlan) -> list[str]:
    """Parameters, gradients and optimizer states per trainer device, as built and with the
    optimizer offload toggled."""
    la, m = plan.launch, plan.memory
    lines = []
    ol = plan.optimizer_layout
    how = (
        f"{ol.params_dtype} params, "
        + ("distributed optimizer" if ol.use_distributed_optimizer else "no distributed optimizer")
        + (", bf16 moments" if ol.use_precision_aware_optimizer else "")
    )
    offload = "optimizer offloaded to CPU" if ol.optimizer_cpu_offload else "no offload"
    alternative = (
        "train.optimizer_cpu_offload=false"
        if ol.optimizer_cpu_offload
        else "train.optimizer_cpu_offload=true with the distributed optimizer"
    )
    for label, est in (
        (f"{how}, {offload}: as built", m),
        (f"alternative: {alternative}", plan.memory_offload_toggled),
    ):
        if est is None:
            continue
        headroom = la.gpu_memory_gib - est.trainer_bytes / GIB
        lines.append(
            f"memory per trainer {'GPU' if la.device == 'cuda' else 'process'} ({label}): "
            f"{est.params_per_rank:,} parameters -> params {est.param_bytes / GIB:.1f} GiB + "
            f"grads {est.grad_bytes / GIB:.1f} GiB + optimizer "
            f"{est.optimizer_bytes / GIB:.1f} GiB = {est.trainer_bytes / GIB:.1f} GiB of "
            f"{la.gpu_memory_gib:g} GiB (headroom {headroom:.1f} GiB for activations)"
        )
    return lines
