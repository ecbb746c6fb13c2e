"""Checkpoint conversion between Hugging Face and megatron-core distributed checkpoints.

``hf-to-mcore``: an HF checkpoint directory -> a megatron-core ``dist_checkpointing``
checkpoint (``torch_dist``), saved from a model built at ``--tp/--ep/--etp/--pp``; the HF
``config.json`` and tokenizer files travel with it (``hf_config.json``, ``tokenizer/``).
``mcore-to-hf``: such a checkpoint, loaded at ``--tp/--ep/--pp`` (any layout: dist_checkpointing
reshards), -> sharded safetensors with ``model.safetensors.index.json``, ``config.json`` and the
tokenizer files.

Run in one process (TP = EP = PP = 1) or under ``torchrun --nproc_per_node=N`` with a layout that
divides N. Nothing is written into a non-empty output directory without ``--overwrite``. A
missing, extra or mis-shaped tensor fails naming it.

CLI: ``python tools/convert_checkpoint.py {hf-to-mcore,mcore-to-hf} ...`` or
``megatron-sat convert ...`` (both call :func:`main`).
"""

from __future__ import annotations

import argparse
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_sat.checkpoint.dist_ckpt import (
    MCORE_MARKER,
    load_model_checkpoint,
    read_checkpoint_hf_config,
    save_model_checkpoint,
)
from megatron_sat.checkpoint.hf_io import (
    HFTensors,
    broadcast_from_rank0,
    copy_tokenizer_files,
    export_hf_tensors,
    read_hf_config,
    write_hf_checkpoint,
)
from megatron_sat.checkpoint.hf_map import format_names
from megatron_sat.checkpoint.sharding import load_hf_tensors
from megatron_sat.config import ParallelConfig
from megatron_sat.platform.distributed import init_distributed

TOKENIZER_SUBDIR = "tokenizer"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(hf_config: dict[str, Any], override: str | None = None) -> torch.dtype:
    """Parameter dtype for a conversion: ``override``, else config.json's ``dtype`` /
    ``torch_dtype``, else float32.

    Raises:
        ValueError: for a dtype name other than float32, bfloat16, float16.
    """
    name = override or hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def build_model(hf_config: dict[str, Any], parallel: ParallelConfig, dtype: torch.dtype):
    """This rank's ``GPTModel`` for ``hf_config`` at ``parallel`` (pipeline stage from
    megatron-core's parallel state), in eval mode."""
    from megatron.core import parallel_state as ps

    from megatron_sat.models import build_gpt_model, transformer_config_from_hf

    config = transformer_config_from_hf(
        hf_config, **parallel.sizes(), params_dtype=dtype, moe_enable_routing_replay=False
    )
    return build_gpt_model(
        hf_config,
        config,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    ).eval()


def _prepare_mcore_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse a non-empty ``out_dir`` unless ``overwrite``; with it, only a previous
    megatron-core checkpoint (holding ``metadata.json``) is deleted."""
    error = ""
    if not dist.is_initialized() or dist.get_rank() == 0:
        if out_dir.exists() and any(out_dir.iterdir()):
            if not overwrite:
                error = f"{out_dir} exists and is not empty (pass --overwrite)"
            elif not (out_dir / MCORE_MARKER).exists():
                error = f"{out_dir} is not a megatron-core checkpoint; refusing to delete it"
            else:
                shutil.rmtree(out_dir)
    error = broadcast_from_rank0(error)
    if error:
        raise FileExistsError(error)


class _Without(Mapping[str, torch.Tensor]):
    """``tensors`` without the names that fully match ``pattern``."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], pattern: str) -> None:
        regex = re.compile(pattern)
        self.tensors = tensors
        self.dropped = sorted(k for k in tensors if regex.fullmatch(k))
        self._dropped = set(self.dropped)
        self._keys = [k for k in tensors if not regex.fullmatch(k)]

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._dropped:
            raise KeyError(key)
        return self.tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def hf_to_mcore_checkpoint(
    hf_dir: str | Path,
    out_dir: str | Path,
    parallel: ParallelConfig | None = None,
    *,
    overwrite: bool = False,
    dtype: str | None = None,
    drop_hf_tensors: str | None = None,
    progress: bool = True,
) -> Path:
    r"""Convert an HF checkpoint into a megatron-core distributed checkpoint (collective).

    Args:
        hf_dir: HF checkpoint directory (``config.json``, ``*.safetensors``, tokenizer).
        out_dir: output directory (created; must be empty unless ``overwrite``).
        parallel: the layout the model is built at while saving (any layout loads it);
            default TP = EP = PP = 1.
        overwrite: replace a previous megatron-core checkpoint in ``out_dir``.
        dtype: parameter dtype name; default config.json's ``dtype``.
        drop_hf_tensors: a regex; HF tensors whose name fully matches it are left out on
            purpose (e.g. DeepSeek-V3's multi-token-prediction layer ``model\.layers\.61\..*``,
            which the model does not build) and listed on stdout. Every other tensor must map.
        progress: show a progress bar on rank 0.

    Raises:
        FileExistsError: for a non-empty ``out_dir`` without ``overwrite``.
        ValueError: for missing, unused or mis-shaped HF tensors (named), an unsupported
            architecture or config value, or a ``drop_hf_tensors`` that matches nothing.
    """
    parallel = parallel or ParallelConfig()
    hf_config = read_hf_config(hf_dir)
    init_distributed(parallel)
    out = Path(out_dir)
    _prepare_mcore_dir(out, overwrite)
    model = build_model(hf_config, parallel, checkpoint_dtype(hf_config, dtype))
    tensors: Mapping[str, torch.Tensor] = HFTensors(hf_dir)
    if drop_hf_tensors is not None:
        tensors = _Without(tensors, drop_hf_tensors)
        if not tensors.dropped:
            raise ValueError(f"--drop-hf-tensors {drop_hf_tensors!r} matches no tensor")
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"dropping {len(tensors.dropped)} HF tensors: {format_names(tensors.dropped)}")
    load_hf_tensors(model, tensors, hf_config, progress=progress)
    save_model_checkpoint(model, out, hf_config)
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out / TOKENIZER_SUBDIR).mkdir(exist_ok=True)
        copy_tokenizer_files(hf_dir, out / TOKENIZER_SUBDIR)
    if dist.is_initialized():
        dist.barrier()
    return out


def mcore_to_hf_checkpoint(
    mcore_dir: str | Path,
    out_dir: str | Path,
    parallel: ParallelConfig | None = None,
    *,
    overwrite: bool = False,
    dtype: str | None = None,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    progress: bool = True,
) -> Path:
    """Convert a megatron-core distributed checkpoint (from :func:`hf_to_mcore_checkpoint` or
    a run) into an HF checkpoint (collective; rank 0 writes).

    Args:
        mcore_dir: the distributed checkpoint (with ``hf_config.json``).
        out_dir: output directory (must be empty unless ``overwrite``).
        parallel: the layout to load at (may differ from the saving one); default 1/1/1.
        overwrite: replace the checkpoint files in ``out_dir``.
        dtype: parameter dtype name; default config.json's ``dtype``.
        tokenizer_dir: where the tokenizer files come from; default the checkpoint's
            ``tokenizer/``.
        max_shard_bytes: largest safetensors shard.
        progress: show a progress bar on rank 0.

    Raises:
        FileExistsError: for a non-empty ``out_dir`` without ``overwrite``.
        FileNotFoundError: when ``mcore_dir`` is not such a checkpoint.
        CheckpointingException: for tensors missing from, or extra in, the checkpoint.
    """
    parallel = parallel or ParallelConfig()
    hf_config = read_checkpoint_hf_config(mcore_dir)
    init_distributed(parallel)
    model = build_model(hf_config, parallel, checkpoint_dtype(hf_config, dtype))
    load_model_checkpoint(model, mcore_dir)
    tokenizer = Path(tokenizer_dir) if tokenizer_dir else Path(mcore_dir) / TOKENIZER_SUBDIR
    return write_hf_checkpoint(
        export_hf_tensors(model, hf_config),
        hf_config,
        out_dir,
        tokenizer_dir=tokenizer if tokenizer.exists() else None,
        overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
        progress=progress,
    )


def _parse_size(text: str) -> int:
    units = {"KB": 1024, "MB": 1024**2, "GB": 1024**3}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """The ``convert`` argument parser (subcommands ``hf-to-mcore`` and ``mcore-to-hf``)."""
    parser = argparse.ArgumentParser(
        prog="megatron-sat convert", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="direction", required=True)
    for name, src, help_text in (
        ("hf-to-mcore", "--hf-dir", "HF checkpoint -> megatron-core dist checkpoint"),
        ("mcore-to-hf", "--mcore-dir", "megatron-core dist checkpoint -> HF checkpoint"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(src, required=True, help="source checkpoint directory")
        p.add_argument("--out-dir", required=True, help="output directory")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of this run")
        p.add_argument("--ep", type=int, default=1, help="expert-parallel size of this run")
        p.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of this run")
        p.add_argument("--dtype", choices=sorted(_DTYPES), help="default: config.json dtype")
        p.add_argument("--overwrite", action="store_true", help="replace an existing output")
        p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
        if name == "hf-to-mcore":
            p.add_argument(
                "--drop-hf-tensors",
                metavar="REGEX",
                help="leave out HF tensors whose name fully matches (e.g. MTP layers)",
            )
        if name == "mcore-to-hf":
            p.add_argument("--tokenizer-dir", help="default: the checkpoint's tokenizer/")
            p.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megatron-sat convert`` / ``tools/convert_checkpoint.py``.

    Initialises torch.distributed (from torchrun's environment, or a 1-process world) and
    tears it down again when it was not initialised before. Returns 0; errors raise.
    """
    args = build_parser().parse_args(argv)
    parallel = ParallelConfig(args.tp, args.pp, args.ep, args.etp)
    owns_world = not dist.is_initialized()
    try:
        if args.direction == "hf-to-mcore":
            hf_to_mcore_checkpoint(
                args.hf_dir,
                args.out_dir,
                parallel,
                overwrite=args.overwrite,
                dtype=args.dtype,
                drop_hf_tensors=args.drop_hf_tensors,
                progress=not args.no_progress,
            )
        else:
            mcore_to_hf_checkpoint(
                args.mcore_dir,
                args.out_dir,
                parallel,
                overwrite=args.overwrite,
                dtype=args.dtype,
                tokenizer_dir=args.tokenizer_dir,
                max_shard_bytes=_parse_size(args.max_shard_size),
                progress=not args.no_progress,
            )
    finally:
        if owns_world and dist.is_initialized():
            from megatron_sat.platform.distributed import destroy_distributed

            destroy_distributed()
    return 0
