"""Push a sharded megatron-core model to the rollout servers from every trainer rank at once.

A weight updater (:class:`~megatron_sat.weight_sync.updater.BaseWeightUpdater`) lives in one
process, but the full HF tensors it sends only exist after collectives over the TP and EP
groups (and, with one sender for the whole model, the PP group:
:func:`~megatron_sat.checkpoint.sharding.export_hf_tensors`). So every trainer rank calls
:func:`push_megatron_weights` at the same point: all of them walk the export, and the rank(s)
holding an updater feed it the tensors as they come, while the others discard them. At PP > 1
each stage may hold its own updater over its own group and send its own layers
(:func:`is_stage_sender`, :func:`connect_in_stage_order`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_sat.checkpoint.sharding import export_hf_tensors, export_stage_hf_tensors
from megatron_sat.weight_sync.updater import BaseWeightUpdater, UpdateStats, WeightSyncError


def push_megatron_weights(
    model: torch.nn.Module,
    hf_config: Mapping[str, Any],
    updater: BaseWeightUpdater | None,
    weight_version: str,
) -> UpdateStats | None:
    """Send this trainer's weights to the servers of ``updater``; call on every trainer rank.

    Two layouts of senders, found from who passes an updater:

    - **One sender** (any PP): exactly one rank of the world passes its connected ``updater``.
      Every rank iterates ``export_hf_tensors(model, hf_config)`` to the end: full HF-named
      tensors (per-expert names, the training dtype -- bf16 when training in bf16, fp32
      tensors such as routers and the expert bias stay fp32), gathered across the TP shards,
      EP ranks and (PP > 1) broadcast from every stage; the holder hands them to
      ``updater.update(..., weight_version)`` lazily (at most a couple of buckets in memory).
    - **One sender per pipeline stage** (PP > 1, as slime: no gather to one rank): exactly one
      rank of every stage passes an updater, each connected over its OWN group (its own
      ``group_name``) to the same servers. The stage-0 holder coordinates: it pauses the
      servers and opens their sessions (``begin_update``); then the stages send their own
      layers (``export_stage_hf_tensors``: TP/EP gathers within the stage only) in stage
      order -- stage s's holder waits for a token from stage s-1's, so that one bucket at a
      time is in flight on the servers (two groups broadcasting at once can deadlock a server
      with TP > 1: its ranks could dequeue the two requests in different orders) -- the last
      stage's last bucket carries ``weight_version`` and the flush. The token (failed?,
      loaded anything?) goes back to the coordinator, which ends the sessions and resumes
      generation (``end_update``), or leaves the servers paused when a stage failed after some
      bucket loaded. A stage after a failed one sends nothing.

    If the update fails part-way (e.g. a server rejects a bucket), the sending rank still walks
    the rest of its export, so the other ranks' collectives complete, and only then re-raises.
    Every rank then learns of the failure and raises as well: the trainer ranks stay in step
    and can all retry (``WeightUpdater.update`` may be called again after a failure).

    Collectives (world group): one ``all_gather_object`` before the export (who holds an
    updater, at which stage), the export's own (TP/EP all-gathers, with one sender also the PP
    broadcasts), with one sender per stage a begin-status ``all_gather_object`` and the token's
    point-to-point sends between the holders (CPU int64 tensors: gloo), one
    ``all_gather_object`` at the end (errors). Without an initialised ``torch.distributed``
    this is a world of one. Ranks wait in collectives while a holder waits for the servers (and
    a later stage while the earlier ones send), so the world group's timeout must exceed that.
    An export that raises on some ranks only (a model that differs between ranks) can still
    leave the ranks out of step: that is outside what this function can repair.

    Args:
        model: this rank's megatron-core model (DDP / Float16Module-wrapped or not).
        hf_config: the model's HF ``config.json``.
        updater: a connected updater on the sending rank(s), None on all others.
        weight_version: the servers' ``weight_version`` once every bucket has loaded.

    Returns:
        The updater's ``UpdateStats`` on a sending rank (with one sender per stage: its own
        stage's buckets), None elsewhere.

    Raises:
        ValueError: on every rank, before any tensor is exported, when the holders are neither
            exactly one rank nor exactly one rank per pipeline stage.
        WeightSyncError (or what ``update`` / the export raised, on the rank where it was
            raised): on every rank when the push failed on any rank. The servers' state is as
            ``WeightUpdater.update`` documents (untouched and generating, or paused with mixed
            weights under the old version until a retry succeeds).
    """
    stage, num_stages = _pipeline_stage()
    holders = _all_gather((updater is not None, stage))
    holder_ranks = [r for r, (held, _) in enumerate(holders) if held]
    stages_held = sorted(s for held, s in holders if held)
    if len(holder_ranks) == 1:
        return _push_one_sender(model, hf_config, updater, weight_version)
    if num_stages > 1 and stages_held == list(range(num_stages)):
        by_stage = {s: r for r, (held, s) in enumerate(holders) if held}
        senders = [by_stage[s] for s in range(num_stages)]
        return _push_per_stage(model, hf_config, updater, weight_version, stage, senders)
    raise ValueError(
        "exactly one rank, or exactly one rank per pipeline stage "
        f"({num_stages} stages), must hold a WeightUpdater; got ranks {holder_ranks} "
        f"at stages {stages_held}"
    )


def _push_one_sender(model, hf_config, updater, weight_version) -> UpdateStats | None:
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
    _raise_everywhere(error, weight_version)
    return stats


def _push_per_stage(
    model, hf_config, updater, weight_version: str, stage: int, senders: list[int]
) -> UpdateStats | None:
    """One sender per stage (``senders[s]``: global rank of stage s's holder); see above."""
    me, last = dist.get_rank(), len(senders) - 1
    coordinator = me == senders[0]
    error: Exception | None = None
    if coordinator:
        try:
            updater.begin_update()
        except Exception as e:  # nothing changed; begin_update resumed generation
            error = e
    began = _all_gather(error is None)[senders[0]]
    if not began:
        _raise_everywhere(error, weight_version)

    stats = None
    tensors = export_stage_hf_tensors(model, hf_config)
    token = torch.zeros(2, dtype=torch.int64)  # [a stage failed, some bucket loaded]
    if updater is not None:
        if stage > 0:
            dist.recv(token, src=senders[stage - 1])
        if not token[0]:
            try:
                stats = updater.send_buckets(tensors, weight_version if stage == last else None)
            except Exception as e:
                error = e
                token[0] = 1
            token[1] |= int(updater.loaded_any)
        if stage < last:
            dist.send(token, dst=senders[stage + 1])
        elif not coordinator:
            dist.send(token, dst=senders[0])
    try:
        _drain(tensors)
    except Exception as e:
        error = error or e
    if coordinator:
        if last > 0:
            dist.recv(token, src=senders[last])
        try:
            if token[0]:
                failure = error or WeightSyncError("a later pipeline stage's buckets failed")
                updater.end_update(failure, loaded_elsewhere=bool(token[1]))
            else:
                updater.end_update()
        except Exception as e:
            error = e
    _raise_everywhere(error, weight_version)
    return stats


def is_stage_sender() -> bool:
    """Whether this rank sends its pipeline stage's layers in a push with one sender per stage:
    the ranks of global rank 0's pipeline group (tensor-, data-, expert- and context-parallel
    coordinate 0 in every stage, as slime's DP = TP = 0 source ranks). True on every rank of a
    world of one; at PP = 1 only global rank 0."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return True
    return ps.get_pipeline_model_parallel_first_rank() == 0


def connect_in_stage_order(updater: BaseWeightUpdater | None) -> None:
    """``updater.connect()`` on every stage sender, one stage after the other (a collective on
    the world group: every rank calls it): the servers then join the stages' groups in one
    order, one rendezvous at a time (a server's ranks handle one ``/init_weights_update_group``
    at a time, each blocking until the trainer side joined)."""
    stage, num_stages = _pipeline_stage()
    for s in range(num_stages):
        if s == stage and updater is not None:
            updater.connect()
        if dist.is_initialized():
            dist.barrier()


def _pipeline_stage() -> tuple[int, int]:
    """(this rank's pipeline stage, number of stages); (0, 1) without model parallelism."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()


def _raise_everywhere(error: Exception | None, weight_version: str) -> None:
    """Every rank learns whether some rank failed; the failing rank re-raises its own error,
    the others a ``WeightSyncError`` naming the first failed rank."""
    errors = _all_gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, message) for r, message in enumerate(errors) if message is not None]
    if failed:
        rank, message = failed[0]
        raise WeightSyncError(f"weight push {weight_version!r} failed on rank {rank}: {message}")


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
