"""Experiment trackers beside TensorBoard: Weights & Biases when ``logging.wandb_project`` is set,
MLflow when ``logging.mlflow_experiment`` is.

A tracker receives what `RunLogger.log` writes to ``metrics.jsonl`` (the same names, the trainer
step as its step) and is closed with the logger. ``wandb`` and ``mlflow`` are optional extras,
imported only when configured; a configured tracker without its package is an error before
step 1, never a silent skip. A run that ends by an exception closes its trackers as failed
(MLflow status FAILED, W&B exit code 1).

Neither tracker can take back what it logged: after a crash, the steps between the resumed
checkpoint and the crash are logged again by the resumed run, and ``metrics.jsonl`` keeps only
the rerun's lines, but MLflow keeps both attempts' values at those steps (its metrics cannot be
deleted) and W&B, whose steps only move forward, keeps the crashed attempt's and drops the
rerun's. (W&B's ``resume_from="<run id>?_step=<step>"`` would rewind the run, but rewinding is a
preview feature of W&B's cloud that truncates the history on the server, not available on
Self-Managed servers nor offline, so it is not used.)
"""

from __future__ import annotations

import hashlib
import json
import os
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
_MLFLOW_KEY_LENGTH = 250  # MAX_ENTITY_KEY_LENGTH


class Tracker(Protocol):
    """Where `RunLogger` mirrors each step's metrics."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Records the step's metrics (name -> float, non-finite values included)."""

    def close(self, failed: bool = False) -> None:
        """Flushes and ends the tracker's run, marked failed when ``failed`` (the run raised)."""


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

    def close(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)


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
    """``name`` as a metric name MLflow accepts (mlflow/utils/validation.py,
    ``_validate_metric_name``), unchanged when it already is one.

    Each character MLflow's names cannot hold becomes "_" (MLflow allows letters, digits, "_",
    "-", ".", " ", ":" and "/"; "eval/pass@4" -> "eval/pass_4"); empty path segments are
    dropped and a "." or ".." segment becomes "_" or "__" (MLflow refuses a name that is not its
    own normalized path: "reward/", "reward//x", "a/../b"); an empty result is "_"; a name over
    MLflow's 250 characters is cut and ends in "-" and 8 hex digits of its hash, so that two long
    names stay apart.
    """
    segments = _MLFLOW_NAME_BAD.sub("_", name).split("/")
    key = "/".join(seg if seg not in (".", "..") else "_" * len(seg) for seg in segments if seg)
    key = key or "_"
    if len(key) > _MLFLOW_KEY_LENGTH:
        digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        key = key[: _MLFLOW_KEY_LENGTH - 9].rstrip("/") + "-" + digest
    return key


def mlflow_tracking_uri(cfg: LoggingConfig) -> str:
    """The MLflow store to log to: ``logging.mlflow_tracking_uri``, else the
    ``MLFLOW_TRACKING_URI`` environment variable (as MLflow itself reads it).

    Raises:
        ValueError: neither is set. MLflow's own default (``sqlite:///mlflow.db`` in MLflow 3)
            needs SQLAlchemy, which the ``[mlflow]`` extra (``mlflow-skinny``) lacks, and a
            relative database in the working directory is not where a run's records belong.
    """
    uri = cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri:
        raise ValueError(
            f"logging.mlflow_experiment={cfg.mlflow_experiment!r} needs a tracking store: set "
            "logging.mlflow_tracking_uri (a server, http://host:5000, or file:/path/mlruns with "
            "MLFLOW_ALLOW_FILE_STORE=true) or the MLFLOW_TRACKING_URI environment variable"
        )
    return uri


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
        ValueError: no tracking store is configured (`mlflow_tracking_uri`).
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
        self._metric, self._keys, self._names = Metric, {}, {}
        self._client = MlflowClient(tracking_uri=mlflow_tracking_uri(cfg))
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
            metrics.append(self._metric(self._key(name), float(value), timestamp, step))
        for i in range(0, len(metrics), _MLFLOW_METRICS_PER_BATCH):
            batch = metrics[i : i + _MLFLOW_METRICS_PER_BATCH]
            self._client.log_batch(self._run_id, metrics=batch)

    def _key(self, name: str) -> str:
        """``name``'s MLflow key (`mlflow_metric_name`), warned about once when it differs;
        a key another name already has gets that name's hash appended."""
        key = self._keys.get(name)
        if key is not None:
            return key
        key = mlflow_metric_name(name)
        if self._names.get(key, name) != name:
            digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
            key = mlflow_metric_name(f"{key[: _MLFLOW_KEY_LENGTH - 9]}-{digest}")
        self._keys[name], self._names[key] = key, name
        if key != name:
            warnings.warn(f"MLflow metric {name!r} is logged as {key!r}", stacklevel=3)
        return key

    def close(self, failed: bool = False) -> None:
        self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")


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
