"""Packed micro-batches: several samples of unequal length share one row of the model input.

What the local (CPU) spec allows, measured on megatron-core 0.19.2: its
``DotProductAttention.forward`` asserts ``packed_seq_params is None`` ("Packed sequence is not
supported by DotProductAttention. Please use TEDotProductAttention instead."), so THD with
``PackedSeqParams`` needs transformer-engine. Packing here is therefore the equivalent that the
local spec runs, in the ``[rows, seq]`` (SBHD) layout:

- samples are concatenated in a row (first fit, in the given order), padding only at the row
  end;
- ``attention_mask`` is block-diagonal causal, bool [R, 1, T, T], True = masked (megatron-core's
  convention; its torch softmax path uses a given mask instead of the default causal one), so a
  token attends only to earlier tokens of its own sample (padding attends to earlier padding);
- ``position_ids`` restart at 0 for every sample. megatron-core's ``GPTModel`` ignores
  ``position_ids`` for RoPE (it builds positions 0..T-1); :func:`use_position_ids_for_rope`
  makes RoPE follow them, taking per-position values from the model's own RoPE table, so a
  packed sample's logits are computed from exactly the rotations of the unpacked one.

When to pack (without transformer-engine; :func:`dense_packing_rows`, which the trainer applies
to every micro-batch by itself): the rows of a packed micro-batch are as wide as the padded one
(W = its longest sample, rounded up to the layout's multiple), filled first fit in decreasing
length; it is packed exactly when that needs fewer rows than it has samples. Then it costs
fewer tokens (R x W < B x W) and less attention (R x W^2 < B x W^2; the local attention
computes every row's full W x W scores), and the mask's R x W^2 bytes are under 1 / (4 x heads)
of the fp32 scores [R, heads, W, W] that attention materialises anyway. With transformer-engine
packing is THD through ``PackedSeqParams`` (not built here), so nothing is packed this way.

Tokens, labels and routes go through one index map (``sample_row``, ``sample_pos``,
:func:`megatron_sat.training.batching.place_tokens`). Losses read a per-sample padded view
(``PackedMicroBatch.samples``, a :class:`MicroBatch`) filled by
:meth:`PackedMicroBatch.to_sample_layout`, so the objectives need not know about packing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_sat.rollout.types import Sample
from megatron_sat.routing.slicing import router_targets
from megatron_sat.training.batching import MicroBatch, build_micro_batch, place_tokens


def first_fit_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Assign items to rows of ``capacity`` tokens, first fit in the given order.

    Returns:
        Per row, the indices of its items in order.

    Raises:
        ValueError: when an item is longer than ``capacity`` (naming it).
    """
    rows: list[list[int]] = []
    fill: list[int] = []
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"item {i} has {n} tokens, more than max_tokens_per_row={capacity}")
        for r, used in enumerate(fill):
            if used + n <= capacity:
                rows[r].append(i)
                fill[r] += n
                break
        else:
            rows.append([i])
            fill.append(n)
    return rows


def dense_packing_rows(
    lengths: Sequence[int], pad_to_multiple_of: int = 1, *, have_te: bool
) -> list[list[int]] | None:
    """Whether to pack one micro-batch with the dense block mask (the rule in the module
    docstring), and how.

    Args:
        lengths: tokens of each sample of the micro-batch.
        pad_to_multiple_of: the layout's sequence multiple (W is rounded up to it).
        have_te: transformer-engine is in use (``platform.have_transformer_engine()``): never
            pack densely then.

    Returns:
        None to pad; else the rows, each the positions of its samples (first fit in
        decreasing length into rows of W tokens), fewer rows than samples.
    """
    if have_te or len(lengths) < 2:
        return None
    width = -(-max(lengths) // pad_to_multiple_of) * pad_to_multiple_of
    decreasing = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows = first_fit_rows([lengths[i] for i in decreasing], width)
    if len(rows) >= len(lengths):
        return None
    return [[decreasing[j] for j in row] for row in rows]


def pack_rows(
    samples: Sequence[Sample],
    advantages: torch.Tensor,
    rows: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    routing_shape: tuple[int, int, int] | None = None,
    pad_to_multiple_of: int = 1,
    moe_layers: Sequence[int] | None = None,
) -> PackedMicroBatch:
    """One packed micro-batch of ``samples`` laid out in the given ``rows`` (positions into
    ``samples``, e.g. :func:`dense_packing_rows`); its per-sample view keeps the order of
    ``samples`` (row n of the losses' layout is ``samples[n]``), T = the fullest row rounded up
    to ``pad_to_multiple_of``. ``moe_layers``: the layers with a router, whose routes are
    checked (:func:`megatron_sat.training.batching.check_sample_routes`; None: every layer).

    Raises:
        ValueError: rows that do not hold every sample exactly once, or anything
            :func:`build_micro_batch` refuses (naming the sample).
    """
    if sorted(i for row in rows for i in row) != list(range(len(samples))):
        raise ValueError("the rows do not hold every sample exactly once")
    fullest = max(sum(samples[i].num_tokens for i in row) for row in rows)
    return _packed(
        samples,
        advantages,
        rows,
        num_rows=len(rows),
        seq=-(-fullest // pad_to_multiple_of) * pad_to_multiple_of,
        pad_token_id=pad_token_id,
        routing_shape=routing_shape,
        moe_layers=moe_layers,
    )


def _packed(
    samples: Sequence[Sample],
    advantages: torch.Tensor,
    rows: Sequence[Sequence[int]],
    *,
    num_rows: int,
    seq: int,
    pad_token_id: int,
    routing_shape: tuple[int, int, int] | None,
    moe_layers: Sequence[int] | None,
) -> PackedMicroBatch:
    """The packed micro-batch [num_rows, seq] holding ``rows`` (positions into ``samples``, each
    sample once; rows after ``len(rows)`` all padding), its per-sample view in the order of
    ``samples``. The caller checks the rows and chooses ``seq`` (>= the fullest row)."""
    sample_row = torch.full((num_rows, seq), -1, dtype=torch.long)
    sample_pos = torch.zeros((num_rows, seq), dtype=torch.long)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            n = samples[i].num_tokens
            sample_row[r, offset : offset + n] = i
            sample_pos[r, offset : offset + n] = torch.arange(n)
            offset += n
    view = build_micro_batch(samples, advantages, pad_token_id=pad_token_id)
    placed = place_tokens(
        samples,
        sample_row,
        sample_pos,
        pad_token_id=pad_token_id,
        routing_shape=routing_shape,
        moe_layers=moe_layers,
    )
    return PackedMicroBatch(
        samples=view,
        input_ids=placed.input_ids,
        position_ids=sample_pos.clone(),
        labels=placed.labels,
        # one segment per sample (padding: -1, its own), so sample_row serves as the segment id
        attention_mask=block_causal_mask(sample_row),
        routes=placed.routes,
        routes_valid=placed.routes_valid
        if placed.routes is not None
        else torch.zeros_like(sample_row, dtype=torch.bool),
        sample_row=sample_row,
        sample_pos=sample_pos,
    )


def block_causal_mask(segment: torch.Tensor) -> torch.Tensor:
    """bool [R, 1, T, T], True where query t may NOT attend to key u: different segment or
    u > t. ``segment`` is int64 [R, T], one id per sample of a row (padding its own id)."""
    seq = segment.shape[1]
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segment.device).tril()
    return (~(same & causal)).unsqueeze(1)


@dataclass
class PackedMicroBatch:
    """R rows of T tokens holding N samples, plus the per-sample view the losses read.

    Attributes:
        samples: the N samples as a padded :class:`MicroBatch` (losses, advantages, rollout
            log-probs; no routes): the sample layout [N, S].
        input_ids, position_ids, labels: int64 [R, T] (positions restart per sample).
        attention_mask: bool [R, 1, T, T], block-diagonal causal, True = masked.
        routes: [R, T, L, K] compact expert ids (filler rows at each sample's last token and at
            padding), or None.
        routes_valid: bool [R, T], True where the route is the rollout engine's.
        sample_row: int64 [R, T], index into ``samples`` at each position, -1 for padding.
        sample_pos: int64 [R, T], position inside that sample.
    """

    samples: MicroBatch
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    routes: torch.Tensor | None
    routes_valid: torch.Tensor
    sample_row: torch.Tensor
    sample_pos: torch.Tensor

    def __post_init__(self) -> None:
        real = self.sample_row >= 0
        seq = self.samples.input_ids.shape[1]
        self._src = real.reshape(-1).nonzero().squeeze(1)
        self._dst = (self.sample_row * seq + self.sample_pos).reshape(-1)[self._src]

    # The per-sample tensors the losses read, as on a padded MicroBatch (sample layout [N, S]).
    @property
    def loss_mask(self) -> torch.Tensor:
        return self.samples.loss_mask

    @property
    def rollout_log_probs(self) -> torch.Tensor:
        return self.samples.rollout_log_probs

    @property
    def response_versions(self) -> torch.Tensor:
        return self.samples.response_versions

    @property
    def advantages(self) -> torch.Tensor:
        return self.samples.advantages

    @property
    def sample_indices(self) -> list[int]:
        return self.samples.sample_indices

    def to_sample_layout(self, x: torch.Tensor) -> torch.Tensor:
        """Model layout [R, T, ...] -> sample layout [N, S, ...] (zeros where no token);
        differentiable."""
        n, seq = self.samples.input_ids.shape
        flat = x.reshape(-1, *x.shape[2:])
        out = flat.new_zeros(n * seq, *x.shape[2:])
        out = out.index_copy(0, self._dst, flat.index_select(0, self._src))
        return out.view(n, seq, *x.shape[2:])

    @property
    def active(self) -> torch.Tensor:
        """bool [R, T] in the model layout: positions whose outputs give response log-probs."""
        flat = torch.zeros(self.input_ids.numel(), dtype=torch.bool, device=self.input_ids.device)
        flat[self._src] = self.samples.loss_mask.bool().reshape(-1)[self._dst]
        return flat.view_as(self.input_ids)

    def to(self, device: torch.device | str) -> PackedMicroBatch:
        """A copy with every tensor on ``device`` (the per-sample view too)."""
        fields = {
            f.name: getattr(self, f.name).to(device)
            if torch.is_tensor(getattr(self, f.name))
            else getattr(self, f.name)
            for f in dataclasses.fields(self)
        }
        fields["samples"] = self.samples.to(device)
        return PackedMicroBatch(**fields)

    def routing_targets(self, layers: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
        """As :meth:`MicroBatch.routing_targets`, for the packed rows."""
        if self.routes is None:
            raise ValueError("this micro-batch carries no routing data (R3 needs routed experts)")
        num_layers = self.routes.shape[2]
        layers = range(1, num_layers + 1) if layers is None else layers
        return router_targets(self.routes, layers, num_layers=num_layers)


def pack_micro_batches(
    samples: Sequence[Sample],
    advantages: Sequence[float] | torch.Tensor,
    *,
    pad_token_id: int,
    max_tokens_per_row: int,
    rows_per_micro_batch: int = 1,
    routing_shape: tuple[int, int, int] | None = None,
    pad_to_multiple_of: int = 1,
    moe_layers: Sequence[int] | None = None,
) -> list[PackedMicroBatch]:
    """Pack ``samples`` into rows (first fit, in order), and rows into micro-batches.

    Every micro-batch gets the same shape [rows_per_micro_batch, T], T = the fullest row
    rounded up to ``pad_to_multiple_of`` (the TP size under sequence parallelism), as a pipeline
    schedule needs; the last micro-batch is completed with all-padding rows.

    Args:
        samples, advantages: as :func:`megatron_sat.training.batching.build_micro_batch`.
        pad_token_id: token written at padding.
        max_tokens_per_row: row capacity in tokens.
        rows_per_micro_batch: R.
        routing_shape: (num_layers, top_k, num_experts) to place routes, or None.
        pad_to_multiple_of: round T up to a multiple of this.
        moe_layers: the layers with a router, whose routes are checked
            (:func:`megatron_sat.training.batching.check_sample_routes`; None: every layer).

    Raises:
        ValueError: for no samples, a sample longer than a row, or anything
            :func:`build_micro_batch` refuses (naming the sample).
    """
    if not samples:
        raise ValueError("no samples to pack")
    advantages = torch.as_tensor(advantages, dtype=torch.float32)
    if advantages.shape != (len(samples),):
        raise ValueError(f"advantages shape {tuple(advantages.shape)} != ({len(samples)},)")
    rows = first_fit_rows([s.num_tokens for s in samples], max_tokens_per_row)
    fullest = max(sum(samples[i].num_tokens for i in row) for row in rows)
    seq = -(-fullest // pad_to_multiple_of) * pad_to_multiple_of
    out = []
    for start in range(0, len(rows), rows_per_micro_batch):
        mb_rows = rows[start : start + rows_per_micro_batch]
        order = [i for row in mb_rows for i in row]
        # The micro-batch's own samples in row order: row r holds positions j, j + 1, ...
        sizes = [len(row) for row in mb_rows]
        local = [list(range(sum(sizes[:r]), sum(sizes[: r + 1]))) for r in range(len(mb_rows))]
        out.append(
            _packed(
                [samples[i] for i in order],
                advantages[order],
                local,
                num_rows=rows_per_micro_batch,
                seq=seq,
                pad_token_id=pad_token_id,
                routing_shape=routing_shape,
                moe_layers=moe_layers,
            )
        )
    return out


def _gpt_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.models.gpt import GPTModel

    return [m for m in model.modules() if isinstance(m, GPTModel)]


def use_position_ids_for_rope(model: torch.nn.Module) -> None:
    """Make RoPE in ``model``'s decoder follow the ``position_ids`` given to its forward.

    megatron-core's ``GPTModel`` builds RoPE for positions 0..T-1 whatever ``position_ids``
    says. This installs two forward pre-hooks (once; idempotent): one on the ``GPTModel`` that
    notes the ``position_ids`` [B, T] of the call, one on its decoder that replaces the
    ``rotary_pos_emb`` [T, 1, 1, D] megatron-core passes with per-token values [T, B, 1, D]
    gathered from the same table (``RotaryEmbedding.get_emb``), so a position p gets bitwise the
    rotation it gets unpacked. Under pipeline parallelism every stage needs the
    ``position_ids`` in its forward call.

    Raises:
        ValueError: if the model has no GPTModel, uses a position embedding other than plain
            RoPE (MLA, YaRN, mRoPE: not mapped), or has MTP layers (their RoPE is not covered).
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    gpts = _gpt_models(model)
    if not gpts:
        raise ValueError("no megatron-core GPTModel inside the model")
    for gpt in gpts:
        if getattr(gpt, "_megatron_sat_position_rope", False):
            continue
        rope = getattr(gpt, "rotary_pos_emb", None)
        if (
            gpt.position_embedding_type != "rope"
            or gpt.config.multi_latent_attention
            or type(rope) is not RotaryEmbedding
        ):
            raise ValueError(
                f"position_ids-driven RoPE supports plain RoPE only, not "
                f"position_embedding_type={gpt.position_embedding_type!r} "
                f"(multi_latent_attention={gpt.config.multi_latent_attention})"
            )
        if getattr(gpt, "mtp_process", False):
            raise ValueError("packed sequences with multi-token prediction are not supported")
        state: dict[str, torch.Tensor | None] = {"position_ids": None}

        def note_positions(module, args, kwargs, state=state):
            state["position_ids"] = args[1] if len(args) > 1 else kwargs.get("position_ids")

        def per_token_rope(module, args, kwargs, state=state, rope=rope):
            positions = state["position_ids"]
            default = kwargs.get("rotary_pos_emb")
            if positions is None or default is None:
                return None
            if positions.shape[1] != default.shape[0]:
                raise ValueError(
                    f"position_ids cover {positions.shape[1]} positions but the decoder runs "
                    f"{default.shape[0]}"
                )
            # Positions restart at 0 for each packed sample, so all are below the row length:
            # a table of that many rows needs no read-back of positions.max() from the device.
            table = rope.get_emb(default.shape[0])[:, 0, 0, :]  # [S, D]
            kwargs["rotary_pos_emb"] = table[positions.t().to(table.device)].unsqueeze(2)
            return args, kwargs

        gpt.register_forward_pre_hook(note_positions, with_kwargs=True)
        gpt.decoder.register_forward_pre_hook(per_token_rope, with_kwargs=True)
        gpt._megatron_sat_position_rope = True
