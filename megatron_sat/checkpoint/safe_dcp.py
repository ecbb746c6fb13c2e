"""Distributed checkpoints read without running code from the run folder.

torch's checkpoint reader (torch 2.13, ``torch.distributed.checkpoint``) runs code from two
kinds of file of a megatron-core ``torch_dist`` checkpoint:

- ``.metadata``: ``FileSystemReader.read_metadata`` is a plain ``pickle.load``: a crafted
  file runs any function it names (reproduced: a shell command ran on resume);
- the bytes items of ``*.distcp`` (megatron-core's ``ShardedObject``\\ s: the layers'
  ``_extra_state``, optimizer objects): ``DefaultLoadPlanner.load_bytes`` is
  ``torch.load(weights_only=False)``.

:func:`restricted_dcp_loading` routes both through restricted loaders for the duration of one
load, which megatron-core's loading (``dist_checkpointing.load``, its
``TorchDistLoadShardedStrategy`` and ``MCoreLoadPlanner``, megatron-core 0.19) goes through:

- ``.metadata`` with :class:`MetadataUnpickler`, which rebuilds only the classes a DCP
  ``Metadata`` is made of (``METADATA_GLOBALS``: the metadata and save-plan dataclasses,
  ``torch.Size``, torch dtypes, ``torch.serialization._get_layout``) and refuses any other
  global, naming the file and the global, before anything is called;
- bytes items with ``torch.load(weights_only=True)`` (plain data and tensors; megatron-core's
  local layers save ``None`` as their extra state).

Why patches: neither torch's reader nor megatron-core's strategy takes an unpickler or a
planner to use (megatron-core builds ``FileSystemReader`` and ``MCoreLoadPlanner`` itself).
The patch replaces two methods on torch's classes (so every subclass megatron-core uses gets
them) inside the ``with`` block only, and ``tests/test_safe_dcp.py`` fails when torch's
``read_metadata`` / ``load_bytes`` stop being what is replaced.

What it does not cover: transformer-engine's own ``set_extra_state`` unpickles the fp8
metadata it finds in its ``_extra_state`` tensor (GPU runs with TE layers); the manifest
(``checkpoint.manifest``) catches such a file changed after the save, not one forged together
with its manifest.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_DCP = "torch.distributed.checkpoint"
# (module, name) of every global a torch 2.13 DCP ``.metadata`` written by megatron-core holds
# (read off real checkpoints), plus the load-plan twins of the save-plan classes.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [
        *(
            (f"{_DCP}.metadata", name)
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        *(
            (f"{_DCP}.planner", name)
            for name in ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")
        ),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
    ]
)


class UnsafeMetadataError(pickle.UnpicklingError):
    """A checkpoint's ``.metadata`` names a global outside ``METADATA_GLOBALS``, or one of its
    objects needs more than plain data and tensors."""


# The refusals of the load in progress (restricted_dcp_loading): torch's loader wraps every
# rank's exception into its CheckpointException; the block raises the refusal itself.
_refused: list[UnsafeMetadataError] = []


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that finds only ``METADATA_GLOBALS`` and torch dtypes.

    Args:
        file: the binary stream of ``.metadata``.
        where: the file's path, for the error.
    """

    def __init__(self, file: io.BufferedIOBase, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        error = UnsafeMetadataError(
            f"{self.where}: refers to {module}.{name}, which a distributed checkpoint's "
            "metadata never holds; refused without loading it (a crafted file would run code)"
        )
        _refused.append(error)
        raise error


def read_dcp_metadata(path: str | Path) -> Any:
    """The ``Metadata`` of a DCP ``.metadata`` file, through :class:`MetadataUnpickler`.

    Raises:
        UnsafeMetadataError: naming the file and the global it refers to.
        FileNotFoundError: when the file is missing.
    """
    with open(path, "rb") as f:
        return MetadataUnpickler(f, str(path)).load()


def _read_metadata(self, *args: Any, **kwargs: Any) -> Any:
    """``FileSystemReader.read_metadata`` through :class:`MetadataUnpickler` (same file, same
    ``storage_meta`` bookkeeping as torch's)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        metadata = MetadataUnpickler(stream, str(path)).load()
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``torch.load(weights_only=True)``."""
    from torch.distributed.checkpoint._traverse import set_element

    try:
        loaded = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        error = UnsafeMetadataError(
            f"checkpoint object {read_item.dest_index.fqn!r}: not plain data and tensors, "
            f"refused without loading it: {e}"
        )
        _refused.append(error)
        raise error from e
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
    else:
        self.state_dict[read_item.dest_index.fqn] = loaded


@contextlib.contextmanager
def restricted_dcp_loading() -> Iterator[None]:
    """Inside the block, torch's DCP reader reads ``.metadata`` and bytes items through the
    restricted loaders (module docstring); torch's methods come back after it.

    Raises:
        UnsafeMetadataError: when the block fails after a refusal (torch wraps it in its
            ``CheckpointException``; the refusal is raised instead, from it).
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    saved = (FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes)
    FileSystemReader.read_metadata = _read_metadata
    DefaultLoadPlanner.load_bytes = _load_bytes
    _refused.clear()
    try:
        yield
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if _refused and not isinstance(e, (UnsafeMetadataError, KeyboardInterrupt, SystemExit)):
            raise _refused[0] from e
        raise
    finally:
        FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = saved
        _refused.clear()
