"""Counting the host synchronisations of a block of torch code (the device check's figure).

On CUDA: the warnings that ``torch.cuda.set_sync_debug_mode("warn")`` raises at every
synchronising call (``c10/cuda``'s "called a synchronizing CUDA operation"). On the CPU, where
nothing synchronises, the host reads that would on a device: ``item``, ``tolist``, ``float`` /
``int`` / ``bool`` / ``index`` of a tensor, ``cpu``, ``numpy``, counted by a
``TorchFunctionMode`` (this thread only). The CPU count is an upper bound: it also counts reads
of tensors that live on the host anyway.
"""

from __future__ import annotations

import warnings

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = frozenset(
    {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"}
)
SYNC_WARNING = "synchronizing CUDA operation"


def counter_method(cuda: bool) -> str:
    """What ``HostSyncCounter(cuda)`` counts, in words (the check's JSON names it)."""
    if cuda:
        return 'torch.cuda.set_sync_debug_mode("warn") warnings'
    return "host reads (" + ", ".join(sorted(HOST_READS)) + ") of any tensor: an upper bound"


class _HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """Context manager: ``count`` host synchronisations in its block (module docstring), and
    the block's other warnings in ``messages`` (each once, e.g. ops that torch's deterministic
    algorithms lack), recorded instead of printed.

    Args:
        cuda: count CUDA's synchronisations (the block runs on a CUDA device) rather than host
            reads.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.count = 0
        self.messages: list[str] = []

    def __enter__(self) -> HostSyncCounter:
        self._warnings = warnings.catch_warnings(record=True)
        self._records = self._warnings.__enter__()
        warnings.simplefilter("always")
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._reads = _HostReads()
            self._reads.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self.count = sum(SYNC_WARNING in str(w.message) for w in self._records)
        else:
            self._reads.__exit__(*exc)
            self.count = self._reads.count
        self._warnings.__exit__(*exc)
        texts = (str(w.message)[:300] for w in self._records)
        self.messages = sorted({t for t in texts if SYNC_WARNING not in t})
