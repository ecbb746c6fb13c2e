"""Run files that load without running code: ``torch.load(weights_only=True)`` only.

What a run checkpoint stores besides the distributed checkpoint (the run state, the RNG
states) is written as plain data: dicts, lists, tuples, str, int, float, bool, None and
tensors. numpy arrays and scalars (the routes of the rollout pool's samples) are stored as
``{"__ndarray__": tensor, "dtype": "uint8", "scalar": False}`` and come back with the same
dtype, shape and bytes (:func:`to_plain`, :func:`from_plain`); numpy's RNG state becomes a
dict of ints and an int64 tensor (:func:`numpy_rng_to_plain`), Python's is already a tuple of
ints. Such a file loads with torch's default weights-only unpickler, which builds no object
it does not know and calls no function it does not allow.

Files written before this format (``meta.json`` without ``"format"``) pickled numpy arrays
directly (numpy's RNG state, the samples' routes). They are read with the same weights-only
unpickler and, scoped to that one load, the globals that rebuild a numeric numpy array
(``_reconstruct``, ``ndarray``, ``dtype``, ``scalar`` and the numeric dtype classes: the
allowlist torch documents for numpy), nothing else. Any other global, a crafted ``__reduce__``
above all, is refused naming the file and the global (:class:`UnsafeFileError`); there is no
opt-in to unpickle anyway, because a flag kept in a shared config would trust every future
file as well, and megatron-sat never wrote a run file that needs more than this allowlist.

The distributed checkpoint itself (``dist/``: torch's reader unpickles its ``.metadata`` and
its objects) is read through a restricted unpickler and weights-only loads by
:mod:`megatron_sat.checkpoint.safe_dcp`.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

NDARRAY_TAG = "__ndarray__"
_NUMERIC_DTYPES = (
    "Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64",
    "Float16", "Float32", "Float64",
)  # fmt: skip


class UnsafeFileError(ValueError):
    """A run file that needs more than the weights-only unpickler (or is not a torch file)."""


def to_plain(obj: Any, where: str = "state") -> Any:
    """``obj`` with numpy arrays and scalars replaced by tagged tensors (see the module).

    Raises:
        TypeError: for a value that is not plain data, a tensor or a numeric numpy value,
            naming where it sits (``state.rollout_state['batches'][0]``).
    """
    if isinstance(obj, (np.ndarray, np.generic)):  # first: np.float64 is a float
        array = np.asarray(obj)
        if array.dtype.kind not in "biuf":
            raise TypeError(f"{where}: numpy dtype {array.dtype} cannot be stored as plain data")
        return {
            NDARRAY_TAG: torch.from_numpy(np.array(array, copy=True, order="C")),
            "dtype": array.dtype.str,
            "scalar": isinstance(obj, np.generic),
        }
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    if isinstance(obj, dict):
        if NDARRAY_TAG in obj:
            raise TypeError(f"{where}: the key {NDARRAY_TAG!r} is reserved")
        return {k: to_plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise TypeError(
        f"{where}: {type(obj).__name__} is not plain data (dict, list, tuple, str, int, float, "
        "bool, None, tensor, numeric numpy array): a run checkpoint stores no pickled objects"
    )


def from_plain(obj: Any) -> Any:
    """Inverse of :func:`to_plain` (the arrays come back with their dtype and bytes)."""
    if isinstance(obj, dict):
        if NDARRAY_TAG in obj:
            array = obj[NDARRAY_TAG].numpy().astype(np.dtype(obj["dtype"]), copy=True)
            return array[()] if obj["scalar"] else array
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_plain(v) for v in obj)
    return obj


def numpy_rng_to_plain(state: tuple) -> dict[str, Any]:
    """``np.random.get_state()`` (MT19937) as ints and an int64 tensor of the 624 words."""
    name, key, pos, has_gauss, cached = state
    return {
        "bit_generator": str(name),
        "key": torch.from_numpy(np.asarray(key, dtype=np.uint32).astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def numpy_rng_from_plain(state: dict[str, Any] | tuple) -> tuple:
    """Inverse of :func:`numpy_rng_to_plain`; a legacy tuple passes through."""
    if isinstance(state, tuple):
        return state
    key = state["key"].numpy().astype(np.uint32)
    return (state["bit_generator"], key, state["pos"], state["has_gauss"], state["cached_gaussian"])


def _numpy_globals() -> list[Any]:
    from numpy._core.multiarray import _reconstruct, scalar

    dtypes = [getattr(np.dtypes, f"{name}DType") for name in _NUMERIC_DTYPES]
    return [_reconstruct, scalar, np.ndarray, np.dtype, *dtypes]


def load_plain(path: str | Path, *, legacy: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; with ``legacy`` also numeric numpy arrays
    (see the module). Runs no code from the file.

    Raises:
        UnsafeFileError: naming the file, when it needs another global (a crafted pickle, an
            object megatron-sat never writes) or is not a readable torch file (truncated,
            corrupt).
    """
    path = Path(path)
    allowed: Callable[[], list[Any]] = _numpy_globals if legacy else list
    try:
        with torch.serialization.safe_globals(allowed()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        found = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(e))
        detail = f"it names {found.group(1)}" if found else "an unsupported pickle operation"
        raise UnsafeFileError(
            f"{path}: refused: loading it needs more than plain data and tensors ({detail}). "
            "megatron-sat writes no such file and loads none (loading it could run code from "
            "the file); a run checkpoint that holds one was not written by megatron-sat or "
            "was altered: resume from another checkpoint"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise UnsafeFileError(f"{path}: unreadable, truncated or corrupt ({e})") from None
