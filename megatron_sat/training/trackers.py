"""Experiment trackers beside TensorBoard: Weights & Biases when ``logging.wandb_project`` is set,
MLflow when ``logging.mlflow_experiment`` is.

A tracker receives what `RunLogger.log` writes to ``metrics.jsonl`` (the same names, the trainer
step as its step) and is closed with the logger. ``wandb`` and ``mlflow`` are optional extras,
imported only when configured; a configured tracker without its package is an error before
step 1, never a silent skip.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from megatron_sat.config.run import LoggingConfig

RUN_ID_FILE = "wandb_run_id"
MLFLOW_RUN_ID_FILE = "mlflow_run_id"
# MLflow's limits (mlflow/utils/validation.py: MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH)
# and the characters its metric names may hold (validate_param_and_metric_name, POSIX).
_MLFLOW_METRICS_PER_BATCH = 1000
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_NAME_BAD = re.compile(r"[^/\w.\- :]")


class Tracker(Protocol):
    """Where `RunLogger` mirrors each step's metrics."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Records the step's metrics (name -> float, non-finite values included)."""

    def close(self) -> None:
        """Flushes and ends the tracker's run."""


class WandbTracker:
    """One W&B run per training run, continued across resumes.

    Args:
        cfg: the ``logging`` section (``wandb_project`` set).
        run_dir: the run folder: W&B's local files go to ``<run_dir>/wandb/`` and the run id to
            ``<run_dir>/wandb_run_id``.
        config: the resolved run config (``RunConfig.to_dict()``), stored as the W&B config.
        resuming: True when the run continues from a checkpoint: the id saved by the earlier
            attempt is reused with ``resume="allow"``; a fresh run gets a new id.

    Raises:
        RuntimeError: ``wandb`` does not import (names the extra to install).
    """

    def __init__(
        self, cfg: LoggingConfig, run_dir: Path, config: Mapping[str, Any], resuming: bool
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError(
                f"logging.wandb_project={cfg.wandb_project!r} needs Weights & Biases, which "
                f"does not import ({err}): pip install -e .[wandb], or set "
                "logging.wandb_project=null"
            ) from err
        run_dir = Path(run_dir)
        id_file = run_dir / RUN_ID_FILE
        if resuming and id_file.exists():
            run_id = id_file.read_text(encoding="utf-8").strip()
        else:
            run_id = secrets.token_hex(8)
            id_file.write_text(run_id + "\n", encoding="utf-8")
        self._run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            name=cfg.wandb_run_name or run_dir.name,
            group=cfg.wandb_group,
            tags=list(cfg.wandb_tags),
            config=dict(config),
            dir=str(run_dir),
            id=run_id,
            resume="allow",
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved config as MLflow params: dotted keys ("rollout.group_size"), strings as
    they are and every other value as JSON ("8", "true", "null", "[...]")."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value if isinstance(value, str) else json.dumps(value)
    return out


def mlflow_metric_name(name: str) -> str:
    """``name`` with each character MLflow's metric names cannot hold replaced by "_" (MLflow
    allows letters, digits, "_", "-", ".", " ", ":" and "/"; "eval/pass@4" -> "eval/pass_4")."""
    return _MLFLOW_NAME_BAD.sub("_", name)


class MlflowTracker:
    """One MLflow run per training run, continued across resumes.

    Args:
        cfg: the ``logging`` section (``mlflow_experiment`` set).
        run_dir: the run folder; the MLflow run id is kept in ``<run_dir>/mlflow_run_id``.
        config: the resolved run config, logged as the run's params (`flat_params`).
        resuming: True when the run continues from a checkpoint: the saved run id is reused
            (set RUNNING again); its params are immutable in MLflow, so only keys it lacks are
            added and a changed value is warned about. A fresh run gets a new MLflow run.

    Raises:
        RuntimeError: ``mlflow`` does not import (names the extra to install).
        mlflow.exceptions.MlflowException: the tracking store refuses (e.g. a ``file:`` URI
            without ``MLFLOW_ALLOW_FILE_STORE=true``, which MLflow 3 asks for).
    """

    def __init__(
        self, cfg: LoggingConfig, run_dir: Path, config: Mapping[str, Any], resuming: bool
    ) -> None:
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Metric, Param
        except ImportError as err:
            raise RuntimeError(
                f"logging.mlflow_experiment={cfg.mlflow_experiment!r} needs MLflow, which does "
                f"not import ({err}): pip install -e .[mlflow], or set "
                "logging.mlflow_experiment=null"
            ) from err
        self._metric, self._renamed = Metric, set()
        self._client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
        id_file = Path(run_dir) / MLFLOW_RUN_ID_FILE
        params = flat_params(config)
        if resuming and id_file.exists():
            self._run_id = id_file.read_text(encoding="utf-8").strip()
            self._client.update_run(self._run_id, status="RUNNING")
            logged = self._client.get_run(self._run_id).data.params
            changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
            if changed:
                warnings.warn(
                    f"MLflow run {self._run_id} keeps its first attempt's params (MLflow params "
                    f"are immutable); the resumed config differs in {changed}",
                    stacklevel=2,
                )
            params = {k: v for k, v in params.items() if k not in logged}
        else:
            experiment = self._client.get_experiment_by_name(cfg.mlflow_experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self._client.create_experiment(cfg.mlflow_experiment)
            )
            run = self._client.create_run(
                experiment_id, run_name=cfg.mlflow_run_name or Path(run_dir).name
            )
            self._run_id = run.info.run_id
            id_file.write_text(self._run_id + "\n", encoding="utf-8")
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), _MLFLOW_PARAMS_PER_BATCH):
            self._client.log_batch(self._run_id, params=items[i : i + _MLFLOW_PARAMS_PER_BATCH])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        timestamp = int(time.time() * 1000)
        metrics = []
        for name, value in values.items():
            key = mlflow_metric_name(name)
            if key != name and name not in self._renamed:
                self._renamed.add(name)
                warnings.warn(f"MLflow metric {name!r} is logged as {key!r}", stacklevel=2)
            metrics.append(self._metric(key, float(value), timestamp, step))
        for i in range(0, len(metrics), _MLFLOW_METRICS_PER_BATCH):
            batch = metrics[i : i + _MLFLOW_METRICS_PER_BATCH]
            self._client.log_batch(self._run_id, metrics=batch)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def make_trackers(
    cfg: LoggingConfig, run_dir: Path, config: Mapping[str, Any], resuming: bool
) -> list[Tracker]:
    """The trackers the ``logging`` section asks for (empty when none is configured)."""
    trackers: list[Tracker] = []
    if cfg.wandb_project is not None:
        trackers.append(WandbTracker(cfg, run_dir, config, resuming))
    if cfg.mlflow_experiment is not None:
        trackers.append(MlflowTracker(cfg, run_dir, config, resuming))
    return trackers
