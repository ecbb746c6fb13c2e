"""Pure-maths RL objectives: advantages, clipped policy losses (GRPO, GSPO, SAT, DPPO), SAT
trust regions, loss aggregation and mismatch metrics. No I/O, no process groups: distributed
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
    OBJECTIVES,
    RATIO_DENOMINATORS,
    SAT_STALENESS,
    LossInputs,
    ObjectiveConfig,
    ObjectiveTerms,
    clipped_surrogate,
    policy_loss,
    prepare_inputs,
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
    "LOSS_AGG_MODES",
    "OBJECTIVES",
    "RATIO_DENOMINATORS",
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
    "informative_groups",
    "hill_kernel",
    "k3_estimator",
    "masked_mean",
    "mismatch_metrics",
    "mismatch_terms",
    "policy_loss",
    "prepare_inputs",
    "sat_abs_staleness",
    "sat_metrics",
    "sat_radii",
    "sat_reference_quantile",
]
