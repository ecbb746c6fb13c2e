"""Train-rollout mismatch and clipping diagnostics (SAT paper Eq. 52, Fig. 2).

All functions are pure, detach their outputs, and ignore inactive positions even when those hold
NaN/inf. Means are over the active tokens of the batch they are given (token-weighted); a trainer
combining micro-batches should weight them by `num_active_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def mismatch_terms(
    log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor
) -> dict[str, Tensor]:
    """Per-token terms whose masked means are `mismatch_metrics` (0 at inactive positions).

    Returns:
        Detached [B, T] tensors `mismatch_abs_logratio` (|d|), `k1` (-d) and `k3`
        (`exp(d) - 1 - d`, d clamped to [-20, 20]), with `d = log pi_j - log mu`.
    """
    with torch.no_grad():
        mask = loss_mask.to(torch.bool)
        d = torch.where(mask, log_probs - rollout_log_probs, torch.zeros_like(log_probs))
        d_clamped = d.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
        return {"mismatch_abs_logratio": d.abs(), "k1": -d, "k3": k3_estimator(d_clamped)}


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
    terms = mismatch_terms(log_probs, rollout_log_probs, loss_mask)
    return {name: masked_mean(value, loss_mask) for name, value in terms.items()}


def clip_indicators(
    ratio: Tensor,
    advantages: Tensor,
    eps_low: Tensor | float,
    eps_high: Tensor | float,
    dual_clip_c: float | None = None,
) -> dict[str, Tensor]:
    """Per-token {0, 1} indicators whose masked means are `clip_fractions` (same arguments).

    Returns:
        Detached [B, T] tensors of the ratio's dtype: `clipfrac_low`, `clipfrac_high` and, with
        `dual_clip_c`, `clipfrac_dual`. Inactive positions are not zeroed: mask them.
    """
    with torch.no_grad():
        low = (advantages < 0) & (ratio < 1.0 - eps_low)
        high = (advantages > 0) & (ratio > 1.0 + eps_high)
        out = {"clipfrac_low": low.to(ratio.dtype), "clipfrac_high": high.to(ratio.dtype)}
        if dual_clip_c is not None:
            dual = (advantages < 0) & (ratio > dual_clip_c)
            out["clipfrac_dual"] = dual.to(ratio.dtype)
        return out


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
    terms = clip_indicators(ratio, advantages, eps_low, eps_high, dual_clip_c)
    return {name: masked_mean(value, loss_mask) for name, value in terms.items()}


def bucket_metrics(
    per_token: dict[str, Tensor],
    loss_mask: Tensor,
    row_bucket: Tensor,
    prefix: str = "age",
    minima: dict[str, Tensor] | None = None,
    buckets: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """Token means of per-token diagnostics within each bucket of rows (e.g. version age).

    For every bucket id `a >= 0` held by at least one row with an active token:
    `f"{prefix}{a}/{name}"` = mean of `per_token[name]` over the active tokens of the rows in
    bucket `a`, plus `f"{prefix}{a}/num_active_tokens"` and `f"{prefix}{a}/num_seqs"` (rows of
    the bucket with >= 1 active token). A trainer combining batches weights each mean by its
    bucket's `num_active_tokens`. For `minima`, `f"{prefix}{a}/{name}"` is the minimum over the
    bucket's active tokens instead of the mean.

    Args:
        per_token: name -> float values broadcastable to [B, T] (e.g. `clip_indicators`,
            `mismatch_terms`, SAT radii [B, 1]).
        loss_mask: [B, T] bool or 0/1.
        row_bucket: [B] integer bucket id of each row; negative ids are left out.
        prefix: key prefix, "age" for the version-age buckets of the SAT paper's diagnostics.
        minima: optional name -> float values broadcastable to [B, T] reduced by min.
        buckets: the bucket ids held by a row with an active token, when the caller knows them
            on the host (a trainer knows its samples' ages); None finds them on `row_bucket`'s
            device, which reads them back to the host (one synchronisation per call). Buckets
            listed here are reported as given: the caller must list exactly those ids.

    Returns:
        Dict of detached 0-dim tensors.

    Raises:
        ValueError: `row_bucket` is not an integer [B] tensor.
    """
    mask = loss_mask.to(torch.bool)
    if row_bucket.shape != mask.shape[:1] or row_bucket.is_floating_point():
        raise ValueError(
            f"row_bucket must be an integer [B] tensor with B = {mask.shape[0]}, got "
            f"{row_bucket.dtype} {tuple(row_bucket.shape)}"
        )
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        rows = (row_bucket >= 0) & mask.any(dim=-1)
        if buckets is None:
            buckets = torch.unique(row_bucket[rows]).tolist()
        for bucket in sorted(buckets):
            in_bucket = rows & (row_bucket == bucket)
            bucket_mask = mask & in_bucket.unsqueeze(-1)
            dtype = next(iter(per_token.values())).dtype if per_token else torch.float32
            out[f"{prefix}{bucket}/num_active_tokens"] = bucket_mask.sum().to(dtype)
            out[f"{prefix}{bucket}/num_seqs"] = in_bucket.sum().to(dtype)
            for name, values in per_token.items():
                out[f"{prefix}{bucket}/{name}"] = masked_mean(values, bucket_mask)
            for name, values in (minima or {}).items():
                values = values.expand(mask.shape)
                inf = torch.full((), torch.inf, dtype=values.dtype, device=values.device)
                out[f"{prefix}{bucket}/{name}"] = torch.where(bucket_mask, values, inf).amin()
    return out
