"""Run checkpoints: save every k steps and resume a training run exactly.

A run checkpoint ``<run_dir>/checkpoints/step_<00000012>/`` holds

- ``dist/``: one megatron-core distributed checkpoint (torch_dist) of ``{"model": ...,
  "optimizer": ...}`` (weights and Adam moments and steps), resharded on load;
- ``rng/rank_<r>.pt``: each rank's RNG states (python, numpy, torch CPU, CUDA when present,
  megatron-core's model-parallel RNG tracker);
- ``state.pt``: the run state of rank 0 (step, weight version, data position, rollout pool
  state, anything else the caller passes; must be picklable);
- ``meta.json``: step, weight version, world size and parallel layout (human-readable).

Commit protocol (crash-safe at any instant): a checkpoint is written into ``step_N.tmp``,
every file and the folder are fsynced, the folder is renamed to ``step_N`` and the rename
fsynced, and only then ``<run_dir>/checkpoints/latest`` is atomically replaced
(``os.replace`` of a fsynced ``.latest.tmp``) to name it. ``latest`` is the sole commit
point: a folder it does not name (a ``step_*.tmp``, or a ``step_N`` newer than it, left by a
crash before the pointer moved) is uncommitted, ignored on resume and removed with a log line
by the next save or resume; a run killed before its first commit resumes from scratch. So any
folder state a crash leaves is either used (committed) or ignored, never fatal.

A test hook (``set_commit_hook``) is called between the commit's steps with the phase name
(``"writing"``: the distributed checkpoint written, the rest not yet, nothing fsynced;
``"written"``, ``"renamed"``, ``"committed"``) and the step; the launch layer installs one
for crash tests, nothing else does.

Resuming restores weights, optimizer, RNG and returns the :class:`RunState`; the caller puts
the data position, rollout pool and weight version back. The RNG states are per rank: a
checkpoint resumed at another world size raises unless ``load_rng=False``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable
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
COMMIT_PHASES = ("writing", "written", "renamed", "committed")

logger = logging.getLogger(__name__)

_commit_hook: Callable[[str, int], None] | None = None


def set_commit_hook(hook: Callable[[str, int], None] | None) -> None:
    """Install ``hook(phase, step)``, called on rank 0 between the commit's steps (phases
    ``COMMIT_PHASES``: files written and fsynced / folder renamed / ``latest`` replaced).
    For crash tests only (the launch layer installs it); None removes it."""
    global _commit_hook
    _commit_hook = hook


def _at(phase: str, step: int) -> None:
    if _commit_hook is not None:
        _commit_hook(phase, step)


def _fsync_path(path: Path) -> None:
    """fsync one file or directory (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (``root`` included)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _step_of(folder: Path) -> int | None:
    """N of ``step_N`` / ``step_N.tmp``, None for other names."""
    name = folder.name.removesuffix(".tmp")
    if not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def clean_uncommitted(run_dir: str | Path) -> list[Path]:
    """Remove the checkpoint folders no commit names: every ``step_*.tmp`` and every
    ``step_N`` newer than ``latest`` (all of them when there is no ``latest``), each with a
    log line (rank 0 only; not collective). Returns the removed folders."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    latest = latest_run_checkpoint(run_dir)
    committed = -1 if latest is None else _step_of(latest)
    removed = []
    for folder in sorted(root.glob("step_*")):
        step = _step_of(folder)
        if step is None:
            continue
        if folder.name.endswith(".tmp") or step > committed:
            logger.warning(
                "removing uncommitted run checkpoint %s (latest: %s)",
                folder,
                None if latest is None else latest.name,
            )
            print(f"megatron-sat: removing uncommitted run checkpoint {folder}", flush=True)
            shutil.rmtree(folder)
            removed.append(folder)
    (root / f".{LATEST}.tmp").unlink(missing_ok=True)
    return removed


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
    if is_loading:  # a fresh distributed optimizer has no states to describe yet
        from megatron_sat.platform.distrib_optimizer_fix import init_states_for_loading

        init_states_for_loading(optimizer)
    model_sd = model_sharded_state_dict(model)
    return {
        "model": model_sd,
        # The distributed optimizer's default format (fully_sharded_model_space) is refused by
        # megatron-core 0.19's ShardedTensor ("flattened_range is not supported") and
        # fully_reshardable gathers with a literal .cuda(); dp_reshardable stores each DP
        # rank's shard (resume at the same DP size). The other optimizers ignore the key.
        "optimizer": optimizer.sharded_state_dict(
            model_sd,
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "dp_reshardable"},
        ),
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
        FileExistsError: when a committed checkpoint of this step exists already (an
            uncommitted one, left by a crash, is removed and written again).
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    error = ""
    if _rank() == 0:
        clean_uncommitted(run_dir)  # a step_N (or .tmp) of an interrupted save goes first
        if final.exists():
            error = f"{final} exists: a run checkpoint of step {step} was written already"
        else:
            (tmp / "rng").mkdir(parents=True)
    from megatron_sat.checkpoint.hf_io import broadcast_from_rank0

    error = broadcast_from_rank0(error)
    if error:
        raise FileExistsError(error)
    save_dist_checkpoint(_sharded_state(model, optimizer, is_loading=False), tmp / "dist")
    if _rank() == 0:
        _at("writing", step)  # a crash in the middle of the write
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
        _fsync_tree(tmp)
        _at("written", step)
        tmp.rename(final)
        _fsync_path(root)
        _at("renamed", step)
        pointer = root / f".{LATEST}.tmp"
        with open(pointer, "w") as f:
            f.write(final.name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, root / LATEST)  # the commit point
        _fsync_path(root)
        _at("committed", step)
        if keep_last is not None:
            done = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp"))
            for old in done[: max(0, len(done) - keep_last)]:
                shutil.rmtree(old)
    _barrier()
    return final


def latest_run_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest committed checkpoint of a run (``<run_dir>/checkpoints/latest``), or None.

    Raises:
        ValueError: when ``latest`` names a folder that is not a complete checkpoint (the
            commit protocol never leaves that: the folder was altered by hand).
    """
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.exists():
        return None
    ckpt = pointer.parent / pointer.read_text().strip()
    if not (ckpt / "meta.json").is_file():
        raise ValueError(f"{pointer} names {ckpt.name}, which holds no complete checkpoint")
    return ckpt


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
        if _rank() == 0:
            clean_uncommitted(ckpt)
        _barrier()
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
    with torch.no_grad():  # the distributed optimizer copies into its leaf main params
        optimizer.load_state_dict(loaded["optimizer"])
    from megatron_sat.platform.distrib_optimizer_fix import restore_adam_steps

    restore_adam_steps(optimizer, loaded["optimizer"])  # megatron-core 0.19 loses Adam's step
    if load_rng:
        set_rng_state(torch.load(ckpt / "rng" / f"rank_{_rank():05d}.pt", weights_only=False))
    state = torch.load(ckpt / "state.pt", weights_only=False)
    return RunState(**state)
