"""The main job with a reward plug-in and with a remote scorer: the example plug-in trains and
its extra metrics are logged; a plug-in that returns NaN is refused before step 1's optimizer
step, naming the sample; a remote scorer that goes down ends the run with a clear error and the
run checkpoint already saved intact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_remote_reward import Scorer

from megatron_sat.checkpoint.manifest import verify_checkpoint_dir
from megatron_sat.checkpoint.run_state import latest_run_checkpoint
from megatron_sat.config import load_config
from megatron_sat.rollout.arith import make_arith_splits
from megatron_sat.rollout.remote_reward import RemoteRewardError
from megatron_sat.rollout.reward_plugins import RewardPluginError

EXAMPLE = Path(__file__).parents[1] / "examples" / "rewards" / "length_penalized_math.py"


def _config(tmp_path: Path, tiny_checkpoint: Path, *overrides: str):
    train, test = make_arith_splits(32, 4, seed=1, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(
        None,
        [
            f"init_checkpoint={tiny_checkpoint}",
            f"run_dir={tmp_path / 'run'}",
            f"data.train_path={tmp_path / 'train.jsonl'}",
            f"data.eval_path={tmp_path / 'test.jsonl'}",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=3",
            "rollout.eval_samples_per_prompt=1",
            "train.num_steps=2",
            "train.eval_every=2",
            *overrides,
        ],
    )


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


@pytest.mark.slow
def test_the_example_plugin_trains_and_its_metrics_are_logged(
    tmp_path, tiny_checkpoint, megatron_world
):
    import megatron_sat.training.rl as rl

    cfg = _config(
        tmp_path,
        tiny_checkpoint,
        "rollout.reward=python",
        f"rollout.reward_function={EXAMPLE}:length_penalized_math",
    )
    rl.run_rl(cfg)
    rows = {r["step"]: r for r in _rows(tmp_path / "run")}
    assert sorted(rows) == [0, 1, 2]
    for step in (1, 2):
        row = rows[step]
        assert "train/loss" in row
        # score = correct + length_penalty per sample, so the step means add up the same way;
        # 3 new tokens stay far below the 2000-character budget: no penalty.
        assert row["reward/length_penalty"] == 0.0
        assert row["rollout/reward"] == pytest.approx(row["reward/correct"], abs=1e-12)
        assert 0.0 <= row["reward/correct"] <= 1.0
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "reward: python" in saved and "length_penalized_math" in saved


@pytest.mark.slow
def test_a_plugin_returning_nan_is_refused_before_the_first_step(
    tmp_path, tiny_checkpoint, megatron_world
):
    import megatron_sat.training.rl as rl

    plugin = tmp_path / "nan_reward.py"
    plugin.write_text("def score(prompt, response, label, metadata):\n    return float('nan')\n")
    spec = f"rollout.reward_function={plugin}:score"
    cfg = _config(tmp_path, tiny_checkpoint, "rollout.reward=python", spec)
    with pytest.raises(ValueError, match=r"sample \d+ has reward nan .*refused before the optim"):
        rl.run_rl(cfg)
    assert all(r["step"] == 0 for r in _rows(tmp_path / "run"))  # no step logged
    assert latest_run_checkpoint(tmp_path / "run") is None  # nor saved


@pytest.mark.slow
def test_a_plugin_that_cannot_be_imported_fails_before_the_servers_start(
    tmp_path, tiny_checkpoint, megatron_world, monkeypatch
):
    import megatron_sat.training.rl as rl

    def no_fleet(cfg):
        raise AssertionError("the rollout servers were started")

    monkeypatch.setattr(rl, "rollout_fleet", no_fleet)
    spec = "rollout.reward_function=no_such_reward_pkg.scores:score"
    cfg = _config(tmp_path, tiny_checkpoint, "rollout.reward=python", spec)
    with pytest.raises(RewardPluginError, match=r"cannot import no_such_reward_pkg.scores \("):
        rl.run_rl(cfg)


@pytest.mark.slow
def test_a_run_retries_a_slow_and_a_failing_scorer_request_and_finishes(
    tmp_path, tiny_checkpoint, megatron_world
):
    """Asynchronous mode (the async pool's workers submit the rewards): the scorer's first
    request outlasts the 1 s timeout, its retry gets HTTP 503, the next try is scored."""
    import megatron_sat.training.rl as rl

    scorer = Scorer(script=[3.0, 503])
    try:
        cfg = _config(
            tmp_path,
            tiny_checkpoint,
            "rollout.reward=http",
            f"rollout.reward_url={scorer.url}",
            "rollout.reward_timeout_s=1",
            "rollout.reward_max_retries=2",
            "rollout.mode=fixed_lag",
            "rollout.lag=1",
        )
        rl.run_rl(cfg)
    finally:
        scorer.shutdown()
        scorer.server_close()
    rows = {r["step"]: r for r in _rows(tmp_path / "run")}
    assert sorted(rows) == [0, 1, 2]
    # the first request was sent three times: timed out, refused, scored (a greedy evaluation
    # later may send the same items again)
    # (other requests may interleave: the senders work concurrently)
    assert scorer.script == [] and scorer.bodies.count(scorer.bodies[0]) >= 3
    # the scorer's reward is the response's length in characters, a positive mean here
    assert all(rows[step]["rollout/reward"] > 0 for step in (1, 2))


@pytest.mark.slow
def test_a_remote_scorer_that_goes_down_ends_the_run_with_the_checkpoint_intact(
    tmp_path, tiny_checkpoint, megatron_world
):
    import megatron_sat.training.rl as rl

    run_dir = tmp_path / "run"

    class GoesDown(Scorer):
        """Answers until step 1's run checkpoint is committed, then HTTP 503 for good."""

        def __init__(self):
            super().__init__()
            self.script = _Down(run_dir)

    scorer = GoesDown()
    try:
        cfg = _config(
            tmp_path,
            tiny_checkpoint,
            "rollout.reward=http",
            f"rollout.reward_url={scorer.url}",
            "rollout.reward_max_retries=1",
            "rollout.reward_timeout_s=5",
            "train.save_every=1",
        )
        with pytest.raises(RemoteRewardError, match=rf"{scorer.url} failed 2 tries .*HTTP 503"):
            rl.run_rl(cfg)
    finally:
        scorer.shutdown()
        scorer.server_close()
    assert [r["step"] for r in _rows(run_dir)] == [0, 1]
    latest = latest_run_checkpoint(run_dir)
    assert latest is not None and latest.name == "step_00000001"
    assert verify_checkpoint_dir(latest) == (True, [])


class _Down(list):
    """A ``Scorer.script`` that answers (``pop`` -> None) until the run has a checkpoint, then
    HTTP 503 for every request."""

    def __init__(self, run_dir: Path):
        super().__init__([None])
        self.run_dir = run_dir

    def pop(self, index=-1):
        return 503 if latest_run_checkpoint(self.run_dir) is not None else None


@pytest.mark.slow
def test_the_eval_job_scores_with_the_configured_plugin(tiny_checkpoint, tmp_path):
    from megatron_sat.cli import main

    plugin = tmp_path / "chars.py"
    plugin.write_text(
        "def score(prompt, response, label, metadata):\n"
        "    return {'score': float(label in response), 'chars': len(response)}\n"
    )
    rows = [{"problem": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    argv = ["eval", "--data", str(data), "--prompt-key", "problem", "--label-key", "answer"]
    argv += ["--num-samples", "2", "--max-new-tokens", "4"]
    argv += [f"init_checkpoint={tiny_checkpoint}", f"run_dir={run_dir}"]
    argv += ["rollout.reward=python", f"rollout.reward_function={plugin}:score"]
    assert main(argv) == 0
    per_problem = [json.loads(x) for x in (run_dir / "eval/sums_step0.jsonl").open()]
    responses = [text for r in per_problem for text in r["responses"]]
    for r in per_problem:
        assert r["rewards"] == [float(r["label"] in text) for text in r["responses"]]
    result = json.loads((run_dir / "eval/results.jsonl").read_text().splitlines()[-1])
    assert result["metrics"]["reward/chars"] == pytest.approx(
        sum(len(t) for t in responses) / len(responses)
    )
