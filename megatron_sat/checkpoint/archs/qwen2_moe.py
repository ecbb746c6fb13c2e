"""Qwen2-MoE (``Qwen2MoeForCausalLM``): GQA with q/k/v biases, softmax router, routed SwiGLU
experts, one shared expert (``mlp.shared_expert``) scaled by ``sigmoid(mlp.shared_expert_gate)``
(megatron-core ``shared_experts.gate_weight`` [1, H]), dense layers."""

from megatron_sat.checkpoint.archs.spec import (
    HF_LAYER,
    LAYER,
    ArchMap,
    Rule,
    dense_mlp_rules,
    embedding_rules,
    gqa_attention_rules,
    layer_norm_rules,
    routed_expert_rules,
    router_rule,
    swiglu_rules,
)

MAP = ArchMap(
    architecture="Qwen2MoeForCausalLM",
    rules=(
        *embedding_rules(),
        *layer_norm_rules(),
        *gqa_attention_rules(qkv_bias=True),
        router_rule(),
        *routed_expert_rules("model.layers.{l}.mlp.experts.{e}."),
        *swiglu_rules(LAYER + "mlp.shared_experts.", HF_LAYER + "mlp.shared_expert."),
        Rule(
            LAYER + "mlp.shared_experts.gate_weight", (HF_LAYER + "mlp.shared_expert_gate.weight",)
        ),
        *dense_mlp_rules(),
    ),
)
