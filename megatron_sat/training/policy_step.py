"""One RL step of the policy (``PolicyTrainer.rl_step``), as phases over one ``StepBatch``.

1. Prepare (``training.step_batch.prepare_step_batch``): micro-batches, fillers, version
   ages, the global loss denominators, and the step's checks.
2. Plan the no-grad passes (``training.pass_plan.plan_passes``, pure) and run them
   (``training.passes.run_no_grad_passes``): live routing, replayed routing, reference policy.
3. SAT's global quantile (``sat_global_quantile``) from the trained routing's pass.
4. The training pass (``training.train_pass.train_pass``) with ``policy_loss``
   (``policy_loss_fn``), after the live-routing metrics (``add_live_metrics``).
5. The optimizer step and the step's global metrics (``step_metrics``).

A collective over all trainer ranks: every rank calls it once per step, the TP ranks of one
data-parallel rank with the same samples, each data-parallel rank with its own share (possibly
none; see ``PolicyTrainer``). The step is independent of how the global batch is split into
micro-batches, DP ranks, TP and EP shards, up to fp32 rounding
(tests/test_split_invariance.py, tests/test_trainer_parallel.py):

- Loss denominators (active tokens; responses with >= 1 active token) are counted over all
  micro-batches of all DP ranks (an all-reduce, ``global_loss_denominators``), so each
  micro-batch's loss is its share of the global loss. Each share is multiplied by the DP size
  before ``backward`` because megatron-core's DDP pre-scales dense and expert gradients by
  1 / DP size (``dp_loss_scale``); the result is the gradient of the global loss. TP ranks
  compute the same loss (vocab-parallel cross entropy), as megatron-core's TP backward
  expects; gradients TP ranks hold in part are summed over TP after the backward passes.
- SAT's quantile q is exact over the global batch: a no-grad forward (same routing as the
  training forward) gives |d| of every active token, which is all-gathered with uneven sizes
  and fed to ``sat_reference_quantile`` (``global_sat_quantile``). With one process and one
  micro-batch ``policy_loss`` computes the same q itself.
- The ratio's denominator is ``objective.ratio_denominator``: the rollout engine's
  ``rollout_log_probs`` (default, SAT Eq. 1) or old log-probs recomputed here by a no-grad
  forward of the current weights before the update. The old log-probs are also computed for
  TIS / IcePop. In a rollout batch of several optimizer steps (``training.mini_batches``) they
  are computed once before its first step and passed in (``old_log_probs``), so no pass here
  recomputes them; SAT's quantile is still this step's, with the current weights.
- With ``train.use_r3`` every forward that trains or sets q replays the rollout engine's
  experts; one more no-grad forward with live routing gives the live diagnostics when
  ``routing_diagnostic`` (``train.routing_diagnostic_interval``). Without R3 that forward is
  also the trained routing's (old log-probs, SAT's q) and runs anyway (``PassPlan``).
- With ``objective.kl_coef > 0`` a no-grad forward of the frozen reference policy (with R3,
  the routes the trained forward replays) gives ``ref_log_probs`` for the k3 KL term. With
  ``objective.entropy_coef > 0`` the trained forward also gives the policy's entropy over the
  whole (vocab-parallel) vocabulary for the entropy bonus.
- Under EP a rank with fewer micro-batches than another rank of its expert group runs
  forwards/backwards of empty filler micro-batches, so the dispatcher's all-to-alls stay in
  step; they contribute nothing.

The step's metrics (identical on every rank; see ``MetricAccumulator``): the ``policy_loss``
metrics (token means, ``seq_*`` means over responses with an active token, ``age{a}/...`` per
version age), ``loss`` (global loss), ``grad_norm`` (the global norm before clipping; absent
when ``train.clip_grad == 0``), ``num_tokens`` / ``num_seqs`` (global denominators), routing
agreement with and without replay (``topk_match_r3`` / ``topk_match_live``) and the
train-rollout mismatch without replay (``mismatch_abs_logratio_live``).
"""

from __future__ import annotations

import torch

from megatron_sat.objectives import (
    ObjectiveConfig,
    ess_from_moments,
    policy_loss,
    sat_abs_staleness,
)
from megatron_sat.training.loss_reduction import MetricAccumulator, global_sat_quantile
from megatron_sat.training.pass_plan import PassPlan, plan_passes
from megatron_sat.training.passes import PassOutput, PassResults, run_no_grad_passes
from megatron_sat.training.staging import stage_tensor
from megatron_sat.training.step_batch import StepBatch
from megatron_sat.training.train_pass import LossFn


def no_grad_passes(
    trainer,
    batch: StepBatch,
    objective: ObjectiveConfig,
    routing_diagnostic: bool,
    old_log_probs: list[torch.Tensor | None] | None,
) -> tuple[PassPlan, PassResults]:
    """Plan and run the step's no-grad passes (a collective); ``old_log_probs`` (per real
    micro-batch [B, S], computed before the rollout batch's first optimizer step,
    ``training.mini_batches``) replace the pass that would recompute them with the current
    weights."""
    plan = plan_passes(
        objective,
        use_r3=trainer.train_config.use_r3,
        diagnostic=routing_diagnostic,
        split_batch=batch.is_split,
        old_given=old_log_probs is not None,
    )
    results = run_no_grad_passes(trainer, batch.forwards, len(batch.mbs), plan)
    if old_log_probs is not None:
        if len(old_log_probs) != len(batch.mbs):
            raise ValueError(
                f"{len(old_log_probs)} old log-prob tensors for {len(batch.mbs)} micro-batches"
            )
        results.old_log_probs = list(old_log_probs)
    return plan, results


def sat_global_quantile(
    batch: StepBatch, objective: ObjectiveConfig, plan: PassPlan, passes: PassResults
) -> torch.Tensor | None:
    """SAT's quantile q over the global batch from the trained routing's log-probs (a
    collective over the data-parallel group), or None when ``plan`` computes none. Call it on
    the last pipeline stage only (the log-probs exist there)."""
    if not plan.global_quantile:
        return None
    recomputed = objective.ratio_denominator == "recomputed_old"
    abs_d = []
    for (lp, _), o, mb in zip(passes.trained_routing, passes.old_log_probs, batch.mbs, strict=True):
        mu = o if recomputed else stage_tensor(mb.rollout_log_probs, batch.device)
        mask = stage_tensor(mb.loss_mask, batch.device)
        abs_d.append(sat_abs_staleness(lp, mu, mask, objective))
    return global_sat_quantile(abs_d, objective.sat_alpha, batch.group)


def add_live_metrics(acc: MetricAccumulator, batch: StepBatch, live: PassOutput) -> None:
    """Add the live-routing diagnostics of each micro-batch to ``acc``, weighted by its active
    tokens: ``mismatch_abs_logratio_live`` (mean |log pi_live - log mu|) and, with rollout
    routes, ``topk_match_live``. Rows without log-probs add nothing. No host
    synchronisation (device tensors into ``acc``)."""
    for mb, (lp, match) in zip(batch.mbs, live, strict=True):
        if lp is None:  # a pipeline stage before the last, or no live pass: no metrics
            continue
        mask = stage_tensor(mb.loss_mask, batch.device)
        mu = stage_tensor(mb.rollout_log_probs, batch.device)
        n = mask.sum()
        diff = ((lp - mu).abs() * mask).sum() / n.clamp_min(1.0)
        live_metrics = {"mismatch_abs_logratio_live": diff}
        if match is not None:  # None: the samples carry no rollout routes
            live_metrics["topk_match_live"] = match
        acc.add(live_metrics, {"num_active_tokens": n})


def policy_loss_fn(
    batch: StepBatch,
    objective: ObjectiveConfig,
    passes: PassResults,
    quantile: torch.Tensor | None,
) -> LossFn:
    """The training pass's loss of real micro-batch ``i``: ``policy_loss`` with the global
    denominators, the passes' old and reference log-probs, SAT's global quantile (None: the
    loss computes its own) and the rows' version ages (their buckets known on the host)."""

    def loss_of(i: int, mb, log_probs: torch.Tensor, entropy: torch.Tensor | None):
        ages = batch.sample_age(i)
        return policy_loss(
            log_probs,
            mb.rollout_log_probs,
            mb.advantages,
            mb.loss_mask,
            objective,
            ref_log_probs=passes.ref_log_probs[i],
            old_log_probs=passes.old_log_probs[i],
            global_num_tokens=batch.num_tokens,
            global_num_seqs=batch.num_seqs,
            sat_quantile=quantile,
            sample_age=None if ages is None else stage_tensor(ages, mb.advantages.device),
            entropy=entropy,
            age_buckets=batch.age_buckets(i),
        )

    return loss_of


def step_metrics(
    metrics: dict[str, float], batch: StepBatch, grad_norm: float | None
) -> dict[str, float]:
    """The step's reduced ``metrics`` completed: the global ``ess`` (from the global moments,
    not a mean of per-batch ones), the global denominators and, when the optimizer computed
    it (``train.clip_grad > 0``), ``grad_norm``."""
    if "is_weight_sq_mean" in metrics:
        metrics["ess"] = ess_from_moments(metrics["is_weight_mean"], metrics["is_weight_sq_mean"])
    metrics.update(num_tokens=batch.num_tokens, num_seqs=batch.num_seqs)
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    return metrics
