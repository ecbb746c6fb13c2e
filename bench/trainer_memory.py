"""The launch plan's memory against what a trainer rank measurably holds, in two parts.

    python bench/trainer_memory.py            # launches itself (torchrun, then 1 process)

**Activations** (``launch.activation_memory``): for each of two small Qwen3-MoE shapes built
by our builders (``training.builders``, the local spec as on any CPU, bf16, R3 replaying random
routes) and each ``train.recompute_granularity`` (none / selective / full), one training
forward with labels runs under ``torch.autograd.graph.saved_tensors_hooks``; every saved
tensor's storage is counted once (parameters excluded), split into the decoder's (while a
module under ``decoder`` other than its final norm runs) and the rest (embedding, final norm,
output layer, loss). The plan's figures for the same micro-batch are
``decoder_activations(...).saved_bytes`` and ``output_activations(...).saved_bytes``.
``activation_plan_error`` is the largest ``|measured - plan| / measured`` of the decoder over
the six cases (goal <= 0.15); ``output_plan_error`` likewise for the output part.

**Static state** (``launch.memory.estimate_memory``):

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
``plan_bytes_per_param``, ``plan_error`` (|measured - plan| / plan; goal <= 0.05) and the parts,
then the activation keys above.
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


# (name, HF overrides, rows, sequence length): one all-MoE shape, one with a dense first layer,
# more heads and experts, a longer sequence.
ACTIVATION_SHAPES = (
    (
        "A: h128 a4 g2 E8 k2 f64, 2 MoE layers, 2 x 64 tokens",
        dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
             vocab_size=512),
        2,
        64,
    ),
    (
        "B: h256 a8 g2 E16 k4 f96, dense + 2 MoE layers, 3 x 96 tokens",
        dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
             head_dim=32, moe_intermediate_size=96, num_experts=16, num_experts_per_tok=4,
             vocab_size=1024, mlp_only_layers=[0], intermediate_size=384),
        3,
        96,
    ),
)  # fmt: skip


def _measure_saved(model, rows: int, seq: int, seed: int) -> tuple[int, int]:
    """(decoder bytes, other bytes) saved for backward by one forward with labels under R3."""
    import torch

    from megatron_sat.routing.replay import find_routers, replay_routing

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[str] = []
    handles = []

    def enter(name):
        def hook(module, args):
            stack.append(name)

        return hook

    def leave(module, args, output):
        stack.pop()

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))
    seen: set[int] = set()
    parts = {"decoder": 0, "other": 0}

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            inside = any(n.startswith("decoder") for n in stack) and not any(
                n.startswith("decoder.final_layernorm") for n in stack
            )
            parts["decoder" if inside else "other"] += storage.nbytes()
        return t

    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    ids = torch.randint(0, model.vocab_size, (rows, seq), generator=gen)
    positions = torch.arange(seq).expand(rows, seq)
    targets = {
        layer: torch.stack(
            [torch.randperm(cfg.num_moe_experts, generator=gen)[: cfg.moe_router_topk]
             for _ in range(rows * seq)]
        )
        for layer in find_routers(model)
    }  # fmt: skip
    with replay_routing(model, targets):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, positions, None, labels=ids)
        loss.float().sum().backward()
    for handle in handles:
        handle.remove()
    return parts["decoder"], parts["other"]


def activation_worker() -> None:
    """Measure the six cases in this process (a 1-process gloo world) and print one JSON line."""
    import torch

    from megatron_sat.checkpoint.tiny_models import TINY_CONFIGS
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.launch.activation_memory import (
        GRANULARITIES,
        ActivationLayout,
        ModelDims,
        decoder_activations,
        output_activations,
    )
    from megatron_sat.platform.distributed import init_distributed
    from megatron_sat.training.builders import build_model, build_transformer_config
    from megatron_sat.training.optimizer_layout import resolve_optimizer_layout

    init_distributed(ParallelConfig())
    cases = []
    for name, overrides, rows, seq in ACTIVATION_SHAPES:
        arch = "Qwen3MoeForCausalLM"
        hf = dict(TINY_CONFIGS[arch], architectures=[arch], max_position_embeddings=seq)
        hf.update(overrides)
        dims = ModelDims.from_hf(hf)
        for granularity in GRANULARITIES:
            train = TrainConfig(params_dtype="bf16", recompute_granularity=granularity)
            layout = resolve_optimizer_layout(train, device_type="cpu", dp=1, edp=1)
            config = build_transformer_config(hf, train, ParallelConfig(), layout)
            model = build_model(hf, config, seed=0, device=torch.device("cpu"), load_from=None)
            model.train()
            decoder, other = _measure_saved(model, rows, seq, seed=len(cases))
            kw = dict(tokens=rows * seq, seq_len=seq, kernels="local")
            plan = decoder_activations(
                dims,
                ActivationLayout(),
                layers=range(len(dims.moe_layers)),
                granularity=granularity,
                **kw,
            ).saved_bytes
            plan_out = output_activations(dims, ActivationLayout(), **kw).saved_bytes
            layers = len(dims.moe_layers)
            cases.append(
                {
                    "shape": name,
                    "recompute_granularity": granularity,
                    "measured_bytes_per_token_per_layer": round(decoder / rows / seq / layers, 1),
                    "plan_bytes_per_token_per_layer": round(plan / rows / seq / layers, 1),
                    "error": round(abs(decoder - plan) / decoder, 4),
                    "measured_output_bytes": other,
                    "plan_output_bytes": plan_out,
                    "output_error": round(abs(other - plan_out) / other, 4),
                }
            )
    print(
        json.dumps(
            {
                "activation_cases": cases,
                "output_plan_error": max(c["output_error"] for c in cases),
                "activation_plan_error": max(c["error"] for c in cases),
            }
        ),
        flush=True,
    )


def _json_line(cmd: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-6000:])
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    from megatron_sat.checkpoint.tiny_models import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint("Qwen3MoeForCausalLM", Path(tmp) / "ckpt", **HF_OVERRIDES)
        torchrun = Path(sys.executable).with_name("torchrun")
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
        result = _json_line(
            [str(torchrun), "--standalone", "--nproc_per_node=2", __file__, "--worker", str(ckpt)],
            env,
        )
    result.update(_json_line([sys.executable, __file__, "--activations"], env))
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "--activations":
        activation_worker()
    else:
        main()
