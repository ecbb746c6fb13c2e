"""Run checkpoints: save every k steps and resume a training run exactly.

A run checkpoint ``<run_dir>/checkpoints/step_<00000012>/`` holds

- ``dist/``: one megatron-core distributed checkpoint (torch_dist) of ``{"model": ...,
  "optimizer": ...}`` (weights and Adam moments and steps), resharded on load;
- ``rng/rank_<r>.pt``: each rank's RNG states (python, numpy, torch CPU, CUDA when present,
  megatron-core's model-parallel RNG tracker), as plain data and tensors;
- ``state.pt``: the run state of rank 0 (step, weight version, data position, rollout pool
  state, anything else the caller passes: plain data, tensors, numeric numpy arrays), written
  as plain data and tensors (:mod:`megatron_sat.checkpoint.safe_files`);
- ``pending_batch/rank_<r>.pt`` (only in ``step_N_mini_j``, written by a stop in the middle
  of rollout batch N + 1 after its j-th optimizer step): each rank's share of the pending
  rollout batch (samples, advantages, old log-probs, steps done: ``RunState.pending_batch``),
  plain data, loaded at the saving world size only;
- ``meta.json``: step, weight version, world size, parallel layout and ``"format": 2``;
- ``manifest.json``: every other file with its size and SHA-256
  (:mod:`megatron_sat.checkpoint.manifest`), hashed by the rank that wrote it.

Everything the resume reads is loaded with ``torch.load(weights_only=True)``: no code runs
from a run folder (checkpoints of format 1, written before, load through a scoped allowlist
of numeric numpy arrays; anything else pickled is refused naming the file, see
:mod:`~megatron_sat.checkpoint.safe_files`); ``dist/.metadata``, which torch unpickles, goes
through a restricted unpickler (:mod:`~megatron_sat.checkpoint.safe_dcp`), so a crafted one is
refused even when its manifest was forged to match.

Commit protocol (crash-safe at any instant): a checkpoint is written into ``step_N.tmp``,
each rank hashes the files it wrote and rank 0 gathers the hashes, every file is fsynced
and ``manifest.json`` written (fsynced, then the folder), the folder is renamed to
``step_N`` and the rename fsynced, and only then ``<run_dir>/checkpoints/latest`` is
atomically replaced (``os.replace`` of a fsynced ``.latest.tmp``) to name it. ``latest`` is
the sole commit point: a folder it does not name (a ``step_*.tmp``, or a ``step_N`` newer
than it, left by a crash before the pointer moved) is uncommitted, ignored on resume and
removed with a log line by the next save or resume; a run killed before its first commit
resumes from scratch. So any folder state a crash leaves is either used (committed) or
ignored, never fatal.

A test hook (``set_commit_hook``) is called between the commit's steps with the phase name
(``"writing"``: the distributed checkpoint written, the rest not yet, nothing fsynced;
``"written"``: files and manifest fsynced; ``"renamed"``, ``"committed"``) and the step;
the launch layer installs one for crash tests, nothing else does.

Verified resume: before anything is loaded, every file of the checkpoint is checked against
its manifest (each rank checks its share of the files, ``manifest.owner_of``; measured
2.4 s/GB on one CPU core). A checkpoint that fails (a file missing, of another size
or checksum, ``meta.json`` unreadable, the manifest missing from a format-2 checkpoint) is
named with the file and the reason, and the resume of a run directory falls back to the
newest older committed checkpoint that verifies, saying so in one line; the failed newer
ones are moved to ``checkpoints/set_aside/`` (nothing is deleted) and ``latest`` re-committed
to name the one used, so the run saves those steps again. ``resume_from=<step>`` picks a
checkpoint (an error when it is missing or fails). A checkpoint without a manifest (written
before this format) loads with one line saying it is unverified.

Resuming restores weights, optimizer, RNG and returns the :class:`RunState`; the caller puts
the data position, rollout pool and weight version back. The RNG states are per rank: a
checkpoint resumed at another world size raises unless ``load_rng=False``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_sat.checkpoint import manifest
from megatron_sat.checkpoint.disk_errors import named_disk_errors
from megatron_sat.checkpoint.dist_ckpt import (
    load_dist_checkpoint,
    model_sharded_state_dict,
    save_dist_checkpoint,
)
from megatron_sat.checkpoint.safe_files import (
    from_plain,
    load_plain,
    numpy_rng_from_plain,
    numpy_rng_to_plain,
    to_plain,
)
from megatron_sat.checkpoint.sharding import unwrap

CHECKPOINTS = "checkpoints"
LATEST = "latest"
SET_ASIDE = "set_aside"
COMMIT_PHASES = ("writing", "written", "renamed", "committed")
PENDING = "pending_batch"  # a mid-batch checkpoint's per-rank pending rollout batches
FORMAT = 2  # meta.json's "format": plain-data run files and manifest.json (absent: format 1)

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


_FOLDER = re.compile(r"^step_(\d+)(?:_mini_(\d+))?$")


def folder_name(step: int, mini_step: int = 0) -> str:
    """The folder of a run checkpoint after rollout batch ``step``: ``step_<step>``, or, for a
    stop in the middle of rollout batch ``step + 1`` after its ``mini_step``-th optimizer
    step, ``step_<step>_mini_<mini_step>`` (sorts after ``step_<step>``, before the next)."""
    name = f"step_{step:08d}"
    return f"{name}_mini_{mini_step:04d}" if mini_step else name


def folder_position(folder: Path) -> tuple[int, int] | None:
    """``(N, j)`` of ``step_N`` / ``step_N_mini_j`` (``.tmp`` or not; j = 0 for ``step_N``),
    the order of the run's checkpoints; None for other names."""
    match = _FOLDER.match(folder.name.removesuffix(".tmp"))
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def _label(folder: Path) -> str:
    """``N`` of ``step_N``, ``N+mini_j`` of ``step_N_mini_j`` (in messages)."""
    step, mini = folder_position(folder)
    return f"{step}+mini_{mini}" if mini else str(step)


def clean_uncommitted(run_dir: str | Path) -> list[Path]:
    """Remove the checkpoint folders no commit names: every ``step_*.tmp`` and every
    ``step_N`` newer than ``latest`` (all of them when there is no ``latest``), each with a
    log line (rank 0 only; not collective). Returns the removed folders."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    latest = latest_run_checkpoint(run_dir)
    committed = (-1, 0) if latest is None else folder_position(latest)
    removed = []
    for folder in sorted(root.glob("step_*")):
        step = folder_position(folder)
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
        extra: anything else (plain data, tensors, numeric numpy arrays: ``safe_files.to_plain``).
        mini_step: 0 for a checkpoint between rollout batches; j > 0 for one written by a stop
            in the middle of rollout batch ``step + 1``, after its j-th optimizer step.
        pending_batch: this rank's pending rollout batch of such a checkpoint (its
            ``pending_batch/rank_<r>.pt``: ``training.mini_batches.RolloutBatchSteps``'s
            ``state_dict``), None otherwise. Not part of ``state.pt``.
    """

    step: int
    weight_version: int = 0
    data_state: dict[str, Any] = field(default_factory=dict)
    rollout_state: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    mini_step: int = 0
    pending_batch: dict[str, Any] | None = None


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


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (rank order) on every rank; ``[value]`` without a world."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _hash_own_files(ckpt: Path) -> dict[str, dict[str, Any]]:
    """Size and checksum of the files of ``ckpt`` this rank owns (``manifest.owner_of``: the
    ones it wrote)."""
    world, rank = _world(), _rank()
    mine = [rel for rel in manifest.list_files(ckpt) if manifest.owner_of(rel, world) == rank]
    return manifest.hash_files(ckpt, mine)


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
    megatron-core's RNG tracker (``get_cuda_rng_tracker().get_states()``), as plain data and
    tensors (numpy's as :func:`~megatron_sat.checkpoint.safe_files.numpy_rng_to_plain`)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": numpy_rng_to_plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (numpy's state also as the tuple
    ``np.random.get_state()`` gives, as checkpoints of format 1 hold it).

    Raises:
        ValueError: when the state holds CUDA states and this machine has no CUDA or the
            reverse.
    """
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    if ("cuda" in state) != torch.cuda.is_available():
        raise ValueError("RNG state and this machine disagree about CUDA")
    random.setstate(state["python"])
    np.random.set_state(numpy_rng_from_plain(state["numpy"]))
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
    mini_step: int = 0,
    pending_batch: dict[str, Any] | None = None,
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
        mini_step, pending_batch: a checkpoint in the middle of rollout batch ``step + 1``
            after its ``mini_step``-th optimizer step (folder ``step_<step>_mini_<j>``), with
            each rank's own ``pending_batch`` (plain data, written by that rank to
            ``pending_batch/rank_<r>.pt``, hashed into the manifest like its RNG file; every
            rank passes one or none does). See :class:`RunState`.

    Returns:
        The checkpoint directory ``<run_dir>/checkpoints/step_<step>`` (``_mini_<j>``).

    Raises:
        FileExistsError: when a committed checkpoint of this step exists already (an
            uncommitted one, left by a crash, is removed and written again).
        TypeError: on every rank, before anything is written, when the run state holds a
            value that is not plain data (named by its place in the state).
        DiskFullError: when the disk filled up during the write (``checkpoint.disk_errors``:
            megatron-core's writer loses the errno); nothing is committed.
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / folder_name(step, mini_step)
    tmp = root / f"{final.name}.tmp"
    state = RunState(
        step=step,
        weight_version=weight_version,
        data_state=data_state or {},
        rollout_state=rollout_state or {},
        extra=extra or {},
        mini_step=mini_step,
    )
    plain = _prepare(run_dir, state, final, tmp)
    mine = None if pending_batch is None else to_plain(pending_batch, "pending_batch")
    with named_disk_errors(tmp, f"run checkpoint of step {step}"):
        _write_files(tmp, model, optimizer, (plain, mine), step, (weight_version, mini_step))
    if _rank() == 0:
        _commit(tmp, final, step, keep_last)
    _barrier()
    return final


def _prepare(run_dir: str | Path, state: RunState, final: Path, tmp: Path) -> Any:
    """Rank 0's checks before anything is written (a collective): ``state`` as plain data
    (rank 0; None elsewhere), an interrupted save cleaned up, ``tmp/rng`` made. Raises the
    same error on every rank (see :func:`save_run_checkpoint`)."""
    error: tuple[str, str] | None = None
    plain = None
    if _rank() == 0:
        try:  # before any collective, so that a bad state fails every rank alike
            plain = to_plain(asdict(state))
        except TypeError as e:
            error = ("TypeError", f"run checkpoint of step {state.step}: {e}")
        clean_uncommitted(run_dir)  # a step_N (or .tmp) of an interrupted save goes first
        if error is None and final.exists():
            error = (
                "FileExistsError",
                f"{final} exists: a run checkpoint of step {_label(final)} was written already",
            )
        elif error is None:
            (tmp / "rng").mkdir(parents=True)
    from megatron_sat.checkpoint.hf_io import broadcast_from_rank0

    error = broadcast_from_rank0(error)
    if error is not None:
        raise {"TypeError": TypeError, "FileExistsError": FileExistsError}[error[0]](error[1])
    return plain


def _commit(tmp: Path, final: Path, step: int, keep_last: int | None) -> None:
    """Rank 0: rename the written ``tmp`` to ``final``, point ``latest`` at it (the commit
    point, fsynced), then keep only the newest ``keep_last`` checkpoints."""
    root = final.parent
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


def _write_files(tmp: Path, model, optimizer, plain, step: int, versions) -> None:
    """Every file of the checkpoint into ``tmp`` and its manifest, fsynced (collective).
    ``plain``: rank 0's run state and this rank's pending batch (or None); ``versions``: the
    weight version and the mini-step."""
    (plain, pending), (weight_version, mini_step) = plain, versions
    save_dist_checkpoint(_sharded_state(model, optimizer, is_loading=False), tmp / "dist")
    if _rank() == 0:
        _at("writing", step)  # a crash in the middle of the write
    torch.save(rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
    if pending is not None:
        (tmp / PENDING).mkdir(exist_ok=True)
        torch.save(pending, tmp / PENDING / f"rank_{_rank():05d}.pt")
    if _rank() == 0:
        torch.save(plain, tmp / "state.pt")
        meta = {"step": step, "weight_version": weight_version, "format": FORMAT, **_layout()}
        if mini_step:
            meta["mini_step"] = mini_step
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _barrier()
    parts = _gather(_hash_own_files(tmp))  # each rank hashes what it wrote
    if _rank() == 0:
        _fsync_tree(tmp)
        manifest.write_manifest(tmp, parts)
        _fsync_path(tmp)


class CheckpointVerificationError(ValueError):
    """No run checkpoint to resume from verifies (the message names each one, the file and
    the reason)."""


def latest_run_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest committed checkpoint of a run: the folder ``<run_dir>/checkpoints/latest``
    names, or None when there is no ``latest``. The folder is not verified here (it may be
    damaged or gone): :func:`load_run_checkpoint` verifies it and falls back.

    Raises:
        ValueError: when ``latest`` does not name a ``step_N`` folder (the commit protocol
            never writes that: the file was altered by hand).
    """
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text(errors="replace").strip()
    if folder_position(Path(name)) is None or name.endswith(".tmp") or "/" in name:
        raise ValueError(f"{pointer} holds {name[:60]!r}, not the name of a step_N folder")
    return pointer.parent / name


def _committed(run_dir: Path) -> list[Path]:
    """The committed checkpoints, newest first: ``latest`` and every ``step_N`` below it."""
    latest = latest_run_checkpoint(run_dir)
    if latest is None:
        return []
    top = folder_position(latest)
    older = [
        p
        for p in (run_dir / CHECKPOINTS).glob("step_*")
        if not p.name.endswith(".tmp") and (folder_position(p) or top) < top and p.is_dir()
    ]
    return [latest, *sorted(older, key=folder_position, reverse=True)]


def _verify(ckpt: Path) -> tuple[list[str], int]:
    """Verify ``ckpt`` (collective: each rank hashes its share of the files). Returns the
    problems (``"<file>: <reason>"``; empty: it verifies) and the checkpoint format (1: no
    manifest, written before manifests; nothing could be verified then but ``meta.json``)."""
    if not ckpt.is_dir():
        return ["the folder is missing"], FORMAT
    meta_problem = None
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        fmt = int(meta.get("format", 1))
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        meta_problem, fmt = f"meta.json: missing, unreadable or truncated ({e})", FORMAT
    files, problem = manifest.read_manifest(ckpt)
    if problem:
        return [problem], fmt
    if files is None:
        if fmt >= FORMAT:
            return [meta_problem or "manifest.json: missing (format 2 writes one)"], fmt
        return [], 1
    world, rank = _world(), _rank()
    mine = [rel for rel in files if manifest.owner_of(rel, world) == rank]
    found = manifest.verify_files(ckpt, files, mine)
    if rank == 0:
        found += manifest.unlisted_files(ckpt, files)
    problems = [p for part in _gather(found) for p in part]
    if not problems and meta_problem:
        problems = [meta_problem]  # listed and intact, yet unreadable: written so
    return problems, fmt


def _recommit(root: Path, keep: Path, failed: list[Path]) -> list[Path]:
    """Rank 0: move the committed checkpoints newer than ``keep`` (``failed``) to
    ``checkpoints/set_aside/`` and make ``latest`` name ``keep`` (the moves first, so that a
    crash in between leaves a ``latest`` that names a missing folder: a failure the next
    resume falls back from). Returns the new paths."""
    moved = []
    aside = root / SET_ASIDE
    for folder in failed:
        if not folder.exists():
            continue
        aside.mkdir(exist_ok=True)
        target = aside / folder.name
        n = 1
        while target.exists():
            target, n = aside / f"{folder.name}.{n}", n + 1
        folder.rename(target)
        moved.append(target)
    _fsync_path(root)
    pointer = root / f".{LATEST}.tmp"
    with open(pointer, "w") as f:
        f.write(keep.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    _fsync_path(root)
    return moved


def _say(message: str) -> None:
    if _rank() == 0:
        logger.warning(message)
        print(f"megatron-sat: {message}", flush=True)


def _choose(path: Path, resume_from: int | None) -> tuple[Path, int]:
    """The verified checkpoint to load from ``path`` (a checkpoint or a run directory) and
    its format (collective). See :func:`load_run_checkpoint`."""
    if (path / "meta.json").exists() or folder_position(path) is not None:
        if resume_from is not None:
            raise ValueError(f"resume_from={resume_from} needs a run directory, got {path}")
        problems, fmt = _verify(path)
        if problems:
            raise CheckpointVerificationError(
                f"run checkpoint {path} fails verification: " + "; ".join(problems)
            )
        return path, fmt
    if _rank() == 0:
        clean_uncommitted(path)
    _barrier()
    committed = all_committed = _committed(path)
    if not committed:
        raise FileNotFoundError(f"{path} holds no run checkpoint (no meta.json, no latest)")
    if resume_from is not None:
        chosen = path / CHECKPOINTS / f"step_{resume_from:08d}"
        if chosen not in committed:
            have = ", ".join(_label(c) for c in committed)
            raise FileNotFoundError(
                f"train.resume_from={resume_from}: no committed run checkpoint {chosen} "
                f"(committed steps: {have})"
            )
        committed = committed[committed.index(chosen) :]
    failures: list[tuple[Path, list[str]]] = []
    chosen = None
    for ckpt in committed:
        problems, fmt = _verify(ckpt)
        if not problems:
            chosen = ckpt
            break
        failures.append((ckpt, problems))
        if resume_from is not None:
            raise CheckpointVerificationError(
                f"train.resume_from={resume_from}: run checkpoint {ckpt} fails verification: "
                + "; ".join(problems)
            )
    if chosen is None:
        listing = "\n  ".join(f"{c.name}: {'; '.join(p)}" for c, p in failures)
        raise CheckpointVerificationError(
            f"no run checkpoint in {path / CHECKPOINTS} verifies:\n  {listing}"
        )
    newer = all_committed[: all_committed.index(chosen)]
    if newer:
        if _rank() == 0:
            _recommit(path / CHECKPOINTS, chosen, newer)
        _barrier()
        aside = f"{', '.join(c.name for c in newer)} moved to {path / CHECKPOINTS / SET_ASIDE}"
        if failures:
            why = "; ".join(f"{c.name} failed verification: {'; '.join(p)}" for c, p in failures)
            _say(f"{why}. Resuming from {chosen.name}, the newest that verifies ({aside})")
        else:
            _say(f"train.resume_from={resume_from}: resuming from {chosen.name} ({aside})")
    return chosen, fmt


def load_run_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer,
    load_rng: bool = True,
    resume_from: int | None = None,
) -> RunState:
    """Verify, then restore model, optimizer and (by default) RNG from a run checkpoint;
    return its state (collective: every rank calls it).

    Args:
        path: a checkpoint directory (``.../step_00000012``: used only if it verifies) or a
            run directory: its newest committed checkpoint that verifies is used; one that
            fails is named with its file and reason, set aside, and the next older tried.
        model, optimizer: freshly built, at any parallel layout (weights and optimizer state
            are resharded); RNG states need the saving world size.
        load_rng: restore this rank's RNG states.
        resume_from: with a run directory, the step of the checkpoint to use (no fallback;
            committed checkpoints newer than it are moved to ``checkpoints/set_aside/`` so
            that the run saves those steps again).

    Raises:
        FileNotFoundError: when ``path`` holds no run checkpoint, or none of ``resume_from``.
        CheckpointVerificationError: when no candidate verifies (each named, with why).
        UnsafeFileError: when a file of a checkpoint without a manifest needs pickled objects
            (see :mod:`megatron_sat.checkpoint.safe_files`) or is unreadable.
        ValueError: when ``load_rng`` and the world size differs from the saving run's.
        CheckpointingException: for model or optimizer tensors missing from, or extra in,
            the checkpoint (megatron-core names them).
    """
    ckpt, fmt = _choose(Path(path), resume_from)
    legacy = fmt < FORMAT
    if legacy:
        _say(
            f"run checkpoint {ckpt} has no manifest.json (written before checkpoints were "
            "verified): loading it unverified"
        )
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{ckpt / 'meta.json'}: unreadable or truncated ({e})") from None
    if load_rng and meta["world_size"] != _world():
        raise ValueError(
            f"{ckpt} was saved by {meta['world_size']} ranks, this run has {_world()}: RNG "
            "states cannot be mapped (pass load_rng=False to resume without them)"
        )
    state = from_plain(load_plain(ckpt / "state.pt", legacy=legacy))
    pending = None
    if (ckpt / PENDING).is_dir():
        if meta["world_size"] != _world():
            raise ValueError(
                f"{ckpt} stopped in the middle of a rollout batch with {meta['world_size']} "
                f"ranks, each holding its share of it; this run has {_world()}: resume it at "
                f"{meta['world_size']} ranks (or from a checkpoint between rollout batches, "
                "train.resume_from)"
            )
        pending = from_plain(load_plain(ckpt / PENDING / f"rank_{_rank():05d}.pt"))
    rng = None
    if load_rng:
        rng = load_plain(ckpt / "rng" / f"rank_{_rank():05d}.pt", legacy=legacy)
    loaded = load_dist_checkpoint(_sharded_state(model, optimizer, is_loading=True), ckpt / "dist")
    unwrap(model).load_state_dict(loaded["model"], strict=True)
    with torch.no_grad():  # the distributed optimizer copies into its leaf main params
        optimizer.load_state_dict(loaded["optimizer"])
    from megatron_sat.platform.distrib_optimizer_fix import restore_adam_steps

    restore_adam_steps(optimizer, loaded["optimizer"])  # megatron-core 0.19 loses Adam's step
    if rng is not None:
        set_rng_state(rng)
    state["pending_batch"] = pending
    return RunState(**state)
