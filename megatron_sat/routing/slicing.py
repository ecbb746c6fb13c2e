"""What one router on one rank replays: a micro-batch's routes cut exactly as its tokens are.

A micro-batch's routes arrive in the model's input layout, ``routes`` [B, S, L, K] (row b,
position s of ``input_ids``; padding and packing already applied by
:mod:`megatron_sat.training.batching` / :mod:`megatron_sat.training.packing` through the same
index map as the tokens), with L = every decoder layer of the HF model, dense ones included
(SGLang's payload carries rows for them). From there each router needs:

- its layer: the router with megatron-core's global 1-based ``layer_number`` n reads layer n - 1.
  Dense layers have no router, so their rows are never read; multi-token-prediction layers are
  never given decoder rows (:mod:`megatron_sat.routing.replay` keeps their routers apart);
- megatron-core's token order: the router flattens hidden states [S, B, H] sequence-major, so
  row ``s * B + b``;
- under sequence parallelism, its TP rank's contiguous sequence shard: rank r of T holds
  positions ``[r * S / T, (r + 1) * S / T)`` of every row (megatron-core's
  ``scatter_to_sequence_parallel_region`` splits dim 0 of [S, B, H]);
- under pipeline parallelism, only the layers of its stage (the caller passes those layers).

Expert parallelism needs nothing here: routing happens before dispatch, on the tokens this rank
holds. Context parallelism cuts the sequence first, by megatron-core's load-balanced split
(chunks r and 2 x CP - 1 - r of 2 x CP: :mod:`megatron_sat.training.context_parallel`, which
cuts routes, tokens and loss masks by one index); the functions here then apply to a CP rank's
[B, S / CP] routes as they are (sequence parallelism shards within them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def sequence_shard(seq_len: int, tp_rank: int, tp_size: int) -> slice:
    """Positions [start, stop) of a length-``seq_len`` sequence held by TP rank ``tp_rank``
    under sequence parallelism.

    Raises:
        ValueError: if ``seq_len`` is not divisible by ``tp_size`` (pad micro-batches to a
            multiple of the TP size) or the rank is outside [0, tp_size).
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    if seq_len % tp_size:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by the TP size {tp_size}: sequence "
            f"parallelism needs it (pad the micro-batch to a multiple of {tp_size})"
        )
    shard = seq_len // tp_size
    return slice(tp_rank * shard, (tp_rank + 1) * shard)


def router_token_order(
    x: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False
) -> torch.Tensor:
    """Reorder a per-position tensor [B, S, ...] into one router's token rows [S_local * B, ...].

    Args:
        x: [B, S, ...] in the model's input layout.
        tp_rank, tp_size, sequence_parallel: this rank's TP coordinates; without sequence
            parallelism every TP rank's router sees all S positions.

    Returns:
        [S_local * B, ...] with row ``s * B + b`` = ``x[b, shard.start + s]`` (a copy).

    Raises:
        ValueError: as :func:`sequence_shard` under sequence parallelism.
    """
    seq_major = x.transpose(0, 1)  # [S, B, ...]
    if sequence_parallel and tp_size > 1:
        seq_major = seq_major[sequence_shard(x.shape[1], tp_rank, tp_size)]
    return seq_major.reshape(-1, *x.shape[2:]).contiguous()


def router_targets(
    routes: torch.Tensor,
    layer_numbers: Iterable[int],
    *,
    num_layers: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    sequence_parallel: bool = False,
) -> dict[int, torch.Tensor]:
    """The replay target of each listed router: layer number -> int64 [S_local * B, K].

    Args:
        routes: [B, S, L, K] expert ids in the model's input layout, any integer dtype (compact
            uint8/int16 is widened here, per layer, and only here).
        layer_numbers: global 1-based layer numbers of the routers on this rank (one pipeline
            stage's MoE layers).
        num_layers: the model's decoder layer count (``TransformerConfig.num_layers``, dense
            layers included, MTP layers excluded); ``routes`` must have exactly this many.
        tp_rank, tp_size, sequence_parallel: as :func:`router_token_order`.

    Raises:
        ValueError: if ``routes`` is not a 4-d integer tensor, its layer count differs from
            ``num_layers`` (both counts named), or a layer number is outside [1, num_layers].
    """
    if routes.dim() != 4 or routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(
            f"routes must be an integer tensor [B, S, layers, top_k], got {routes.dtype} "
            f"{tuple(routes.shape)}"
        )
    if routes.shape[2] != num_layers:
        raise ValueError(
            f"routes have {routes.shape[2]} layers but the model has num_layers={num_layers} "
            "decoder layers (dense layers included, MTP layers excluded)"
        )
    targets = {}
    for layer in layer_numbers:
        if not 1 <= layer <= num_layers:
            raise ValueError(f"router layer_number {layer} outside [1, {num_layers}]")
        targets[layer] = router_token_order(
            routes[:, :, layer - 1],
            tp_rank=tp_rank,
            tp_size=tp_size,
            sequence_parallel=sequence_parallel,
        ).long()
    return targets


def moe_layer_numbers(config) -> list[int]:
    """Global 1-based numbers of the decoder layers that have a router (MoE layers), from a
    megatron-core ``TransformerConfig``: its ``moe_layer_freq`` read as megatron-core's
    ``get_gpt_decoder_block_spec`` does (an int f: layer i (0-based) is MoE iff i % f == 0; a
    list: 1 = MoE, one entry per layer). MTP layers are not decoder layers.

    Raises:
        ValueError: for a model without experts, or a ``moe_layer_freq`` list whose length is
            not ``num_layers``.
    """
    if not config.num_moe_experts:
        raise ValueError("the model has no MoE layer (num_moe_experts is not set)")
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        pattern = [int(i % freq == 0) for i in range(config.num_layers)]
    else:
        pattern = list(freq)
        if len(pattern) != config.num_layers:
            raise ValueError(
                f"moe_layer_freq has {len(pattern)} entries but num_layers={config.num_layers}"
            )
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe]
