"""What ``train`` refuses before anything starts: a run folder that holds another run unless
``train.resume`` (``training.run_folder``; a sweep resumes a cell that logged), and a missing
reward plug-in file, each in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sat.cli import main
from megatron_sat.experiments.sweep import cell_command, load_grid
from megatron_sat.training.run_folder import check_new_run, previous_run

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/configs/tiny_cpu_sat_gspo_r3.yaml"


def test_previous_run_lists_what_a_run_leaves(tmp_path):
    run = tmp_path / "run"
    assert previous_run(run) == []  # missing
    run.mkdir()
    (run / "config.yaml").write_text("run_dir: x\n")  # a run that failed at start-up
    (run / "metrics.jsonl").write_text("")  # and logged nothing
    (run / "checkpoints").mkdir()
    assert previous_run(run) == []
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "summary.json").write_text("{}")
    for step in (4, 2):
        (run / "checkpoints" / f"step_{step:08d}").mkdir()
    assert previous_run(run) == [
        "metrics.jsonl",
        "summary.json",
        "checkpoints/step_00000002",
        "checkpoints/step_00000004",
    ]
    check_new_run(run, resume=True)  # continuing it is what resume is for
    with pytest.raises(FileExistsError) as info:
        check_new_run(run, resume=False)
    assert str(info.value) == (
        f"run_dir={str(run)!r} already holds a run (metrics.jsonl, summary.json, "
        "checkpoints/step_00000002 and 1 more): continue it with train.resume=true, or give "
        "this run a run_dir of its own (a new run there would append to its metrics.jsonl "
        "and replace its summary and checkpoints)"
    )


def test_train_refuses_a_folder_holding_a_run_and_changes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/acc_greedy": 0.5}\n')
    before = sorted(p.name for p in run.iterdir())
    code = main(["train", "--config", str(CONFIG), f"run_dir={run}"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert f"megatron-sat train: run_dir={str(run)!r} already holds a run (metrics.jsonl)" in err
    assert "train.resume=true" in err
    assert sorted(p.name for p in run.iterdir()) == before  # not even config.yaml written
    assert (run / "metrics.jsonl").read_text() == '{"step": 0, "eval/acc_greedy": 0.5}\n'


def test_a_sweep_resumes_a_cell_that_logged_even_without_a_checkpoint(tmp_path):
    """A cell killed before its first run checkpoint restarts with ``train.resume=true``
    (from step 1, its lines dropped) instead of being refused or appending to them."""
    from test_sweep import _grid

    grid = load_grid(_grid(tmp_path, tmp_path / "hf"))
    fresh, killed = grid.cells
    assert "train.resume=true" not in cell_command(grid, fresh)
    killed.run_dir.mkdir(parents=True)
    (killed.run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    assert cell_command(grid, killed)[-1] == "train.resume=true"


def test_train_names_a_missing_reward_plugin_file_in_one_line(tmp_path, capsys):
    """Found by a fresh user's run: a 35-line traceback from the reward workers before."""
    run = tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            str(CONFIG),
            f"run_dir={run}",
            "rollout.reward=python",
            "rollout.reward_function=nonexistent.py:f",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    missing = Path("nonexistent.py").resolve()
    assert err.strip() == (
        f"megatron-sat train: rollout.reward_function='nonexistent.py:f': no file {missing}"
    )
    assert not run.exists()
