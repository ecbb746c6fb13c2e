"""Model configs checked before step 1 (``config.layout.model_config_errors``, run by
``check_train_layout`` and the launch plan): each error names the config.json field and value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_sat.config import load_config
from megatron_sat.config.layout import check_train_layout, model_config_errors

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples/models").glob("*.json"))
QWEN3 = dict(
    architectures=["Qwen3MoeForCausalLM"],
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=128,
)
MIXTRAL = dict(
    architectures=["MixtralForCausalLM"],
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=128,
)
DEEPSEEK = dict(
    architectures=["DeepseekV3ForCausalLM"],
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    vocab_size=128,
)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_shipped_model_configs_pass(path):
    hf = json.loads(path.read_text())
    assert model_config_errors({"vocab_size": 151936, **hf}) == []  # a template has none


@pytest.mark.parametrize("hf", [QWEN3, MIXTRAL, DEEPSEEK], ids=["qwen3", "mixtral", "dsv3"])
def test_small_configs_pass(hf):
    assert model_config_errors(hf) == []


@pytest.mark.parametrize(
    ("base", "change", "message"),
    [
        (QWEN3, {"num_experts_per_tok": 9},
         "config.json num_experts_per_tok=9: more than the 8 experts (num_experts)"),
        (MIXTRAL, {"num_experts_per_tok": 5},
         "config.json num_experts_per_tok=5: more than the 4 experts (num_local_experts)"),
        (DEEPSEEK, {"num_experts_per_tok": 9},
         "config.json num_experts_per_tok=9: more than the 8 experts (n_routed_experts)"),
        (QWEN3, {"num_experts_per_tok": 0},
         "config.json num_experts_per_tok=0: must be a positive integer"),
        (QWEN3, {"num_experts_per_tok": None},
         "config.json num_experts=8 without num_experts_per_tok (top-k)"),
        (QWEN3, {"num_key_value_heads": 3},
         "config.json num_key_value_heads=3 does not divide num_attention_heads=4"),
        (DEEPSEEK, {"num_key_value_heads": 2},
         "config.json num_key_value_heads=2: must equal num_attention_heads=4"),
        (MIXTRAL, {"hidden_size": 66},
         "config.json hidden_size=66 is not divisible by num_attention_heads=4 and there is no "
         "head_dim"),
        (QWEN3, {"hidden_size": -64}, "config.json hidden_size=-64: must be a positive integer"),
        (QWEN3, {"moe_intermediate_size": 3.5},
         "config.json moe_intermediate_size=3.5: must be a positive integer"),
        (QWEN3, {"vocab_size": None}, "config.json has no vocab_size (required)"),
        (QWEN3, {"mlp_only_layers": [0, 4]},
         "config.json mlp_only_layers=[0, 4]: [4] outside [0, num_hidden_layers=4)"),
        (DEEPSEEK, {"first_k_dense_replace": 4},
         "config.json first_k_dense_replace=4: must be an integer in [0, num_hidden_layers=3]"),
        (DEEPSEEK, {"n_group": 3}, "config.json n_group=3 does not divide n_routed_experts=8"),
        (DEEPSEEK, {"topk_group": 5}, "config.json topk_group=5: more than n_group=4"),
        (DEEPSEEK, {"topk_group": 1, "num_experts_per_tok": 3},
         "config.json num_experts_per_tok=3: more than the 1 groups (topk_group) x 2 experts"),
    ],
)  # fmt: skip
def test_bad_model_config_is_named(base, change, message):
    hf = {k: v for k, v in {**base, **change}.items() if v is not None}
    errors = model_config_errors(hf)
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_bad_top_k_refused_by_the_train_check_before_anything_is_built():
    """The issue's repro: top-k 9 of 8 experts passed every check and ended after three
    server restarts with "no live rollout server left"."""
    cfg = load_config(None, [])
    with pytest.raises(ValueError, match=r"(?s)invalid training layout:.*num_experts_per_tok=9"):
        check_train_layout(cfg, 1, dict(QWEN3, num_experts_per_tok=9))
    check_train_layout(cfg, 1, QWEN3)
