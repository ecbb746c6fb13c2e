"""Samples -> padded micro-batch tensors, with the R3 routes aligned exactly like the tokens.

Layout (right padding, one sample per row, S = longest prompt + response in the micro-batch,
optionally rounded up): ``input_ids[b, :P+R]`` = prompt ids then response ids. Position t
predicts token t + 1, so the log-prob of response token j (absolute position P + j) sits at
position ``P + j - 1``: ``labels``, ``loss_mask``, ``rollout_log_probs`` and
``response_versions`` live at those positions.

One index map places everything: :func:`place_tokens` takes, for every position (r, t) of the
model's input, the sample it holds (``sample_row``, -1 for padding) and the position inside
that sample (``sample_pos``), and builds ``input_ids``, ``labels`` and the routes from the same
map, so routes cannot drift from tokens. The padded layout here and the packed layout of
:mod:`megatron_sat.training.packing` are two such maps.

Routes: SGLang returns ``routed_experts`` [P + R - 1, num_layers, top_k] (no row for the last
token), all decoder layers included (dense ones too, filled with expert 0 by SGLang: only the MoE
layers' rows are checked, :func:`check_sample_routes`). A filler row stands in for the last token
and for every padding position. Filler rows hold valid ids that differ within the row and cycle
over all experts (and so over all EP ranks, whose experts are contiguous ranges), so padding
never piles onto one expert. Routes stay in the compact dtype of the payload (uint8 up to 256
experts, int16 above) until a router's target is cut from them
(:func:`megatron_sat.routing.slicing.router_targets`, which widens to int64).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_sat.rollout.types import Sample
from megatron_sat.routing.checks import RouteFault, find_route_fault, layer_selection
from megatron_sat.routing.payload import compact_expert_dtype
from megatron_sat.routing.slicing import router_targets


@dataclass
class MicroBatch:
    """One micro-batch of B samples padded to S tokens (model layout = sample layout).

    Attributes:
        input_ids: int64 [B, S].
        position_ids: int64 [B, S].
        labels: int64 [B, S], next token at each position (0 at padding).
        loss_mask: float32 [B, S], 1.0 where ``labels`` is a response token.
        rollout_log_probs: float32 [B, S], log mu of the label token (0 where inactive).
        response_versions: int64 [B, S], policy version that sampled the label (-1 inactive).
        advantages: float32 [B], one per sample.
        routes: [B, S, L, K] expert ids per token and decoder layer (dense layers included,
            filler rows included), uint8 (<= 256 experts) or int16; None without routing data.
        routes_valid: bool [B, S], True where ``routes`` came from the rollout engine.
        sample_indices: the ``Sample.index`` of each row.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    response_versions: torch.Tensor
    advantages: torch.Tensor
    routes: torch.Tensor | None
    routes_valid: torch.Tensor
    sample_indices: list[int]

    @property
    def attention_mask(self) -> None:
        """No explicit mask: megatron-core's default causal mask is right for one sample per
        row (packed rows carry a block-diagonal one, see ``training.packing``)."""
        return None

    @property
    def samples(self) -> MicroBatch:
        """The per-sample view the losses read (this micro-batch itself)."""
        return self

    @property
    def active(self) -> torch.Tensor:
        """bool [B, S] in the model layout: positions whose outputs give response log-probs."""
        return self.loss_mask.bool()

    def to_sample_layout(self, x: torch.Tensor) -> torch.Tensor:
        """Model layout [B, S, ...] -> sample layout [B, S, ...]: the identity here."""
        return x

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if torch.is_tensor(getattr(self, f.name))
            },
        )

    def routing_targets(self, layers: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
        """Global 1-based layer number -> int64 [S * B, K] in the router's token order, for a
        single rank without sequence parallelism (use
        :meth:`megatron_sat.routing.replay.RoutingReplay.routes_for` on a parallel model).

        Args:
            layers: the MoE layer numbers to cut (default: every decoder layer, which fits only
                an all-MoE model: dense layers have no router to take their rows).

        Raises:
            ValueError: without routing data, or as :func:`router_targets`.
        """
        if self.routes is None:
            raise ValueError("this micro-batch carries no routing data (R3 needs routed experts)")
        num_layers = self.routes.shape[2]
        layers = range(1, num_layers + 1) if layers is None else layers
        return router_targets(self.routes, layers, num_layers=num_layers)


def filler_routes(num_rows: int, top_k: int, num_experts: int, start: int = 0) -> np.ndarray:
    """Expert ids [num_rows, top_k] for rows without rollout routes.

    Row i holds experts ``((start + i) * top_k + j) % num_experts``: distinct within a row
    (top_k <= num_experts) and spread evenly over all experts, hence over all EP ranks.

    Raises:
        ValueError: if top_k > num_experts (no row of distinct ids exists).
    """
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} > num_experts={num_experts}")
    rows = np.arange(start, start + num_rows)[:, None] * top_k + np.arange(top_k)[None, :]
    return rows % num_experts


def check_sample_routes(
    sample: Sample,
    num_layers: int,
    top_k: int,
    num_experts: int,
    moe_layers: Sequence[int] | None = None,
) -> None:
    """Raise ``ValueError`` naming the sample unless its ``routed_experts`` is
    [P + R - 1, num_layers, top_k] with, on every MoE layer, ids in [0, num_experts) that
    differ within a token's row.

    ``num_layers`` counts every decoder layer: SGLang's payload has rows for dense layers too,
    and fills them with expert 0 (its capture buffer is zero-initialised and only layers with a
    router write into it: ``srt/state_capturer/base.py``, 0.5.23). Dense layers' rows are never
    replayed, so their values are not checked.

    Args:
        sample: the sample to check.
        num_layers, top_k, num_experts: the payload's shape and the experts per MoE layer.
        moe_layers: global 1-based numbers of the layers with a router (megatron-core's
            ``layer_number``; :func:`megatron_sat.routing.slicing.moe_layer_numbers`); None
            means every layer has one (an all-MoE model).

    Raises:
        ValueError: naming the sample (and the token row and layer of a repeated expert), or
            for a ``moe_layers`` entry outside [1, num_layers].
    """
    layer_selection(num_layers, moe_layers)  # refuses entries outside [1, num_layers]
    _check_route_shape(sample, num_layers, top_k)
    fault = find_route_fault(sample.routed_experts, num_experts, moe_layers)
    _raise_route_fault(sample, fault, num_experts)


def _check_route_shape(sample: Sample, num_layers: int, top_k: int) -> None:
    """The shape and dtype half of :func:`check_sample_routes`."""
    routed = sample.routed_experts
    expected = (sample.num_tokens - 1, num_layers, top_k)
    if routed is None:
        raise ValueError(f"sample {sample.index} has no routed_experts but R3 replay is on")
    if not isinstance(routed, np.ndarray) or not np.issubdtype(routed.dtype, np.integer):
        kind = routed.dtype if isinstance(routed, np.ndarray) else type(routed).__name__
        raise ValueError(
            f"sample {sample.index}: routed_experts must be an integer numpy array, got {kind}"
        )
    if tuple(routed.shape) != expected:
        raise ValueError(
            f"sample {sample.index}: routed_experts has shape {tuple(routed.shape)}, expected "
            f"{expected} = [prompt {len(sample.prompt_ids)} + response "
            f"{len(sample.response_ids)} - 1 tokens, {num_layers} layers, top_k {top_k}]"
            + (
                f"; it has {routed.shape[1]} layers, the model has {num_layers}"
                if routed.ndim == 3 and routed.shape[1] != num_layers
                else ""
            )
        )


def _raise_route_fault(sample: Sample, fault: RouteFault | None, num_experts: int) -> None:
    """The named error of :func:`check_sample_routes` for ``fault`` (row and layer of
    ``sample.routed_experts``); nothing when ``fault`` is None."""
    if fault is None:
        return
    if fault.kind == "range":
        raise ValueError(f"sample {sample.index}: routed_experts ids outside [0, {num_experts})")
    row = sample.routed_experts[fault.row, fault.layer].tolist()
    raise ValueError(
        f"sample {sample.index}: routed_experts row {fault.row}, layer {fault.layer} names one "
        f"expert twice: {row}"
    )


@dataclass
class PlacedTokens:
    """Tokens and routes placed by an index map (see :func:`place_tokens`), model layout.

    Attributes:
        input_ids: int64 [R, T].
        labels: int64 [R, T], the next token of the same sample (0 at its last token and at
            padding).
        routes: [R, T, L, K] compact dtype, or None.
        routes_valid: bool [R, T], True where the route is the rollout engine's.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    routes: torch.Tensor | None
    routes_valid: torch.Tensor


def place_tokens(
    samples: Sequence[Sample],
    sample_row: torch.Tensor,
    sample_pos: torch.Tensor,
    *,
    pad_token_id: int,
    routing_shape: tuple[int, int, int] | None,
    moe_layers: Sequence[int] | None = None,
) -> PlacedTokens:
    """Build model-layout tokens, labels and routes from one index map.

    Args:
        samples: the samples referenced by the map.
        sample_row: int64 [R, T], index into ``samples`` of the sample at each position, -1 for
            padding.
        sample_pos: int64 [R, T], position inside that sample (ignored at padding).
        pad_token_id: token written at padding.
        routing_shape: (num_layers, top_k, num_experts) to place routes, or None.
        moe_layers: the layers with a router, as :func:`check_sample_routes` (None: all).

    Raises:
        ValueError: on bad routes (naming the sample, see :func:`check_sample_routes`) or a map
            that points outside a sample.
    """
    rows, seq = sample_row.shape
    real = sample_row >= 0
    lengths = torch.tensor([s.num_tokens for s in samples], dtype=torch.long)
    offsets = torch.cumsum(lengths, 0) - lengths
    ids = [x for s in samples for x in (s.prompt_ids, s.response_ids)]
    flat_tokens = torch.from_numpy(_flat(ids, np.int64, int(lengths.sum())))
    src_row = sample_row.clamp(min=0)
    if bool((real & ((sample_pos < 0) | (sample_pos >= lengths[src_row]))).any()):
        raise ValueError("index map points outside a sample")
    flat_index = offsets[src_row] + sample_pos.clamp(min=0)
    input_ids = torch.where(real, flat_tokens[flat_index.clamp(max=len(flat_tokens) - 1)], 0)
    input_ids = input_ids.masked_fill(~real, pad_token_id)
    has_next = real & (sample_pos + 1 < lengths[src_row])
    next_ids = flat_tokens[(flat_index + 1).clamp(max=len(flat_tokens) - 1)]
    labels = torch.where(has_next, next_ids, 0)
    routes = None
    routes_valid = has_next  # a token has a rollout route iff it is not its sample's last
    if routing_shape is not None:
        starts = _contiguous_starts(sample_row, sample_pos, real, lengths)
        if starts is None:
            routes = _gather_routes(
                samples, src_row, sample_pos, routes_valid, offsets, routing_shape, moe_layers
            )
        else:
            routes = _copy_routes(
                samples, starts, sample_row, sample_pos, routes_valid, routing_shape, moe_layers
            )
    return PlacedTokens(input_ids, labels, routes, routes_valid)


def _torch_dtype(num_experts: int) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=compact_expert_dtype(num_experts))).dtype


def _filler_cycle(routing_shape: tuple[int, int, int]) -> np.ndarray:
    """One period of filler rows [period, top_k] in the compact dtype: filler row i (flat
    position i of the model input) is row ``i % period``, period num_experts / gcd(top_k,
    num_experts)."""
    _, top_k, num_experts = routing_shape
    period = num_experts // math.gcd(top_k, num_experts)
    return filler_routes(period, top_k, num_experts).astype(compact_expert_dtype(num_experts))


def _contiguous_starts(
    sample_row: torch.Tensor, sample_pos: torch.Tensor, real: torch.Tensor, lengths: torch.Tensor
) -> list[int] | None:
    """Flat position (over [R, T]) of each sample's first token when the map holds every token
    of every sample at consecutive flat positions in order (the padded and packed layouts);
    None otherwise (the general gather then places the routes). Numpy: a handful of small
    arrays per micro-batch, where torch's per-call cost would dominate."""
    if not len(lengths):
        return None
    real_np = real.numpy().reshape(-1)
    flat = np.flatnonzero(real_np)
    which = sample_row.numpy().reshape(-1)[flat]
    first = flat - sample_pos.numpy().reshape(-1)[flat]
    if not np.array_equal(np.bincount(which, minlength=len(lengths)), lengths.numpy()):
        return None
    starts = np.full(len(lengths), -1, dtype=np.int64)
    starts[which] = first
    if not np.array_equal(starts[which], first):
        return None
    return starts.tolist()


def _copy_routes(
    samples: Sequence[Sample],
    starts: list[int],
    sample_row: torch.Tensor,
    sample_pos: torch.Tensor,
    routes_valid: torch.Tensor,
    routing_shape: tuple[int, int, int],
    moe_layers: Sequence[int] | None,
) -> torch.Tensor:
    """Routes [R, T, L, K] for a map that holds each sample contiguously: one preallocated
    array in the compact dtype, each sample's rows copied in once at its start, filler rows
    written at the other positions, then one vectorised check of the whole micro-batch
    (:func:`megatron_sat.routing.checks.find_route_fault`; filler rows always pass) whose
    fault is named by sample, row and layer as :func:`check_sample_routes` names it. Once it
    passes, each sample's ``routed_experts`` (in the compact dtype) is replaced by the view of
    its rows in the micro-batch: equal values, one copy held instead of two."""
    num_layers, top_k, num_experts = routing_shape
    layer_selection(num_layers, moe_layers)
    dtype = compact_expert_dtype(num_experts)
    rows, seq = sample_row.shape
    routes = np.empty((rows * seq, num_layers, top_k), dtype=dtype)
    for s, start in zip(samples, starts, strict=True):
        _check_route_shape(s, num_layers, top_k)
        if s.routed_experts.dtype != dtype:  # a cast could wrap an id: check before it
            _raise_route_fault(
                s, find_route_fault(s.routed_experts, num_experts, moe_layers), num_experts
            )
        routes[start : start + len(s.routed_experts)] = s.routed_experts
    fill = np.flatnonzero(~routes_valid.reshape(-1).numpy())
    cycle = _filler_cycle(routing_shape)
    routes[fill] = cycle[fill % len(cycle)][:, None, :]
    fault = find_route_fault(routes, num_experts, moe_layers)
    if fault is not None:
        row = int(sample_row.view(-1)[fault.row])
        if row < 0:
            raise RuntimeError(f"filler route at flat position {fault.row} is invalid: {fault}")
        token = int(sample_pos.view(-1)[fault.row])
        _raise_route_fault(samples[row], RouteFault(fault.kind, token, fault.layer), num_experts)
    # The micro-batch takes the routes over: each sample now views its rows in it (the same
    # values, shape and dtype), so rank 0 does not hold every route twice once the batch is
    # built (bench/data_path.py, rank0_built_host_bytes_per_token).
    for s, start in zip(samples, starts, strict=True):
        if s.routed_experts.dtype == dtype:
            s.routed_experts = routes[start : start + len(s.routed_experts)]
    return torch.from_numpy(routes).view(rows, seq, num_layers, top_k)


def _gather_routes(
    samples: Sequence[Sample],
    src_row: torch.Tensor,
    sample_pos: torch.Tensor,
    routes_valid: torch.Tensor,
    offsets: torch.Tensor,
    routing_shape: tuple[int, int, int],
    moe_layers: Sequence[int] | None,
) -> torch.Tensor:
    """Routes [R, T, L, K] for any map: every sample checked, then one gather from [rollout
    rows of every sample; one cycle of filler rows]."""
    num_layers, top_k, num_experts = routing_shape
    for s in samples:
        check_sample_routes(s, num_layers, top_k, num_experts, moe_layers)
    dtype = _torch_dtype(num_experts)
    cycle = torch.from_numpy(_filler_cycle(routing_shape))
    period = cycle.shape[0]
    parts = [torch.from_numpy(np.ascontiguousarray(s.routed_experts)).to(dtype) for s in samples]
    parts.append(cycle[:, None, :].expand(period, num_layers, top_k))
    table = torch.cat(parts)
    num_rollout_rows = table.shape[0] - period
    route_offsets = offsets - torch.arange(len(samples))  # each sample has len - 1 rows
    rows, seq = src_row.shape
    take = torch.where(
        routes_valid,
        route_offsets[src_row] + sample_pos.clamp(min=0),
        num_rollout_rows + torch.arange(rows * seq).view(rows, seq) % period,
    )
    return table[take]


def _flat(lists: Sequence[Sequence], dtype: type, count: int) -> np.ndarray:
    """Concatenated Python lists as one numpy array, iterated in C (one call per micro-batch
    instead of one ``torch.tensor`` per list)."""
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=count)


def _response_fields(samples: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
    """Every sample's rollout log-probs (float32) and response versions (int64), concatenated
    in sample order, after the per-sample checks.

    Raises:
        ValueError: naming the sample, for an empty prompt, log-probs or versions of another
            length than the response, or a NaN/inf log-prob.
    """
    for s in samples:
        r = len(s.response_ids)
        if not s.prompt_ids:
            raise ValueError(f"sample {s.index} has an empty prompt")
        if len(s.rollout_log_probs) != r or len(s.response_versions) != r:
            raise ValueError(
                f"sample {s.index}: {r} response tokens but {len(s.rollout_log_probs)} "
                f"rollout_log_probs and {len(s.response_versions)} response_versions"
            )
    total = sum(len(s.response_ids) for s in samples)
    lp = _flat([s.rollout_log_probs for s in samples], np.float32, total)
    if not np.isfinite(lp).all():
        bad = int(np.flatnonzero(~np.isfinite(lp))[0])
        for s in samples:
            if bad < len(s.response_ids):
                raise ValueError(f"sample {s.index}: rollout_log_probs[{bad}] = {lp[bad]}")
            bad -= len(s.response_ids)
    return lp, _flat([s.response_versions for s in samples], np.int64, total)


def build_micro_batch(
    samples: Sequence[Sample],
    advantages: Sequence[float] | torch.Tensor,
    *,
    pad_token_id: int,
    routing_shape: tuple[int, int, int] | None = None,
    pad_to_multiple_of: int = 1,
    moe_layers: Sequence[int] | None = None,
) -> MicroBatch:
    """Pad ``samples`` into one :class:`MicroBatch`.

    Args:
        samples: B samples with at least one prompt token each.
        advantages: B per-sample advantages.
        pad_token_id: Token id written at padding positions.
        routing_shape: (num_layers, top_k, num_experts) to align routes for R3, or None;
            num_layers counts every decoder layer (dense included).
        pad_to_multiple_of: Round S up (e.g. to the TP size for sequence parallelism).
        moe_layers: global 1-based numbers of the layers with a router, whose rows are checked
            (:func:`check_sample_routes`); None: every layer.

    Raises:
        ValueError: for an empty batch, a sample without prompt tokens, mismatched lengths of
            ``rollout_log_probs``/``response_versions``, a NaN/inf rollout log-prob, or bad
            routes (naming the sample).
    """
    if not samples:
        raise ValueError("empty micro-batch")
    advantages = torch.as_tensor(advantages, dtype=torch.float32)
    if advantages.shape != (len(samples),):
        raise ValueError(f"advantages shape {tuple(advantages.shape)} != ({len(samples)},)")
    if not torch.isfinite(advantages).all():
        bad = int((~torch.isfinite(advantages)).nonzero()[0])
        raise ValueError(
            f"sample {samples[bad].index}: advantage {advantages[bad].item()} is not finite"
        )
    seq = max(s.num_tokens for s in samples)
    seq = -(-seq // pad_to_multiple_of) * pad_to_multiple_of
    b = len(samples)
    loss_mask = torch.zeros((b, seq), dtype=torch.float32)
    rollout_lp = torch.zeros((b, seq), dtype=torch.float32)
    versions = torch.full((b, seq), -1, dtype=torch.long)
    sample_row = torch.full((b, seq), -1, dtype=torch.long)
    lp, response_versions = (torch.from_numpy(x) for x in _response_fields(samples))
    offset = 0
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        sample_row[row, : p + r] = row
        loss_mask[row, p - 1 : p + r - 1] = 1.0
        rollout_lp[row, p - 1 : p + r - 1] = lp[offset : offset + r]
        versions[row, p - 1 : p + r - 1] = response_versions[offset : offset + r]
        offset += r
    position_ids = torch.arange(seq, dtype=torch.long).expand(b, seq).contiguous()
    placed = place_tokens(
        samples,
        sample_row,
        position_ids,
        pad_token_id=pad_token_id,
        routing_shape=routing_shape,
        moe_layers=moe_layers,
    )
    return MicroBatch(
        input_ids=placed.input_ids,
        position_ids=position_ids,
        labels=placed.labels,
        loss_mask=loss_mask,
        rollout_log_probs=rollout_lp,
        response_versions=versions,
        advantages=advantages,
        routes=placed.routes,
        routes_valid=(
            placed.routes_valid
            if placed.routes is not None
            else torch.zeros((b, seq), dtype=torch.bool)
        ),
        sample_indices=[s.index for s in samples],
    )
