"""Several optimizer steps per rollout batch: mini-batches (``train.global_batch_size``) and
epochs (``train.num_epochs``), with old log-probs computed once.

One rollout batch of N samples gives (N / ``global_batch_size``) x ``num_epochs`` optimizer
steps (slime: ``num_steps_per_rollout`` = rollout batch / ``--global-batch-size``; verl:
``ppo_mini_batch_size`` and ``ppo_epochs``):

- The cut (``mini_batch_slices``): contiguous mini-batches of whole GRPO groups in rollout
  order, the same cut every epoch, no shuffle: verl splits the batch in order
  (``data.split(ppo_mini_batch_size)`` in ``dp_actor.update_policy``) and slime walks the
  rollout data in order. Deterministic, so a resumed run needs no RNG state for it. Each
  mini-batch is then shared over the data-parallel ranks as a whole batch is today
  (``training.step.dp_shares``, whole groups).
- Old log-probs (a "recomputed_old" ratio denominator, TIS, IcePop) are computed ONCE, before
  the first optimizer step, with the weights the rollout batch started from (slime's
  ``compute_log_prob`` before ``train``; verl's ``compute_log_prob`` before
  ``update_policy``), by one no-grad forward of every mini-batch (``plan_old_log_probs``), and
  reused by every optimizer step of every epoch. Forwards per rollout batch of k optimizer
  steps with R3 and a recomputed denominator (bench/forward_passes.py): 1 no-grad forward of
  the batch + one training forward of each mini-batch, the same 2 forwards of the batch as a
  single step (a SAT objective on a split batch adds, per optimizer step, the no-grad forward
  of its mini-batch that gives its quantile with the current weights).
- SAT's quantile q (SAT Eq. 14, over "the batch") is per optimizer step, over the active
  tokens of that step's mini-batch with the current weights (all DP ranks): the batch a step
  trains on, as slime computes every step's statistics on that step's own data.
- Policy version: one rollout batch, as slime's ``rollout_id``: every optimizer step of it
  runs at the trainer version the batch started with (staleness and ``response_versions``
  count rollout batches) and the weights are pushed once, after its last step.
- Metrics: each optimizer step's global metrics (``PolicyTrainer.rl_step``) under
  ``mini_step{j}/`` (j = 1 .. k, epochs included), and their mean over the k steps under the
  plain name (verl reduces its mini-batches' metrics to their mean the same way), so the
  run's ``metrics.jsonl`` keeps one line per rollout batch with its usual keys, plus
  ``num_optimizer_steps``. The live-routing diagnostic runs on the first step only (closest
  to the rollout policy).
- Resume: ``RolloutBatchSteps`` is this rank's pending rollout batch (its shares of every
  mini-batch, their old log-probs, the steps done); ``state_dict`` / ``from_state_dict`` give
  it as plain data for a run checkpoint, so a run resumed after step j of k continues with
  the same old log-probs and bitwise the same weights (tests/test_mini_batches.py). The old
  log-probs cannot be regenerated after the first step (the weights they need are gone), so
  they are stored, not recomputed.
- Stop in the middle (``train_rollout_batch``): the RL loop asks, after each optimizer step
  that leaves steps to do, whether a stop signal came (``training.stop``); rank 0's answer is
  broadcast, and on a stop every rank keeps its ``RolloutBatchSteps`` for a run checkpoint
  (``training.mid_batch``) and the resumed run passes it back to finish the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megatron_sat.config import RunConfig
from megatron_sat.objectives import INERT_CLIP_WARNING, ObjectiveConfig
from megatron_sat.rollout.types import Sample
from megatron_sat.training import passes, step_batch
from megatron_sat.training.pass_plan import needs_old_log_probs, plan_old_log_probs
from megatron_sat.training.step import distributed_rl_step, rank_share
from megatron_sat.training.trainer import PolicyTrainer

_step_hook: Callable[[int | None, int], None] | None = None


def set_step_hook(hook: Callable[[int | None, int], None] | None) -> None:
    """Install ``hook(trainer_version, done)``, called after each optimizer step of a rollout
    batch (``run_optimizer_step``; ``done``: its steps done, 1-based). For stop tests only
    (the CLI installs one from ``MEGATRON_SAT_STOP_AT``); None removes it."""
    global _step_hook
    _step_hook = hook


def mini_batch_slices(num_samples: int, group_size: int, global_batch_size: int) -> list[slice]:
    """Contiguous mini-batches of ``global_batch_size`` samples (whole groups, in order).

    Raises:
        ValueError: ``global_batch_size`` does not divide ``num_samples`` or is not a
            multiple of ``group_size``.
    """
    if global_batch_size < 1 or num_samples % global_batch_size or global_batch_size % group_size:
        raise ValueError(
            f"train.global_batch_size={global_batch_size} must divide the rollout batch of "
            f"{num_samples} samples and be a multiple of rollout.group_size={group_size}"
        )
    return [slice(s, s + global_batch_size) for s in range(0, num_samples, global_batch_size)]


def uses_mini_batches(cfg: RunConfig) -> bool:
    """Whether a rollout batch gives more than one optimizer step (else the one-step path,
    bitwise as before mini-batches existed)."""
    return cfg.train.global_batch_size is not None or cfg.train.num_epochs > 1


@dataclass
class RolloutBatchSteps:
    """This rank's pending rollout batch.

    Attributes:
        shares: per mini-batch, this rank's ``(samples, advantages [n] float32,
            trainer_version)`` (possibly no samples).
        old_log_probs: per mini-batch, per real micro-batch, old log-probs [B, S] (None on a
            pipeline stage before the last); None when the objective reads none.
        num_epochs: passes over the mini-batches.
        done: optimizer steps done (0 .. ``num_steps``).
        metrics: the global metrics of the steps done.
    """

    shares: list[tuple[list[Sample], torch.Tensor, int | None]]
    old_log_probs: list[list[torch.Tensor | None]] | None
    num_epochs: int
    done: int = 0
    metrics: list[dict[str, float]] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        """Optimizer steps of the rollout batch: mini-batches x epochs."""
        return len(self.shares) * self.num_epochs

    def state_dict(self) -> dict:
        """Plain data (lists, dicts, CPU tensors, numpy arrays) for a run checkpoint."""

        def cpu(t):
            return None if t is None else t.detach().cpu().clone()

        return {
            "shares": [
                {
                    "samples": [dataclasses.asdict(s) for s in samples],
                    "advantages": advantages.cpu().clone(),
                    "version": version,
                }
                for samples, advantages, version in self.shares
            ],
            "old_log_probs": None
            if self.old_log_probs is None
            else [[cpu(t) for t in mb] for mb in self.old_log_probs],
            "num_epochs": self.num_epochs,
            "done": self.done,
            "metrics": [dict(m) for m in self.metrics],
        }

    @classmethod
    def from_state_dict(cls, state: dict, device: torch.device) -> RolloutBatchSteps:
        """The pending batch ``state_dict`` gave, its old log-probs on ``device``."""

        def sample(d: dict) -> Sample:
            d = dict(d)
            if d.get("routed_experts") is not None:
                d["routed_experts"] = np.asarray(d["routed_experts"])
            return Sample(**d)

        old = state["old_log_probs"]
        return cls(
            shares=[
                ([sample(s) for s in sh["samples"]], sh["advantages"], sh["version"])
                for sh in state["shares"]
            ],
            old_log_probs=None
            if old is None
            else [[None if t is None else t.to(device) for t in mb] for mb in old],
            num_epochs=state["num_epochs"],
            done=state["done"],
            metrics=[dict(m) for m in state["metrics"]],
        )


@contextlib.contextmanager
def clip_not_inert(num_steps: int) -> Iterator[None]:
    """Silence ``INERT_CLIP_WARNING`` (stale samples with a recomputed denominator: "the ratio
    is 1, the clip inert") in a rollout batch of ``num_steps`` > 1 optimizer steps, where it
    is untrue: pi_old is the batch's starting policy, and the ratio leaves 1 from the second
    step on. With one step the warning stands."""
    with warnings.catch_warnings():
        if num_steps > 1:
            warnings.filterwarnings("ignore", message=re.escape(INERT_CLIP_WARNING))
        yield


def batch_old_log_probs(
    trainer: PolicyTrainer,
    samples: list[Sample],
    advantages: torch.Tensor,
    objective: ObjectiveConfig,
    trainer_version: int | None,
) -> list[torch.Tensor | None]:
    """Per real micro-batch of ``samples`` (``trainer.micro_batch_rows``), old log-probs
    [B, S] of a no-grad forward with the current weights and the training forward's routing
    (R3: replayed). A collective over every trainer rank (fillers included)."""
    batch = step_batch.prepare_step_batch(trainer, samples, advantages, objective, trainer_version)
    plan = plan_old_log_probs(trainer.train_config.use_r3)
    return passes.run_no_grad_passes(trainer, batch.forwards, len(batch.mbs), plan).old_log_probs


def start_rollout_batch(
    trainer: PolicyTrainer,
    samples: list[Sample] | None,
    advantages: torch.Tensor | None,
    cfg: RunConfig,
    trainer_version: int | None,
) -> RolloutBatchSteps:
    """Cut rank 0's rollout batch into mini-batches, give every rank its share of each, and
    compute the old log-probs of all of them with the current weights (when the objective
    reads any). A collective over every trainer rank; the others pass None.

    Raises:
        ValueError: what ``mini_batch_slices`` refuses (on rank 0, before any collective).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    gbs = cfg.train.global_batch_size
    cuts = None
    if rank == 0:
        cuts = mini_batch_slices(len(samples), cfg.rollout.group_size, gbs or len(samples))
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [None if cuts is None else [(c.start, c.stop) for c in cuts]]
        dist.broadcast_object_list(box, src=0)  # the followers learn how many mini-batches
        cuts = [slice(a, b) for a, b in box[0]]
    shares = [
        rank_share(
            trainer,
            None if rank else samples[c],
            None if rank else advantages[c],
            cfg,
            trainer_version,
        )
        for c in cuts
    ]
    pending = RolloutBatchSteps(shares, None, cfg.train.num_epochs)
    if needs_old_log_probs(cfg.objective):
        with clip_not_inert(pending.num_steps):
            pending.old_log_probs = [
                batch_old_log_probs(trainer, s, a, cfg.objective, v) for s, a, v in shares
            ]
    return pending


def run_optimizer_step(
    trainer: PolicyTrainer,
    pending: RolloutBatchSteps,
    objective: ObjectiveConfig,
    routing_diagnostic: bool,
) -> dict[str, float]:
    """The next optimizer step of ``pending`` (``PolicyTrainer.rl_step`` on this rank's share
    of its mini-batch, with the precomputed old log-probs); its global metrics, also kept in
    ``pending.metrics``. A collective.

    Raises:
        ValueError: every step of ``pending`` is done.
    """
    if pending.done >= pending.num_steps:
        raise ValueError(f"the rollout batch's {pending.num_steps} optimizer steps are done")
    j = pending.done % len(pending.shares)
    samples, advantages, version = pending.shares[j]
    with clip_not_inert(pending.num_steps):
        metrics = trainer.rl_step(
            samples,
            advantages,
            objective,
            trainer_version=version,
            routing_diagnostic=routing_diagnostic and pending.done == 0,
            old_log_probs=None if pending.old_log_probs is None else pending.old_log_probs[j],
        )
    pending.done += 1
    pending.metrics.append(metrics)
    if _step_hook is not None:
        _step_hook(version, pending.done)
    return metrics


def rollout_batch_metrics(per_step: list[dict[str, float]]) -> dict[str, float]:
    """The rollout batch's metrics from its optimizer steps' ones: each step's under
    ``mini_step{j}/`` (1-based), each key's mean over the steps that report it under its plain
    name, and ``num_optimizer_steps``."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_step for k in m):
        values = [m[key] for m in per_step if key in m]
        out[key] = sum(values) / len(values)
    for j, m in enumerate(per_step, start=1):
        out.update({f"mini_step{j}/{k}": v for k, v in m.items()})
    out["num_optimizer_steps"] = float(len(per_step))
    return out


def distributed_rollout_batch(
    trainer: PolicyTrainer,
    samples: list[Sample] | None,
    advantages: torch.Tensor | None,
    cfg: RunConfig,
    trainer_version: int | None,
    *,
    routing_diagnostic: bool = True,
) -> dict[str, float]:
    """Train on one rollout batch on every rank (rank 0 passes it, the others None): one
    ``distributed_rl_step`` without mini-batches (bitwise as before), else every optimizer
    step of ``start_rollout_batch``; the global metrics (``rollout_batch_metrics``).
    ``train_rollout_batch`` that never stops in the middle (and broadcasts no stop)."""
    metrics, _ = train_rollout_batch(
        trainer,
        samples,
        advantages,
        cfg,
        trainer_version,
        routing_diagnostic=routing_diagnostic,
        stoppable=False,
    )
    assert metrics is not None  # unstoppable: the batch is done
    return metrics


def _stop_agreed(stop: Callable[[], bool] | None) -> bool:
    """Rank 0's ``stop()`` (False without one), broadcast to every rank. A collective."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    box = [bool(stop()) if rank == 0 and stop is not None else False]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def train_rollout_batch(
    trainer: PolicyTrainer,
    samples: list[Sample] | None,
    advantages: torch.Tensor | None,
    cfg: RunConfig,
    trainer_version: int | None,
    *,
    routing_diagnostic: bool,
    stop: Callable[[], bool] | None = None,
    pending: RolloutBatchSteps | None = None,
    stoppable: bool = True,
) -> tuple[dict[str, float] | None, RolloutBatchSteps | None]:
    """``distributed_rollout_batch`` that a stop can interrupt between two optimizer steps (the
    RL loop's, on every rank: rank 0 passes the batch, the others None).

    Args:
        stop: rank 0's question "stop now?", asked after each optimizer step that leaves
            steps of the rollout batch to do; its answer is broadcast to every rank, so the
            others pass None (rank 0 too, never to stop in the middle). One step per rollout
            batch: never asked.
        stoppable: False on every rank: never ask (no broadcast per optimizer step).
        pending: a pending batch restored from a run checkpoint (this rank's share), finished
            instead of starting one from ``samples``.

    Returns:
        ``(metrics, None)`` when the rollout batch is done (``rollout_batch_metrics``, or the
        one step's), ``(None, pending)`` when a stop came with ``pending.done`` of its
        ``pending.num_steps`` steps done (``pending.state_dict()`` goes into the checkpoint).
    """
    if pending is None:
        if not uses_mini_batches(cfg):
            metrics = distributed_rl_step(
                trainer,
                samples,
                advantages,
                cfg,
                trainer_version,
                routing_diagnostic=routing_diagnostic,
            )
            return metrics, None
        pending = start_rollout_batch(trainer, samples, advantages, cfg, trainer_version)
    while pending.done < pending.num_steps:
        run_optimizer_step(trainer, pending, cfg.objective, routing_diagnostic)
        if stoppable and pending.done < pending.num_steps and _stop_agreed(stop):
            return None, pending
    return rollout_batch_metrics(pending.metrics), None
