"""A stop in the middle of a rollout batch of several optimizer steps (``train.global_batch_size``
= rollout batch / 4): SIGUSR1 after optimizer step 2 of rollout batch 2 writes a run
checkpoint ``step_1_mini_2`` holding the pending batch, exits 0, and the resumed run finishes
that batch's last two steps and ends with the uninterrupted run's weights and metrics, bit for
bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_checkpoint
from safetensors.torch import load_file

from megatron_sat.rollout.arith import make_arith_splits

NUM_STEPS = 3
TIMING = ("time/", "per_s", "utilisation", "/requests")


# The tiny random model never writes a boxed answer (math rewards all 0, advantages 0): a reward
# that varies within each group, and an entropy term, give every optimizer step a gradient.
REWARD = "def reward(prompt, response, label, metadata):\n    return float(len(response) % 2)\n"


# nproc: (launcher, the rollout batch and its mini-batches). Two ranks: DP2, every mini-batch
# of two groups shared one group per rank, so each rank saves a pending batch of its own.
LAYOUTS = {
    1: ([sys.executable], ["rollout.prompts_per_step=4", "train.global_batch_size=4"]),
    2: (
        [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node=2"],
        ["rollout.prompts_per_step=8", "train.global_batch_size=8"],
    ),
}


def _cmd(run_dir: Path, data: Path, checkpoint: Path, nproc: int) -> list[str]:
    launcher, batch = LAYOUTS[nproc]
    return [
        *launcher, "-m", "megatron_sat.cli", "train", *batch,
        f"init_checkpoint={checkpoint}", f"run_dir={run_dir}",
        f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'test.jsonl'}",
        "data.num_eval_prompts=4", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "rollout.eval_samples_per_prompt=2", "train.seed=5",
        f"train.num_steps={NUM_STEPS}", "train.save_every=100", "train.eval_every=2",
        "train.micro_batch_size=16", "train.lr=1e-3",
        "objective.ratio_denominator=recomputed_old", "objective.entropy_coef=0.01",
        "rollout.reward=python", f"rollout.reward_function={data / 'reward.py'}:reward",
        "train.resume=true",
    ]  # fmt: skip


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def _weights(run_dir: Path) -> dict:
    out = {}
    for path in sorted((run_dir / "checkpoint").glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")
@pytest.mark.parametrize("nproc", [1, 2])
def test_stop_after_mini_step_2_resumes_to_the_same_weights_and_metrics(tmp_path, nproc):
    checkpoint = make_tiny_checkpoint(tmp_path / "init", seed=2)
    data = tmp_path / "data"
    data.mkdir()
    train, test = make_arith_splits(16, 4, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "reward.py").write_text(REWARD)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.pop("MEGATRON_SAT_STOP_AT", None)
    straight = subprocess.run(
        _cmd(tmp_path / "a", data, checkpoint, nproc), env=env, capture_output=True, text=True
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    run_b = tmp_path / "b"
    stopped = subprocess.run(
        _cmd(run_b, data, checkpoint, nproc),
        env={**env, "MEGATRON_SAT_STOP_AT": "2:2"},
        capture_output=True,
        text=True,
    )
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "stopped by SIGUSR1 after step 1 and optimizer step 2 of step 2" in stopped.stderr
    saved = sorted(p.name for p in (run_b / "checkpoints").glob("step_*"))
    assert saved == ["step_00000001_mini_0002"]
    ckpt = run_b / "checkpoints" / saved[0]
    ranks = [f"rank_{r:05d}.pt" for r in range(nproc)]
    assert sorted(p.name for p in (ckpt / "pending_batch").iterdir()) == ranks
    listed = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert all(f"pending_batch/{name}" in listed for name in ranks)
    assert [r["step"] for r in _metrics(run_b)] == [0, 1]  # batch 2 is logged when it ends
    assert not (run_b / "checkpoint").exists()

    resumed = subprocess.run(
        _cmd(run_b, data, checkpoint, nproc), env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows_a, rows_b = _metrics(tmp_path / "a"), _metrics(run_b)
    assert [r["step"] for r in rows_b] == list(range(NUM_STEPS + 1))
    assert rows_b[2]["train/num_optimizer_steps"] == 4.0
    assert all(rows_a[2][f"train/mini_step{j}/grad_norm"] > 0 for j in (1, 2, 3, 4))
    assert rows_b == rows_a
    weights_a, weights_b = _weights(tmp_path / "a"), _weights(run_b)
    assert weights_a.keys() == weights_b.keys() and weights_a
    initial = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        initial.update(load_file(path))
    assert any(not t.equal(initial[n]) for n, t in weights_a.items() if n in initial)
    for name, tensor in weights_a.items():
        assert (
            tensor.view(-1).view(torch.uint8).equal(weights_b[name].view(-1).view(torch.uint8))
        ), name


def test_mid_batch_checkpoint_sorts_between_batches_and_loads_its_pending_batch(
    megatron_world, tiny_checkpoint, tiny_hf_config, tmp_path
):
    """``step_1_mini_2`` (a stop in rollout batch 2 after its 2nd optimizer step) commits
    after ``step_1``, is what a resume picks, and gives back this rank's pending batch as it
    was written (no pickle: plain data and tensors); a checkpoint between batches has none."""
    from test_checkpoint_resume import train_step

    from megatron_sat.checkpoint.run_state import (
        _committed,
        latest_run_checkpoint,
        load_run_checkpoint,
        save_run_checkpoint,
    )
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.training.trainer import PolicyTrainer

    trainer = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(lr=1e-3, micro_batch_size=4, seed=3),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
    )
    train_step(trainer, 1, tiny_hf_config["vocab_size"])  # Adam state to checkpoint
    pending = {"done": 2, "old_log_probs": [[torch.arange(6.0).reshape(2, 3)]], "metrics": []}
    kwargs = dict(model=trainer.model, optimizer=trainer.optimizer)
    save_run_checkpoint(tmp_path, step=1, **kwargs)
    mid = save_run_checkpoint(tmp_path, step=1, mini_step=2, pending_batch=pending, **kwargs)
    assert mid.name == "step_00000001_mini_0002"
    assert latest_run_checkpoint(tmp_path) == mid
    assert [p.name for p in _committed(tmp_path)] == [mid.name, "step_00000001"]
    state = load_run_checkpoint(tmp_path, **kwargs)
    assert (state.step, state.mini_step, state.pending_batch["done"]) == (1, 2, 2)
    assert state.pending_batch["old_log_probs"][0][0].equal(torch.arange(6.0).reshape(2, 3))
    later = save_run_checkpoint(tmp_path, step=2, **kwargs)
    assert [p.name for p in _committed(tmp_path)][:2] == [later.name, mid.name]
    state = load_run_checkpoint(tmp_path, **kwargs)
    assert (state.step, state.mini_step, state.pending_batch) == (2, 0, None)
