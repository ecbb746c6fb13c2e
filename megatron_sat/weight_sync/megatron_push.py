"""Push a sharded megatron-core model to the rollout servers from every trainer rank at once.

A :class:`~megatron_sat.weight_sync.broadcast.WeightUpdater` lives in one process (global
rank 0), but the full HF tensors it sends only exist after collectives over the TP, EP and PP
groups (:func:`~megatron_sat.checkpoint.sharding.export_hf_tensors`). So every trainer rank
calls :func:`push_megatron_weights` at the same point: all of them walk the export, and the rank
holding the updater feeds it the tensors as they come, while the others discard them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_sat.checkpoint.sharding import export_hf_tensors
from megatron_sat.weight_sync.broadcast import UpdateStats, WeightSyncError, WeightUpdater


def push_megatron_weights(
    model: torch.nn.Module,
    hf_config: Mapping[str, Any],
    updater: WeightUpdater | None,
    weight_version: str,
) -> UpdateStats | None:
    """Send this trainer's weights to the servers of ``updater``; call on every trainer rank.

    Every rank iterates ``export_hf_tensors(model, hf_config)`` to the end: full HF-named
    tensors (per-expert names, the training dtype, e.g. float32 [V, H] for the embedding),
    gathered across the TP shards, EP ranks and PP stages. Exactly one rank of the world passes
    its connected ``updater`` (the others pass None); that rank hands the tensors to
    ``updater.update(..., weight_version)`` lazily, so at most a couple of buckets are held in
    memory, not the whole model.

    If the update fails part-way (e.g. a server rejects a bucket), the pushing rank still walks
    the rest of the export, so the other ranks' collectives complete, and only then re-raises.
    Every rank then learns of the failure and raises as well: the trainer ranks stay in step
    and can all retry (``WeightUpdater.update`` may be called again after a failure).

    Collectives (world group): one ``all_gather_object`` before the export (who holds an
    updater), the export's own (TP/EP all-gathers, PP broadcasts), one ``all_gather_object``
    after it (errors). Without an initialised ``torch.distributed`` this is a world of one.
    The other ranks wait in the export's collectives while the pushing rank waits for the
    servers, so the world group's timeout must exceed a bucket's round trip. An export that
    raises on some ranks only (a model that differs between ranks) can still leave the ranks
    out of step: that is outside what this function can repair.

    Args:
        model: this rank's megatron-core model (DDP / Float16Module-wrapped or not).
        hf_config: the model's HF ``config.json``.
        updater: a connected updater on exactly one rank, None on all others.
        weight_version: the servers' ``weight_version`` once every bucket has loaded.

    Returns:
        The updater's ``UpdateStats`` on the pushing rank, None elsewhere.

    Raises:
        ValueError: on every rank, before any tensor is exported, when not exactly one rank
            holds an updater.
        WeightSyncError (or what ``update`` / the export raised, on the rank where it was
            raised): on every rank when the push failed on any rank. The servers' state is as
            ``WeightUpdater.update`` documents (untouched and generating, or paused with mixed
            weights under the old version until a retry succeeds).
    """
    holders = _all_gather(updater is not None)
    if sum(holders) != 1:
        ranks = [r for r, held in enumerate(holders) if held]
        raise ValueError(f"exactly one rank must hold the WeightUpdater, got ranks {ranks}")

    tensors = export_hf_tensors(model, hf_config)
    stats = None
    error: Exception | None = None
    try:
        if updater is not None:
            stats = updater.update(tensors, weight_version)
    except Exception as e:
        error = e
    # Walk whatever the update did not consume (all of it on the other ranks; the rest after
    # a failure on the pushing rank), so every rank runs the same sequence of collectives.
    try:
        _drain(tensors)
    except Exception as e:
        error = error or e

    errors = _all_gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, message) for r, message in enumerate(errors) if message is not None]
    if failed:
        rank, message = failed[0]
        raise WeightSyncError(f"weight push {weight_version!r} failed on rank {rank}: {message}")
    return stats


def _all_gather(value: Any) -> list[Any]:
    """``value`` of every rank of the world, in rank order (``[value]`` in a world of one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _drain(tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Run the rest of the export's collectives, discarding its tensors."""
    for _ in tensors:
        pass
