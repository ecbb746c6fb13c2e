"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-latent attention, first-k dense layers,
sigmoid router with ``e_score_correction_bias`` (megatron-core's fp32 ``expert_bias`` buffer),
routed SwiGLU experts, shared experts (``mlp.shared_experts``, no gate).

MLA renames (megatron-core ``self_attention.`` <- HF ``self_attn.``): ``linear_q_down_proj`` <-
``q_a_proj``, ``q_layernorm`` <- ``q_a_layernorm``, ``linear_q_up_proj`` <- ``q_b_proj``
(``linear_q_proj`` <- ``q_proj`` without a query LoRA), ``linear_kv_down_proj`` <-
``kv_a_proj_with_mqa`` ([kv_lora_rank + rope dim, H], same row order), ``kv_layernorm`` <-
``kv_a_layernorm``, ``linear_kv_up_proj`` <- ``kv_b_proj`` (per head [k_nope; v], same order),
``linear_proj`` <- ``o_proj``. RoPE rows stay interleaved as on disk: megatron-core's MLA
de-interleaves them at run time as transformers does with ``rope_interleave=true``.
"""

from megatron_sat.checkpoint.archs.spec import (
    HF_LAYER,
    LAYER,
    ArchMap,
    Rule,
    dense_mlp_rules,
    embedding_rules,
    layer_norm_rules,
    routed_expert_rules,
    router_rule,
    swiglu_rules,
)

_MLA = {
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_q_proj.weight": "q_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight",
}

MAP = ArchMap(
    architecture="DeepseekV3ForCausalLM",
    rules=(
        *embedding_rules(),
        *layer_norm_rules(),
        *(
            Rule(LAYER + "self_attention." + m, (HF_LAYER + "self_attn." + h,))
            for m, h in _MLA.items()
        ),
        router_rule(),
        Rule(LAYER + "mlp.router.expert_bias", (HF_LAYER + "mlp.gate.e_score_correction_bias",)),
        *routed_expert_rules("model.layers.{l}.mlp.experts.{e}."),
        *swiglu_rules(LAYER + "mlp.shared_experts.", HF_LAYER + "mlp.shared_experts."),
        *dense_mlp_rules(),
    ),
)
