"""How the trainer's weight-update group must be built under a launcher.

The servers connect to the TCPStore that trainer rank 0 hosts, so the address they are given
must be rank 0's address as other nodes see it. Every rendered script sets ``MASTER_ADDR`` to
the first trainer node (torchrun: 127.0.0.1 on its one node; sbatch: the first node of
``SLURM_JOB_NODELIST``; mpirun: the first host), which is where rank 0 runs.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_sat.config.launch import LaunchConfig


def weight_sync_options(
    launch: LaunchConfig, num_servers: int, environ: Mapping[str, str]
) -> dict[str, object]:
    """Keyword arguments for :class:`megatron_sat.weight_sync.broadcast.WeightUpdater`.

    Args:
        launch: the run's launch section.
        num_servers: rollout servers the trainer talks to.
        environ: the process environment (``os.environ``).

    Returns:
        ``master_address`` (``MASTER_ADDR``, else 127.0.0.1 for a single process),
        ``backend`` ("nccl" on device cuda, "gloo" on cpu) and ``ranks_per_server``
        (``launch.rollout_server_tp`` for each server: an SGLang server at TP t joins the group
        with t ranks).

    Raises:
        ValueError: for ``num_servers < 1``.
    """
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    return {
        "master_address": environ.get("MASTER_ADDR") or "127.0.0.1",
        "backend": "nccl" if launch.device == "cuda" else "gloo",
        "ranks_per_server": [launch.rollout_server_tp] * num_servers,
    }
