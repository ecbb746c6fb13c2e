"""Pipeline-parallel cases of tests/test_pipeline_parallel.py in ONE torchrun launch (gloo, CPU).

    torchrun --nproc_per_node=N tests/dist/pp_parallel.py SPEC.pkl OUT_DIR

SPEC.pkl (written by the pytest test) holds the tiny checkpoint, the global batch (samples with
R3 routes, advantages), the objective, the trainer settings and the cases whose world size is N.
For every case each rank builds a fresh ``PolicyTrainer`` at the case's layout (PP2, or PP2 x
TP2 or PP2 x EP2 on 4 ranks), runs ONE ``rl_step`` on its data-parallel rank's share of the
batch (the whole batch at data-parallel size 1) and exports,
through the HF name map (a collective over the TP and pipeline groups), the updated weights and
the step's gradients (``main_grad`` after the reduction), and which MoE layers each rank's
routers replay.

A case with ``resume`` then checks a run checkpoint at its layout: a trainer that ran step 1
saves, a second step follows; a fresh trainer loads the checkpoint and runs the same second
step: its metrics and weights must be bit-identical. A case with ``sft`` runs one ``sft_step``
after the RL step and exports the weights again.

Rank 0 writes OUT_DIR/result.pt ({case name: {...}}) and prints ``PP_PARALLEL_DONE`` at the end.
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
import time
from pathlib import Path

import torch


def _hf_state():
    path = Path(__file__).with_name("trainer_parallel.py")
    spec = importlib.util.spec_from_file_location("trainer_parallel_dist", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.hf_state


def share_of(case: dict) -> slice:
    """This data-parallel rank's share of the batch (the whole batch without ``shares``)."""
    from megatron.core import parallel_state

    return case.get("shares", [slice(None)])[parallel_state.get_data_parallel_rank()]


def run_case(spec: dict, case: dict, out_dir: str) -> dict:
    """One case on this rank: {"weights", "grads", "layout": [per rank]}."""
    from megatron.core import parallel_state

    from megatron_sat.checkpoint.run_state import load_run_checkpoint, save_run_checkpoint
    from megatron_sat.config import TrainConfig
    from megatron_sat.objectives import ObjectiveConfig
    from megatron_sat.config import ParallelConfig
    from megatron_sat.training.trainer import PolicyTrainer

    start = time.perf_counter()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    objective = ObjectiveConfig(**dict(spec["objective"], **case.get("objective", {})))

    def trainer() -> PolicyTrainer:
        return PolicyTrainer(
            spec["hf_config"],
            TrainConfig(**dict(spec["train"], **case.get("train", {}))),
            ParallelConfig(
                tensor_model_parallel_size=case.get("tp", 1),
                expert_model_parallel_size=case.get("ep", 1),
                pipeline_model_parallel_size=case["pp"],
            ),
            pad_token_id=spec["pad_token_id"],
            load_from=spec["checkpoint"],
            reference=objective.kl_coef > 0,
        )

    def step(t: PolicyTrainer, version: int) -> dict[str, float]:
        share = share_of(case)
        return t.rl_step(
            spec["samples"][share], spec["advantages"][share], objective, trainer_version=version
        )

    first = trainer()
    metrics = step(first, spec["trainer_version"])
    weights, grads = _hf_state()(first)
    layout = {
        "rank": torch.distributed.get_rank(),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "micro_batches": len(first.micro_batch_rows(spec["samples"][share_of(case)])),
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "replayed_layers": list(first.routing.layers),
        "num_local_params": sum(p.numel() for p in first.model.parameters()),
        "recompute_granularity": first.config.recompute_granularity,
        # router recomputes of the step's training session, per layer (replayed routes)
        "recomputes": dict(first.routing._report.recomputes),
        "metrics": metrics,
    }
    record = {"weights": weights, "grads": grads}
    if case.get("sft"):  # then one supervised step through the same schedule
        layout["sft"] = first.sft_step(spec["samples"])
        record["sft_weights"] = {name: t.detach().clone() for name, t in first.hf_tensors()}
    if case.get("resume"):
        run_dir = Path(out_dir) / f"run_{case['name']}"
        save_run_checkpoint(
            run_dir, model=first.model, optimizer=first.optimizer, step=1, weight_version=1
        )
        straight = step(first, spec["trainer_version"] + 1)
        straight_weights = dict(first.model.module.named_parameters())
        del first
        resumed = trainer()
        state = load_run_checkpoint(run_dir, model=resumed.model, optimizer=resumed.optimizer)
        again = step(resumed, spec["trainer_version"] + 1)
        different = [
            name
            for name, p in resumed.model.module.named_parameters()
            if not torch.equal(p, straight_weights[name])
        ]
        layout["resume"] = {
            "step": state.step,
            "metrics_equal": again == straight,
            "metric_keys": len(straight),
            "loss": (straight["loss"], again["loss"]),
            "different": different,
            "num_params": len(straight_weights),
        }
    layout["seconds"] = round(time.perf_counter() - start, 2)
    layouts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(layouts, layout)
    return dict(record, layout=layouts)


def main(spec_path: str, out_dir: str) -> None:
    """Run every case of the spec; see the module docstring."""
    spec = pickle.loads(Path(spec_path).read_bytes())
    results = {case["name"]: run_case(spec, case, out_dir) for case in spec["cases"]}
    if torch.distributed.get_rank() == 0:
        torch.save(results, Path(out_dir) / "result.pt")
        print("PP_PARALLEL_DONE", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
