"""megatron-core distributed checkpoints (``dist_checkpointing``, ``torch_dist`` format) of a
model, resharded on load: the TP / EP / PP of the saving and the loading run may differ.

A checkpoint directory holds megatron-core's files (``metadata.json``, ``.metadata``,
``*.distcp``, ``common.pt``) plus our ``hf_config.json`` (the model's HF ``config.json``) so that
it can be exported to HF without other inputs.

CPU notes (megatron-core 0.19.2, gloo; measured, see docs/ARCHITECTURE.md): saving calls
``torch.cuda.synchronize`` (a no-op after :func:`megatron_sat.platform.apply_cpu_shims`) and
needs the directory to exist beforehand (created here on rank 0, then a barrier). Its file
writer also needs ``psutil``, which the pinned CPU environment lacks: see
:func:`apply_dist_checkpointing_fixes`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_sat.checkpoint.safe_dcp import restricted_dcp_loading
from megatron_sat.checkpoint.sharding import unwrap

HF_CONFIG_FILE = "hf_config.json"
MCORE_MARKER = "metadata.json"


SUPPORTED_MEGATRON_CORE = ("0.19.",)


@functools.cache
def apply_dist_checkpointing_fixes() -> bool:
    """Make ``dist_checkpointing.save`` work without ``psutil``. Idempotent; returns whether
    anything was patched.

    megatron-core 0.19.2's ``strategies/filesystem_async.py`` calls ``_process_memory()``
    (``psutil.Process().memory_info().rss``) before and after writing each file, only for a
    debug log line, and raises ``RuntimeError("psutil is not installed")`` inside the writer
    (seen as ``CheckpointException ... Worker failure``) when psutil is absent, as in our pinned
    CPU environment. Without psutil the probe reports 0 bytes. Nothing is patched when psutil
    is installed.

    Raises:
        RuntimeError: for a megatron-core version the fix was not measured against.
    """
    import megatron.core
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async.HAVE_PSUTIL:
        return False
    if not megatron.core.__version__.startswith(SUPPORTED_MEGATRON_CORE):
        raise RuntimeError(
            f"megatron-core {megatron.core.__version__}: {__name__}'s psutil fix was measured "
            f"against {SUPPORTED_MEGATRON_CORE}; install psutil or megatron-core==0.19.2"
        )
    filesystem_async._process_memory = lambda: 0
    return True


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def model_sharded_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """megatron-core's sharded state dict of this rank's model (wrappers removed)."""
    return unwrap(model).sharded_state_dict()


def save_dist_checkpoint(state: Mapping[str, Any], ckpt_dir: str | Path) -> Path:
    """``dist_checkpointing.save`` of a sharded state dict into ``ckpt_dir`` (collective).

    The directory is created on rank 0 first (megatron-core requires it to exist).
    """
    from megatron.core import dist_checkpointing

    from megatron_sat.platform.lifetime import fork_manager_for_dist_checkpointing

    apply_dist_checkpointing_fixes()
    fork_manager_for_dist_checkpointing()  # its writer's helper process dies with us
    out = Path(ckpt_dir)
    if _is_rank0():
        out.mkdir(parents=True, exist_ok=True)
    _barrier()
    dist_checkpointing.save(dict(state), str(out))
    _barrier()
    return out


def load_dist_checkpoint(state: Mapping[str, Any], ckpt_dir: str | Path) -> dict[str, Any]:
    """``dist_checkpointing.load`` with every missing or unexpected key an error, reading
    ``.metadata`` and the checkpoint's objects without running code from them
    (``checkpoint.safe_dcp``).

    Raises:
        FileNotFoundError: when ``ckpt_dir`` is not a megatron-core distributed checkpoint.
        megatron.core.dist_checkpointing.core.CheckpointingException: for keys missing from
            the checkpoint or present only there (megatron-core names them).
        UnsafeMetadataError: a ``.metadata`` or an object that would need code to load,
            naming the file or the object.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    path = Path(ckpt_dir)
    if not (path / MCORE_MARKER).exists():
        raise FileNotFoundError(f"{path} is not a megatron-core distributed checkpoint")
    with restricted_dcp_loading():
        return dist_checkpointing.load(dict(state), str(path), strict=StrictHandling.RAISE_ALL)


def save_model_checkpoint(
    model: torch.nn.Module, ckpt_dir: str | Path, hf_config: Mapping[str, Any]
) -> Path:
    """Save this rank's model into a distributed checkpoint with ``hf_config.json`` (collective).

    Returns:
        ``ckpt_dir``.
    """
    out = save_dist_checkpoint(model_sharded_state_dict(model), ckpt_dir)
    if _is_rank0():
        (out / HF_CONFIG_FILE).write_text(json.dumps(dict(hf_config), indent=2) + "\n")
    _barrier()
    return out


def load_model_checkpoint(model: torch.nn.Module, ckpt_dir: str | Path) -> None:
    """Load a distributed model checkpoint into this rank's model at its own TP/EP/PP
    (collective). The checkpoint may have been saved at another layout.

    Raises:
        FileNotFoundError, CheckpointingException: as :func:`load_dist_checkpoint`.
    """
    inner = unwrap(model)
    state = load_dist_checkpoint(inner.sharded_state_dict(), ckpt_dir)
    inner.load_state_dict(state, strict=True)


def read_checkpoint_hf_config(ckpt_dir: str | Path) -> dict[str, Any]:
    """The HF ``config.json`` stored with a distributed checkpoint.

    Raises:
        FileNotFoundError: when the checkpoint has no ``hf_config.json``.
    """
    path = Path(ckpt_dir) / HF_CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: not written by megatron-sat convert")
    return json.loads(path.read_text())
