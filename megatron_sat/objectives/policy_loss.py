"""Clipped policy-gradient objectives: one shared clipped core and a registry of objectives.

Every objective is a small function `(LossInputs, ObjectiveConfig, sat_quantile) ->
ObjectiveTerms` that builds a ratio and per-token radii and calls `clipped_surrogate`; adding an
objective is adding one function to `OBJECTIVES`. `policy_loss` does what all objectives share:
input checks, masking of padded positions, TIS/IcePop weights, aggregation, the k3 reference KL
and metrics.

Sources (formulas as in ALGORITHMS.md):
- SAT paper: Yang et al., arXiv 2607.18722: ratio Eq. 1, PPO/GRPO clip Eq. 11, SAT Eqs. 13-20,
  Proposition 4.1, mismatch Eq. 52.
- GSPO: Zheng et al., arXiv 2507.18071: sequence ratio Eqs. 5-7, GSPO-token Eqs. 13-14.
- DPPO: Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879,
  binary (sampled-token) TV and KL approximations, run as in the SAT paper (GRPO clip x mask).
- TIS: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
  (2025 blog). IcePop: inclusionAI, Ring-1T report (2025). Dual clip: Ye et al., arXiv 1912.09729.

Deliberate choices where ALGORITHMS.md leaves room, and departures:
- Log-ratios are clamped to [-20, 20] before `exp` (as verl does): a token with |log r| > 20
  has zero gradient through the ratio instead of an overflowing one (bit-identical otherwise).
- DPPO-KL masks on the binary KL(mu || pi_j) of the sampled token (`binary_kl`), not |log r|;
  both DPPO variants share `dppo_threshold` (probability units for TV, nats for KL). DPPO keeps
  the GRPO clip and multiplies it by the mask, as the SAT paper ran it (the DPPO paper itself
  drops the ratio clip).
- "Outward" (DPPO) is tested as A * log r > 0, the exact sign of A (r - 1).
- SAT-GSPO clips the GSPO-token ratio; value and gradient equal the sequence form (tested).
  Its radii are constant within a response, so they are computed once per response ([B, 1])
  and its quantile is the token-weighted quantile of the B sequence proxies: exactly the
  quantile over the broadcast tokens of Eq. 20, at O(B) instead of O(tokens) cost.
- The ratio's denominator is `ObjectiveConfig.ratio_denominator`: the rollout engine's mu
  (SAT Eq. 1) or recomputed old trainer log-probs (`old_log_probs`, required then).
- TIS / IcePop are slime's form, as the SAT paper ran them: the clip acts on pi / pi_old
  ("recomputed_old", implied by `tis_cap` / `icepop_range`) and the detached weight
  min(pi_old / mu, C) corrects the rest, so pi / mu is counted once. The weights apply to the
  policy-gradient term only, not the KL term.
- CISPO (MiniMax-M1, arXiv 2506.13585 Eq. 4) and M2PO (Zheng et al., arXiv 2510.01161
  Algorithm 1, Eq. 5) are optional rows beyond the SAT paper's grid; `ess` (Kong 1992) is
  logged for every objective.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megatron_sat.objectives.aggregation import LOSS_AGG_MODES, aggregate_loss
from megatron_sat.objectives.metrics import (
    MAX_ABS_LOG_RATIO,
    bucket_metrics,
    clip_indicators,
    k3_estimator,
    masked_mean,
    mismatch_terms,
)
from megatron_sat.objectives.paper_defaults import departure, paper_default, resolve_unset
from megatron_sat.objectives.sat import SatRadii, sat_metrics, sat_radii

# Reference-KL clamp of ALGORITHMS.md ("clamped to [-10, 10]").
MAX_ABS_REF_LOG_RATIO = 10.0

# What the ratio divides by: the rollout engine's mu, or recomputed old trainer log-probs.
RATIO_DENOMINATORS: tuple[str, ...] = ("rollout", "recomputed_old")


@dataclass
class ObjectiveConfig:
    """Policy objective configuration; validated on construction.

    Attributes:
        name: Objective, a key of `OBJECTIVES`: "grpo" (alias "ppo"), "gspo", "gspo-token",
            "sat-grpo", "sat-gspo", "dppo-tv", "dppo-kl", "cispo", "m2po".
        eps_low: Lower clip radius, in [0, 1] (ratio >= 1 - eps_low). None (the default): the
            objective's paper value (`paper_defaults`): 1.0 (no lower bound) for CISPO, else
            0.2 as in the SAT paper (the GSPO paper's own radii are 3e-4 / 4e-4).
        eps_high: Upper clip radius, >= 0 (ratio <= 1 + eps_high). 0.2 / 4e-4 as above.
        sat_alpha: Quantile level of SAT Eq. 14, in (0, 1).
        loss_agg_mode: One of `LOSS_AGG_MODES`. None (the default): the objective's paper
            aggregation (`paper_defaults`): "seq-mean-token-mean" for GSPO, GSPO-token and
            SAT-GSPO, "token-mean" for the others. A value departing from the paper warns.
        loss_agg_norm_constant: C of "seq-mean-token-sum-norm" (> 0); None = padded width T.
        dppo_threshold: DPPO delta, >= 0: probability units for "dppo-tv", nats for "dppo-kl".
        tis_cap: TIS cap C > 0; None disables TIS.
        icepop_range: (alpha, beta), 0 <= alpha < beta: IcePop keeps tokens with
            alpha <= pi_old / mu <= beta; None disables IcePop.
        dual_clip_c: Dual-clip constant c > 1 for A < 0; None disables it.
        m2po_tau: M2PO's threshold tau_M2 > 0 on the second moment of log r (0.04 in the
            M2PO paper, Section 5.2, and AReaL's `actor.m2_threshold` example).
        kl_coef: Coefficient (>= 0) of the k3 KL to the reference policy; 1e-3 in the SAT paper.
        entropy_coef: Coefficient (>= 0) of the entropy bonus: `loss -= entropy_coef *
            agg(H)`, H the policy's per-token entropy (`entropy` of `policy_loss`); 0 = off.
        ratio_denominator: log-probs in the ratio's denominator: "rollout" = the rollout
            engine's log mu (SAT Eq. 1) or "recomputed_old" = old log-probs that the trainer
            recomputes with its own weights before the update (`old_log_probs`, slime's
            default). None (the default) resolves on construction to "recomputed_old" when
            TIS or IcePop is on and to "rollout" otherwise. TIS / IcePop (slime's form, as the
            SAT paper ran them) clip the update ratio pi / pi_old and correct the rest with
            sg[min(pi_old / mu, C)], so they need "recomputed_old"; "rollout" with them is
            refused (it would count pi / mu twice: r * min(r, C)). Without TIS, with one
            optimizer step per batch the recomputed old policy *is* the current policy, so
            r = 1 and every clip is inert on stale samples; see `recomputed_old_when_stale`.

    Raises:
        ValueError: naming the field, for an unknown name or mode or an out-of-range value.
    """

    name: str = "sat-gspo"
    eps_low: float | None = None
    eps_high: float = 0.2
    sat_alpha: float = 0.9
    loss_agg_mode: str | None = None
    loss_agg_norm_constant: float | None = None
    dppo_threshold: float = 1e-3
    tis_cap: float | None = None
    icepop_range: tuple[float, float] | None = None
    dual_clip_c: float | None = None
    m2po_tau: float = 0.04
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    ratio_denominator: str | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, requirement: str) -> None:
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"ObjectiveConfig.{name} must be {requirement}, got {value!r}")

        def finite(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        check(self.name in OBJECTIVES, "name", f"one of {sorted(OBJECTIVES)}")
        for unset in ("loss_agg_mode", "eps_low"):
            if getattr(self, unset) is None:
                resolve_unset(self, unset, paper_default(self.name, unset))
            elif (why := departure(self.name, unset, getattr(self, unset))) is not None:
                warnings.warn(why, stacklevel=3)
        check(finite(self.eps_low) and 0 <= self.eps_low <= 1, "eps_low", "in [0, 1]")
        check(finite(self.eps_high) and self.eps_high >= 0, "eps_high", "finite and >= 0")
        check(finite(self.sat_alpha) and 0 < self.sat_alpha < 1, "sat_alpha", "in (0, 1)")
        check(self.loss_agg_mode in LOSS_AGG_MODES, "loss_agg_mode", f"one of {LOSS_AGG_MODES}")
        norm = self.loss_agg_norm_constant
        check(norm is None or (finite(norm) and norm > 0), "loss_agg_norm_constant", "None or > 0")
        check(
            finite(self.dppo_threshold) and self.dppo_threshold >= 0,
            "dppo_threshold",
            "finite and >= 0",
        )
        cap = self.tis_cap
        check(cap is None or (finite(cap) and cap > 0), "tis_cap", "None or finite and > 0")
        if self.icepop_range is not None:
            ok = isinstance(self.icepop_range, (tuple, list)) and len(self.icepop_range) == 2
            lo, hi = self.icepop_range if ok else (None, None)
            ok = ok and finite(lo) and isinstance(hi, (int, float)) and 0 <= lo < hi
            check(ok, "icepop_range", "None or (alpha, beta) with 0 <= alpha < beta")
            self.icepop_range = (float(lo), float(hi))
        c = self.dual_clip_c
        check(c is None or (finite(c) and c > 1), "dual_clip_c", "None or finite and > 1")
        check(
            c is None or self.name not in ("cispo", "m2po"),
            "dual_clip_c",
            f"None for {self.name!r} (its surrogate has no PPO clip for a dual clip to bound)",
        )
        check(finite(self.m2po_tau) and self.m2po_tau > 0, "m2po_tau", "finite and > 0")
        check(finite(self.kl_coef) and self.kl_coef >= 0, "kl_coef", "finite and >= 0")
        check(
            finite(self.entropy_coef) and self.entropy_coef >= 0, "entropy_coef", "finite and >= 0"
        )
        corrected = self.tis_cap is not None or self.icepop_range is not None
        if self.ratio_denominator is None:
            resolve_unset(self, "ratio_denominator", "recomputed_old" if corrected else "rollout")
        check(
            self.ratio_denominator in RATIO_DENOMINATORS,
            "ratio_denominator",
            f"one of {RATIO_DENOMINATORS} (or None)",
        )
        check(
            not (corrected and self.ratio_denominator == "rollout"),
            "ratio_denominator",
            "'recomputed_old' (or None) with tis_cap/icepop_range: TIS and IcePop clip the "
            "update ratio pi/pi_old and weight by sg[min(pi_old/mu, C)]; dividing by mu as well "
            "would count pi/mu twice",
        )
        if norm is not None and self.loss_agg_mode != "seq-mean-token-sum-norm":
            warnings.warn(
                f"ObjectiveConfig.loss_agg_norm_constant is ignored with "
                f"loss_agg_mode={self.loss_agg_mode!r}",
                stacklevel=3,
            )


@dataclass(frozen=True)
class LossInputs:
    """Inputs with inactive positions already replaced by 0 (finite everywhere).

    Attributes:
        log_probs: [B, T] trainer log pi_j (grad flows at active positions only).
        rollout_log_probs: [B, T] the ratio's denominator: rollout-engine log mu, or the
            recomputed old log-probs when `ObjectiveConfig.ratio_denominator` says so.
        advantages: [B, T] per-token advantages (per-sequence ones broadcast).
        mask: [B, T] bool, active response tokens.
        per_sequence_advantages: the caller gave one advantage per response ([B]).
    """

    log_probs: Tensor
    rollout_log_probs: Tensor
    advantages: Tensor
    mask: Tensor
    per_sequence_advantages: bool = False

    @property
    def log_ratio(self) -> Tensor:
        """[B, T] `log pi_j - log mu` (SAT Eq. 1); 0 at inactive positions."""
        return self.log_probs - self.rollout_log_probs

    def sequence_log_ratio(self) -> Tensor:
        """[B] `log rho_b = mean over active tokens of log r` (GSPO Eq. 7); 0 for empty rows."""
        num_tokens = self.mask.sum(dim=-1).clamp_min(1).to(self.log_probs.dtype)
        return self.log_ratio.sum(dim=-1) / num_tokens


@dataclass(frozen=True)
class ObjectiveTerms:
    """What an objective returns.

    Attributes:
        surrogate: [B, T] per-token surrogate S to *maximise* (the loss is -S).
        ratio: [B, T] detached ratio that was clipped (for clip fractions).
        eps_low, eps_high: radii used, 0-dim, [B, 1] or [B, T], detached.
        metrics: objective-specific detached 0-dim metrics.
        radii: SAT objectives' trust region (for the per-age-bucket SAT diagnostics).
    """

    surrogate: Tensor
    ratio: Tensor
    eps_low: Tensor
    eps_high: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    radii: SatRadii | None = None


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    eps_low: Tensor,
    eps_high: Tensor,
    dual_clip_c: float | None = None,
) -> Tensor:
    """Shared clipped core: `S = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)` (SAT Eq. 11/19).

    Used by every objective: GRPO/PPO (token r, scalar radii), GSPO (sequence rho_b, GSPO Eq. 5),
    SAT (per-token radii of SAT Eq. 17, Eq. 18-19). With `dual_clip_c = c`, for A < 0 the
    surrogate is further bounded below, `S = max(S, c A)` (Ye et al. 2019).

    Args:
        ratio: [B, T] float, > 0.
        advantages: [B, T] float.
        eps_low, eps_high: radii, tensors broadcastable to [B, T] of the ratio's dtype (0-dim
            for the base recipes, per token for SAT). Every objective computes its bounds the
            same way, `1 -+ eps` in the ratio's dtype, so SAT with no gated token (c = 1
            exactly) is bit-identical to its base.
        dual_clip_c: optional c > 1.

    Returns:
        [B, T] surrogate to maximise.
    """
    clipped = torch.clamp(ratio, min=1.0 - eps_low, max=1.0 + eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    if dual_clip_c is not None:
        dual = torch.maximum(surrogate, dual_clip_c * advantages)
        surrogate = torch.where(advantages < 0, dual, surrogate)
    return surrogate


# --- ratios -------------------------------------------------------------------------------------


def _exp_ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO))


def token_ratio(inp: LossInputs) -> Tensor:
    """[B, T] token ratio `r = pi_j / mu` (SAT Eq. 1), 1 at inactive positions."""
    return _exp_ratio(inp.log_ratio)


def sequence_ratio(inp: LossInputs) -> Tensor:
    """[B, T] GSPO sequence ratio rho_b (GSPO Eq. 7) broadcast; gradient through the mean."""
    return _exp_ratio(inp.sequence_log_ratio()).unsqueeze(-1).expand_as(inp.log_probs)


class _BroadcastRatio(torch.autograd.Function):
    """`s_bt = rho_b` in value with `d s_bt / d log pi_bt = s_bt`: the GSPO-token ratio.

    Same value and gradient, bit for bit, as `exp(clamp(log_rho_b) + (x - sg[x]))` (`x - sg[x]`
    is exactly 0 and exp's backward multiplies by its output), without the [B, T] exp. Where
    `log_rho_b` lies outside the clamp the gradient is 0, as through `_exp_ratio`.
    """

    @staticmethod
    def forward(ctx, log_probs: Tensor, rho: Tensor, inside: Tensor) -> Tensor:
        ctx.save_for_backward(torch.where(inside, rho, torch.zeros_like(rho)))
        return rho.unsqueeze(-1).expand(log_probs.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (slope,) = ctx.saved_tensors
        return grad * slope.unsqueeze(-1), None, None


def _detached_sequence_log_ratio(inp: LossInputs) -> Tensor:
    with torch.no_grad():
        return inp.sequence_log_ratio()


def sequence_token_ratio(inp: LossInputs, log_rho: Tensor | None = None) -> Tensor:
    """[B, T] GSPO-token ratio `s_bt = sg[rho_b] * pi_j(y_t) / sg[pi_j(y_t)]` (GSPO Eq. 13-14).

    Same value as `sequence_ratio` bit for bit, and d s_bt / d log pi_bt = rho_b, so with
    per-sequence advantages the gradient equals the sequence-level one.

    Args:
        inp: the loss inputs.
        log_rho: [B] detached `log rho_b` if the caller already has it (`sequence_log_ratio`).
    """
    if log_rho is None:
        log_rho = _detached_sequence_log_ratio(inp)
    rho = torch.exp(log_rho.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO))
    return _BroadcastRatio.apply(inp.log_probs, rho, log_rho.abs() <= MAX_ABS_LOG_RATIO)


# --- objectives ---------------------------------------------------------------------------------


def _clip(
    ratio: Tensor, inp: LossInputs, config: ObjectiveConfig, eps_low: Tensor, eps_high: Tensor
) -> ObjectiveTerms:
    surrogate = clipped_surrogate(ratio, inp.advantages, eps_low, eps_high, config.dual_clip_c)
    return ObjectiveTerms(surrogate, ratio.detach(), eps_low, eps_high)


def _base_clip(ratio: Tensor, inp: LossInputs, config: ObjectiveConfig) -> ObjectiveTerms:
    eps_low, eps_high = ratio.new_tensor(config.eps_low), ratio.new_tensor(config.eps_high)
    return _clip(ratio, inp, config, eps_low, eps_high)


def grpo_objective(
    inp: LossInputs, config: ObjectiveConfig, sat_quantile: Tensor | float | None
) -> ObjectiveTerms:
    """GRPO/PPO token-level clip on `r = pi_j / mu` (SAT Eq. 11)."""
    return _base_clip(token_ratio(inp), inp, config)


def gspo_objective(
    inp: LossInputs, config: ObjectiveConfig, sat_quantile: Tensor | float | None
) -> ObjectiveTerms:
    """GSPO: the clip on the sequence ratio rho_b, broadcast to tokens (GSPO Eqs. 5-7).

    With [B, T] advantages each token uses its own A with the shared rho_b.
    """
    return _base_clip(sequence_ratio(inp), inp, config)


def gspo_token_objective(
    inp: LossInputs, config: ObjectiveConfig, sat_quantile: Tensor | float | None
) -> ObjectiveTerms:
    """GSPO-token: the clip on `s_bt = sg[rho_b] pi/sg[pi]` (GSPO Eqs. 13-14)."""
    return _base_clip(sequence_token_ratio(inp), inp, config)


def token_staleness(inp: LossInputs) -> Tensor:
    """[B, T] SAT proxy `d = sg[log r]` per token (SAT Eq. 13), 0 at inactive positions."""
    return inp.log_ratio.detach()


def sequence_staleness(inp: LossInputs) -> Tensor:
    """[B, T] SAT-GSPO proxy `d = sg[log rho_b]` broadcast to active tokens (SAT Eq. 20)."""
    d = inp.sequence_log_ratio().detach().unsqueeze(-1).expand_as(inp.log_probs)
    return torch.where(inp.mask, d, torch.zeros_like(d))


def _sat_clip(
    ratio: Tensor, d: Tensor, inp: LossInputs, config: ObjectiveConfig, q: Tensor | float | None
) -> ObjectiveTerms:
    radii = sat_radii(d, inp.mask, config.eps_low, config.eps_high, config.sat_alpha, q)
    terms = _clip(ratio, inp, config, radii.eps_low, radii.eps_high)
    return dataclasses.replace(terms, metrics=sat_metrics(radii, inp.mask), radii=radii)


def sat_grpo_objective(
    inp: LossInputs, config: ObjectiveConfig, sat_quantile: Tensor | float | None
) -> ObjectiveTerms:
    """SAT-GRPO: token ratio, radii from the token proxy (SAT Eqs. 13-19)."""
    return _sat_clip(token_ratio(inp), token_staleness(inp), inp, config, sat_quantile)


def sat_gspo_objective(
    inp: LossInputs, config: ObjectiveConfig, sat_quantile: Tensor | float | None
) -> ObjectiveTerms:
    """SAT-GSPO: the clip on the sequence ratio rho_b, radii from its log (SAT Eqs. 13-20).

    With one advantage per response ([B] advantages) the ratio is GSPO's sequence form (GSPO
    Eqs. 5-7, gradient through the mean), so the loss is GSPO's plus O(B) work for the radii.
    With per-token advantages it is the GSPO-token ratio (Eqs. 13-14), which gives each token
    its own advantage; both forms have the same value, and the same gradient for per-sequence
    advantages. The radii are per response ([B, 1]); the quantile weights each response by its
    active tokens, which equals Eq. 14 over the broadcast proxy of Eq. 20 exactly
    (`sat_reference_quantile`).
    """
    num_tokens = inp.mask.sum(dim=-1, keepdim=True)  # [B, 1], counted once for both uses
    denominator = num_tokens.squeeze(-1).clamp_min(1).to(inp.log_probs.dtype)
    if inp.per_sequence_advantages:  # = inp.sequence_log_ratio(), bit for bit
        log_rho = inp.log_ratio.sum(dim=-1) / denominator
        ratio = _exp_ratio(log_rho).unsqueeze(-1).expand_as(inp.log_probs)
        log_rho = log_rho.detach()
    else:
        with torch.no_grad():
            log_rho = inp.log_ratio.sum(dim=-1) / denominator
        ratio = sequence_token_ratio(inp, log_rho)
    rows = num_tokens > 0
    radii = sat_radii(
        log_rho.unsqueeze(-1),
        rows,
        config.eps_low,
        config.eps_high,
        config.sat_alpha,
        sat_quantile,
        weights=num_tokens,
    )
    terms = _clip(ratio, inp, config, radii.eps_low, radii.eps_high)
    metrics = sat_metrics(radii, rows, weights=num_tokens)
    return dataclasses.replace(terms, metrics=metrics, radii=radii)


def binary_tv(inp: LossInputs) -> Tensor:
    """[B, T] detached sampled-token TV `|pi_j(y_t) - mu(y_t)|` in probability units (DPPO)."""
    return (inp.log_probs.detach().exp() - inp.rollout_log_probs.exp()).abs()


def binary_kl(inp: LossInputs) -> Tensor:
    """[B, T] detached binary KL(mu || pi_j) of the sampled token (DPPO Binary-KL), nats.

    `KL = mu log(mu/pi) + (1 - mu) log((1 - mu)/(1 - pi))` with mu = mu(y_t), pi = pi_j(y_t):
    the KL between the two-outcome distributions {y_t, not y_t}, which lower-bounds the full
    vocabulary KL (data processing). Direction KL(mu || pi) because tokens were sampled from mu,
    as in the DPPO authors' code. Computed in float64, probabilities clamped to
    [1e-12, 1 - 1e-12] so that p = 1 (log p = 0) gives a finite value.
    """
    tiny = 1e-12
    p = inp.rollout_log_probs.detach().double().exp().clamp(tiny, 1 - tiny)
    q = inp.log_probs.detach().double().exp().clamp(tiny, 1 - tiny)
    kl = p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))
    return kl.to(inp.log_probs.dtype)


def _dppo(
    divergence: Callable[[LossInputs], Tensor], inp: LossInputs, config: ObjectiveConfig
) -> ObjectiveTerms:
    """GRPO clip times a {0,1} mask dropping outward moves beyond `dppo_threshold` (DPPO).

    A token is dropped iff `sign(A (r - 1)) > 0` (equivalently A * log r > 0, exact in floating
    point where `exp` may round r to 1) and its divergence exceeds the threshold.
    """
    terms = _base_clip(token_ratio(inp), inp, config)
    outward = (inp.advantages * inp.log_ratio.detach()) > 0
    drop = outward & (divergence(inp) > config.dppo_threshold) & inp.mask
    surrogate = torch.where(drop, torch.zeros_like(terms.surrogate), terms.surrogate)
    metrics = {"dppo_drop_rate": masked_mean(drop.to(surrogate.dtype), inp.mask)}
    return ObjectiveTerms(surrogate, terms.ratio, terms.eps_low, terms.eps_high, metrics)


def dppo_tv_objective(
    inp: LossInputs, config: ObjectiveConfig, sat_quantile: Tensor | float | None
) -> ObjectiveTerms:
    """DPPO Binary-TV as run in the SAT paper (Table 1): mask on |pi - mu| > delta."""
    return _dppo(binary_tv, inp, config)


def dppo_kl_objective(
    inp: LossInputs, config: ObjectiveConfig, sat_quantile: Tensor | float | None
) -> ObjectiveTerms:
    """DPPO Binary-KL: mask on binary KL(mu || pi) > delta (nats)."""
    return _dppo(binary_kl, inp, config)


def cispo_objective(
    inp: LossInputs, config: ObjectiveConfig, sat_quantile: Tensor | float | None
) -> ObjectiveTerms:
    """CISPO: `S = sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * log pi_j` (MiniMax-M1 Eq. 4).

    The clip bounds the detached importance weight instead of the update, so a clipped token
    still passes gradient `sg[clip(r)] * A` (peers: slime `compute_cispo_loss`, verl `cispo`).
    The canonical setting has no lower bound: `eps_low = 1` (bound 0). The clip fractions count
    the PPO-style binding side (A < 0 below, A > 0 above), as for the other objectives.
    """
    ratio = token_ratio(inp).detach()
    eps_low, eps_high = ratio.new_tensor(config.eps_low), ratio.new_tensor(config.eps_high)
    weight = torch.clamp(ratio, min=1.0 - eps_low, max=1.0 + eps_high)
    return ObjectiveTerms(weight * inp.advantages * inp.log_probs, ratio, eps_low, eps_high)


def m2po_mask(log_ratio: Tensor, advantages: Tensor, mask: Tensor, tau: float) -> Tensor:
    """[B, T] bool keep mask of M2PO Algorithm 1 (Zheng, Zhao, Chen, arXiv 2510.01161).

    Among the "trust-region" tokens (active, with `A * log r > 0`: the side a PPO clip could
    bind, Section 5.2), the tokens with the largest `M2_i = (log r_i)^2` are dropped one by one
    until the mean M2 of the remaining trust-region tokens is <= tau. Other tokens are always
    kept. Ties are dropped in row-major order (a stable sort). The batch is the tensor given:
    the trainer passes one micro-batch (exact for one micro-batch per step).

    Args:
        log_ratio: [B, T] `log pi_j - log mu` (detached here).
        advantages: [B, T].
        mask: [B, T] bool, active tokens.
        tau: threshold tau_M2 > 0.

    Returns:
        [B, T] bool, True = keep.
    """
    with torch.no_grad():
        trust = mask & (advantages * log_ratio > 0)
        m2 = log_ratio.square()[trust]
        n = m2.numel()
        keep = torch.ones_like(mask)
        if n == 0:
            return keep
        values, order = torch.sort(m2, descending=True, stable=True)
        # remaining mean after dropping the k largest, k = 0..n-1 (k = n leaves none: mean 0)
        suffix = values.flip(0).cumsum(0).flip(0)
        remaining = torch.arange(n, 0, -1, device=m2.device, dtype=m2.dtype)
        done = torch.ones(1, dtype=torch.bool, device=m2.device)  # m2's device (CUDA)
        ok = torch.cat([suffix / remaining <= tau, done])
        k = int(torch.nonzero(ok)[0])
        dropped = torch.zeros(n, dtype=torch.bool, device=m2.device)
        dropped[order[:k]] = True
        keep[trust] = ~dropped
        return keep


def m2po_objective(
    inp: LossInputs, config: ObjectiveConfig, sat_quantile: Tensor | float | None
) -> ObjectiveTerms:
    """M2PO: the unclipped `S = M * r * A` with M the second-moment mask (M2PO Eq. 5).

    Masked tokens stay in the aggregation denominator (the paper's footnote 2: it averages over
    all tokens). Metrics: `m2po_m2` (M2 over all active tokens, before masking) and
    `m2po_mask_rate` (share of active tokens dropped).
    """
    ratio = token_ratio(inp)
    log_ratio = inp.log_ratio.detach()
    keep = m2po_mask(log_ratio, inp.advantages, inp.mask, config.m2po_tau)
    surrogate = torch.where(keep, ratio * inp.advantages, torch.zeros_like(ratio))
    # radii that never bind (bounds 0 and inf): clip fractions are 0 for an unclipped objective
    eps_low, eps_high = ratio.new_tensor(1.0), ratio.new_tensor(math.inf)
    metrics = {
        "m2po_m2": masked_mean(log_ratio.square(), inp.mask),
        "m2po_mask_rate": masked_mean((~keep).to(ratio.dtype), inp.mask),
    }
    return ObjectiveTerms(surrogate, ratio.detach(), eps_low, eps_high, metrics)


ObjectiveFn = Callable[[LossInputs, ObjectiveConfig, Tensor | float | None], ObjectiveTerms]

OBJECTIVES: Mapping[str, ObjectiveFn] = types.MappingProxyType(
    {
        "grpo": grpo_objective,
        "ppo": grpo_objective,
        "gspo": gspo_objective,
        "gspo-token": gspo_token_objective,
        "sat-grpo": sat_grpo_objective,
        "sat-gspo": sat_gspo_objective,
        "dppo-tv": dppo_tv_objective,
        "dppo-kl": dppo_kl_objective,
        "cispo": cispo_objective,
        "m2po": m2po_objective,
    }
)

# Objectives whose ratio may divide by the recomputed old policy on stale samples, as the SAT
# paper ran its GRPO/GSPO baselines (Table 9: slime's recomputed log-probs): with one optimizer
# step per batch r = 1, so their clip is inert (allowed with a warning). SAT, DPPO and M2PO
# measure staleness against mu and are refused; TIS / IcePop correct pi_old to mu.
RECOMPUTED_OLD_INERT_CLIP: frozenset[str] = frozenset(
    {"grpo", "ppo", "gspo", "gspo-token", "cispo"}
)


def recomputed_old_when_stale(config: ObjectiveConfig) -> str:
    """What a "recomputed_old" denominator means on samples older than the trainer's weights.

    Returns:
        "ok" (not "recomputed_old", or TIS / IcePop: pi_old is their inner reference and the
        weight min(pi_old / mu, C) corrects it to mu), "inert" (a plain clip on pi / pi_old = 1:
        no trust region against the behaviour policy, as the SAT paper ran GRPO / GSPO; allowed,
        callers warn) or "refused" (SAT, DPPO, M2PO: their staleness measure would be 0).
    """
    if config.ratio_denominator != "recomputed_old":
        return "ok"
    if config.tis_cap is not None or config.icepop_range is not None:
        return "ok"
    return "inert" if config.name in RECOMPUTED_OLD_INERT_CLIP else "refused"


INERT_CLIP_WARNING = (
    "objective.ratio_denominator='recomputed_old' on stale samples without TIS: the recomputed "
    "old policy is the current one (one optimizer step per batch), so the ratio is 1 and the "
    "clip is inert -- no trust region against the rollout policy (how the SAT paper ran its "
    "GRPO/GSPO baselines, Table 9)"
)

# SAT objectives and their staleness proxy (for `sat_abs_staleness` and ignored-q warnings).
SAT_STALENESS: Mapping[str, Callable[[LossInputs], Tensor]] = types.MappingProxyType(
    {"sat-grpo": token_staleness, "sat-gspo": sequence_staleness}
)


# --- the loss -----------------------------------------------------------------------------------


def _check_shapes(
    log_probs: Tensor,
    advantages: Tensor,
    optional: dict[str, Tensor | None],
) -> None:
    if log_probs.dim() != 2 or not log_probs.is_floating_point():
        raise ValueError(
            f"log_probs must be a float [B, T] tensor, got {log_probs.dtype} "
            f"{tuple(log_probs.shape)}"
        )
    shape = log_probs.shape
    for name, tensor in optional.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(
                f"{name} must have the shape of log_probs {tuple(shape)}, got {tuple(tensor.shape)}"
            )
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] with [B, T] = {tuple(shape)}, "
            f"got {tuple(advantages.shape)}"
        )


def _compute_dtype(log_probs: Tensor) -> torch.dtype:
    # fp64 stays fp64 (tests); everything else is computed in fp32 (bf16 log-probs are upcast).
    return torch.float64 if log_probs.dtype == torch.float64 else torch.float32


def _masked(x: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    # torch.where, not multiplication: NaN/inf at padded positions must reach neither the value
    # (0 * NaN = NaN) nor the gradient (where's backward routes zeros to the unselected branch).
    x = x.to(dtype)
    return torch.where(mask, x, torch.zeros_like(x))


def prepare_inputs(
    log_probs: Tensor, rollout_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor
) -> LossInputs:
    """Validate shapes, broadcast advantages to [B, T] and zero every inactive position.

    Raises:
        ValueError: naming the argument whose shape or dtype is wrong.
    """
    _check_shapes(
        log_probs, advantages, {"rollout_log_probs": rollout_log_probs, "loss_mask": loss_mask}
    )
    dtype = _compute_dtype(log_probs)
    mask = loss_mask.to(torch.bool)
    per_sequence = advantages.dim() == 1
    if per_sequence:
        advantages = advantages.unsqueeze(-1).expand(log_probs.shape)
    return LossInputs(
        log_probs=_masked(log_probs, mask, dtype),
        rollout_log_probs=_masked(rollout_log_probs.detach(), mask, dtype),
        advantages=_masked(advantages.detach(), mask, dtype),
        mask=mask,
        per_sequence_advantages=per_sequence,
    )


def sat_abs_staleness(
    log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor, config: ObjectiveConfig
) -> Tensor:
    """|d| of the active tokens of one micro-batch, for a global SAT quantile (SAT Eq. 14).

    Under data parallelism / gradient accumulation: call this on every micro-batch on every rank,
    all-gather and concatenate the results, then `q = sat_reference_quantile(all_abs_d,
    config.sat_alpha)`, and pass `sat_quantile=q` to every `policy_loss` call of the step. `d` is
    token level for "sat-grpo" and the sequence log-ratio broadcast for "sat-gspo" (Eq. 20).

    Args:
        log_probs, rollout_log_probs, loss_mask: [B, T] as for `policy_loss`.
        config: a SAT objective's config.

    Returns:
        [num_active_tokens] detached float tensor, in mask order (row-major).

    Raises:
        ValueError: `config.name` is not a SAT objective, or a shape mismatch.
    """
    if config.name not in SAT_STALENESS:
        raise ValueError(
            f"ObjectiveConfig.name must be one of {sorted(SAT_STALENESS)} for "
            f"sat_abs_staleness, got {config.name!r}"
        )
    zeros = torch.zeros(log_probs.shape[:1], dtype=log_probs.dtype, device=log_probs.device)
    inp = prepare_inputs(log_probs.detach(), rollout_log_probs, zeros, loss_mask)
    return SAT_STALENESS[config.name](inp).abs()[inp.mask]


def _correction_weights(
    inp: LossInputs, rollout: Tensor, old_log_probs: Tensor | None, config: ObjectiveConfig
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Detached per-token TIS weight times IcePop keep mask, or None when neither is on.

    `x = log pi_old - log mu` (`rollout` = masked log mu; the ratio divides by pi_old), so the
    gradient weight of an unclipped token is (pi / pi_old) * min(pi_old / mu, C): with one
    optimizer step per batch (pi = pi_old) it is min(pi / mu, C), pi / mu counted once (slime's
    `--use-tis`; ALGORITHMS.md).
    TIS: `w = min(exp(x), C)`, computed as exp(min(x, log C)) so it cannot overflow.
    IcePop: keep iff `log alpha <= x <= log beta`, compared in log space.
    """
    if config.tis_cap is None and config.icepop_range is None:
        return None, {}
    # ObjectiveConfig makes TIS/IcePop imply "recomputed_old", whose old_log_probs policy_loss
    # requires: the ratio (clipped) is pi / pi_old and this weight corrects pi_old to mu.
    assert old_log_probs is not None
    x = _masked(old_log_probs.detach(), inp.mask, inp.log_probs.dtype) - rollout
    weight = torch.ones_like(x)
    metrics: dict[str, Tensor] = {}
    if config.tis_cap is not None:
        tis = torch.exp(x.clamp(max=math.log(config.tis_cap)))
        weight = weight * tis
        metrics["tis_weight_mean"] = masked_mean(tis, inp.mask)
    if config.icepop_range is not None:
        lo, hi = config.icepop_range
        log_lo = math.log(lo) if lo > 0 else -math.inf
        keep = (x >= log_lo) & (x <= math.log(hi))
        weight = torch.where(keep, weight, torch.zeros_like(weight))
        metrics["icepop_keep_rate"] = masked_mean(keep.to(x.dtype), inp.mask)
    return weight, metrics


def reference_kl(inp: LossInputs, ref_log_probs: Tensor) -> Tensor:
    """[B, T] k3 ("low_var_kl") KL to the reference: `exp(-x) - 1 + x`, x clamped to [-10, 10].

    `x = log pi_j - log pi_ref` (ALGORITHMS.md; Schulman's k3 of KL(pi_j || pi_ref)). The clamp
    keeps value and gradient finite in fp32 for any x (the gradient is 0 outside the clamp).
    """
    ref = _masked(ref_log_probs.detach(), inp.mask, inp.log_probs.dtype)
    x = (inp.log_probs - ref).clamp(-MAX_ABS_REF_LOG_RATIO, MAX_ABS_REF_LOG_RATIO)
    return k3_estimator(-x)


def policy_loss(
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    config: ObjectiveConfig,
    ref_log_probs: Tensor | None = None,
    old_log_probs: Tensor | None = None,
    global_num_tokens: float | Tensor | None = None,
    global_num_seqs: float | Tensor | None = None,
    sat_quantile: float | Tensor | None = None,
    sample_age: Tensor | None = None,
    entropy: Tensor | None = None,
    age_buckets: Sequence[int] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss of `config.name`, aggregated, plus the optional k3 reference KL.

    `loss = agg(-S * w) + kl_coef * agg(k3)`, with S the objective's clipped surrogate (shared
    core `clipped_surrogate`), w the detached TIS weight times IcePop mask (1 when off; dropped
    tokens stay in the aggregation denominator), agg = `aggregate_loss` with
    `config.loss_agg_mode`. The ratio's denominator is the rollout engine's mu (SAT Eq. 1) or,
    with `config.ratio_denominator == "recomputed_old"`, `old_log_probs`; the mismatch metrics
    always compare with mu.

    Args:
        log_probs: [B, T] float32 (bf16 is upcast, fp64 kept), trainer log pi_j of the response
            tokens, natural log; requires grad.
        rollout_log_probs: [B, T] rollout-engine log mu. Detached.
        advantages: [B] per response or [B, T] per token. Detached.
        loss_mask: [B, T] bool or 0/1, true on active response tokens. Values of every other
            tensor at inactive positions are ignored, even NaN/inf, and get zero gradient.
        config: ObjectiveConfig.
        ref_log_probs: [B, T] reference log-probs; required when `config.kl_coef > 0`.
        old_log_probs: [B, T] recomputed old-policy log-probs: numerator of TIS/IcePop, and the
            ratio's denominator under "recomputed_old" (required then).
        global_num_tokens, global_num_seqs: global aggregation denominators, see
            `aggregate_loss`; None = this batch alone.
        sat_quantile: SAT q over the global batch (see `sat_abs_staleness`); None = from this
            batch. Ignored, with a warning, by non-SAT objectives.
        sample_age: optional [B] integer version age of each row (`rollout.types.staleness`;
            negative = leave the row out): adds per-age-bucket metrics (`bucket_metrics`;
            `age_buckets`: its `buckets`, known on the host, or None).
        entropy: [B, T] the policy's entropy per token, nats, differentiable (e.g.
            `training.logprobs.vocab_parallel_entropy`); required when `entropy_coef > 0`, and
            reported as the `entropy` metric whenever given.

    Returns:
        (loss, metrics): 0-dim loss to minimise, in the compute dtype; metrics are detached 0-dim
        tensors over this batch: `pg_loss`, `clipfrac_low`, `clipfrac_high` (`clipfrac_dual`),
        `mismatch_abs_logratio`, `k1`, `k3` (token means), `seq_abs_log_ratio` (mean over rows
        with an active token of |log rho_b| vs mu, the sequence-level mismatch),
        `num_active_tokens`, `num_seqs` (rows with >= 1 active token), `ess`,
        `is_weight_mean`, `is_weight_sq_mean` (`importance_weight_metrics`); SAT objectives add
        `sat_q`, `sat_gate_rate`, `sat_eps_low_mean`, `sat_eps_high_mean`, `sat_c_plus_min`,
        `sat_c_minus_min`; DPPO adds `dppo_drop_rate`; M2PO `m2po_m2`, `m2po_mask_rate`; TIS
        `tis_weight_mean`; IcePop `icepop_keep_rate`; `kl_loss` when `kl_coef > 0`; `entropy`
        (token mean) when `entropy` is given; with `sample_age`, per age a: `age{a}/` +
        `clipfrac_low`, `clipfrac_high`, `mismatch_abs_logratio`, `k1`, `k3`,
        `num_active_tokens`, `num_seqs`, and for SAT `sat_gate_rate`, `sat_eps_low_mean`,
        `sat_eps_high_mean`, `sat_c_plus_min`, `sat_c_minus_min`.

    Raises:
        ValueError: a shape mismatch (naming the argument), `kl_coef > 0` without
            `ref_log_probs`, `entropy_coef > 0` without `entropy`, "recomputed_old" without
            `old_log_probs`, a non-positive global denominator, a negative `sat_quantile`.
    """
    others = dict(rollout_log_probs=rollout_log_probs, loss_mask=loss_mask, entropy=entropy)
    others |= dict(ref_log_probs=ref_log_probs, old_log_probs=old_log_probs)
    _check_shapes(log_probs, advantages, others)
    _check_optional_inputs(config, ref_log_probs, old_log_probs, sat_quantile, entropy)
    recomputed = config.ratio_denominator == "recomputed_old"
    inp = prepare_inputs(
        log_probs, old_log_probs if recomputed else rollout_log_probs, advantages, loss_mask
    )
    rollout = _masked(rollout_log_probs.detach(), inp.mask, inp.log_probs.dtype)
    terms = OBJECTIVES[config.name](inp, config, sat_quantile)
    per_token = -terms.surrogate
    weight, weight_metrics = _correction_weights(inp, rollout, old_log_probs, config)
    if weight is not None:
        per_token = per_token * weight

    agg = functools.partial(
        aggregate_loss,
        loss_mask=inp.mask,
        mode=config.loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_constant=config.loss_agg_norm_constant,
    )
    pg_loss = agg(per_token)
    metrics = _loss_metrics(
        inp, rollout, terms, config, pg_loss, weight_metrics, sample_age, age_buckets
    )
    loss = _regularised(pg_loss, inp, config, agg, ref_log_probs, entropy, metrics)
    return loss, {k: v.detach() for k, v in metrics.items()}


def _loss_metrics(
    inp: LossInputs,
    rollout: Tensor,
    terms: ObjectiveTerms,
    config: ObjectiveConfig,
    pg_loss: Tensor,
    weight_metrics: dict[str, Tensor],
    sample_age: Tensor | None,
    age_buckets: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """`policy_loss`'s metrics before the regularisers (see its Returns): importance weights,
    clip fractions and mismatch vs mu (token means), the sequence mismatch, the objective's
    and the correction weights' own metrics, and the per-age buckets with `sample_age`."""
    clip = clip_indicators(
        terms.ratio, inp.advantages, terms.eps_low, terms.eps_high, config.dual_clip_c
    )
    mismatch = mismatch_terms(inp.log_probs, rollout, inp.mask)
    metrics = {
        **importance_weight_metrics(inp.log_probs, rollout, inp.mask),
        "pg_loss": pg_loss.detach(),
        "num_active_tokens": inp.mask.sum().to(pg_loss.dtype),
        **{name: masked_mean(value, inp.mask) for name, value in clip.items()},
        **{name: masked_mean(value, inp.mask) for name, value in mismatch.items()},
        **_sequence_metrics(mismatch["k1"], inp.mask),
        **terms.metrics,
        **weight_metrics,
    }
    if sample_age is not None:
        metrics.update(_age_metrics(inp, clip, mismatch, terms, sample_age, age_buckets))
    return metrics


def _regularised(
    pg_loss: Tensor,
    inp: LossInputs,
    config: ObjectiveConfig,
    agg: Callable[[Tensor], Tensor],
    ref_log_probs: Tensor | None,
    entropy: Tensor | None,
    metrics: dict[str, Tensor],
) -> Tensor:
    """`pg_loss` plus `kl_coef` times the aggregated k3 reference KL, minus `entropy_coef`
    times the aggregated entropy, in that order; adds `kl_loss` and `entropy` to `metrics`."""
    loss = pg_loss
    if config.kl_coef > 0:
        kl_loss = agg(reference_kl(inp, ref_log_probs))
        loss = loss + config.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    elif ref_log_probs is not None:
        warnings.warn("ref_log_probs is ignored because ObjectiveConfig.kl_coef == 0", stacklevel=3)
    if entropy is not None:
        per_token_entropy = _masked(entropy, inp.mask, inp.log_probs.dtype)
        metrics["entropy"] = masked_mean(per_token_entropy.detach(), inp.mask)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * agg(per_token_entropy)
    return loss


def _check_optional_inputs(
    config: ObjectiveConfig,
    ref_log_probs: Tensor | None,
    old_log_probs: Tensor | None,
    sat_quantile: float | Tensor | None,
    entropy: Tensor | None,
) -> None:
    """The optional inputs `policy_loss` needs for `config` (errors as it documents); warns
    when a SAT quantile is passed to an objective without SAT."""
    if config.kl_coef > 0 and ref_log_probs is None:
        raise ValueError("ref_log_probs is required when ObjectiveConfig.kl_coef > 0")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy is required when ObjectiveConfig.entropy_coef > 0")
    if config.ratio_denominator == "recomputed_old" and old_log_probs is None:
        raise ValueError(
            "old_log_probs is required when ObjectiveConfig.ratio_denominator == 'recomputed_old'"
        )
    if sat_quantile is not None and config.name not in SAT_STALENESS:
        warnings.warn(f"sat_quantile is ignored by objective {config.name!r}", stacklevel=3)


def _age_metrics(
    inp: LossInputs,
    clip: dict[str, Tensor],
    mismatch: dict[str, Tensor],
    terms: ObjectiveTerms,
    sample_age: Tensor,
    age_buckets: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """`policy_loss`'s per-version-age metrics (`bucket_metrics` with prefix `age`): clip
    fractions and mismatch terms, and SAT's diagnostics when the objective has radii (q is the
    batch's, one value)."""
    per_age = {k: clip[k] for k in ("clipfrac_low", "clipfrac_high")} | mismatch
    minima = None
    if terms.radii is not None:
        radii = terms.radii
        per_age |= {
            "sat_gate_rate": radii.gate.to(inp.log_probs.dtype),
            "sat_eps_low_mean": radii.eps_low,
            "sat_eps_high_mean": radii.eps_high,
        }
        minima = {"sat_c_plus_min": radii.c_plus, "sat_c_minus_min": radii.c_minus}
    return bucket_metrics(
        per_age, inp.mask, sample_age, prefix="age", minima=minima, buckets=age_buckets
    )


def importance_weight_metrics(
    log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """Effective sample size of the importance weights `w = pi_j / mu` over active tokens.

    `ess = (sum w)^2 / (N sum w^2) = mean(w)^2 / mean(w^2)` (Kong 1992; VCPO, arXiv 2602.17616,
    reads its fall as an early warning of collapse): 1 when every w is equal (on-policy),
    toward 1/N when one token dominates. `log w` is clamped to [-20, 20] as for the ratios.
    The token means `is_weight_mean` and `is_weight_sq_mean` are returned too, so that a
    trainer combining micro-batches recomputes the exact global ess from their global means
    (the token-weighted mean of per-micro-batch ess values is not the global ess).

    Args:
        log_probs, rollout_log_probs: [B, T] log pi_j and log mu (masked, finite).
        mask: [B, T] bool, active tokens.

    Returns:
        Detached 0-dim `ess` (1 for a batch without active tokens), `is_weight_mean`,
        `is_weight_sq_mean`.
    """
    with torch.no_grad():
        w = _exp_ratio(log_probs - rollout_log_probs)
        m1, m2 = masked_mean(w, mask), masked_mean(w.square(), mask)
        return {"ess": ess_from_moments(m1, m2), "is_weight_mean": m1, "is_weight_sq_mean": m2}


def ess_from_moments(mean_w: Tensor | float, mean_w_sq: Tensor | float) -> Tensor | float:
    """`mean(w)^2 / mean(w^2)`; 1 when `mean_w_sq` is 0 (no active token)."""
    if isinstance(mean_w_sq, Tensor):
        safe = torch.where(mean_w_sq > 0, mean_w_sq, torch.ones_like(mean_w_sq))
        return torch.where(mean_w_sq > 0, mean_w**2 / safe, torch.ones_like(mean_w_sq))
    return mean_w**2 / mean_w_sq if mean_w_sq > 0 else 1.0


def _sequence_metrics(neg_log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """`num_seqs` and `seq_abs_log_ratio` = mean over rows with an active token of |log rho_b|,
    from the detached per-token `-log r` (0 at inactive positions)."""
    num_tokens = mask.sum(dim=-1)
    rows = num_tokens > 0
    log_rho = -neg_log_ratio.sum(dim=-1) / num_tokens.clamp_min(1).to(neg_log_ratio.dtype)
    return {
        "num_seqs": rows.sum().to(neg_log_ratio.dtype),
        "seq_abs_log_ratio": masked_mean(log_rho.abs(), rows),
    }
