"""Sharded checkpoint conversion under ``torchrun --nproc_per_node=2`` (gloo, CPU).

Run by ``tests/test_checkpoint_parallel.py``; prints one line ``CKPT_RESULT <json>`` on rank 0.

For each architecture (tiny random HF checkpoint written by rank 0):
- TP2, EP2 and PP2: HF -> this rank's shards -> full HF tensors (every tensor bitwise equal on
  every rank) and the logits against transformers (max abs diff).
- EP2 -> a megatron-core distributed checkpoint -> loaded at EP1 (TP1, PP1, DP2): logits equal
  to the EP2 ones and to transformers, export bitwise equal.
- The CLI: ``convert hf-to-mcore --ep 2`` then ``convert mcore-to-hf --tp 2`` (resharding), the
  written HF checkpoint bitwise equal to the source; a second write without ``--overwrite``
  refused on every rank.

Then a run checkpoint of the real PolicyTrainer at DP2: stopped after step K and resumed in
fresh trainers, step K + 1 gives bit-identical loss and weights on both ranks (per-rank RNG).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_sat.checkpoint import convert  # noqa: E402
from megatron_sat.checkpoint.dist_ckpt import (  # noqa: E402
    load_model_checkpoint,
    save_model_checkpoint,
)
from megatron_sat.checkpoint.hf_io import (  # noqa: E402
    export_hf_tensors,
    load_hf_into_model,
    read_hf_config,
    read_hf_tensors,
)
from megatron_sat.checkpoint.tiny_models import TINY_CONFIGS, make_tiny_hf_model  # noqa: E402
from megatron_sat.config import ParallelConfig  # noqa: E402
from megatron_sat.platform.distributed import init_distributed  # noqa: E402

LAYOUTS = {
    "tp2": ParallelConfig(2, 1, 1),
    "ep2": ParallelConfig(1, 1, 2),
    "pp2": ParallelConfig(1, 2, 1),
}


def set_layout(parallel: ParallelConfig) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_distributed(parallel)


@torch.no_grad()
def forward_logits(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Full logits [B, S, V] on the last pipeline stage (TP shards gathered), None elsewhere."""
    from megatron.core import parallel_state as ps

    positions = torch.arange(ids.shape[1]).expand_as(ids)
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(ids, positions, None)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) > 1:
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, out.contiguous(), group=group)
        out = torch.cat(parts, dim=-1)
    return out


def compare_export(model, hf_config, original) -> list[str]:
    exported = dict(export_hf_tensors(model, hf_config))
    names = sorted(set(exported) | set(original))
    return [
        n
        for n in names
        if n not in exported
        or n not in original
        or exported[n].dtype != original[n].dtype
        or not torch.equal(exported[n], original[n])
    ]


def gather(record: dict) -> list[dict]:
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def summarize(records: list[dict]) -> dict:
    diffs = [r["max_abs_diff"] for r in records if r.get("max_abs_diff") is not None]
    return {
        "bitwise": all(not r["mismatch"] for r in records),
        "mismatch": sorted({m for r in records for m in r["mismatch"]})[:8],
        "max_abs_diff": max(diffs) if diffs else None,
        "num_tensors": records[0]["num_tensors"],
    }


def run_arch(arch: str, root: Path) -> dict:
    rank = dist.get_rank()
    hf_dir = root / arch / "hf"
    hf_model = make_tiny_hf_model(arch, seed=1)
    if rank == 0:
        hf_model.save_pretrained(hf_dir)
        from megatron_sat.rollout.tokenizer import build_char_tokenizer

        build_char_tokenizer().save_pretrained(hf_dir)
    dist.barrier()
    hf_config = read_hf_config(hf_dir)
    original = read_hf_tensors(hf_dir)
    torch.manual_seed(0)
    ids = torch.randint(0, hf_config["vocab_size"], (2, 10))
    with torch.no_grad():
        reference = hf_model(ids).logits
    result: dict = {}
    for name, parallel in LAYOUTS.items():
        set_layout(parallel)
        model = convert.build_model(hf_config, parallel, torch.float32)
        load_hf_into_model(model, hf_dir)
        logits = forward_logits(model, ids)
        record = {
            "mismatch": compare_export(model, hf_config, original),
            "max_abs_diff": None if logits is None else (logits - reference).abs().max().item(),
            "num_tensors": len(original),
        }
        result[name] = summarize(gather(record))
        if name == "ep2":
            ep2_logits = logits
            save_model_checkpoint(model, root / arch / "mcore_ep2", hf_config)
    # EP2 checkpoint -> EP1 (TP1, PP1, DP2).
    set_layout(ParallelConfig())
    model = convert.build_model(hf_config, ParallelConfig(), torch.float32)
    load_model_checkpoint(model, root / arch / "mcore_ep2")
    logits = forward_logits(model, ids)
    record = {
        "mismatch": compare_export(model, hf_config, original),
        "max_abs_diff": (logits - reference).abs().max().item(),
        "num_tensors": len(original),
        "vs_ep2": (logits - ep2_logits).abs().max().item(),
    }
    records = gather(record)
    result["ep2_ckpt_at_ep1"] = dict(
        summarize(records), max_abs_diff_vs_ep2=max(r["vs_ep2"] for r in records)
    )
    # The CLI, resharding EP2 -> TP2 through the distributed checkpoint.
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    mcore_dir, out_dir = root / arch / "cli_mcore", root / arch / "cli_hf"
    convert.main(
        [
            "hf-to-mcore",
            "--hf-dir",
            str(hf_dir),
            "--out-dir",
            str(mcore_dir),
            "--ep",
            "2",
            "--no-progress",
        ]
    )
    ps.destroy_model_parallel()
    convert.main(
        [
            "mcore-to-hf",
            "--mcore-dir",
            str(mcore_dir),
            "--out-dir",
            str(out_dir),
            "--tp",
            "2",
            "--no-progress",
        ]
    )
    written = read_hf_tensors(out_dir)
    cli_mismatch = [
        n
        for n in sorted(set(written) | set(original))
        if n not in written or n not in original or not torch.equal(written[n], original[n])
    ]
    refused = False
    ps.destroy_model_parallel()
    try:
        convert.main(
            [
                "mcore-to-hf",
                "--mcore-dir",
                str(mcore_dir),
                "--out-dir",
                str(out_dir),
                "--no-progress",
            ]
        )
    except FileExistsError:
        refused = True
    files = sorted(p.name for p in out_dir.iterdir())
    result["cli"] = {
        "bitwise": not cli_mismatch,
        "mismatch": cli_mismatch[:8],
        "config_equal": json.loads((out_dir / "config.json").read_text()) == hf_config,
        "has_index": "model.safetensors.index.json" in files,
        "tokenizer_copied": "tokenizer.json" in files,
        "refused_without_overwrite": all(
            gather({"r": refused, "mismatch": []})[i]["r"] for i in range(dist.get_world_size())
        ),
    }
    ps.destroy_model_parallel()
    return result


def sft_batch(vocab: int):
    """Six random samples from the global torch RNG (seeded per rank by the caller)."""
    from megatron_sat.rollout.types import Sample

    samples = []
    for i in range(6):
        tokens = torch.randint(3, vocab, (7,)).tolist()
        samples.append(Sample(i, i, "", "", tokens[:3], tokens[3:], [0.0] * 4, [0] * 4))
    return samples


def run_resume_dp2(root: Path, *, distributed_optimizer: bool, k: int = 2) -> dict:
    from megatron_sat.checkpoint.run_state import load_run_checkpoint, save_run_checkpoint
    from megatron_sat.config import TrainConfig
    from megatron_sat.training.trainer import PolicyTrainer

    hf_dir = root / "Qwen3MoeForCausalLM" / "hf"
    run_dir = root / ("run_distopt" if distributed_optimizer else "run")
    set_layout(ParallelConfig())
    hf_config = read_hf_config(hf_dir)
    vocab = hf_config["vocab_size"]
    # Both optimizers: the replicated one and megatron-core's DistributedOptimizer (the default
    # at DP2), whose load once gave every parameter one shared Adam step tensor.
    train = TrainConfig(
        lr=3e-3,
        micro_batch_size=3,
        use_r3=False,
        seed=5,
        use_distributed_optimizer=distributed_optimizer,
    )

    def trainer() -> PolicyTrainer:
        return PolicyTrainer(hf_config, train, ParallelConfig(), pad_token_id=0, load_from=hf_dir)

    torch.manual_seed(100 + dist.get_rank())
    straight = trainer()
    losses = [straight.sft_step(sft_batch(vocab))["loss"] for _ in range(k + 1)]
    torch.manual_seed(100 + dist.get_rank())
    first = trainer()
    for _ in range(k):
        first.sft_step(sft_batch(vocab))
    save_run_checkpoint(run_dir, model=first.model, optimizer=first.optimizer, step=k)
    torch.manual_seed(7)
    resumed = trainer()
    state = load_run_checkpoint(run_dir, model=resumed.model, optimizer=resumed.optimizer)
    loss = resumed.sft_step(sft_batch(vocab))["loss"]
    expected = dict(straight.model.module.named_parameters())
    different = [
        n for n, p in resumed.model.module.named_parameters() if not torch.equal(p, expected[n])
    ]
    records = gather({"loss_equal": loss == losses[k], "different": different, "step": state.step})
    return {
        "loss_equal": all(r["loss_equal"] for r in records),
        "weights_equal": all(not r["different"] for r in records),
        "different": sorted({d for r in records for d in r["different"]})[:8],
        "step": records[0]["step"],
    }


def main() -> None:
    root = Path(sys.argv[1])
    init_distributed(ParallelConfig())
    archs = sys.argv[2:] or list(TINY_CONFIGS)
    results = {arch: run_arch(arch, root) for arch in archs}
    if "Qwen3MoeForCausalLM" in archs:
        results["resume_dp2"] = run_resume_dp2(root, distributed_optimizer=False)
        results["resume_dp2_distopt"] = run_resume_dp2(root, distributed_optimizer=True)
    if dist.get_rank() == 0:
        print("CKPT_RESULT " + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
