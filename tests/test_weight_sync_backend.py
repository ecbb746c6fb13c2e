"""The weight-sync group's backend is the platform's decision (``platform.weight_sync_backend``):
NCCL only when the trainer and the rollout servers both hold their weights on CUDA, gloo
otherwise (the embedded servers run on the CPU); ``rollout.weight_sync_backend`` overrides it,
and NCCL towards a CPU end is refused naming the field."""

from __future__ import annotations

import pytest

from megatron_sat.platform.device import weight_sync_backend


@pytest.mark.parametrize(
    ("trainer", "server", "expected"),
    [
        ("cuda", "cuda", "nccl"),
        ("cuda", "cpu", "gloo"),
        ("cpu", "cuda", "gloo"),
        ("cpu", "cpu", "gloo"),
    ],
)
def test_the_decision(trainer, server, expected):
    assert weight_sync_backend(trainer, server) == expected
    assert weight_sync_backend(trainer, server, "gloo") == "gloo"  # gloo reaches every end


def test_overrides():
    assert weight_sync_backend("cuda", "cuda", "nccl") == "nccl"
    for trainer, server in (("cuda", "cpu"), ("cpu", "cuda"), ("cpu", "cpu")):
        with pytest.raises(ValueError, match="rollout.weight_sync_backend=nccl needs CUDA"):
            weight_sync_backend(trainer, server, "nccl")
    with pytest.raises(ValueError, match="rollout.weight_sync_backend must be one of"):
        weight_sync_backend("cuda", "cuda", "mpi")
    with pytest.raises(ValueError, match="server_device must be 'cuda' or 'cpu'"):
        weight_sync_backend("cuda", "cuda:0")


@pytest.mark.parametrize(
    ("trainer", "overrides", "expected"),
    [
        ("cpu", [], "gloo"),  # today's CPU runs: embedded servers
        ("cuda", [], "gloo"),  # a GPU trainer pushing to the embedded (CPU) servers
        ("cuda", ["rollout.server_urls=[http://h:1]"], "nccl"),  # SGLang on GPUs
        (
            "cpu",
            [
                "rollout.server_urls=[http://h:1]",
                "launch.device=cpu",
                "launch.rollout_engine=embedded",
            ],
            "gloo",
        ),
        (
            "cuda",
            [
                "rollout.server_urls=[http://h:1]",
                "launch.device=cpu",
                "launch.rollout_engine=embedded",
            ],
            "gloo",
        ),
        ("cuda", ["rollout.server_urls=[http://h:1]", "rollout.weight_sync_backend=gloo"], "gloo"),
    ],
)
def test_sync_options_take_the_platform_decision(monkeypatch, trainer, overrides, expected):
    import torch

    from megatron_sat.config import load_config
    from megatron_sat.training import engines as rl

    monkeypatch.setattr(rl, "get_device", lambda: torch.device(trainer))
    assert rl.sync_options(load_config(None, overrides), 1)["backend"] == expected


def test_nccl_to_the_embedded_servers_is_refused():
    from megatron_sat.config import load_config

    with pytest.raises(ValueError, match="rollout.weight_sync_backend=nccl, but the embedded"):
        load_config(None, ["rollout.weight_sync_backend=nccl"])
    with pytest.raises(ValueError, match="rollout.weight_sync_backend must be"):
        load_config(None, ["rollout.weight_sync_backend=mpi"])
