"""Train-rollout mismatch and clipping diagnostics (SAT paper Eq. 52, Fig. 2).

All functions are pure, detach their outputs, and ignore inactive positions even when those hold
NaN/inf. Means are over the active tokens of the batch they are given (token-weighted); a trainer
combining micro-batches should weight them by `num_active_tokens`.
"""

from __future__ import annotations

import torch
from torch import Tensor

# |log r| beyond this is clamped before exp: exp(20) = 4.9e8 is finite in fp32 and bf16, and no
# healthy token gets near it (verl uses the same bound).
MAX_ABS_LOG_RATIO = 20.0


def masked_mean(values: Tensor, loss_mask: Tensor) -> Tensor:
    """Mean of `values` over positions where `loss_mask` is true; 0 when none is.

    Args:
        values: Any shape broadcastable to `loss_mask`, float.
        loss_mask: bool or 0/1, true on active positions.

    Returns:
        0-dim tensor of `values.dtype`. Garbage at inactive positions never reaches it.
    """
    mask = loss_mask.to(torch.bool)
    values = values.expand(mask.shape)
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp_min(1).to(values.dtype)


def k3_estimator(log_r: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(q || p) from samples x ~ q: `r - 1 - log r`, `r = p(x)/q(x)`.

    Non-negative, unbiased, lower variance than k1 = -log r (J. Schulman, "Approximating KL
    divergence", 2020). The caller clamps `log_r` to keep `exp` finite.

    Args:
        log_r: Any shape, float: `log p(x) - log q(x)` (natural log).

    Returns:
        Same shape and dtype as `log_r`.
    """
    return torch.exp(log_r) - 1.0 - log_r


def mismatch_metrics(
    log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor
) -> dict[str, Tensor]:
    """Train-rollout mismatch of the sampled tokens (SAT paper Eq. 52 and Fig. 2).

    With `d = log pi_j - log mu` per active token (always token level, also for GSPO):

    - `mismatch_abs_logratio`: mean |d|.
    - `k1`: mean of `-d`, the k1 estimate of KL(mu || pi_j) (tokens were sampled from mu).
    - `k3`: mean of `exp(d) - 1 - d`, the k3 estimate of KL(mu || pi_j); `d` clamped to
      [-20, 20] so it stays finite.

    Args:
        log_probs: [B, T] float, trainer log-probs (natural log). Detached here.
        rollout_log_probs: [B, T] float, rollout-engine log-probs.
        loss_mask: [B, T] bool or 0/1.

    Returns:
        Dict of detached 0-dim tensors (nats).
    """
    with torch.no_grad():
        mask = loss_mask.to(torch.bool)
        d = torch.where(mask, log_probs - rollout_log_probs, torch.zeros_like(log_probs))
        d_clamped = d.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
        return {
            "mismatch_abs_logratio": masked_mean(d.abs(), mask),
            "k1": masked_mean(-d, mask),
            "k3": masked_mean(k3_estimator(d_clamped), mask),
        }


def clip_fractions(
    ratio: Tensor,
    advantages: Tensor,
    eps_low: Tensor | float,
    eps_high: Tensor | float,
    loss_mask: Tensor,
    dual_clip_c: float | None = None,
) -> dict[str, Tensor]:
    """Fractions of active tokens whose surrogate gradient a clip zeroes, by side.

    - `clipfrac_low`:  `A < 0` and `r < 1 - eps_low`   (lower clip binds, SAT paper Eq. 11/19)
    - `clipfrac_high`: `A > 0` and `r > 1 + eps_high`  (upper clip binds)
    - `clipfrac_dual`: `A < 0` and `r > c`, only when `dual_clip_c` is given.

    Tokens with `A = 0` are never counted. For GSPO `r` is the response's sequence ratio
    broadcast to its tokens, so the fractions are token-weighted shares of clipped responses.

    Args:
        ratio: [B, T] float, the ratio the surrogate clipped.
        advantages: [B, T] float.
        eps_low, eps_high: radii, floats or tensors broadcastable to [B, T] (SAT's per-token
            radii of Eq. 17).
        loss_mask: [B, T] bool or 0/1.
        dual_clip_c: the dual-clip constant, if used.

    Returns:
        Dict of detached 0-dim tensors in [0, 1].
    """
    with torch.no_grad():
        mask = loss_mask.to(torch.bool)
        low = (advantages < 0) & (ratio < 1.0 - eps_low)
        high = (advantages > 0) & (ratio > 1.0 + eps_high)
        out = {
            "clipfrac_low": masked_mean(low.to(ratio.dtype), mask),
            "clipfrac_high": masked_mean(high.to(ratio.dtype), mask),
        }
        if dual_clip_c is not None:
            dual = (advantages < 0) & (ratio > dual_clip_c)
            out["clipfrac_dual"] = masked_mean(dual.to(ratio.dtype), mask)
        return out
