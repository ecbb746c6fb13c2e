"""Process-group set-up: torch.distributed world and megatron-core's model-parallel state.

megatron-core keeps its parallel state in module globals; this module is the one place that
creates and destroys it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from megatron_sat.platform import apply_cpu_shims, default_backend


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallel layout of the trainer ranks.

    Attributes:
        tensor_model_parallel_size: TP degree (sequence parallel is on whenever TP > 1).
        pipeline_model_parallel_size: PP degree.
        expert_model_parallel_size: EP degree.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        for field in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"parallel.{field} must be >= 1, got {getattr(self, field)}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Initialise torch.distributed (from torchrun's env, or a 1-process world) and
    megatron-core's model-parallel groups and RNG tracker. Idempotent.

    Raises:
        ValueError: when the world size is not divisible by TP x PP (or EP).
    """
    apply_cpu_shims()
    if not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ:  # torchrun, srun or mpirun (launch code maps their variables)
            torch.distributed.init_process_group(backend=default_backend())
        else:
            # A 1-process world without touching os.environ: child processes (servers,
            # launchers) must not inherit a fake torchrun rank.
            torch.distributed.init_process_group(
                backend=default_backend(),
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
            )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = torch.distributed.get_world_size()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    ep = parallel.expert_model_parallel_size
    if world % (tp * pp) or world % (ep * pp):
        raise ValueError(
            f"world size {world} is not divisible by TP*PP={tp * pp} and EP*PP={ep * pp}"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
        )
        model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down megatron-core's parallel state and the torch.distributed world."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
