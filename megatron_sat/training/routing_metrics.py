"""Top-k routing agreement: how often the trainer's routers pick the rollout engine's experts.

``topk_match_r3`` (replayed forwards: 1.0 when replay works) and ``topk_match_live`` (live
routing) are fractions of (MoE layer, active token) pairs whose top-k expert set equals the
rollout's. Each rank counts its own tokens (a sequence shard under sequence parallelism) of its
own layers (its pipeline stage); the counts are summed over the TP and pipeline groups so that
every rank reports the value of the whole micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sat.routing.slicing import router_token_order
from megatron_sat.training.batching import MicroBatch


@dataclass(frozen=True)
class ShardLayout:
    """Which part of a micro-batch's routing this rank sees.

    Attributes:
        tp_size: the tensor-parallel size.
        sequence_parallel: the routers see a sequence shard of the TP group.
        pp_size: the pipeline size (each stage routes its own layers).
    """

    tp_size: int
    sequence_parallel: bool
    pp_size: int


def topk_counts(
    captured: dict[int, torch.Tensor],
    mb: MicroBatch,
    layout: ShardLayout,
) -> torch.Tensor:
    """float64 [2] on the routers' device: this rank's (MoE layer, active token) pairs (its
    stage's layers, its sequence shard) whose experts equal the rollout's, and all such pairs;
    zeros for a micro-batch without routes. No collective and no host synchronisation (the
    counts stay on the device; ``topk_agreements`` reads nothing back either).

    Args:
        captured: layer number -> bool routing map [local tokens, num_experts]
            (``routing.replay.capture_routing``), tokens in the router's order.
        mb: the micro-batch (padded or packed, on the trainer's device), with or without
            routes.
        layout: this rank's layout.
    """
    from megatron.core import parallel_state

    device = next(iter(captured.values())).device if captured else mb.input_ids.device
    same = torch.zeros((), dtype=torch.float64, device=device)
    if mb.routes is None:
        return torch.zeros(2, dtype=torch.float64, device=device)
    coords = dict(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=layout.tp_size,
        sequence_parallel=layout.sequence_parallel,
    )
    active = router_token_order(mb.active, **coords).to(device)
    for layer, used in captured.items():
        # Widened per layer (the routes stay compact until here).
        rollout = router_token_order(mb.routes[:, :, layer - 1], **coords).to(device).long()
        rollout_map = torch.zeros_like(used).scatter_(1, rollout, True)
        matched = (rollout_map == used).all(dim=1) & active
        same = same + matched.sum()
    pairs = active.sum().to(torch.float64) * len(captured)  # active tokens x MoE layers
    return torch.stack([same, pairs])


def topk_agreements(counts: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """Per micro-batch, the agreement of ``counts`` [M, 2] (``topk_counts``) summed over the
    TP group under sequence parallelism and over the pipeline stages (each holds its own
    layers): float64 [M] on ``counts``' device, the same values on every rank (0 without a
    pair). A collective over those groups; ``counts`` is reduced in place. No host
    synchronisation: the values are read back with the step's other metrics."""
    from megatron.core import parallel_state

    if layout.sequence_parallel and layout.tp_size > 1:
        torch.distributed.all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
    if layout.pp_size > 1:
        torch.distributed.all_reduce(
            counts, group=parallel_state.get_pipeline_model_parallel_group()
        )
    same, total = counts[:, 0], counts[:, 1]
    return torch.where(total > 0, same / total.clamp_min(1.0), torch.zeros_like(same))


def topk_agreement(
    captured: dict[int, torch.Tensor],
    mb: MicroBatch,
    layout: ShardLayout,
) -> torch.Tensor | None:
    """Fraction of (MoE layer, active token) pairs of one micro-batch whose experts equal the
    rollout's, a 0-dim float64 tensor on the device (None for a micro-batch without rollout
    routes; 0 without an active token, whose weight in the metrics is 0 then). Every TP and
    pipeline rank returns the value of the whole micro-batch (a collective over those groups,
    ``topk_agreements``).

    Args:
        captured: as ``topk_counts``.
        mb: the micro-batch.
        layout: this rank's layout.
    """
    if mb.routes is None:
        return None
    return topk_agreements(topk_counts(captured, mb, layout)[None], layout)[0]
