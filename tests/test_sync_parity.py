"""Weight sync from a sharded trainer: ONE torchrun launch (2 gloo ranks) of
tests/dist/sync_parity.py pushes a TP2, an EP2 and a PP2 megatron-core model with
``push_megatron_weights`` to one embedded rollout server (PP2: each stage sends its own layers
over its own group, no gather to rank 0). The server's log-probs of its sampled
probe tokens (T = 1: ``log_softmax(logits)``, all ``/generate`` exposes of its logits) must equal
the trainer's forward to fp32 rounding after the sync, and be far from it before; a push whose
middle bucket the server rejects must raise on both ranks without hanging or changing the
server's weight_version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
CASES = ("tp2", "ep2")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("sync_parity")
    proc = run_torchrun("tests/dist/sync_parity.py", str(out_dir), done="SYNC_PARITY_RESULT ")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SYNC_PARITY_RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0][len("SYNC_PARITY_RESULT ") :])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_server_matches_trainer_after_sync(results, case):
    server_rank, other = results[case]["ranks"]
    for r in (server_rank, other):
        # Different weights before (else the comparison could not fail), fp32 rounding after.
        assert r["gap_before"] > 0.1, r
        assert r["gap_after"] <= 1e-4, r
        assert r["tokens_compared"] >= 8
    assert server_rank["version_after"] == f"{case}-synced"
    assert server_rank["version_before"] != server_rank["version_after"]
    assert server_rank["num_tensors"] == results["num_hf_tensors"]
    assert server_rank["num_buckets"] > 3


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_rejected_bucket_fails_every_rank_without_hanging(results, case):
    server_rank, other = results[case]["ranks"]
    # Rank 0 failed part-way (earlier buckets loaded), drained the export, then re-raised.
    assert server_rank["rejected_error"].startswith("WeightSyncError"), server_rank
    assert "unknown parameter name" in server_rank["rejected_error"]
    assert "already loaded earlier buckets" in server_rank["rejected_error"]
    assert other["rejected_error"].startswith(
        f"WeightSyncError: weight push '{case}-rejected' failed on rank 0"
    ), other
    assert server_rank["version_after_rejected"] == server_rank["version_before"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_push_without_an_updater_is_refused_on_every_rank(results, case):
    for r in results[case]["ranks"]:
        assert r["no_holder_error"].startswith("ValueError: exactly one rank"), r


@pytest.mark.slow
def test_pp2_each_stage_sends_its_own_layers(results):
    stage0, stage1 = results["pp2"]["ranks"]
    for r in (stage0, stage1):
        # Against a PP1 model with the same weights: both stages' layers reached the server.
        assert r["gap_before"] > 0.1, r
        assert r["gap_after"] <= 1e-4, r
        assert r["tokens_compared"] >= 8
        assert r["no_holder_error"].startswith("ValueError: exactly one rank"), r
        assert r["one_stage_error"] is None, r  # one holder (stage 1): the single-sender path
    # Each stage sent its own tensors only; together the whole model, none twice.
    assert stage0["num_tensors"] + stage1["num_tensors"] == results["num_hf_tensors"]
    assert min(stage0["num_tensors"], stage1["num_tensors"]) > 10
    assert stage0["version_after"] == "pp2-synced"
    # Stage 0's middle bucket rejected: stage 1 sent nothing, every rank raised, version kept.
    assert "unknown parameter name" in stage0["rejected_error"]
    assert "already loaded earlier buckets" in stage0["rejected_error"]
    assert stage1["rejected_error"].startswith(
        "WeightSyncError: weight push 'pp2-rejected' failed on rank 0"
    ), stage1
    assert stage0["version_one_stage"] == "pp2-one-stage"
    assert stage0["version_after_rejected"] == "pp2-one-stage"
