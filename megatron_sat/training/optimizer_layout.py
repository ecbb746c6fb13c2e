"""What the trainer's parameters, gradients and optimizer states look like on one rank.

One pure function, :func:`resolve_optimizer_layout`, turns ``train.*`` and the device into the
settings the trainer builds (``PolicyTrainer``: megatron-core's DDP and optimizer configs) and
the launch plan's memory model uses (``launch.memory``), so the estimate is of the trainer as
built. :func:`bytes_per_param` is that memory model per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OptimizerLayout:
    """The trainer's precision and optimizer sharding.

    Attributes:
        params_dtype: "bf16" or "fp32", the model's parameter dtype (routers stay float32).
        use_distributed_optimizer: megatron-core's DistributedOptimizer (main weights and Adam
            moments sharded over the data-parallel group of each parameter).
        optimizer_cpu_offload: main weights and moments in host memory.
        use_precision_aware_optimizer: bf16 Adam moments.
    """

    params_dtype: str
    use_distributed_optimizer: bool
    optimizer_cpu_offload: bool
    use_precision_aware_optimizer: bool


def resolve_optimizer_layout(train: Any, *, device_type: str, dp: int, edp: int) -> OptimizerLayout:
    """The layout for ``train`` (a ``TrainConfig``) on ``device_type`` ("cuda" or "cpu") with
    dense data-parallel size ``dp`` (x CP) and expert data-parallel size ``edp``.

    ``params_dtype`` None: bf16 on CUDA, fp32 on the CPU. ``use_distributed_optimizer`` None:
    on when ``dp > 1`` or ``edp > 1``, and always with bf16 parameters.

    Why always with bf16: our bf16 models keep their routers in fp32 (``keep_router_fp32``),
    and megatron-core 0.19's replicated mixed-precision optimizer
    (``Float16OptimizerWithFloat16Params.sharded_state_dict``) numbers only the bf16 parameters
    of a group while torch numbers all of them, so the first run checkpoint of a bf16 run at
    DP 1 failed ("Optimizer shape (32, 32) does not match model shape (32, 16)"). The
    distributed optimizer at DP 1 holds the same bytes and checkpoints (and resumes) exactly.

    Raises:
        ValueError: ``optimizer_cpu_offload`` without CUDA; ``optimizer_cpu_offload`` /
            ``use_precision_aware_optimizer`` without the
            distributed optimizer (both DP sizes 1 and not forced on), or with fp32 params (no
            main weights to offload or to keep apart from bf16 moments); bf16 with
            ``use_distributed_optimizer`` false (naming the field).
    """
    dtype = train.params_dtype or ("bf16" if device_type == "cuda" else "fp32")
    dist_opt = train.use_distributed_optimizer
    if dist_opt is None:
        dist_opt = dp > 1 or edp > 1 or dtype == "bf16"
    if dtype == "bf16" and not dist_opt:
        raise ValueError(
            "train.use_distributed_optimizer=false with bf16 parameters: megatron-core 0.19's "
            "replicated mixed-precision optimizer cannot checkpoint our fp32 routers beside "
            "bf16 weights; leave train.use_distributed_optimizer unset (or true)"
        )
    if train.optimizer_cpu_offload and device_type != "cuda":
        # megatron-core's HybridDeviceOptimizer moves gradients and weights between the device
        # and host copies on CUDA streams; without CUDA its constructor fails ("can't optimize
        # a non-leaf Tensor"), and a CPU trainer's optimizer is in host memory already.
        raise ValueError(
            f"train.optimizer_cpu_offload=true needs CUDA (the trainer's device is "
            f"{device_type}): megatron-core's HybridDeviceOptimizer offloads from a GPU; on "
            "the CPU the optimizer state is in host memory already: set "
            "train.optimizer_cpu_offload=false"
        )
    for name in ("optimizer_cpu_offload", "use_precision_aware_optimizer"):
        if getattr(train, name) and not dist_opt:
            raise ValueError(
                f"train.{name}=true needs megatron-core's distributed optimizer, which is off "
                f"at DP {dp} / expert DP {edp}: set train.use_distributed_optimizer=true"
            )
        if getattr(train, name) and dtype != "bf16":
            raise ValueError(f"train.{name}=true needs train.params_dtype='bf16', got {dtype!r}")
    return OptimizerLayout(
        params_dtype=dtype,
        use_distributed_optimizer=dist_opt,
        optimizer_cpu_offload=bool(train.optimizer_cpu_offload),
        use_precision_aware_optimizer=bool(train.use_precision_aware_optimizer),
    )


def bytes_per_param(
    layout: OptimizerLayout, shards: int, *, fp32_param: bool = False
) -> tuple[float, float, float]:
    """Device bytes (parameter, gradient, optimizer state) per model parameter on one rank.

    - parameter: 2 (bf16) or 4 (fp32, and a router's weight: ``fp32_param``).
    - gradient: 4, DDP's ``grad_reduce_in_fp32`` buffer, full size on every rank (the
      distributed optimizer reduce-scatters it but keeps the buffer).
    - optimizer: Adam's two moments (4 + 4, or 2 + 2 precision-aware) plus, for a bf16
      parameter, its float32 main copy (4); divided by ``shards`` (the parameter's
      data-parallel size) under the distributed optimizer; 0 on the device with CPU offload.

    So bf16 at DP 2 with the distributed optimizer: 2 + 4 + 12 / 2 = 12 bytes; without it
    18; fp32 without it 16.
    """
    fp32 = fp32_param or layout.params_dtype == "fp32"
    param = 4.0 if fp32 else 2.0
    moments = 4.0 if layout.use_precision_aware_optimizer else 8.0
    optimizer = moments + (0.0 if fp32 else 4.0)
    if layout.use_distributed_optimizer:
        optimizer /= shards
    if layout.optimizer_cpu_offload:
        optimizer = 0.0
    return param, 4.0, optimizer
