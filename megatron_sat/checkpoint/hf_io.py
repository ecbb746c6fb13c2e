"""Load and save Hugging Face checkpoints (sharded safetensors + index, config.json, tokenizer)
for a megatron-core model at any TP / EP / PP (see :mod:`megatron_sat.checkpoint.sharding`).

With a world of one process these are plain single-rank functions; under torchrun every rank
must call them (they run collectives), and only global rank 0 writes files.

A written checkpoint gets ``manifest.json`` (every file with its size and SHA-256, see
:mod:`megatron_sat.checkpoint.manifest`) after its files; :func:`verify_hf_checkpoint` checks
it, and :func:`load_hf_into_model` verifies a checkpoint that has one before reading it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_sat.checkpoint import manifest, sharding

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF checkpoint directory."""
    return json.loads((Path(path) / "config.json").read_text())


def current_umask() -> int:
    """This process's umask, read from ``/proc/self/status`` (Linux >= 4.7) without changing
    it; elsewhere via ``os.umask`` set-and-restore (racy only against a concurrent umask)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class HFTensors(Mapping[str, torch.Tensor]):
    """The tensors of an HF checkpoint directory by on-disk name, read lazily (one tensor per
    access, from whichever ``*.safetensors`` file holds it).

    Raises:
        FileNotFoundError: when the directory holds no safetensors file.
        ValueError: when two files hold the same tensor name, or the index names a tensor or
            file that is not there.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {self.path}")
        self._file_of: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key in self._file_of:
                        raise ValueError(f"tensor {key!r} appears twice ({file.name})")
                    self._file_of[key] = file
        index = self.path / INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            wrong = {k for k, f in weight_map.items() if self._file_of.get(k, Path()).name != f}
            if wrong or set(weight_map) != set(self._file_of):
                extra = set(self._file_of) - set(weight_map)
                raise ValueError(f"{index} disagrees with the shards: {sorted(wrong | extra)[:8]}")

    def __getitem__(self, key: str) -> torch.Tensor:
        with safe_open(str(self._file_of[key]), framework="pt") as f:
            return f.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def read_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path``, by on-disk name (in memory).

    Raises:
        FileNotFoundError, ValueError: as :class:`HFTensors`.
    """
    return dict(HFTensors(path).items())


def verify_hf_checkpoint(path: str | Path) -> bool:
    """Check every file of an HF checkpoint against its ``manifest.json`` (in this process).

    Returns:
        True when it verifies, False when it has no manifest (written elsewhere, or before
        manifests: nothing to verify against).

    Raises:
        ValueError: naming each file that is missing, of another size or checksum, or not in
            the manifest (and the checkpoint).
    """
    has_manifest, problems = manifest.verify_checkpoint_dir(path)
    if problems:
        raise ValueError(f"HF checkpoint {path} fails verification: " + "; ".join(problems))
    return has_manifest


def load_hf_into_model(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the HF checkpoint at ``path`` into this rank's shards of ``model``, in place,
    after verifying it when it has a ``manifest.json`` (each rank verifies; one without is
    loaded as it is: HF checkpoints from elsewhere carry none).

    Collective under torchrun (see :func:`megatron_sat.checkpoint.sharding.load_hf_tensors`).

    Raises:
        ValueError: for missing, unused or mis-shaped tensors, naming them; for a checkpoint
            that fails verification, naming the file and reason.
    """
    verify_hf_checkpoint(path)
    sharding.load_hf_tensors(model, HFTensors(path), read_hf_config(path))


def export_hf_tensors(
    model: torch.nn.Module, hf_config: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` of the whole model on every rank, at any TP/EP/PP.

    See :func:`megatron_sat.checkpoint.sharding.export_hf_tensors` (every rank must iterate to
    the end; tensors may alias the parameters).
    """
    return sharding.export_hf_tensors(model, hf_config)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def prepare_output_dir(out_dir: str | Path, *, overwrite: bool, marker: Iterable[str]) -> Path:
    """Check (and with ``overwrite`` clear) an output directory on rank 0.

    A directory that exists and is not empty is refused unless ``overwrite``; with it, the
    files matching the ``marker`` globs (the previous checkpoint's files) are removed and other
    files are kept.

    Raises:
        FileExistsError: naming the directory when it is not empty and ``overwrite`` is False.
    """
    out = Path(out_dir)
    error = ""
    if _is_rank0():
        if out.exists() and any(out.iterdir()) and not overwrite:
            error = f"{out} exists and is not empty (pass overwrite / --overwrite)"
        else:
            out.mkdir(parents=True, exist_ok=True)
            for pattern in marker if overwrite else ():
                for stale in out.glob(pattern):
                    shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    error = broadcast_from_rank0(error)
    if error:
        raise FileExistsError(error)
    return out


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (picklable; the value itself without a world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class ShardWriter:
    """Writes ``(name, tensor)`` pairs into safetensors shards of at most ``max_shard_bytes``
    (a tensor larger than that gets a shard of its own) and, on :meth:`close`, renames them
    ``model-0000i-of-0000N.safetensors`` (``model.safetensors`` when there is one) and writes
    ``model.safetensors.index.json`` (``metadata.total_size`` in bytes, ``weight_map``)."""

    def __init__(self, out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.out, self.max_bytes = out_dir, max_shard_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._files: list[Path] = []
        self._file_of: dict[str, int] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor (copied) for the current shard.

        Raises:
            ValueError: when ``name`` was already written.
        """
        if name in self._file_of or name in self._shard:
            raise ValueError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._shard and self._shard_bytes + size > self.max_bytes:
            self._flush()
        self._shard[name] = tensor.detach().contiguous().clone()
        self._shard_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.out / f".shard-{len(self._files):05d}.safetensors.tmp"
        save_file(self._shard, str(path), metadata={"format": "pt"})
        # safetensors creates the file 0600 (a private temp file it persists); give it the
        # mode open() would, so the user's umask decides who can read the checkpoint.
        os.chmod(path, 0o666 & ~current_umask())
        for name in self._shard:
            self._file_of[name] = len(self._files)
        self._files.append(path)
        self._shard, self._shard_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, name the shards, write the index; returns the shard paths."""
        if self._shard or not self._files:
            self._flush()
        n = len(self._files)
        names = [self.out / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        if n == 1:  # transformers' name for an unsharded checkpoint
            names = [self.out / "model.safetensors"]
        for tmp, final in zip(self._files, names, strict=True):
            tmp.rename(final)
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {k: names[i].name for k, i in sorted(self._file_of.items())},
        }
        (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names


def copy_tokenizer_files(src_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer files present in ``src_dir`` (see :data:`TOKENIZER_FILES`) into
    ``out_dir``; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(src_dir) / name
        if src.exists() and src.resolve() != (Path(out_dir) / name).resolve():
            shutil.copy(src, Path(out_dir) / name)
            copied.append(name)
    return copied


HF_CHECKPOINT_FILES = (
    "*.safetensors",
    INDEX,
    "config.json",
    ".shard-*.tmp",
    manifest.MANIFEST,
)


def write_hf_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]],
    hf_config: Mapping[str, Any],
    out_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = False,
) -> Path:
    """Write ``(hf_name, tensor)`` pairs as an HF checkpoint: sharded safetensors with index,
    ``config.json``, the tokenizer files of ``tokenizer_dir`` and, after them (fsynced),
    ``manifest.json`` of every file in ``out_dir``. Rank 0 writes; other ranks
    consume ``tensors`` (it may be a collective iterator) and write nothing. Tensors are
    written as they come (one shard in memory at a time).

    Raises:
        FileExistsError: when ``out_dir`` is not empty and ``overwrite`` is False.
        ValueError: when a tensor name repeats.
    """
    from tqdm import tqdm

    out = prepare_output_dir(out_dir, overwrite=overwrite, marker=HF_CHECKPOINT_FILES)
    writer = ShardWriter(out, max_shard_bytes) if _is_rank0() else None
    bar = tqdm(tensors, desc="write HF", unit="tensor", disable=not (progress and _is_rank0()))
    for name, tensor in bar:
        if writer is not None:
            writer.add(name, tensor)
    if writer is not None:
        writer.close()
        (out / "config.json").write_text(json.dumps(dict(hf_config), indent=2) + "\n")
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, out)
        write_hf_manifest(out)
    if dist.is_initialized():
        dist.barrier()
    return out


def write_hf_manifest(out_dir: str | Path) -> Path:
    """fsync every file of ``out_dir``, then write its ``manifest.json`` (fsynced, with the
    folder). Files kept from before (``overwrite``) are listed too: the manifest describes
    the folder as it is."""
    out = Path(out_dir)
    rels = manifest.list_files(out)
    for rel in rels:
        fd = os.open(out / rel, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    path = manifest.write_manifest(out, [manifest.hash_files(out, rels)])
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def save_model_as_hf(
    model: torch.nn.Module,
    hf_config: dict[str, Any],
    out_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write ``model`` (any TP/EP/PP; collective) as an HF checkpoint that
    ``AutoModelForCausalLM.from_pretrained`` loads: safetensors shards (per-expert keys;
    ``model.safetensors`` when one shard suffices) with ``model.safetensors.index.json``,
    ``config.json``, from ``tokenizer_dir``, the tokenizer files, and ``manifest.json``
    (:func:`verify_hf_checkpoint`).

    With ``overwrite`` the previous checkpoint files of ``out_dir`` are replaced and other files
    (a tokenizer saved there first) kept.

    Raises:
        FileExistsError: when ``out_dir`` is not empty and ``overwrite`` is False.
    """
    return write_hf_checkpoint(
        export_hf_tensors(model, hf_config),
        hf_config,
        out_dir,
        tokenizer_dir=tokenizer_dir,
        overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
    )
