"""`megatron-sat sweep`: a tiny grid of two cells end to end, the report, resume, SLURM array."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_sat.cli import main
from megatron_sat.experiments.sweep import cell_stats, load_grid, render_slurm_array, run_sweep
from megatron_sat.rollout.arith import make_arith_splits


def _grid(tmp_path, tiny_checkpoint) -> str:
    train, test = make_arith_splits(32, 4, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    grid = {
        "name": "tiny",
        "base_config": None,
        "output_dir": str(tmp_path / "cells"),
        "overrides": [
            f"init_checkpoint={tiny_checkpoint}",
            f"data.train_path={tmp_path / 'train.jsonl'}",
            f"data.eval_path={tmp_path / 'test.jsonl'}",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=3",
            "rollout.eval_samples_per_prompt=1",
            "train.num_steps=2",
            "train.eval_every=1",
        ],
        "lag_overrides": ["rollout.mode=fixed_lag", "rollout.lag={lag}"],
        "lags": [1],
        "seeds": [3],
        "rows": [
            {"id": "grpo_mu", "label": "GRPO (mu)", "overrides": ["objective.name=grpo"]},
            {"id": "sat_gspo_r3", "label": "SAT-GSPO w/ R3", "overrides": ["train.use_r3=true"]},
        ],
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(grid))
    return str(path)


def test_grid_cells_and_validation(tmp_path, tiny_checkpoint):
    grid = load_grid(_grid(tmp_path, tiny_checkpoint))
    assert [(c.row.id, c.lag, c.seed) for c in grid.cells] == [
        ("grpo_mu", 1, 3),
        ("sat_gspo_r3", 1, 3),
    ]
    cell = grid.cells[0]
    assert cell.run_dir == tmp_path / "cells" / "grpo_mu" / "lag1_seed3"
    assert cell.overrides[-5:] == (
        "rollout.mode=fixed_lag",
        "rollout.lag=1",
        "objective.name=grpo",
        "train.seed=3",
        f"run_dir={cell.run_dir}",
    )
    bad = yaml.safe_load(open(_grid(tmp_path, tiny_checkpoint)))
    bad["rows"][1]["overrides"] = ["objective.name=nope"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="cell sat_gspo_r3 lag 1 seed 3.*ObjectiveConfig.name"):
        load_grid(tmp_path / "bad.yaml")
    bad["rows"][1] = dict(bad["rows"][0])
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="duplicate row ids"):
        load_grid(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="outside the grid"):
        run_sweep(grid, cells=[2], runner=lambda cmd, log: 0)


def test_grid_order_seed_first(tmp_path, tiny_checkpoint):
    tree = yaml.safe_load(open(_grid(tmp_path, tiny_checkpoint)))
    tree["seeds"] = [3, 4]
    path = tmp_path / "two_seeds.yaml"
    for order, expected in (
        (None, [("grpo_mu", 3), ("grpo_mu", 4), ("sat_gspo_r3", 3), ("sat_gspo_r3", 4)]),
        ("seed", [("grpo_mu", 3), ("sat_gspo_r3", 3), ("grpo_mu", 4), ("sat_gspo_r3", 4)]),
    ):
        path.write_text(yaml.safe_dump({**tree, **({"order": order} if order else {})}))
        grid = load_grid(path)
        assert [(c.row.id, c.seed) for c in grid.cells] == expected
        assert [c.index for c in grid.cells] == [0, 1, 2, 3]
    path.write_text(yaml.safe_dump({**tree, "order": "lag"}))
    with pytest.raises(ValueError, match="order must be 'row' or 'seed', got 'lag'"):
        load_grid(path)


def test_slurm_array(tmp_path, tiny_checkpoint):
    grid = load_grid(_grid(tmp_path, tiny_checkpoint))
    text = render_slurm_array(grid, tmp_path / "a.sbatch", ["--partition=gpu"]).read_text()
    assert "#SBATCH --array=0-1\n" in text and "#SBATCH --partition=gpu\n" in text
    assert "megatron-sat sweep --grid" in text and '--cell "$SLURM_ARRAY_TASK_ID"' in text
    # SLURM opens each task's --output file before the script's mkdir runs
    assert (tmp_path / "cells" / "slurm").is_dir()
    assert f"#SBATCH --output={tmp_path / 'cells' / 'slurm'}/%A_%a.out\n" in text
    spaced = load_grid(_grid(tmp_path, tiny_checkpoint), output_dir=tmp_path / "a b")
    with pytest.raises(ValueError, match="whitespace"):
        render_slurm_array(spaced, tmp_path / "b.sbatch")


def test_cell_stats_by_hand():
    rows = [
        {"step": 0, "eval/acc_greedy": 0.5},
        {"step": 1, "train/mismatch_abs_logratio": 0.1, "train/ess": 0.9},
        {"step": 2, "train/mismatch_abs_logratio": 0.2, "eval/acc_greedy": 0.8},
        {"step": 3, "train/mismatch_abs_logratio": 0.3, "train/sat_gate_rate": 0.1},
        {"step": 4, "train/mismatch_abs_logratio": 0.5, "eval/acc_greedy": 0.6},
    ]
    s = cell_stats(rows)
    # best 0.8 at step 2; final 0.6 < 0.8 * 0.8 = 0.64 -> collapsed; last 25% of 4 steps = 1
    assert (s["best_acc"], s["best_step"], s["final_acc"], s["collapsed"]) == (0.8, 2, 0.6, True)
    assert s["mismatch_last25"] == 0.5 and s["sat_gate_rate"] == 0.1 and s["ess_last25"] is None
    rows[-1]["eval/acc_greedy"] = 0.7  # 0.7 >= 0.64: not collapsed
    assert cell_stats(rows)["collapsed"] is False


@pytest.mark.slow
def test_tiny_sweep_end_to_end_report_and_rerun_skips(tmp_path, tiny_checkpoint, capsys):
    grid_path = _grid(tmp_path, tiny_checkpoint)
    assert main(["sweep", "--grid", grid_path]) == 0
    assert capsys.readouterr().out.strip().endswith("ran 2, skipped 0, failed 0")
    grid = load_grid(grid_path)
    assert all(c.finished for c in grid.cells)
    mtimes = [(c.run_dir / "summary.json").stat().st_mtime_ns for c in grid.cells]
    # rerun: both cells finished, nothing runs
    assert main(["sweep", "--grid", grid_path]) == 0
    assert capsys.readouterr().out.strip().endswith("ran 0, skipped 2, failed 0")
    assert [(c.run_dir / "summary.json").stat().st_mtime_ns for c in grid.cells] == mtimes
    # report
    out = tmp_path / "report"
    assert main(["sweep", "report", "--grid", grid_path, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "table.md")
    table = (out / "table.md").read_text()
    assert f"megatron-sat sweep report --grid {grid_path}" in table
    lines = [ln for ln in table.splitlines() if ln.startswith("| GRPO (mu) |")]
    assert len(lines) == 1
    cells = [x.strip() for x in lines[0].strip("|").split("|")]
    stats = cell_stats([json.loads(x) for x in open(grid.cells[0].run_dir / "metrics.jsonl")])
    assert cells[:3] == ["GRPO (mu)", "1", "1"]
    assert float(cells[3]) == pytest.approx(stats["best_acc"], rel=1e-2, abs=1e-3)
    assert cells[6] == f"{int(stats['collapsed'])}/1"
    sat = [ln for ln in table.splitlines() if ln.startswith("| SAT-GSPO w/ R3 |")][0]
    assert sat.split("|")[10].strip() != "-"  # SAT gate rate reported for the SAT row
    for png in ("mismatch_grpo_mu_lag.png", "mismatch_by_method.png", "final_accuracy.png"):
        assert (out / png).stat().st_size > 1000
    # a half-finished cell without a checkpoint is started again; dry run lists states
    (grid.cells[1].run_dir / "summary.json").unlink()
    assert main(["sweep", "--grid", grid_path, "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split("\t")[:2] == ["1", "todo"]


def test_jobs_run_cells_at_once_and_keep_the_order(tmp_path, tiny_checkpoint):
    # two cells, jobs=2: a barrier of two parties passes only if both runners wait at once
    # (with one cell at a time the first waits alone and breaks the barrier: BrokenBarrierError)
    import threading

    grid = load_grid(_grid(tmp_path, tiny_checkpoint))
    barrier = threading.Barrier(2, timeout=20)

    def runner(cmd, log_path):
        barrier.wait()
        run_dir = Path(cmd[-1].removeprefix("run_dir="))
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text("{}")
        return 1 if "objective.name=grpo" in cmd else 0  # the first cell fails

    result = run_sweep(grid, runner=runner, log=lambda line: None, jobs=2)
    assert result == {"ran": [1], "skipped": [], "failed": [0]}


def test_default_runner_gives_each_cell_its_share_of_the_cores(
    tmp_path, tiny_checkpoint, monkeypatch
):
    import types

    from megatron_sat.experiments import sweep

    seen = []

    def run(cmd, **kw):
        seen.append(kw["env"])
        return types.SimpleNamespace(returncode=1)

    monkeypatch.setattr(sweep.subprocess, "run", run)
    monkeypatch.delenv("MEGATRON_SAT_LOCAL_PROCESSES", raising=False)
    grid = load_grid(_grid(tmp_path, tiny_checkpoint))
    run_sweep(grid, log=lambda line: None, jobs=2)
    assert [env["MEGATRON_SAT_LOCAL_PROCESSES"] for env in seen] == ["2", "2"]
    with pytest.raises(ValueError, match="jobs must be an integer >= 1, got 0"):
        run_sweep(grid, jobs=0)


def test_r3_note_pairs_live_and_replayed_by_hand(tmp_path, tiny_checkpoint):
    from megatron_sat.experiments.sweep import r3_notes

    grid = load_grid(_grid(tmp_path, tiny_checkpoint))
    rows = [
        {"step": 0, "eval/acc_greedy": 0.5},
        {
            "step": 1,
            "train/mismatch_abs_logratio": 0.01,
            "train/mismatch_abs_logratio_live": 0.03,
            "train/topk_match_live": 0.9,
            "train/topk_match_r3": 1.0,
        },
        {
            "step": 2,
            "train/mismatch_abs_logratio": 0.03,
            "train/mismatch_abs_logratio_live": 0.05,
            "train/topk_match_live": 0.8,
            "train/topk_match_r3": 1.0,
        },
    ]
    s = cell_stats(rows)
    assert (s["mismatch_all"], s["mismatch_live_all"]) == pytest.approx((0.02, 0.04))
    assert (s["topk_live"], s["topk_r3"]) == pytest.approx((0.85, 1.0))
    no_r3 = cell_stats([{k: v for k, v in r.items() if "r3" not in k} for r in rows])
    assert no_r3["topk_r3"] is None
    cells = grid.cells  # cell 0 without replay, cell 1 with
    notes = r3_notes(grid, cells, {cells[0].index: no_r3, cells[1].index: s})
    assert notes == [
        "- R3 at lag 1 (1 runs that replay, all train steps): mean |log pi - log mu| 0.04 with "
        "live routing -> 0.02 replayed (lower in 1 of 1 runs); top-k agreement 85.00% live -> "
        "100.00% replayed (minimum over runs 100.00%)."
    ]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda g: g["rows"][0].update(id=".."), "plain directory name"),
        (lambda g: g["rows"][0].update(id="."), "plain directory name"),
        (lambda g: g.update(lag_overrides=["rollout.lag={lag}", "x={mode}"]), "only {lag}"),
        (lambda g: g.update(lag_overrides=["rollout.lag={}"]), "only {lag}"),
    ],
)
def test_grid_refuses_hostile_entries(tmp_path, tiny_checkpoint, edit, message):
    # ".." put a cell's run directory (which run_sweep may rmtree) outside output_dir; a brace
    # other than {lag} raised a bare KeyError / IndexError from str.format
    grid = yaml.safe_load(open(_grid(tmp_path, tiny_checkpoint)))
    edit(grid)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(grid))
    with pytest.raises(ValueError, match=message.replace("{", r"\{")):
        load_grid(tmp_path / "bad.yaml")


def test_grid_file_must_be_a_mapping(tmp_path):
    (tmp_path / "list.yaml").write_text("- lags\n- rows\n")
    with pytest.raises(ValueError, match="a grid file is a mapping"):
        load_grid(tmp_path / "list.yaml")


def test_report_names_the_cell_without_evaluations(tmp_path, tiny_checkpoint):
    # a finished cell whose run never evaluated (train.eval_every=0): the error names it
    from megatron_sat.experiments.sweep import sweep_report

    grid = load_grid(_grid(tmp_path, tiny_checkpoint))
    cell = grid.cells[1]
    cell.run_dir.mkdir(parents=True)
    (cell.run_dir / "summary.json").write_text("{}")
    (cell.run_dir / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "train/mismatch_abs_logratio": 0.1}) + "\n"
    )
    with pytest.raises(ValueError, match="cell sat_gspo_r3 lag 1 seed 3 .*no eval/acc_greedy"):
        sweep_report(grid, tmp_path / "report")
