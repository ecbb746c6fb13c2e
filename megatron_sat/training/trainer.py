"""The policy trainer: megatron-core model, DDP and optimizer; one RL or SFT step at a time."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from megatron_sat.checkpoint.hf_io import (
    export_hf_tensors,
    load_hf_into_model,
    save_model_as_hf,
)
from megatron_sat.config import TrainConfig
from megatron_sat.models import build_gpt_model, transformer_config_from_hf
from megatron_sat.objectives import (
    SAT_STALENESS,
    ObjectiveConfig,
    policy_loss,
    sat_abs_staleness,
)
from megatron_sat.rollout.types import Sample, staleness
from megatron_sat.routing.replay import capture_routing, replay_routing
from megatron_sat.training.batching import MicroBatch, build_micro_batch
from megatron_sat.training.distributed import ParallelConfig, init_distributed
from megatron_sat.training.logprobs import forward_log_probs, routing_agreement
from megatron_sat.training.loss_reduction import (
    MetricAccumulator,
    dp_loss_scale,
    global_loss_denominators,
    global_max,
    global_sat_quantile,
    group_size,
)


def ages_tensor(ages: Sequence[int | None], index: int, size: int) -> torch.Tensor | None:
    """[B] int64 version ages of micro-batch ``index`` (rows ``index * size`` onwards), -1 for
    a row without an age; None when no sample has an age."""
    rows = ages[index * size : (index + 1) * size]
    if all(a is None for a in rows):
        return None
    return torch.tensor([-1 if a is None else a for a in rows], dtype=torch.int64)


class PolicyTrainer:
    """A megatron-core Qwen3-MoE policy with its DDP wrapper and Megatron optimizer.

    Args:
        hf_config: The model's HF ``config.json`` (Qwen3-MoE).
        load_from: HF checkpoint directory whose weights are loaded, or None to keep
            megatron-core's random initialisation (seeded by ``train.seed``).
        train: optimisation settings (lr, Adam, clipping, micro-batch size, R3 on/off).
        parallel: Megatron parallel layout: TP = EP = PP = 1 and any number of data-parallel
            ranks (the world size under torchrun). Every DP rank holds the full weights, made
            identical at construction by a broadcast from DP rank 0.
        pad_token_id: token id used for padding.

    Raises:
        ValueError: for a parallel layout other than TP = EP = PP = 1 (the weight export of
            sharded models is not wired yet).
    """

    def __init__(
        self,
        hf_config: dict,
        train: TrainConfig,
        parallel: ParallelConfig,
        *,
        pad_token_id: int,
        load_from: str | Path | None,
    ) -> None:
        if (
            parallel.tensor_model_parallel_size,
            parallel.expert_model_parallel_size,
            parallel.pipeline_model_parallel_size,
        ) != (1, 1, 1):
            raise ValueError("parallel: the trainer currently supports TP = EP = PP = 1 only")
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        init_distributed(parallel, seed=train.seed)
        self.train_config = train
        self.pad_token_id = pad_token_id
        self.hf_config = hf_config
        self.config = transformer_config_from_hf(self.hf_config, moe_enable_routing_replay=True)
        model = build_gpt_model(self.hf_config, self.config)
        if load_from is not None:
            load_hf_into_model(model, load_from)
        self.model = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=False
            ),
            model,
        )
        from megatron.core import parallel_state

        if parallel_state.get_data_parallel_world_size() > 1:
            self.model.broadcast_params()
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=train.lr,
                min_lr=train.lr,
                weight_decay=train.weight_decay,
                adam_beta1=train.adam_beta1,
                adam_beta2=train.adam_beta2,
                clip_grad=train.clip_grad,
                bf16=False,
                fp16=False,
            ),
            [self.model],
        )
        self.routing_shape = (
            self.config.num_layers,
            self.config.moe_router_topk,
            self.config.num_moe_experts,
        )

    # -- batches -------------------------------------------------------------------------
    def micro_batches(
        self, samples: Sequence[Sample], advantages: torch.Tensor, with_routes: bool
    ) -> list[MicroBatch]:
        """Split ``samples`` into micro-batches of ``train.micro_batch_size``."""
        size = self.train_config.micro_batch_size
        return [
            build_micro_batch(
                samples[i : i + size],
                advantages[i : i + size],
                pad_token_id=self.pad_token_id,
                routing_shape=self.routing_shape if with_routes else None,
            )
            for i in range(0, len(samples), size)
        ]

    # -- steps ---------------------------------------------------------------------------
    def rl_step(
        self,
        samples: Sequence[Sample],
        advantages: torch.Tensor,
        objective: ObjectiveConfig,
        *,
        trainer_version: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step of the policy objective on this rank's share of the batch.

        A collective over megatron-core's data-parallel group: every DP rank calls it once per
        step with its own samples (possibly none). The step is independent of how the global
        batch is split into micro-batches and ranks, up to fp32 rounding
        (tests/test_split_invariance.py):

        - Loss denominators (active tokens; responses with >= 1 active token) are counted over
          all micro-batches of all DP ranks (an all-reduce, ``global_loss_denominators``), so
          each micro-batch's loss is its share of the global loss. Each share is multiplied by
          the DP size before ``backward`` because megatron-core's DDP averages gradients over
          DP ranks (``dp_loss_scale``); the result is the gradient of the global loss.
        - SAT's quantile q is exact over the global batch: a no-grad forward (same routing as
          the training forward) gives |d| of every active token, which is all-gathered with
          uneven sizes and fed to ``sat_reference_quantile`` (``global_sat_quantile``). With
          one process and one micro-batch ``policy_loss`` computes the same q itself.
        - The ratio's denominator is ``objective.ratio_denominator``: the rollout engine's
          ``rollout_log_probs`` (default, SAT Eq. 1) or old log-probs recomputed here by a
          no-grad forward of the current weights before the update. The old log-probs are also
          computed for TIS / IcePop.
        - With ``train.use_r3`` every forward that trains or sets q replays the rollout engine's
          experts; one more no-grad forward with live routing gives the live diagnostics.

        Args:
            samples: this rank's samples, whole GRPO groups.
            advantages: [len(samples)] float advantages.
            objective: the policy objective.
            trainer_version: the policy version the trainer holds (optimizer steps so far, the
                weight version that a sync after this step would *not* yet carry). When given,
                metrics per version-age bucket are added (``rollout.types.staleness``), and a
                "recomputed_old" denominator is refused for samples older than 0 versions.

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
        mbs = self.micro_batches(samples, advantages, with_routes=True)
        ages = self._sample_ages(samples, trainer_version)
        num_tokens, num_seqs = global_loss_denominators([mb.loss_mask for mb in mbs], group)
        if num_tokens == 0:
            raise ValueError("the global batch has no response tokens to train on")
        recomputed = objective.ratio_denominator == "recomputed_old"
        if recomputed and trainer_version is not None:
            oldest = global_max(max((a for a in ages if a is not None), default=0), group)
            if oldest > 0:
                raise ValueError(
                    f"ObjectiveConfig.ratio_denominator='recomputed_old' divides by the current "
                    f"policy, but a sample is {oldest} version(s) old: use 'rollout'"
                )

        live = self._no_grad_log_probs(mbs, replay=False)
        needs_old = (
            recomputed or objective.tis_cap is not None or objective.icepop_range is not None
        )
        global_q = objective.name in SAT_STALENESS and (group_size(group) > 1 or len(mbs) > 1)
        trained_routing = live
        if use_r3 and (needs_old or global_q):
            trained_routing = self._no_grad_log_probs(mbs, replay=True)
        old = [lp if needs_old else None for lp, _ in trained_routing]
        quantile = None
        if global_q:
            abs_d = [
                sat_abs_staleness(
                    lp, o if recomputed else mb.rollout_log_probs, mb.loss_mask, objective
                )
                for (lp, _), o, mb in zip(trained_routing, old, mbs, strict=True)
            ]
            quantile = global_sat_quantile(abs_d, objective.sat_alpha, group)

        acc = MetricAccumulator()
        for mb, (lp, match) in zip(mbs, live, strict=True):
            n = float(mb.loss_mask.sum())
            diff = ((lp - mb.rollout_log_probs).abs() * mb.loss_mask).sum() / max(n, 1.0)
            acc.add(
                {"topk_match_live": match, "mismatch_abs_logratio_live": diff},
                {"num_active_tokens": n},
            )
        scale = dp_loss_scale(group)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        for i, mb in enumerate(mbs):
            replay = (
                replay_routing(self.model, mb.routing_targets())
                if use_r3
                else contextlib.nullcontext()
            )
            with replay, capture_routing(self.model) as used:
                log_probs = forward_log_probs(self.model, mb)
                loss, mb_metrics = policy_loss(
                    log_probs,
                    mb.rollout_log_probs,
                    mb.advantages,
                    mb.loss_mask,
                    objective,
                    old_log_probs=old[i],
                    global_num_tokens=num_tokens,
                    global_num_seqs=num_seqs,
                    sat_quantile=quantile,
                    sample_age=ages_tensor(ages, i, self.train_config.micro_batch_size),
                )
                (loss * scale).backward()
            mb_metrics["loss"] = loss.detach()  # this micro-batch's share of the global loss
            if use_r3:
                mb_metrics["topk_match_r3"] = routing_agreement(used, mb)["topk_match"]
            acc.add(mb_metrics)
        self.model.finish_grad_sync()
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError("optimizer step was skipped (non-finite gradients)")
        metrics = acc.reduce(group)
        metrics.update(num_tokens=num_tokens, num_seqs=num_seqs)
        if grad_norm is not None:  # megatron-core computes it only to clip (train.clip_grad > 0)
            metrics["grad_norm"] = float(grad_norm)
        return metrics

    @staticmethod
    def _sample_ages(samples: Sequence[Sample], trainer_version: int | None) -> list[int | None]:
        """Version age of each sample (``rollout.types.staleness``); None without a version or
        for a sample without response tokens (it has no active token either)."""
        if trainer_version is None:
            return [None] * len(samples)
        return [staleness(s, trainer_version) if s.response_ids else None for s in samples]

    @torch.no_grad()
    def _no_grad_log_probs(
        self, mbs: list[MicroBatch], replay: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per micro-batch: log-probs [B, S] of a no-grad forward with the current weights, and
        the fraction of response tokens whose top-k experts equal the rollout engine's.

        Args:
            mbs: micro-batches with routes.
            replay: replay the rollout engine's experts (R3) or route live.
        """
        self.model.eval()
        out = []
        for mb in mbs:
            ctx = (
                replay_routing(self.model, mb.routing_targets())
                if replay
                else contextlib.nullcontext()
            )
            with ctx, capture_routing(self.model) as used:
                log_probs = forward_log_probs(self.model, mb)
            out.append((log_probs, routing_agreement(used, mb)["topk_match"]))
        return out

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One supervised step: mean negative log-likelihood of the response tokens (live
        routing), over the global batch (a collective over the data-parallel group, like
        ``rl_step``). Returns ``{"loss", "grad_norm"}``, both global."""
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        mbs = self.micro_batches(samples, torch.zeros(len(samples)), with_routes=False)
        num_tokens, _ = global_loss_denominators([mb.loss_mask for mb in mbs], group)
        if num_tokens == 0:
            raise ValueError("the global batch has no response tokens to train on")
        scale = dp_loss_scale(group)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        acc = MetricAccumulator()
        for mb in mbs:
            log_probs = forward_log_probs(self.model, mb)
            loss = -(log_probs * mb.loss_mask).sum() / num_tokens
            (loss * scale).backward()
            acc.add({"loss": loss.detach()})
        self.model.finish_grad_sync()
        _, grad_norm, _ = self.optimizer.step()
        return {"loss": acc.reduce(group)["loss"], "grad_norm": float(grad_norm)}

    # -- weights -------------------------------------------------------------------------
    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full model as ``(hf_name, tensor)`` pairs (training dtype), for weight sync."""
        return export_hf_tensors(self.model, self.hf_config)

    def save_hf(self, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
        """Write the model as an HF checkpoint (overwriting ``out_dir``'s model files)."""
        return save_model_as_hf(
            self.model, self.hf_config, out_dir, tokenizer_dir=tokenizer_dir, overwrite=True
        )
