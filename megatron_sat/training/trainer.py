"""The policy trainer: megatron-core model, DDP and optimizer; one RL or SFT step at a time.

The trainer wires its parts together (``training.builders``) and runs the steps as phases:
the step batch (``training.step_batch``), the no-grad passes (``training.pass_plan``,
``training.passes``), the training pass (``training.train_pass``); ``training.policy_step``
describes the RL step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from megatron_sat.checkpoint.hf_io import export_hf_tensors, save_model_as_hf
from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.objectives import ObjectiveConfig
from megatron_sat.platform import get_device
from megatron_sat.platform.distributed import init_distributed
from megatron_sat.rollout.types import Sample
from megatron_sat.routing.replay import RoutingReplay
from megatron_sat.routing.slicing import moe_layer_numbers
from megatron_sat.training import passes, policy_step, step_batch
from megatron_sat.training.batching import MicroBatch
from megatron_sat.training.builders import (
    build_ddp,
    build_model,
    build_optimizer,
    build_transformer_config,
)
from megatron_sat.training.loss_reduction import (
    MetricAccumulator,
    dp_loss_scale,
    global_loss_denominators,
)
from megatron_sat.training.optimizer_layout import resolve_optimizer_layout
from megatron_sat.training.packing import PackedMicroBatch
from megatron_sat.training.reference import ReferencePolicy
from megatron_sat.training.sampling_mask_tp import SamplingMask
from megatron_sat.training.train_pass import train_pass


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
            ``kl_coef > 0``: this rank's shard of those weights, swapped into the model for the
            reference's no-grad forward and out again (``training.reference``): in device
            memory with ``train.reference_on_device`` (no copy per step), else, as in slime,
            in pinned host memory (three host<->device copies of the shard per step, through
            buffers allocated once).
        sampling_mask: score every log-prob (trained, old, reference) under the rollout's
            truncated sampling distribution (``rollout.replay_sampling_mask``;
            ``training.sampling_mask_tp``); None: the full softmax.

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
        sampling_mask: SamplingMask | None = None,
    ) -> None:
        from megatron.core import parallel_state

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
        self.sampling_mask = sampling_mask
        self.pad_token_id = pad_token_id
        self.hf_config = hf_config
        # One device decision (platform.get_device): the model and the log-probs live there;
        # micro-batches wait in host memory and are staged one at a time (training.staging).
        self.device = get_device()
        self.optimizer_layout = resolve_optimizer_layout(
            train,
            device_type=self.device.type,
            dp=parallel_state.get_data_parallel_world_size(with_context_parallel=True),
            edp=parallel_state.get_expert_data_parallel_world_size(),
        )
        self.config = build_transformer_config(hf_config, train, parallel, self.optimizer_layout)
        # Pipeline stages: this rank's layers, the embedding on the first stage and the output
        # layer on the last; the steps then run megatron-core's schedule (training.pipeline).
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        model = build_model(
            hf_config, self.config, seed=train.seed, device=self.device, load_from=load_from
        )
        # The k3 KL term's reference policy: the initial weights, on the device or in host
        # memory (train.reference_on_device; training.reference).
        self._reference: ReferencePolicy | None = None
        if reference:
            self._reference = ReferencePolicy(model, self.device, train.reference_on_device)
        self.model = build_ddp(self.config, model, self.optimizer_layout)
        self.optimizer = build_optimizer(self.model, train, self.optimizer_layout)
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
        """Per micro-batch, the positions in ``samples`` of its rows
        (``step_batch.micro_batch_rows`` with ``train``'s micro-batch size or token budget; a
        sample longer than the budget raises ValueError naming it)."""
        return step_batch.micro_batch_rows(samples, self.train_config, self.pad_to_multiple_of)

    def micro_batches(
        self,
        samples: Sequence[Sample],
        advantages: torch.Tensor,
        with_routes: bool,
        rows: list[list[int]] | None = None,
    ) -> list[MicroBatch | PackedMicroBatch]:
        """Split ``samples`` ([len(samples)] float ``advantages``) into micro-batches on the
        host, pinned on CUDA (``rows``, default ``micro_batch_rows``; each pass stages them on
        the device one at a time, ``training.staging``), padded or packed
        (``step_batch.build_micro_batches``), with the rollout routes when ``with_routes``.
        The losses' per-sample layout holds the samples in the order of ``rows``."""
        rows = self.micro_batch_rows(samples) if rows is None else rows
        return step_batch.build_micro_batches(
            samples,
            advantages,
            rows,
            pad_token_id=self.pad_token_id,
            routing_shape=self.routing_shape if with_routes else None,
            pad_to_multiple_of=self.pad_to_multiple_of,
            moe_layers=self.moe_layers,
            device=self.device,
        )

    def _with_fillers(self, mbs: list[MicroBatch], with_routes: bool) -> list[MicroBatch]:
        """``mbs`` followed by fillers up to the busiest rank of this rank's expert group
        (``step_batch.with_fillers``, a collective over that group)."""
        return step_batch.with_fillers(
            mbs,
            lambda: step_batch.filler_micro_batch(
                pad_token_id=self.pad_token_id,
                routing_shape=self.routing_shape,
                with_routes=with_routes,
                pad_to_multiple_of=self.pad_to_multiple_of,
                device=self.device,
            ),
        )

    def _reads_routes(self, samples: Sequence[Sample]) -> bool:
        """Whether this step reads the rollout engine's routes (``step_batch.reads_routes``
        with ``train.use_r3``; raises its ValueError)."""
        return step_batch.reads_routes(samples, self.train_config.use_r3)

    def _no_grad_log_probs(
        self, mbs: list[MicroBatch], replay: bool, reference: bool = False
    ) -> list[tuple[torch.Tensor, float | None]]:
        """Per micro-batch: no-grad log-probs [B, S] and the top-k agreement with the rollout's
        routes (``passes.no_grad_log_probs``; the steps run every pass through this method)."""
        return passes.no_grad_log_probs(self, mbs, replay, reference)

    # -- gradients and metrics -----------------------------------------------------------
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
        old_log_probs: list[torch.Tensor | None] | None = None,
    ) -> dict[str, float]:
        """One optimizer step of the policy objective on this rank's share of the batch, a
        collective over all trainer ranks, in the phases ``training.policy_step`` describes
        (with the step's split invariance and its metrics).

        Args:
            samples: this rank's samples, whole GRPO groups; advantages: [len(samples)] float.
            objective: the policy objective.
            trainer_version: the policy version the trainer holds (optimizer steps so far, the
                weight version that a sync after this step would *not* yet carry). When given,
                metrics per version-age bucket are added (``rollout.types.staleness``), and a
                "recomputed_old" denominator is refused for samples older than 0 versions.
            routing_diagnostic: run the live-routing diagnostic pass and report its ``*_live``
                metrics (absent, not zero, when False). The same on every rank.

        Returns:
            The step's global metrics, identical on every rank (listed in
            ``training.policy_step``).

        Raises:
            ValueError: what ``step_batch.prepare_step_batch`` refuses.
            RuntimeError: the optimizer skipped the step (non-finite gradients).
        """
        batch = step_batch.prepare_step_batch(self, samples, advantages, objective, trainer_version)
        plan, results = policy_step.no_grad_passes(
            self, batch, objective, routing_diagnostic, old_log_probs
        )
        quantile = None
        if self.is_last_stage:  # (log-probs exist on the last stage only)
            quantile = policy_step.sat_global_quantile(batch, objective, plan, results)
        acc = MetricAccumulator()
        policy_step.add_live_metrics(acc, batch, results.live)
        loss_of = policy_step.policy_loss_fn(batch, objective, results, quantile)
        scale = self._loss_scale(batch.group)
        entropy = objective.entropy_coef > 0
        train_pass(
            self,
            batch.forwards,
            len(batch.mbs),
            loss_of,
            acc,
            scale,
            replay=self.train_config.use_r3,
            entropy=entropy,
        )
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError("optimizer step was skipped (non-finite gradients)")
        metrics = self._from_last_stage(acc.reduce(batch.group, self.device))
        return policy_step.step_metrics(metrics, batch, grad_norm)

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
        acc = MetricAccumulator()

        def nll(i: int, mb, log_probs: torch.Tensor, _entropy: None) -> tuple[torch.Tensor, dict]:
            return -(log_probs * mb.loss_mask).sum() / num_tokens, {}

        train_pass(self, forwards, len(mbs), nll, acc, scale, replay=False, entropy=False)
        _, grad_norm, _ = self.optimizer.step()
        loss = self._from_last_stage(acc.reduce(group, self.device))["loss"]
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
