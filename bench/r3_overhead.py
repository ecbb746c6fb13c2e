"""R3 overhead: train step time with routing replay over without, and payload bytes per token.

Side by side in one run, one process (CPU, gloo world of 1), a Qwen3-MoE-shaped megatron-core
model (random weights, local spec). One train step = build the micro-batches from samples,
forward + backward through megatron-core's schedule (``training.logprobs.forward_backward``),
one Adam step. Two variants, alternated step by step so that machine load drifts hit both:

- ``live``: micro-batches without routes, live routing;
- ``replay``: micro-batches with routes placed through the token index map, a ``RoutingReplay``
  session (targets cut per micro-batch and layer, the top-k audit on, as the trainer runs it).

The replayed routes are the model's own (recorded once), so both variants send every token to
the same experts: the difference is the replay machinery alone, not a different expert load.
``ratio`` = median over step pairs of replay time / live time (issue #4 goal: <= 1.01). On the
CPU in process CPU time: with one thread, CPU time is the work of the step, while wall-clock
time on a shared machine also counts waiting for a core (``ratio_wall`` reports it too). With
CUDA (model and micro-batches on the GPU, local spec) in synchronised wall-clock time.

Payload bytes per token: SGLang's wire format (int32 [layers, top_k] per token, base64), the
compact form the trainer stores (uint8 up to 256 experts), for this model and for
Qwen3-30B-A3B (48 layers, top-8, 128 experts).
The last line is JSON with every figure. Usage:
``python bench/r3_overhead.py [--steps 24] [--threads 1] [--hidden 256 --layers 4 ...]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

HF_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=1024,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
)


def make_samples(num: int, seq: int, seed: int = 0):
    from megatron_sat.rollout.types import Sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        n = int(torch.randint(seq // 2, seq + 1, (1,), generator=gen))
        ids = torch.randint(3, HF_CONFIG["vocab_size"], (n,), generator=gen).tolist()
        p = n // 4
        out.append(
            Sample(
                index=i,
                group_index=i,
                prompt="",
                label="",
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                rollout_log_probs=[0.0] * (n - p),
                response_versions=[0] * (n - p),
            )
        )
    return out


def record_own_routes(model, samples, shape) -> None:
    """Fill every sample's ``routed_experts`` with the model's own live top-k (record mode)."""
    from megatron_sat.routing.payload import compact_expert_dtype
    from megatron_sat.routing.replay import RoutingReplay
    from megatron_sat.training.batching import build_micro_batch
    from megatron_sat.training.logprobs import forward_log_probs

    controller = RoutingReplay(model)
    device = next(model.parameters()).device
    for s in samples:
        mb = build_micro_batch([s], [0.0], pad_token_id=0).to(device)
        with torch.no_grad(), controller.record(training=False) as report:
            with controller.micro_batch(0):
                forward_log_probs(model, mb)
        rows = np.zeros((s.num_tokens - 1, *shape[:2]), dtype=compact_expert_dtype(shape[2]))
        for layer in controller.layers:
            rows[:, layer - 1] = report.recorded[(0, layer)][: s.num_tokens - 1].cpu().numpy()
        s.routed_experts = rows


def payload_bytes(num_layers: int, top_k: int, num_experts: int, tokens: int = 1000) -> dict:
    """Bytes per token of the SGLang payload (raw int32, base64) and of the compact store."""
    from megatron_sat.routing.payload import compact_expert_dtype, encode_routed_experts

    rows = np.random.default_rng(0).integers(0, num_experts, (tokens, num_layers, top_k))
    b64 = encode_routed_experts(rows)
    return {
        "wire_int32": 4 * num_layers * top_k,
        "wire_base64": round(len(b64) / tokens, 2),
        "stored_compact": compact_expert_dtype(num_experts).itemsize * num_layers * top_k,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="timed step pairs")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument(
        "--no-audit", action="store_true", help="replay without the own-top-k audit metric"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    HF_CONFIG.update(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=max(1024, args.seq),
    )
    cuda = torch.cuda.is_available()

    from megatron_sat.config import ParallelConfig
    from megatron_sat.models import build_gpt_model, transformer_config_from_hf
    from megatron_sat.platform.distributed import init_distributed
    from megatron_sat.routing.replay import RoutingReplay
    from megatron_sat.training.batching import build_micro_batch
    from megatron_sat.training.logprobs import forward_backward

    init_distributed(ParallelConfig())
    config = transformer_config_from_hf(HF_CONFIG, calculate_per_token_loss=True)
    torch.manual_seed(0)
    model = build_gpt_model(HF_CONFIG, config, use_transformer_engine=False)
    if cuda:
        model = model.cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0)  # lr 0: the routes stay the model's
    shape = (config.num_layers, config.moe_router_topk, config.num_moe_experts)
    size = args.micro_batch_size
    samples = make_samples(args.micro_batches * size, args.seq)
    record_own_routes(model, samples, shape)
    num_tokens = float(sum(len(s.response_ids) for s in samples))
    controller = RoutingReplay(model)

    def loss_fn(log_probs, batch, index):
        view = batch.samples
        return -(log_probs * view.loss_mask).sum() / num_tokens, {}

    def step(replay: bool) -> tuple[float, float, dict]:
        if cuda:
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        mbs = [
            build_micro_batch(
                samples[i : i + size],
                [1.0] * size,
                pad_token_id=0,
                routing_shape=shape if replay else None,
            )
            for i in range(0, len(samples), size)
        ]
        if cuda:
            mbs = [mb.to("cuda") for mb in mbs]
        optimizer.zero_grad(set_to_none=True)
        metrics = {}
        if replay:
            routes = {
                i: controller.routes_for(mb.routes, mb.routes_valid) for i, mb in enumerate(mbs)
            }
            with controller.replay(routes, training=True, audit=not args.no_audit) as report:
                forward_backward([model], mbs, loss_fn, replay=controller)
            metrics = report.metrics(config.num_layers)
        else:
            forward_backward([model], mbs, loss_fn)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        return time.process_time() - start_cpu, time.perf_counter() - start, metrics

    step(False), step(True)  # warm-up
    cpu = {False: [], True: []}
    wall = {False: [], True: []}
    metrics = {}
    for i in range(args.steps):
        for use in (False, True) if i % 2 == 0 else (True, False):
            cpu_s, wall_s, m = step(use)
            cpu[use].append(cpu_s)
            wall[use].append(wall_s)
            metrics = m or metrics

    def pair_ratio(times):
        return statistics.median(r / b for r, b in zip(times[True], times[False], strict=True))

    tokens_per_step = sum(s.num_tokens for s in samples)
    result = {
        # CPU: the step's CPU time (one thread); CUDA: wall clock, synchronised (the GPU's work
        # does not show in the process's CPU time).
        "ratio": round(pair_ratio(wall if cuda else cpu), 4),
        "device": "cuda" if cuda else "cpu",
        "ratio_wall": round(pair_ratio(wall), 4),
        "step_cpu_s_live": round(statistics.median(cpu[False]), 4),
        "step_cpu_s_replay": round(statistics.median(cpu[True]), 4),
        "step_wall_s_live": round(statistics.median(wall[False]), 4),
        "step_wall_s_replay": round(statistics.median(wall[True]), 4),
        "steps": args.steps,
        "tokens_per_step": tokens_per_step,
        "threads": args.threads,
        "audit": not args.no_audit,
        "r3_topk_differ": metrics.get("r3_topk_differ"),
        "model": {k: HF_CONFIG[k] for k in ("hidden_size", "num_hidden_layers", "num_experts")},
        "payload_bytes_per_token": payload_bytes(*shape),
        "payload_bytes_per_token_qwen3_30b_a3b": payload_bytes(48, 8, 128),
    }
    clock = "wall" if cuda else "cpu"
    print(
        f"train step {clock} time, median of {args.steps}: "
        f"live {result[f'step_{clock}_s_live']:.3f} s, "
        f"replay {result[f'step_{clock}_s_replay']:.3f} s, replay/live {result['ratio']:.4f} "
        f"(goal <= 1.01; wall-clock {result['ratio_wall']:.4f}); payload bytes/token "
        f"{result['payload_bytes_per_token']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
