"""Trainer -> rollout server weight sync at TP2, EP2 and PP2 under ``torchrun --nproc_per_node=2``
(gloo, CPU). Run by ``tests/test_sync_parity.py``; rank 0 prints ``SYNC_PARITY_RESULT <json>``.

    torchrun --nproc_per_node=2 tests/dist/sync_parity.py OUT_DIR

Rank 0 writes a tiny Qwen3-MoE HF checkpoint, starts ONE embedded rollout server on it and
connects one WeightUpdater. Then per case (TP2, EP2) both ranks build the megatron-core model at
that layout and load the checkpoint plus deterministic noise (another noise per case), so the
trainer and the server start from different weights, and:

1. probe: the server samples (T = 1) from fixed prompts; both ranks run the trainer's forward
   on prompt + response (full logits, TP shards gathered) and rank 0 takes, per response token,
   ``log_softmax(logits)[token]`` -- the closest the server exposes to its logits:
   ``/generate`` returns only ``output_token_logprobs`` (``logprob_start_len`` other than -1 is
   refused, so no ``input_token_logprobs``), and at T = 1 those are exactly
   ``log_softmax(logits)`` of the sampled tokens. Max abs difference before the sync;
2. no rank holding an updater: ValueError on both ranks, nothing exported;
3. a push whose middle bucket the server rejects (a renamed tensor): both ranks raise, neither
   hangs, the server's weight_version is unchanged;
4. the real push (:func:`push_megatron_weights`, every rank), the version, and the probe again.

PP2 (``run_pp_case``): one sender per stage, rank 1 with its own updater and group.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import make_tiny_checkpoint  # noqa: E402

from megatron_sat.checkpoint.convert import build_model  # noqa: E402
from megatron_sat.checkpoint.hf_io import read_hf_config, read_hf_tensors  # noqa: E402
from megatron_sat.checkpoint.sharding import load_hf_tensors  # noqa: E402
from megatron_sat.config import ParallelConfig  # noqa: E402
from megatron_sat.platform.distributed import init_distributed  # noqa: E402
from megatron_sat.rollout.client import SamplingParams, SGLangClient  # noqa: E402
from megatron_sat.rollout.embedded.launch import EmbeddedServer  # noqa: E402
from megatron_sat.weight_sync.broadcast import WeightUpdater  # noqa: E402
from megatron_sat.weight_sync.megatron_push import push_megatron_weights  # noqa: E402

CASES = {"tp2": ParallelConfig(2, 1, 1), "ep2": ParallelConfig(1, 1, 2)}
PROMPTS = [[5, 17, 30, 8], [40, 41], [9, 9, 9, 22, 13, 3], [27, 6, 50]]
NOISE_STD = 0.05  # weights are ~N(0, 0.2): a clearly different model, still well conditioned
BUCKET_BYTES = 16 * 1024  # many buckets, so a rejected one is in the middle of the push


class RejectingUpdater(WeightUpdater):
    """Test hook: while ``reject_at`` is set, the tensor at that index of the push is renamed,
    so the server rejects its bucket (unknown parameter) part-way through the update."""

    reject_at: int | None = None

    def prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        # Both update() and send_buckets() take the tensors through prepare().
        if self.reject_at is None:
            return super().prepare(named_tensors)
        at = self.reject_at

        def renamed():
            for i, (name, tensor) in enumerate(named_tensors):
                yield (f"{name}.rejected" if i == at else name), tensor

        return super().prepare(renamed())


def set_layout(parallel: ParallelConfig) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_distributed(parallel)


def perturbed(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``tensors`` plus N(0, NOISE_STD) noise drawn in name order: identical on every rank, so
    replicated parameters stay identical across the ranks that hold them."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: tensors[name] + NOISE_STD * torch.randn(tensors[name].shape, generator=gen)
        for name in sorted(tensors)
    }


def probe(client: SGLangClient | None) -> list[dict]:
    """Rank 0 samples every prompt on the server; every rank gets the result."""
    box: list = [None]
    if client is not None:
        outs = client.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8))
        box[0] = [
            {"prompt": p, "output": o.output_ids, "logprobs": o.output_token_logprobs}
            for p, o in zip(PROMPTS, outs, strict=True)
        ]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@torch.no_grad()
def trainer_logprobs(model, probes: list[dict]) -> list[list[float]]:
    """log_softmax of the trainer's logits at each response token (collective over TP / EP)."""
    from megatron.core import parallel_state as ps

    seqs = [p["prompt"] + p["output"] for p in probes]
    # Right padding leaves the causal logits of real tokens unchanged; an even length lets
    # sequence parallelism split the sequence over 2 TP ranks.
    length = max(len(s) for s in seqs)
    length += length % 2
    ids = torch.tensor([s + [0] * (length - len(s)) for s in seqs])
    positions = torch.arange(length).expand_as(ids)
    logits = model(ids, positions, None)  # [B, S, V / TP]
    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) > 1:
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for b, p in enumerate(probes):
        start = len(p["prompt"]) - 1  # position predicting the first response token
        pos = torch.arange(start, start + len(p["output"]))
        out.append(log_probs[b, pos, torch.tensor(p["output"])].tolist())
    return out


def max_gap(model, probes: list[dict]) -> tuple[float, int]:
    """(max abs difference server vs trainer log-prob, number of response tokens compared)."""
    ours = trainer_logprobs(model, probes)
    diffs = [
        abs(a - b) for p, row in zip(probes, ours, strict=True) for a, b in zip(p["logprobs"], row)
    ]
    return max(diffs), len(diffs)


def attempt(fn) -> str | None:
    """Run ``fn``; the type and message of what it raised, or None."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def run_case(name: str, parallel: ParallelConfig, seed: int, hf_dir: Path, updater) -> dict:
    rank = dist.get_rank()
    client = updater.clients[0] if updater is not None else None
    set_layout(parallel)
    hf_config = read_hf_config(hf_dir)
    model = build_model(hf_config, parallel, torch.float32)
    load_hf_tensors(model, perturbed(read_hf_tensors(hf_dir), seed), hf_config)
    record: dict = {"rank": rank}
    record["gap_before"], _ = max_gap(model, probe(client))
    if client is not None:
        record["version_before"] = client.get_weight_version()

    record["no_holder_error"] = attempt(
        lambda: push_megatron_weights(model, hf_config, None, f"{name}-none")
    )
    if updater is not None:
        updater.reject_at = 20
    record["rejected_error"] = attempt(
        lambda: push_megatron_weights(model, hf_config, updater, f"{name}-rejected")
    )
    if updater is not None:
        updater.reject_at = None
        record["version_after_rejected"] = client.get_weight_version()

    stats = push_megatron_weights(model, hf_config, updater, f"{name}-synced")
    if stats is not None:
        record.update(num_tensors=stats.num_tensors, num_buckets=stats.num_buckets)
        record["version_after"] = client.get_weight_version()
    record["gap_after"], record["tokens_compared"] = max_gap(model, probe(client))
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return {"ranks": records}


def run_pp_case(name: str, seed: int, hf_dir: Path, updater, stage_updater) -> dict:
    """PP2, one sender per stage: rank 0 (stage 0) and rank 1 (stage 1) each push their own
    layers over their own group. The trainer side of the probe is a PP1 model loaded with the
    same weights (the PP2 stages cannot run a forward alone): the server must match it after
    the push, so both stages' layers must have arrived."""
    rank = dist.get_rank()
    client = updater.clients[0] if updater is not None else None
    hf_config = read_hf_config(hf_dir)
    weights = perturbed(read_hf_tensors(hf_dir), seed)

    def reference_gap() -> tuple[float, int]:
        set_layout(ParallelConfig())
        reference = build_model(hf_config, ParallelConfig(), torch.float32)
        load_hf_tensors(reference, weights, hf_config)
        return max_gap(reference, probe(client))

    record: dict = {"rank": rank}
    record["gap_before"], _ = reference_gap()
    if client is not None:
        record["version_before"] = client.get_weight_version()
    set_layout(CASES_PP[name])
    model = build_model(hf_config, CASES_PP[name], torch.float32)
    load_hf_tensors(model, weights, hf_config)
    mine = updater if rank == 0 else stage_updater
    record["no_holder_error"] = attempt(
        lambda: push_megatron_weights(model, hf_config, None, f"{name}-none")
    )
    record["one_stage_error"] = attempt(  # stage 1 without its sender
        lambda: push_megatron_weights(model, hf_config, stage_updater, f"{name}-one-stage")
    )
    if client is not None:
        record["version_one_stage"] = client.get_weight_version()
        updater.reject_at = 20
    record["rejected_error"] = attempt(
        lambda: push_megatron_weights(model, hf_config, mine, f"{name}-rejected")
    )
    if updater is not None:
        updater.reject_at = None
        record["version_after_rejected"] = client.get_weight_version()
    stats = push_megatron_weights(model, hf_config, mine, f"{name}-synced")
    record.update(num_tensors=stats.num_tensors, num_buckets=stats.num_buckets)
    if client is not None:
        record["version_after"] = client.get_weight_version()
    record["gap_after"], record["tokens_compared"] = reference_gap()
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return {"ranks": records}


CASES_PP = {"pp2": ParallelConfig(1, 2, 1)}


def main() -> None:
    out_dir = Path(sys.argv[1])
    init_distributed(ParallelConfig())
    rank = dist.get_rank()
    hf_dir = out_dir / "hf"
    if rank == 0:
        make_tiny_checkpoint(hf_dir, seed=0)
    dist.barrier()
    results = {}
    with contextlib.ExitStack() as stack:
        updater = None
        if rank == 0:
            server = stack.enter_context(
                EmbeddedServer(hf_dir, random_seed=0, env={"OMP_NUM_THREADS": "1"})
            )
            updater = stack.enter_context(
                RejectingUpdater([server.client()], bucket_bytes=BUCKET_BYTES)
            )
            results["num_hf_tensors"] = len(read_hf_tensors(hf_dir))
        dist.barrier()
        for seed, (name, parallel) in enumerate(CASES.items(), start=1):
            results[name] = run_case(name, parallel, seed, hf_dir, updater)
        # Stage 1's own sender: rank 1 reaches the server by its URL, over a group of its own.
        url = [updater.clients[0].base_url if updater is not None else None]
        dist.broadcast_object_list(url, src=0)
        stage_updater = None
        if rank == 1:
            stage_updater = WeightUpdater([SGLangClient(url[0])], bucket_bytes=BUCKET_BYTES)
            stack.callback(stage_updater.close)
            stage_updater.connect()
        dist.barrier()
        for seed, name in enumerate(CASES_PP, start=len(CASES) + 1):
            results[name] = run_pp_case(name, seed, hf_dir, updater, stage_updater)
    if rank == 0:
        print("SYNC_PARITY_RESULT " + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
