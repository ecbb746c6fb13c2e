"""Lag sweeps: a grid of methods x lags x seeds, one run directory per cell, and its report.

A grid file (YAML, e.g. ``examples/sweeps/table1.yaml``)::

    name: table1
    base_config: examples/configs/tiny_cpu_sat_gspo_r3.yaml   # a RunConfig YAML (or null)
    output_dir: runs/sweeps/table1                            # cells go under it
    overrides: [train.num_steps=60]                           # every cell
    lag_overrides: [rollout.mode=fixed_lag, "rollout.lag={lag}"]
    lags: [1, 8]
    seeds: [1, 2]
    order: row                                                # or seed (seed, row, lag)
    rows:
      - id: grpo_paper
        label: GRPO (recomputed old, as the paper ran it)
        overrides: [objective.name=grpo, objective.ratio_denominator=recomputed_old]

A cell is (row, lag, seed); its run directory is ``output_dir/<row id>/lag<L>_seed<S>`` with
``run_dir``, ``train.seed`` and the lag overrides set. ``run_sweep`` runs the cells one process
at a time (``megatron-sat train`` in a subprocess, so each cell gets a fresh megatron-core
world); a cell whose ``summary.json`` exists is finished and skipped, so a sweep resumes where
it stopped, across sessions. An unfinished cell that logged anything is run with
``train.resume=true``: it continues from its run checkpoint, or, without one, starts again
from step 1, dropping the lines the interrupted attempt logged (``training.run_folder``).
``render_slurm_array`` writes an sbatch job array with one task per cell (``megatron-sat
sweep --cell i``).

``sweep_report`` reads every finished cell's ``metrics.jsonl`` and writes ``table.md`` and
figures; the statistics per row and lag are described in ``CELL_STATS`` and ``COLLAPSE_RULE``.
"""

from __future__ import annotations

import functools
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_sat.platform.threads import child_env
from megatron_sat.training.run_folder import previous_run

# A run collapsed when its final held-out accuracy lost more than this share of its best.
COLLAPSE_DROP = 0.2
COLLAPSE_RULE = (
    f"collapsed = final held-out greedy accuracy < {1 - COLLAPSE_DROP:.1f} x the run's best "
    "(it lost more than 20% of its best); the flag counts the seeds that collapsed"
)
ACCURACY_KEY = "eval/acc_greedy"
MISMATCH_KEY = "train/mismatch_abs_logratio"
LAST_FRACTION = 0.25  # mismatch and ESS are averaged over the last quarter of the steps


@dataclass(frozen=True)
class SweepRow:
    """One method row: ``id`` (a directory name), ``label`` (the table's), its overrides."""

    id: str
    label: str
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class SweepCell:
    """One run of the grid."""

    index: int
    row: SweepRow
    lag: int
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]

    @property
    def finished(self) -> bool:
        """The run wrote ``summary.json`` (``run_rl`` does so after its last step)."""
        return (self.run_dir / "summary.json").is_file()


@dataclass(frozen=True)
class SweepGrid:
    """A parsed grid file (see the module docstring); ``path`` is where it was read from."""

    name: str
    path: Path
    base_config: str | None
    output_dir: Path
    rows: tuple[SweepRow, ...]
    lags: tuple[int, ...]
    seeds: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    lag_overrides: tuple[str, ...] = ("rollout.mode=fixed_lag", "rollout.lag={lag}")
    cells: tuple[SweepCell, ...] = field(default=(), repr=False)


def _str_list(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of strings (section.field=value), got {value!r}")
    return tuple(value)


def _int_list(value, where: str) -> tuple[int, ...]:
    ok = isinstance(value, list) and value and all(type(v) is int for v in value)
    if not ok or len(set(value)) != len(value):
        raise ValueError(f"{where} must be a non-empty list of distinct integers, got {value!r}")
    return tuple(value)


def load_grid(path: str | Path, output_dir: str | Path | None = None) -> SweepGrid:
    """Parse and validate a grid file; cells in the file's ``order``.

    ``order: row`` (default) lists the cells by (row, lag, seed); ``order: seed`` by (seed, row,
    lag), so that a sweep stopped early has run every row and lag with the first seed(s).

    Args:
        path: the YAML grid file.
        output_dir: overrides the file's ``output_dir`` (tests, a second copy of a sweep).

    Raises:
        ValueError: naming the key of a malformed entry, a duplicate row id, or a cell whose
            config does not validate (``load_config``'s error, prefixed with the cell).
    """
    path = Path(path)
    tree = yaml.safe_load(path.read_text()) or {}
    if not isinstance(tree, dict):
        raise ValueError(f"{path}: a grid file is a mapping (name, rows, lags, ...)")
    known = {"name", "base_config", "output_dir", "overrides", "lag_overrides", "lags", "seeds"}
    known.add("order")
    unknown = sorted(set(tree) - known - {"rows"})
    if unknown:
        raise ValueError(f"{path}: unknown grid key(s) {unknown}")
    rows = _grid_rows(tree.get("rows"), path)
    name = tree.get("name", path.stem)
    out = Path(output_dir if output_dir is not None else tree.get("output_dir", f"runs/{name}"))
    grid = SweepGrid(
        name=str(name),
        path=path,
        base_config=tree.get("base_config"),
        output_dir=out,
        rows=tuple(rows),
        lags=_int_list(tree.get("lags"), f"{path}: lags"),
        seeds=_int_list(tree.get("seeds"), f"{path}: seeds"),
        overrides=_str_list(tree.get("overrides"), f"{path}: overrides"),
        lag_overrides=_str_list(
            tree.get("lag_overrides", list(SweepGrid.lag_overrides)), f"{path}: lag_overrides"
        ),
    )
    for o in grid.lag_overrides:
        try:
            o.format(lag=0)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"{path}: lag_overrides entry {o!r}: only {{lag}} is substituted ({e!r})"
            ) from e
    cells = _grid_cells(grid, tree.get("order", "row"), path)
    return SweepGrid(**{**grid.__dict__, "cells": tuple(cells)})


def _grid_rows(rows_raw: Any, path: Path) -> list[SweepRow]:
    """The grid file's ``rows``: ids that are plain directory names, unique."""
    if not isinstance(rows_raw, list) or not rows_raw:
        raise ValueError(f"{path}: rows must be a non-empty list")
    rows = []
    for i, raw in enumerate(rows_raw):
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str) or not raw["id"]:
            raise ValueError(f"{path}: rows[{i}] needs a string id")
        if set(raw["id"]) == {"."} or not all(c.isalnum() or c in "-_." for c in raw["id"]):
            raise ValueError(f"{path}: rows[{i}].id {raw['id']!r} must be a plain directory name")
        extra = sorted(set(raw) - {"id", "label", "overrides"})
        if extra:
            raise ValueError(f"{path}: rows[{i}] unknown key(s) {extra}")
        overrides = _str_list(raw.get("overrides"), f"{path}: rows[{i}].overrides")
        rows.append(SweepRow(raw["id"], str(raw.get("label", raw["id"])), overrides))
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"{path}: duplicate row ids {sorted({i for i in ids if ids.count(i) > 1})}"
        )
    return rows


def _grid_cells(grid: SweepGrid, order: Any, path: Path) -> list[SweepCell]:
    """Every (row, lag, seed) cell in ``order``, each config validated by ``load_config``."""
    from megatron_sat.config import load_config

    if order not in ("row", "seed"):
        raise ValueError(f"{path}: order must be 'row' or 'seed', got {order!r}")
    if order == "row":  # (row, lag, seed): a row's cells together
        keys = [(r, lag, s) for r in grid.rows for lag in grid.lags for s in grid.seeds]
    else:  # (seed, row, lag): a sweep stopped early has every row once before any twice
        keys = [(r, lag, s) for s in grid.seeds for r in grid.rows for lag in grid.lags]
    cells = []
    for row, lag, seed in keys:
        run_dir = grid.output_dir / row.id / f"lag{lag}_seed{seed}"
        overrides = (
            *grid.overrides,
            *(o.format(lag=lag) for o in grid.lag_overrides),
            *row.overrides,
            f"train.seed={seed}",
            f"run_dir={run_dir}",
        )
        cell = SweepCell(len(cells), row, lag, seed, run_dir, overrides)
        try:
            load_config(grid.base_config, list(overrides))
        except ValueError as e:
            raise ValueError(f"{path}: cell {row.id} lag {lag} seed {seed}: {e}") from e
        cells.append(cell)
    return cells


def cell_command(grid: SweepGrid, cell: SweepCell) -> list[str]:
    """``megatron-sat train`` of one cell (resumed if an earlier attempt left anything)."""
    cmd = [sys.executable, "-m", "megatron_sat.cli", "train"]
    if grid.base_config is not None:
        cmd += ["--config", str(grid.base_config)]
    cmd += list(cell.overrides)
    if previous_run(cell.run_dir):  # else train refuses the folder (training.run_folder)
        cmd.append("train.resume=true")
    return cmd


def _subprocess_runner(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` with this environment plus ``env``, its output appended to ``log_path``."""
    full_env = None if env is None else {**os.environ, **env}
    with log_path.open("a") as log:
        return subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, check=False, env=full_env
        ).returncode


def run_sweep(
    grid: SweepGrid,
    cells: Sequence[int] | None = None,
    runner: Callable[[list[str], Path], int] | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    jobs: int = 1,
) -> dict[str, list[int]]:
    """Run the unfinished cells, ``jobs`` at a time, in order; finished cells are skipped.

    An unfinished cell without a run checkpoint is removed and started again (its partial
    metrics would otherwise be appended to); one with a checkpoint resumes from it. A cell that
    fails is reported and the sweep goes on with the next one. Cells are independent processes
    with their own seeds. Each cell's processes take 1 / ``jobs`` of the cores
    (``platform.threads.child_env``: ``MEGATRON_SAT_LOCAL_PROCESSES``), so on CPU ``jobs``
    changes the cells' thread counts, which change float reduction orders: set
    ``OMP_NUM_THREADS`` (or ``MEGATRON_SAT_THREADS``) to keep one count across ``jobs``.

    Args:
        grid: from ``load_grid``.
        cells: indices of the cells to consider (default all), e.g. one SLURM array task's.
        runner: ``(command, log_path) -> exit status``; the default (None) runs a
            subprocess whose output goes to ``<run_dir>.log``, with its share of the cores.
        log: progress lines.
        jobs: how many cells run at once (threads, each waiting on its cell's process).

    Returns:
        ``{"ran": [...], "skipped": [...], "failed": [...]}`` cell indices, in ``cells`` order.

    Raises:
        ValueError: an index outside the grid, or ``jobs`` < 1.
    """
    chosen = list(range(len(grid.cells))) if cells is None else list(cells)
    bad = [i for i in chosen if not 0 <= i < len(grid.cells)]
    if bad:
        raise ValueError(f"cell indices {bad} outside the grid's {len(grid.cells)} cells")
    if type(jobs) is not int or jobs < 1:
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    if runner is None:
        runner = functools.partial(_subprocess_runner, env=child_env(jobs))

    def run_one(i: int) -> str:
        cell = grid.cells[i]
        where = f"cell {i + 1}/{len(grid.cells)} {cell.row.id} lag {cell.lag} seed {cell.seed}"
        if cell.finished:
            log(f"{where}: finished, skipped")
            return "skipped"
        if cell.run_dir.exists() and not any((cell.run_dir / "checkpoints").glob("step_*")):
            log(f"{where}: unfinished without a run checkpoint, started again")
            shutil.rmtree(cell.run_dir)
        cell.run_dir.parent.mkdir(parents=True, exist_ok=True)
        cmd = cell_command(grid, cell)
        log(f"{where}: {shlex.join(cmd)}")
        status = runner(cmd, cell.run_dir.with_suffix(".log"))
        if status == 0 and cell.finished:
            log(f"{where}: done")
            return "ran"
        log(f"{where}: FAILED (exit {status}); see {cell.run_dir.with_suffix('.log')}")
        return "failed"

    if jobs == 1:
        outcomes = [run_one(i) for i in chosen]
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            outcomes = list(pool.map(run_one, chosen))
    result: dict[str, list[int]] = {"ran": [], "skipped": [], "failed": []}
    for i, outcome in zip(chosen, outcomes, strict=True):
        result[outcome].append(i)
    return result


def render_slurm_array(
    grid: SweepGrid, out: str | Path, sbatch_options: Sequence[str] = ()
) -> Path:
    """Write an sbatch script running the grid as a job array, one task per cell.

    Each task runs ``megatron-sat sweep --grid <file> --cell $SLURM_ARRAY_TASK_ID``, which
    skips a finished cell, so resubmitting the array finishes what is left.

    Args:
        grid: from ``load_grid``.
        out: the script to write.
        sbatch_options: extra ``#SBATCH`` lines' options (e.g. ``--partition=gpu``).

    Raises:
        ValueError: ``output_dir`` holds whitespace (``#SBATCH --output`` cannot quote it).
    """
    out = Path(out)
    logs = grid.output_dir / "slurm"
    if any(c.isspace() for c in str(logs)):  # an #SBATCH line takes no quoting
        raise ValueError(f"output_dir {grid.output_dir} has whitespace: #SBATCH --output breaks")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=sweep-{grid.name}",
        f"#SBATCH --array=0-{len(grid.cells) - 1}",
        f"#SBATCH --output={logs}/%A_%a.out",
        *(f"#SBATCH {opt}" for opt in sbatch_options),
        "set -euo pipefail",
        f"mkdir -p {shlex.quote(str(logs))}",
        f"# {len(grid.cells)} cells: {len(grid.rows)} rows x lags {list(grid.lags)} x seeds "
        f"{list(grid.seeds)}",
        f"exec megatron-sat sweep --grid {shlex.quote(str(grid.path))} "
        f'--output-dir {shlex.quote(str(grid.output_dir))} --cell "$SLURM_ARRAY_TASK_ID"',
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    # SLURM opens --output before the script runs: a missing folder fails every task at start
    logs.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    os.chmod(out, 0o755)
    return out


# --- the report ---------------------------------------------------------------------------------


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def cell_stats(rows: Sequence[dict]) -> dict[str, float | int | bool | None]:
    """Statistics of one run from its metrics rows (the table's columns, ``CELL_STATS``).

    - ``best_acc``, ``best_step``: the highest held-out greedy accuracy and its (first) step;
    - ``final_acc``: the accuracy of the last evaluation;
    - ``collapsed``: ``COLLAPSE_RULE``;
    - ``mismatch_last25``: mean ``train/mismatch_abs_logratio`` (|log pi - log mu| of the
      trained forward, with R3 when it is on) over the last 25% of the train steps;
    - ``mismatch_live_last25``: the same without replay (``_live``);
    - ``sat_gate_rate``: mean SAT gate rate over all train steps (None for non-SAT rows);
    - ``ess_last25``: mean effective sample size over the last 25% of the steps (None if the
      run predates the metric);
    - ``topk_live``, ``topk_r3``: mean top-k agreement with the rollout engine's experts over
      all train steps, with live routing and with the replayed routes (None without R3);
    - ``mismatch_all``, ``mismatch_live_all``: the two mismatches over all train steps (the
      R3 note compares them);
    - ``num_steps``: train steps logged.

    Raises:
        ValueError: no held-out evaluation in the rows.
    """
    evals = [(r["step"], r[ACCURACY_KEY]) for r in rows if _finite(r.get(ACCURACY_KEY))]
    if not evals:
        raise ValueError(f"no {ACCURACY_KEY} in the metrics")
    best_step, best = max(evals, key=lambda e: (e[1], -e[0]))
    final = evals[-1][1]
    train = [r for r in rows if r.get("step", 0) > 0 and _finite(r.get(MISMATCH_KEY))]
    tail = train[-max(1, math.ceil(LAST_FRACTION * len(train))) :] if train else []

    def mean(key: str, over: Sequence[dict]) -> float | None:
        values = [r[key] for r in over if _finite(r.get(key))]
        return sum(values) / len(values) if values else None

    return {
        "best_acc": best,
        "best_step": best_step,
        "final_acc": final,
        "collapsed": final < (1 - COLLAPSE_DROP) * best,
        "mismatch_last25": mean(MISMATCH_KEY, tail),
        "mismatch_live_last25": mean("train/mismatch_abs_logratio_live", tail),
        "sat_gate_rate": mean("train/sat_gate_rate", train),
        "ess_last25": mean("train/ess", tail),
        "topk_live": mean("train/topk_match_live", train),
        "topk_r3": mean("train/topk_match_r3", train),
        "mismatch_all": mean(MISMATCH_KEY, train),
        "mismatch_live_all": mean("train/mismatch_abs_logratio_live", train),
        "num_steps": len(train),
    }


# The table's notes: what each column is.
CELL_STATS: tuple[str, ...] = (
    "best acc / best step: the highest held-out greedy accuracy (eval/acc_greedy) and the "
    "first step that reached it; step 0 is the warm start",
    "final acc: the accuracy of the last evaluation",
    "mismatch (last 25%): mean |log pi - log mu| of the trained forward "
    "(train/mismatch_abs_logratio; with R3 where the row replays) over the last 25% of the "
    "train steps; mismatch live: the same forward with live routing",
    "SAT gate rate: mean train/sat_gate_rate over all train steps (SAT rows only)",
    "ESS (last 25%): mean effective sample size of the importance weights pi/mu",
    "top-k live / top-k R3: mean fraction of (token, MoE layer) pairs whose top-k experts in "
    "the trained forward equal the rollout engine's, with live routing (train/topk_match_live) "
    "and with the replayed routes (train/topk_match_r3, R3 rows only), over all train steps",
)


def _mean_spread(values: Sequence[float | None]) -> str:
    xs = [v for v in values if v is not None]
    if not xs:
        return "-"
    mean = statistics.fmean(xs)
    if len(xs) == 1:
        return f"{mean:.3g}"
    return f"{mean:.3g} ± {statistics.stdev(xs):.2g}"


def sweep_report(grid: SweepGrid, out_dir: str | Path, command: str | None = None) -> Path:
    """Write ``out_dir/table.md`` and the figures from the grid's finished cells.

    Per row and lag, over the seeds that finished: mean ± sample standard deviation of each
    statistic of ``cell_stats``, the number of seeds and of collapsed seeds. Figures:
    ``mismatch_<first row>_lag.png`` (the first row's mismatch over steps at every lag),
    ``mismatch_by_method.png`` (every row's mismatch, one panel per lag),
    ``final_accuracy.png`` (bar chart of the mean final accuracy per row and lag).

    Args:
        grid: from ``load_grid``.
        out_dir: where ``table.md`` and the PNGs go.
        command: the command line that made the sweep, written at the top of the table.

    Returns:
        The path of ``table.md``.

    Raises:
        ValueError: no finished cell.
    """
    from megatron_sat.experiments.plots import read_metrics

    out_dir = Path(out_dir)
    done = [c for c in grid.cells if c.finished]
    if not done:
        raise ValueError(f"no finished cell under {grid.output_dir}")
    metrics = {c.index: read_metrics(c.run_dir) for c in done}
    stats = {}
    for c in done:
        try:
            stats[c.index] = cell_stats(metrics[c.index])
        except ValueError as e:  # name the cell: the error alone does not say which run
            raise ValueError(f"cell {c.row.id} lag {c.lag} seed {c.seed} ({c.run_dir}): {e}") from e
    lines = [f"# Sweep `{grid.name}`", ""]
    if command:
        lines += ["Made by:", "", "```", command, "```", ""]
    lines += [
        f"Grid `{grid.path}`: {len(grid.rows)} rows x lags {list(grid.lags)} x seeds "
        f"{list(grid.seeds)}; {len(done)} of {len(grid.cells)} cells finished.",
        "",
        "| method | lag | seeds | best acc | best step | final acc | collapsed | "
        "mismatch (last 25%) | mismatch live (last 25%) | SAT gate rate | ESS (last 25%) | "
        "top-k live | top-k R3 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in grid.rows:
        for lag in grid.lags:
            cells = [c for c in done if c.row.id == row.id and c.lag == lag]
            if not cells:
                lines.append(f"| {row.label} | {lag} | 0 (missing) |" + " - |" * 10)
                continue
            s = [stats[c.index] for c in cells]
            collapsed = sum(bool(x["collapsed"]) for x in s)

            def col(key: str, s: list[dict] = s) -> str:
                return _mean_spread([x[key] for x in s])

            lines.append(
                f"| {row.label} | {lag} | {len(cells)} | {col('best_acc')} | {col('best_step')} "
                f"| {col('final_acc')} | {collapsed}/{len(cells)} | {col('mismatch_last25')} "
                f"| {col('mismatch_live_last25')} | {col('sat_gate_rate')} "
                f"| {col('ess_last25')} | {col('topk_live')} | {col('topk_r3')} |"
            )
    lines += [
        "",
        "Notes:",
        "",
        "- Values are mean ± sample standard deviation over the seeds that finished.",
        f"- {COLLAPSE_RULE}.",
        *(f"- {item}." for item in CELL_STATS),
        *r3_notes(grid, done, stats),
        "",
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    table = out_dir / "table.md"
    table.write_text("\n".join(lines))
    _figures(grid, done, metrics, stats, out_dir)
    return table


def r3_notes(grid: SweepGrid, done: Sequence[SweepCell], stats: dict[int, dict]) -> list[str]:
    """One note line per lag: what R3 changes in the runs that replay, pooled over them.

    Each R3 run logs, at every step and at the same weights, the mismatch and the top-k
    agreement of the trained (replayed) forward and of a live-routing forward: a paired
    comparison. The line gives both means over the R3 runs' train steps (mean over the runs of
    each run's all-steps mean), and how many runs have the replayed mismatch below the live.

    Returns:
        Markdown list items (empty when no finished cell replays).
    """
    out = []
    for lag in grid.lags:
        s = [stats[c.index] for c in done if c.lag == lag and stats[c.index]["topk_r3"] is not None]
        s = [x for x in s if x["mismatch_all"] is not None and x["mismatch_live_all"] is not None]
        if not s:
            continue
        lower = sum(x["mismatch_all"] < x["mismatch_live_all"] for x in s)

        def m(key: str, s: list[dict] = s) -> float:
            return statistics.fmean(x[key] for x in s)

        out.append(
            f"- R3 at lag {lag} ({len(s)} runs that replay, all train steps): mean "
            f"|log pi - log mu| {m('mismatch_live_all'):.4g} with live routing -> "
            f"{m('mismatch_all'):.4g} replayed "
            f"(lower in {lower} of {len(s)} runs); top-k agreement {100 * m('topk_live'):.2f}% "
            f"live -> {100 * m('topk_r3'):.2f}% replayed (minimum over runs "
            f"{100 * min(x['topk_r3'] for x in s):.2f}%)."
        )
    return out


def _figures(grid, done, metrics, stats, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(index: int) -> tuple[list, list]:
        points = [
            (r["step"], r[MISMATCH_KEY]) for r in metrics[index] if _finite(r.get(MISMATCH_KEY))
        ]
        return ([p[0] for p in points], [p[1] for p in points]) if points else ([], [])

    first = grid.rows[0]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for c in done:
        if c.row.id == first.id:
            ax.plot(*curve(c.index), label=f"lag {c.lag} seed {c.seed}")
    ax.set(title=f"{first.label}: |log pi - log mu|", xlabel="step", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / f"mismatch_{first.id}_lag.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(grid.lags), figsize=(6 * len(grid.lags), 4), squeeze=False)
    for ax, lag in zip(axes[0], grid.lags, strict=True):
        for k, row in enumerate(grid.rows):
            cells = [c for c in done if c.row.id == row.id and c.lag == lag]
            if cells:  # the first seed's curve per method; 20 colours x 2 styles tell 13+ apart
                style = "-" if k % 2 == 0 else "--"
                ax.plot(*curve(cells[0].index), style, color=plt.cm.tab20(k % 20), label=row.label)
        ax.set(title=f"lag {lag}: |log pi - log mu|", xlabel="step", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out_dir / "mismatch_by_method.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(grid.rows)), 4))
    width = 0.8 / len(grid.lags)
    for j, lag in enumerate(grid.lags):
        heights = []
        for row in grid.rows:
            s = [stats[c.index]["final_acc"] for c in done if c.row.id == row.id and c.lag == lag]
            heights.append(statistics.fmean(s) if s else 0.0)
        ax.bar([i + j * width for i in range(len(grid.rows))], heights, width, label=f"lag {lag}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(grid.rows))])
    ax.set_xticklabels([r.label for r in grid.rows], rotation=60, ha="right", fontsize=7)
    ax.set(title="final held-out greedy accuracy (mean over seeds)", ylabel="accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "final_accuracy.png", dpi=110)
    plt.close(fig)
