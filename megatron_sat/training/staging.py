"""Micro-batches staged on the host and moved to the device one at a time.

A step's micro-batches are built in host memory (``training.step_batch``), page-locked once on
CUDA machines (``pin``), and each pass moves one micro-batch to the device just before its
forward (``staged``, asynchronous copies from pinned memory on the current stream) and drops
it after its backward (or after its no-grad forward). At the paper's scale (256 x 16 samples
of ~8k tokens, 48 layers x top-8 routes) the whole step's batch is 10-55 GB on a rank: kept on
the device through every pass, it would crowd out the activations. Routes stay compact
(uint8 / int16) in the staged copy; they are widened to int64 per micro-batch by
``RoutingReplay.routes_for`` and per layer by ``routing_metrics.topk_counts``.

Every move of a micro-batch in a step goes through ``staged`` (or ``stage_tensor`` for the
few per-token fields that a metric reads after a pass), so a test can record them. On the CPU
nothing moves: the staged micro-batch is the host one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TypeVar

import torch

from megatron_sat.platform import to_device

T = TypeVar("T")


def pin(obj: T, device: torch.device) -> T:
    """``obj`` (a micro-batch dataclass or a tensor) with its tensors in page-locked host
    memory when ``device`` is CUDA (so that ``staged`` copies run asynchronously), else
    ``obj`` itself. One host copy per step, however many passes stage it."""
    if device.type != "cuda":
        return obj
    if torch.is_tensor(obj):
        return obj if obj.is_pinned() else obj.pin_memory()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: pin(getattr(obj, f.name), device)
            for f in dataclasses.fields(obj)
            if f.init
            and (
                torch.is_tensor(getattr(obj, f.name))
                or dataclasses.is_dataclass(getattr(obj, f.name))
            )
        }
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


@contextlib.contextmanager
def staged(mb: T, device: torch.device) -> Iterator[T]:
    """``mb`` on ``device`` inside the block (non-blocking copies from pinned host memory on
    CUDA; ``mb`` itself on the CPU), released at its end: the device copy lives only as long
    as the autograd graph of the forward run inside holds parts of it (until its backward)."""
    moved = to_device(mb, device, non_blocking=True)
    try:
        yield moved
    finally:
        del moved


def stage_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One per-token field of a host micro-batch (e.g. ``rollout_log_probs`` [B, S] float32)
    on ``device``, for a metric computed after a pass (non-blocking; itself on the CPU)."""
    return to_device(tensor, device, non_blocking=True)
