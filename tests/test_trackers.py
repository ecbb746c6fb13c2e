"""W&B tracking (``logging.wandb_project``) and MLflow tracking (``logging.mlflow_experiment``):
the offline run's / file store's own files hold every logged step metric and the resolved
config; a resumed run continues the same tracked run; a missing package or an incomplete section
is refused before anything is logged."""

from __future__ import annotations

import math
import sys
import time

import mlflow_files
import pytest
import wandb_records

from megatron_sat.config import LoggingConfig, load_config
from megatron_sat.training.rl import validate_run
from megatron_sat.training.run_logger import RunLogger
from megatron_sat.training.trackers import (
    MLFLOW_RUN_ID_FILE,
    RUN_ID_FILE,
    MlflowTracker,
    WandbTracker,
    make_trackers,
    mlflow_metric_name,
)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def _run_file(run_dir, run_id, nth=0):
    return wandb_records.run_file(run_dir, run_id, nth)


@pytest.mark.slow
def test_offline_files_hold_the_step_metrics_and_config(tmp_path, offline):
    cfg = load_config(
        overrides=[
            "logging.wandb_project=sat",
            "logging.wandb_tags=[r3, lag8]",
            f"run_dir={tmp_path}",
        ]
    )
    trackers = make_trackers(cfg.logging, tmp_path, cfg.to_dict(), resuming=False)
    with RunLogger(tmp_path, trackers=trackers) as logger:
        logger.log(1, {"train/loss": 0.25, "eval/greedy_acc": 0.5})
        logger.log(2, {"train/loss": float("nan"), "rollout/reward": 1})
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    path = _run_file(tmp_path, run_id)
    rows = [
        {k: v for k, v in r.items() if not k.startswith("_") or k == "_step"}
        for r in wandb_records.history(path)
    ]
    assert rows[0] == {"_step": 1, "train/loss": 0.25, "eval/greedy_acc": 0.5}
    assert rows[1]["_step"] == 2 and rows[1]["rollout/reward"] == 1.0
    assert math.isnan(rows[1]["train/loss"])  # metrics.jsonl has null; W&B keeps the NaN
    config = wandb_records.config(path)
    assert config["objective"]["name"] == cfg.objective.name
    assert config["logging"]["wandb_tags"] == ["r3", "lag8"]


@pytest.mark.slow
def test_resume_continues_the_same_run(tmp_path, offline):
    cfg = LoggingConfig(wandb_project="sat")
    with RunLogger(tmp_path, trackers=[WandbTracker(cfg, tmp_path, {}, resuming=False)]) as log:
        log.log(1, {"a": 1.0})
    first = (tmp_path / RUN_ID_FILE).read_text().strip()
    # W&B names an offline run's folder by the second it starts: two attempts within one second
    # share a folder and the later one's records are not kept there (a real resume rebuilds the
    # trainer first, which takes longer)
    time.sleep(1.1)
    with RunLogger(tmp_path, 1, [WandbTracker(cfg, tmp_path, {}, resuming=True)]) as log:
        log.log(2, {"a": 2.0})
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == first
    resumed = wandb_records.history(_run_file(tmp_path, first, nth=1))
    assert [(r["_step"], r["a"]) for r in resumed] == [(2, 2.0)]
    # a fresh run in the same folder is a new W&B run
    WandbTracker(cfg, tmp_path, {}, resuming=False).close()
    assert (tmp_path / RUN_ID_FILE).read_text().strip() != first


def test_missing_wandb_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(RuntimeError, match=r"pip install -e \.\[wandb\]"):
        make_trackers(LoggingConfig(wandb_project="sat"), tmp_path, {}, resuming=False)
    assert make_trackers(LoggingConfig(), tmp_path, {}, resuming=False) == []


@pytest.mark.parametrize(
    "override, message",
    [
        ("logging.wandb_tags=[a]", "wandb_project is null"),
        ("logging.wandb_project=''", "logging.wandb_project must be a non-empty string"),
        ("logging.wandb_tags=a", "must be a list"),
    ],
)
def test_bad_logging_sections_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=[override])


# ----------------------------------------------------------------------------- MLflow


@pytest.fixture
def file_store(tmp_path, monkeypatch):
    """A local MLflow file store (MLflow 3 asks for the opt-in to its file backend)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return tmp_path / "mlruns"


def test_mlflow_file_store_holds_the_step_metrics_and_config(tmp_path, file_store):
    cfg = load_config(
        overrides=[
            "logging.mlflow_experiment=sat",
            f"logging.mlflow_tracking_uri=file:{file_store}",
            f"run_dir={tmp_path}",
        ]
    )
    trackers = make_trackers(cfg.logging, tmp_path, cfg.to_dict(), resuming=False)
    with RunLogger(tmp_path, trackers=trackers) as logger:
        logger.log(1, {"train/loss": 0.25, "eval/greedy_acc": 0.5})
        with pytest.warns(UserWarning, match=r"'eval/pass@4' is logged as 'eval/pass_4'"):
            logger.log(2, {"train/loss": float("nan"), "eval/pass@4": 1})
    run_id = (tmp_path / MLFLOW_RUN_ID_FILE).read_text().strip()
    folder = mlflow_files.run_folder(file_store, run_id)
    logged = mlflow_files.metrics(folder)
    assert logged["eval/greedy_acc"] == [(1, 0.5)] and logged["eval/pass_4"] == [(2, 1.0)]
    assert logged["train/loss"][0] == (1, 0.25) and math.isnan(logged["train/loss"][1][1])
    params = mlflow_files.params(folder)
    assert params["objective.name"] == cfg.objective.name
    assert params["rollout.group_size"] == str(cfg.rollout.group_size)
    assert params["logging.mlflow_experiment"] == "sat"
    assert "status: 3" in (folder / "meta.yaml").read_text()  # RunStatus.FINISHED


def test_mlflow_resume_continues_the_same_run(tmp_path, file_store):
    cfg = LoggingConfig(mlflow_experiment="sat", mlflow_tracking_uri=f"file:{file_store}")
    config = {"train": {"lr": 1e-6, "num_steps": 4}}
    with RunLogger(tmp_path, trackers=[MlflowTracker(cfg, tmp_path, config, False)]) as log:
        log.log(1, {"a": 1.0})
    first = (tmp_path / MLFLOW_RUN_ID_FILE).read_text().strip()
    resumed = {"train": {"lr": 1e-6, "num_steps": 8, "resume": True}}
    with pytest.warns(UserWarning, match=r"differs in \['train.num_steps'\]"):
        tracker = MlflowTracker(cfg, tmp_path, resumed, True)
    with RunLogger(tmp_path, 1, [tracker]) as log:
        log.log(2, {"a": 2.0})
    assert (tmp_path / MLFLOW_RUN_ID_FILE).read_text().strip() == first
    folder = mlflow_files.run_folder(file_store, first)
    assert mlflow_files.metrics(folder) == {"a": [(1, 1.0), (2, 2.0)]}
    assert mlflow_files.params(folder) == {
        "train.lr": "1e-06",
        "train.num_steps": "4",
        "train.resume": "true",
    }
    MlflowTracker(cfg, tmp_path, {}, resuming=False).close()  # a fresh run: a new MLflow run
    assert (tmp_path / MLFLOW_RUN_ID_FILE).read_text().strip() != first


def test_missing_mlflow_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(RuntimeError, match=r"pip install -e \.\[mlflow\]"):
        make_trackers(LoggingConfig(mlflow_experiment="sat"), tmp_path, {}, resuming=False)
    with pytest.raises(ValueError, match="mlflow_experiment is null"):
        load_config(overrides=["logging.mlflow_run_name=x"])


def test_mlflow_without_a_tracking_store_is_named(tmp_path, monkeypatch, file_store):
    # MLflow 3's own default, sqlite:///mlflow.db, needs SQLAlchemy, which mlflow-skinny lacks
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = LoggingConfig(mlflow_experiment="sat")
    with pytest.raises(ValueError, match=r"set logging\.mlflow_tracking_uri"):
        MlflowTracker(cfg, tmp_path, {}, resuming=False)
    with pytest.raises(ValueError, match=r"set logging\.mlflow_tracking_uri"):  # before any build
        validate_run(load_config(overrides=["logging.mlflow_experiment=sat"]))
    assert not (tmp_path / MLFLOW_RUN_ID_FILE).exists()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{file_store}")  # MLflow's own variable
    MlflowTracker(cfg, tmp_path, {}, resuming=False).close()
    run_id = (tmp_path / MLFLOW_RUN_ID_FILE).read_text().strip()
    assert mlflow_files.run_folder(file_store, run_id).is_dir()


def test_a_run_that_raises_ends_its_trackers_failed(tmp_path, file_store):
    cfg = LoggingConfig(mlflow_experiment="sat", mlflow_tracking_uri=f"file:{file_store}")
    with pytest.raises(RuntimeError, match="crashed"):
        with RunLogger(tmp_path, trackers=[MlflowTracker(cfg, tmp_path, {}, False)]) as log:
            log.log(1, {"a": 1.0})
            raise RuntimeError("trainer crashed at step 2")
    folder = mlflow_files.run_folder(
        file_store, (tmp_path / MLFLOW_RUN_ID_FILE).read_text().strip()
    )
    assert "status: 4" in (folder / "meta.yaml").read_text()  # RunStatus.FAILED


@pytest.mark.slow
def test_a_run_that_raises_ends_its_wandb_run_with_exit_code_1(tmp_path, offline):
    cfg = LoggingConfig(wandb_project="sat")
    with pytest.raises(KeyError):
        with RunLogger(tmp_path, trackers=[WandbTracker(cfg, tmp_path, {}, False)]) as log:
            log.log(1, {"a": 1.0})
            raise KeyError("x")
    exits = [
        r.exit.exit_code
        for r in wandb_records.records(
            _run_file(tmp_path, (tmp_path / RUN_ID_FILE).read_text().strip())
        )
        if r.WhichOneof("record_type") == "exit"
    ]
    assert exits == [1]


@pytest.mark.parametrize(
    "name, key",
    [
        ("eval/pass@4", "eval/pass_4"),
        ("reward/", "reward"),
        ("reward//x", "reward/x"),
        ("/reward/x", "reward/x"),
        ("reward/../x", "reward/__/x"),
        ("..", "__"),
        ("a/./b", "a/_/b"),
        ("", "_"),
        ("//", "_"),
        ("reward/score.v2 t:1", "reward/score.v2 t:1"),  # already valid: unchanged
    ],
)
def test_mlflow_metric_names_are_made_valid(name, key):
    from mlflow.utils.validation import _validate_metric_name

    assert mlflow_metric_name(name) == key
    _validate_metric_name(key)  # MLflow's own check raises on a name it refuses


def test_long_mlflow_metric_names_are_cut_apart(tmp_path, file_store):
    from mlflow.utils.validation import _validate_metric_name

    long_a, long_b = "reward/" + "a" * 300, "reward/" + "a" * 299 + "b"
    key_a, key_b = mlflow_metric_name(long_a), mlflow_metric_name(long_b)
    assert len(key_a) == len(key_b) == 250 and key_a != key_b
    assert key_a[:241] == long_a[:241] and key_a[241] == "-"
    _validate_metric_name(key_a)
    # logged after a trained step: renamed with a warning, never an error; two names that
    # map to one key stay apart
    cfg = LoggingConfig(mlflow_experiment="sat", mlflow_tracking_uri=f"file:{file_store}")
    with RunLogger(tmp_path, trackers=[MlflowTracker(cfg, tmp_path, {}, False)]) as log:
        with pytest.warns(UserWarning, match="is logged as"):
            log.log(1, {long_a: 1.0, "score/": 2.0, "score": 3.0, "reward//x": 4.0})
    logged = mlflow_files.metrics(
        mlflow_files.run_folder(file_store, (tmp_path / MLFLOW_RUN_ID_FILE).read_text().strip())
    )
    assert logged[key_a] == [(1, 1.0)] and logged["reward/x"] == [(1, 4.0)]
    assert logged["score"] == [(1, 2.0)]  # the first name to claim a key keeps it
    assert [v for k, v in logged.items() if k.startswith("score-")] == [[(1, 3.0)]]
    assert sorted(v for k, v in logged.items() if k.startswith("score")) == [
        [(1, 2.0)],
        [(1, 3.0)],
    ]
