"""Host memory of a trainer node: what the launch plan's device figures leave in host RAM.

Three things of the recipe's step live in host memory, per trainer rank:

- the optimizer's fp32 main weights and Adam moments with ``train.optimizer_cpu_offload``
  (megatron-core's HybridDeviceOptimizer steps them there);
- the frozen reference policy of the k3 KL term when ``objective.kl_coef > 0`` and
  ``train.reference_on_device`` is false: pinned buffers allocated once for its weights and
  the policy's while they are swapped (``training.reference``), two copies of the rank's shard;
- the rank's share of the step's batch in its final form (compact routes, ids, log-probs,
  versions: the pool's bytes per token), staged on the host and moved one micro-batch at a
  time (``training.staging``).

Rank 0 also holds the rollout pool (``rollout.pool_memory``). The rollout servers' own host
memory (their processes, tokenizer, CUDA context) is theirs and is not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sat.launch.memory import GIB, MemoryEstimate
from megatron_sat.rollout.pool_memory import PoolMemory


@dataclass(frozen=True)
class HostMemory:
    """Host bytes of the trainer ranks, per rank and for the node of rank 0 (the fullest).

    Attributes:
        optimizer_bytes: offloaded optimizer state per rank (0 without offload).
        reference_bytes: the reference policy's host buffers per rank (0 when unused or on the
            device).
        batch_bytes: a rank's share of one batch (samples / DP x the longest sample).
        pool_bytes: the rollout pool on rank 0 at its fullest.
        ranks_per_node: trainer ranks on one node.
        pool_batches: batches the pool holds at its fullest (1 in sync mode, ``rollout.lag``
            + 1 in the asynchronous modes).
    """

    optimizer_bytes: int
    reference_bytes: int
    batch_bytes: int
    pool_bytes: int
    ranks_per_node: int
    pool_batches: int = 1

    @property
    def per_rank_bytes(self) -> int:
        """One trainer rank's host bytes (the pool aside)."""
        return self.optimizer_bytes + self.reference_bytes + self.batch_bytes

    @property
    def node_bytes(self) -> int:
        """Host bytes of the node of rank 0: its ranks and the pool."""
        return self.ranks_per_node * self.per_rank_bytes + self.pool_bytes


def host_memory(
    cfg, static: MemoryEstimate, offloaded: MemoryEstimate | None, pool: PoolMemory, dp: int
) -> HostMemory:
    """The trainer node's host memory for ``cfg`` (a RunConfig).

    Args:
        static: the device memory as built (its ``param_bytes`` size the reference buffers).
        offloaded: the estimate with offload toggled; with ``train.optimizer_cpu_offload`` on,
            its ``optimizer_bytes`` are what the offload holds in host memory.
        pool: the rollout pool at its fullest (one batch in sync mode).
        dp: data-parallel size (a rank holds 1/dp of a batch).
    """
    optimizer = 0
    if cfg.train.optimizer_cpu_offload and offloaded is not None:
        optimizer = offloaded.optimizer_bytes
    reference = 0
    if cfg.objective.kl_coef > 0 and not cfg.train.reference_on_device:
        reference = 2 * static.param_bytes
    per_batch = pool.total_bytes // pool.batches
    return HostMemory(
        optimizer_bytes=optimizer,
        reference_bytes=reference,
        batch_bytes=-(-per_batch // dp),
        pool_bytes=pool.total_bytes,
        ranks_per_node=cfg.launch.trainer_ranks_per_node,
        pool_batches=pool.batches,
    )


def host_memory_line(memory: HostMemory) -> str:
    """The dry-run's report line."""
    g = GIB
    return (
        f"host memory of trainer node 0: {memory.node_bytes / g:.1f} GiB = "
        f"{memory.ranks_per_node} rank(s) x ({memory.optimizer_bytes / g:.1f} offloaded "
        f"optimizer + {memory.reference_bytes / g:.1f} reference policy + "
        f"{memory.batch_bytes / g:.1f} batch share) + {memory.pool_bytes / g:.1f} rollout pool "
        "(the rollout servers' own processes not counted)"
    )


def host_memory_errors(limit_gib: float | None, memory: HostMemory) -> list[str]:
    """The node's host memory against ``launch.host_memory_gib`` (none when it is null or
    enough), with the fixes that apply to this node: the reference policy to the device when
    it is in host memory, a lower lag when the pool holds more than one batch (asynchronous
    modes), the optimizer state to the device when it is offloaded, more nodes always."""
    if limit_gib is None or memory.node_bytes <= limit_gib * GIB:
        return []
    ranks, g = memory.ranks_per_node, GIB
    fixes = []
    if memory.reference_bytes:
        fixes.append(
            f"train.reference_on_device=true (-{ranks * memory.reference_bytes / g:.1f} GiB; "
            "the reference policy's weights then take device memory)"
        )
    if memory.pool_batches > 1:
        per_batch = memory.pool_bytes / memory.pool_batches
        fixes.append(
            f"a lower rollout.lag (the pool holds lag + 1 = {memory.pool_batches} batches of "
            f"{per_batch / g:.1f} GiB)"
        )
    if memory.optimizer_bytes:
        fixes.append(
            f"train.optimizer_cpu_offload=false (-{ranks * memory.optimizer_bytes / g:.1f} GiB; "
            "only where the device has room for the optimizer state)"
        )
    fixes.append("fewer trainer ranks per node (launch.trainer_gpus_per_node; more nodes)")
    return [
        f"launch.host_memory_gib={limit_gib:g}: trainer node 0 needs "
        f"{memory.node_bytes / g:.1f} GiB of host memory ({host_memory_line(memory)}); "
        f"fixes: {'; or '.join(fixes)}"
    ]
