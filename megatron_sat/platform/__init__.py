"""Device and backend choice, the CPU shims that let megatron-core run without CUDA, and the
thread policy of every process (``platform.threads``).

Importing this package does not import torch: ``platform.threads`` must run before torch loads
its OpenMP runtime, and ``platform.lifetime`` before the slow imports; the device names below
are loaded from ``platform.device`` (which imports torch) on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_sat.platform.threads import ThreadPolicy, configure_threads, decide_threads

_DEVICE_EXPORTS = (
    "PARAMS_DTYPES",
    "apply_cpu_shims",
    "default_backend",
    "default_params_dtype",
    "get_device",
    "to_device",
)
_FUSION_EXPORTS = (
    "BrokenInstallError",
    "DeviceFusions",
    "announce_fusions",
    "device_fusions",
    "have_transformer_engine",
)

__all__ = [
    *_DEVICE_EXPORTS,
    *_FUSION_EXPORTS,
    "ThreadPolicy",
    "configure_threads",
    "decide_threads",
]


def __getattr__(name: str) -> Any:
    if name in _DEVICE_EXPORTS:
        return getattr(importlib.import_module("megatron_sat.platform.device"), name)
    if name in _FUSION_EXPORTS:
        return getattr(importlib.import_module("megatron_sat.platform.fusions"), name)
    raise AttributeError(f"module 'megatron_sat.platform' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
