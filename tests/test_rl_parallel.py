"""The RL loop under torchrun at TP2 (+SP) and EP2: ONE launch of tests/dist/rl_parallel.py.

Rank 0 leads and the other rank follows its collectives (train steps, the sharded HF export of
every weight push, checkpoints). Synchronous rollouts with a push after every step make the
server's weights equal the trainer's at every step, so the train-rollout mismatch measures the
push itself: a push missing a TP shard or an EP rank's experts would show as a large mismatch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import run_torchrun

from megatron_sat.rollout.arith import make_arith_splits

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "ep2": ["parallel.expert_model_parallel_size=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_checkpoint) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("rl_parallel")
    train, test = make_arith_splits(64, 8, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [
        f"init_checkpoint={tiny_checkpoint}",
        f"data.train_path={tmp / 'train.jsonl'}",
        f"data.eval_path={tmp / 'test.jsonl'}",
        "data.num_eval_prompts=4",
        "rollout.prompts_per_step=3",  # EP2 = DP2: shares of 2 and 1 groups
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "rollout.eval_samples_per_prompt=2",
        "rollout.temperature=1.0",
        "train.num_steps=3",
        "train.eval_every=3",
        "train.micro_batch_size=4",
        "train.lr=0.01",  # weights move visibly, so a stale or partial push would show
        "objective.kl_coef=0.001",  # the sharded reference policy too
        # a gradient at every step whatever the rewards (the tiny random model often scores 0
        # on a whole batch, which gives zero advantages), so every push moves the weights
        "objective.entropy_coef=0.01",
    ]
    argv = [
        f"{name}=" + ";".join([*common, f"run_dir={tmp / name}", *extra])
        for name, extra in LAYOUTS.items()
    ]
    run_torchrun("tests/dist/rl_parallel.py", *argv, done="RL_PARALLEL_DONE", timeout=900)
    return {name: tmp / name for name in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rl_loop_at_model_parallel_layout(runs, layout):
    run = runs[layout]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert row["train/num_seqs"] == 12  # the global batch, whatever the shares
        assert row["train/topk_match_r3"] == 1.0
        assert row["train/kl_loss"] >= 0.0
        # server weights == trainer weights at every step: fp32 rounding only
        assert row["train/mismatch_abs_logratio"] < 1e-4, row
    # ... and every step but the last was followed by an update that moved the weights (lr 0.01, a
    # non-zero gradient), so a push that missed it would have shown above
    # (Adam moves each weight by about lr whatever the gradient's scale)
    assert all(prev["train/grad_norm"] > 0.0 for prev in rows[1:-1])
    assert rows[1]["train/kl_loss"] == 0.0 and rows[-1]["train/kl_loss"] > 0.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_steps"] == 3 and (run / "checkpoint" / "config.json").exists()


@pytest.mark.slow
def test_a_failure_of_rank_0_inside_a_step_ends_the_job_promptly(tmp_path, tiny_checkpoint):
    """Rank 0 raises inside a train step while rank 1 is in the step's collectives (EP2): the
    job must end with rank 0's error well before the collective timeout (1 minute here), not
    wait for it in an abort broadcast rank 1 cannot reach."""
    train, test = make_arith_splits(16, 4, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        f"init_checkpoint={tiny_checkpoint}",
        f"run_dir={tmp_path / 'run'}",
        f"data.train_path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'test.jsonl'}",
        "data.num_eval_prompts=2",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=2",
        "rollout.eval_samples_per_prompt=1",
        "train.num_steps=2",
        "train.micro_batch_size=2",
        "train.distributed_timeout_minutes=1",
        "parallel.expert_model_parallel_size=2",
    ]
    mark = tmp_path / "failed_at"
    with pytest.raises(AssertionError, match="injected failure on rank 0"):
        run_torchrun(
            "tests/dist/rl_abort.py",
            "abort=" + ";".join(overrides),
            done="never",
            timeout=600,  # start-up under CI's load can take minutes: timed from the failure
            env={"RL_ABORT_MARK": str(mark)},
        )
    # A job waiting in rank 1's collectives would end only after the 60 s timeout.
    ended_after = time.time() - float(mark.read_text())
    assert ended_after < 40, f"the job ended {ended_after:.1f} s after rank 0's failure"
