"""Tiny random Hugging Face checkpoints of every supported architecture (tests, smoke runs).

Each config has 2 decoder layers (one dense where the family has dense layers), a vocabulary
of 64, hidden size 32 and 4 or 8 experts, so TP2 / EP2 / PP2 all divide it. Every tensor,
norms and the DeepSeek-V3 expert bias included, is drawn at random so that a wrong mapping of
any one shows up in the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_COMMON: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3MoeForCausalLM": dict(
        _COMMON,
        model_type="qwen3_moe",
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    "MixtralForCausalLM": dict(
        _COMMON,
        model_type="mixtral",
        num_key_value_heads=2,
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    ),
    "Qwen2MoeForCausalLM": dict(
        _COMMON,
        model_type="qwen2_moe",
        num_key_value_heads=2,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[0],
        qkv_bias=True,
        tie_word_embeddings=False,
    ),
    "DeepseekV3ForCausalLM": dict(
        _COMMON,
        model_type="deepseek_v3",
        num_key_value_heads=4,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=6,
        routed_scaling_factor=2.5,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    ),
}


def make_tiny_hf_model(architecture: str, seed: int = 0, **overrides: Any):
    """A randomly initialised tiny transformers model of ``architecture`` (fp32, eval mode).

    Weights ~ N(0, 0.2); 1-D tensors (norms, biases, expert bias) ~ 1 + N(0, 0.1) for norms and
    N(0, 0.1) for biases.

    Raises:
        KeyError: for an architecture without a tiny config.
    """
    import transformers

    cfg = dict(TINY_CONFIGS[architecture], architectures=[architecture], **overrides)
    config_cls = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config_cls).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.dim() > 1:
                tensor.normal_(0.0, 0.2)
            elif name.endswith("norm.weight"):
                tensor.normal_(1.0, 0.1)
            else:
                tensor.normal_(0.0, 0.1)
    return model


def make_tiny_checkpoint(architecture: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Save :func:`make_tiny_hf_model` to ``path`` (``save_pretrained``); returns ``path``."""
    make_tiny_hf_model(architecture, seed, **overrides).save_pretrained(path)
    return Path(path)
