"""torchrun (gloo ranks): every rank's share from ``distribute_batch`` (flat tensors, each
rank its own share) is bitwise what ``dist.scatter_object_list`` of the pickled shares (the
path it replaced) delivers; prints per-rank timings for bench/data_path.py.

Args: ``--num-samples N --group-size G --response-len R --layers L --topk K --experts E``,
``--dp-ranks 0,0,1`` (each rank's data-parallel rank; default: its rank): equal entries train
on one share (TP / EP ranks of one DP rank), all equal is data-parallel size 1 (broadcast).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_sat.rollout.types import Sample
from megatron_sat.training.batch_transfer import distribute_batch
from megatron_sat.training.rl import dp_shares


def synthetic_batch(n, group, response_len, layers, topk, experts, seed=0):
    """Samples with every kind of field: long-tailed lengths, compact routes (uint8 <= 256
    experts, int16 above), a None reward, an empty response, metadata, unicode text."""
    rng = np.random.default_rng(seed)
    dtype = np.uint8 if experts <= 256 else np.int16
    samples = []
    for i in range(n):
        p = int(rng.integers(3, 40))
        r = 0 if i == 1 else int(min(response_len, rng.lognormal(np.log(response_len / 8), 1.0)))
        samples.append(
            Sample(
                index=1000 + i,
                group_index=i // group,
                prompt=f"prompt {i} é≠",
                label=str(i),
                prompt_ids=rng.integers(0, 50000, p).tolist(),
                response_ids=rng.integers(0, 50000, r).tolist(),
                rollout_log_probs=(-rng.exponential(1.0, r)).tolist(),
                response_versions=rng.integers(0, 9, r).tolist(),
                routed_experts=None
                if i == 2
                else rng.integers(0, experts, (p + r - 1, layers, topk)).astype(dtype),
                finish_reason=("stop", "length", "abort")[i % 3],
                reward=None if i == 3 else float(rng.random()),
                response_text=f"answer {i} \\boxed{{{i}}}",
                metadata={"source": i} if i % 2 else {},
            )
        )
    advantages = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    return samples, advantages


def same(a: Sample, b: Sample) -> bool:
    def bits(x):
        return np.asarray(x, dtype=np.float64).view(np.int64).tolist()

    routes = (a.routed_experts is None and b.routed_experts is None) or (
        a.routed_experts is not None
        and b.routed_experts is not None
        and a.routed_experts.dtype == b.routed_experts.dtype
        and a.routed_experts.shape == b.routed_experts.shape
        and np.array_equal(a.routed_experts, b.routed_experts)
    )
    plain = ("index", "group_index", "prompt", "label", "prompt_ids", "response_ids",
             "response_versions", "finish_reason", "response_text", "metadata")  # fmt: skip
    return (
        routes
        and all(getattr(a, k) == getattr(b, k) for k in plain)
        and all(type(x) is type(y) for x, y in zip(a.prompt_ids, b.prompt_ids, strict=True))
        and bits(a.rollout_log_probs) == bits(b.rollout_log_probs)
        and (a.reward is None) == (b.reward is None)
        and (a.reward is None or bits([a.reward]) == bits([b.reward]))
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("num-samples", 16), ("group-size", 4), ("response-len", 256),
                          ("layers", 4), ("topk", 2), ("experts", 8), ("repeats", 1)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dp-ranks", default="")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_ranks = [int(x) for x in args.dp_ranks.split(",")] if args.dp_ranks else list(range(world))
    batch = synthetic_batch(
        args.num_samples, args.group_size, args.response_len, args.layers, args.topk, args.experts
    )
    slices = dp_shares(args.num_samples, args.group_size, max(dp_ranks) + 1)
    # The path it replaced (rl.py before issue 12), on the same gloo world.
    objects = None
    if rank == 0:
        objects = [(batch[0][slices[d]], batch[1][slices[d]], 7) for d in dp_ranks]
    received: list = [None]
    dist.scatter_object_list(received, objects, src=0)
    old = received[0]
    timings = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            new = distribute_batch(batch[0], batch[1], 7, slices, dp_rank=dp_ranks[rank])
        else:
            new = distribute_batch(None, None, None, None, dp_rank=dp_ranks[rank])
        timings.append(time.perf_counter() - start)
    samples, advantages, version = new
    ok = (
        version == old[2] == 7
        and len(samples) == len(old[0]) > 0
        and all(same(a, b) for a, b in zip(samples, old[0], strict=True))
        and advantages.dtype == old[1].dtype
        and torch.equal(advantages, old[1])
    )
    share_tokens = sum(s.num_tokens for s in samples)
    report = {"rank": rank, "ok": ok, "seconds": min(timings), "tokens": share_tokens}
    reports: list = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        print("SHARES " + json.dumps(reports), flush=True)
        if all(r["ok"] for r in reports):
            print("BATCH_TRANSFER_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
