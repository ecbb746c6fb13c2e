"""Sampling-mask replay: log-probabilities under the truncated distribution a rollout engine
actually sampled from (top-k / top-p), recomputed from the trainer's own logits with the
engine's rule.

The engines' rule and what they return (read in their source):

- SGLang 0.5.23, torch sampler (``srt/layers/sampler.py``
  ``top_k_top_p_min_p_sampling_from_probs_torch``; the one deterministic inference uses, which
  our launcher turns on): ``probs = softmax(logits / T)`` sorted descending, ``probs_sum`` their
  inclusive cumulative sum; rank ``>= top_k`` is dropped, and so is every token whose
  *exclusive* prefix sum ``probs_sum - p`` exceeds ``top_p`` (the token that crosses ``top_p``
  is kept; ties keep ``torch.sort``'s order). The token is drawn from the kept probabilities,
  renormalised. The log-probs SGLang returns are ``log(probs)`` *before* the truncation
  (``Sampler.forward``: ``logprobs = torch.log(probs)`` of the untruncated ``probs``).
- vLLM 0.32 with ``--logprobs-mode processed_logprobs`` returns log-probs *after* temperature and
  top-k/top-p (of the truncated, renormalised distribution); 0.33 can also return the kept set
  itself (``vllm/outputs.py`` ``SamplingMask``).

Without replay the trainer scores ``log softmax(logits / T)`` (SGLang's convention), so at
``top_p < 1`` or ``top_k > 0`` its ratio is against another distribution than the sampler's.
:func:`truncated_log_probs` is the sampler's: ``log p(y) - log sum_{v in kept} p(v)``, with the
kept set recomputed from the trainer's logits by SGLang's rule (:func:`kept_mask`), plus the
sampled token itself: the engine kept it, and a trainer whose logits differ by rounding must
not give it probability 0. Pure functions, full vocabulary (gather it under tensor
parallelism first).
"""

from __future__ import annotations

import torch


def kept_mask(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """SGLang's top-k / top-p kept set (module docstring) of each row of ``probs``.

    Args:
        probs: [N, V] probabilities (rows sum to 1), any float dtype.
        top_p: in (0, 1]; 1 keeps every token top-k keeps.
        top_k: -1 or 0 (off, SGLang's convention) or >= 1.

    Returns:
        bool [N, V], True where the token may be sampled.

    Raises:
        ValueError: for ``top_p`` outside (0, 1] or ``top_k < -1``.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < -1:
        raise ValueError(f"top_k must be -1, 0 (off) or >= 1, got {top_k}")
    vocab = probs.shape[-1]
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    exclusive = probs_sort.cumsum(dim=-1) - probs_sort
    ranks = torch.arange(vocab, device=probs.device)
    keep_sorted = exclusive <= top_p
    if top_k > 0:
        keep_sorted &= ranks < top_k
    return torch.zeros_like(keep_sorted).scatter_(-1, probs_idx, keep_sorted)


def truncated_log_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
) -> torch.Tensor:
    """log-probability of ``tokens`` under the engine's sampling distribution: the softmax of
    ``logits / temperature`` truncated to :func:`kept_mask` (plus each row's token) and
    renormalised. Equal to ``log_softmax(logits / T)[tokens]`` when nothing is truncated.

    Args:
        logits: [N, V] float (computed in float32); differentiable.
        tokens: [N] int64, the sampled token of each row.
        temperature: > 0.
        top_p, top_k: the rollout's sampling parameters.

    Returns:
        float32 [N], differentiable with respect to ``logits`` (the kept set is not).

    Raises:
        ValueError: for a temperature <= 0, bad ``top_p`` / ``top_k``, or shapes that differ.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(
            f"logits [N, V] and tokens [N] expected, got {logits.shape}, {tokens.shape}"
        )
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = log_probs.gather(1, tokens[:, None]).squeeze(1)
    if top_p >= 1 and top_k <= 0:
        return chosen
    with torch.no_grad():
        kept = kept_mask(log_probs.exp(), top_p, top_k)
        kept.scatter_(1, tokens[:, None], True)
    kept_mass = torch.logsumexp(log_probs.masked_fill(~kept, float("-inf")), dim=-1)
    return chosen - kept_mass
