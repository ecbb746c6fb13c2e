"""The training pass of a step: forward and backward of every micro-batch, then the optimizer.

Shared by the RL and SFT steps, which differ only in the loss of a micro-batch (``LossFn``).
Each loss is the micro-batch's share of the global loss, multiplied by the trainer's loss
scale before ``backward`` so that the reduced gradients are those of the global loss
(``PolicyTrainer._loss_scale``). Fillers (micro-batches after the real ones, see
``training.step_batch.with_fillers``) run a forward and a zero backward only, which keeps the
token dispatcher's all-to-alls in step over an expert group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from megatron_sat.routing.replay import capture_routing
from megatron_sat.training.batching import MicroBatch
from megatron_sat.training.logprobs import (
    forward_log_probs,
    forward_log_probs_and_entropy,
    model_log_probs,
)
from megatron_sat.training.loss_reduction import MetricAccumulator
from megatron_sat.training.passes import (
    LazyRoutes,
    layout_of,
    replayed,
    stack_counts,
    stage_replay,
)
from megatron_sat.training.pipeline import run_pipeline_schedule
from megatron_sat.training.routing_metrics import topk_agreement, topk_agreements, topk_counts
from megatron_sat.training.staging import staged

if TYPE_CHECKING:
    from megatron_sat.training.trainer import PolicyTrainer

# (index of a real micro-batch, that micro-batch staged on the device, log-probs [N, S],
# entropy [N, S] or None) -> (its share of the global loss, its metrics as device tensors)
LossFn = Callable[[int, MicroBatch, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict]]


def train_pass(
    trainer: PolicyTrainer,
    forwards: list[MicroBatch],
    num_real: int,
    loss_of: LossFn,
    acc: MetricAccumulator,
    scale: float,
    *,
    replay: bool,
    entropy: bool,
) -> None:
    """Forward and backward of ``forwards`` with fresh gradients, each real micro-batch's
    metrics plus ``loss`` (its share of the global loss) and, with ``replay``,
    ``topk_match_r3`` added to ``acc``; then the gradients are completed
    (``trainer._finish_grads``, a collective). No optimizer step.

    Args:
        trainer: the policy trainer (model, optimizer, routing replay, layout).
        forwards: the micro-batches, the fillers after the first ``num_real``.
        num_real: how many of ``forwards`` are real.
        loss_of: the loss of a real micro-batch (``LossFn``).
        acc: the step's metric accumulator.
        scale: factor on each loss before backward (``PolicyTrainer._loss_scale``).
        replay: replay the rollout routes (R3) in every forward.
        entropy: the forward also gives the policy's entropy for ``loss_of``.
    """
    trainer.model.train()
    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    if trainer.pp_size > 1:  # megatron-core's schedule runs every forward and backward
        for mb_metrics in pipelined_train(
            trainer, forwards, num_real, loss_of, scale, replay=replay, entropy=entropy
        ):
            acc.add(mb_metrics)
    for i, host_mb in enumerate(forwards if trainer.pp_size == 1 else []):
        # staged just before its forward, dropped after its backward
        with staged(host_mb, trainer.device) as mb:
            mb_metrics = _forward_backward(
                trainer, mb, i, num_real, loss_of, scale, replay, entropy
            )
        if mb_metrics is not None:
            acc.add(mb_metrics)
    trainer._finish_grads()


def _forward_backward(
    trainer: PolicyTrainer,
    mb: MicroBatch,
    i: int,
    num_real: int,
    loss_of: LossFn,
    scale: float,
    replay: bool,
    entropy: bool,
) -> dict | None:
    """Forward and backward of staged micro-batch ``i`` (single pipeline stage); its metrics
    plus ``loss`` and, with ``replay``, ``topk_match_r3`` (None for a filler)."""
    ctx = replayed(trainer, mb, training=True) if replay else contextlib.nullcontext()
    with ctx, capture_routing(trainer.model) as used:
        ent = None
        if entropy:
            log_probs, ent = forward_log_probs_and_entropy(trainer.model, mb, trainer.sampling_mask)
        else:
            log_probs = forward_log_probs(trainer.model, mb, trainer.sampling_mask)
        if i >= num_real:  # filler: keeps the all-to-alls of the backward in step
            (log_probs.sum() * 0.0).backward()
            return None
        loss, mb_metrics = loss_of(i, mb, log_probs, ent)
        (loss * scale).backward()
    mb_metrics["loss"] = loss.detach()  # this micro-batch's share of the global loss
    if replay:
        mb_metrics["topk_match_r3"] = topk_agreement(used, mb, layout_of(trainer))
    return mb_metrics


def pipelined_train(
    trainer: PolicyTrainer,
    forwards: list[MicroBatch],
    num_real: int,
    loss_of: LossFn,
    scale: float,
    *,
    replay: bool,
    entropy: bool,
) -> list[dict]:
    """Forward and backward of ``forwards`` through megatron-core's pipeline schedule
    (1F1B), with R3 replay of each stage's layers when ``replay``.

    Args:
        trainer, forwards, num_real, loss_of, scale, entropy: as ``train_pass``; ``loss_of``
            runs on the last stage.
        replay: replay the rollout routes (R3); also adds ``topk_match_r3`` (a collective
            over the TP and pipeline groups after the schedule).

    Returns:
        On the last stage, per real micro-batch its metrics plus ``loss`` (its share of
        the global loss); on the other stages an empty list.
    """
    layout = layout_of(trainer)
    counts: dict[int, torch.Tensor] = {}
    metrics: dict[int, dict] = {}
    routes = LazyRoutes(trainer, len(forwards))

    def forward(chunk, host_mb, i):
        # Staged just before its forward; the loss closure holds it until the loss ran (the
        # backward keeps what it needs through autograd).
        with staged(host_mb, trainer.device) as mb:
            routes.put(i, mb)
            ctx = trainer.routing.micro_batch(i) if replay else contextlib.nullcontext()
            ent = None
            with ctx, capture_routing(chunk) as used:
                if trainer.is_last_stage and entropy:
                    output, ent = forward_log_probs_and_entropy(chunk, mb, trainer.sampling_mask)
                elif trainer.is_last_stage:
                    output = forward_log_probs(chunk, mb, trainer.sampling_mask)
                else:
                    output = model_log_probs(chunk, mb)  # the stage's hidden states
            counts[i] = topk_counts(used, mb, layout)

        def loss_fn(log_probs):
            if i >= num_real:  # filler: keeps the all-to-alls of the backward in step
                return log_probs.sum() * 0.0
            loss, mb_metrics = loss_of(i, mb, log_probs, ent)
            metrics[i] = dict(mb_metrics, loss=loss.detach())
            return loss * scale

        return output, loss_fn

    with stage_replay(trainer, routes, training=True) if replay else contextlib.nullcontext():
        if forwards:  # a data-parallel rank without samples (and no EP peers to follow)
            run_pipeline_schedule(trainer.model, forwards, forward, forward_only=False)
    if replay:
        agreements = topk_agreements(stack_counts(counts, len(forwards), trainer.device), layout)
        for i in range(min(num_real, len(forwards))):
            if i in metrics:
                metrics[i]["topk_match_r3"] = agreements[i]
    return [metrics[i] for i in range(num_real)] if trainer.is_last_stage else []
