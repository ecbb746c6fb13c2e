"""Figures of one or more runs from their ``metrics.jsonl`` (see ``training.run_logger``).

One panel per metric, step on the x axis, one line per run: the curves a comparison of
objectives or lags needs (reward, held-out accuracy, train-rollout mismatch with and without
R3, SAT's gate rate, clip fractions, staleness, KL), written as one PNG.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

# (panel title, metric keys drawn in it): a panel is drawn when some run has one of its keys.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch reward", ("rollout/reward",)),
    ("held-out greedy accuracy", ("eval/acc_greedy",)),
    ("held-out avg@k", ("eval/avg_at_k",)),
    (
        "mismatch |log pi - log mu|",
        ("train/mismatch_abs_logratio", "train/mismatch_abs_logratio_live"),
    ),
    ("SAT gate rate", ("train/sat_gate_rate",)),
    ("clip fraction", ("train/clipfrac_low", "train/clipfrac_high")),
    ("staleness (versions)", ("rollout/staleness_mean",)),
    ("KL to the reference", ("train/kl_loss",)),
    ("entropy", ("train/entropy",)),
)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``, in file order.

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: naming the file and line of a malformed row.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run_dir} a run directory?)")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {number}: not JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}, line {number}: a row needs an integer 'step'")
        rows.append(row)
    return rows


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path) -> list[str]:
    """Draw every panel of :data:`PANELS` that some run has data for; write ``out`` (PNG).

    Rows without a key, or with null (a non-finite value), leave a gap. Runs are labelled by
    their directory names.

    Returns:
        The titles of the panels drawn, in order.

    Raises:
        ValueError: without runs, or when no run has any plotted metric.
        FileNotFoundError / ValueError: as :func:`read_metrics`.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    runs = {Path(d).name or str(d): read_metrics(d) for d in run_dirs}
    panels = [
        (title, keys)
        for title, keys in PANELS
        if any(row.get(k) is not None for rows in runs.values() for row in rows for k in keys)
    ]
    if not panels:
        raise ValueError(f"none of {list(runs)} has any of the plotted metrics")
    columns = min(3, len(panels))
    rows_n = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(5 * columns, 3.4 * rows_n), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for name, rows in runs.items():
            for key in keys:
                points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
                if points:
                    label = name if len(keys) == 1 else f"{name} {key.rsplit('/', 1)[-1]}"
                    ax.plot(
                        *zip(*points, strict=True),
                        marker="." if len(points) < 30 else None,
                        label=label,
                    )
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [title for title, _ in panels]
