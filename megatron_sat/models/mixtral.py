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

import torch

from megatron_sat.models.registry import common_transformer_kwargs, require

ARCHITECTURE = "MixtralForCausalLM"


def transformer_config_from_hf(
    hf_config: Mapping[str, Any],
    *,
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    moe_token_dispatcher_type: str = "alltoall",
    moe_enable_routing_replay: bool = True,
    recompute_granularity: str | None = None,
    expert_tensor_parallel_size: int | None = None,
    **overrides: Any,
):
    """megatron-core ``TransformerConfig`` of a Mixtral ``config.json``.

    Arguments as :func:`megatron_sat.models.qwen3_moe.transformer_config_from_hf`.

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
    kwargs = common_transformer_kwargs(
        hf_config,
        tensor_model_parallel_size=tensor_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        params_dtype=params_dtype,
        moe_token_dispatcher_type=moe_token_dispatcher_type,
        moe_enable_routing_replay=moe_enable_routing_replay,
        recompute_granularity=recompute_granularity,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
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
