"""Which samples share a micro-batch: a fixed count, or a token budget (dynamic batching).

A micro-batch pads its samples to its longest one (``training.batching``), so its cost on a
rank is ``rows x S_pad / CP`` tokens, S_pad the longest sample rounded up to the layout's
multiple (the TP size under sequence parallelism, 2 x CP x TP under context parallelism) and CP
the context-parallel size (each CP rank holds 1 / CP of every row).

- Fixed count (``train.micro_batch_size``, the default): consecutive slices of that many
  samples. With long-tailed response lengths most of such a micro-batch is padding.
- Token budget (``train.max_tokens_per_micro_batch``, slime's ``--max-tokens-per-gpu`` with
  ``--use-dynamic-batch-size``, Megatron's ``max_tokens_per_gpu``): samples sorted by length,
  longest first, and cut into runs whose padded cost ``rows x S_pad / CP`` stays within the
  budget. Neighbours in that order have nearly equal lengths, so little is padding; the first
  sample of each run is its longest, so a run is closed exactly when one more row would not
  fit (greedy, in one pass: O(N log N)).

The grouping changes no loss: every loss is normalised by denominators counted over the whole
global batch (``loss_reduction.global_loss_denominators``) and SAT's quantile is taken over
every active token of it, so a micro-batch's loss is its share of the global loss whichever
samples it holds (tests/test_split_invariance.py). Ranks that must run their forwards in step
(an expert group's all-to-alls) agree on the largest count and pad with empty filler
micro-batches (``PolicyTrainer._with_fillers``); data-parallel ranks alone need not, since the
gradient all-reduce runs once after all backward passes.
"""

from __future__ import annotations

from collections.abc import Sequence


def padded_length(num_tokens: int, multiple: int) -> int:
    """``num_tokens`` rounded up to a multiple of ``multiple`` (>= 1)."""
    if multiple < 1:
        raise ValueError(f"pad multiple must be >= 1, got {multiple}")
    return -(-num_tokens // multiple) * multiple


def fixed_count_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Positions ``[0, n)`` cut into consecutive slices of ``micro_batch_size`` (the last one
    shorter); no micro-batch for 0 samples.

    Raises:
        ValueError: ``micro_batch_size`` < 1.
    """
    if micro_batch_size < 1:
        raise ValueError(f"train.micro_batch_size must be >= 1, got {micro_batch_size}")
    return [
        list(range(i, min(i + micro_batch_size, num_samples)))
        for i in range(0, num_samples, micro_batch_size)
    ]


def token_budget_micro_batches(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    pad_to_multiple_of: int = 1,
    context_parallel_size: int = 1,
    names: Sequence[object] | None = None,
) -> list[list[int]]:
    """Group samples by length into micro-batches whose padded cost per rank fits the budget.

    Args:
        lengths: tokens (prompt + response) of each sample.
        max_tokens: ``train.max_tokens_per_micro_batch``: the most padded tokens one rank holds
            in one micro-batch, ``rows x S_pad / context_parallel_size``.
        pad_to_multiple_of: the layout's sequence multiple (TP size under sequence parallelism;
            divisible by 2 x CP under context parallelism).
        context_parallel_size: CP; a row's S_pad tokens are spread over the CP ranks, so a
            sample longer than the budget still fits when CP splits it enough.
        names: what to call each sample in an error (default: its position), e.g. the
            ``Sample.index``.

    Returns:
        Per micro-batch, the positions of its samples (longest first, ties in input order);
        micro-batches from the longest samples to the shortest. Every position exactly once.

    Raises:
        ValueError: a non-positive budget, multiple or CP size, a multiple not divisible by
            2 x CP (megatron-core's load-balanced split needs 2 x CP equal chunks), or a sample
            whose padded length per rank exceeds the budget (naming it).
    """
    if max_tokens < 1:
        raise ValueError(f"train.max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    if context_parallel_size < 1:
        raise ValueError(f"context_parallel_size must be >= 1, got {context_parallel_size}")
    if context_parallel_size > 1 and pad_to_multiple_of % (2 * context_parallel_size):
        raise ValueError(
            f"pad_to_multiple_of={pad_to_multiple_of} is not divisible by 2 x CP = "
            f"{2 * context_parallel_size} (the load-balanced split cuts 2 x CP equal chunks)"
        )
    if names is not None and len(names) != len(lengths):
        raise ValueError(f"{len(names)} names for {len(lengths)} samples")
    cp = context_parallel_size
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep order
    groups: list[list[int]] = []
    width = 0  # S_pad / CP of the open micro-batch (its first sample is its longest)
    for i in order:
        per_rank = padded_length(lengths[i], pad_to_multiple_of) // cp
        if per_rank > max_tokens:
            name = i if names is None else names[i]
            raise ValueError(
                f"sample {name} has {lengths[i]} tokens ({per_rank} per rank after padding to "
                f"a multiple of {pad_to_multiple_of}"
                + (f" and splitting over CP {cp}" if cp > 1 else "")
                + f"), more than train.max_tokens_per_micro_batch={max_tokens}: raise the "
                "budget, parallel.context_parallel_size, or lower rollout.max_new_tokens"
            )
        if groups and (len(groups[-1]) + 1) * width <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = per_rank
    return groups


def padded_tokens(
    lengths: Sequence[int], groups: Sequence[Sequence[int]], pad_to_multiple_of: int = 1
) -> int:
    """Padding positions of ``groups`` laid out as padded micro-batches: the sum over
    micro-batches of ``rows x S_pad`` minus the real tokens (whole rows, all CP ranks)."""
    total = 0
    for group in groups:
        width = padded_length(max(lengths[i] for i in group), pad_to_multiple_of)
        total += len(group) * width - sum(lengths[i] for i in group)
    return total


def padding_waste(
    lengths: Sequence[int], groups: Sequence[Sequence[int]], pad_to_multiple_of: int = 1
) -> float:
    """Padded tokens over real tokens of ``groups`` (0.0 = no padding).

    Raises:
        ValueError: when ``groups`` do not hold every position exactly once, or there is no
            token.
    """
    flat = sorted(i for group in groups for i in group)
    if flat != list(range(len(lengths))):
        raise ValueError("the micro-batches do not hold every sample exactly once")
    real = sum(lengths)
    if real == 0:
        raise ValueError("no tokens")
    return padded_tokens(lengths, groups, pad_to_multiple_of) / real
