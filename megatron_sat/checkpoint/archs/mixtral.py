"""Mixtral (``MixtralForCausalLM``): GQA, softmax router ``block_sparse_moe.gate``, experts
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down) on disk; transformers
names the block ``mlp`` in memory."""

from megatron_sat.checkpoint.archs.spec import (
    ArchMap,
    embedding_rules,
    gqa_attention_rules,
    layer_norm_rules,
    routed_expert_rules,
    router_rule,
)

MAP = ArchMap(
    architecture="MixtralForCausalLM",
    rules=(
        *embedding_rules(),
        *layer_norm_rules(),
        *gqa_attention_rules(),
        router_rule("block_sparse_moe.gate.weight"),
        *routed_expert_rules(
            "model.layers.{l}.block_sparse_moe.experts.{e}.",
            names=("w1.weight", "w3.weight", "w2.weight"),
        ),
    ),
    memory_renames=((".mlp.", ".block_sparse_moe."),),
)
