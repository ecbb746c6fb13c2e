"""R3 replay control: install rollout routes into megatron-core's routers for one pass.

Routers are found by walking the live model (never megatron-core's process-global
``RouterReplay.global_router_replay_instances``, which keeps instances of every model ever
built) and keyed by their global 1-based ``layer_number``, so a pipeline stage only touches its
own layers. Source: Ma et al., "Stabilizing MoE RL by Aligning Training and Inference Routers"
(R3), arXiv 2510.11370; megatron-core ``transformer/moe/router_replay.py``.

With ``moe_router_pre_softmax=False`` megatron-core's replay gathers the trainer's own router
logits at the replayed experts and takes their softmax, so the gate weights (and the router's
gradient) come from the trainer while the expert choice comes from the rollout engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch


def find_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Map global 1-based layer number -> the MoE router (``TopKRouter``) of that layer.

    Raises:
        ValueError: if two routers claim one layer number.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    routers: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        if isinstance(module, TopKRouter):
            layer = int(module.layer_number)
            if layer in routers:
                raise ValueError(f"two routers claim layer_number {layer}")
            routers[layer] = module
    return routers


def _check_target(layer: int, target: torch.Tensor, router: torch.nn.Module) -> None:
    num_experts, top_k = router.config.num_moe_experts, router.topk
    if target.dim() != 2 or target.shape[1] != top_k:
        raise ValueError(
            f"routing replay target for layer {layer} has shape {tuple(target.shape)}; "
            f"expected [num_tokens, top_k={top_k}]"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"routing replay target for layer {layer} has dtype {target.dtype}")
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= num_experts):
        raise ValueError(
            f"routing replay target for layer {layer} holds expert ids outside [0, {num_experts})"
        )


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, targets: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Replay ``targets`` in every MoE router of ``model`` for the forward (and backward) inside.

    Args:
        model: The live megatron-core model (DDP-wrapped or not) on this rank.
        targets: Global layer number -> expert ids, int64 [num_tokens, top_k], rows in
            megatron-core's token order for the router's input: sequence-major, i.e. row
            ``s * batch + b`` for a [batch, seq] micro-batch (under SP, this rank's shard).

    Raises:
        ValueError: if a router of the model has no target (never a silent fall-back to live
            routing), a target names a layer the model does not hold, a router lacks a
            ``RouterReplay`` (build with ``moe_enable_routing_replay``) or uses the fused
            router (whose path skips replay), or a target has the wrong shape or ids.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = find_routers(model)
    missing = sorted(set(routers) - set(targets))
    extra = sorted(set(targets) - set(routers))
    if missing or extra:
        raise ValueError(
            f"routing replay targets do not match the model's MoE layers: missing {missing}, "
            f"not in this model (or pipeline stage) {extra}"
        )
    for layer, router in routers.items():
        if router.router_replay is None:
            raise ValueError(
                f"router of layer {layer} has no RouterReplay: set moe_enable_routing_replay=True"
            )
        if router.config.moe_router_fusion:
            raise ValueError("moe_router_fusion=True skips routing replay; turn it off for R3")
        _check_target(layer, targets[layer], router)
    try:
        for layer, router in routers.items():
            replay = router.router_replay
            replay.clear_indices()
            replay.set_target_indices(targets[layer].long())
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield
    finally:
        for router in routers.values():
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


@contextlib.contextmanager
def capture_routing(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Collect the experts each router actually used, whatever the replay mode.

    Yields a dict filled during the block: global layer number -> bool routing map
    [num_tokens, num_experts] of the last forward through that router (detached). Used to
    verify replay and to measure how often the trainer's own top-k agrees with the rollout's.
    """
    routers = find_routers(model)
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for layer, router in routers.items():

        def hook(module, args, output, layer=layer):
            captured[layer] = output[1].detach()

        handles.append(router.register_forward_hook(hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
