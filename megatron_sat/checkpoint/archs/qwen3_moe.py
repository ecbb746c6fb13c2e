"""Qwen3-MoE (``Qwen3MoeForCausalLM``): GQA with per-head q/k RMSNorm, softmax router, routed
SwiGLU experts, optional dense layers (``mlp_only_layers``)."""

from megatron_sat.checkpoint.archs.spec import (
    ArchMap,
    dense_mlp_rules,
    embedding_rules,
    gqa_attention_rules,
    layer_norm_rules,
    routed_expert_rules,
    router_rule,
)

MAP = ArchMap(
    architecture="Qwen3MoeForCausalLM",
    rules=(
        *embedding_rules(),
        *layer_norm_rules(),
        *gqa_attention_rules(qk_norm=True),
        router_rule(),
        *routed_expert_rules("model.layers.{l}.mlp.experts.{e}."),
        *dense_mlp_rules(),
    ),
)
