"""Sampling-mask replay under tensor parallelism: the log-probability of each label under the
rollout engine's truncated (top-k / top-p) sampling distribution, from this TP rank's
vocabulary shard of the logits, without gathering the vocabulary.

The rule is SGLang 0.5.23's torch sampler, as :func:`megatron_sat.objectives.sampling_mask.
kept_mask` states it (tokens in descending probability; rank ``< top_k`` and exclusive prefix
sum ``<= top_p``), plus the label itself (the engine sampled it; a trainer whose logits differ
by rounding must not give it probability 0). Both conditions keep a prefix of the descending
order, so the kept set is the shorter prefix, fixed by its last token (the *boundary*):

- top-k: each rank's local top-k probabilities are all-gathered (``k * TP`` values per
  position) and the k-th largest is the boundary value.
- top-p: the boundary value is the smallest probability x with ``S(x) <= top_p``, S(x) the
  mass strictly above x; S only steps at present values, so a bisection on the bit patterns of
  float32 thresholds in [0, 1] (30 steps: 1.0 is 0x3F800000 < 2^30) ends exactly on it. One
  all-reduce (SUM over the TP group) per step, vectorised over positions, a fixed step count:
  no host synchronisation.
- ties: tokens of equal probability are ordered by ascending vocabulary index, the order of
  a stable descending sort. SGLang calls ``torch.sort`` without ``stable=True``, whose tie
  order is not promised: on CUDA a vocabulary-sized row goes to a segmented radix sort, which
  is stable (this order; not checked on a GPU here), while torch's CPU kernel can reverse
  ties (ten equal leaders came out 29, 28, ..., 20 in tests/test_sampling_mask_tp.py). Exact
  ties at the boundary are rare in float32 logits; where the orders differ, the kept sets
  differ by tokens of equal probability, so the kept mass, hence the log-prob, is the same
  unless the label is one of them (only the gradient's split over the tied logits differs).
  Of the boundary value's tokens the first n in that order are kept: n from the top-k count,
  or from ``(top_p - S(x)) / x`` for top-p, the exclusive sums of ties being ``S(x) + j x``.

The exclusive sums are summed per shard and then over TP, not by a cumulative sum, so a token
whose exclusive sum is within float32 rounding of ``top_p`` may fall on the other side than in
SGLang's ``cumsum`` (tests/test_sampling_mask_tp.py compares the kept sets with
``kept_mask`` on random logits).

The result is ``l_y - log sum_{v in kept} exp(l_v)`` with ``l = logits / T`` (the full
softmax's normaliser cancels), differentiable through ``l_y`` and the kept logits exactly as
the full-vocabulary formula (``objectives.sampling_mask.truncated_log_probs``); the kept set is
a constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_sat.config import RolloutConfig

# 1.0 as float32 bits is 0x3F800000 < 2**30: 30 halvings of [0, 0x3F800000] end on one value.
_BISECTION_STEPS = 30
_ONE_BITS = 0x3F800000


@dataclass(frozen=True)
class SamplingMask:
    """The rollout's sampling parameters the trainer replays (SGLang's semantics).

    Attributes:
        temperature: > 0; the logits are divided by it.
        top_p: in (0, 1].
        top_k: -1 (off) or >= 1.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"SamplingMask.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingMask.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingMask.top_k must be -1 (off) or >= 1, got {self.top_k}")

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p cuts the distribution (else only the temperature applies)."""
        return self.top_p < 1 or self.top_k != -1


def replayed_sampling_mask(rollout: RolloutConfig) -> SamplingMask | None:
    """What the trainer applies to its logits to score tokens as the engine does, or None for
    the plain full softmax.

    - ``rollout.replay_sampling_mask``: the temperature and the top-k / top-p truncation.
    - else, at a temperature other than 1: the temperature alone. SGLang's (and the embedded
      engine's) log-probs are those of ``softmax(logits / T)`` (SGLang 0.5.23
      ``srt/layers/sampler.py``: ``logprobs = torch.log(probs)`` after the temperature), so
      a trainer scoring ``softmax(logits)`` would measure a mismatch of its own making.
    """
    if rollout.replay_sampling_mask:
        return SamplingMask(rollout.temperature, rollout.top_p, rollout.top_k)
    if rollout.temperature != 1.0:
        return SamplingMask(rollout.temperature)
    return None


class _AllReduceSum(torch.autograd.Function):
    """SUM over ``group`` forward, identity backward: the gradient of a loss every rank of
    the group computes alike (megatron-core's ``reduce_from_tensor_model_parallel_region``,
    with the group as an argument)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group is None else _AllReduceSum.apply(x, group)


def _tie_rank(is_tie: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """int64 [N, V / TP]: per token of bool ``is_tie`` [N, V / TP], its index among the ties
    of its position over the whole vocabulary, in ascending vocabulary order (meaningful where
    ``is_tie``): the ties on lower TP ranks (all-gathered counts) come first."""
    local = is_tie.long().cumsum(dim=-1) - 1
    if group is None:
        return local
    count = local[:, -1].contiguous() + 1
    counts = [torch.empty_like(count) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, count, group=group)
    before = torch.stack(counts)[: dist.get_rank(group)].sum(dim=0)
    return local + before[:, None]


def _top_k_boundary(
    probs: torch.Tensor, top_k: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(value of the k-th largest probability [N], how many of its ties are kept [N])."""
    local = probs.topk(min(top_k, probs.shape[-1]), dim=-1).values
    if group is not None:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        local = torch.cat(parts, dim=-1)
    k = min(top_k, local.shape[-1])  # a vocabulary smaller than k keeps everything
    value = local.topk(k, dim=-1).values[:, -1]
    above = _sum((probs > value[:, None]).sum(dim=-1), group)
    return value, k - above


def _top_p_boundary(
    probs: torch.Tensor, top_p: float, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(smallest probability x with mass-above(x) <= top_p [N], how many of its ties are
    kept [N]) by the bisection of the module docstring."""
    n = probs.shape[0]
    lo = torch.zeros(n, dtype=torch.int32, device=probs.device)  # mass above 0.0 is > top_p
    hi = torch.full_like(lo, _ONE_BITS)  # mass above 1.0 is 0
    for _ in range(_BISECTION_STEPS):
        mid = lo + (hi - lo) // 2
        t = mid.view(torch.float32)
        above = _sum(torch.where(probs > t[:, None], probs, 0.0).sum(dim=-1), group)
        ok = above <= top_p
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid)
    value = hi.view(torch.float32)
    above = _sum(torch.where(probs > value[:, None], probs, 0.0).sum(dim=-1), group)
    # ties j = 0, 1, ... at x have exclusive sums above + j x; those <= top_p are kept
    ties = torch.floor((top_p - above) / value).long() + 1
    return value, ties


def truncated_log_probs_tp(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: SamplingMask,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """log-probability of ``labels`` under the engine's truncated sampling distribution, from
    this rank's vocabulary shard (module docstring for the rule, ties and rounding).

    Args:
        logits: [..., V / TP] any float dtype (computed in float32, divided by
            ``mask.temperature``); rank r of ``group`` holds vocabulary ids
            ``[r V/TP, (r+1) V/TP)`` (megatron-core's vocab-parallel output layer).
        labels: [...] int64 ids over the whole vocabulary.
        mask: the rollout's temperature, top_p and top_k.
        group: the tensor-parallel group; None for an unsharded vocabulary.

    Returns:
        float32 [...], differentiable with respect to ``logits`` (the kept set is not).
        Equal to ``log_softmax(logits / T)[labels]`` when nothing is truncated.

    Raises:
        ValueError: when ``labels`` does not have the shape of ``logits`` without its last
            dimension.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be logits {tuple(logits.shape)}[:-1]")
    shape, shard = labels.shape, logits.shape[-1]
    scaled = logits.float().reshape(-1, shard) / mask.temperature
    labels = labels.reshape(-1)
    start = 0 if group is None else dist.get_rank(group) * shard
    local_label = labels - start
    owned = (local_label >= 0) & (local_label < shard)
    with torch.no_grad():
        m = scaled.max(dim=-1, keepdim=True).values
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        # in place: at the paper's scale each [tokens, V / TP] float32 buffer is ~GiB
        probs = (scaled - m).exp_()
        probs.div_(_sum(probs.sum(dim=-1, keepdim=True), group))
        kept = _kept(probs, mask, group)
        del probs
        index = local_label.clamp(0, shard - 1)[:, None]
        kept.scatter_(1, index, kept.gather(1, index) | owned[:, None])  # the label is kept
    shifted = scaled - m
    kept_mass = _sum(torch.where(kept, shifted.exp(), 0.0).sum(dim=-1), group)
    chosen = shifted.gather(1, index).squeeze(1)
    chosen = _sum(torch.where(owned, chosen, 0.0), group)
    return (chosen - kept_mass.log()).reshape(shape)


def _kept(probs: torch.Tensor, mask: SamplingMask, group: dist.ProcessGroup | None) -> torch.Tensor:
    """bool [N, V / TP]: SGLang's kept set (without the label) of each row of this shard."""
    n = probs.shape[0]
    value = torch.zeros(n, device=probs.device)  # boundary: keep everything
    vocab = probs.shape[-1] * (1 if group is None else dist.get_world_size(group))
    ties = torch.full((n,), vocab, dtype=torch.long, device=probs.device)
    if mask.top_p < 1:
        value, ties = _top_p_boundary(probs, mask.top_p, group)
    if mask.top_k > 0:
        k_value, k_ties = _top_k_boundary(probs, mask.top_k, group)
        # the shorter prefix: the larger boundary value, or at an equal value fewer ties
        k_first = (k_value > value) | ((k_value == value) & (k_ties < ties))
        value, ties = torch.where(k_first, k_value, value), torch.where(k_first, k_ties, ties)
    is_tie = probs == value[:, None]
    tie_rank = _tie_rank(is_tie, group)
    return (probs > value[:, None]) | (is_tie & (tie_rank < ties[:, None]))
