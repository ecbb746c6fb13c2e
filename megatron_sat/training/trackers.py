"""Experiment trackers beside TensorBoard: Weights & Biases when ``logging.wandb_project`` is set.

A tracker receives what `RunLogger.log` writes to ``metrics.jsonl`` (the same names, the trainer
step as its step) and is closed with the logger. ``wandb`` is an optional extra, imported only
when a project is configured; a configured project without it is an error before step 1, never
a silent skip.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from megatron_sat.config.run import LoggingConfig

RUN_ID_FILE = "wandb_run_id"


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


def make_trackers(
    cfg: LoggingConfig, run_dir: Path, config: Mapping[str, Any], resuming: bool
) -> list[Tracker]:
    """The trackers the ``logging`` section asks for (empty when none is configured)."""
    if cfg.wandb_project is None:
        return []
    return [WandbTracker(cfg, run_dir, config, resuming)]
