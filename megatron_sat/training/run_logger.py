"""Per-run metric logging: TensorBoard events plus a line-per-step ``metrics.jsonl``, mirrored
to the configured experiment trackers (``training.trackers``: W&B).

``metrics.jsonl`` is the file that scripts and tests read: one JSON object per `RunLogger.log`
call, ``{"step": int, "<name>": float | null, ...}``, appended and flushed at once so that a
crashed or resumed run keeps every logged step. JSON has no NaN or infinity; non-finite values
are written as null there (TensorBoard receives them unchanged).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import torch
from torch.utils.tensorboard import SummaryWriter

from megatron_sat.training.trackers import Tracker


def _to_float(name: str, value: float | torch.Tensor) -> float:
    """A metric value as a Python float; tensors must hold exactly one element."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {name!r} is a tensor of shape {tuple(value.shape)}; log one element"
            )
        return float(value.detach().cpu().item())
    if isinstance(value, (bool, int, float)):
        return float(value)
    raise TypeError(f"metric {name!r} has type {type(value).__name__}; expected float or tensor")


def _json_safe(value: Any, path: str) -> Any:
    """Copies `value` for JSON: non-finite floats -> None, one-element tensors -> float.

    Raises:
        TypeError: A value JSON cannot hold; the message names its path ("summary.a[2]").
    """
    if isinstance(value, torch.Tensor):
        value = _to_float(path, value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"{path} has the non-string key {key!r}")
        return {key: _json_safe(item, f"{path}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise TypeError(f"{path} has type {type(value).__name__}, which JSON cannot hold")


class RunLogger:
    """Writes TensorBoard events, ``metrics.jsonl`` and ``summary.json`` under one run folder.

    Use as a context manager, or call `close` when done. Not thread-safe: log from one thread.

    Args:
        run_dir: Folder of the run; created if missing. An existing ``metrics.jsonl`` is appended
            to (a resumed run continues its file).
        resume_step: the step a resumed run continues from (its checkpoint's): the steps a
            crashed run logged after it are dropped from ``metrics.jsonl`` and purged from the
            TensorBoard events (``SummaryWriter(purge_step=...)``), since they are run again.
        trackers: further sinks of every logged step (W&B, MLflow), closed with the logger
            (as failed when its ``with`` block raised); they get the float values as given
            (non-finite included).
    """

    def __init__(
        self, run_dir: Path, resume_step: int | None = None, trackers: Sequence[Tracker] = ()
    ) -> None:
        self.trackers = list(trackers)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.summary_path = self.run_dir / "summary.json"
        purge = None
        if resume_step is not None:
            purge = resume_step + 1
            if self.metrics_path.exists():
                lines = self.metrics_path.read_text(encoding="utf-8").splitlines(keepends=True)
                kept = [line for line in lines[:-1] if json.loads(line)["step"] <= resume_step]
                if lines:  # a crash can cut the last line short: drop it then
                    try:
                        if json.loads(lines[-1])["step"] <= resume_step:
                            kept.append(lines[-1])
                    except json.JSONDecodeError:
                        pass
                self.metrics_path.write_text("".join(kept), encoding="utf-8")
        self._writer: SummaryWriter | None = SummaryWriter(
            log_dir=str(self.run_dir), purge_step=purge
        )
        self._metrics_file = self.metrics_path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float | torch.Tensor]) -> None:
        """Records `metrics` at `step` in TensorBoard and as one line of ``metrics.jsonl``.

        Args:
            step: Trainer step (optimizer steps), an int >= 0.
            metrics: Name -> float, int, bool or one-element tensor. The name "step" is reserved.

        Raises:
            RuntimeError: The logger is closed.
            ValueError: A negative or non-int step, the name "step", an empty name, or a tensor
                with more than one element.
            TypeError: A value of another type.
        """
        if self._writer is None:
            raise RuntimeError(f"RunLogger for {self.run_dir} is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"metric names must be non-empty strings, got {name!r}")
            if name == "step":
                raise ValueError("the metric name 'step' is reserved for the step number")
            values[name] = _to_float(name, value)
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)
        row = {"step": step} | {name: _json_safe(value, name) for name, value in values.items()}
        # allow_nan=False: a non-finite value that slipped past _json_safe must fail here rather
        # than write "NaN", which strict JSON readers reject.
        self._metrics_file.write(json.dumps(row, allow_nan=False) + "\n")
        self._metrics_file.flush()
        for tracker in self.trackers:
            tracker.log(step, values)

    def write_summary(self, summary: dict) -> Path:
        """Writes `summary` as pretty JSON to ``summary.json`` (replacing it atomically).

        Args:
            summary: JSON-like dict; one-element tensors become floats, non-finite floats null.

        Returns:
            The path of ``summary.json``.

        Raises:
            TypeError: A value JSON cannot hold (the message names its key path).
        """
        text = json.dumps(_json_safe(summary, "summary"), indent=2, sort_keys=True, allow_nan=False)
        # Write-then-rename so a reader never sees a half-written summary.
        tmp_path = self.summary_path.with_suffix(".json.tmp")
        tmp_path.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp_path, self.summary_path)
        return self.summary_path

    def close(self, failed: bool = False) -> None:
        """Flushes and closes both writers and the trackers (their runs marked failed when
        ``failed``); calling it again does nothing."""
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        self._metrics_file.close()
        for tracker in self.trackers:
            tracker.close(failed)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(failed=exc_type is not None)
