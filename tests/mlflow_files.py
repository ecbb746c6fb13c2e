"""Reads an MLflow file store (``file:`` tracking URI) without MLflow, for tests.

The layout MLflow's ``FileStore`` writes (mlflow/store/tracking/file_store.py):
``<root>/<experiment id>/<run id>/metrics/<metric name>``, one line per logged value,
``"<timestamp ms> <value> <step>"`` (a "/" in a name is a subfolder), and
``params/<param name>`` holding the value; ``meta.yaml`` beside them.
"""

from __future__ import annotations

from pathlib import Path


def run_folder(root: Path, run_id: str) -> Path:
    """The folder of run ``run_id`` in the store at ``root``."""
    (folder,) = Path(root).glob(f"*/{run_id}")
    return folder


def metrics(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """name -> [(step, value), ...] in logged order."""
    out = {}
    base = folder / "metrics"
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        rows = [line.split() for line in path.read_text().splitlines()]
        out[path.relative_to(base).as_posix()] = [(int(s), float(v)) for _, v, s in rows]
    return out


def params(folder: Path) -> dict[str, str]:
    base = folder / "params"
    return {p.relative_to(base).as_posix(): p.read_text() for p in base.rglob("*") if p.is_file()}
