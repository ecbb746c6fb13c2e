"""DeepSeek-V3 on megatron-core: HF ``config.json`` -> ``MLATransformerConfig``.

DeepSeek-V3 (transformers ``DeepseekV3ForCausalLM``): multi-latent attention (MLA: optional
low-rank query ``q_a_proj -> q_a_layernorm -> q_b_proj``, compressed key/value
``kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj``, decoupled RoPE on ``qk_rope_head_dim``
interleaved dimensions), ``first_k_dense_replace`` dense SwiGLU layers of width
``intermediate_size``, then MoE layers: a sigmoid router computed in fp32 with a per-expert
selection bias (``e_score_correction_bias``, megatron-core's ``expert_bias``, kept in fp32),
group-limited top-k (``n_group``, ``topk_group``), re-normalised top-k weights scaled by
``routed_scaling_factor``, and ``n_shared_experts`` shared experts fused into one SwiGLU MLP of
width ``n_shared_experts * moe_intermediate_size`` (no gate).

Multi-token-prediction layers (``num_nextn_predict_layers``) are not built: the checkpoint map
rejects their tensors by name.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from megatron_sat.models.registry import (
    ModelLayout,
    common_transformer_kwargs,
    hf_rope_theta,
    moe_layer_freq,
    require,
)

ARCHITECTURE = "DeepseekV3ForCausalLM"


def moe_layer_pattern(hf_config: Mapping[str, Any]) -> list[int]:
    """1 for each MoE decoder layer, 0 for the first ``first_k_dense_replace`` dense ones."""
    num_layers = int(require(hf_config, "num_hidden_layers"))
    first_dense = int(hf_config.get("first_k_dense_replace") or 0)
    return [int(i >= first_dense) for i in range(num_layers)]


def transformer_config(hf_config: Mapping[str, Any], layout: ModelLayout, **overrides: Any):
    """megatron-core ``MLATransformerConfig`` of a DeepSeek-V3 ``config.json``.

    Called by :func:`megatron_sat.models.registry.transformer_config_from_hf`.

    Raises:
        ValueError: for another architecture; ``rope_interleave=false`` (megatron-core's MLA
            always de-interleaves); ``num_key_value_heads != num_attention_heads``;
            ``norm_topk_prob=false`` with top-k > 1 (megatron-core always re-normalises sigmoid
            top-k weights); group-limited routing whose per-group score is not the top-2 sum
            transformers uses (megatron-core sums the top ``topk // topk_group``); scaled RoPE;
            attention biases; a missing field (named).
    """
    from megatron.core.transformer import MLATransformerConfig

    if ARCHITECTURE not in (hf_config.get("architectures") or []):
        raise ValueError(f"architectures={hf_config.get('architectures')}: not {ARCHITECTURE}")
    if not hf_config.get("rope_interleave", True):
        raise ValueError("rope_interleave=false is not supported (megatron-core MLA interleaves)")
    heads = int(require(hf_config, "num_attention_heads"))
    if int(hf_config.get("num_key_value_heads") or heads) != heads:
        raise ValueError("num_key_value_heads must equal num_attention_heads for MLA")
    if hf_config.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported")
    topk = int(require(hf_config, "num_experts_per_tok"))
    if topk > 1 and not hf_config.get("norm_topk_prob", True):
        raise ValueError("norm_topk_prob=false with num_experts_per_tok > 1 is not supported")
    n_group = int(hf_config.get("n_group") or 1)
    topk_group = int(hf_config.get("topk_group") or 1)
    if n_group > 1 and topk // topk_group != 2:
        raise ValueError(
            f"group-limited routing needs num_experts_per_tok // topk_group == 2 "
            f"(got {topk} // {topk_group})"
        )
    pattern = moe_layer_pattern(hf_config)
    kwargs = common_transformer_kwargs(hf_config, layout)
    moe_width = int(require(hf_config, "moe_intermediate_size"))
    num_shared = int(hf_config.get("n_shared_experts") or 0)
    q_lora_rank = hf_config.get("q_lora_rank")
    kwargs.update(
        multi_latent_attention=True,
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        kv_lora_rank=int(require(hf_config, "kv_lora_rank")),
        qk_head_dim=int(require(hf_config, "qk_nope_head_dim")),
        qk_pos_emb_head_dim=int(require(hf_config, "qk_rope_head_dim")),
        v_head_dim=int(require(hf_config, "v_head_dim")),
        num_query_groups=heads,
        rope_type="rope",
        rotary_base=hf_rope_theta(hf_config),
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
        qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm
        ffn_hidden_size=int(require(hf_config, "intermediate_size")),
        num_moe_experts=int(require(hf_config, "n_routed_experts")),
        moe_layer_freq=moe_layer_freq(pattern),
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_width,
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32",
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=topk_group if n_group > 1 else None,
        moe_router_topk_scaling_factor=float(hf_config.get("routed_scaling_factor") or 1.0),
        moe_shared_expert_intermediate_size=moe_width * num_shared if num_shared else None,
        moe_shared_expert_gate=False,
        add_qkv_bias=False,
    )
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


@functools.cache
def _mla_core_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """megatron-core's local ``DotProductAttention`` for MLA: query/key heads of
        ``k_channels`` and value heads of ``v_channels`` (the local class takes neither and
        sizes its output by ``kv_channels``; MLA passes both, so the local spec cannot build
        MLA without this). The computation is the parent's; only the output width changes to
        ``num_heads_per_partition * v_channels``. (megatron-core's base ``Attention`` first
        builds a core attention without either; MLA then rebuilds it with both.)
        """

        def __init__(
            self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs
        ) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
            self.k_channels, self.v_channels = k_channels, v_channels

    return MLADotProductAttention


def mla_local_spec(block_spec, use_transformer_engine: bool):
    """Give every layer of a local-spec MLA block the MLA-capable core attention (no-op for the
    transformer-engine spec, whose ``TEDotProductAttention`` takes ``k_channels``)."""
    import dataclasses

    if use_transformer_engine:
        return block_spec
    core = _mla_core_attention_class()
    for spec in block_spec.layer_specs:
        attention = spec.submodules.self_attention
        attention.submodules = dataclasses.replace(attention.submodules, core_attention=core)
    return block_spec


def build_gpt_model(hf_config: Mapping[str, Any], config, **kwargs: Any):
    """This rank's ``GPTModel`` for DeepSeek-V3 (generic builder + :func:`mla_local_spec`)."""
    from megatron_sat.models.registry import build_generic_gpt_model

    return build_generic_gpt_model(hf_config, config, spec_hook=mla_local_spec, **kwargs)
