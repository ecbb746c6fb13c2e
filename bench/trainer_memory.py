"""Bytes of parameters, gradients and optimizer state per model parameter on one trainer rank,
measured from the tensors' storage, against the launch plan's estimate for the same layout.

    python bench/trainer_memory.py            # launches itself under torchrun (2 gloo ranks)

Layout: DP2 (2 ranks, TP = EP = 1, so dense and expert DP are both 2), bf16 parameters with
megatron-core's distributed optimizer (the trainer's default at DP > 1), a Qwen3-MoE of
hidden 256, 4 layers, 8 experts (large enough that norms, which the local spec keeps in fp32,
are a small share). One SFT step allocates Adam's states. Measured on rank 0:

- params: distinct storages of the model's parameters (DDP's parameter buffers, padding
  included);
- grads: distinct storages of their ``main_grad`` (DDP's fp32 gradient buffers);
- optimizer: distinct storages of what torch's optimizer holds (main-parameter shards and
  Adam moments), minus any storage already counted as a parameter.

The estimate is ``launch.memory.estimate_memory`` with the layout resolved by
``training.optimizer_layout`` from the same TrainConfig. The last line is JSON:
``bytes_per_param`` (measured total / model parameters on the rank; goal <= 12),
``plan_bytes_per_param``, ``plan_error`` (|measured - plan| / plan; goal <= 0.05) and the parts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HF_OVERRIDES = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    moe_intermediate_size=128,
    num_experts=8,
    vocab_size=1024,
    max_position_embeddings=128,
)


def _storage_bytes(tensors, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def worker(ckpt: str) -> None:
    import torch

    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.launch.memory import count_parameters, estimate_memory
    from megatron_sat.rollout.types import Sample
    from megatron_sat.training.optimizer_layout import resolve_optimizer_layout
    from megatron_sat.training.trainer import PolicyTrainer

    hf = json.loads((Path(ckpt) / "config.json").read_text())
    train = TrainConfig(micro_batch_size=2, params_dtype="bf16")
    trainer = PolicyTrainer(hf, train, ParallelConfig(), pad_token_id=0, load_from=ckpt)
    samples = [
        Sample(
            index=i,
            group_index=i,
            prompt="",
            label="",
            prompt_ids=[3, 4, 5],
            response_ids=[6, 7],
            rollout_log_probs=[0.0, 0.0],
            response_versions=[0, 0],
        )
        for i in range(2)
    ]
    trainer.sft_step(samples)
    params = list(trainer.model.parameters())
    seen: set[int] = set()
    param_bytes = _storage_bytes(params, seen)
    grad_bytes = _storage_bytes([p.main_grad for p in params], seen)
    opt_tensors = []
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for group in opt.optimizer.param_groups:
            opt_tensors += list(group["params"])
        for state in opt.optimizer.state.values():
            opt_tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    opt_bytes = _storage_bytes(opt_tensors, seen)
    n = sum(p.numel() for p in params)
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    edp = ps.get_expert_data_parallel_world_size()
    layout = resolve_optimizer_layout(train, device_type="cuda", dp=dp, edp=edp)
    plan = estimate_memory(
        count_parameters(hf),
        tp=1,
        pp=1,
        ep=1,
        etp=1,
        layout=layout,
        dense_shards=dp,
        expert_shards=edp,
        server_tp=1,
    )
    if torch.distributed.get_rank() == 0:
        measured = param_bytes + grad_bytes + opt_bytes
        print(
            json.dumps(
                {
                    "layout": f"DP{dp} (expert DP {edp}), bf16, distributed optimizer "
                    f"{layout.use_distributed_optimizer}",
                    "model_params_on_rank": n,
                    "plan_params_on_rank": plan.params_per_rank,
                    "param_bytes": param_bytes,
                    "grad_bytes": grad_bytes,
                    "optimizer_bytes": opt_bytes,
                    "plan_param_bytes": plan.param_bytes,
                    "plan_grad_bytes": plan.grad_bytes,
                    "plan_optimizer_bytes": plan.optimizer_bytes,
                    "bytes_per_param": round(measured / n, 4),
                    "plan_bytes_per_param": round(plan.trainer_bytes / plan.params_per_rank, 4),
                    "plan_error": round(abs(measured - plan.trainer_bytes) / plan.trainer_bytes, 4),
                }
            ),
            flush=True,
        )
    torch.distributed.barrier()


def main() -> None:
    from megatron_sat.checkpoint.tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint("Qwen3MoeForCausalLM", Path(tmp) / "ckpt", **HF_OVERRIDES)
        torchrun = Path(sys.executable).with_name("torchrun")
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
        proc = subprocess.run(
            [str(torchrun), "--standalone", "--nproc_per_node=2", __file__, "--worker", str(ckpt)],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            sys.exit(proc.stdout[-3000:] + proc.stderr[-6000:])
        result = [line for line in proc.stdout.splitlines() if line.startswith("{")][-1]
        print(result)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
