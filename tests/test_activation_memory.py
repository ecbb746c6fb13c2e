"""launch.activation_memory against hand counts at a small shape: every term written out as
the tensors megatron-core keeps (the bench measures the same "local" figures with saved-tensor
hooks: bench/trainer_memory.py), the TP / SP / EP / CP division, the recompute granularities,
and the token-budget search of launch.step_memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_sat.launch.activation_memory import (
    ActivationLayout,
    ModelDims,
    attention_terms,
    decoder_activations,
    layer_bytes,
    mlp_terms,
    output_activations,
)
from megatron_sat.launch.step_memory import largest_fitting_budget

# h 128, 4 heads, 2 query groups, head 32, 8 experts, top-2, expert width 64, vocab 512.
DIMS = ModelDims(
    hidden=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    qk_layernorm=True,
    vocab=512,
    moe_layers=(True, True),
    dense_ffn=0,
    moe_ffn=64,
    num_experts=8,
    top_k=2,
)
ONE = ActivationLayout()
SMALL = dict(tokens=128, seq_len=64)  # 2 rows of 64


def test_local_attention_none_by_hand():
    t = attention_terms(DIMS, ONE, kernels="local", granularity="none", **SMALL)
    assert t == {
        "input_norm_fp32_in_out": 128 * (2 * 128 * 4 + 4),  # fp32 input, fp32 output, rstd
        "qkv_input": 128 * 128 * 2,  # the bf16 norm output
        "qk_norm_fp32_in_out": 128 * 6 * (2 * 32 * 4 + 4),  # 4 q + 2 k heads, per head
        "rope_cos_sin": 4 * 64 * 32 * 2,  # cos, sin for q and k: [s, 1, 1, d] bf16
        "core_attention_qkv": 3 * 128 * 4 * 32 * 2,  # q, expanded k, expanded v
        "core_attention_scores": 2 * 4 * 64 * 64 * (4 + 2),  # fp32 softmax + bf16 probs
        "proj_input": 128 * 4 * 32 * 2,
    }
    assert sum(t.values()) == 708_096


def test_local_attention_selective_keeps_only_core_attention_inputs():
    t = attention_terms(DIMS, ONE, kernels="local", granularity="selective", **SMALL)
    assert "core_attention_scores" not in t
    # q and k after RoPE, and v: a view of the QKV output [s, b, (4 + 2 x 2) x 32] (its storage)
    assert t["core_attention_inputs"] == 128 * 6 * 32 * 2 + 128 * 8 * 32 * 2
    assert sum(t.values()) == 708_096 - 98_304 - 196_608 + 114_688


def test_local_moe_by_hand():
    t = mlp_terms(DIMS, ONE, kernels="local", moe=True, **SMALL)
    routed = 128 * 2
    assert t == {
        "pre_mlp_norm_fp32_in_out": 128 * (2 * 128 * 4 + 4),
        "norm_output": 128 * 128 * 2,  # the router's input, also the dispatcher's
        "router_scores_fp32": 128 * (8 * 4 + 2 * (4 + 8)),  # scores, top-k probs, indices
        "dispatch_indices": routed * 5 * 8,
        "expert_inputs": routed * (128 * 2 + 4),  # permuted tokens, their probabilities
        # fc1 output (4f), silu (2f), offset copy (2f), product (2f), weighted product (2f)
        "expert_swiglu": routed * 64 * 12,
    }
    assert sum(t.values()) == 444_928


def test_decoder_by_granularity_by_hand():
    none = decoder_activations(
        DIMS, ONE, layers=range(2), kernels="local", granularity="none", **SMALL
    )
    assert none.per_layer == (708_096 + 444_928,) * 2
    assert none.saved_bytes == 2 * 1_153_024 + 64 * 64  # + the bool causal mask, once
    assert none.recompute_bytes == 0
    full = decoder_activations(
        DIMS, ONE, layers=range(2), kernels="local", granularity="full", **SMALL
    )
    # Each layer's bf16 input, plus the float32 RoPE frequencies [s, d] once; during the
    # backward one layer is rebuilt.
    assert full.saved_bytes == 2 * 128 * 128 * 2 + 64 * 32 * 4
    assert full.recompute_bytes == 1_153_024
    two = decoder_activations(
        DIMS,
        ONE,
        layers=range(2),
        kernels="local",
        granularity="full",
        recompute_num_layers=2,
        **SMALL,
    )
    assert two.saved_bytes == 128 * 128 * 2 + 64 * 32 * 4
    assert two.recompute_bytes == 2 * 1_153_024


def test_transformer_engine_and_parallel_division_by_hand():
    # TP 2 with SP, EP 2, CP 2: 128 tokens -> 64 per CP rank, 32 after SP; heads 2 and 1.
    layout = ActivationLayout(tp=2, cp=2, ep=2, sequence_parallel=True)
    a = attention_terms(DIMS, layout, kernels="transformer_engine", granularity="none", **SMALL)
    assert a == {
        "input_norm_qkv": 32 * (2 * 128 * 2 + 4),  # bf16 input + bf16 ln_out + rstd
        "qkv_output": 64 * (2 + 2) * 32 * 2,
        "qk_norm": 64 * (2 * 32 * 2 + 3 * 4),  # the q copy + rstd per head
        "rope_q_k": 64 * 3 * 32 * 2,
        "flash_output": 64 * 2 * 32 * 2,
        "flash_softmax_lse": 64 * 2 * 4,
    }
    m = mlp_terms(DIMS, layout, kernels="transformer_engine", moe=True, **SMALL)
    routed = 32 * 2  # the rank's 32 tokens x top-2 expert rows (balanced over EP)
    assert m == {
        "pre_mlp_norm": 32 * (2 * 128 * 2 + 4),
        "router_scores_fp32": 32 * (8 * 4 + 2 * 12),
        "dispatch_indices": routed * 40,
        "expert_inputs": routed * (128 * 2 + 4),
        "expert_swiglu": routed * 64 * 6,  # fused SwiGLU input (4f) + fc2 input (2f)
    }
    sel = attention_terms(
        DIMS, layout, kernels="transformer_engine", granularity="selective", **SMALL
    )
    assert sum(a.values()) - sum(sel.values()) == 64 * 2 * 4  # flash keeps little to drop


def test_dense_layer_and_qwen3_30b_dims():
    dense = ModelDims(**{**DIMS.__dict__, "moe_layers": (False,), "dense_ffn": 256})
    t = mlp_terms(dense, ONE, kernels="local", moe=False, **SMALL)
    assert t["dense_swiglu"] == 128 * 256 * 10  # fc1 out 4F, silu, offset copy, product
    hf = json.loads(
        (Path(__file__).resolve().parents[1] / "examples/models/qwen3_30b_a3b.json").read_text()
    )
    dims = ModelDims.from_hf(hf)
    assert (dims.hidden, dims.num_heads, dims.num_kv_heads, dims.head_dim) == (2048, 32, 4, 128)
    assert (dims.num_experts, dims.top_k, dims.moe_ffn, len(dims.moe_layers)) == (128, 8, 768, 48)
    layout = ActivationLayout(tp=4, ep=4, sequence_parallel=True)
    kw = dict(tokens=32768, seq_len=8704, kernels="transformer_engine")
    # attention: 8192 x 8196 + 32768 x (2560 + 2084 + 2304 + 2048 + 32)
    # MoE: 8192 x 8196 + 8192 x 608 + 65536 x (40 + 4100 + 4608)
    attention = 8192 * 8196 + 32768 * (2560 + 2084 + 2304 + 2048 + 32)
    moe = 8192 * 8196 + 8192 * 608 + 65536 * (40 + 4100 + 4608)
    assert attention + moe == 1_008_402_432
    assert layer_bytes(dims, layout, layer=0, granularity="none", **kw) == 1_008_402_432
    out = output_activations(dims, layout, **kw)
    assert out.transient_bytes == 32768 * 37984 * 2
    assert out.saved_bytes == 32768 * 37984 * 4 + 8192 * (4100 + 4096) + 32768 * 17


def test_refusals_name_the_culprit():
    with pytest.raises(ValueError, match="train.recompute_granularity"):
        attention_terms(DIMS, ONE, kernels="local", granularity="partial", **SMALL)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM"):
        ModelDims.from_hf(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "hidden_size": 8,
                "num_attention_heads": 2,
                "vocab_size": 8,
                "num_experts_per_tok": 1,
            }
        )
    with pytest.raises(ValueError, match="ActivationLayout.tp"):
        ActivationLayout(tp=0)


def test_largest_fitting_budget_bisects_over_the_candidates():
    assert largest_fitting_budget(lambda b: b <= 5000, 1500, 9000) == 4096
    assert largest_fitting_budget(lambda b: b <= 1500, 1500, 9000) == 1500
    assert largest_fitting_budget(lambda b: False, 1500, 9000) is None
    assert largest_fitting_budget(lambda b: True, 1500, 9000) == 8192


def _bench():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "trainer_memory.py"
    spec = importlib.util.spec_from_file_location("_bench_trainer_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("granularity", ["none", "selective", "full"])
def test_plan_equals_the_saved_tensor_bytes_of_megatron_core(megatron_world, granularity):
    """The oracle is megatron-core itself: the storages autograd keeps in one R3 training
    forward of shape A of the bench (it fails when an upgrade changes what a layer keeps)."""
    import torch

    from megatron_sat.checkpoint.tiny_models import TINY_CONFIGS
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.training.builders import build_model, build_transformer_config
    from megatron_sat.training.optimizer_layout import resolve_optimizer_layout

    bench = _bench()
    _, overrides, rows, seq = bench.ACTIVATION_SHAPES[0]
    arch = "Qwen3MoeForCausalLM"
    hf = dict(TINY_CONFIGS[arch], architectures=[arch], max_position_embeddings=seq, **overrides)
    train = TrainConfig(params_dtype="bf16", recompute_granularity=granularity)
    layout = resolve_optimizer_layout(train, device_type="cpu", dp=1, edp=1)
    config = build_transformer_config(hf, train, ParallelConfig(), layout)
    model = build_model(hf, config, seed=0, device=torch.device("cpu"), load_from=None)
    model.train()
    decoder, other = bench._measure_saved(model, rows, seq, seed=0)
    dims = ModelDims.from_hf(hf)
    assert dims == DIMS
    kw = dict(tokens=rows * seq, seq_len=seq, kernels="local")
    plan = decoder_activations(DIMS, ONE, layers=range(2), granularity=granularity, **kw)
    # selective: megatron-core's checkpoint also keeps a 4-byte int32 per layer
    assert decoder == plan.saved_bytes + (8 if granularity == "selective" else 0)
    assert other == output_activations(DIMS, ONE, **kw).saved_bytes
