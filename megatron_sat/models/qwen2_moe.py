"""Qwen2-MoE on megatron-core: HF ``config.json`` -> ``TransformerConfig``.

Qwen2-MoE (transformers ``Qwen2MoeForCausalLM``): GQA attention with q/k/v biases
(``qkv_bias``), RoPE, a softmax top-k router (top-k probabilities re-normalised only when
``norm_topk_prob``; ``False`` is megatron-core's ``moe_router_pre_softmax=True``), SwiGLU experts
of width ``moe_intermediate_size``, one shared expert of width
``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``
(megatron-core's ``moe_shared_expert_gate``), and dense SwiGLU layers of width
``intermediate_size`` where ``mlp_only_layers`` / ``decoder_sparse_step`` say so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_sat.models.qwen3_moe import moe_layer_pattern
from megatron_sat.models.registry import (
    ModelLayout,
    common_transformer_kwargs,
    moe_layer_freq,
    require,
)

ARCHITECTURE = "Qwen2MoeForCausalLM"


def transformer_config(hf_config: Mapping[str, Any], layout: ModelLayout, **overrides: Any):
    """megatron-core ``TransformerConfig`` of a Qwen2-MoE ``config.json``.

    Called by :func:`megatron_sat.models.registry.transformer_config_from_hf`.

    Raises:
        ValueError: for another architecture, sliding-window attention, no MoE layer at all,
            or a missing field (named).
    """
    from megatron.core.transformer import TransformerConfig

    if ARCHITECTURE not in (hf_config.get("architectures") or []):
        raise ValueError(f"architectures={hf_config.get('architectures')}: not {ARCHITECTURE}")
    if hf_config.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported")
    pattern = moe_layer_pattern(hf_config)
    if not any(pattern) or not int(hf_config.get("num_experts") or 0):
        raise ValueError("config.json has no MoE layer (num_experts / mlp_only_layers)")
    kwargs = common_transformer_kwargs(hf_config, layout)
    num_heads = int(hf_config["num_attention_heads"])
    kwargs.update(
        num_query_groups=int(hf_config.get("num_key_value_heads") or num_heads),
        kv_channels=int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // num_heads),
        ffn_hidden_size=int(require(hf_config, "intermediate_size")),
        num_moe_experts=int(hf_config["num_experts"]),
        moe_layer_freq=moe_layer_freq(pattern),
        moe_router_topk=int(require(hf_config, "num_experts_per_tok")),
        moe_ffn_hidden_size=int(require(hf_config, "moe_intermediate_size")),
        moe_router_pre_softmax=not bool(hf_config.get("norm_topk_prob", False)),
        moe_router_score_function="softmax",
        moe_shared_expert_intermediate_size=int(
            require(hf_config, "shared_expert_intermediate_size")
        ),
        moe_shared_expert_gate=True,
        qk_layernorm=False,
        add_qkv_bias=bool(hf_config.get("qkv_bias", True)),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
