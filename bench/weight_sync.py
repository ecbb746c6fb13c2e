"""Weight-sync throughput: our bucketed SGLang-protocol push, SGLang's per-tensor protocol, a raw
broadcast of the same bytes and a memcpy, side by side in one run.

To one embedded rollout server over a gloo group, on this machine, in ``--rounds`` rounds; each
round measures:

- ``raw``: one ``torch.distributed`` broadcast of the model's total bytes as a flat tensor
  between two processes of an ordinary gloo world (the collective's own speed; the two
  processes live across rounds).
- ``copy``: packing the model's tensors into a reused flat buffer (``buckets.pack_into``), the
  work a protocol with one copy per side adds on each side (the sender packs, the server
  copies into its parameters).
- ``ours``: ``WeightUpdater.update`` with its defaults for gloo, buckets of
  ``--bucket-megabytes`` (pause and begin while bucket 0 is gathered and packed, then buckets
  with bucket k+1 gathered during bucket k's broadcast and packed while the server loads
  bucket k, version, end, continue): every bucket
  flattened into one broadcast
  (SGLang's ``flattened_bucket``), and requests pipelined (``pipeline_requests``: bucket k+1
  posted once rank 0's broadcast of bucket k completed, before bucket k's reply; safe on this
  gloo group with real SGLang too, ``weight_sync.request_order``).
- ``per_tensor``: the same update with SGLang's per-tensor protocol as slime and verl use it
  (``load_format`` null: one broadcast per tensor, all enqueued then awaited, per bucket of the
  same size, each bucket's reply awaited before the next is posted, as slime's ``ray.get``
  per bucket).

The embedded server receives both formats as SGLang 0.5.23 does: into buffers of their own,
then copied into the parameters (``model_runner_components/weight_updater.py``,
``receive_weights_from_distributed`` then ``load_weights_from_distributed``; its reused
buffer stands in for CUDA's caching allocator). From 0a79720 until this change it received
per-tensor requests straight into the parameters, which SGLang does not: that favoured the
per-tensor protocol by one copy on the server.

- ``protocol``: ours pushing one small tensor (``model.norm.weight``, 2 KiB): SGLang's round
  trips (pause, begin, one request, end, continue) with almost nothing to move, what every
  push pays on top of its bytes (a push of several buckets also waits for the first bucket's
  reply before posting the second, and for every reply before the last).

The two protocols run in alternating order. Per round: ``ratio`` = raw / ours (seconds
inverted: throughputs), ``ratio_ceiling`` = raw / (raw + 2 copies), what a sync with one
copy per side can reach when nothing overlaps,
``ratio_vs_ceiling`` = ratio / ratio_ceiling, ``vs_per_tensor`` = ours' throughput over the
per-tensor protocol's, and ``ratio_vs_ceiling_plus_protocol`` = (raw + 2 copies + protocol) /
ours: the time of a push that overlaps nothing, over ours (above 1 where ours overlaps more
than the round trips cost; evidence beside the headline, not a goal). The
headline figures are the medians of the per-round values (each
round's four measurements are taken back to back, so a round compares like with like on a
loaded machine); their spread (min, median, max) is in ``rounds``, and the figures of each
measurement's best time over the rounds in ``best``. The last line is JSON.
On a CPU a memcpy runs at only a few times the speed of a loopback gloo broadcast, so the
ceiling is far below 1; on GPUs HBM copies are one to two orders of magnitude faster than the
NCCL transfer and it is close to 1.

Usage: ``python bench/weight_sync.py [--megabytes 256] [--rounds 9] [--bucket-megabytes 32]
[--dtype float32|bfloat16] [--variants serial split]`` (bfloat16: every float tensor cast
to bf16 and a bf16 server, the wire of a bf16 trainer; ``--variants`` also times ours without
pipelined requests and ours with tensors of 256 KiB or more sent per tensor, reported as their
time over ours per round under ``variants``: the evidence for the gloo defaults).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _raw_worker(rank: int, port: int, nbytes: int, commands, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    dist.broadcast(flat, src=0)  # warm-up
    while commands.get() == "go":
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(flat, src=0)
        dist.barrier()
        if rank == 0:
            out.put(time.perf_counter() - t0)
    dist.destroy_process_group()


class RawBroadcast:
    """Two processes of a gloo world that time one broadcast of ``nbytes`` per ``seconds()``."""

    def __init__(self, nbytes: int) -> None:
        from megatron_sat.platform.distributed import free_port

        ctx = mp.get_context("spawn")
        self._out = ctx.Queue()
        self._commands = [ctx.Queue(), ctx.Queue()]
        port = free_port()
        self._procs = [
            ctx.Process(target=_raw_worker, args=(r, port, nbytes, self._commands[r], self._out))
            for r in range(2)
        ]
        for p in self._procs:
            p.start()

    def seconds(self) -> float:
        for q in self._commands:
            q.put("go")
        return self._out.get(timeout=600)

    def close(self) -> None:
        for q in self._commands:
            q.put("stop")
        for p in self._procs:
            p.join(timeout=60)


def copy_seconds(tensors: list[torch.Tensor], flat: torch.Tensor) -> float:
    """Time of packing ``tensors`` into the (already faulted-in) flat uint8 buffer, seconds."""
    from megatron_sat.weight_sync.buckets import pack_into

    start = time.perf_counter()
    pack_into(tensors, flat)
    return time.perf_counter() - start


# The updaters timed besides ours (WeightUpdater's gloo defaults), by their options.
PROTOCOLS: dict[str, dict] = {
    "per_tensor": {"flatten_buckets": False, "pipeline_requests": False},
    "serial": {"pipeline_requests": False},  # ours without pipelined requests
    # ours with tensors of 256 KiB or more sent per tensor (the gloo default until the embedded
    # server received as SGLang does)
    "split": {"unpacked_from_bytes": 256 * 1024},
}


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=256.0)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--bucket-megabytes", type=float, default=32.0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--variants",
        nargs="*",
        choices=[k for k in PROTOCOLS if k != "per_tensor"],
        default=[],
        help="also time these variants of ours (same rounds, alternating order)",
    )
    args = parser.parse_args()
    from conftest import make_tiny_checkpoint
    from safetensors.torch import load_file

    from megatron_sat.rollout.embedded.launch import EmbeddedServer
    from megatron_sat.weight_sync.broadcast import WeightUpdater

    # The tiny architecture widened so that the model weighs about --megabytes (in --dtype).
    hidden = 512
    per_layer = 4 * (8 * 3 * hidden * hidden + 4 * hidden * hidden)
    if args.dtype == "bfloat16":
        per_layer //= 2
    layers = max(1, round(args.megabytes * 2**20 / per_layer))
    bucket_bytes = int(args.bucket_megabytes * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(
            Path(tmp),
            hidden_size=hidden,
            num_hidden_layers=layers,
            head_dim=hidden // 4,
            moe_intermediate_size=hidden,
            intermediate_size=2 * hidden,
        )
        dtype = getattr(torch, args.dtype)
        tensors = {
            k: v.to(dtype) if v.is_floating_point() else v
            for k, v in load_file(str(ckpt / "model.safetensors")).items()
        }
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        flat = torch.ones(nbytes, dtype=torch.uint8)
        raw = RawBroadcast(nbytes)
        protocols = {"ours": {}, "per_tensor": PROTOCOLS["per_tensor"]}
        protocols.update({name: PROTOCOLS[name] for name in args.variants})
        times: dict[str, list[float]] = {
            "raw": [],
            "copy": [],
            "protocol": [],
            **{k: [] for k in protocols},
        }
        small = [("model.norm.weight", tensors["model.norm.weight"])]
        try:
            with (
                EmbeddedServer(ckpt, random_seed=0, dtype=args.dtype) as server,
                contextlib.ExitStack() as stack,
            ):
                updaters = {
                    key: stack.enter_context(
                        WeightUpdater([server.client()], bucket_bytes=bucket_bytes, **options)
                    )
                    for key, options in protocols.items()
                }
                ours = updaters["ours"]
                unpacked_from, pipelined = ours.unpacked_from_bytes, ours.pipeline_requests
                for key, updater in updaters.items():
                    updater.update(tensors.items(), weight_version=f"warm-{key}")
                for i in range(args.rounds):
                    times["raw"].append(raw.seconds())
                    times["copy"].append(copy_seconds(list(tensors.values()), flat))
                    # Alternate which push goes first: on a loaded machine the one after the
                    # memcpy would otherwise always meet the same cache and scheduler state.
                    order = [(k, u, tensors.items()) for k, u in updaters.items()]
                    order.append(("protocol", ours, small))
                    for key, updater, pushed in order if i % 2 == 0 else order[::-1]:
                        times[key].append(updater.update(pushed, f"{key}-{i}").seconds)
                    print(
                        f"round {i}: "
                        + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items())
                        + f" (load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
        finally:
            raw.close()

    def figures(t: dict[str, float]) -> dict[str, float]:
        ratio = t["raw"] / t["ours"]
        ceiling = t["raw"] / (t["raw"] + 2 * t["copy"])
        return {
            "ratio": ratio,
            "ratio_ceiling": ceiling,
            "ratio_vs_ceiling": ratio / ceiling,
            "vs_per_tensor": t["per_tensor"] / t["ours"],
            "ratio_vs_ceiling_plus_protocol": (t["raw"] + 2 * t["copy"] + t["protocol"])
            / t["ours"],
        }

    best = {k: min(v) for k, v in times.items()}
    per_round = [figures({k: v[i] for k, v in times.items()}) for i in range(args.rounds)]
    median = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    result = {
        "bytes": nbytes,
        "num_tensors": len(tensors),
        "dtype": args.dtype,
        "bucket_bytes": bucket_bytes,
        "unpacked_from_bytes": unpacked_from,
        "pipeline_requests": pipelined,
        "rounds_run": args.rounds,
        **{
            f"{k}_bytes_per_s": nbytes / statistics.median(v)
            for k, v in times.items()
            if k != "protocol"
        },
        "protocol_s": statistics.median(times["protocol"]),
        **median,
        "rounds": {k: _spread([r[k] for r in per_round]) for k in per_round[0]},
        "best": figures(best),
        # Each variant's time over ours, per round (> 1: ours is faster), for the defaults.
        "variants": {
            k: _spread([v[i] / times["ours"][i] for i in range(args.rounds)])
            for k, v in times.items()
            if k in args.variants
        },
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    print(
        "medians: "
        + ", ".join(
            f"{k} {nbytes / statistics.median(v) / 1e9:.2f} GB/s"
            for k, v in times.items()
            if k != "protocol"
        )
        + f", protocol {result['protocol_s'] * 1e3:.1f} ms"
        + f"; ratio_vs_ceiling {result['ratio_vs_ceiling']:.2f}"
        + f", vs_per_tensor {result['vs_per_tensor']:.2f}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
