"""Builders of the policy trainer's parts: megatron-core config, model, DDP wrapper, optimizer.

``PolicyTrainer.__init__`` only wires them together, in this order: the transformer config,
the model (seeded, routers in fp32, loaded), the reference copy, the DDP wrapper, the
optimizer. Each builder assumes megatron-core's parallel state is initialised.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_sat.checkpoint.hf_io import load_hf_into_model
from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.models import build_gpt_model, transformer_config_from_hf
from megatron_sat.models.registry import keep_router_fp32
from megatron_sat.platform import PARAMS_DTYPES
from megatron_sat.platform.distrib_optimizer_fix import realign_param_group_index_map
from megatron_sat.training.optimizer_layout import OptimizerLayout


def build_transformer_config(
    hf_config: dict, train: TrainConfig, parallel: ParallelConfig, layout: OptimizerLayout
):
    """megatron-core's ``TransformerConfig`` of the policy: the HF model, the parallel sizes,
    routing replay on, the layout's parameter dtype and the recompute settings.

    Under pipeline parallelism also ``calculate_per_token_loss`` and ``variable_seq_lengths``:
    the contract of megatron-core's schedule (``training.pipeline``). With
    ``calculate_per_token_loss`` the DDP wrapper sums gradients over data-parallel ranks
    instead of averaging them, so the loss scale is 1 there (``PolicyTrainer._loss_scale``).
    """
    from megatron.core import parallel_state

    config = transformer_config_from_hf(
        hf_config,
        **parallel.sizes(),
        moe_enable_routing_replay=True,
        params_dtype=PARAMS_DTYPES[layout.params_dtype],
        recompute_granularity=(
            None if train.recompute_granularity == "none" else train.recompute_granularity
        ),
        recompute_num_layers=train.recompute_num_layers,
    )
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        config.calculate_per_token_loss = True
        config.variable_seq_lengths = True
    return config


def build_model(
    hf_config: dict,
    config,
    *,
    seed: int,
    device: torch.device,
    load_from: str | Path | None,
) -> torch.nn.Module:
    """This rank's stage of the policy (megatron-core ``GPTModel``, not yet DDP-wrapped) on
    ``device``, its routers in fp32, with ``load_from``'s weights (an HF checkpoint directory,
    each rank its shards) or megatron-core's random initialisation (seeded by ``seed``)."""
    from megatron.core import parallel_state

    # On the CPU megatron-core initialises on the host (use_cpu_initialization) from
    # torch's default generator, which model_parallel_cuda_manual_seed leaves alone: seed
    # it, as Megatron's _set_random_seed does, or every run starts from other random
    # weights (on CUDA the CUDA RNG tracker seeded by init_distributed draws them).
    # Full matrices are drawn before the TP split, so TP layouts get the single-rank
    # weights; each EP rank draws only its local experts, so it gets its own seed (else
    # experts e and e + E/EP would start equal). Dense weights are then made equal across
    # data-parallel ranks by the DDP broadcast (build_ddp).
    torch.manual_seed(seed + 1000 * parallel_state.get_expert_model_parallel_rank())
    model = build_gpt_model(
        hf_config,
        config,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    # Routers (weight, expert_bias, token counts) in float32 also in a bf16 model; before
    # the load (which copies into the parameters' dtype) and before DDP buckets by dtype.
    keep_router_fp32(model)
    model.to(device)  # dtypes kept; a no-op where megatron-core built it already
    if load_from is not None:
        load_hf_into_model(model, load_from)
    return model


def build_ddp(config, model: torch.nn.Module, layout: OptimizerLayout):
    """megatron-core's ``DistributedDataParallel`` around ``model``, with fp32 main gradients;
    the dense weights broadcast from data-parallel rank 0 when the DP size is > 1.

    average_in_collective=False (megatron-core's default) pre-scales dense AND expert
    gradients by 1 / (dense DP size) before summing them over their own DP groups
    (expert_gradient_scaling_factor in distributed_data_parallel.py). Expert weights
    already receive the gradient of every DP rank's tokens through the all-to-all, so
    with losses multiplied by dp_loss_scale (= dense DP size) both kinds of weights get
    the gradient of the global loss.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,  # fp32 main gradients, also for bf16 parameters
            use_distributed_optimizer=layout.use_distributed_optimizer,
            average_in_collective=False,
        ),
        model,
    )
    if parallel_state.get_data_parallel_world_size() > 1:
        ddp.broadcast_params()
    return ddp


def build_optimizer(ddp_model, train: TrainConfig, layout: OptimizerLayout):
    """megatron-core's Adam for ``ddp_model`` (constant ``train.lr``; weight decay, betas and
    gradient clipping from ``train``; precision, sharding and offload from ``layout``)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    moments_dtype = torch.bfloat16 if layout.use_precision_aware_optimizer else torch.float32
    optimizer = get_megatron_optimizer(
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
            bf16=layout.params_dtype == "bf16",
            fp16=False,
            params_dtype=PARAMS_DTYPES[layout.params_dtype],
            use_distributed_optimizer=layout.use_distributed_optimizer,
            optimizer_cpu_offload=layout.optimizer_cpu_offload,
            optimizer_offload_fraction=1.0 if layout.optimizer_cpu_offload else 0.0,
            use_precision_aware_optimizer=layout.use_precision_aware_optimizer,
            exp_avg_dtype=moments_dtype,
            exp_avg_sq_dtype=moments_dtype,
        ),
        [ddp_model],
    )
    realign_param_group_index_map(optimizer)  # bf16 + fp32 routers in one group
    return optimizer
