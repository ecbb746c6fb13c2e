"""Device and backend choice, and the CPU shims that let megatron-core run without CUDA."""

from megatron_sat.platform.device import (
    apply_cpu_shims,
    default_backend,
    get_device,
    have_transformer_engine,
)

__all__ = ["apply_cpu_shims", "default_backend", "get_device", "have_transformer_engine"]
