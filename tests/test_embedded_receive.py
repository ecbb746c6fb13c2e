"""The embedded server's receive paths of a weight update (both formats through the reused buffer,
then loaded, as SGLang receives aside then loads) and the single-threaded host copy they use."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_sat.platform.host_copy import copy_into
from megatron_sat.rollout.embedded.server import ServerConfig, ServerState


@pytest.fixture(scope="module")
def state(tiny_checkpoint):
    return ServerState(ServerConfig(model_path=str(tiny_checkpoint)))


class Group:
    """A weight-update group whose broadcasts write ``sent[i]`` into the i-th buffer, and
    record which storage each landed in; ``fail_at``: the broadcast that raises instead."""

    def __init__(self, sent, fail_at=None):
        self.sent, self.fail_at, self.pointers = list(sent), fail_at, []

    def broadcast(self, buf, src, async_op=False):
        assert src == 0
        i = len(self.pointers)
        if i == self.fail_at:
            raise RuntimeError("Connection closed by peer")
        self.pointers.append(buf.data_ptr())
        buf.copy_(self.sent[i].view(buf.dtype).reshape(buf.shape))
        return types.SimpleNamespace(wait=lambda: None) if async_op else None


def _body(state, names, group_name, load_format=None, dtype=None):
    targets = [state.engine.weight_targets[n] for n in names]
    return {
        "group_name": group_name,
        "names": names,
        "dtypes": [str(dtype or t.dtype).removeprefix("torch.") for t in targets],
        "shapes": [list(t.shape) for t in targets],
        "load_format": load_format,
        "flush_cache": False,
    }


def _update(state, body, sent, fail_at=None):
    group = Group(sent, fail_at)
    state.groups[body["group_name"]] = group
    try:
        fatal, specs, mismatches = state.check_update(body)
        assert fatal is None
        return state.receive_update(body, specs, mismatches), group
    finally:
        del state.groups[body["group_name"]]


def test_per_tensor_request_is_received_aside_then_loaded(state):
    # SGLang receives each tensor into a fresh buffer, then loads it
    # (model_runner_components/weight_updater.py: receive_weights_from_distributed,
    # load_weights_from_distributed): no broadcast lands in a parameter.
    names = list(state.engine.weight_targets)[:4]
    targets = [state.engine.weight_targets[n] for n in names]
    before = [t.detach().clone() for t in targets]
    sent = [torch.randn(t.shape, dtype=t.dtype) for t in targets]
    try:
        (ok, _), group = _update(state, _body(state, names, "aside"), sent)
        assert ok
        for target, new in zip(targets, sent, strict=True):
            assert torch.equal(target.detach(), new)
        buffer = state._receive_buffer
        start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
        assert all(start <= p < end and p % 64 == start % 64 for p in group.pointers)
        assert set(group.pointers).isdisjoint(t.data_ptr() for t in targets)
    finally:
        for target, old in zip(targets, before, strict=True):
            target.detach().copy_(old)


def test_flattened_request_loads_bitwise_through_the_buffer(state):
    names = list(state.engine.weight_targets)[:3]
    targets = [state.engine.weight_targets[n] for n in names]
    before = [t.detach().clone() for t in targets]
    new = [torch.randn(t.shape, dtype=t.dtype) for t in targets]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in new])
    try:
        body = _body(state, names, "flat", load_format="flattened_bucket")
        (ok, _), group = _update(state, body, [flat])
        assert ok and group.pointers == [state._receive_buffer.data_ptr()]
        for target, want in zip(targets, new, strict=True):
            assert torch.equal(target.detach(), want)
    finally:
        for target, old in zip(targets, before, strict=True):
            target.detach().copy_(old)


def test_mismatched_request_is_received_aside_and_changes_nothing(state):
    names = list(state.engine.weight_targets)[:2]
    targets = [state.engine.weight_targets[n] for n in names]
    before = [t.detach().clone() for t in targets]
    body = _body(state, names, "mismatch")
    body["shapes"][1] = [1, 2, 3]
    sent = [torch.randn(targets[0].shape), torch.randn(1, 2, 3)]
    (ok, message), group = _update(state, body, sent)
    assert not ok and message.startswith("rejected 1 parameter(s): ")
    assert set(group.pointers).isdisjoint(t.data_ptr() for t in targets)
    for target, old in zip(targets, before, strict=True):
        assert torch.equal(target.detach(), old)


def test_a_cast_is_received_aside_then_loaded(state):
    name = next(n for n, t in state.engine.weight_targets.items() if t.dtype == torch.float32)
    target = state.engine.weight_targets[name]
    before = target.detach().clone()
    sent = torch.randn(target.shape).to(torch.bfloat16)
    try:
        (ok, _), group = _update(state, _body(state, [name], "cast", dtype=torch.bfloat16), [sent])
        assert ok and group.pointers != [target.data_ptr()]
        assert torch.equal(target.detach(), sent.float())
    finally:
        target.detach().copy_(before)


def test_broken_broadcast_says_what_it_left(state):
    names = list(state.engine.weight_targets)[:3]
    targets = [state.engine.weight_targets[n] for n in names]
    before = [t.detach().clone() for t in targets]
    sent = [torch.randn(t.shape, dtype=t.dtype) for t in targets]
    version = state.scheduler.weight_version
    try:
        body = {**_body(state, names, "broken"), "weight_version": "never"}
        (ok, message), _ = _update(state, body, sent, fail_at=1)
        assert not ok and message.startswith("broadcast failed, no weight loaded")
        assert state.scheduler.weight_version == version
        # the first tensor's broadcast had completed: still nothing of it is loaded
        for target, old in zip(targets, before, strict=True):
            assert torch.equal(target.detach(), old)
        flat_body = _body(state, names, "broken_flat", load_format="flattened_bucket")
        (ok, message), _ = _update(state, flat_body, [], fail_at=0)
        assert not ok and message.startswith("broadcast failed, no weight loaded")
    finally:
        for target, old in zip(targets, before, strict=True):
            target.detach().copy_(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_copy_into_is_bitwise(dtype):
    src = (torch.randn(3, 5) * 100).to(dtype)
    dst = torch.zeros(3, 5, dtype=dtype)
    copy_into(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    # a cast and a strided destination go through torch's copy_
    wide = torch.zeros(3, 10)
    copy_into(wide[:, ::2], torch.ones(3, 5, dtype=torch.bfloat16))
    assert wide.sum().item() == 15.0 and wide[:, 1::2].abs().sum().item() == 0.0
    with pytest.raises(RuntimeError):
        copy_into(torch.zeros(2, 2), torch.zeros(3, 3))


def test_copy_into_bumps_the_version_as_copy_does():
    """A weight saved for backward and then overwritten fails at backward, as with copy_."""
    w = torch.ones(4, requires_grad=True)
    x = torch.ones(4, requires_grad=True)
    with torch.no_grad():
        target = w.detach()
    y = (x * target).sum()  # saves target
    before = target._version
    copy_into(target, torch.full((4,), 2.0))
    assert target._version == before + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
