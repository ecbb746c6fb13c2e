"""Pure-maths RL objectives: advantages, clipped policy losses (GRPO, GSPO, SAT, DPPO, TIS,
CISPO, M2PO), SAT trust regions, loss aggregation, mismatch metrics and the importance
weights' effective sample size. No I/O, no process groups: distributed
denominators and the global SAT quantile are computed by the caller and passed in."""

from megatron_sat.objectives.advantages import compute_grpo_advantages, informative_groups
from megatron_sat.objectives.aggregation import LOSS_AGG_MODES, aggregate_loss
from megatron_sat.objectives.metrics import (
    bucket_metrics,
    clip_fractions,
    clip_indicators,
    k3_estimator,
    masked_mean,
    mismatch_metrics,
    mismatch_terms,
)
from megatron_sat.objectives.policy_loss import (
    INERT_CLIP_WARNING,
    OBJECTIVES,
    RATIO_DENOMINATORS,
    RECOMPUTED_OLD_INERT_CLIP,
    SAT_STALENESS,
    LossInputs,
    ObjectiveConfig,
    ObjectiveTerms,
    clipped_surrogate,
    ess_from_moments,
    importance_weight_metrics,
    m2po_mask,
    policy_loss,
    prepare_inputs,
    recomputed_old_when_stale,
    sat_abs_staleness,
)
from megatron_sat.objectives.sat import (
    SatRadii,
    hill_kernel,
    sat_metrics,
    sat_radii,
    sat_reference_quantile,
)

__all__ = [
    "INERT_CLIP_WARNING",
    "LOSS_AGG_MODES",
    "OBJECTIVES",
    "RATIO_DENOMINATORS",
    "RECOMPUTED_OLD_INERT_CLIP",
    "SAT_STALENESS",
    "LossInputs",
    "ObjectiveConfig",
    "ObjectiveTerms",
    "SatRadii",
    "aggregate_loss",
    "bucket_metrics",
    "clip_fractions",
    "clip_indicators",
    "clipped_surrogate",
    "compute_grpo_advantages",
    "ess_from_moments",
    "importance_weight_metrics",
    "m2po_mask",
    "informative_groups",
    "hill_kernel",
    "k3_estimator",
    "masked_mean",
    "mismatch_metrics",
    "mismatch_terms",
    "policy_loss",
    "prepare_inputs",
    "recomputed_old_when_stale",
    "sat_abs_staleness",
    "sat_metrics",
    "sat_radii",
    "sat_reference_quantile",
]
