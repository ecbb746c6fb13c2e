"""The RL loop's per-pipeline-stage weight push, its parts that need no torchrun (the PP2 runs
are in tests/test_pipeline_parallel.py: parity after every push, who exported what, a server
restart)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from megatron_sat.rollout.client import SGLangClient
from megatron_sat.training import stage_senders as rl


def run_config(pp: int, engine: str) -> SimpleNamespace:
    return SimpleNamespace(
        parallel=SimpleNamespace(pipeline_model_parallel_size=pp),
        rollout=SimpleNamespace(engine=engine),
    )


def test_stage_senders_only_at_pp_above_one_with_sglang():
    assert not rl.uses_stage_senders(run_config(1, "sglang"))  # PP1: rank 0 sends all, as before
    assert rl.uses_stage_senders(run_config(2, "sglang"))
    assert rl.uses_stage_senders(run_config(4, "sglang"))
    assert not rl.uses_stage_senders(run_config(2, "vllm"))  # no per-stage vLLM protocol


def test_stage_master_address(monkeypatch):
    # On rank 0's host: rank 0's address, verbatim.
    assert rl.stage_master_address(socket.gethostname(), "10.1.2.3") == "10.1.2.3"
    # On another host a loopback rank-0 address cannot be reached: refused, naming the fix.
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        rl.stage_master_address("node-a", "127.0.0.1")


def test_stage_zero_updater_refuses_real_tensors():
    """The fleet must hand it the marker: a caller passing tensors would otherwise have them
    silently ignored (every stage exports its own)."""
    followers = SimpleNamespace(active=False, tell=None, idle=None)
    updater = rl.StageZeroUpdater(followers, None, [SGLangClient("http://127.0.0.1:1")])
    with pytest.raises(TypeError, match="each stage exports its own layers"):
        updater.update(iter([("w", None)]), "1")
    updater.close()
