"""The no-grad log-prob passes of a step: live or replayed routing, policy or reference weights.

Each pass is one no-grad forward of every micro-batch (fillers included: every rank of an
expert group runs as many), through megatron-core's forward-only pipeline schedule under
pipeline parallelism. ``run_no_grad_passes`` runs the passes a ``PassPlan`` names, in a fixed
order (live, replayed, reference). R3 replay contexts for single forwards (``replayed``) and for
a pipeline schedule (``stage_replay``) live here too; the training pass uses them as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_sat.routing.replay import MicroBatchRoutes, capture_routing
from megatron_sat.training.batching import MicroBatch
from megatron_sat.training.logprobs import forward_log_probs, model_log_probs
from megatron_sat.training.pass_plan import PassPlan
from megatron_sat.training.pipeline import run_pipeline_schedule
from megatron_sat.training.reference import ReferencePolicy
from megatron_sat.training.routing_metrics import (
    ShardLayout,
    topk_agreement,
    topk_agreements,
    topk_counts,
)
from megatron_sat.training.staging import staged

if TYPE_CHECKING:
    from megatron_sat.training.trainer import PolicyTrainer

# Per micro-batch: log-probs [B, S] (None on a pipeline stage before the last) and the top-k
# agreement with the rollout's routes (a 0-dim tensor on the device; None without routes).
PassOutput = list[tuple[torch.Tensor | None, torch.Tensor | None]]


@contextlib.contextmanager
def reference_weights(reference: ReferencePolicy | None) -> Iterator[None]:
    """The parameters hold the reference weights inside the block, the policy's again after it
    (``ReferencePolicy.swapped_in``).

    Raises:
        ValueError: without a reference (``reference=False`` at construction).
    """
    if reference is None:
        raise ValueError("this PolicyTrainer holds no reference policy (reference=False)")
    with reference.swapped_in():
        yield


def replayed(
    trainer: PolicyTrainer, mb: MicroBatch, *, training: bool
) -> contextlib.AbstractContextManager:
    """Context in which the next forward replays ``mb``'s rollout routes (R3) in every MoE
    router of this rank, cut to this rank's tokens (``RoutingReplay.routes_for``)."""

    @contextlib.contextmanager
    def session() -> Iterator[None]:
        routes = trainer.routing.routes_for(mb.routes, mb.routes_valid)
        # ids checked on the host when the micro-batch was built (check_sample_routes;
        # fillers valid by construction): no read-back from the device per session
        with trainer.routing.replay({0: routes}, training=training, audit=False, ids_checked=True):
            with trainer.routing.micro_batch(0):
                yield

    return session()


class LazyRoutes(Mapping[int, MicroBatchRoutes]):
    """The replay targets of a pipeline schedule's micro-batches, built one micro-batch at a
    time: the forward step ``put``s its staged micro-batch, and the routers' first read widens
    that micro-batch's compact routes (this stage's layers) to int64; the targets of earlier
    micro-batches are dropped then (a recompute reads its own from the replay ledger). Under PP
    a step's routes are never all widened at once."""

    def __init__(self, trainer: PolicyTrainer, num_micro_batches: int) -> None:
        self._trainer = trainer
        self._count = num_micro_batches
        self._staged: tuple[int, MicroBatch] | None = None
        self._built: tuple[int, MicroBatchRoutes] | None = None

    def put(self, index: int, mb: MicroBatch) -> None:
        """Micro-batch ``index`` (staged on the device) runs next."""
        self._staged, self._built = (index, mb), None

    def __getitem__(self, index: int) -> MicroBatchRoutes:
        if self._built is not None and self._built[0] == index:
            return self._built[1]
        if self._staged is None or self._staged[0] != index:
            raise KeyError(f"micro-batch {index} was not staged before its forward")
        mb = self._staged[1]
        self._built = (index, self._trainer.routing.routes_for(mb.routes, mb.routes_valid))
        return self._built[1]

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and 0 <= index < self._count

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._count))

    def __len__(self) -> int:
        return self._count


def stage_replay(trainer: PolicyTrainer, routes: LazyRoutes, *, training: bool):
    """One R3 replay session over a schedule's micro-batches (``routes``: their targets, built
    as each is staged); the schedule's forward step names the micro-batch
    (``micro_batch(i)``). The ids were checked on the host (see ``replayed``)."""
    return trainer.routing.replay(routes, training=training, audit=False, ids_checked=True)


def stack_counts(counts: dict[int, torch.Tensor], num: int, device) -> torch.Tensor:
    """float64 [num, 2]: the ``topk_counts`` of micro-batches 0..num-1 (on the device)."""
    if not num:
        return torch.zeros(0, 2, dtype=torch.float64, device=device)
    return torch.stack([counts[i].to(device) for i in range(num)])


def layout_of(trainer: PolicyTrainer) -> ShardLayout:
    """This rank's layout as the ``routing_metrics`` functions take it."""
    return ShardLayout(trainer.tp_size, trainer.sequence_parallel, trainer.pp_size)


@torch.no_grad()
def no_grad_log_probs(
    trainer: PolicyTrainer, mbs: list[MicroBatch], replay: bool, reference: bool = False
) -> PassOutput:
    """Per micro-batch: log-probs [B, S] of a no-grad forward with the current weights
    (the full sequence on every TP rank), and the fraction of (MoE layer, response token)
    pairs whose top-k experts equal the rollout engine's (``routing_metrics.topk_agreement``;
    a collective over the TP group under sequence parallelism).

    Args:
        trainer: the policy trainer (its model, routing replay and layout).
        mbs: micro-batches (fillers included: every rank of an expert group must pass as
            many); without routes the agreement is None.
        replay: replay the rollout engine's experts (R3) or route live.
        reference: run the frozen reference policy instead of the policy.

    Raises:
        ValueError: ``reference`` on a trainer without a reference policy.
    """
    trainer.model.eval()
    out = []
    weights = reference_weights(trainer._reference) if reference else contextlib.nullcontext()
    with weights:
        if trainer.pp_size > 1:
            return pipelined_log_probs(trainer, mbs, replay)
        for host_mb in mbs:
            with staged(host_mb, trainer.device) as mb:
                ctx = replayed(trainer, mb, training=False) if replay else contextlib.nullcontext()
                with ctx, capture_routing(trainer.model) as used:
                    log_probs = forward_log_probs(trainer.model, mb, trainer.sampling_mask)
                out.append((log_probs, topk_agreement(used, mb, layout_of(trainer))))
    return out


def pipelined_log_probs(trainer: PolicyTrainer, mbs: list[MicroBatch], replay: bool) -> PassOutput:
    """``no_grad_log_probs`` under pipeline parallelism (call it under ``no_grad``): one
    forward-only run of megatron-core's schedule. The log-probs [B, S] exist on the last
    stage (None on the others); the top-k agreement is summed over the stages' layers and
    is the same on every rank (None for a micro-batch without routes)."""
    layout = layout_of(trainer)
    counts: dict[int, torch.Tensor] = {}
    log_probs: dict[int, torch.Tensor] = {}
    routes = LazyRoutes(trainer, len(mbs))

    def forward(chunk, host_mb, i):
        with staged(host_mb, trainer.device) as mb:
            routes.put(i, mb)
            ctx = trainer.routing.micro_batch(i) if replay else contextlib.nullcontext()
            with ctx, capture_routing(chunk) as used:
                output = model_log_probs(chunk, mb, trainer.sampling_mask)
            counts[i] = topk_counts(used, mb, layout)
            if trainer.is_last_stage:
                log_probs[i] = mb.to_sample_layout(output)
        return output, None

    with stage_replay(trainer, routes, training=False) if replay else contextlib.nullcontext():
        if mbs:  # (a pipeline without samples: every stage has none, nothing to send)
            run_pipeline_schedule(trainer.model, mbs, forward, forward_only=True)
    matches = topk_agreements(stack_counts(counts, len(mbs), trainer.device), layout)
    return [
        (log_probs.get(i), None if mb.routes is None else match)
        for i, (mb, match) in enumerate(zip(mbs, matches, strict=True))
    ]


@dataclass
class PassResults:
    """What the no-grad passes give the rest of the step, per real micro-batch (fillers cut).

    Attributes:
        live: the live pass's output for the ``*_live`` metrics; ``(None, None)`` rows when
            the plan reports none (the pass did not run, or ran for the trained routing only).
        trained_routing: the output of the pass with the training forward's routing
            (``PassPlan.trained_routing``), for SAT's global quantile; ``(None, None)`` rows
            when no pass ran.
        old_log_probs: per micro-batch old log-probs [B, S], or None each.
        ref_log_probs: per micro-batch reference log-probs [B, S], or None each.
    """

    live: PassOutput
    trained_routing: PassOutput
    old_log_probs: list[torch.Tensor | None]
    ref_log_probs: list[torch.Tensor | None]


def run_no_grad_passes(
    trainer: PolicyTrainer, forwards: list[MicroBatch], num_real: int, plan: PassPlan
) -> PassResults:
    """Run the passes of ``plan`` over ``forwards`` (the first ``num_real`` real, the rest
    fillers), in the order live, replayed, reference, through ``trainer._no_grad_log_probs``.
    A collective (each pass is one, see ``no_grad_log_probs``)."""
    skipped = [(None, None)] * num_real  # no log-probs: nothing is logged from them
    live = skipped
    if plan.live:
        live = trainer._no_grad_log_probs(forwards, replay=False)[:num_real]
    trained = live
    if plan.replayed:
        trained = trainer._no_grad_log_probs(forwards, replay=True)[:num_real]
    old = [lp if plan.old_log_probs else None for lp, _ in trained]
    if not plan.live_metrics:
        live = skipped  # the *_live metrics stay absent, also when the pass ran
    ref = [None] * num_real
    if plan.reference:
        ref = [
            lp
            for lp, _ in trainer._no_grad_log_probs(
                forwards, replay=plan.reference_replays, reference=True
            )
        ][:num_real]
    return PassResults(live=live, trained_routing=trained, old_log_probs=old, ref_log_probs=ref)
