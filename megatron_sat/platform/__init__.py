"""Device and backend choice, and the CPU shims that let megatron-core run without CUDA."""

from megatron_sat.platform.device import (
    PARAMS_DTYPES,
    apply_cpu_shims,
    default_backend,
    default_params_dtype,
    get_device,
    have_transformer_engine,
    to_device,
    transformer_device_fields,
)

__all__ = [
    "PARAMS_DTYPES",
    "apply_cpu_shims",
    "default_backend",
    "default_params_dtype",
    "get_device",
    "have_transformer_engine",
    "to_device",
    "transformer_device_fields",
]
