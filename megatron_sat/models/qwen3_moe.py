"""Qwen3-MoE on megatron-core: HF ``config.json`` -> ``TransformerConfig``.

Qwen3-MoE (transformers ``Qwen3MoeForCausalLM``): GQA attention with RMSNorm on q and k per
head, RoPE, SwiGLU experts, a softmax top-k router with optional re-normalisation of the top-k
probabilities (``norm_topk_prob``), no shared experts, no biases. ``norm_topk_prob=True`` is
megatron-core's ``moe_router_pre_softmax=False`` (softmax over the top-k logits is the
re-normalised top-k of the full softmax); ``False`` is ``pre_softmax=True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_sat.models.registry import ModelLayout, common_transformer_kwargs, moe_layer_freq

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def num_experts_of(hf_config: Mapping[str, Any]) -> int:
    """Routed-expert count: ``num_experts`` (transformers 4) or ``num_local_experts`` (5)."""
    for key in ("num_experts", "num_local_experts"):
        if hf_config.get(key):
            return int(hf_config[key])
    raise ValueError("config.json has neither num_experts nor num_local_experts")


def moe_layer_pattern(hf_config: Mapping[str, Any]) -> list[int]:
    """1 for each decoder layer that is MoE, 0 for a dense one (Qwen3-MoE's rule).

    transformers' ``Qwen3MoeDecoderLayer``: layer i is sparse iff ``i not in mlp_only_layers``
    and ``(i + 1) % decoder_sparse_step == 0`` (and the model has experts). First-k-dense
    layouts (DeepSeek-V3's ``first_k_dense_replace``) are ``mlp_only_layers = [0, .., k-1]``.

    Raises:
        ValueError: for ``decoder_sparse_step`` < 1 or an ``mlp_only_layers`` index outside
            [0, num_hidden_layers).
    """
    num_layers = int(hf_config["num_hidden_layers"])
    step = int(hf_config.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"config.json decoder_sparse_step={step}: must be >= 1")
    dense = set(hf_config.get("mlp_only_layers") or [])
    outside = sorted(i for i in dense if not 0 <= int(i) < num_layers)
    if outside:
        raise ValueError(
            f"config.json mlp_only_layers {outside} outside [0, num_hidden_layers={num_layers})"
        )
    return [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]


def transformer_config(hf_config: Mapping[str, Any], layout: ModelLayout, **overrides: Any):
    """megatron-core ``TransformerConfig`` of a Qwen3-MoE ``config.json`` on ``layout``.

    Called by :func:`megatron_sat.models.registry.transformer_config_from_hf`; ``overrides``
    are further ``TransformerConfig`` fields, applied last.

    Dense layers (``mlp_only_layers``, ``decoder_sparse_step``; :func:`moe_layer_pattern`)
    become megatron-core's ``moe_layer_freq`` list, with ``intermediate_size`` as their FFN
    width; every layer keeps its global ``layer_number``, which is what R3 keys routes by.

    Raises:
        ValueError: for an architecture other than Qwen3-MoE, no MoE layer at all, dense
            layers without ``intermediate_size``, a bad layer pattern, or scaled RoPE.
    """
    from megatron.core.transformer import TransformerConfig

    archs = hf_config.get("architectures") or []
    if not set(archs) & set(SUPPORTED_ARCHITECTURES):
        raise ValueError(f"architectures={archs}: supported are {SUPPORTED_ARCHITECTURES}")
    pattern = moe_layer_pattern(hf_config)
    if not any(pattern):
        raise ValueError("config.json has no MoE layer (mlp_only_layers / decoder_sparse_step)")
    if not all(pattern) and not hf_config.get("intermediate_size"):
        raise ValueError("config.json has dense layers but no intermediate_size for them")
    kwargs = common_transformer_kwargs(hf_config, layout)
    num_heads = int(hf_config["num_attention_heads"])
    kwargs.update(
        num_query_groups=int(hf_config.get("num_key_value_heads", num_heads)),
        kv_channels=int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // num_heads),
        ffn_hidden_size=int(
            hf_config.get("intermediate_size") or hf_config["moe_intermediate_size"]
        ),
        num_moe_experts=num_experts_of(hf_config),
        moe_router_topk=int(hf_config["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf_config["moe_intermediate_size"]),
        moe_router_pre_softmax=not bool(hf_config.get("norm_topk_prob", True)),
        moe_router_score_function="softmax",
        qk_layernorm=True,
        add_qkv_bias=bool(hf_config.get("attention_bias", False)),
        moe_layer_freq=moe_layer_freq(pattern),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
