"""Which no-grad forwards one RL step runs before its training forward, and why.

A pure decision (``plan_passes``): no model, no collective. The step then runs the planned
passes in a fixed order (``training.passes.run_no_grad_passes``): live routing, replayed
routing, reference policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_sat.objectives import SAT_STALENESS, ObjectiveConfig


@dataclass(frozen=True)
class PassPlan:
    """The no-grad forwards of one RL step (each a forward of every micro-batch, fillers too).

    - The *live* pass routes every token with the trainer's own routers. It gives the
      diagnostics ``topk_match_live`` / ``mismatch_abs_logratio_live`` on diagnostic steps
      (``routing_diagnostic``, ``train.routing_diagnostic_interval``). Without R3 it is also
      the routing the training forward uses, so it runs whenever the trained routing's
      log-probs are needed, and its ``*_live`` metrics are then still dropped on
      non-diagnostic steps (absent, not zero).
    - The *replayed* pass (R3 only) replays the rollout engine's experts, as the training
      forward does, when the trained routing's log-probs are needed.
    - The trained routing's log-probs are needed for old log-probs (a "recomputed_old" ratio
      denominator: old log-probs recomputed by the current weights before the update; also
      TIS and IcePop, whose correction weight is pi_old / mu) and for SAT's global quantile.
      SAT's quantile q is exact over the global batch: the |d| of every active token is
      all-gathered with uneven sizes and fed to ``sat_reference_quantile``
      (``global_sat_quantile``); with one process and one micro-batch ``policy_loss``
      computes the same q itself from the training forward, and no pass is needed for it.
    - The *reference* pass (``objective.kl_coef > 0``) runs the frozen reference policy (its
      weights swapped in, ``training.passes.reference_weights``), with the routes the
      training forward replays under R3, for the k3 KL term's ``ref_log_probs``.

    Attributes:
        live: run the live-routing pass.
        replayed: run the replayed (R3) pass.
        reference: run the reference policy's pass.
        reference_replays: the reference pass replays the rollout routes (R3).
        live_metrics: report the live pass's ``*_live`` metrics (a diagnostic step).
        old_log_probs: the loss gets old log-probs (from ``trained_routing``).
        global_quantile: SAT's quantile is computed over the global batch before training
            (from ``trained_routing``).
        trained_routing: the pass giving the trained routing's log-probs ("live" or
            "replayed"), None when nothing needs them.
    """

    live: bool
    replayed: bool
    reference: bool
    reference_replays: bool
    live_metrics: bool
    old_log_probs: bool
    global_quantile: bool
    trained_routing: Literal["live", "replayed"] | None


def needs_old_log_probs(objective: ObjectiveConfig) -> bool:
    """Whether ``objective`` reads old log-probs: a "recomputed_old" ratio denominator, TIS or
    IcePop."""
    return (
        objective.ratio_denominator == "recomputed_old"
        or objective.tis_cap is not None
        or objective.icepop_range is not None
    )


def plan_passes(
    objective: ObjectiveConfig,
    *,
    use_r3: bool,
    diagnostic: bool,
    split_batch: bool,
    old_given: bool = False,
) -> PassPlan:
    """The no-grad passes of one RL step (see ``PassPlan``).

    Args:
        objective: the policy objective (its old log-probs, SAT, ``kl_coef``).
        use_r3: ``train.use_r3``: the training forward replays the rollout routes.
        diagnostic: ``routing_diagnostic`` of ``rl_step``: report the ``*_live`` metrics.
        split_batch: the global batch spans more than one micro-batch or data-parallel rank
            (SAT's quantile must then be computed before training). Identical on every rank
            of an expert group: a DP size > 1 makes it True everywhere, a DP size of 1 means
            one set of micro-batches.
        old_given: the step's old log-probs were computed before (a mini-step of a rollout
            batch, ``training.mini_batches``): no pass computes them.

    Returns:
        The plan; the same inputs give the same plan on every rank (the passes are
        collectives).
    """
    old = needs_old_log_probs(objective) and not old_given
    global_q = objective.name in SAT_STALENESS and split_batch
    needed = old or global_q
    return PassPlan(
        # The live pass costs one forward of the batch: diagnostic steps, and without R3
        # whenever the trained routing's log-probs are needed (it is that routing).
        live=diagnostic or (not use_r3 and needed),
        replayed=use_r3 and needed,
        reference=objective.kl_coef > 0,
        reference_replays=use_r3,
        live_metrics=diagnostic,
        old_log_probs=old,
        global_quantile=global_q,
        trained_routing=("replayed" if use_r3 else "live") if needed else None,
    )


def plan_old_log_probs(use_r3: bool) -> PassPlan:
    """The one pass that gives old log-probs alone (the trained routing's, no metrics): what a
    rollout batch of several optimizer steps runs once before its first step
    (``training.mini_batches``)."""
    return PassPlan(
        live=not use_r3,
        replayed=use_r3,
        reference=False,
        reference_replays=use_r3,
        live_metrics=False,
        old_log_probs=True,
        global_quantile=False,
        trained_routing="replayed" if use_r3 else "live",
    )
