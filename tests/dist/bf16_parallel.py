"""bf16 mixed precision and the distributed optimizer at TP2+SP, EP2 and DP2, in ONE torchrun
launch (2 gloo ranks, CPU). Cases of tests/test_bf16_trainer.py.

    torchrun --nproc_per_node=2 tests/dist/bf16_parallel.py CHECKPOINT OUT_DIR

For every layout (``tp2`` with sequence parallelism, ``ep2`` (dense DP2), ``dp2``) each rank
builds an fp32 and a bf16 ``PolicyTrainer`` from the same tiny HF checkpoint and records:

- the built objects: parameter dtypes (non-router bf16, router float32), the optimizer's main
  parameters' dtypes (float32), whether the distributed optimizer is on;
- the R3-replayed log-probs of the batch before the step (both dtypes) and after one SAT-GSPO
  step (both dtypes), the step's ``topk_match_r3``;
- with ``BF16_PARALLEL_RESUME_DTYPE=bf16`` (or fp32), at ``dp2``: resume of the distributed
  optimizer. The trainer saves a run checkpoint after step 1 and runs step 2; a fresh trainer
  loads that checkpoint and runs the same step 2; both export their weights (``continued``,
  ``resumed``), asserted bit-identical by the pytest test (bf16).
``BF16_PARALLEL_CASES=dp2,...`` picks cases.

Rank 0 writes OUT_DIR/result.pt and prints ``BF16_PARALLEL_DONE``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from r3_common import make_samples

CASES = {
    "tp2": dict(tensor_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
    "dp2": dict(),
}


def optimizer_main_dtypes(optimizer) -> dict[str, list[str]]:
    """dtypes of the main (fp32) parameter copies and of the model parameters each sub-
    optimizer of megatron-core's ChainedOptimizer steps, by optimizer class."""
    out: dict[str, list[str]] = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        mains = []
        for group in opt.optimizer.param_groups:  # what torch's Adam updates: the main params
            mains += [str(p.dtype) for p in group["params"]]
        out.setdefault(type(opt).__name__, []).extend(sorted(set(mains)))
    return out


def built_dtypes(trainer) -> dict[str, str]:
    """dtype of every model parameter and router buffer, by name."""
    out = {n: str(p.dtype) for n, p in trainer.model.named_parameters()}
    out.update({n: str(b.dtype) for n, b in trainer.model.named_buffers() if "router" in n})
    return out


def main(checkpoint: str, out_dir: str) -> None:
    from megatron.core import parallel_state

    from megatron_sat.checkpoint.run_state import load_run_checkpoint, save_run_checkpoint
    from megatron_sat.config import TrainConfig
    from megatron_sat.objectives import ObjectiveConfig
    from megatron_sat.config import ParallelConfig
    from megatron_sat.training.trainer import PolicyTrainer

    hf = json.loads((Path(checkpoint) / "config.json").read_text())
    objective = ObjectiveConfig(name="sat-gspo")
    results: dict = {}

    def trainer_for(case: str, dtype: str) -> PolicyTrainer:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        return PolicyTrainer(
            hf,
            TrainConfig(lr=1e-4, micro_batch_size=4, params_dtype=dtype, seed=7),
            ParallelConfig(**CASES[case]),
            pad_token_id=0,
            load_from=checkpoint,
        )

    for case in os.environ.get("BF16_PARALLEL_CASES", ",".join(CASES)).split(","):
        out: dict = {}
        for dtype in ("fp32", "bf16"):
            trainer = trainer_for(case, dtype)
            num_layers, top_k, num_experts = trainer.routing_shape
            shape = dict(hf, num_hidden_layers=num_layers, num_experts_per_tok=top_k)
            samples = make_samples([(3, 6)] * 8, dict(shape, num_experts=num_experts), seed=3)
            dp_size = parallel_state.get_data_parallel_world_size()
            dp_rank = parallel_state.get_data_parallel_rank()
            share = slice(dp_rank * 8 // dp_size, (dp_rank + 1) * 8 // dp_size)
            mine = samples[share]
            advantages = torch.linspace(-1.0, 1.0, 8)[share]
            # Rollout log-probs = the fp32 policy's (replayed) log-probs, so the ratio is ~1.
            if dtype == "fp32":
                mbs = trainer.micro_batches(mine, advantages, with_routes=True)
                lps = trainer._no_grad_log_probs(mbs, replay=True)
                for mb, (lp, _) in zip(mbs, lps, strict=True):
                    for row, index in enumerate(mb.sample_indices):
                        s = samples[index]
                        n = len(s.response_ids)
                        start = len(s.prompt_ids) - 1
                        s.rollout_log_probs = lp[row, start : start + n].float().tolist()
                out["rollout"] = [s.rollout_log_probs for s in mine]
            else:
                for s, lps in zip(mine, out["rollout"], strict=True):
                    s.rollout_log_probs = lps
            mbs = trainer.micro_batches(mine, advantages, with_routes=True)
            before = [lp.cpu() for lp, _ in trainer._no_grad_log_probs(mbs, replay=True)]
            metrics = trainer.rl_step(mine, advantages, objective)
            after = [lp.cpu() for lp, _ in trainer._no_grad_log_probs(mbs, replay=True)]
            out[dtype] = dict(
                before=before,
                after=after,
                masks=[mb.loss_mask.cpu() for mb in mbs],
                metrics=metrics,
                dtypes=built_dtypes(trainer),
                main=optimizer_main_dtypes(trainer.optimizer),
                distributed_optimizer=trainer.optimizer_layout.use_distributed_optimizer,
                dp=dp_size,
                edp=parallel_state.get_expert_data_parallel_world_size(),
            )
            if case == "dp2" and dtype == os.environ.get("BF16_PARALLEL_RESUME_DTYPE"):
                run_dir = Path(out_dir) / "run"
                save_run_checkpoint(
                    run_dir, model=trainer.model, optimizer=trainer.optimizer, step=1
                )
                trainer.rl_step(mine, advantages, objective)
                out["continued"] = {n: t.clone() for n, t in trainer.hf_tensors()}
                del trainer
                resumed = trainer_for(case, dtype)
                ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
                load_run_checkpoint(ckpt, model=resumed.model, optimizer=resumed.optimizer)
                resumed.rl_step(mine, advantages, objective)
                out["resumed"] = {n: t.clone() for n, t in resumed.hf_tensors()}
                del resumed
            else:
                del trainer
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, out)
        results[case] = gathered
    if torch.distributed.get_rank() == 0:
        torch.save(results, Path(out_dir) / "result.pt")
        print("BF16_PARALLEL_DONE", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
