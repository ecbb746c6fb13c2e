"""Data-parallel cases of tests/test_split_invariance.py, all in ONE torchrun launch (gloo, CPU).

    torchrun --nproc_per_node=2 tests/dist/dp_split_invariance.py SPEC.pkl OUT_DIR

SPEC.pkl (written by the pytest test) holds the tiny checkpoint path, the samples, advantages,
trainer version, every rank's share (whole groups, uneven on purpose) and the cases. For every
case each rank runs ``PolicyTrainer.rl_step`` on its share, rank 0 saves the global metrics and
the summed gradients (``main_grad`` after the DDP all-reduce, clip_grad = 0 so nothing rescales
them), then every rank restores the weights for the next case. With ``rl_overrides`` in the spec
it then runs the whole RL loop (``run_rl``) at DP = 2. Rank 0 writes OUT_DIR/result.pt and
prints one line ``DP_DONE`` at the end.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
from pathlib import Path

import torch


def main(spec_path: str, out_dir: str) -> None:
    """Run every case of the spec; see the module docstring."""
    spec = pickle.loads(Path(spec_path).read_bytes())
    from megatron.core import parallel_state

    from megatron_sat.config import TrainConfig
    from megatron_sat.objectives import ObjectiveConfig
    from megatron_sat.config import ParallelConfig
    from megatron_sat.training.trainer import PolicyTrainer

    trainer = PolicyTrainer(
        spec["hf_config"],
        TrainConfig(**spec["train"]),
        ParallelConfig(),
        pad_token_id=spec["pad_token_id"],
        load_from=spec["checkpoint"],
    )
    rank = torch.distributed.get_rank()
    assert parallel_state.get_data_parallel_world_size() == 2
    share = spec["shares"][rank]
    samples, advantages = spec["samples"][share], spec["advantages"][share]
    params = [p for _, p in trainer.model.named_parameters()]
    saved = [p.detach().clone() for p in params]
    base = trainer.train_config
    results = {}
    # Each case with fixed-count micro-batches, and with token-budget ones (key
    # "<name>/token_budget") when the case gives ``dp_max_tokens``.
    runs = [
        (case, case["name"], {"micro_batch_size": case["dp_micro_batch_size"]})
        for case in spec["cases"]
    ]
    runs += [
        (
            case,
            f"{case['name']}/token_budget",
            {"max_tokens_per_micro_batch": case["dp_max_tokens"]},
        )
        for case in spec["cases"]
        if case.get("dp_max_tokens")
    ]
    for case, name, fields in runs:
        trainer.train_config = dataclasses.replace(base, **fields)
        metrics = trainer.rl_step(
            samples,
            advantages,
            ObjectiveConfig(**case["objective"]),
            trainer_version=case["trainer_version"],
        )
        grads = torch.cat([p.main_grad.detach().reshape(-1).clone() for p in params])
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        results[name] = {
            "metrics": metrics,
            "grads": grads,
            "micro_batches": len(trainer.micro_batch_rows(samples)),
        }
    trainer.train_config = base
    if spec.get("rl_overrides"):
        from megatron_sat.config import load_config
        from megatron_sat.training.rl import run_rl

        summary = run_rl(load_config(None, spec["rl_overrides"]))
        results["rl_summary"] = summary
    if rank == 0:
        torch.save(results, Path(out_dir) / "result.pt")
        print("DP_DONE", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
