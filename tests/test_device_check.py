"""The device check (tests/gpu/check_policy_trainer.py) in its CPU mode: every part runs, none
skips, and the JSON line holds every key with the values the device run will be read for."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "gpu" / "check_policy_trainer.py"


@pytest.fixture(scope="module")
def check():
    sys.path.insert(0, str(CHECK.parent))  # kept: the check's own modules import from there
    import check_policy_trainer

    return check_policy_trainer


def test_host_sync_counter_counts_each_host_read_on_cpu(check):
    from host_syncs import HostSyncCounter

    t = torch.arange(6.0)
    with HostSyncCounter(cuda=False) as counter:
        t.sum().item()
        float(t[1])
        t.tolist()
        bool(t[2] > 1)
        t * 2  # device work: not counted
        t.cpu()
    assert counter.count == 5


def test_metric_comparison_is_bitwise_and_nan_aware(check):
    a = {"loss": 0.1, "kl_loss": float("nan"), "grad_norm": 1.0}
    assert check.same_metrics(a, dict(a)) == []
    assert check.same_metrics(a, dict(a, loss=0.1 + 2**-60)) == []  # (the same double)
    assert check.same_metrics(a, dict(a, loss=math.nextafter(0.1, 1))) == ["loss"]
    assert check.same_metrics(a, {"loss": 0.1, "kl_loss": 0.0}) == ["grad_norm", "kl_loss"]


@pytest.mark.slow
def test_cpu_mode_runs_every_part(check, tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, str(CHECK), "--mode", "cpu", "--json-out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    report = json.loads(lines[-1])
    assert json.loads(out.read_text()) == report
    assert list(report) == list(check.KEYS)
    assert report["ok"] and report["failure"] is None
    assert report["parts"] == dict.fromkeys(check.PARTS, "ok")
    for part in check.PARTS:  # each part printed its line; nothing skipped
        assert any(line.startswith(f"{part}: ") for line in lines), part
    assert not any("SKIP" in line for line in lines)
    assert report["mode"] == "cpu" and report["device"] == "cpu"
    assert report["params_dtype"] == "torch.bfloat16"
    assert report["recompute_granularity"] == "full"
    objective = report["objective"]
    assert (objective["name"], objective["kl_coef"]) == ("sat-gspo", 1e-3)
    model = report["model"]
    assert (model["num_layers"], model["num_experts"], model["top_k"]) == (2, 8, 2)

    # three steps of two micro-batches, R3 exact, the KL zero while the policy is the reference
    assert report["num_micro_batches"] == [2, 2, 2]
    rows, seq_len = report["max_micro_batch_shape"]
    assert rows == 4 and report["max_micro_batch_tokens"] == rows * seq_len
    assert max(report["tokens_per_step"]) <= 2 * report["max_micro_batch_tokens"]
    assert report["topk_match_r3"] == [1.0, 1.0, 1.0]
    assert report["kl_loss"][0] == 0.0 and min(report["kl_loss"][1:]) > 0
    assert all(math.isfinite(x) for x in report["loss"])
    assert all(isinstance(n, int) and n > 0 for n in report["host_syncs_per_step"])
    assert report["step_time_s"] == report["step_times_s"][1] > 0
    # trainer (bf16) vs server (fp32) on the same weights: the bf16 tolerance of
    # tests/test_bf16_trainer.py
    assert 0 < report["logprob_gap_initial"] <= 0.015
    assert 0 < report["logprob_gap_trainer_vs_server"] <= 0.015

    # the push: versions 0 -> 2, the server's log-probs of one seeded request changed
    assert report["server_versions"] == ["default", "0", "2"]
    assert report["push_changed_server_logprobs"] is True
    assert report["probe_logprob_max_change"] > 0
    assert report["push_bytes"] > 0

    # the resume: step 3 bit for bit
    assert report["resume_bitwise"] is True and report["resume_differences"] == []

    # memory: the plan's static and activation figures; CUDA's allocator figures (and so the
    # plan's error) are null on the CPU
    assert report["plan_static_bytes"] > 0
    assert report["plan_activation_bytes_per_token_per_layer"] > 0
    assert report["plan_activation_kernels"] == "local"
    for key in (
        "static_memory_bytes",
        "step_memory_bytes",
        "optimizer_step_peak_bytes",
        "peak_memory_bytes",
        "peak_memory_per_token_per_layer_bytes",
        "activation_plan_error",
    ):
        assert report[key] is None, key
    assert set(report["seconds"]) == set(check.PARTS)
