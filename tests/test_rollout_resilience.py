"""Dead rollout servers: both pools stop using them, re-issue their work exactly once and take
a replacement only through ``replace_server``; the fleet drops a dead URL server from the
weight-update group; per-server utilisation and throughput are measured exactly (fake clock)."""

from __future__ import annotations

import itertools
import threading

import pytest
from test_async_pool import CharTokenizer, records

from megatron_sat.rollout.async_pool import AsyncPoolConfig, AsyncRolloutPool
from megatron_sat.rollout.client import GenerateOutput, SamplingParams, SGLangClient, SGLangError
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.embedded.launch import EmbeddedServer
from megatron_sat.rollout.fleet import PushReport, RolloutFleet, sync_servers
from megatron_sat.rollout.meter import ServerMeter, server_metrics
from megatron_sat.rollout.pool import NoLiveServer, RolloutPool
from megatron_sat.rollout.protocol import ReplyGuard
from megatron_sat.weight_sync.broadcast import UpdateStats


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FakeServer:
    """A client whose server answers 2 tokens per prompt, or fails once ``alive`` is False;
    each call advances ``clock`` (if given) by ``latency`` seconds."""

    def __init__(self, name, *, version=0, clock=None, latency=0.0):
        self.base_url = f"fake://{name}"
        self.guard = ReplyGuard(self.base_url)  # sync_servers tells it the pushed version
        self.version, self.clock, self.latency = version, clock, latency
        self.alive = True
        self.calls = 0
        self._lock = threading.Lock()

    def generate(self, input_ids, sampling, routing=None):
        with self._lock:
            self.calls += 1
        if not self.alive:
            raise SGLangError(f"POST {self.base_url}/generate failed: connection refused")
        if self.clock is not None:
            self.clock.t += self.latency
        return [
            GenerateOutput(
                output_ids=[50, 51],
                output_token_logprobs=[-0.1, -0.2],
                finish_reason="stop",
                weight_version=str(self.version),
                routed_experts=None,
                prompt_tokens=len(ids),
                completion_tokens=2,
            )
            for ids in input_ids
        ]


def test_meter_counts_overlapping_requests_once():
    clock = FakeClock()
    meter = ServerMeter(2, clock=clock)
    before = meter.snapshot()
    meter.begin(0)  # t=100
    clock.t += 1
    meter.begin(0)  # overlaps the first: server 0 stays busy, not twice as busy
    clock.t += 1
    meter.end(0, samples=3, tokens=30)
    clock.t += 1
    meter.end(0, samples=1, tokens=10)  # t=103: busy 3 s
    meter.begin(1)
    clock.t += 1
    meter.end(1, failed=True)  # t=104: busy 1 s
    meter.begin(1)
    clock.t += 4  # still in flight at the snapshot: busy up to now
    after = meter.snapshot()  # t=108
    m = server_metrics(before, after)
    assert m["rollout/server0/utilisation"] == pytest.approx(3 / 8)
    assert m["rollout/server0/samples_per_s"] == pytest.approx(4 / 8)
    assert m["rollout/server0/tokens_per_s"] == pytest.approx(40 / 8)
    assert m["rollout/server1/utilisation"] == pytest.approx(5 / 8)
    assert (m["rollout/server1/requests"], m["rollout/server1/failures"]) == (2.0, 1.0)
    with pytest.raises(RuntimeError, match="without a matching begin"):
        meter.end(0)
    with pytest.raises(ValueError, match="> 0 s"):
        server_metrics(after, after)


def test_async_pool_utilisation_and_throughput_per_server():
    """One server, 2 s per request, 3 s of training per step: utilisation 2/5 exactly."""
    clock = FakeClock()
    server = FakeServer("a", clock=clock, latency=2.0)
    meter = ServerMeter(1, clock=clock)
    pool = AsyncRolloutPool(
        [server],
        CharTokenizer(),
        lambda t, label: 0.0,
        records(),
        AsyncPoolConfig(mode="fixed_lag", lag=0, prompts_per_batch=2, group_size=2),
        SamplingParams(max_new_tokens=2),
        meter=meter,
    )
    pool.start()
    pool.get_batch(0, timeout_s=30)
    snapshot = meter.snapshot()
    rows = []
    for step in range(1, 4):
        clock.t += 3.0  # the train step; the server is idle (lag 0: nothing admitted)
        pool.wait_before_update(step, timeout_s=30)
        pool.set_version(step)
        pool.get_batch(step, timeout_s=30)
        now = meter.snapshot()
        rows.append(server_metrics(snapshot, now))
        snapshot = now
    pool.stop()
    for m in rows:
        assert m["rollout/server0/utilisation"] == pytest.approx(2 / 5)
        assert m["rollout/server0/samples_per_s"] == pytest.approx(4 / 5)
        assert m["rollout/server0/tokens_per_s"] == pytest.approx(8 / 5)
        assert m["rollout/server0/requests"] == 1.0


def test_async_pool_revives_a_slot_only_through_replace_server():
    a, b = FakeServer("a"), FakeServer("b")
    b.alive = False  # dies before its first request
    pool = AsyncRolloutPool(
        [a, b],
        CharTokenizer(),
        lambda t, label: 0.0,
        records(),
        AsyncPoolConfig(mode="bounded", lag=0, prompts_per_batch=2, group_size=2),
        SamplingParams(max_new_tokens=2),
        max_attempts=10,
    )
    fakes = [a, b]
    seen: list[tuple[int, int]] = []

    def run(first, last):
        """Consume batches first..last-1; after each, push the next version (lag 0: batch
        b + 1 is admitted then, so the servers are idle when this returns)."""
        for step in range(first, last):
            if step > 0:
                for f in fakes:
                    f.version = step
                pool.set_version(step)
            batch = pool.get_batch(step, timeout_s=30)
            assert len(batch) == 4
            assert {v for s in batch for v in s.response_versions} == {step}
            seen.extend((s.group_index, s.index) for s in batch)

    pool.start()
    run(0, 3)
    assert pool.down_servers() == {1}
    assert pool.stats.dead_servers == ["fake://b"]
    assert b.calls == 1  # one failed request, then nothing more to the dead slot
    assert pool.stats.reissued >= 1

    # Every server dead: the batch waits, queued, instead of being lost or failing the pool.
    a.alive = False
    for f in fakes:
        f.version = 3
    pool.set_version(3)
    with pytest.raises(NoLiveServer, match="every rollout server is dead"):
        pool.get_batch(3, timeout_s=30)
    a_calls = a.calls
    c = FakeServer("c", version=3)  # synced before the pool may use it
    fakes.append(c)
    pool.replace_server(1, c)
    batch = pool.get_batch(3, timeout_s=30)
    seen.extend((s.group_index, s.index) for s in batch)
    run(4, 6)
    assert c.calls >= 1 and a.calls == a_calls  # slot 0's old worker retired after failing
    d = FakeServer("d", version=5)
    fakes.append(d)
    pool.replace_server(0, d)
    run(6, 8)

    # A slot marked dead by its owner (idle now) gets nothing more.
    pool.mark_dead(0)
    d_calls = d.calls
    run(8, 10)
    pool.stop()
    assert d.calls == d_calls
    assert pool.stats.dead_servers == ["fake://b", "fake://a", "fake://d"]
    assert pool.stats.replaced == 2
    groups = [g for g, _ in seen]
    assert sorted(groups) == sorted(list(range(10 * 2)) * 2)  # each sample exactly once
    assert len({i for _, i in seen}) == len(seen)


def test_sync_pool_reissues_a_dead_servers_share_and_skips_it_afterwards():
    a, b = FakeServer("a"), FakeServer("b")
    b.alive = False
    pool = RolloutPool([a, b], CharTokenizer(), lambda t, label: 0.0, routing=None)
    prompts = list(itertools.islice(records(), 3))
    samples = pool.generate_groups(prompts, 2, temperature=1.0, max_new_tokens=2)
    assert [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [s.index for s in samples] == list(range(6))
    assert pool.down_servers() == {1} and pool.stats.dead_servers == ["fake://b"]
    assert pool.stats.reissued == 3  # b's whole share
    assert (b.calls, a.calls) == (1, 2)  # a: its own share, then b's
    pool.generate_groups(prompts, 2, temperature=1.0, max_new_tokens=2)
    assert (b.calls, a.calls) == (1, 3)

    a.alive = False
    with pytest.raises(NoLiveServer, match="every rollout server is dead"):
        pool.generate_groups(prompts, 2, temperature=1.0, max_new_tokens=2)
    c = FakeServer("c")
    pool.replace_server(0, c)
    samples = pool.generate_groups(prompts, 2, temperature=1.0, max_new_tokens=2)
    # The failed call used up no index or group id.
    assert [s.index for s in samples] == list(range(12, 18))
    assert [s.group_index for s in samples] == [6, 6, 7, 7, 8, 8]
    assert (c.calls, b.calls) == (1, 1)
    counters = pool.meter.snapshot().servers
    assert (counters[0].failures, counters[1].failures) == (1, 1)
    assert counters[0].samples == 6 + 6 + 6  # a twice (with b's share once), then c
    pool.close()


def test_fleet_drops_a_dead_url_server_and_keeps_pushing(tiny_checkpoint):
    """Servers given by URL are not restarted: a dead one leaves the group, the rest sync on.
    Server 1 dies after the health probe, as the push starts: the push fails, finds it dead,
    rebuilds the group without it and succeeds."""
    from safetensors.torch import load_file

    norm = load_file(tiny_checkpoint / "model.safetensors")["model.norm.weight"]
    calls = []

    def weights():
        calls.append(len(calls))
        return [("model.norm.weight", norm)]

    with (
        EmbeddedServer(tiny_checkpoint, random_seed=1) as a,
        EmbeddedServer(tiny_checkpoint, random_seed=2) as b,
    ):
        clients = [SGLangClient(s.url, max_retries=1, retry_backoff_s=0.1) for s in (a, b)]

        def weights_killing_b():
            b.process.kill()
            b.process.wait()
            return weights()

        with RolloutFleet(clients, updater_options={"timeout_s": 60}) as fleet:
            pool = RolloutPool(fleet.clients, CharTokenizer(), lambda t, label: 0.0, routing=None)
            first = sync_servers(fleet, [pool], weights, 0)
            assert first.regrouped and first.found_dead == () and first.down == ()
            report = sync_servers(fleet, [pool], weights_killing_b, 1)
            assert (report.found_dead, report.restarted, report.down) == ((1,), (), (1,))
            assert report.regrouped and fleet.restarts == [0, 0]
            assert len(calls) == 3  # push 0, the failed push 1, its retry
            assert pool.down_servers() == {1}
            assert clients[0].get_weight_version() == "1"
            samples = pool.generate_groups(
                list(itertools.islice(records(), 2)), 2, temperature=1.0, max_new_tokens=2
            )
            assert {v for s in samples for v in s.response_versions} == {1}
            assert pool.stats.reissued == 0  # b was never asked: marked dead before the call
            again = sync_servers(fleet, [pool], weights, 2)
            assert not again.regrouped and again.found_dead == () and again.down == (1,)
            assert clients[0].get_weight_version() == "2"
        pool.close()


class RecordingFleet:
    """Stands in for RolloutFleet in sync_servers: slot 1 is restarted, slot 2 stays down."""

    def __init__(self, events):
        self.events = events
        self.clients = [FakeServer("a"), FakeServer("b"), FakeServer("c")]

    def push(self, named_tensors, version, *, dead=()):
        self.events.append(("push begins", tuple(sorted(dead))))
        self.clients[1] = FakeServer("b2", version=version)
        self.events.append(("push done", version))
        return PushReport(
            update=UpdateStats(1, 4, 1, 0.0),
            found_dead=(1, 2),
            restarted=(1,),
            down=(2,),
            regrouped=True,
            restart_s=0.0,
        )


class RecordingPool:
    def __init__(self, events, down):
        self.events, self.down = events, set(down)

    def down_servers(self):
        return set(self.down)

    def mark_dead(self, index):
        self.events.append(("mark_dead", index))

    def replace_server(self, index, client):
        self.events.append(("replace_server", index, client.base_url))


def test_sync_servers_hands_a_restarted_client_over_only_after_the_push():
    events = []
    fleet = RecordingFleet(events)
    pools = [RecordingPool(events, {1}), RecordingPool(events, {2})]
    report = sync_servers(fleet, pools, lambda: [], 7)
    assert report.restarted == (1,)
    assert events == [
        ("push begins", (1, 2)),  # what every pool found dead
        ("push done", 7),
        ("mark_dead", 2),
        ("replace_server", 1, "fake://b2"),
        ("mark_dead", 2),
        ("replace_server", 1, "fake://b2"),
    ]


class RefusingServer(FakeServer):
    """Refuses (HTTP 400, as SGLang for a prompt beyond the context) any prompt of > 4 tokens,
    naming its index in the batch as the embedded server does."""

    def generate(self, input_ids, sampling, routing=None):
        for i, ids in enumerate(input_ids):
            if len(ids) > 4:
                from megatron_sat.rollout.client import SGLangRequestError

                message = f"POST {self.base_url}/generate -> HTTP 400: prompt {i}: too long"
                raise SGLangRequestError(message, 400)
        return super().generate(input_ids, sampling, routing)


def test_a_refused_request_fails_naming_the_prompt_and_keeps_the_servers():
    from megatron_sat.rollout.client import SGLangRequestError

    long_prompt = PromptRecord(prompt="12345+1=", label="12346", source_index=7)
    short = [PromptRecord(prompt="1+1", label="2", source_index=i) for i in range(3)]
    servers = [RefusingServer("a"), RefusingServer("b")]
    pool = RolloutPool(servers, CharTokenizer(), lambda t, label: 0.0, routing=None)
    # among four prompts of one request, the one refused is named
    with pytest.raises(SGLangRequestError, match=r"refused prompt row 7 '12345\+1='") as info:
        pool.generate_groups([*short, long_prompt], 1, temperature=1.0, max_new_tokens=2)
    assert info.value.status_code == 400
    assert pool.down_servers() == set() and pool.stats.reissued == 0  # no server condemned

    prompts = iter([long_prompt] * 4)
    apool = AsyncRolloutPool(
        servers,
        CharTokenizer(),
        lambda t, label: 0.0,
        prompts,
        AsyncPoolConfig(mode="fixed_lag", lag=0, prompts_per_batch=1, group_size=2),
        SamplingParams(max_new_tokens=2),
    )
    apool.start()
    try:
        with pytest.raises(RuntimeError, match="rollout pool failed") as info:
            apool.get_batch(0, timeout_s=30)
        assert isinstance(info.value.__cause__, SGLangRequestError)
        assert "row 7" in str(info.value.__cause__)
        assert apool.down_servers() == set() and apool.stats.reissued == 0
    finally:
        apool.stop()
