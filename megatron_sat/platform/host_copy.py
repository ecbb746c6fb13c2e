"""Host-memory copies that stay off torch's intra-op thread pool.

``torch.cat`` / ``copy_`` of large CPU tensors split the copy over the intra-op threads. On a
machine whose cores are shared (other processes, the gloo broadcast thread, an embedded server)
those threads wait for each other: packing a 256 MB weight bucket ran at 0.05-0.08 GB/s on the
2 loaded cores of the CPU test machine, against 1.4-2.9 GB/s for one thread's memcpy, and it
starved the broadcast it was meant to overlap. A numpy copy is a single-threaded memcpy that
releases the GIL. CUDA tensors are copied by torch (one kernel per tensor, on the caller's
stream).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version


def copy_bytes_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Write every tensor's bytes, back to back in order, into ``flat``.

    Args:
        flat: uint8 [sum of the tensors' bytes], contiguous, on the tensors' device.
        tensors: contiguous tensors of any dtype.

    Raises:
        ValueError: when ``flat`` is not uint8, its size is not the tensors' total bytes, or a
            tensor is not contiguous or lives on another device.
    """
    total = sum(t.numel() * t.element_size() for t in tensors)
    if flat.dtype != torch.uint8 or flat.numel() != total or not flat.is_contiguous():
        raise ValueError(f"flat must be contiguous uint8 [{total}], got {flat.dtype} {flat.shape}")
    for t in tensors:
        if not t.is_contiguous() or t.device != flat.device:
            raise ValueError(
                f"tensor {tuple(t.shape)} on {t.device}: must be contiguous, on {flat.device}"
            )
    if flat.device.type != "cpu":
        torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors], out=flat)
        return
    out = flat.numpy()
    start = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        # view(uint8): numpy has no bfloat16; bytes are bytes.
        out[start : start + size] = t.reshape(-1).view(torch.uint8).numpy()
        start += size


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, by a single-threaded memcpy when both are contiguous host tensors
    of one dtype and shape (else torch's ``copy_``, which also casts and strides).

    Why: a weight update copies each received tensor into its parameter; ``copy_`` of a 1 MiB
    host tensor is one OpenMP parallel region, whose workers, sleeping under the passive wait
    policy (``platform.threads``), must be woken per tensor. Measured on the shared 2-core
    test machine (load ~20): 33 copies of 1 MiB took 9.8 ms by ``copy_`` with
    ``OMP_WAIT_POLICY=PASSIVE``, 929 ms with the default (spinning) policy, 4.3 ms by numpy.

    Raises:
        RuntimeError: from ``copy_`` when ``src`` does not broadcast to ``dst``.
    """
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        # view(uint8): numpy has no bfloat16; bytes are bytes.
        dst.detach().reshape(-1).view(torch.uint8).numpy()[...] = (
            src.detach().reshape(-1).view(torch.uint8).numpy()
        )
        # As copy_ would: a tensor saved for backward before the write then fails loudly at
        # backward instead of differentiating through the new values.
        increment_version(dst)
        return
    dst.copy_(src)
