"""What a finished or interrupted run leaves in its folder, and the refusal to start a new run
over it.

A run writes ``metrics.jsonl`` (appended: ``training.run_logger``), ``summary.json`` and
``checkpoint/`` at its end, and run checkpoints under ``checkpoints/`` (``checkpoint.run_state``).
A second run started in the same folder without ``train.resume`` would append its steps to the
first one's metrics and replace its summary and checkpoints, silently: ``train`` refuses it
(``check_new_run``). With ``train.resume`` the run continues from the latest committed run
checkpoint, or, when there is none (a run killed before its first commit), starts from step 1
and drops every line the killed run logged.
"""

from __future__ import annotations

from pathlib import Path

from megatron_sat.checkpoint.run_state import CHECKPOINTS

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


def previous_run(run_dir: str | Path) -> list[str]:
    """What of a run ``run_dir`` holds, as paths relative to it: ``metrics.jsonl`` when it has
    a line, ``summary.json``, and ``checkpoints/step_*`` folders (committed or not). Empty
    for a missing or empty folder, or one holding only the ``config.yaml`` of a run that
    failed before its first step."""
    run = Path(run_dir)
    found = []
    metrics = run / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS)
    if (run / SUMMARY).is_file():
        found.append(SUMMARY)
    found += sorted(f"{CHECKPOINTS}/{p.name}" for p in (run / CHECKPOINTS).glob("step_*"))
    return found


def check_new_run(run_dir: str | Path, resume: bool) -> None:
    """Refuse to start a run (``resume`` False) in a folder that holds another one.

    Raises:
        FileExistsError: naming the folder, what it holds, and the two ways on.
    """
    if resume:
        return
    found = previous_run(run_dir)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise FileExistsError(
            f"run_dir={str(run_dir)!r} already holds a run ({shown}): continue it with "
            "train.resume=true, or give this run a run_dir of its own (a new run there would "
            "append to its metrics.jsonl and replace its summary and checkpoints)"
        )
