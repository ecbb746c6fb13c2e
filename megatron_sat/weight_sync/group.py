"""The weight-update process group shared by the trainer (rank 0) and rollout servers.

Built exactly as SGLang 0.5.23 builds it on the server side
(``sglang/srt/utils/common.py:init_custom_process_group``): a TCPStore at
``master_address:master_port`` wrapped in ``PrefixStore(group_name, store)``, then
``torch.distributed.distributed_c10d._new_process_group_helper`` with the group's own ranks.
Using the same store layout on both sides is what lets our trainer talk to a real SGLang server
and our embedded server talk to the same trainer code.

The trainer hosts the store itself (rank 0, ``is_master=True``): under torchrun
``TORCHELASTIC_USE_AGENT_STORE=True`` turns a ``tcp://`` rendezvous into a store *client* on
every rank, and the trainer side then hangs (measured, see docs/ARCHITECTURE.md). No default
process group is needed or touched: the new group is not the world group, and collectives go
through ``dist.broadcast(t, src, group=pg)``.

``_new_process_group_helper`` is private torch API (signature as of torch 2.13); SGLang relies
on the same call, and tests/test_embedded_server.py exercises it end to end.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_sat.platform.stores import bound_tcp_store

_BACKENDS = ("gloo", "nccl")


def host_store(
    master_address: str, master_port: int, world_size: int, timeout_s: float
) -> dist.TCPStore:
    """Start the group's TCPStore on the trainer (rank 0) without waiting for clients,
    listening on ``master_address`` only (``platform.stores``: torch's own binds every
    interface).

    Args:
        master_address: the trainer's address as the servers see it (127.0.0.1 on one node).
        master_port: TCP port to listen on; 0 lets the OS choose (read it back from ``.port``).

    Raises:
        OSError: naming the address when it cannot be resolved or bound.
    """
    return bound_tcp_store(master_address, master_port, world_size, timedelta(seconds=timeout_s))


@dataclass
class WeightUpdateGroup:
    """One rank's handle on the weight-update group.

    Attributes:
        pg: the torch ProcessGroup (backend gloo on CPU tensors, nccl on CUDA tensors).
        rank: this process's rank in the group (trainer 0, servers >= 1).
        world_size: 1 + total ranks of all rollout servers.
        group_name: name shared with the servers (SGLang's ``group_name``).
        backend: "gloo" or "nccl".
        store: the TCPStore kept alive for the group's lifetime.
    """

    pg: dist.ProcessGroup
    rank: int
    world_size: int
    group_name: str
    backend: str
    store: dist.Store

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Broadcast ``tensor`` in place from ``src`` (group rank) to every rank.

        The tensor must live on the backend's device (CPU for gloo, CUDA for nccl) and be
        contiguous. Returns a work handle when ``async_op`` else None.
        """
        if not tensor.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor")
        return dist.broadcast(tensor, src=src, group=self.pg, async_op=async_op)

    def destroy(self) -> None:
        """Tear the group down and free its name in this process.

        A later group with the same name must rendezvous on a fresh store: the old store still
        holds this group's gloo addresses under the same key prefix.
        """
        dist.destroy_process_group(self.pg)


def create_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
) -> WeightUpdateGroup:
    """Join (or, at rank 0, host) the weight-update group; blocks until all ranks joined.

    Args:
        master_address: host of the TCPStore (the trainer's address as seen by the servers).
        master_port: port of the TCPStore.
        rank: this process's group rank; rank 0 hosts the store unless ``store`` is given.
        world_size: number of ranks in the group.
        group_name: unique name; also the store key prefix (as SGLang uses it).
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        timeout_s: timeout of the rendezvous and of every collective on the group, seconds.
        store: an already hosted store (see ``host_store``) to use instead of connecting.

    Raises:
        ValueError: on an unknown backend, bad rank/world size, or a group name already used in
            this process.
        RuntimeError/DistStoreError: from torch when the rendezvous times out.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
    if not group_name:
        raise ValueError("group_name must be non-empty")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        if rank == 0:
            store = host_store(master_address, master_port, world_size, timeout_s)
        else:
            store = dist.TCPStore(
                master_address, master_port, world_size, is_master=False, timeout=timeout
            )
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    # dist.broadcast maps group ranks through this table; SGLang registers it the same way.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return WeightUpdateGroup(
        pg=pg,
        rank=rank,
        world_size=world_size,
        group_name=group_name,
        backend=backend,
        store=store,
    )
