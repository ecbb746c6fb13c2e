"""One distributed train step: rank 0's batch split into whole-group shares per data-parallel
rank (``dp_shares``), sent as flat CPU tensors, and ``PolicyTrainer.rl_step`` on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sat.config import RunConfig
from megatron_sat.rollout.types import Sample
from megatron_sat.training.batch_transfer import distribute_batch
from megatron_sat.training.trainer import PolicyTrainer


def dp_shares(num_samples: int, group_size: int, num_ranks: int) -> list[slice]:
    """Contiguous shares of whole groups for ``num_ranks`` data-parallel ranks.

    The groups are split as evenly as possible, the first ranks taking one more group when
    they do not divide evenly; a rank may get none when there are fewer groups than ranks.

    Raises:
        ValueError: ``num_samples`` is not a multiple of ``group_size``, or a count < 1.
    """
    if group_size < 1 or num_ranks < 1:
        raise ValueError(f"group_size ({group_size}) and num_ranks ({num_ranks}) must be >= 1")
    if num_samples % group_size:
        raise ValueError(f"{num_samples} samples are not whole groups of {group_size}")
    base, extra = divmod(num_samples // group_size, num_ranks)
    shares, start = [], 0
    for rank in range(num_ranks):
        stop = start + (base + (rank < extra)) * group_size
        shares.append(slice(start, stop))
        start = stop
    return shares


def distributed_rl_step(
    trainer: PolicyTrainer,
    samples: list[Sample] | None,
    advantages: torch.Tensor | None,
    cfg: RunConfig,
    trainer_version: int | None,
    *,
    routing_diagnostic: bool = True,
) -> dict[str, float]:
    """One train step on every rank: rank 0 passes the whole batch and sends each rank the
    share of its data-parallel rank (``dp_shares``; TP ranks of one DP rank get the same
    share) as flat CPU tensors over gloo (``training.batch_transfer``: no pickle, nothing
    staged on a GPU); the other ranks pass None and receive theirs. Returns the global metrics of
    ``PolicyTrainer.rl_step`` (on every rank); ``routing_diagnostic`` (the same on every
    rank: ``routing_diagnostic_due``) runs its live-routing diagnostic forward.

    Raises:
        ValueError: a non-zero rank passed samples, or rank 0 passed none.
    """
    share_samples, share_advantages, version = rank_share(
        trainer, samples, advantages, cfg, trainer_version
    )
    return trainer.rl_step(
        share_samples,
        share_advantages,
        cfg.objective,
        trainer_version=version,
        routing_diagnostic=routing_diagnostic,
    )


def rank_share(
    trainer: PolicyTrainer,
    samples: list[Sample] | None,
    advantages: torch.Tensor | None,
    cfg: RunConfig,
    trainer_version: int | None,
) -> tuple[list[Sample], torch.Tensor, int | None]:
    """This rank's share of rank 0's batch: ``(samples, advantages, trainer_version)`` (a
    collective; see ``distributed_rl_step``). Rank 0 passes the batch, the others None.

    Raises:
        ValueError: a non-zero rank passed samples, or rank 0 passed none.
    """
    from megatron.core import parallel_state

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if (samples is None) != (rank != 0):
        raise ValueError(f"rank {rank}: only rank 0 passes the batch to distributed_rl_step")
    if world == 1:
        return samples, advantages, trainer_version
    # Flat CPU tensors over gloo, each rank only its share (training.batch_transfer).
    slices = None
    if rank == 0:
        num_dp = parallel_state.get_data_parallel_world_size()
        slices = dp_shares(len(samples), cfg.rollout.group_size, num_dp)
    return distribute_batch(
        samples, advantages, trainer_version, slices, parallel_state.get_data_parallel_rank()
    )


def routing_diagnostic_due(interval: int, step: int) -> bool:
    """Whether optimizer step ``step`` (1-based) runs the live-routing diagnostic forward at
    ``train.routing_diagnostic_interval`` = ``interval`` (every ``interval`` steps, as
    ``train.save_every`` counts; 0 = never).

    Raises:
        ValueError: ``interval`` < 0 or ``step`` < 1.
    """
    if interval < 0 or step < 1:
        raise ValueError(f"routing_diagnostic_due: interval={interval} < 0 or step={step} < 1")
    return interval > 0 and step % interval == 0
