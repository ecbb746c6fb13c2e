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
import importlib.util

import torch

SUPPORTED_MEGATRON_CORE = ("0.19.",)


def get_device() -> torch.device:
    """The device this process trains on: the local CUDA device if present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    """torch.distributed backend for this machine: nccl with CUDA, gloo without."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def have_transformer_engine() -> bool:
    """Whether transformer-engine can be used (installed and CUDA present). Never imports it."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


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


def _patch_literal_cuda_tensors() -> None:
    # Literal device="cuda" tensors in DDP buffers, the optimizer, clip_grads and the pipeline
    # schedules; clip_grads also asserts the type name 'torch.cuda.FloatTensor'.
    import megatron.core.optimizer.clip_grads as clip_grads

    original_norm = clip_grads.get_grad_norm_fp32

    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        if isinstance(grads_for_norm, torch.Tensor):
            grads_for_norm = [grads_for_norm]
        grads_for_norm = list(grads_for_norm)
        norm_type = float(norm_type)
        if not grads_for_norm:
            total = torch.zeros(1)
        elif norm_type == float("inf"):
            total = torch.stack([g.detach().abs().max() for g in grads_for_norm]).max()
            total = total.reshape(1).float()
        else:
            total = sum(g.detach().float().norm(norm_type) ** norm_type for g in grads_for_norm)
            total = torch.as_tensor(total, dtype=torch.float32).reshape(1)
        if grad_stats_parallel_group is not None and torch.distributed.is_initialized():
            op = torch.distributed.ReduceOp.MAX
            if norm_type != float("inf"):
                op = torch.distributed.ReduceOp.SUM
            torch.distributed.all_reduce(total, op=op, group=grad_stats_parallel_group)
        if norm_type == float("inf"):
            return total.item()
        return total.item() ** (1.0 / norm_type)

    get_grad_norm_fp32.__wrapped__ = original_norm  # type: ignore[attr-defined]
    clip_grads.get_grad_norm_fp32 = get_grad_norm_fp32

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr) for p in parameters if getattr(p, attr) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for g in grads:
                g.detach().mul_(clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
