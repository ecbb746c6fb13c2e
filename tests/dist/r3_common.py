"""Helpers of the R3 torchrun scripts: parallel state per case, tiny models, full-weight loading
into sharded models, packed data with random routes, and sum-semantics gradient reduction.

The reference of every case is the same model at TP = EP = PP = 1, run on every rank over all
micro-batches. Its parameters, named canonically (global layer index, global expert index), are
the full weights every parallel layout loads its shard of; its gradients, cut the same way, are
what each rank's reduced gradient must equal.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from megatron_sat.checkpoint.tiny_models import TINY_CONFIGS
from megatron_sat.rollout.types import Sample

# The tiny Qwen3-MoE of the checkpoint tests, with 4 layers and 8 experts (PP2 x EP2 divide
# them) and room for the packed rows.
HF_CONFIG = dict(
    TINY_CONFIGS["Qwen3MoeForCausalLM"],
    architectures=["Qwen3MoeForCausalLM"],
    num_hidden_layers=4,
    num_experts=8,
    max_position_embeddings=128,
)


def set_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, seed=1234):
    """(Re)initialise megatron-core's parallel state on the running 2-rank gloo world
    (``etp`` None: megatron-core's default, the TP size)."""
    from megatron.core import parallel_state

    from megatron_sat.config import ParallelConfig
    from megatron_sat.platform.distributed import init_distributed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_distributed(ParallelConfig(tp, pp, ep, tp if etp is None else etp), seed=seed)


def build(hf_config, *, tp=1, pp=1, ep=1, etp=None, dispatcher="alltoall", recompute=None):
    """This rank's model stage (a GPTModel) for the current parallel state."""
    from megatron.core import parallel_state

    from megatron_sat.models import build_gpt_model, transformer_config_from_hf

    config = transformer_config_from_hf(
        hf_config,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        moe_token_dispatcher_type=dispatcher,
        recompute_granularity=recompute,
        calculate_per_token_loss=True,
    )
    torch.manual_seed(1234)
    return build_gpt_model(
        hf_config,
        config,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        use_transformer_engine=False,
    )


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> name with global layer and expert indices."""
    from megatron.core import parallel_state

    layer_number = {i: int(layer.layer_number) for i, layer in enumerate(model.decoder.layers)}
    num_local = (
        model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    )
    expert_offset = parallel_state.get_expert_model_parallel_rank() * num_local
    out = {}
    for name, _ in model.named_parameters():
        canon = _LAYER.sub(lambda m: f"decoder.layers.{layer_number[int(m[1])] - 1}.", name, 1)
        canon = _EXPERT.sub(lambda m: f"local_experts.{int(m[1]) + expert_offset}.", canon, 1)
        out[name] = canon
    return out


def is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)


def shard_of(full: torch.Tensor, param) -> torch.Tensor:
    """The part of ``full`` that ``param`` holds on this rank (TP / expert-TP split, with
    megatron-core's stride: rank r holds chunks r, r + world, ... of size per_partition /
    stride, as ``_initialize_affine_weight_cpu`` cuts them)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return full
    if is_expert(param):
        rank, world = (
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
        )
    else:
        rank, world = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    dim, stride = param.partition_dim, param.partition_stride
    chunk = full.shape[dim] // (world * stride)
    pieces = torch.split(full, chunk, dim=dim)
    return torch.cat(pieces[rank::world], dim=dim)


def full_params(model) -> dict[str, torch.Tensor]:
    """Canonical name -> parameter copy of a TP = EP = PP = 1 model."""
    names = canonical_names(model)
    return {names[n]: p.detach().clone() for n, p in model.named_parameters()}


def load_full(model, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shard of every canonical tensor into ``model``."""
    names = canonical_names(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            src = shard_of(full[names[name]], param)
            if src.shape != param.shape:
                raise ValueError(f"{name}: shard {tuple(src.shape)} != param {tuple(param.shape)}")
            param.copy_(src)


def reduced_grads(model) -> dict[str, torch.Tensor]:
    """Canonical name -> this rank's gradient with every partial sum completed: sequence-
    parallel params (norms, router, q/k norms) over TP, then data parallel (non-expert params
    over DP, expert params over expert-DP). Sum semantics, like the reference's one rank."""
    from megatron.core import parallel_state as ps

    names = canonical_names(model)
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
        sp_partial = getattr(param, "sequence_parallel", False) or (
            "q_layernorm" in name or "k_layernorm" in name
        )
        if sp_partial and ps.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
        group = (
            ps.get_expert_data_parallel_group()
            if is_expert(param)
            else ps.get_data_parallel_group()
        )
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(grad, group=group)
        out[names[name]] = grad
    return out


def make_samples(lengths, hf_config, seed=0) -> list[Sample]:
    """Samples of the given (prompt, response) lengths, random tokens, and random routes with
    distinct experts per token (so replay, not live routing, decides every expert)."""
    gen = torch.Generator().manual_seed(seed)
    num_layers = hf_config["num_hidden_layers"]
    num_experts, top_k = hf_config["num_experts"], hf_config["num_experts_per_tok"]
    samples = []
    for i, (p, r) in enumerate(lengths):
        n = p + r
        ids = torch.randint(3, hf_config["vocab_size"], (n,), generator=gen).tolist()
        routes = torch.rand(n - 1, num_layers, num_experts, generator=gen).argsort(-1)[..., :top_k]
        samples.append(
            Sample(
                index=i,
                group_index=i,
                prompt="",
                label="",
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                rollout_log_probs=[0.0] * r,
                response_versions=[0] * r,
                routed_experts=routes.numpy().astype(np.uint8),
            )
        )
    return samples


def nll_loss(num_tokens: float):
    """loss_fn for ``forward_backward``: advantage-weighted NLL over response tokens divided by
    the batch-global token count (so micro-batch and DP shares add up to the full loss)."""

    def loss_fn(log_probs, batch, index):
        view = batch.samples
        weighted = log_probs * view.loss_mask * view.advantages[:, None]
        return -weighted.sum() / num_tokens, {}

    return loss_fn


def max_rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max |got - ref| / max |ref| over tensors (the worst one named)."""
    worst, where = 0.0, ""
    for name, g in got.items():
        r = ref[name]
        err = float((g - r).abs().max() / r.abs().max().clamp(min=1e-12))
        if err > worst:
            worst, where = err, name
    return worst, where
