"""A fix of megatron-core 0.19's DistributedOptimizer for parameter groups that mix dtypes.

``DistributedOptimizer._build_optimizer_group_ranges`` numbers each parameter of a group in the
order of the gradient buffers (``model_param_group_index_map[param] = (group, order)``), but
``_build_model_and_main_param_groups`` then hands torch's optimizer the group as
``[fp32 params..., fp32 main copies of the bf16 params...]``. With both kinds in one group (a
bf16 model whose routers are float32: ``models.registry.keep_router_fp32``) the numbers point
at other parameters, and every lookup through the map (the checkpoint's
``_get_main_param_and_optimizer_states`` / ``_set_main_param_and_optimizer_states``, the
state-dict ordering) takes another parameter's main weights and Adam moments: saving a run
checkpoint failed with "(torch.Size([256]), 0, 2048)" (a router's 256 values for a 2048-value
embedding range). The optimizer step itself walks the groups directly and was right.
"""

from __future__ import annotations


def realign_param_group_index_map(optimizer) -> int:
    """Renumber ``model_param_group_index_map`` of every DistributedOptimizer inside
    ``optimizer`` (a megatron-core optimizer or ChainedOptimizer) in the order its torch
    optimizer's groups hold the parameters (float32 ones first, then the bf16/fp16 ones).

    Returns the number of entries whose numbering changed (0 when a group has one dtype only).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    changed = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for group_index, (fp32, half) in enumerate(
            zip(opt.model_fp32_groups, opt.model_float16_groups, strict=True)
        ):
            for order, param in enumerate([*fp32, *half]):
                if opt.model_param_group_index_map.get(param) != (group_index, order):
                    opt.model_param_group_index_map[param] = (group_index, order)
                    changed += 1
    return changed


def init_states_for_loading(optimizer) -> None:
    """Give every DistributedOptimizer inside ``optimizer`` that has not stepped yet its Adam
    states (megatron-core's ``_init_optimizer_states_with_dummy_values``: one step on zero
    gradients), so its state dict can describe what a checkpoint load fills in.

    megatron-core 0.19's ``DistributedOptimizer.state_dict`` (used by the ``dp_reshardable``
    checkpoint format) asserts one Adam ``step`` over the states and fails on a fresh
    optimizer. The dummy values are all overwritten by the load; with zero gradients and
    megatron's weight decay 0 the dummy step changes no main parameter either.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
