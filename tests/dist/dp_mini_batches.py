"""Data-parallel case of tests/test_mini_batches.py in ONE torchrun launch (gloo, CPU).

    torchrun --nproc_per_node=2 tests/dist/dp_mini_batches.py SPEC.pkl OUT_DIR

SPEC.pkl (written by the pytest test) holds the tiny checkpoint, the rollout batch (rank 0's),
its advantages and the run config's fields. Every rank runs ``distributed_rollout_batch``
(rank 0 passes the batch, rank 1 None): each mini-batch is shared over the two DP ranks, old
log-probs computed once before the first step. Rank 0 then saves the metrics and the final
weights; with ``rl_overrides`` the whole RL loop (``run_rl``) then runs at DP = 2 with
mini-batches. Rank 0 writes OUT_DIR/result.pt and prints ``MB_DONE`` at the end.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch


def main(spec_path: str, out_dir: str) -> None:
    """Run the spec's rollout batch at DP = 2; see the module docstring."""
    spec = pickle.loads(Path(spec_path).read_bytes())
    from megatron.core import parallel_state

    from megatron_sat.config import ParallelConfig, load_config
    from megatron_sat.training.mini_batches import distributed_rollout_batch
    from megatron_sat.training.trainer import PolicyTrainer

    cfg = load_config(None, spec["overrides"])
    trainer = PolicyTrainer(
        spec["hf_config"], cfg.train, ParallelConfig(), pad_token_id=0, load_from=spec["checkpoint"]
    )
    rank = torch.distributed.get_rank()
    assert parallel_state.get_data_parallel_world_size() == 2
    samples, advantages = (spec["samples"], spec["advantages"]) if rank == 0 else (None, None)
    metrics = distributed_rollout_batch(trainer, samples, advantages, cfg, 0)
    params = torch.cat([p.detach().reshape(-1).clone() for p in trainer.model.parameters()])
    results = {"metrics": metrics, "params": params}
    if spec.get("rl_overrides"):
        from megatron_sat.training.rl import run_rl

        results["rl_summary"] = run_rl(load_config(None, spec["rl_overrides"]))
    if rank == 0:
        torch.save(results, Path(out_dir) / "result.pt")
        print("MB_DONE", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
