"""bf16 mixed precision in PolicyTrainer: built objects, log-probs against fp32, R3, at TP2+SP,
EP2 and DP2 under torchrun (tests/dist/bf16_parallel.py), and the optimizer layout's rules."""

from __future__ import annotations

import pytest
import torch
from conftest import run_torchrun

from megatron_sat.config import TrainConfig
from megatron_sat.training.optimizer_layout import (
    OptimizerLayout,
    bytes_per_param,
    resolve_optimizer_layout,
)

# bf16 tolerances of the per-token log-probs (nats), the same checkpoint in fp32 and bf16.
# Before the step the bf16 model holds the fp32 weights rounded to bf16 (unit roundoff 2^-9)
# and computes every matmul in bf16: with |logits| of a few nats over 4 layers that is ~1e-2
# per token (measured: mean 0.011, max 0.031). After one Adam step (lr 1e-4) the difference
# also holds the step's own: Adam's first update is +-lr per weight by the sign of its
# gradient, and bf16 gradients flip the sign of near-zero components (measured: mean 0.027,
# max 0.15).
BEFORE_MEAN, BEFORE_MAX = 0.015, 0.05
AFTER_MEAN, AFTER_MAX = 0.04, 0.2


@pytest.mark.slow
def test_bf16_parallel_layouts(tmp_path):
    from megatron_sat.checkpoint.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(
        "Qwen3MoeForCausalLM", tmp_path / "ckpt", num_hidden_layers=4, num_experts=8
    )
    run_torchrun(
        "tests/dist/bf16_parallel.py",
        str(ckpt),
        str(tmp_path),
        done="BF16_PARALLEL_DONE",
        env={"BF16_PARALLEL_RESUME_DTYPE": "bf16"},
    )
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert set(result) == {"tp2", "ep2", "dp2"}
    for case, ranks in result.items():
        for rank, out in enumerate(ranks):
            fp32, bf16 = out["fp32"], out["bf16"]
            where = f"{case} rank {rank}"
            # Built objects: linear/embedding weights bf16, routers (weight) float32; the local
            # spec's torch RMSNorm keeps its weight float32 (megatron-core's WrappedTorchNorm
            # takes no dtype); main parameters float32; fp32 run fully float32.
            for name, dtype in bf16["dtypes"].items():
                if "router" in name:
                    assert dtype == "torch.float32", (where, name)
                elif name.endswith("weight") and "norm" not in name:
                    assert dtype == "torch.bfloat16", (where, name)
            assert set(fp32["dtypes"].values()) == {"torch.float32"}, where
            for mains in bf16["main"].values():
                assert set(mains) == {"torch.float32"}, (where, bf16["main"])
            # The distributed optimizer: always in bf16 (also at DP 1, as tp2), in fp32 exactly
            # when a DP size (dense or expert) is > 1.
            assert bf16["distributed_optimizer"], where
            assert fp32["distributed_optimizer"] == (fp32["dp"] > 1 or fp32["edp"] > 1), where
            assert bf16["metrics"]["topk_match_r3"] == 1.0, where
            assert fp32["metrics"]["topk_match_r3"] == 1.0, where
            for when, mean_tol, max_tol in (
                ("before", BEFORE_MEAN, BEFORE_MAX),
                ("after", AFTER_MEAN, AFTER_MAX),
            ):
                for a, b, mask in zip(fp32[when], bf16[when], fp32["masks"], strict=True):
                    diff = (a - b).abs() * mask
                    assert float(diff.sum() / mask.sum()) <= mean_tol, (where, when)
                    assert float(diff.max()) <= max_tol, (where, when)
                    assert float(diff.max()) > 0, (where, when)  # bf16 really ran
    assert result["tp2"][0]["bf16"]["dp"] == 1
    assert (result["ep2"][0]["bf16"]["dp"], result["ep2"][0]["bf16"]["edp"]) == (2, 1)
    assert (result["dp2"][0]["bf16"]["dp"], result["dp2"][0]["bf16"]["edp"]) == (2, 2)
    # The bf16 run at DP2 (distributed optimizer) resumed from a run checkpoint after step 1:
    # its step 2 equals the uninterrupted step 2 bit for bit, on every rank.
    for rank, out in enumerate(result["dp2"]):
        continued, resumed = out["continued"], out["resumed"]
        assert sorted(continued) == sorted(resumed)
        different = [n for n in continued if not torch.equal(continued[n], resumed[n])]
        assert not different, (rank, different[:5])


def test_optimizer_layout_defaults_and_refusals():
    # bf16 (CUDA's default): the distributed optimizer also at DP 1 (megatron-core 0.19's
    # replicated mixed-precision optimizer cannot checkpoint fp32 routers beside bf16 weights).
    cuda = resolve_optimizer_layout(TrainConfig(), device_type="cuda", dp=1, edp=1)
    assert (cuda.params_dtype, cuda.use_distributed_optimizer) == ("bf16", True)
    cpu = resolve_optimizer_layout(TrainConfig(), device_type="cpu", dp=1, edp=1)
    assert (cpu.params_dtype, cpu.use_distributed_optimizer) == ("fp32", False)
    cpu = resolve_optimizer_layout(TrainConfig(), device_type="cpu", dp=1, edp=2)
    assert (cpu.params_dtype, cpu.use_distributed_optimizer) == ("fp32", True)
    forced = TrainConfig(params_dtype="fp32", use_distributed_optimizer=False)
    assert not resolve_optimizer_layout(
        forced, device_type="cuda", dp=8, edp=1
    ).use_distributed_optimizer
    with pytest.raises(ValueError, match="train.use_distributed_optimizer=false with bf16"):
        resolve_optimizer_layout(
            TrainConfig(use_distributed_optimizer=False), device_type="cuda", dp=8, edp=1
        )
    with pytest.raises(ValueError, match="train.optimizer_cpu_offload"):
        resolve_optimizer_layout(
            TrainConfig(optimizer_cpu_offload=True, params_dtype="fp32"),
            device_type="cuda",
            dp=1,
            edp=1,
        )
    with pytest.raises(ValueError, match="optimizer_cpu_offload=true needs CUDA"):
        # megatron-core's HybridDeviceOptimizer failed with "can't optimize a non-leaf Tensor"
        resolve_optimizer_layout(
            TrainConfig(optimizer_cpu_offload=True, params_dtype="bf16"),
            device_type="cpu",
            dp=1,
            edp=1,
        )
    with pytest.raises(ValueError, match="train.use_distributed_optimizer"):
        TrainConfig(use_precision_aware_optimizer=True, use_distributed_optimizer=False)
    with pytest.raises(ValueError, match="train.params_dtype"):
        TrainConfig(params_dtype="fp16")
    with pytest.raises(ValueError, match="train.recompute_granularity"):
        TrainConfig(recompute_granularity="block")


def test_bytes_per_param_by_layout():
    def layout(**kw):
        return resolve_optimizer_layout(TrainConfig(**kw), device_type="cuda", dp=2, edp=2)

    assert bytes_per_param(layout(), 2) == (2.0, 4.0, 6.0)  # 2 + 4 + (4 + 8) / 2 = 12
    replicated_bf16 = OptimizerLayout("bf16", False, False, False)  # refused by the resolver
    assert bytes_per_param(replicated_bf16, 2) == (2.0, 4.0, 12.0)
    assert bytes_per_param(layout(params_dtype="fp32", use_distributed_optimizer=False), 2) == (
        4.0,
        4.0,
        8.0,
    )
    assert bytes_per_param(layout(optimizer_cpu_offload=True), 2) == (2.0, 4.0, 0.0)
    assert bytes_per_param(layout(use_precision_aware_optimizer=True), 2) == (2.0, 4.0, 4.0)
    assert bytes_per_param(layout(), 2, fp32_param=True) == (4.0, 4.0, 4.0)  # router: 8 / 2


def test_bf16_run_checkpoint_at_dp1_resumes_bit_exact(megatron_world, tiny_checkpoint, tmp_path):
    """bf16 at DP 1 (a single GPU): the first run checkpoint used to fail in megatron-core
    0.19's replicated mixed-precision optimizer ("Optimizer shape ... does not match model
    shape": fp32 routers beside bf16 weights); the layout now takes the distributed optimizer,
    and the step after a resume equals the uninterrupted one bit for bit."""
    import json
    import sys
    from pathlib import Path

    from megatron_sat.checkpoint.run_state import load_run_checkpoint, save_run_checkpoint
    from megatron_sat.config import ParallelConfig
    from megatron_sat.objectives import ObjectiveConfig
    from megatron_sat.training.trainer import PolicyTrainer

    sys.path.insert(0, str(Path(__file__).parent / "dist"))
    from r3_common import make_samples

    hf = json.loads((tiny_checkpoint / "config.json").read_text())

    def trainer() -> PolicyTrainer:
        return PolicyTrainer(
            hf,
            TrainConfig(lr=1e-4, micro_batch_size=4, params_dtype="bf16", seed=7),
            ParallelConfig(),
            pad_token_id=0,
            load_from=tiny_checkpoint,
        )

    first = trainer()
    assert first.optimizer_layout.use_distributed_optimizer
    layers, top_k, experts = first.routing_shape
    shape = dict(hf, num_hidden_layers=layers, num_experts_per_tok=top_k, num_experts=experts)
    samples = make_samples([(3, 6)] * 8, shape, seed=3)
    for s in samples:
        s.rollout_log_probs = [0.0] * len(s.response_ids)
    advantages = torch.linspace(-1.0, 1.0, 8)
    objective = ObjectiveConfig(name="sat-gspo")
    for _ in range(2):
        first.rl_step(samples, advantages, objective)
    save_run_checkpoint(tmp_path, model=first.model, optimizer=first.optimizer, step=2)
    first.rl_step(samples, advantages, objective)
    continued = dict(first.hf_tensors())
    resumed = trainer()
    load_run_checkpoint(tmp_path, model=resumed.model, optimizer=resumed.optimizer)
    resumed.rl_step(samples, advantages, objective)
    different = [n for n, t in resumed.hf_tensors() if not torch.equal(t, continued[n])]
    assert not different, different[:5]


def test_restore_adam_steps_unshares_and_checks_the_step():
    """megatron-core 0.19's DistributedOptimizer load leaves ONE step tensor shared by every
    parameter (and the template's value in it): each parameter gets its own tensor with the
    checkpoint's step; a step that is not a finite number >= 0 is refused."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_sat.platform.distrib_optimizer_fix import restore_adam_steps

    class Loaded(DistributedOptimizer):
        def __init__(self, inner):  # only the torch optimizer matters here
            self.optimizer = inner

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    inner = torch.optim.AdamW([a, b])
    shared = torch.tensor(1.0)
    inner.state[a]["step"], inner.state[b]["step"] = shared, shared
    opt = Loaded(inner)
    assert restore_adam_steps(opt, {"optimizer": {"param_groups": [{"step": 2.0}]}}) == 2
    assert inner.state[a]["step"] is not inner.state[b]["step"]
    assert float(inner.state[a]["step"]) == float(inner.state[b]["step"]) == 2.0
    for bad in (float("nan"), -1.0, "5"):
        with pytest.raises(ValueError, match="finite number >= 0"):
            restore_adam_steps(opt, {"optimizer": {"param_groups": [{"step": bad}]}})
    with pytest.raises(ValueError, match="disagree on step"):
        restore_adam_steps(opt, {"optimizer": {"param_groups": [{"step": 1}, {"step": 2}]}})
    # A chain given another number of states names the layout instead of a bare zip error.
    chain = type("Chain", (), {"chained_optimizers": [opt, opt]})()
    state = {"optimizer": {"param_groups": [{"step": 2.0}]}}
    with pytest.raises(ValueError, match="optimizer state of 3 optimizers for a chain of 2"):
        restore_adam_steps(chain, [state] * 3)
    assert restore_adam_steps(chain, {0: state, 1: state}) == 4
