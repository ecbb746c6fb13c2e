"""The launch plan's trainer memory comes from the trainer's own optimizer layout
(training.optimizer_layout): the paper recipe as built and with optimizer offload, a layout
that cannot fit refused naming the fields, and launch.params_dtype checked against train."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sat.config import load_config
from megatron_sat.launch.memory import GIB
from megatron_sat.launch.plan import format_plan, resolve_plan

RECIPE = Path(__file__).resolve().parents[1] / "examples/configs/qwen3_30b_a3b_sat_gspo_r3.yaml"


def test_paper_recipe_memory_as_built_and_offloaded():
    plan = resolve_plan(load_config(RECIPE))
    m, n = plan.memory, plan.memory.params_per_rank
    # TP x EP with DP = expert DP = 1: the distributed optimizer (always with bf16) shards
    # nothing, bf16 + fp32 grads + 12 = 18 B.
    assert plan.optimizer_layout.use_distributed_optimizer
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (2 * n, 4 * n, 12 * n)
    off = plan.memory_offload_toggled
    assert (off.param_bytes, off.grad_bytes, off.optimizer_bytes) == (2 * n, 4 * n, 0)
    text = format_plan(plan)
    assert f"{m.trainer_bytes / GIB:.1f} GiB of" in text
    assert f"{off.trainer_bytes / GIB:.1f} GiB of" in text
    assert "train.optimizer_cpu_offload=true with the distributed optimizer" in text


def test_layout_that_cannot_fit_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match=r"launch.gpu_memory_gib=80.*train.optimizer_cpu_offload"):
        resolve_plan(load_config(RECIPE, ["launch.gpu_memory_gib=80"]))
    # With the offload it fits in 80 GiB (42.7 GiB of static state).
    plan = resolve_plan(
        load_config(
            RECIPE,
            [
                "launch.gpu_memory_gib=80",
                "train.optimizer_cpu_offload=true",
                "train.use_distributed_optimizer=true",
            ],
        )
    )
    assert plan.memory.optimizer_bytes == 0


def test_params_dtype_must_agree_with_the_trainer():
    with pytest.raises(ValueError, match=r"launch.params_dtype='bf16'.*train.params_dtype='fp32'"):
        resolve_plan(load_config(RECIPE, ["train.params_dtype=fp32"]))
    with pytest.raises(ValueError, match="train.use_distributed_optimizer=false with bf16"):
        resolve_plan(load_config(RECIPE, ["train.use_distributed_optimizer=false"]))
    # Offload at DP 1 needs nothing else now that bf16 always takes the distributed optimizer.
    plan = resolve_plan(load_config(RECIPE, ["train.optimizer_cpu_offload=true"]))
    assert plan.memory.optimizer_bytes == 0
