"""Pipelined weight-push requests (``WeightUpdater(pipeline_requests=...)``): bucket k+1's
request is posted once rank 0's broadcast of bucket k completed, before bucket k's reply, and
only where that is safe (``weight_sync.request_order``); a failure mid-pipeline leaves the
servers paused and counted as changed, with no request loaded in part."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_sat.weight_sync.broadcast import WeightSyncError, WeightUpdater
from megatron_sat.weight_sync.request_order import can_pipeline_requests, gloo_root_peers


class Log:
    """Events of every channel and the group, in the order they happened."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def add(self, kind: str, index: int) -> None:
        with self._lock:
            self.events.append((kind, index))

    def at(self, kind: str, index: int) -> int:
        return self.events.index((kind, index))


class Channel:
    """A server that takes ``reply_s`` to answer each bucket; bucket ``fail_at`` is refused."""

    def __init__(self, log: Log, fail_at: int | None = None, reply_s: float = 0.15) -> None:
        self.base_url, self.log, self.fail_at, self.reply_s = "http://s0", log, fail_at, reply_s
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def pause_generation(self, mode="abort"):
        self.calls.append("pause")

    def begin_weight_update(self, selector="all"):
        self.calls.append("begin")

    def end_weight_update(self):
        self.calls.append("end")

    def continue_generation(self):
        self.calls.append("continue")

    def update_weights_from_distributed(self, names, dtypes, shapes, **kwargs):
        index = int(names[0].removeprefix("t").split("_")[0])  # t<bucket>[_<tensor>]
        self.log.add("post", index)
        with self._lock:  # one request at a time, as a server serves them
            time.sleep(self.reply_s)
            self.log.add("reply", index)
        if index == self.fail_at:
            raise RuntimeError(f"bucket {index}: rejected 1 parameter(s): {names[0]}: bad shape")


class Group:
    """Rank 0's end of the group: each broadcast completes at once, logged."""

    def __init__(self, log: Log) -> None:
        self.log, self.count = log, 0

    def broadcast(self, tensor, src, async_op=False):
        self.log.add("broadcast", self.count)
        self.count += 1


def push(num_buckets: int, pipeline: bool, fail_at: int | None = None):
    log = Log()
    channel = Channel(log, fail_at)
    updater = WeightUpdater([channel], bucket_bytes=1024, pipeline_requests=pipeline)
    updater._group = Group(log)  # the broadcasts' bytes are not under test here
    tensors = [(f"t{i}", torch.full((200,), float(i))) for i in range(num_buckets)]  # 800 B each
    try:
        updater.update(tensors, weight_version="v1")
        error = None
    except WeightSyncError as e:
        error = str(e)
    loaded = updater.loaded_any
    updater._pool.shutdown()
    return log, channel, error, loaded


def test_pipelined_requests_are_posted_after_the_broadcast_before_the_reply():
    log, channel, error, _ = push(5, pipeline=True)
    assert error is None
    at = log.at
    # The second bucket waits for the first one's reply: a refused first bucket changes nothing.
    assert at("post", 1) > at("reply", 0)
    for k in range(2, 4):
        assert at("broadcast", k - 1) < at("post", k) < at("reply", k - 1), log.events
        assert at("post", k) > at("reply", k - 2)  # at most two requests in flight
    # The last bucket sets the version: posted only once every earlier bucket loaded.
    assert at("post", 4) > at("reply", 3)
    assert channel.calls == ["pause", "begin", "end", "continue"]


class AsyncGroup:
    """Rank 0's end for per-tensor buckets: each broadcast is a work whose wait is logged as
    ("sent", bucket * 10 + tensor); tensors are named ``t<bucket>_<tensor>``."""

    def __init__(self, log: Log, fail_at: int | None = None) -> None:
        self.log, self.count, self.fail_at = log, 0, fail_at

    def broadcast(self, tensor, src, async_op=False):
        assert async_op
        code, self.count = self.count, self.count + 1

        def wait():
            if code == self.fail_at:
                raise RuntimeError("Connection closed by peer")
            self.log.add("sent", code)

        return SimpleNamespace(wait=wait)


def test_per_tensor_bucket_posts_the_next_after_its_first_message():
    """The next request travels while the rest of bucket k is on the wire: posted after
    bucket k's first tensor was received, before its last."""
    log = Log()
    channel = Channel(log)
    updater = WeightUpdater([channel], bucket_bytes=800, unpacked_from_bytes=1)
    assert updater.pipeline_requests
    updater._group = AsyncGroup(log)
    post = updater._post

    def logged_post(bucket, index, weight_version):  # on the sender's thread, in order
        log.add("posting", index)
        return post(bucket, index, weight_version)

    updater._post = logged_post
    tensors = [(f"t{k}_{j}", torch.zeros(100)) for k in range(4) for j in range(2)]  # 400 B
    updater.update(tensors, weight_version="v1")
    updater._pool.shutdown()
    at = log.at
    # Bucket k's tensors are broadcasts 2k and 2k + 1; bucket 2 is the first posted ahead:
    # after bucket 1's first message, before its second and before bucket 1's reply.
    assert at("sent", 2) < at("posting", 2) < at("sent", 3), log.events
    assert at("posting", 2) < at("reply", 1)
    assert at("posting", 3) > at("reply", 2)  # the last bucket: after every reply


def test_without_pipelining_each_request_waits_for_the_previous_reply():
    log, _, error, _ = push(4, pipeline=False)
    assert error is None
    assert [e for e in log.events if e[0] != "broadcast"] == [
        (kind, k) for k in range(4) for kind in ("post", "reply")
    ]


def test_failure_mid_pipeline_keeps_the_servers_paused_and_changed():
    """Bucket 2 is refused while bucket 3 is already posted and broadcast: bucket 3 loads, no
    further bucket is posted, the servers count as changed and stay paused."""
    log, channel, error, loaded = push(6, pipeline=True, fail_at=2)
    assert error is not None and loaded
    assert "bucket 2" in error and "t2" in error and "bad shape" in error
    assert "bucket 3, posted before that failure was known, loaded on every server" in error
    assert "stay paused" in error and "No server changed weights" not in error
    posted = [k for kind, k in log.events if kind == "post"]
    assert posted == [0, 1, 2, 3]  # nothing after the failure was known
    assert channel.calls == ["pause", "begin", "end"]  # no continue_generation


def test_refused_first_bucket_changes_nothing_even_when_pipelined():
    log, channel, error, loaded = push(4, pipeline=True, fail_at=0)
    assert error is not None and not loaded
    assert "No server changed weights" in error
    assert [k for kind, k in log.events if kind == "post"] == [0]
    assert channel.calls == ["pause", "begin", "end", "continue"]


def test_gloo_root_peers_follow_the_binomial_tree():
    # gloo/broadcast.cc from root 0: vrank 0 sends to vrank 0 ^ (1 << i) for every i.
    assert gloo_root_peers(1) == []
    assert gloo_root_peers(2) == [1]
    assert gloo_root_peers(3) == [1, 2]
    assert gloo_root_peers(9) == [1, 2, 4, 8]


@pytest.mark.parametrize(
    "backend, ranks, expected",
    [
        ("gloo", [1], True),
        ("gloo", [1, 1], True),  # ranks 1 and 2
        ("gloo", [1, 1, 1], False),  # rank 3 is reached through rank 1
        ("gloo", [2, 2], True),  # ranks 1-2 and 3-4: 4 is rank 0's peer
        ("gloo", [2, 2, 2], False),  # ranks 5-6
        ("nccl", [1], False),  # no completion proof on NCCL
    ],
)
def test_pipelining_needs_rank_0_to_reach_every_server(backend, ranks, expected):
    assert can_pipeline_requests(backend, ranks) is expected


def test_forced_pipelining_where_unsafe_is_refused():
    channels = [Channel(Log()) for _ in range(3)]
    with pytest.raises(ValueError, match="pipeline_requests=True needs a gloo group"):
        WeightUpdater(channels, pipeline_requests=True)
    with pytest.raises(ValueError, match="pipeline_requests must be"):
        WeightUpdater(channels[:1], pipeline_requests="yes")
    assert WeightUpdater(channels).pipeline_requests is False  # auto: three servers of 1 rank
    assert WeightUpdater(channels[:1]).pipeline_requests is True


def test_sglang_serves_a_paused_servers_update_requests_one_at_a_time():
    """The fact pipelining relies on, from SGLang 0.5.23's source: while paused, an update
    request holds ``is_pause_cond`` (an ``asyncio.Condition``: its lock wakes waiters in
    order) around the whole scheduler call, so a later request waits for the reply."""
    import ast

    import sglang_reference as ref

    manager = ref.source("srt/managers/tokenizer_manager.py")
    assert "self.is_pause_cond = asyncio.Condition()" in manager
    tree = ast.parse(ref.source("srt/managers/tokenizer_control_mixin.py"))
    (update,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.AsyncFunctionDef) and node.name == "update_weights_from_distributed"
    ]
    held = [
        ast.unparse(inner)
        for node in ast.walk(update)
        if isinstance(node, ast.AsyncWith) and ast.unparse(node.items[0]) == "self.is_pause_cond"
        for inner in ast.walk(node)
        if isinstance(inner, ast.Await)
    ]
    assert held == ["await self.update_weights_from_distributed_communicator(obj)"]


def _logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Log-probs [R] of ``response`` after ``prompt`` under ``model`` at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).view(-1)


def test_embedded_server_mid_pipeline_failure_loads_whole_requests_only(tiny_checkpoint):
    """Five buckets to the embedded server, pipelined; bucket 2 is refused (an unknown name)
    while bucket 3 is already posted: buckets 0, 1 and 3 load whole, bucket 2 not at all (its
    good tensor neither), bucket 4 is never posted; the server stays paused under its old
    version. Checked by log-probs against transformers with exactly those weights."""
    from transformers import AutoModelForCausalLM

    from megatron_sat.rollout.client import SamplingParams
    from megatron_sat.rollout.embedded.launch import EmbeddedServer

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    layer = "model.layers.{}."
    buckets = [  # bucket_bytes 256: each line is one bucket (a 4 KiB o_proj travels alone)
        [
            layer.format(0) + "input_layernorm.weight",
            layer.format(0) + "post_attention_layernorm.weight",
        ],
        [
            layer.format(1) + "input_layernorm.weight",
            layer.format(1) + "post_attention_layernorm.weight",
        ],
        ["model.norm.weight", "model.layers.0.mlp.unknown"],
        [layer.format(0) + "self_attn.o_proj.weight"],
        [layer.format(1) + "self_attn.o_proj.weight"],  # the last: posted after every reply
    ]
    new = {
        name: params[name].detach() + 0.5 if name in params else torch.zeros(32)
        for bucket in buckets
        for name in bucket
    }
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, sampling_seed=7)
    prompt = [5, 17, 3, 9]
    with EmbeddedServer(tiny_checkpoint, random_seed=0, dist_timeout_s=60) as server:
        client = server.client()
        with WeightUpdater([client], bucket_bytes=256, timeout_s=60) as updater:
            assert updater.pipeline_requests  # auto: one gloo server
            with pytest.raises(WeightSyncError) as info:
                updater.update(list(new.items()), weight_version="never")
        assert updater.loaded_any
        text = str(info.value)
        assert "bucket 2" in text and "model.layers.0.mlp.unknown: unknown parameter" in text
        assert "bucket 3, posted before that failure was known, loaded on every server" in text
        assert "bucket 4" not in text and "stay paused" in text
        assert client.get_weight_version() == "default"
        client.continue_generation()  # left paused by the push; resumed here to read it
        (out,) = client.generate(prompt, sampling)
    served = torch.tensor(out.output_token_logprobs)
    with torch.no_grad():
        for name in buckets[0] + buckets[1] + buckets[3]:
            params[name].copy_(new[name])
        expected = _logprobs(model, prompt, out.output_ids)
        params["model.norm.weight"].copy_(new["model.norm.weight"])  # as if bucket 2 half-loaded
        half = _logprobs(model, prompt, out.output_ids)
    torch.testing.assert_close(served, expected, atol=1e-5, rtol=0)
    assert (served - half).abs().max() > 1e-3


def test_broken_broadcast_mid_pipeline_still_sends_the_bucket_posted_ahead():
    """Bucket 2's second message fails after bucket 3 was posted: bucket 3 is still broadcast
    (its server would wait for it otherwise), both replies are awaited, nothing more is
    posted, and the servers, which may hold part of a per-tensor bucket, stay paused."""
    log = Log()
    channel = Channel(log, reply_s=0.05)
    updater = WeightUpdater([channel], bucket_bytes=800, unpacked_from_bytes=1)
    updater._group = AsyncGroup(log, fail_at=5)  # bucket 2's second tensor
    tensors = [(f"t{k}_{j}", torch.zeros(100)) for k in range(6) for j in range(2)]
    with pytest.raises(WeightSyncError, match="rank 0 broadcast failed") as info:
        updater.update(tensors, weight_version="v1")
    updater._pool.shutdown()
    assert updater.loaded_any and "stay paused" in str(info.value)
    assert [k for kind, k in log.events if kind == "post"] == [0, 1, 2, 3]
    assert ("sent", 6) in log.events and ("sent", 7) in log.events  # bucket 3 went out
    assert ("reply", 3) in log.events and channel.calls == ["pause", "begin", "end"]


def test_a_later_stage_failing_is_reported_as_mixed_weights_under_the_old_version():
    """Per-stage push: stage 0 loads its buckets, a later stage fails (loaded_elsewhere). With
    no failure of its own, stage 0 must not report "every server ... holds the new
    weight_version" (found by review: all() of no failures was True)."""
    log = Log()
    channel = Channel(log, reply_s=0.0)
    updater = WeightUpdater([channel], bucket_bytes=1024)
    updater._group = Group(log)
    try:
        updater.begin_update()
        updater.send_buckets([(f"t{i}", torch.zeros(200)) for i in range(3)], None)
        with pytest.raises(WeightSyncError) as raised:
            updater.end_update(WeightSyncError("stage 1 failed"), loaded_elsewhere=True)
    finally:
        updater._pool.shutdown()
    assert "holds the new weight_version" not in str(raised.value)
    assert "old weight_version" in str(raised.value)


@pytest.mark.parametrize(("pipeline", "failing", "posted"), [(False, 1, 1), (True, 2, 3)])
def test_a_packing_error_leaves_no_server_waiting_in_a_broadcast(
    monkeypatch, pipeline, failing, posted
):
    """A bucket is packed before its request is posted, except a bucket posted ahead, which
    is still broadcast (as it is) when its packing fails: every posted request gets its
    broadcast, or a real server would wait in it until the group's timeout."""
    import megatron_sat.weight_sync.buckets as buckets

    real, calls = buckets.pack_into, []

    def pack_into(tensors, staging):
        calls.append(len(calls))
        if len(calls) == failing + 1:
            raise MemoryError(f"packing bucket {failing} failed")
        return real(tensors, staging)

    monkeypatch.setattr(buckets, "pack_into", pack_into)
    log = Log()
    channel = Channel(log, reply_s=0.01)
    updater = WeightUpdater([channel], bucket_bytes=1024, pipeline_requests=pipeline)
    updater._group = Group(log)
    tensors = [(f"t{i}", torch.full((200,), float(i))) for i in range(5)]  # a bucket each
    with pytest.raises(MemoryError, match=f"packing bucket {failing} failed"):
        updater.update(tensors, weight_version="v1")
    updater._pool.shutdown()
    kinds = [kind for kind, _ in log.events]
    assert kinds.count("post") == kinds.count("broadcast") == kinds.count("reply") == posted
    # Earlier buckets loaded (and, pipelined, bucket 2's bytes as they were): the sessions end,
    # the servers stay paused until a retry.
    assert updater.loaded_any and channel.calls == ["pause", "begin", "end"]


class PausingChannel(Channel):
    """A server whose ``/begin_weight_update`` answers once ``ready`` is set (or after 5 s):
    it records whether the first bucket was built by then."""

    def __init__(self, log: Log, ready: threading.Event, refuse_begin: bool = False) -> None:
        super().__init__(log, reply_s=0.0)
        self.ready, self.refuse_begin, self.ready_at_begin = ready, refuse_begin, None

    def begin_weight_update(self, selector="all"):
        self.ready_at_begin = self.ready.wait(timeout=5.0)
        super().begin_weight_update(selector)
        if self.refuse_begin:
            raise RuntimeError("a weight-update session is already open")


def test_the_first_bucket_is_packed_while_the_servers_pause(monkeypatch):
    """``update`` starts the producer before ``/pause_generation``: bucket 0 is gathered and
    packed while the servers pause and open their sessions."""
    import megatron_sat.weight_sync.buckets as buckets

    real, packed = buckets.pack_into, threading.Event()

    def pack_into(tensors, staging):
        flat = real(tensors, staging)
        packed.set()
        return flat

    monkeypatch.setattr(buckets, "pack_into", pack_into)
    log = Log()
    channel = PausingChannel(log, packed)
    updater = WeightUpdater([channel], bucket_bytes=1024)
    updater._group = Group(log)
    updater.update([(f"t{i}", torch.full((200,), float(i))) for i in range(3)], "v1")
    updater._pool.shutdown()
    assert channel.ready_at_begin is True  # False: begin waited 5 s for a pack that never came
    assert channel.calls == ["pause", "begin", "end", "continue"]
    assert sorted(log.events) == sorted(
        (kind, k) for k in range(3) for kind in ("post", "broadcast", "reply")
    )


def test_a_refused_begin_stops_the_producer_and_leaves_the_rest_of_the_source():
    """A ``/begin_weight_update`` refused after the producer read ahead: nothing is posted or
    broadcast, generation resumes, and every tensor the producer did not read is still in
    the source, in order (a Megatron push drains it on every rank: the export's collectives)."""
    log, read = Log(), threading.Event()

    def source():
        for i in range(6):
            yield f"t{i}", torch.full((200,), float(i))
            read.set()

    channel = PausingChannel(log, read, refuse_begin=True)
    updater = WeightUpdater([channel], bucket_bytes=1024)
    updater._group = Group(log)
    tensors = source()
    with pytest.raises(WeightSyncError, match="No server changed weights"):
        updater.update(tensors, "v1")
    updater._pool.shutdown()
    rest = [name for name, _ in tensors]
    assert channel.ready_at_begin is True and not log.events
    assert channel.calls == ["pause", "begin", "continue"]  # no session opened: no end
    # Two staging slots: at most buckets 0 and 1, and the one tensor read ahead, were taken.
    assert 1 <= 6 - len(rest) <= 3 and rest == [f"t{i}" for i in range(6 - len(rest), 6)]


class SessionChannel(Channel):
    """A server that refuses a second ``/begin_weight_update`` while a session is open (as
    SGLang does) and takes ``begin_s`` to open one."""

    def __init__(self, log: Log, begin_s: float = 0.0) -> None:
        super().__init__(log, reply_s=0.0)
        self.begin_s, self.session = begin_s, False

    def begin_weight_update(self, selector="all"):
        time.sleep(self.begin_s)
        if self.session:
            raise RuntimeError("a weight-update session is already open")
        self.session = True
        super().begin_weight_update(selector)

    def end_weight_update(self):
        self.session = False
        super().end_weight_update()


def test_an_interrupt_while_begin_travels_ends_the_session_it_opened():
    """Ctrl-C in the trainer while ``/begin_weight_update`` is on its way: the begin lands,
    so its session is ended and generation resumed before the interrupt propagates; the next
    push is not refused for a session left open (found by review)."""
    import _thread

    log = Log()
    channel = SessionChannel(log, begin_s=0.3)
    updater = WeightUpdater([channel], bucket_bytes=1024)
    updater._group = Group(log)
    tensors = [(f"t{i}", torch.full((200,), float(i))) for i in range(2)]
    timer = threading.Timer(0.1, _thread.interrupt_main)  # SIGINT's KeyboardInterrupt
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        updater.update(tensors, "v1")
    timer.join()
    assert channel.calls == ["pause", "begin", "end", "continue"] and not channel.session
    assert not log.events  # nothing was posted or broadcast
    channel.begin_s = 0.0
    updater.update(tensors, "v2")
    updater._pool.shutdown()
    assert channel.calls[4:] == ["pause", "begin", "end", "continue"]


def test_a_second_update_while_one_runs_is_refused_and_the_first_is_intact():
    """Two threads pushing through one updater would share its sessions and staging buffers
    (the second's producer packing over the first's bucket on the wire): the second is
    refused before it touches anything (found by review)."""
    log = Log()
    channel = SessionChannel(log, begin_s=0.3)
    updater = WeightUpdater([channel], bucket_bytes=1024)
    sent: list[torch.Tensor] = []

    class Recording(Group):
        def broadcast(self, tensor, src, async_op=False):
            sent.append(tensor.clone())
            super().broadcast(tensor, src, async_op)

    updater._group = Recording(log)
    first = [(f"t{i}", torch.full((200,), float(i))) for i in range(3)]
    errors: list[BaseException] = []

    def push() -> None:
        try:
            updater.update(first, "v1")
        except BaseException as e:  # pragma: no cover - reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=push)
    thread.start()
    time.sleep(0.1)  # the first update waits for its begin
    with pytest.raises(RuntimeError, match="another update\\(\\) is in progress"):
        updater.update([(f"t{i}", torch.full((200,), -1.0)) for i in range(3)], "v2")
    thread.join()
    updater._pool.shutdown()
    assert not errors and channel.calls == ["pause", "begin", "end", "continue"]
    assert [t.view(torch.float32)[0].item() for t in sent] == [0.0, 1.0, 2.0]


def test_a_producer_not_entered_is_refused_instead_of_waited_for():
    log = Log()
    updater = WeightUpdater([Channel(log, reply_s=0.0)], bucket_bytes=1024)
    updater._group = Group(log)
    producer = updater.prepare([("t0", torch.zeros(200))])
    with pytest.raises(RuntimeError, match="enter the BucketProducer"):
        updater.send_buckets(producer, "v1")
    updater._pool.shutdown()
    assert not log.events
