"""bench/fault_matrix.py reads the steps a killed run saved from its checkpoint folder names,
mid-batch ``step_N_mini_j`` folders (a stop in the middle of a rollout batch) included."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from megatron_sat.checkpoint.run_state import folder_name

_BENCH = Path(__file__).resolve().parents[1] / "bench" / "fault_matrix.py"


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_fault_matrix", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_saved_steps_reads_mid_batch_and_skips_uncommitted_folders(tmp_path):
    for name in (folder_name(1), folder_name(2, mini_step=3), folder_name(3) + ".tmp", "latest"):
        (tmp_path / name).mkdir()
    assert folder_name(2, mini_step=3) == "step_00000002_mini_0003"
    assert _bench().saved_steps(tmp_path) == [1, 2]
    assert _bench().saved_steps(tmp_path / "none") == []
