"""SAT: staleness-adaptive trust region (SAT paper, Section 4.2, Eqs. 13-20).

Source: Yang et al., "Stale but Stable: Staleness-Adaptive Trust Regions for Stabilizing
Asynchronous Reinforcement Learning", arXiv 2607.18722 (2026); formulas as in ALGORITHMS.md.

Pipeline: a detached staleness proxy `d` per active token (Eq. 13; for SAT-GSPO the sequence
log-ratio broadcast to the response's tokens, Eq. 20) -> batch reference quantile `q` of |d|
(Eq. 14) -> Hill kernel (Eq. 15) applied only to tokens with |d| > q (Eq. 16) -> shrunken radii
(Eq. 17) that the shared clipped core uses (Eqs. 18-19, `policy_loss.clipped_surrogate`).

Data parallelism: the quantile must be over the global batch. This module is pure: the trainer
gathers |d| of every active token of every micro-batch on every data-parallel rank
(`all_gather`, exact; no approximate distributed selection), calls `sat_reference_quantile` once
and passes the result to `policy_loss(..., sat_quantile=q)`. Without it, `q` is this batch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_sat.objectives.metrics import masked_mean

# alpha * n within this relative distance of an integer is that integer: alpha = 0.9 is stored as
# 0.90000000000000002, and 0.07 * 100 evaluates to 7.000000000000001; neither may move the
# quantile up one rank.
_RANK_REL_TOL = 1e-12


def _quantile_rank(alpha: float, n: int) -> int:
    """1-based rank k = ceil(alpha * n) of the lower alpha-quantile of n values, in [1, n]."""
    k = math.ceil(alpha * n * (1.0 - _RANK_REL_TOL))
    return min(max(k, 1), n)


def sat_reference_quantile(abs_d: Tensor, alpha: float, weights: Tensor | None = None) -> Tensor:
    """Batch reference quantile of the staleness proxy (SAT paper Eq. 14).

    `q = inf{x >= 0 : F(x) >= alpha}` with F the empirical CDF of `abs_d`: the lower
    (inverse-CDF, no interpolation) convention, i.e. the k-th smallest value with
    `k = ceil(alpha * n)`. Example: |d| = [0.1, 0.2, ..., 1.0], alpha = 0.9 -> k = 9 -> q = 0.9.
    Consequence used by Proposition 4.1: at most `n - k <= (1 - alpha) n` values exceed q.

    With `weights`, value i counts `weights[i]` times (n = sum of the weights): the result is
    exactly the quantile of the expanded list. SAT-GSPO uses this with one value per response
    weighted by its number of active tokens, so its quantile costs O(B log B), not O(tokens).

    Args:
        abs_d: [n] float, |d| of the active tokens (detached here). Under data parallelism: the
            all-gathered values of the global batch.
        alpha: quantile level in (0, 1); 0.90 in the SAT paper.
        weights: optional [n] integer tensor of non-negative multiplicities.

    Returns:
        0-dim tensor, dtype and device of `abs_d`; 0 when `abs_d` is empty or all weights are 0.

    Raises:
        ValueError: `abs_d` not 1-D, `alpha` outside (0, 1), or `weights` not an integer tensor
            of the shape of `abs_d`.
    """
    if abs_d.dim() != 1:
        raise ValueError(f"abs_d must be 1-D, got shape {tuple(abs_d.shape)}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha (sat_alpha) must be in (0, 1), got {alpha!r}")
    abs_d = abs_d.detach()
    if weights is not None:
        if weights.shape != abs_d.shape or weights.is_floating_point():
            raise ValueError(
                f"weights must be an integer tensor of shape {tuple(abs_d.shape)}, got "
                f"{weights.dtype} {tuple(weights.shape)}"
            )
        return _weighted_lower_quantile(abs_d, alpha, weights)
    n = abs_d.numel()
    if n == 0:
        return abs_d.new_zeros(())
    return torch.kthvalue(abs_d, _quantile_rank(alpha, n)).values


def _weighted_lower_quantile(values: Tensor, alpha: float, weights: Tensor) -> Tensor:
    # Sort once; the k-th smallest of the expanded list is the first sorted value whose
    # cumulative weight reaches k (int64 cumsum: exact).
    total = int(weights.sum())
    if total == 0:
        return values.new_zeros(())
    sorted_values, order = torch.sort(values)
    cumulative = torch.cumsum(weights[order].to(torch.int64), 0)
    k = torch.tensor([_quantile_rank(alpha, total)], dtype=torch.int64, device=values.device)
    return sorted_values[torch.searchsorted(cumulative, k)[0]]


def hill_kernel(u: Tensor, q: Tensor | float) -> Tensor:
    """Hill kernel `psi(u; q) = 1 / (1 + (u / q)^2)` (SAT paper Eq. 15).

    Args:
        u: Any shape, float, u >= 0 (u_plus = max(d, 0) or u_minus = max(-d, 0)).
        q: Scale, > 0 (q = inf gives 1 everywhere). Not checked: the gate of Eq. 16 only calls
            the kernel with q > 0.

    Returns:
        Same shape as `u`, values in (0, 1]; psi(0) = 1 and psi(q) = 1/2.
    """
    return 1.0 / (1.0 + (u / q) ** 2)


@dataclass(frozen=True)
class SatRadii:
    """Per-token SAT trust region (SAT paper Eqs. 16-17). All tensors detached, [B, T].

    Attributes:
        eps_low: eps_low' = eps_low * c_minus.
        eps_high: eps_high' = eps_high * c_plus.
        c_plus: Upper contraction, 1 where not gated.
        c_minus: Lower contraction, 1 where not gated.
        gate: bool, active tokens with q > 0 and |d| > q.
        q: 0-dim reference quantile used.
    """

    eps_low: Tensor
    eps_high: Tensor
    c_plus: Tensor
    c_minus: Tensor
    gate: Tensor
    q: Tensor


def sat_radii(
    d: Tensor,
    loss_mask: Tensor,
    eps_low: float,
    eps_high: float,
    alpha: float,
    q: Tensor | float | None = None,
    weights: Tensor | None = None,
) -> SatRadii:
    """SAT radii from the staleness proxy (SAT paper Eqs. 14-17).

    Gate (Eq. 16): a token is gated iff it is active, q > 0 and |d| > q (strict). Gated tokens
    get `c_plus = psi(max(d, 0); q)`, `c_minus = psi(max(-d, 0); q)`, so for d > 0 only the upper
    radius shrinks and for d < 0 only the lower one; every other token keeps c = 1 exactly, so
    its radii are bit-identical to the base recipe's.

    Args:
        d: [B, T] float, staleness proxy `sg[log r]` per token, or [B, 1] one value per response
            (SAT-GSPO, Eq. 20: `sg[log rho_b]`, with `weights` = its active token counts).
            Detached here; inactive positions are ignored.
        loss_mask: bool or 0/1, shape of `d`.
        eps_low, eps_high: base PPO radii.
        alpha: quantile level of Eq. 14, in (0, 1).
        q: precomputed quantile (global batch, see module docstring), >= 0; None computes it
            from the active entries of `d` (each counted `weights` times when given).
        weights: optional integer multiplicities, shape of `d` (see `sat_reference_quantile`).

    Returns:
        SatRadii, every tensor of the shape of `d`.

    Raises:
        ValueError: a Python-number `q` that is negative or NaN; `alpha` outside (0, 1).
    """
    mask = loss_mask.to(torch.bool)
    d = torch.where(mask, d.detach(), torch.zeros_like(d))
    abs_d = d.abs()
    if q is None and weights is None:
        q_t = sat_reference_quantile(abs_d[mask], alpha)
    elif q is None:  # inactive entries get weight 0: no boolean indexing (a device sync)
        w = torch.where(mask, weights, torch.zeros_like(weights)).reshape(-1)
        q_t = sat_reference_quantile(abs_d.reshape(-1), alpha, weights=w)
    else:
        if isinstance(q, (int, float)) and not q >= 0:
            raise ValueError(f"sat_quantile must be >= 0, got {q!r}")
        q_t = torch.as_tensor(q, dtype=d.dtype, device=d.device)
    gate = mask & (q_t > 0) & (abs_d > q_t)
    # The kernel is evaluated everywhere and selected by the gate; keep q = 0 from dividing.
    q_safe = torch.where(q_t > 0, q_t, torch.ones_like(q_t))
    one = torch.ones_like(d)
    c_plus = torch.where(gate, hill_kernel(d.clamp_min(0.0), q_safe), one)
    c_minus = torch.where(gate, hill_kernel((-d).clamp_min(0.0), q_safe), one)
    return SatRadii(
        eps_low=d.new_tensor(eps_low) * c_minus,
        eps_high=d.new_tensor(eps_high) * c_plus,
        c_plus=c_plus,
        c_minus=c_minus,
        gate=gate,
        q=q_t,
    )


def _min_of_active(c: Tensor, mask: Tensor) -> Tensor:
    # c <= 1, so filling inactive positions with 1 (and appending a 1 for an empty batch) leaves
    # the minimum over active tokens, or 1 when there is none.
    filled = torch.where(mask, c, torch.ones_like(c)).reshape(-1)
    return torch.cat([filled, filled.new_ones(1)]).amin()


def sat_metrics(
    radii: SatRadii, loss_mask: Tensor, weights: Tensor | None = None
) -> dict[str, Tensor]:
    """SAT diagnostics of SAT paper Table 10, over the active tokens of this batch.

    Args:
        radii: from `sat_radii`.
        loss_mask: bool or 0/1, shape of the radii.
        weights: integer multiplicities of each entry (SAT-GSPO's per-response radii weighted by
            active token counts, so the means stay token-weighted); None = 1 each.

    Returns:
        Detached 0-dim tensors: `sat_q`, `sat_gate_rate` (fraction of active tokens gated),
        `sat_eps_low_mean`, `sat_eps_high_mean` (mean radii), `sat_c_plus_min`, `sat_c_minus_min`
        (1 when there is no active token).
    """
    mask = loss_mask.to(torch.bool)
    dtype = radii.c_plus.dtype
    if weights is None:
        mean = masked_mean
    else:
        w = torch.where(mask, weights.to(dtype), torch.zeros((), dtype=dtype))
        total = w.sum().clamp_min(1)

        def mean(values: Tensor, _: Tensor) -> Tensor:
            return (values * w).sum() / total

    return {
        "sat_q": radii.q.detach(),
        "sat_gate_rate": mean(radii.gate.to(dtype), mask),
        "sat_eps_low_mean": mean(radii.eps_low, mask),
        "sat_eps_high_mean": mean(radii.eps_high, mask),
        "sat_c_plus_min": _min_of_active(radii.c_plus, mask),
        "sat_c_minus_min": _min_of_active(radii.c_minus, mask),
    }
