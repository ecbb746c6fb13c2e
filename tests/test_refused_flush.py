"""A push whose final bucket SGLang loads but whose cache flush it refuses is reported as what
it is: SGLang 0.5.23 records the new weight_version, then flushes, and a refused flush fails
the call with a message saying the weights were updated
(``srt/managers/scheduler_components/weight_updater.py``, ``flush_cache_after_weight_update``,
called after ``record_weight_version_after_update``). The updater must not say that no server
changed weights, nor resume generation as if nothing had happened."""

from __future__ import annotations

import ast

import pytest
import sglang_reference as ref
import torch

from megatron_sat.rollout.client import SGLangError
from megatron_sat.weight_sync.broadcast import SGLANG_FLUSH_REFUSED, WeightSyncError, WeightUpdater


def sglang_flush_refused_message() -> str:
    """The message of SGLang 0.5.23's refused flush after an update, from its source."""
    tree = ast.parse(ref.source("srt/managers/scheduler_components/weight_updater.py"))
    (function,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "flush_cache_after_weight_update"
    ]
    # Its one `return False, (<message>)`.
    (message,) = [
        element.value
        for node in ast.walk(function)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple)
        for element in node.value.elts
        if isinstance(element, ast.Constant) and isinstance(element.value, str)
    ]
    return message


class Channel:
    """A server's weight-update channel that records the calls of a session; its final
    bucket answers ``final_error``."""

    def __init__(self, url, final_error=None):
        self.base_url, self.final_error, self.calls = url, final_error, []

    def begin_weight_update(self, selector="all"):
        self.calls.append("begin")

    def end_weight_update(self):
        self.calls.append("end")

    def continue_generation(self):
        self.calls.append("continue")

    def pause_generation(self, mode="abort"):
        self.calls.append("pause")

    def update_weights_from_distributed(self, names, dtypes, shapes, *, weight_version, **kw):
        self.calls.append(("update", weight_version))
        if weight_version is not None and self.final_error is not None:
            raise SGLangError(
                f"{self.base_url}/update_weights_from_distributed: {self.final_error}"
            )


class Group:
    def broadcast(self, tensor, src, async_op=False):
        return None


def push(channels):
    updater = WeightUpdater(channels, bucket_bytes=1024)
    updater._group = Group()  # the broadcast itself is not under test here
    tensors = [("a", torch.zeros(200)), ("b", torch.zeros(200))]  # two buckets
    with pytest.raises(WeightSyncError) as info:
        updater.update(tensors, weight_version="5")
    updater._pool.shutdown()
    return str(info.value)


def test_sglangs_message_is_the_one_the_updater_recognises():
    assert sglang_flush_refused_message().startswith(SGLANG_FLUSH_REFUSED)
    source = ref.source("srt/managers/scheduler_components/weight_updater.py")
    assert source.index("self.record_weight_version_after_update(recv_req.weight_version)") < (
        source.index("success, message = self.flush_cache_after_weight_update(")
    )


def test_a_refused_flush_is_reported_as_loaded_and_the_servers_stay_paused():
    message = sglang_flush_refused_message()
    channels = [Channel("http://s0", message), Channel("http://s1")]
    text = push(channels)
    assert "holds the new weight_version" in text and "refused the cache flush" in text
    assert "http://s0" in text and message in text
    assert "No server changed weights" not in text and "mixed weights" not in text
    for channel in channels:
        assert channel.calls[-1] == "end" and "continue" not in channel.calls  # still paused


def test_another_final_bucket_failure_still_says_mixed_weights():
    channels = [Channel("http://s0", "shape mismatch for lm_head.weight"), Channel("http://s1")]
    text = push(channels)
    assert "mixed weights under their old weight_version" in text
    assert "holds the new weight_version" not in text
