"""Tensor- and expert-parallel cases of tests/test_trainer_parallel.py, all in ONE torchrun
launch (2 gloo ranks, CPU).

    torchrun --nproc_per_node=2 tests/dist/trainer_parallel.py SPEC.pkl OUT_DIR

SPEC.pkl (written by the pytest test) holds the tiny checkpoint, the global batch (samples with
R3 routes, advantages), the objective, the trainer settings and the cases. For every case each
rank builds a fresh ``PolicyTrainer`` at the case's layout (TP2 with sequence parallelism, or
EP2), runs ONE ``rl_step`` on its data-parallel rank's share of the batch and exports, through
the HF name map (a collective), the updated weights and the step's gradients (``main_grad``
after the reduction). Control cases break one mechanism on purpose (``control``):

- ``dp_scale_1``: losses are not multiplied by the data-parallel size before ``backward``;
- ``no_tp_grad_sum``: gradients that TP ranks hold only in part (sequence-parallel norms and
  routers, q/k norms) are not summed over the TP group.

After the case named ``refusal_after`` (a TP2 case) a trainer asking for EP2 on the live TP2
state must raise ValueError; its message is kept as ``result["refusal"]``.

Rank 0 writes OUT_DIR/result.pt ({case name: {"metrics", "weights", "grads", "layout"}}) and
prints one line ``TRAINER_PARALLEL_DONE`` at the end.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch


def hf_state(trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, gradients) of ``trainer`` as full HF-named tensors (clones).

    The gradients are each parameter's ``main_grad`` (after the DDP and TP reductions of the
    last step; unclipped when ``train.clip_grad`` is larger than the norm) exported through the
    same name map as the weights, by copying them into the parameters for one export. A
    collective under TP / EP: every rank must call it.
    """
    weights = {name: t.detach().clone() for name, t in trainer.hf_tensors()}
    params = list(trainer.model.parameters())
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.main_grad)
        grads = {name: t.detach().clone() for name, t in trainer.hf_tensors()}
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    return weights, grads


@contextlib.contextmanager
def control(name: str | None, trainer) -> Iterator[None]:
    """Break one mechanism of ``trainer`` for the block (see the module docstring)."""
    import megatron_sat.training.trainer as trainer_module

    if name is None:
        yield
    elif name == "dp_scale_1":
        original = trainer_module.dp_loss_scale
        trainer_module.dp_loss_scale = lambda group: 1.0
        try:
            yield
        finally:
            trainer_module.dp_loss_scale = original
    elif name == "no_tp_grad_sum":
        trainer._finish_grads = trainer.model.finish_grad_sync
        try:
            yield
        finally:
            del trainer._finish_grads
    else:
        raise ValueError(f"unknown control {name!r}")


def main(spec_path: str, out_dir: str) -> None:
    """Run every case of the spec; see the module docstring."""
    spec = pickle.loads(Path(spec_path).read_bytes())
    from megatron.core import parallel_state

    from megatron_sat.config import TrainConfig
    from megatron_sat.objectives import ObjectiveConfig
    from megatron_sat.config import ParallelConfig
    from megatron_sat.training.trainer import PolicyTrainer

    rank = None
    results = {}
    for case in spec["cases"]:
        start = time.perf_counter()
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        trainer = PolicyTrainer(
            spec["hf_config"],
            TrainConfig(
                **dict(
                    spec["train"],
                    micro_batch_size=case["micro_batch_size"],
                    max_tokens_per_micro_batch=case.get("max_tokens"),
                )
            ),
            ParallelConfig(
                tensor_model_parallel_size=case.get("tp", 1),
                expert_model_parallel_size=case.get("ep", 1),
            ),
            pad_token_id=spec["pad_token_id"],
            load_from=spec["checkpoint"],
        )
        rank = torch.distributed.get_rank()
        dp_rank = parallel_state.get_data_parallel_rank()
        share = case["shares"][dp_rank]
        with control(case.get("control"), trainer):
            metrics = trainer.rl_step(
                spec["samples"][share],
                spec["advantages"][share],
                ObjectiveConfig(**spec["objective"]),
                trainer_version=spec["trainer_version"],
            )
        weights, grads = hf_state(trainer)
        layout = {
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "ep": parallel_state.get_expert_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "expert_dp": parallel_state.get_expert_data_parallel_world_size(),
            "sequence_parallel": trainer.sequence_parallel,
            "micro_batches": len(trainer.micro_batch_rows(spec["samples"][share])),
            "seconds": round(time.perf_counter() - start, 2),
        }
        layouts: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(layouts, layout)
        results[case["name"]] = {
            "metrics": metrics,
            "weights": weights,
            "grads": grads,
            "layout": layouts,
        }
        if case["name"] == spec["refusal_after"]:
            # init_distributed keeps an initialised parallel state: a trainer asking for other
            # sizes must refuse rather than build a model for the wrong layout.
            try:
                PolicyTrainer(
                    spec["hf_config"],
                    TrainConfig(**dict(spec["train"], micro_batch_size=4)),
                    ParallelConfig(expert_model_parallel_size=2),
                    pad_token_id=spec["pad_token_id"],
                    load_from=None,
                )
                results["refusal"] = "no error"
            except ValueError as e:
                results["refusal"] = str(e)
        del trainer
    if rank == 0:
        torch.save(results, Path(out_dir) / "result.pt")
        print("TRAINER_PARALLEL_DONE", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
