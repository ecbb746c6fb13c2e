"""Reads the records of a W&B transaction log (``run-<id>.wandb``), for tests.

wandb 0.31 has no Python reader of its own files any more (the Go core writes them), so this
follows the format it writes: a 7-byte header (``:W&B``, magic 0xBEE1 little-endian, version 0),
then LevelDB's log format: 32 KiB blocks of chunks, each a 7-byte header (CRC32C 4 bytes, length 2
bytes little-endian, type 1 byte: 1 full, 2 first, 3 middle, 4 last) and its bytes; a block's tail
shorter than a header is padding. Each record is a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

BLOCK = 32 * 1024
HEADER = b":W&B\xe1\xbe\x00"


def finished(path: Path, timeout_s: float = 60.0) -> Path:
    """``path`` once its run's ``exit`` record is in it. ``run.finish()`` returns before W&B's
    core has written everything (seen on a loaded machine: the history row arrived after the
    test read the file).

    Raises:
        TimeoutError: no exit record after ``timeout_s``, naming the record types found.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        kinds = [r.WhichOneof("record_type") for r in records(path)] if Path(path).exists() else []
        if "exit" in kinds:
            return path
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: no exit record after {timeout_s} s; records {kinds}")
        time.sleep(0.2)


def run_file(run_dir: Path, run_id: str, nth: int = 0, timeout_s: float = 60.0) -> Path:
    """The ``nth`` (by start time) offline file of run ``run_id`` under ``run_dir/wandb``, once
    it is `finished` (W&B's core may create it after ``run.finish()`` returns).

    Raises:
        TimeoutError: fewer than ``nth + 1`` such files after ``timeout_s``.
    """
    pattern = f"offline-run-*-{run_id}/run-{run_id}.wandb"
    deadline = time.monotonic() + timeout_s
    while len(files := sorted((Path(run_dir) / "wandb").glob(pattern))) <= nth:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no file {nth} matching {pattern} in {run_dir}/wandb: {files}")
        time.sleep(0.2)
    return finished(files[nth], timeout_s)


def records(path: Path) -> list:
    """Every ``Record`` in the file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path} does not start with W&B's header {HEADER!r}")
    out, pos, pending = [], len(HEADER), b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            continue
        pending += chunk
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(path: Path) -> list[dict]:
    """The logged rows: ``{"_step": int, name: value, ...}`` per ``run.log`` call."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            if record.history.HasField("step"):
                row.setdefault("_step", record.history.step.num)
            rows.append(row)
    return rows


def config(path: Path) -> dict:
    """The run's config (the last value of each key across its config records)."""
    out = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        items = record.config.update if kind == "config" else None
        if kind == "run":
            items = record.run.config.update
        for item in items or []:
            key = item.key or "/".join(item.nested_key)
            out[key] = json.loads(item.value_json)
    return out
