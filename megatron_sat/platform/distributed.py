"""Process-group set-up: torch.distributed world and megatron-core's model-parallel state.

megatron-core keeps its parallel state in module globals; this module is the one place that
creates and destroys it.
"""

from __future__ import annotations

import datetime
import math
import os
import socket

import torch

from megatron_sat.config.parallel import ParallelConfig
from megatron_sat.platform.device import apply_cpu_shims, default_backend
from megatron_sat.platform.fusions import announce_fusions, device_fusions
from megatron_sat.platform.stores import bound_tcp_store


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    parallel: ParallelConfig, seed: int = 1234, timeout_minutes: float | None = None
) -> None:
    """Initialise torch.distributed (from torchrun's env, or a 1-process world) and
    megatron-core's model-parallel groups and RNG tracker. Idempotent for the same layout.
    ``timeout_minutes`` (None: torch's default) bounds every collective of the world and of
    megatron-core's groups; it applies only when this call creates the world.

    First decides the layer spec and fusions by what imports (``platform.fusions``) and prints
    them once on rank 0.

    Raises:
        BrokenInstallError: transformer-engine or apex's CUDA extension is installed but fails
            to import (named, with the fix).
        ValueError: when the world size does not fit the layout (TP*CP*PP and ETP*EP*PP must
            divide it), CP > 1 without CUDA (attention under CP needs transformer-engine), or
            megatron-core is already initialised at another layout (destroy it first:
            ``destroy_distributed``), which would otherwise be kept silently.
    """
    cp = parallel.context_parallel_size
    if cp > 1 and not torch.cuda.is_available():
        raise ValueError(
            f"parallel.context_parallel_size={cp} on a machine without CUDA: attention under "
            "context parallelism is transformer-engine's (TEDotProductAttention's ring "
            "attention); megatron-core's local attention, the CPU path, has none. Use "
            "context_parallel_size=1 here"
        )
    # Before megatron-core is imported: it imports TE and apex itself and would crash on, or
    # silently drop, a broken install that this refuses by name (platform.fusions).
    fusions = device_fusions()
    apply_cpu_shims()
    timeout = None if timeout_minutes is None else datetime.timedelta(minutes=timeout_minutes)
    if not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        _init_world(timeout)
    announce_fusions(fusions, rank=torch.distributed.get_rank())
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = torch.distributed.get_world_size()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    if world % (tp * cp * pp) or world % (etp * ep * pp):
        raise ValueError(
            f"world size {world} is not divisible by TP*CP*PP={tp * cp * pp} and "
            f"ETP*EP*PP={etp * ep * pp}"
        )
    if ps.model_parallel_is_initialized():
        have = ParallelConfig(
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_context_parallel_world_size(),
        )
        if have != parallel:
            raise ValueError(
                f"megatron-core's parallel state is already initialised at {have}, not "
                f"{parallel}: destroy it first (platform.distributed.destroy_distributed)"
            )
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
        # megatron-core takes whole minutes: round up, never to 0
        distributed_timeout_minutes=math.ceil(timeout_minutes) if timeout_minutes else 30,
    )
    model_parallel_cuda_manual_seed(seed)


def _init_world(timeout: datetime.timedelta | None) -> None:
    """The default process group, its TCPStore listening only at the launch plan's address
    (``platform.stores``).

    - torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``): the agent hosts the store (bound by
      ``platform.torchrun``); the ranks are its clients through torch's ``env://``.
    - ``RANK`` and ``MASTER_ADDR`` without the agent (srun, mpirun: launch code maps their
      variables): rank 0 hosts the store at ``MASTER_ADDR:MASTER_PORT``, the others connect.
    - neither: a 1-process world on a loopback store, without touching os.environ (child
      processes, servers and launchers, must not inherit a fake rank).
    """
    backend = default_backend()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        torch.distributed.init_process_group(backend=backend, timeout=timeout)
        return
    store_timeout = timeout or datetime.timedelta(minutes=30)
    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if rank == 0:
            store = bound_tcp_store(host, port, world, store_timeout, wait_for_workers=False)
        else:
            store = torch.distributed.TCPStore(
                host, port, world, is_master=False, timeout=store_timeout
            )
    else:
        rank, world = 0, 1
        store = bound_tcp_store("127.0.0.1", 0, 1, store_timeout)
    torch.distributed.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world, timeout=timeout
    )


def destroy_distributed() -> None:
    """Tear down megatron-core's parallel state and the torch.distributed world."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
