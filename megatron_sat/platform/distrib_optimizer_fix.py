"""Fixes of megatron-core 0.19's DistributedOptimizer: parameter groups that mix dtypes, a
fresh optimizer's state dict, and Adam steps shared by every parameter after a load.

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

import math

import torch


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


def restore_adam_steps(optimizer, state_dict) -> int:
    """After ``optimizer.load_state_dict(state_dict)``, give every parameter of every
    DistributedOptimizer inside ``optimizer`` its own Adam ``step`` tensor holding the step of
    the checkpoint; returns how many parameters were corrected.

    Without apex or transformer-engine (torch's AdamW, as on CPU) megatron-core 0.19's
    ``DistributedOptimizer.load_state_dict`` breaks the step twice: it sets ``state["step"]``
    of every parameter to ONE shared ``torch.tensor(step)`` from the parameter groups, and the
    ``dp_reshardable`` parameter-state load then ``copy_``s into it the step of the template
    it was given (our ``init_states_for_loading``: 1), not the checkpoint's. A resumed run
    therefore restarted Adam's bias correction at step 1, and torch's AdamW, incrementing each
    parameter's step in place, gave parameter i step 2 + i (weights off by up to 0.4 x lr
    after one step at DP2; ``tests/test_checkpoint_parallel.py``). With apex's or TE's fused
    Adam the step lives in the parameter groups, no state holds a step tensor, and nothing
    changes.

    Args:
        optimizer: the megatron-core optimizer (or ChainedOptimizer) just loaded.
        state_dict: what it was loaded from (one optimizer's dict, or the chain's list or
            index-keyed dict of them).

    Raises:
        ValueError: when a checkpoint's parameter groups disagree on the step, a step is
            not a finite number >= 0 (a NaN step would turn Adam's bias correction NaN), or
            a chain's state holds another number of optimizers than the chain.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(optimizers) == 1:
        states = [state_dict]
    elif isinstance(state_dict, dict):
        states = [v for _, v in sorted(state_dict.items())]
    else:
        states = list(state_dict)
    if len(states) != len(optimizers):
        raise ValueError(
            f"optimizer state of {len(states)} optimizers for a chain of {len(optimizers)}: "
            "the checkpoint was saved by another optimizer layout"
        )
    corrected = 0
    for opt, state in zip(optimizers, states, strict=True):
        if not isinstance(opt, DistributedOptimizer):
            continue
        groups = state["optimizer"]["param_groups"]
        raw = [g["step"] for g in groups if g.get("step") is not None]
        if not raw:
            continue
        bad = [v for v in raw if isinstance(v, bool) or not isinstance(v, int | float)]
        bad += [v for v in raw if not bad and not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"checkpoint's optimizer step must be a finite number >= 0: {bad}")
        steps = {float(v) for v in raw}
        if len(steps) != 1:
            raise ValueError(f"checkpoint's optimizer parameter groups disagree on step: {steps}")
        (step,) = steps
        for param_state in opt.optimizer.state.values():
            old = param_state.get("step")
            if torch.is_tensor(old):
                param_state["step"] = torch.tensor(step, dtype=old.dtype, device=old.device)
                corrected += 1
    return corrected
