"""Several optimizer steps per rollout batch (``training.mini_batches``): the cut, the config
checks, the first mini-step's gradient equal to a single step's on the same samples, four
steps with the old log-probs of the batch's start (the ratio leaves 1), None = the one-step
path bitwise, and a resume after mini-step 2 of 4 bitwise equal to the uninterrupted run."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from test_split_invariance import TRAIN, attach_rollout_log_probs, make_samples

from megatron_sat.checkpoint.run_state import load_run_checkpoint, save_run_checkpoint
from megatron_sat.config import ParallelConfig, RunConfig, TrainConfig
from megatron_sat.config.run import RolloutConfig, steps_per_rollout_batch
from megatron_sat.objectives import ObjectiveConfig, compute_grpo_advantages
from megatron_sat.training.mini_batches import (
    RolloutBatchSteps,
    distributed_rollout_batch,
    mini_batch_slices,
    rollout_batch_metrics,
    run_optimizer_step,
    start_rollout_batch,
)
from megatron_sat.training.trainer import PolicyTrainer

GROUP = 4
GRPO_OLD = {"name": "grpo", "ratio_denominator": "recomputed_old"}
# The GSPO paper's clip radii (3e-4, 4e-4): one step of lr 1e-3 moves the ratio past them.
GSPO_OLD = {
    "name": "gspo",
    "ratio_denominator": "recomputed_old",
    "eps_low": 3e-4,
    "eps_high": 4e-4,
}


def test_mini_batch_slices_are_contiguous_whole_groups():
    assert mini_batch_slices(48, 4, 12) == [
        slice(0, 12),
        slice(12, 24),
        slice(24, 36),
        slice(36, 48),
    ]
    assert mini_batch_slices(8, 4, 8) == [slice(0, 8)]
    for bad in (10, 6, 0):  # does not divide 48 / not whole groups / empty
        with pytest.raises(ValueError, match="train.global_batch_size"):
            mini_batch_slices(48, 4, bad)


def test_config_checks_and_steps_per_rollout_batch():
    rollout = RolloutConfig(prompts_per_step=12, group_size=4)
    assert steps_per_rollout_batch(TrainConfig(), rollout) == 1
    assert steps_per_rollout_batch(TrainConfig(global_batch_size=12), rollout) == 4
    assert steps_per_rollout_batch(TrainConfig(global_batch_size=24, num_epochs=3), rollout) == 6
    assert steps_per_rollout_batch(TrainConfig(num_epochs=2), rollout) == 2
    with pytest.raises(ValueError, match="train.global_batch_size=6 must divide"):
        RunConfig(rollout=rollout, train=TrainConfig(global_batch_size=6))
    with pytest.raises(ValueError, match="train.num_epochs must be > 0"):
        TrainConfig(num_epochs=0)


def test_inert_clip_warning_only_with_one_step_per_rollout_batch(recwarn):
    # Asynchronous GRPO with a recomputed old policy: inert with one step per batch (warned),
    # a live clip from the second of several steps (not warned); SAT stays refused.
    from megatron_sat.objectives import INERT_CLIP_WARNING

    def config(**train):
        return RunConfig(
            rollout=RolloutConfig(prompts_per_step=12, group_size=4, mode="fixed_lag", lag=8),
            train=TrainConfig(**train),
            objective=ObjectiveConfig(**GRPO_OLD),
        )

    with pytest.warns(UserWarning, match="clip is inert"):
        config()
    recwarn.clear()
    config(global_batch_size=12)
    assert not [w for w in recwarn if INERT_CLIP_WARNING in str(w.message)]
    with pytest.raises(ValueError, match="recomputed_old"):
        RunConfig(
            rollout=RolloutConfig(prompts_per_step=12, group_size=4, mode="fixed_lag", lag=8),
            train=TrainConfig(global_batch_size=12),
            objective=ObjectiveConfig(name="sat-gspo", ratio_denominator="recomputed_old"),
        )


def test_rollout_batch_metrics_means_and_per_step_keys():
    out = rollout_batch_metrics([{"loss": 1.0, "topk_match_live": 0.5}, {"loss": 3.0}])
    assert out == {
        "loss": 2.0,
        "topk_match_live": 0.5,  # reported by the first step only: its own value
        "mini_step1/loss": 1.0,
        "mini_step1/topk_match_live": 0.5,
        "mini_step2/loss": 3.0,
        "num_optimizer_steps": 2.0,
    }


@pytest.fixture(scope="module")
def trainer(megatron_world, tiny_checkpoint, tiny_hf_config):
    train = TrainConfig(**TRAIN)
    return PolicyTrainer(
        tiny_hf_config, train, ParallelConfig(), pad_token_id=0, load_from=tiny_checkpoint
    )


@pytest.fixture(scope="module")
def batch(trainer, tiny_hf_config):
    """12 groups of 4 (48 samples), on-policy (``recomputed_old`` needs age 0), log mu noisy."""
    samples = []
    for half in range(2):
        part = make_samples(trainer, tiny_hf_config["vocab_size"], seed=half)
        attach_rollout_log_probs(trainer, part, seed=half + 1)
        for s in part:
            s.index += 24 * half
            s.group_index += 6 * half
            s.response_versions = [0] * len(s.response_ids)
        samples += part
    rewards = torch.tensor([float((i * 7) % 5 > 1) for i in range(len(samples))])
    advantages = compute_grpo_advantages(rewards, GROUP)
    # One step first, so that every run checkpoint below holds Adam's states (a checkpoint
    # without them cannot be loaded into an optimizer that has them).
    trainer.rl_step(samples, advantages, ObjectiveConfig(name="grpo"), trainer_version=0)
    return samples, advantages


def run_config(objective: dict, **train) -> RunConfig:
    return RunConfig(
        rollout=RolloutConfig(prompts_per_step=12, group_size=GROUP, return_routed_experts=True),
        train=TrainConfig(**TRAIN, **train),
        objective=ObjectiveConfig(**objective),
    )


def params_of(trainer) -> list[torch.Tensor]:
    return [p for _, p in trainer.model.named_parameters()]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def save(trainer, run_dir, step, **kw):
    return save_run_checkpoint(
        run_dir, model=trainer.model, optimizer=trainer.optimizer, step=step, **kw
    )


def restore(trainer, path):
    return load_run_checkpoint(path, model=trainer.model, optimizer=trainer.optimizer)


@pytest.mark.parametrize("objective", [GRPO_OLD, {"name": "sat-gspo"}], ids=["grpo-old", "sat"])
def test_first_mini_step_gradient_equals_single_step(trainer, batch, objective, tmp_path):
    samples, advantages = batch
    start = save(trainer, tmp_path, 1)
    cfg = run_config(objective, global_batch_size=12)
    pending = start_rollout_batch(trainer, samples, advantages, cfg, 0)
    first = run_optimizer_step(trainer, pending, cfg.objective, routing_diagnostic=False)
    mini_grad = flat(p.main_grad for p in params_of(trainer))
    restore(trainer, start)
    single = trainer.rl_step(
        samples[:12], advantages[:12], cfg.objective, trainer_version=0, routing_diagnostic=False
    )
    single_grad = flat(p.main_grad for p in params_of(trainer))
    assert single_grad.abs().max() > 0
    assert torch.equal(mini_grad, single_grad)  # bitwise
    assert first == single


def test_four_mini_steps_reuse_the_batch_start_old_log_probs(trainer, batch, tmp_path):
    samples, advantages = batch
    start = save(trainer, tmp_path, 1)
    cfg = run_config(GSPO_OLD, global_batch_size=12)
    before = flat(params_of(trainer))
    metrics = distributed_rollout_batch(trainer, samples, advantages, cfg, 0)
    assert metrics["num_optimizer_steps"] == 4.0
    steps = [
        {k[11:]: v for k, v in metrics.items() if k.startswith(f"mini_step{j}/")} for j in "1234"
    ]
    assert [m["num_seqs"] for m in steps] == [11.0, 12.0, 11.0, 12.0]  # samples 5, 29: no response
    # Step 1 divides by its own weights (ratio 1: GSPO's clip idle); steps 2..4 by the batch
    # start's, so GSPO's narrow clip (3e-4 / 4e-4) binds.
    assert steps[0]["clipfrac_low"] == steps[0]["clipfrac_high"] == 0.0
    for m in steps[1:]:
        assert m["clipfrac_low"] + m["clipfrac_high"] > 0
    assert metrics["loss"] == pytest.approx(sum(m["loss"] for m in steps) / 4)
    assert not torch.equal(flat(params_of(trainer)), before)
    # Recomputing pi_old at step 2 instead (a second rollout batch of one step) gives ratio 1.
    restore(trainer, start)
    run_optimizer_step(
        trainer,
        start_rollout_batch(trainer, samples[:12], advantages[:12], cfg, 0),
        cfg.objective,
        False,
    )
    recomputed = trainer.rl_step(
        samples[12:24], advantages[12:24], cfg.objective, trainer_version=0
    )
    assert recomputed["clipfrac_low"] == recomputed["clipfrac_high"] == 0.0


def test_two_epochs_of_two_mini_batches(trainer, batch):
    # Epoch 2 walks the same cut again (mini-batch 1, then 2) with the batch start's old
    # log-probs: its first step is no longer at ratio 1.
    samples, advantages = batch
    cfg = run_config(GSPO_OLD, global_batch_size=24, num_epochs=2)
    metrics = distributed_rollout_batch(trainer, samples, advantages, cfg, 0)
    assert metrics["num_optimizer_steps"] == 4.0
    for key in ("num_seqs", "num_tokens"):
        assert metrics[f"mini_step3/{key}"] == metrics[f"mini_step1/{key}"]
        assert metrics[f"mini_step4/{key}"] == metrics[f"mini_step2/{key}"]
    assert metrics["mini_step1/clipfrac_low"] == metrics["mini_step1/clipfrac_high"] == 0.0
    assert metrics["mini_step3/clipfrac_low"] + metrics["mini_step3/clipfrac_high"] > 0


def test_stale_samples_warn_inert_only_with_one_step(trainer, batch, tmp_path, recwarn):
    from megatron_sat.objectives import INERT_CLIP_WARNING

    samples, advantages = batch
    start = save(trainer, tmp_path, 1)
    for gbs, warned in ((12, False), (None, True)):
        restore(trainer, start)
        recwarn.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            distributed_rollout_batch(
                trainer, samples, advantages, run_config(GRPO_OLD, global_batch_size=gbs), 2
            )  # trainer version 2: every sample 2 versions old
            inert = [w for w in recwarn if INERT_CLIP_WARNING in str(w.message)]
        assert bool(inert) == warned, gbs


def test_none_is_the_one_step_path_bitwise(trainer, batch, tmp_path):
    samples, advantages = batch
    start = save(trainer, tmp_path, 1)
    cfg = run_config(GRPO_OLD)
    via_loop = distributed_rollout_batch(trainer, samples, advantages, cfg, 0)
    params_loop = flat(params_of(trainer))
    restore(trainer, start)
    direct = trainer.rl_step(samples, advantages, cfg.objective, trainer_version=0)
    assert via_loop == direct and "num_optimizer_steps" not in via_loop
    assert torch.equal(params_loop, flat(params_of(trainer)))
    # One mini-batch of the whole batch through the mini-step path: the same step bitwise.
    restore(trainer, start)
    whole = distributed_rollout_batch(
        trainer,
        samples,
        advantages,
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=48)),
        0,
    )
    assert torch.equal(params_loop, flat(params_of(trainer)))
    assert {k[11:]: v for k, v in whole.items() if k.startswith("mini_step1/")} == direct
    assert {k: whole[k] for k in direct} == direct  # the means of one step: its own values


def test_resume_after_mini_step_two_of_four_is_bitwise(trainer, batch, tmp_path):
    samples, advantages = batch
    cfg = run_config(GSPO_OLD, global_batch_size=12)
    start = save(trainer, tmp_path / "start", 1)
    pending = start_rollout_batch(trainer, samples, advantages, cfg, 0)
    for _ in range(2):
        run_optimizer_step(trainer, pending, cfg.objective, False)
    middle = save(trainer, tmp_path / "run", 2, extra={"pending": pending.state_dict()})
    while pending.done < 4:
        run_optimizer_step(trainer, pending, cfg.objective, False)
    uninterrupted, metrics = flat(params_of(trainer)), pending.metrics
    restore(trainer, start)  # scramble: a different state in between
    distributed_rollout_batch(trainer, samples, advantages, run_config(GRPO_OLD), 0)
    state = restore(trainer, middle)
    resumed = RolloutBatchSteps.from_state_dict(state.extra["pending"], trainer.device)
    assert resumed.done == 2 and resumed.num_steps == 4
    while resumed.done < 4:
        run_optimizer_step(trainer, resumed, cfg.objective, False)
    assert torch.equal(flat(params_of(trainer)), uninterrupted)
    assert resumed.metrics == metrics


# ---------------------------------------------------------------- data parallel (torchrun)

DP_OVERRIDES = [
    "rollout.prompts_per_step=12",
    "rollout.group_size=4",
    "rollout.return_routed_experts=true",
    "train.global_batch_size=12",  # 3 groups per mini-batch: DP shares of 2 and 1 groups
    *(f"train.{k}={str(v).lower()}" for k, v in TRAIN.items()),
    *(f"objective.{k}={v}" for k, v in GSPO_OLD.items()),
]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory, batch, tiny_checkpoint, tiny_hf_config):
    """ONE torchrun launch (2 ranks): a rollout batch of 4 mini-batches, then a 2-step RL run
    with mini-batches (3 groups, mini-batches of 1 group: rank 1 has no samples in each)."""
    import json
    import pickle

    from conftest import run_torchrun

    from megatron_sat.rollout.arith import make_arith_splits

    tmp = tmp_path_factory.mktemp("dp_mini")
    samples, advantages = batch
    train, test = make_arith_splits(64, 8, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rl_overrides = [
        f"init_checkpoint={tiny_checkpoint}",
        f"run_dir={tmp / 'run'}",
        f"data.train_path={tmp / 'train.jsonl'}",
        f"data.eval_path={tmp / 'test.jsonl'}",
        "data.num_eval_prompts=4",
        "rollout.prompts_per_step=3",
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "rollout.eval_samples_per_prompt=2",
        "train.num_steps=2",
        "train.eval_every=2",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        "objective.name=grpo",
        "objective.ratio_denominator=recomputed_old",
    ]
    spec = {
        "checkpoint": str(tiny_checkpoint),
        "hf_config": tiny_hf_config,
        "samples": samples,
        "advantages": advantages,
        "overrides": DP_OVERRIDES,
        "rl_overrides": rl_overrides,
    }
    (tmp / "spec.pkl").write_bytes(pickle.dumps(spec))
    run_torchrun("tests/dist/dp_mini_batches.py", str(tmp / "spec.pkl"), str(tmp), done="MB_DONE")
    return torch.load(tmp / "result.pt", weights_only=False), tmp


@pytest.mark.slow
def test_data_parallel_mini_batches_equal_one_process(
    dp_run, batch, megatron_world, tiny_checkpoint, tiny_hf_config
):
    # The same rollout batch from the checkpoint's weights and a fresh optimizer, one process.
    from megatron_sat.config import load_config

    results, _ = dp_run
    samples, advantages = batch
    cfg = load_config(None, DP_OVERRIDES)
    fresh = PolicyTrainer(
        tiny_hf_config, cfg.train, ParallelConfig(), pad_token_id=0, load_from=tiny_checkpoint
    )
    want = distributed_rollout_batch(fresh, samples, advantages, cfg, 0)
    params = torch.cat([p.detach().reshape(-1) for p in fresh.model.parameters()])
    got = results["metrics"]
    assert set(got) == set(want) and want["num_optimizer_steps"] == 4.0
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(results["params"], params, rtol=1e-5, atol=1e-6)
    assert sum(want[f"mini_step{j}/clipfrac_high"] for j in (2, 3, 4)) > 0


@pytest.mark.slow
def test_data_parallel_rl_run_logs_mini_steps(dp_run):
    import json

    _, tmp = dp_run
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]  # one line per rollout batch
    for r in train_rows:
        assert r["train/num_optimizer_steps"] == 3.0
        steps = [r[f"train/mini_step{j}/loss"] for j in (1, 2, 3)]
        assert r["train/loss"] == pytest.approx(sum(steps) / 3)
    assert (tmp / "run" / "summary.json").is_file()
