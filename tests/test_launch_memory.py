"""The launch plan's memory: the trainer's own optimizer layout (training.optimizer_layout)
and the whole RL step per trainer GPU (launch.step_memory): the shipped recipe fits a 141 GB
H200, the old recipe (4 samples per micro-batch, no recompute, Adam on the device) is refused
naming the component and the fields that would make it fit, and launch.params_dtype is checked
against train."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sat.cli import main
from megatron_sat.config import load_config
from megatron_sat.launch.memory import GIB
from megatron_sat.launch.plan import format_plan, resolve_plan

RECIPE = Path(__file__).resolve().parents[1] / "examples/configs/qwen3_30b_a3b_sat_gspo_r3.yaml"
# The recipe as it was before the memory plan counted activations.
OLD_RECIPE = [
    "train.max_tokens_per_micro_batch=null",
    "train.micro_batch_size=4",
    "train.optimizer_cpu_offload=false",
    "launch.gpu_memory_gib=140",
]


def test_paper_recipe_memory_as_built_and_without_offload():
    plan = resolve_plan(load_config(RECIPE))
    m, n = plan.memory, plan.memory.params_per_rank
    # TP x EP with DP = expert DP = 1, Adam offloaded: bf16 params + fp32 grads on the device.
    assert plan.optimizer_layout.use_distributed_optimizer
    assert plan.optimizer_layout.optimizer_cpu_offload
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (2 * n, 4 * n, 0)
    off = plan.memory_offload_toggled  # the distributed optimizer shards nothing at DP 1: 12 B
    assert (off.param_bytes, off.grad_bytes, off.optimizer_bytes) == (2 * n, 4 * n, 12 * n)
    text = format_plan(plan)
    assert f"{m.trainer_bytes / GIB:.1f} GiB of" in text
    assert f"{off.trainer_bytes / GIB:.1f} GiB of" in text
    assert "alternative: train.optimizer_cpu_offload=false" in text


def test_shipped_recipe_fits_an_h200_and_prints_every_component(capsys):
    assert main(["launch", "--config", str(RECIPE), "--dry-run"]) == 0
    out = capsys.readouterr().out
    step = resolve_plan(load_config(RECIPE)).step_memory
    assert step.fits and step.limit_bytes == 139 * GIB
    assert step.shape.tokens == 32768 and step.kernels == "transformer_engine"
    c = step.components
    # Activations: 48 layers x 1,008,402,432 B (32768 tokens at TP 4 / SP / EP 4, hand-counted
    # in tests/test_activation_memory.py: 30,774 B per token per layer) + the RoPE
    # frequencies once (8704 x 128 float32).
    assert c["activations"] == 48 * 1_008_402_432 + 8704 * 128 * 4
    # Logits and loss: float32 copy (saved) + bf16 logits (transient) of 32768 tokens x
    # 151936 / 4 entries; final norm input + rstd and output layer input on 32768 / 4 tokens;
    # labels, input ids (int64) and the loss mask per token.
    assert c["logits and loss"] == 32768 * 37984 * (4 + 2) + 8192 * (4096 + 4 + 4096) + 32768 * 17
    assert c["optimizer states"] == 0 and c["CUDA/NCCL/TE workspaces"] == 3 * GIB
    for name in ("activations", "logits and loss", "micro-batch and R3 routes", "total"):
        assert f"  {name:<28}" in out
    assert f"{step.total / GIB:8.2f} GiB of 139 GiB: fits" in out


def test_old_recipe_is_refused_naming_the_component_and_fields():
    with pytest.raises(ValueError) as info:
        resolve_plan(load_config(RECIPE, OLD_RECIPE))
    message = str(info.value)
    assert "launch.gpu_memory_gib=140: a trainer GPU needs" in message
    assert "largest other part: activations" in message
    assert "train.micro_batch_size=4 x 8704 tokens" in message
    assert "train.recompute_granularity=none" in message
    # What would make it fit, each with its total: full recompute (not enough alone), a token
    # budget with full recompute, the optimizer offload.
    assert "train.recompute_granularity=full (" in message
    assert "train.max_tokens_per_micro_batch=" in message
    assert "train.optimizer_cpu_offload=true and train.use_distributed_optimizer=true" in message


def test_layout_that_cannot_fit_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match=r"launch.gpu_memory_gib=80: .*activations"):
        resolve_plan(load_config(RECIPE, ["launch.gpu_memory_gib=80"]))
    # The H100 configuration the docs give fits in 79 GiB.
    h100 = ["launch.gpu_memory_gib=79", "train.recompute_granularity=full"]
    step = resolve_plan(load_config(RECIPE, h100)).step_memory
    assert step.fits and step.components["recompute working set"] > 0


def test_params_dtype_must_agree_with_the_trainer():
    with pytest.raises(ValueError, match=r"launch.params_dtype='bf16'.*train.params_dtype='fp32'"):
        resolve_plan(load_config(RECIPE, ["train.params_dtype=fp32"]))
    with pytest.raises(ValueError, match="train.use_distributed_optimizer=false with bf16"):
        resolve_plan(
            load_config(
                RECIPE,
                ["train.use_distributed_optimizer=false", "train.optimizer_cpu_offload=false"],
            )
        )


def test_reference_on_device_is_counted():
    """``train.reference_on_device`` puts a second copy of the parameters on every trainer GPU:
    the plan's reference component is exactly the parameter bytes, and 0 in host memory."""
    host = resolve_plan(load_config(RECIPE)).step_memory
    device = resolve_plan(load_config(RECIPE, ["train.reference_on_device=true"])).step_memory
    assert host.components["reference policy"] == 0
    assert device.components["reference policy"] == host.components["parameters"] > 0
    assert device.total - host.total == host.components["parameters"]


def test_prompts_longer_than_the_plan_assumes_are_refused_at_load():
    """The plan sizes micro-batches and the pool for prompts up to ``launch.max_prompt_tokens``:
    a longer prompt is refused when the dataset loads, naming the file, the row and the field
    (it would otherwise run the GPU out of memory mid-run; a breaker's find)."""
    from megatron_sat.rollout.datasets import PromptRecord
    from megatron_sat.training.rl import check_prompt_lengths

    class Chars:  # one token per character
        @staticmethod
        def encode(text):
            return list(text)

    rows = [PromptRecord("x" * 8, "1", 0), PromptRecord("x" * 9, "1", 1)]
    check_prompt_lengths(rows[:1], Chars, 100, 4, "train.jsonl", max_prompt_tokens=8)
    with pytest.raises(ValueError, match=r"train.jsonl row 1: 9 prompt tokens exceed launch\."):
        check_prompt_lengths(rows, Chars, 100, 4, "train.jsonl", max_prompt_tokens=8)
    with pytest.raises(ValueError, match=r"row 0: 8 prompt tokens \+ rollout.max_new_tokens=4"):
        check_prompt_lengths(rows[:1], Chars, 11, 4, "train.jsonl", max_prompt_tokens=8)
