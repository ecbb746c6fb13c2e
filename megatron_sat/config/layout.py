"""Checks of the trainer's parallel layout against its world size and the model's shape.

What ``megatron-sat train`` runs on every rank before it builds anything
(:func:`check_train_layout`), and what the launch plan (``launch.plan.resolve_plan``) runs
for the whole cluster layout. Errors name the config field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


def parallel_option(parallel: Any, name: str) -> Any:
    """A ParallelConfig field if the trainer's ParallelConfig defines it, else None."""
    names = {f.name for f in dataclasses.fields(parallel)}
    return getattr(parallel, name) if name in names else None


def read_model_config(cfg: Any) -> tuple[str, dict[str, Any]]:
    """The HF config.json the plan uses: ``launch.model_config`` or the one in
    ``init_checkpoint``. Returns ``(path, parsed)``.

    Raises:
        ValueError: naming ``launch.model_config`` when the file is missing or not JSON.
    """
    path = Path(cfg.launch.model_config or Path(cfg.init_checkpoint) / "config.json")
    if not path.is_file():
        raise ValueError(
            f"launch.model_config: {path} does not exist (set launch.model_config to an HF "
            "config.json, e.g. examples/models/qwen3_30b_a3b.json, when init_checkpoint is not "
            "on this machine)"
        )
    try:
        return str(path), json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"launch.model_config: {path} is not valid JSON: {e}") from None


def check_train_layout(cfg: Any, world: int, hf_config: dict[str, Any] | None = None) -> None:
    """The launch plan's layout and model checks for a trainer of ``world`` ranks (what
    ``megatron-sat train`` runs before building anything, at the world torchrun gave it).

    Raises:
        ValueError: listing every problem, one per line, each naming its config field.
    """
    if hf_config is None:
        _, hf_config = read_model_config(cfg)
    par = cfg.parallel
    tp = par.tensor_model_parallel_size
    sp = parallel_option(par, "sequence_parallel")
    if sp is None:
        sp = tp > 1  # transformer_config_from_hf's rule
    cp = parallel_option(par, "context_parallel_size") or 1
    pp = par.pipeline_model_parallel_size
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size
    errors = layout_errors(hf_config, world, tp, pp, ep, etp, sp)
    errors += context_parallel_errors(cfg, world, tp, cp, pp)
    if errors:
        raise ValueError("invalid training layout:\n  " + "\n  ".join(errors))


def context_parallel_errors(cfg: Any, world: int, tp: int, cp: int, pp: int) -> list[str]:
    """Context parallelism and the token budget against the world, the device, the trainer
    and the longest sample."""
    errors = []
    if cp > 1:
        if world % (tp * cp * pp):
            errors.append(
                f"parallel.context_parallel_size={cp} x TP {tp} x PP {pp} does not divide the "
                f"{world} trainer ranks"
            )
        if cfg.launch.device == "cpu":
            errors.append(
                f"parallel.context_parallel_size={cp} with launch.device=cpu: attention under "
                "context parallelism is transformer-engine's (ring attention); the CPU path "
                "has none"
            )
        # The slicing and the log-prob gather exist (training.context_parallel), but the
        # trainer's steps refuse CP (PolicyTrainer); a plan that calls CP valid would let a
        # job queue for hours to fail at build.
        errors.append(
            f"parallel.context_parallel_size={cp}: the trainer's steps do not run context "
            "parallelism yet (PolicyTrainer refuses it); use context_parallel_size=1"
        )
    budget = cfg.train.max_tokens_per_micro_batch
    if budget is not None and cfg.rollout.max_new_tokens + 1 > budget * cp:
        errors.append(
            f"train.max_tokens_per_micro_batch={budget}: a sample of rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} response tokens and a prompt does not fit "
            + (f"in {budget * cp} tokens over CP {cp}" if cp > 1 else "in one micro-batch")
        )
    return errors


_SIZES = (  # config.json fields that must be positive integers when present
    "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
    "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
    "shared_expert_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts",
    "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "decoder_sparse_step",
    "max_position_embeddings",
)  # fmt: skip
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def model_config_errors(hf: dict[str, Any]) -> list[str]:
    """The model's own shape, as the families read it (``models/*.py``), before anything is
    built: sizes positive integers; ``num_key_value_heads`` dividing ``num_attention_heads``
    (equal to it under DeepSeek-V3's MLA); without ``head_dim``, ``hidden_size`` divisible
    by the heads (the families take ``hidden_size // num_attention_heads``); top-k
    (``num_experts_per_tok``) between 1 and the routed experts (``num_experts`` /
    ``num_local_experts`` / ``n_routed_experts``); DeepSeek-V3's ``first_k_dense_replace``
    within the layers and its routing groups (``n_group`` dividing the experts,
    ``topk_group`` <= ``n_group``, top-k within the chosen groups' experts); Qwen-MoE's
    ``mlp_only_layers`` within the layers. Each error names the config.json field and value.
    """
    errors = [f"config.json has no {k} (required)" for k in _REQUIRED if hf.get(k) is None]
    sizes: dict[str, int] = {}
    for key in _SIZES:
        value = hf.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            errors.append(f"config.json {key}={value!r}: must be a positive integer")
        else:
            sizes[key] = value
    if errors:
        return errors
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    groups = sizes.get("num_key_value_heads", heads)
    mla = "DeepseekV3ForCausalLM" in (hf.get("architectures") or [])
    if mla and groups != heads:
        errors.append(
            f"config.json num_key_value_heads={groups}: must equal num_attention_heads={heads} "
            "under DeepSeek-V3's multi-latent attention"
        )
    elif heads % groups:
        errors.append(
            f"config.json num_key_value_heads={groups} does not divide num_attention_heads="
            f"{heads} (each key-value head serves a whole group of query heads)"
        )
    if not mla and "head_dim" not in sizes and hidden % heads:
        errors.append(
            f"config.json hidden_size={hidden} is not divisible by num_attention_heads={heads} "
            "and there is no head_dim (the head size is hidden_size // num_attention_heads)"
        )
    expert_key = next(
        (k for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in sizes), None
    )
    experts = sizes.get(expert_key, 0)
    topk = sizes.get("num_experts_per_tok")
    if experts and topk is None:
        errors.append(f"config.json {expert_key}={experts} without num_experts_per_tok (top-k)")
    if experts and topk is not None and topk > experts:
        errors.append(
            f"config.json num_experts_per_tok={topk}: more than the {experts} experts "
            f"({expert_key}); each token is routed to top-k distinct experts"
        )
    layers = sizes["num_hidden_layers"]
    first_dense = hf.get("first_k_dense_replace")
    if first_dense is not None and not (
        isinstance(first_dense, int) and 0 <= first_dense <= layers
    ):
        errors.append(
            f"config.json first_k_dense_replace={first_dense!r}: must be an integer in "
            f"[0, num_hidden_layers={layers}]"
        )
    dense = hf.get("mlp_only_layers") or []
    outside = [i for i in dense if not (isinstance(i, int) and 0 <= i < layers)]
    if outside:
        errors.append(
            f"config.json mlp_only_layers={dense}: {outside} outside [0, num_hidden_layers="
            f"{layers})"
        )
    n_group, topk_group = sizes.get("n_group", 1), sizes.get("topk_group", 1)
    if experts and n_group > 1:
        if experts % n_group:
            errors.append(f"config.json n_group={n_group} does not divide {expert_key}={experts}")
        elif topk_group > n_group:
            errors.append(f"config.json topk_group={topk_group}: more than n_group={n_group}")
        elif topk is not None and topk_group * (experts // n_group) < topk <= experts:
            errors.append(
                f"config.json num_experts_per_tok={topk}: more than the {topk_group} groups "
                f"(topk_group) x {experts // n_group} experts a token may be routed to"
            )
    return errors


def layout_errors(
    hf: dict[str, Any], world: int, tp: int, pp: int, ep: int, etp: int, sp: bool
) -> list[str]:
    """The model's shape (:func:`model_config_errors`; when it has errors, only those: the
    parallel checks below read it), then parallel sizes against the trainer world and the
    model's dimensions."""
    errors = model_config_errors(hf)
    if errors:
        return errors
    ranks = f"the {world} trainer ranks (launch.trainer_nodes x launch.trainer_gpus_per_node)"
    if world % (tp * pp):
        errors.append(
            f"parallel.tensor_model_parallel_size={tp} x parallel.pipeline_model_parallel_size"
            f"={pp} does not divide {ranks}"
        )
    if world % (etp * ep * pp):
        errors.append(
            f"parallel.expert_model_parallel_size={ep} x expert TP {etp} x PP {pp} does not "
            f"divide {ranks}"
        )
    heads = int(hf["num_attention_heads"])
    groups = int(hf.get("num_key_value_heads") or heads)
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    num_experts = num_experts or int(hf.get("n_routed_experts") or 0)
    checks = [
        (heads, tp, "parallel.tensor_model_parallel_size", "num_attention_heads"),
        (groups, tp, "parallel.tensor_model_parallel_size", "num_key_value_heads (query groups)"),
        (int(hf["vocab_size"]), tp, "parallel.tensor_model_parallel_size", "vocab_size"),
        (int(hf["num_hidden_layers"]), pp, "parallel.pipeline_model_parallel_size", "layers"),
        (num_experts, ep, "parallel.expert_model_parallel_size", "experts"),
    ]
    for value, size, name, what in checks:
        if value % size:
            errors.append(f"{name}={size} does not divide the model's {what} ({value})")
    if num_experts and tp > 1 and not sp:
        errors.append(
            f"parallel.sequence_parallel=False with MoE and parallel.tensor_model_parallel_size"
            f"={tp}: megatron-core requires sequence parallelism for MoE with TP > 1"
        )
    return errors
