"""Model providers: Hugging Face config -> megatron-core TransformerConfig, layer spec, GPTModel.

The HF ``architectures`` name selects the family (:mod:`megatron_sat.models.registry`):
Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V3.
"""

from megatron_sat.models.registry import (
    ARCHITECTURES,
    architecture_of,
    build_gpt_model,
    hf_rope_theta,
    transformer_config_from_hf,
)

__all__ = [
    "ARCHITECTURES",
    "architecture_of",
    "build_gpt_model",
    "hf_rope_theta",
    "transformer_config_from_hf",
]
