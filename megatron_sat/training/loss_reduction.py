"""Global loss denominators, SAT's global quantile and global metrics over data-parallel ranks.

Small functions taking the process group explicitly (megatron-core's data-parallel group in the
trainer, ``parallel_state.get_data_parallel_group()``); ``group=None`` means a single process and
communicates nothing. Every function is a collective when ``group`` is given: every rank of the
group must call it, in the same order, even a rank that holds no sample this step.

Why (ALGORITHMS.md, "Loss aggregation modes" and SAT step 2): a loss normalised per micro-batch
or per rank weights tokens by how the batch happened to be split. Here every denominator is the
count over all micro-batches of all ranks, each micro-batch's loss is its *share* of the global
value, and the shares sum (over micro-batches by gradient accumulation, over ranks by the
gradient all-reduce) to exactly the single-process loss. megatron-core's DDP *averages* gradients
over the data-parallel group (it pre-scales them by 1 / dp_size before its sum all-reduce,
``gradient_scaling_factor`` in ``distributed_data_parallel.py``), so the trainer multiplies each
share by ``dp_loss_scale(group)`` = dp_size before ``backward`` to get the sum.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_sat.objectives import sat_reference_quantile


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks of ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def dp_loss_scale(group: dist.ProcessGroup | None) -> float:
    """Factor on a loss share before ``backward`` so that megatron-core DDP's gradient *average*
    over ``group`` becomes the *sum* of the shares: the group's size (exact in floating point
    for power-of-two sizes; otherwise within one rounding of the sum)."""
    return float(group_size(group))


def global_loss_denominators(
    loss_masks: Sequence[Tensor], group: dist.ProcessGroup | None
) -> tuple[float, float]:
    """Active tokens and responses with >= 1 active token over all micro-batches and ranks.

    Args:
        loss_masks: this rank's [B, T] bool or 0/1 loss masks, one per micro-batch (may be empty).
        group: data-parallel group, or None for one process.

    Returns:
        (num_tokens, num_seqs) as Python floats (exact: counted in float64, < 2**53), the
        ``global_num_tokens`` / ``global_num_seqs`` of ``policy_loss``.
    """
    # Counted as tensors and read back once (one host synchronisation, however many masks).
    local = torch.zeros(2, dtype=torch.float64)
    for mask in loss_masks:
        active = mask.to(torch.bool)
        local = local + torch.stack([active.sum(), active.any(dim=-1).sum()]).to(local)
    if group is not None:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    num_tokens, num_seqs = local.tolist()
    return num_tokens, num_seqs


def all_gather_uneven(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Concatenate every rank's 1-D ``values`` (lengths may differ, 0 included) in rank order.

    Two collectives: the lengths, then the values padded to the longest; the padding is cut
    off again, so the result is exact.

    Args:
        values: [n_rank] tensor, same dtype on every rank (float32 or float64 for gloo).
        group: data-parallel group, or None for one process (returns ``values``).

    Returns:
        [sum of n_rank] tensor.

    Raises:
        ValueError: ``values`` is not 1-D.
    """
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D, got shape {tuple(values.shape)}")
    if group is None:
        return values
    world = dist.get_world_size(group)
    length = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    longest = max(sizes)
    padded = values.new_zeros(longest)
    padded[: values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:n] for g, n in zip(gathered, sizes, strict=True)])


def global_sat_quantile(
    abs_d: Sequence[Tensor], alpha: float, group: dist.ProcessGroup | None
) -> Tensor:
    """SAT's reference quantile q (SAT paper Eq. 14) over the global batch, exactly.

    Method: all-gather (``all_gather_uneven``) every rank's |d| of every active token, then
    ``sat_reference_quantile`` on the concatenation. No approximate distributed selection: the
    k-th smallest of a multiset does not depend on the order of its elements, so q equals the
    single-process q bit for bit. Cost: one float per active token on every rank.

    Args:
        abs_d: this rank's [n_i] float tensors from ``sat_abs_staleness``, one per micro-batch
            (may be empty).
        alpha: ``ObjectiveConfig.sat_alpha``.
        group: data-parallel group, or None for one process.

    Returns:
        0-dim float32 tensor (0 when the global batch has no active token).
    """
    local = torch.cat([d.detach().float().reshape(-1) for d in abs_d]) if abs_d else None
    if local is None:
        local = torch.zeros(0, dtype=torch.float32)
    return sat_reference_quantile(all_gather_uneven(local, group), alpha)


def global_max(value: int, group: dist.ProcessGroup | None) -> int:
    """The maximum of an integer over the ranks of ``group``."""
    t = torch.tensor([value], dtype=torch.int64)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


# --- metrics ------------------------------------------------------------------------------------

_AGE = re.compile(r"^(age\d+/)(.*)$")
SUM_METRICS = frozenset({"loss", "pg_loss", "kl_loss", "num_active_tokens", "num_seqs"})
MIN_METRICS = frozenset({"sat_c_plus_min", "sat_c_minus_min"})
# Identical on every micro-batch and rank (the global q): reduced by max, which keeps it exact.
SAME_METRICS = frozenset({"sat_q"})


def _base_name(key: str) -> str:
    """``key`` without its ``age{a}/`` prefix."""
    match = _AGE.match(key)
    return match.group(2) if match else key


def metric_weight_key(key: str) -> str | None:
    """How ``key`` combines over micro-batches and ranks; the name of its weight for a mean.

    - sums (None): loss shares (``loss``, ``pg_loss``, ``kl_loss``; already divided by the
      global denominators) and counts (``num_active_tokens``, ``num_seqs`` and their ``age{a}/``
      versions);
    - sequence means (``seq_*``): weighted by ``num_seqs`` (rows with >= 1 active token);
    - everything else is a token mean, weighted by ``num_active_tokens``; an ``age{a}/`` key
      by its bucket's ``age{a}/num_active_tokens`` (or ``age{a}/num_seqs`` for ``seq_*``).
    ``MIN_METRICS`` (also with an ``age{a}/`` prefix) and ``SAME_METRICS`` are handled by
    ``MetricAccumulator`` itself.
    """
    match = _AGE.match(key)
    prefix, name = (match.group(1), match.group(2)) if match else ("", key)
    if name in SUM_METRICS:
        return None
    return prefix + ("num_seqs" if name.startswith("seq_") else "num_active_tokens")


def _as_float64(value: Tensor | float) -> Tensor:
    """``value`` as a detached 0-dim float64 tensor where it is (a number: on the host), with
    no read-back to the host."""
    if torch.is_tensor(value):
        return value.detach().to(torch.float64)
    return torch.tensor(float(value), dtype=torch.float64)


class MetricAccumulator:
    """Combines per-micro-batch metric dicts into global metrics, over micro-batches and ranks.

    ``add`` one micro-batch's metrics (0-dim tensors or numbers) at a time; ``reduce(group)``
    returns the global values (see ``metric_weight_key`` for the rule per key), the same on every
    rank. Means are accumulated as float64 sums of ``value * weight`` and of weights, so the
    result is the global token (or sequence) mean up to fp32 rounding of each input.

    The sums stay tensors on the values' device until ``reduce``, which reads them back to the
    host once (one stacked tensor, one ``.tolist()``): ``add`` never synchronises with the
    device, however many micro-batches a step has.
    """

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] = {}
        self._mins: dict[str, Tensor] = {}
        self._maxs: dict[str, Tensor] = {}

    def add(
        self,
        metrics: Mapping[str, Tensor | float],
        weights: Mapping[str, Tensor | float] | None = None,
    ) -> None:
        """Add one micro-batch (no host synchronisation).

        Args:
            metrics: name -> value of this micro-batch. A mean's weight is looked up in
                ``weights`` first, then among ``metrics`` (the counts ``policy_loss`` returns).
            weights: optional extra weights, e.g. ``{"num_active_tokens": n}`` for metrics that
                do not carry their own counts.

        Raises:
            KeyError: naming a mean metric whose weight is missing.
        """
        weights = weights or {}
        values = {k: _as_float64(v) for k, v in metrics.items()}
        for key, value in values.items():
            if _base_name(key) in MIN_METRICS:
                held = self._mins.get(key)
                self._mins[key] = value if held is None else torch.minimum(held, value)
            elif key in SAME_METRICS:
                held = self._maxs.get(key)
                self._maxs[key] = value if held is None else torch.maximum(held, value)
            elif (weight_key := metric_weight_key(key)) is None:
                self._sums[key] = self._sums.get(key, 0.0) + value
            else:
                if weight_key in weights:
                    weight = _as_float64(weights[weight_key])
                elif weight_key in values:
                    weight = values[weight_key]
                else:
                    raise KeyError(f"metric {key!r} needs the weight {weight_key!r}")
                self._sums[f"{key}\0sum"] = self._sums.get(f"{key}\0sum", 0.0) + value * weight
                self._sums[f"{key}\0weight"] = self._sums.get(f"{key}\0weight", 0.0) + weight

    def reduce(
        self, group: dist.ProcessGroup | None, device: torch.device | str | None = None
    ) -> dict[str, float]:
        """Global metrics (a collective when ``group`` is given): one float64 vector per
        reduction (sum, min, max) all-reduced on ``device`` (the trainer's device: NCCL groups
        reduce CUDA tensors; default the host), then one read-back to the host.

        The set of keys may differ between ranks (age buckets, a rank without micro-batches):
        the union is agreed with ``all_gather_object`` first. A mean whose total weight is 0
        is left out.
        """
        keys = (sorted(self._sums), sorted(self._mins), sorted(self._maxs))
        if group is not None:
            everyone: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, keys, group=group)
            keys = tuple(sorted(set().union(*(k[i] for k in everyone))) for i in range(3))
        device = torch.device("cpu" if device is None else device)
        parts = []
        for names, local, missing, op in (
            (keys[0], self._sums, 0.0, dist.ReduceOp.SUM),
            (keys[1], self._mins, math.inf, dist.ReduceOp.MIN),
            (keys[2], self._maxs, -math.inf, dist.ReduceOp.MAX),
        ):
            part = torch.full((len(names),), missing, dtype=torch.float64, device=device)
            if names:
                held = [(i, local[k]) for i, k in enumerate(names) if k in local]
                if held:
                    index = torch.tensor([i for i, _ in held], device=device)
                    part[index] = torch.stack([v.to(device) for _, v in held])
                if group is not None:
                    dist.all_reduce(part, op=op, group=group)
            parts.append(part)
        flat = torch.cat(parts).tolist()  # the one read-back of the step's metrics
        sums = dict(zip(keys[0], flat[: len(keys[0])], strict=True))
        out: dict[str, float] = dict(zip(keys[1] + keys[2], flat[len(keys[0]) :], strict=True))
        for key, value in sums.items():
            if key.endswith("\0sum"):
                name = key[: -len("\0sum")]
                weight = sums[f"{name}\0weight"]
                if weight > 0:
                    out[name] = value / weight
            elif not key.endswith("\0weight"):
                out[key] = value
        return dict(sorted(out.items()))
