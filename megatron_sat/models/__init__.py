"""Model providers: Hugging Face config -> megatron-core TransformerConfig, layer spec, GPTModel."""

from megatron_sat.models.qwen3_moe import (
    build_gpt_model,
    hf_rope_theta,
    transformer_config_from_hf,
)

__all__ = ["build_gpt_model", "hf_rope_theta", "transformer_config_from_hf"]
