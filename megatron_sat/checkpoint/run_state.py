"""Run checkpoints: save every k steps and resume a training run exactly.

A run checkpoint ``<run_dir>/checkpoints/step_<00000012>/`` holds

- ``dist/``: one megatron-core distributed checkpoint (torch_dist) of ``{"model": ...,
  "optimizer": ...}`` (weights and Adam moments and steps), resharded on load;
- ``rng/rank_<r>.pt``: each rank's RNG states (python, numpy, torch CPU, CUDA when present,
  megatron-core's model-parallel RNG tracker);
- ``state.pt``: the run state of rank 0 (step, weight version, data position, rollout pool
  state, anything else the caller passes; must be picklable);
- ``meta.json``: step, weight version, world size and parallel layout (human-readable).

``<run_dir>/checkpoints/latest`` names the newest complete checkpoint; it is replaced only
after every file of a new checkpoint is written (written into ``step_*.tmp`` first, then
renamed), so an interrupted save never becomes ``latest``.

Resuming restores weights, optimizer, RNG and returns the :class:`RunState`; the caller puts
the data position, rollout pool and weight version back. The RNG states are per rank: a
checkpoint resumed at another world size raises unless ``load_rng=False``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_sat.checkpoint.dist_ckpt import (
    load_dist_checkpoint,
    model_sharded_state_dict,
    save_dist_checkpoint,
)
from megatron_sat.checkpoint.sharding import unwrap

CHECKPOINTS = "checkpoints"
LATEST = "latest"


@dataclass
class RunState:
    """What a resumed run needs besides weights, optimizer and RNG.

    Attributes:
        step: optimizer steps completed when the checkpoint was written.
        weight_version: the policy version last synced to the rollout servers.
        data_state: the data position (e.g. ``{"epoch": 2, "offset": 96, "seed": 0}``).
        rollout_state: the rollout pool's state (admitted but unconsumed samples with their
            versions), as the pool exports it.
        extra: anything else (picklable).
    """

    step: int
    weight_version: int = 0
    data_state: dict[str, Any] = field(default_factory=dict)
    rollout_state: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def should_save(step: int, every: int) -> bool:
    """Whether to checkpoint after optimizer step ``step`` (1-based) when saving every
    ``every`` steps (``every`` <= 0: never)."""
    return every > 0 and step > 0 and step % every == 0


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "world_size": _world(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
    }


def rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU, CUDA (when present) and
    megatron-core's RNG tracker (``get_cuda_rng_tracker().get_states()``)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned.

    Raises:
        ValueError: when the state holds CUDA states and this machine has no CUDA or the
            reverse.
    """
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    if ("cuda" in state) != torch.cuda.is_available():
        raise ValueError("RNG state and this machine disagree about CUDA")
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _sharded_state(model, optimizer, *, is_loading: bool) -> dict[str, Any]:
    model_sd = model_sharded_state_dict(model)
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
    }


def save_run_checkpoint(
    run_dir: str | Path,
    *,
    model: torch.nn.Module,
    optimizer,
    step: int,
    weight_version: int = 0,
    data_state: dict[str, Any] | None = None,
    rollout_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write a run checkpoint after optimizer step ``step`` (collective: every rank calls it).

    Args:
        run_dir: the run's directory; checkpoints go to ``<run_dir>/checkpoints/``.
        model: the megatron-core model (DDP-wrapped or not).
        optimizer: its megatron-core optimizer (``get_megatron_optimizer``).
        step: optimizer steps completed.
        weight_version, data_state, rollout_state, extra: see :class:`RunState` (rank 0's
            values are written).
        keep_last: delete all but the newest ``keep_last`` checkpoints (None keeps all).

    Returns:
        The checkpoint directory ``<run_dir>/checkpoints/step_<step>``.

    Raises:
        FileExistsError: when a checkpoint of this step exists already.
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    error = ""
    if _rank() == 0:
        if final.exists():
            error = f"{final} exists: a run checkpoint of step {step} was written already"
        else:
            shutil.rmtree(tmp, ignore_errors=True)  # a save interrupted before
            (tmp / "rng").mkdir(parents=True)
    from megatron_sat.checkpoint.hf_io import broadcast_from_rank0

    error = broadcast_from_rank0(error)
    if error:
        raise FileExistsError(error)
    save_dist_checkpoint(_sharded_state(model, optimizer, is_loading=False), tmp / "dist")
    torch.save(rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
    if _rank() == 0:
        state = RunState(
            step=step,
            weight_version=weight_version,
            data_state=data_state or {},
            rollout_state=rollout_state or {},
            extra=extra or {},
        )
        torch.save(asdict(state), tmp / "state.pt")
        meta = {"step": step, "weight_version": weight_version, **_layout()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _barrier()
    if _rank() == 0:
        tmp.rename(final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / LATEST)
        if keep_last is not None:
            done = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp"))
            for old in done[: max(0, len(done) - keep_last)]:
                shutil.rmtree(old)
    _barrier()
    return final


def latest_run_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (``<run_dir>/checkpoints/latest``), or None."""
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.exists():
        return None
    return pointer.parent / pointer.read_text().strip()


def load_run_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer,
    load_rng: bool = True,
) -> RunState:
    """Restore model, optimizer and (by default) RNG from a run checkpoint; return its state
    (collective: every rank calls it).

    Args:
        path: a checkpoint directory (``.../step_00000012``) or a run directory (its latest
            checkpoint is used).
        model, optimizer: freshly built, at any parallel layout (weights and optimizer state
            are resharded); RNG states need the saving world size.
        load_rng: restore this rank's RNG states.

    Raises:
        FileNotFoundError: when ``path`` holds no run checkpoint.
        ValueError: when ``load_rng`` and the world size differs from the saving run's.
        CheckpointingException: for model or optimizer tensors missing from, or extra in,
            the checkpoint (megatron-core names them).
    """
    ckpt = Path(path)
    if not (ckpt / "meta.json").exists():
        latest = latest_run_checkpoint(ckpt)
        if latest is None:
            raise FileNotFoundError(f"{path} holds no run checkpoint (no meta.json, no latest)")
        ckpt = latest
    meta = json.loads((ckpt / "meta.json").read_text())
    if load_rng and meta["world_size"] != _world():
        raise ValueError(
            f"{ckpt} was saved by {meta['world_size']} ranks, this run has {_world()}: RNG "
            "states cannot be mapped (pass load_rng=False to resume without them)"
        )
    loaded = load_dist_checkpoint(_sharded_state(model, optimizer, is_loading=True), ckpt / "dist")
    unwrap(model).load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    if load_rng:
        set_rng_state(torch.load(ckpt / "rng" / f"rank_{_rank():05d}.pt", weights_only=False))
    state = torch.load(ckpt / "state.pt", weights_only=False)
    return RunState(**state)
