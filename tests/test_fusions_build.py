"""Every importable combination of transformer-engine, apex and grouped_gemm builds the model
path (``tests/stubbed_build.py``: a fresh process per TE x apex state, since megatron-core
decides at import time what they give); the broken ones are refused before
(``tests/test_fusions.py``). Imports nothing of ``platform.fusions``, so that it also runs on
the code before it, where ``test_te_without_apex_builds_the_output_layer`` fails with the crash.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tiny Qwen3-MoE (checkpoint.tiny_models): vocab 64, hidden 32, 2 layers, 4 heads of 8
# (2 KV heads), 4 experts of width 16. Parameters by hand: embedding and output layer 64*32
# each, final norm 32; per layer: 2 norms 2*32, QKV (4*8 + 2*2*8)*32 = 2048, proj 32*32 = 1024,
# q/k norms 2*8, router 4*32 = 128, experts 4 * (2*16*32 + 32*16) = 6144.
TINY_PARAMETERS = 2 * 64 * 32 + 32 + 2 * (2 * 32 + 2048 + 1024 + 16 + 128 + 6144)


def _stubbed_build(te: str, apex: str, grouped_gemm: str = "absent") -> list[dict]:
    proc = subprocess.run(
        [
            sys.executable,
            "tests/stubbed_build.py",
            "--te",
            te,
            "--apex",
            apex,
            "--grouped-gemm",
            grouped_gemm,
        ],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _assert_built(result: dict, te: bool, apex: bool) -> None:
    assert result["outcome"] == "built", result.get("error")
    fields = result["fields"]
    assert fields == {
        "transformer_impl": "transformer_engine" if te else "local",
        "use_cpu_initialization": True,  # the one override: no CUDA memory here
        "gradient_accumulation_fusion": apex,
        "apply_rope_fusion": te,
        "moe_grouped_gemm": te,
        "moe_permute_fusion": te,
        "moe_router_fusion": False,
        "bias_activation_fusion": True,
    }
    assert result["output_layer"] == [64, 32]  # megatron-core's ColumnParallelLinear, built
    assert result["spec"] == (
        {"core_attention": "TEDotProductAttention", "experts": "TEGroupedMLP"}
        if te
        else {"core_attention": "DotProductAttention", "experts": "SequentialMLP"}
    )
    if not te:
        assert result["model_parameters"] == TINY_PARAMETERS
    assert result["grouped_gemm_imported"] is False


def test_te_without_apex_builds_the_output_layer():
    # The crash of issue 20: with TE importable and apex's CUDA extension not, megatron-sat
    # turned gradient_accumulation_fusion on and ColumnParallelLinear raised
    # "fused_weight_gradient_mlp_cuda module is not found". On the commit before
    # platform.fusions this test fails with that RuntimeError.
    (result,) = _stubbed_build("present", "absent")
    _assert_built(result, te=True, apex=False)


@pytest.mark.slow
@pytest.mark.parametrize("te,apex", list(itertools.product(("present", "absent"), repeat=2)))
def test_every_importable_combination_builds(te, apex):
    # Each TE x apex state in its own process, the three grouped_gemm states inside it; the
    # broken states are refused before megatron-core is imported (tests above).
    results = _stubbed_build(te, apex, "present,absent,broken")
    assert [r["grouped_gemm"] for r in results] == ["present", "absent", "broken"]
    for result in results:
        _assert_built(result, te=te == "present", apex=apex == "present")
