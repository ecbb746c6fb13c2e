"""Parameter counts from an HF ``config.json`` and the static memory of one trainer rank.

The counts follow each architecture's module list in transformers (``Qwen3MoeForCausalLM``,
``Qwen2MoeForCausalLM``, ``MixtralForCausalLM``, ``DeepseekV3ForCausalLM``); the tests check
them against transformers' own models built on the meta device, and Qwen3-30B-A3B against its
model card (30.5B parameters, 29.9B without embeddings).

The per-rank estimate follows megatron-core's sharding: embedding and output layer split over
TP (first / last pipeline stage), attention and dense or shared-expert MLP weights split over
TP, routed experts split over EP x expert-TP, norms and routers replicated; ``L / PP`` layers
per stage. Bytes per parameter are those of the optimizer the trainer builds from the same
``train.*`` settings (``training.optimizer_layout``: parameter dtype, distributed optimizer,
CPU offload, precision-aware moments): bf16 parameters + fp32 gradients (DDP
``grad_reduce_in_fp32``) + (fp32 main parameters + Adam's two fp32 moments) / DP shards under
the distributed optimizer, dense parameters sharded over DP x CP and experts over expert DP
(18 bytes without it, 12 at DP 2); fp32 parameters 4 + 4 + 8 / shards. Activations, the CUDA
context and allocator fragmentation are not estimated: the headroom printed by the dry-run is
what is left for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_sat.training.optimizer_layout import OptimizerLayout, bytes_per_param

GIB = 2**30


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a model by how megatron-core shards them.

    Attributes:
        vocab: embedding plus (untied) output layer, split over TP.
        final_norm: the final norm (last pipeline stage, replicated).
        per_layer_tp: per decoder layer, weights split over TP (attention projections, dense or
            shared-expert MLP), one entry per layer.
        per_layer_replicated: per layer, replicated weights (norms, routers, gate biases).
        per_layer_experts: per layer, routed-expert weights (split over EP x expert-TP).
        embedding: the input embedding alone (first pipeline stage).
    """

    vocab: int
    final_norm: int
    per_layer_tp: tuple[int, ...]
    per_layer_replicated: tuple[int, ...]
    per_layer_experts: tuple[int, ...]
    embedding: int

    @property
    def total(self) -> int:
        """All parameters of the HF model."""
        return (
            self.vocab
            + self.final_norm
            + sum(self.per_layer_tp)
            + sum(self.per_layer_replicated)
            + sum(self.per_layer_experts)
        )

    @property
    def non_embedding(self) -> int:
        """Parameters without the embedding and output layer (the model cards' figure)."""
        return self.total - self.vocab


def _get(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json: {key} is missing (needed to count parameters)")
    return cfg[key]


def _attention_gqa(cfg: Mapping[str, Any], qkv_bias: bool, qk_norm: bool) -> tuple[int, int]:
    """(TP-split, replicated) parameters of one GQA attention block."""
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    split = hidden * (q + 2 * kv) + q * hidden
    if qkv_bias:
        split += q + 2 * kv
    replicated = 2 * head_dim if qk_norm else 0
    if cfg.get("attention_bias") and not qkv_bias:  # Qwen3 / Mixtral style: bias on all four
        split += q + 2 * kv
        replicated += hidden  # o_proj bias: row-parallel, replicated
    return split, replicated


def _moe_layers(cfg: Mapping[str, Any]) -> list[bool]:
    """True for each MoE decoder layer (Qwen-MoE's ``decoder_sparse_step``/``mlp_only_layers``)."""
    num_layers = int(_get(cfg, "num_hidden_layers"))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers)]


def count_parameters(cfg: Mapping[str, Any]) -> ParameterCount:
    """Exact parameter count of the HF model described by ``cfg`` (a parsed ``config.json``).

    Raises:
        ValueError: for an architecture without a formula here (naming ``architectures``) or a
            missing field (naming it).
    """
    archs = list(cfg.get("architectures") or [])
    hidden = int(_get(cfg, "hidden_size"))
    vocab_size = int(_get(cfg, "vocab_size"))
    tied = bool(cfg.get("tie_word_embeddings", False))
    tp_split, replicated, experts = [], [], []
    if "Qwen3MoeForCausalLM" in archs or "Qwen2MoeForCausalLM" in archs:
        qwen2 = "Qwen2MoeForCausalLM" in archs
        attn_split, attn_rep = _attention_gqa(cfg, qkv_bias=qwen2, qk_norm=not qwen2)
        num_experts = int(cfg.get("num_experts") or _get(cfg, "num_local_experts"))
        moe_inter = int(_get(cfg, "moe_intermediate_size"))
        for is_moe in _moe_layers(cfg):
            split, rep, exp = attn_split, attn_rep + 2 * hidden, 0
            if is_moe:
                rep += num_experts * hidden  # router
                exp = num_experts * 3 * hidden * moe_inter
                if qwen2:
                    split += 3 * hidden * int(_get(cfg, "shared_expert_intermediate_size"))
                    rep += hidden  # shared_expert_gate [1, H]
            else:
                split += 3 * hidden * int(_get(cfg, "intermediate_size"))
            tp_split.append(split)
            replicated.append(rep)
            experts.append(exp)
    elif "MixtralForCausalLM" in archs:
        attn_split, attn_rep = _attention_gqa(cfg, qkv_bias=False, qk_norm=False)
        num_experts = int(_get(cfg, "num_local_experts"))
        inter = int(_get(cfg, "intermediate_size"))
        for _ in range(int(_get(cfg, "num_hidden_layers"))):
            tp_split.append(attn_split)
            replicated.append(attn_rep + 2 * hidden + num_experts * hidden)
            experts.append(num_experts * 3 * hidden * inter)
    elif "DeepseekV3ForCausalLM" in archs:
        tp_split, replicated, experts = _deepseek_v3_layers(cfg)
    else:
        raise ValueError(
            f"architectures={archs}: no parameter formula (known: Qwen3MoeForCausalLM, "
            "Qwen2MoeForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM)"
        )
    embedding = vocab_size * hidden
    return ParameterCount(
        vocab=embedding * (1 if tied else 2),
        final_norm=hidden,
        per_layer_tp=tuple(tp_split),
        per_layer_replicated=tuple(replicated),
        per_layer_experts=tuple(experts),
        embedding=embedding,
    )


def _deepseek_v3_layers(cfg: Mapping[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """DeepSeek-V3: MLA attention, ``first_k_dense_replace`` dense layers, then MoE layers with
    shared experts. The router's score-correction bias is a buffer, not a parameter (in
    transformers and megatron-core alike); multi-token-prediction layers are not counted
    (transformers does not build them)."""
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    q_lora = cfg.get("q_lora_rank")
    kv_lora = int(_get(cfg, "kv_lora_rank"))
    nope, rope = int(_get(cfg, "qk_nope_head_dim")), int(_get(cfg, "qk_rope_head_dim"))
    v_dim = int(_get(cfg, "v_head_dim"))
    q_dim = heads * (nope + rope)
    if q_lora:
        q_split, q_rep = hidden * int(q_lora) + int(q_lora) * q_dim, int(q_lora)
    else:
        q_split, q_rep = hidden * q_dim, 0
    attn_split = (
        q_split
        + hidden * (kv_lora + rope)
        + kv_lora * heads * (nope + v_dim)
        + heads * v_dim * hidden
    )
    attn_rep = q_rep + kv_lora
    num_experts = int(_get(cfg, "n_routed_experts"))
    moe_inter = int(_get(cfg, "moe_intermediate_size"))
    shared = int(cfg.get("n_shared_experts") or 0)
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    split, rep, exp = [], [], []
    for i in range(int(_get(cfg, "num_hidden_layers"))):
        if i < first_dense:
            split.append(attn_split + 3 * hidden * int(_get(cfg, "intermediate_size")))
            rep.append(attn_rep + 2 * hidden)
            exp.append(0)
        else:
            split.append(attn_split + shared * 3 * hidden * moe_inter)
            rep.append(attn_rep + 2 * hidden + num_experts * hidden)
            exp.append(num_experts * 3 * hidden * moe_inter)
    return split, rep, exp


@dataclass(frozen=True)
class MemoryEstimate:
    """Static memory of the heaviest trainer rank and of one rollout server's weights.

    Attributes:
        params_per_rank: parameters held by the heaviest trainer rank (max over PP stages).
        param_bytes, grad_bytes, optimizer_bytes: that rank's parameter, gradient and optimizer
            state (main parameters + Adam moments) bytes.
        server_weight_bytes_per_gpu: bf16 weights of one rollout server per device
            (total / server TP).
    """

    params_per_rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    server_weight_bytes_per_gpu: int

    @property
    def trainer_bytes(self) -> int:
        """Parameters + gradients + optimizer states of the heaviest trainer rank, bytes."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def estimate_memory(
    count: ParameterCount,
    *,
    tp: int,
    pp: int,
    ep: int,
    etp: int,
    layout: OptimizerLayout,
    dense_shards: int,
    expert_shards: int,
    server_tp: int,
) -> MemoryEstimate:
    """Static bytes per device for ``count`` under the given parallel sizes and the trainer's
    optimizer ``layout`` (``training.optimizer_layout.resolve_optimizer_layout``);
    ``dense_shards`` = DP x CP and ``expert_shards`` = expert DP (the distributed optimizer's
    shard counts).

    Raises:
        ValueError: when the layer count is not divisible by ``pp`` (naming the parallel field).
    """
    num_layers = len(count.per_layer_tp)
    if num_layers % pp:
        raise ValueError(
            f"parallel.pipeline_model_parallel_size={pp} does not divide the {num_layers} layers"
        )
    per_stage = num_layers // pp
    stages = []  # (dense parameters, expert parameters) per stage
    for stage in range(pp):
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        dense = sum(count.per_layer_tp[i] // tp + count.per_layer_replicated[i] for i in layers)
        experts = sum(count.per_layer_experts[i] // (ep * etp) for i in layers)
        tied = count.vocab == count.embedding
        if stage == 0:
            dense += count.embedding // tp
        if stage == pp - 1:
            dense += count.final_norm
            if not tied:
                dense += (count.vocab - count.embedding) // tp
            elif pp > 1:  # megatron keeps a copy of tied weights on the last stage
                dense += count.embedding // tp
        stages.append((dense, experts))
    dense, experts = max(stages, key=sum)
    pd, gd, od = bytes_per_param(layout, dense_shards)
    pe, ge, oe = bytes_per_param(layout, expert_shards)
    return MemoryEstimate(
        params_per_rank=dense + experts,
        param_bytes=int(dense * pd + experts * pe),
        grad_bytes=int(dense * gd + experts * ge),
        optimizer_bytes=int(dense * od + experts * oe),
        server_weight_bytes_per_gpu=count.total * 2 // server_tp,
    )
