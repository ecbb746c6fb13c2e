"""A real RL run with ``logging.wandb_project`` (W&B offline) and ``logging.mlflow_experiment`` (an
MLflow file store) set: the run's W&B files and MLflow store hold every step metric of
``metrics.jsonl`` at the same step, and the resolved config."""

from __future__ import annotations

import json
import math

import mlflow_files
import pytest
import wandb_records

from megatron_sat.config import load_config
from megatron_sat.rollout.arith import make_arith_splits
from megatron_sat.training.trackers import MLFLOW_RUN_ID_FILE, RUN_ID_FILE, mlflow_metric_name


@pytest.mark.slow
def test_rl_run_logs_every_step_metric_to_wandb_and_mlflow(
    tmp_path, tiny_checkpoint, megatron_world, monkeypatch
):
    import megatron_sat.training.rl as rl

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    train, test = make_arith_splits(32, 4, seed=1, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    rl.run_rl(
        load_config(
            None,
            [
                f"init_checkpoint={tiny_checkpoint}",
                f"run_dir={run_dir}",
                f"data.train_path={tmp_path / 'train.jsonl'}",
                f"data.eval_path={tmp_path / 'test.jsonl'}",
                "rollout.prompts_per_step=2",
                "rollout.group_size=2",
                "rollout.max_new_tokens=3",
                "rollout.eval_samples_per_prompt=1",
                "train.num_steps=2",
                "train.eval_every=2",
                "logging.wandb_project=megatron-sat-test",
                "logging.wandb_tags=[ci]",
                "logging.mlflow_experiment=megatron-sat-test",
                f"logging.mlflow_tracking_uri=file:{tmp_path / 'mlruns'}",
            ],
        )
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    path = wandb_records.run_file(run_dir, run_id)
    logged = {r["_step"]: r for r in wandb_records.history(path)}
    assert sorted(logged) == [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        for name, value in row.items():
            if name == "step":
                continue
            got = logged[row["step"]][name]
            assert got == value or (value is None and not math.isfinite(got)), name
    assert "train/loss" in rows[1] and "eval/acc_greedy" in rows[-1]
    config = wandb_records.config(path)
    assert config["rollout"]["group_size"] == 2
    assert config["logging"]["wandb_tags"] == ["ci"]
    folder = mlflow_files.run_folder(
        tmp_path / "mlruns", (run_dir / MLFLOW_RUN_ID_FILE).read_text().strip()
    )
    tracked = mlflow_files.metrics(folder)
    for row in rows:
        for name, value in row.items():
            if name == "step":
                continue
            (got,) = [v for step, v in tracked[mlflow_metric_name(name)] if step == row["step"]]
            assert got == value or (value is None and not math.isfinite(got)), name
    assert mlflow_files.params(folder)["rollout.group_size"] == "2"
