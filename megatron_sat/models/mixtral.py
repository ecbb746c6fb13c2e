"""Mixtral on megatron-core: HF ``config.json`` -> ``TransformerConfig``.

Mixtral (transformers ``MixtralForCausalLM``): GQA attention without q/k norms or biases, RoPE,
SwiGLU experts of width ``intermediate_size`` (``w1`` gate, ``w3`` up, ``w2`` down), a softmax
top-k router whose top-k probabilities are re-normalised (megatron-core's
``moe_router_pre_softmax=False``: softmax over the top-k logits), no shared experts, no dense
layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_sat.models.registry import (
    ModelLayout,
    common_transformer_kwargs,
    require,
)

ARCHITECTURE = "MixtralForCausalLM"


def transformer_config(hf_config: Mapping[str, Any], layout: ModelLayout, **overrides: Any):
    """megatron-core ``TransformerConfig`` of a Mixtral ``config.json``.

    Called by :func:`megatron_sat.models.registry.transformer_config_from_hf`.

    Raises:
        ValueError: for another architecture, a sliding window (not mapped), router jitter
            noise (megatron-core jitters the router input only, transformers the expert input
            too), or a missing field (named).
    """
    from megatron.core.transformer import TransformerConfig

    if ARCHITECTURE not in (hf_config.get("architectures") or []):
        raise ValueError(f"architectures={hf_config.get('architectures')}: not {ARCHITECTURE}")
    if hf_config.get("sliding_window") is not None:
        raise ValueError(f"sliding_window={hf_config['sliding_window']} is not supported")
    if float(hf_config.get("router_jitter_noise") or 0.0) != 0.0:
        raise ValueError("router_jitter_noise != 0 is not supported")
    kwargs = common_transformer_kwargs(hf_config, layout)
    num_heads = int(hf_config["num_attention_heads"])
    width = int(require(hf_config, "intermediate_size"))
    kwargs.update(
        num_query_groups=int(hf_config.get("num_key_value_heads") or num_heads),
        kv_channels=int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // num_heads),
        ffn_hidden_size=width,
        num_moe_experts=int(require(hf_config, "num_local_experts")),
        moe_router_topk=int(require(hf_config, "num_experts_per_tok")),
        moe_ffn_hidden_size=width,
        moe_router_pre_softmax=False,
        moe_router_score_function="softmax",
        qk_layernorm=False,
        add_qkv_bias=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
