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
from megatron_sat.objectives import ObjectiveConfig, policy_loss
from megatron_sat.rollout.types import Sample
from megatron_sat.routing.replay import capture_routing, replay_routing
from megatron_sat.training.batching import MicroBatch, build_micro_batch
from megatron_sat.training.distributed import ParallelConfig, init_distributed
from megatron_sat.training.logprobs import forward_log_probs, routing_agreement


class PolicyTrainer:
    """A megatron-core Qwen3-MoE policy with its DDP wrapper and Megatron optimizer.

    Args:
        hf_config: The model's HF ``config.json`` (Qwen3-MoE).
        load_from: HF checkpoint directory whose weights are loaded, or None to keep
            megatron-core's random initialisation (seeded by ``train.seed``).
        train: optimisation settings (lr, Adam, clipping, micro-batch size, R3 on/off).
        parallel: Megatron parallel layout (this version trains at TP = EP = PP = 1 with any
            number of data-parallel ranks being future work; see ``__init__``).
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
        self, samples: Sequence[Sample], advantages: torch.Tensor, objective: ObjectiveConfig
    ) -> dict[str, float]:
        """One optimizer step of the policy objective on ``samples``.

        The ratio's denominator is each token's ``rollout_log_probs`` (ALGORITHMS.md). Loss
        denominators (tokens, sequences) and SAT's quantile are over the whole batch, not per
        micro-batch. With ``train.use_r3`` every forward replays the rollout engine's experts.

        Returns:
            Metrics averaged over the batch (token-weighted), plus ``grad_norm``, routing
            agreement with and without replay (``topk_match_r3`` / ``topk_match_live``) and the
            train-rollout mismatch without replay (``mismatch_abs_logratio_live``).
        """
        use_r3 = self.train_config.use_r3
        mbs = self.micro_batches(samples, advantages, with_routes=True)
        num_tokens = float(sum(mb.loss_mask.sum() for mb in mbs))
        num_seqs = float(sum(int((mb.loss_mask.sum(1) > 0).sum()) for mb in mbs))
        if num_tokens == 0:
            raise ValueError("batch has no response tokens to train on")
        metrics: dict[str, float] = {}
        total_loss = 0.0
        live = self._live_routing_diagnostics(mbs)
        quantile = self._batch_sat_quantile(mbs, objective) if len(mbs) > 1 else None

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        for mb in mbs:
            replay = (
                replay_routing(self.model, mb.routing_targets())
                if use_r3
                else (contextlib.nullcontext())
            )
            with replay, capture_routing(self.model) as used:
                log_probs = forward_log_probs(self.model, mb)
                loss, mb_metrics = policy_loss(
                    log_probs,
                    mb.rollout_log_probs,
                    mb.advantages,
                    mb.loss_mask,
                    objective,
                    global_num_tokens=num_tokens,
                    global_num_seqs=num_seqs,
                    sat_quantile=quantile,
                )
                loss.backward()
            weight = float(mb.loss_mask.sum()) / num_tokens
            total_loss += float(loss.detach())  # already divided by the batch's global denominator
            mb_metrics["topk_match_r3" if use_r3 else "topk_match_live"] = routing_agreement(
                used, mb
            )["topk_match"]
            for key, value in mb_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + weight * float(value)
        self.model.finish_grad_sync()
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError("optimizer step was skipped (non-finite gradients)")
        metrics.update(live, loss=total_loss, grad_norm=float(grad_norm), num_tokens=num_tokens)
        return metrics

    @torch.no_grad()
    def _live_routing_diagnostics(self, mbs: list[MicroBatch]) -> dict[str, float]:
        """Without replay: how often the trainer's own top-k equals the rollout's, and the
        train-rollout log-prob mismatch (mean |log pi - log mu| over response tokens)."""
        self.model.eval()
        match, mismatch, total = 0.0, 0.0, 0.0
        for mb in mbs:
            with capture_routing(self.model) as used:
                log_probs = forward_log_probs(self.model, mb)
            tokens = float(mb.loss_mask.sum())
            match += tokens * float(routing_agreement(used, mb)["topk_match"])
            diff = (log_probs - mb.rollout_log_probs).abs() * mb.loss_mask
            mismatch += float(diff.sum())
            total += tokens
        return {"topk_match_live": match / total, "mismatch_abs_logratio_live": mismatch / total}

    @torch.no_grad()
    def _batch_sat_quantile(
        self, mbs: list[MicroBatch], objective: ObjectiveConfig
    ) -> float | None:
        """SAT's q over the whole batch (all micro-batches), from a no-grad forward with the
        same routing as the training forward; None for objectives without SAT."""
        from megatron_sat.objectives import (
            SAT_STALENESS,
            sat_abs_staleness,
            sat_reference_quantile,
        )

        if objective.name not in SAT_STALENESS:
            return None
        self.model.eval()
        abs_d = []
        for mb in mbs:
            replay = (
                replay_routing(self.model, mb.routing_targets())
                if (self.train_config.use_r3)
                else contextlib.nullcontext()
            )
            with replay:
                log_probs = forward_log_probs(self.model, mb)
            abs_d.append(
                sat_abs_staleness(log_probs, mb.rollout_log_probs, mb.loss_mask, objective)
            )
        return float(sat_reference_quantile(torch.cat(abs_d), objective.sat_alpha))

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One supervised step: mean negative log-likelihood of the response tokens (live
        routing). Returns ``{"loss", "grad_norm"}``."""
        mbs = self.micro_batches(samples, torch.zeros(len(samples)), with_routes=False)
        num_tokens = float(sum(mb.loss_mask.sum() for mb in mbs))
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        total = 0.0
        for mb in mbs:
            log_probs = forward_log_probs(self.model, mb)
            loss = -(log_probs * mb.loss_mask).sum() / num_tokens
            loss.backward()
            total += float(loss.detach())
        self.model.finish_grad_sync()
        _, grad_norm, _ = self.optimizer.step()
        return {"loss": total, "grad_norm": float(grad_norm)}

    # -- weights -------------------------------------------------------------------------
    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full model as ``(hf_name, tensor)`` pairs (training dtype), for weight sync."""
        return export_hf_tensors(self.model, self.hf_config)

    def save_hf(self, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
        """Write the model as an HF checkpoint (overwriting ``out_dir``'s model files)."""
        return save_model_as_hf(
            self.model, self.hf_config, out_dir, tokenizer_dir=tokenizer_dir, overwrite=True
        )
