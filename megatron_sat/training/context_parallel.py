"""Context parallelism (CP): which positions of a micro-batch each CP rank holds, and back.

megatron-core's load-balanced sequence split (``megatron.core.utils.
_get_batch_on_this_cp_rank_per_sequence_balancing``, used by ``get_batch_on_this_cp_rank``):
every row of S positions (S divisible by 2 x CP) is cut into 2 x CP equal chunks, and CP rank r
holds chunks r and 2 x CP - 1 - r, in that order, so that under causal attention every rank has
as many early (cheap) as late (costly) queries. For CP = 2 and S = 8: rank 0 holds positions
0 1 6 7, rank 1 holds 2 3 4 5. Every tensor of the micro-batch with a sequence dimension is cut
by this one index (:func:`context_parallel_positions`), so tokens, labels, loss masks, rollout
log-probs, versions and the R3 routes stay aligned; per-sample tensors (advantages) are not cut.
megatron-core's RoPE follows the same split (``get_pos_emb_on_this_cp_rank``).

R3 under CP: a CP rank's routers see its [B, S / CP] positions; within them sequence
parallelism cuts contiguous TP shards as usual, so a rank's replay targets are
``routing.slicing.router_targets`` of the CP-sliced routes.

The inverse, :func:`reassemble_context_parallel`, puts the CP ranks' pieces (e.g. per-token
log-probs after an all-gather over the CP group, :func:`all_gather_context_parallel`) back in
sequence order, so the losses read the whole sample layout.

Attention across CP ranks (ring attention with causal masking) is transformer-engine's
(``TEDotProductAttention`` with ``cp_comm_type``); megatron-core's local attention refuses CP,
so a CPU run with CP > 1 is refused (``platform.distributed.init_distributed``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from megatron_sat.training.batching import MicroBatch


def context_parallel_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk ids (of 2 x ``cp_size``) that CP rank ``cp_rank`` holds: (r, 2CP-1-r).

    Raises:
        ValueError: ``cp_size`` < 1 or the rank outside [0, cp_size).
    """
    if cp_size < 1:
        raise ValueError(f"context_parallel_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def context_parallel_positions(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """int64 [seq_len / cp_size]: the positions CP rank ``cp_rank`` holds, in its order
    (chunk r, then chunk 2CP-1-r). All positions for ``cp_size`` = 1.

    Raises:
        ValueError: ``seq_len`` not divisible by 2 x ``cp_size`` (pad the micro-batch to it),
            or as :func:`context_parallel_chunks`.
    """
    first, second = context_parallel_chunks(cp_rank, cp_size)
    if cp_size == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 x CP = {2 * cp_size}: the "
            f"load-balanced split needs equal chunks (pad the micro-batch to a multiple of it)"
        )
    chunk = seq_len // (2 * cp_size)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk),
            torch.arange(second * chunk, (second + 1) * chunk),
        ]
    )


def slice_context_parallel(
    x: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1
) -> torch.Tensor:
    """CP rank ``cp_rank``'s part of ``x`` along ``seq_dim`` (1 for [B, S, ...]; 2 for an
    attention mask [B, 1, S, S], whose query dimension is cut as megatron-core cuts it): a
    copy, ``x.shape[seq_dim] / cp_size`` long there.

    Raises:
        ValueError: as :func:`context_parallel_positions`.
    """
    index = context_parallel_positions(x.shape[seq_dim], cp_rank, cp_size).to(x.device)
    return x.index_select(seq_dim, index)


def reassemble_context_parallel(pieces: Sequence[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`slice_context_parallel` over all ranks: ``pieces[r]`` is CP rank
    r's part; returns the tensor in sequence order. Differentiable (an index_copy).

    Raises:
        ValueError: no pieces, or pieces of unequal shape (naming the rank).
    """
    if not pieces:
        raise ValueError("no context-parallel pieces to reassemble")
    cp_size = len(pieces)
    shape = pieces[0].shape
    for r, piece in enumerate(pieces):
        if piece.shape != shape:
            raise ValueError(
                f"CP rank {r}'s piece has shape {tuple(piece.shape)}, rank 0's {tuple(shape)}"
            )
    seq_len = shape[seq_dim] * cp_size
    index = torch.cat([context_parallel_positions(seq_len, r, cp_size) for r in range(cp_size)]).to(
        pieces[0].device
    )
    stacked = torch.cat(list(pieces), dim=seq_dim)
    out_shape = list(shape)
    out_shape[seq_dim] = seq_len
    return stacked.new_zeros(out_shape).index_copy(seq_dim, index, stacked)


def all_gather_context_parallel(
    local: torch.Tensor, group: torch.distributed.ProcessGroup | None, seq_dim: int = 1
) -> torch.Tensor:
    """Every CP rank's ``local`` part, all-gathered over the CP ``group`` and reassembled in
    sequence order (a collective; the identity without a group or with one rank). No gradient
    flows to the other ranks' parts (a plain all-gather): use it for no-grad log-probs, or keep
    the loss on the local positions."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, local.contiguous(), group=group)
    return reassemble_context_parallel(pieces, seq_dim=seq_dim)


# Fields of MicroBatch with a sequence dimension (dim 1); the others are per sample.
SEQUENCE_FIELDS = (
    "input_ids",
    "position_ids",
    "labels",
    "loss_mask",
    "rollout_log_probs",
    "response_versions",
    "routes",
    "routes_valid",
)


def slice_micro_batch_context_parallel(mb: MicroBatch, cp_rank: int, cp_size: int) -> MicroBatch:
    """CP rank ``cp_rank``'s part of a padded micro-batch: every sequence field of
    :data:`SEQUENCE_FIELDS` cut by the same index (position ids keep their values, as RoPE
    under CP needs), advantages and sample indices whole.

    Raises:
        ValueError: as :func:`context_parallel_positions`.
    """
    index = context_parallel_positions(mb.input_ids.shape[1], cp_rank, cp_size)
    cut = {}
    for name in SEQUENCE_FIELDS:
        value = getattr(mb, name)
        cut[name] = None if value is None else value.index_select(1, index.to(value.device))
    return dataclasses.replace(mb, **cut)


def reassemble_micro_batch_context_parallel(pieces: Sequence[MicroBatch]) -> MicroBatch:
    """The micro-batch whose CP parts are ``pieces`` (rank order): the inverse of
    :func:`slice_micro_batch_context_parallel`.

    Raises:
        ValueError: as :func:`reassemble_context_parallel`; pieces of different samples or
            advantages (naming the rank).
    """
    if not pieces:
        raise ValueError("no context-parallel pieces to reassemble")
    for r, piece in enumerate(pieces):
        if piece.sample_indices != pieces[0].sample_indices or not torch.equal(
            piece.advantages, pieces[0].advantages
        ):
            raise ValueError(f"CP rank {r}'s piece holds other samples than rank 0's")
    whole = {}
    for name in SEQUENCE_FIELDS:
        values = [getattr(p, name) for p in pieces]
        whole[name] = None if values[0] is None else reassemble_context_parallel(values)
    return dataclasses.replace(pieces[0], **whole)
