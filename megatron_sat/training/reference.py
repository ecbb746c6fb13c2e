"""The frozen reference policy of the k3 KL term, kept where it costs least.

The reference is the policy's initial weights (this rank's shard). Its no-grad forward runs
the model with the reference's values in the parameters, then puts the policy's back, bit for
bit. Two placements (``train.reference_on_device``):

- on the device: one more copy of the shard in device memory (the training dtype); the swap
  exchanges the parameters' storage (``param.data``), so it copies nothing;
- in host memory (default): the reference waits in page-locked memory (on CUDA) and is copied
  in over PCIe; the policy's weights wait meanwhile in page-locked buffers allocated once, at
  the first swap, and reused by every later step (never fresh buffers per step): three
  copies of the shard per step (policy out, reference in, policy back), as slime's offloaded
  reference does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A copy of ``tensor`` in host memory (page-locked on CUDA machines, for fast copies)."""
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    copy.copy_(tensor.detach())
    return copy


class ReferencePolicy:
    """The reference weights of ``model``'s parameters, taken now, and their swap.

    Args:
        model: the policy model (its parameters keep their identity through megatron-core's
            DDP wrapping, which re-points their storage into its buffers, values unchanged).
        device: the model's device (pinned host memory when CUDA).
        on_device: keep the reference on ``device`` (see the module docstring).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, on_device: bool) -> None:
        self.on_device = on_device
        self.pin = device.type == "cuda"
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = [
            (p, p.detach().clone() if on_device else host_copy(p, self.pin))
            for p in model.parameters()
        ]
        # host placement: where the policy's weights wait during a swap (allocated once)
        self.policy_buffers: list[torch.Tensor] | None = None

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The parameters hold the reference weights inside the block, the policy's again
        after it (bit for bit)."""
        if self.on_device:
            saved = [param.data for param, _ in self.pairs]
            for param, reference in self.pairs:
                param.data = reference
            try:
                yield
            finally:
                for (param, _), data in zip(self.pairs, saved, strict=True):
                    param.data = data
            return
        if self.policy_buffers is None:
            self.policy_buffers = [
                torch.empty(p.shape, dtype=p.dtype, pin_memory=self.pin) for p, _ in self.pairs
            ]
        with torch.no_grad():  # copies in stream order: the policy is out before it is overwritten
            for (param, reference), buffer in zip(self.pairs, self.policy_buffers, strict=True):
                buffer.copy_(param, non_blocking=True)
                param.copy_(reference, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for (param, _), buffer in zip(self.pairs, self.policy_buffers, strict=True):
                    param.copy_(buffer, non_blocking=True)
