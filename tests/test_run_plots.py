"""`megatron-sat plot`: the panels drawn are exactly those some run has data for; bad run
directories are named."""

from __future__ import annotations

import json

import pytest

from megatron_sat.cli import main
from megatron_sat.experiments.plots import plot_runs


def write_run(path, rows):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_draws_the_panels_with_data(tmp_path):
    a = write_run(
        tmp_path / "gspo",
        [
            {"step": 0, "eval/acc_greedy": 0.5},
            {"step": 1, "rollout/reward": 0.2, "train/mismatch_abs_logratio": 1e-3},
            {"step": 2, "rollout/reward": None, "train/kl_loss": 0.01},  # null: a gap
        ],
    )
    b = write_run(
        tmp_path / "sat", [{"step": 1, "rollout/reward": 0.3, "train/sat_gate_rate": 0.1}]
    )
    out = tmp_path / "figs" / "cmp.png"
    panels = plot_runs([a, b], out)
    assert panels == [
        "batch reward",
        "held-out greedy accuracy",
        "mismatch |log pi - log mu|",
        "SAT gate rate",
        "KL to the reference",
    ]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_errors_name_the_culprit(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        plot_runs([tmp_path / "missing"], tmp_path / "x.png")
    bad = write_run(tmp_path / "bad", [{"step": 0}])
    (bad / "metrics.jsonl").write_text('{"step": 0}\n{"loss": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: a row needs an integer 'step'"):
        plot_runs([bad], tmp_path / "x.png")
    empty = write_run(tmp_path / "empty", [{"step": 0, "other": 1.0}])
    with pytest.raises(ValueError, match="none of"):
        plot_runs([empty], tmp_path / "x.png")
    assert main(["plot", str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2
    assert "megatron-sat plot:" in capsys.readouterr().err
