"""The whole /generate call in a reply worker process (``rollout.reply_parser``'s fetch: the
request, the body read, the size cap, the malformed-JSON resend, the parse) against the same
call in the calling thread (``SGLangClient.generate`` without a parser), on a loopback HTTP
server in this process.

Oracle: the in-thread call. The outputs are the same bit for bit, the errors of the same class
and message, the refusals counted alike in the caller's guard; calls in flight together each get
their own reply; a worker killed with calls in flight fails them all with a named error; the
seeded async pool makes the same samples. One parser and one server serve the module.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pytest
from test_reply_parser import ROUTING, CharTokenizer, _fields, assert_same_samples, seeded_reply

from megatron_sat.rollout.async_pool import AsyncPoolConfig, AsyncRolloutPool
from megatron_sat.rollout.client import SGLangClient, SGLangError
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.reply_parser import ReplyParser, ReplyParserError
from megatron_sat.rollout.sampling import SamplingParams

# The server's behaviour, chosen by a prompt's first token.
MALFORMED_ONCE = 900  # the first reply to it is not JSON, then a good one
ALWAYS_MALFORMED = 901
HOLD = 902  # 902, 903: wait for the test's release (a generation in progress)
DELAY = 800  # 800 + k: the reply waits 0.05 * k s


class _Server:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen: dict[int, int] = {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                content = self.rfile.read(int(self.headers["Content-Length"]))
                self.send_reply(server.answer(content))

            def send_reply(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the caller's worker was killed (the death test)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def answer(self, content: bytes) -> bytes:
        prompts = orjson.loads(content)["input_ids"]
        first = prompts[0][0] if isinstance(prompts[0], list) else prompts[0]
        with self.lock:
            self.seen[first] = self.seen.get(first, 0) + 1
            count = self.seen[first]
        if first == ALWAYS_MALFORMED or (first == MALFORMED_ONCE and count == 1):
            return b'{"meta_info": [1]}'
        if first in (HOLD, HOLD + 1):
            self.release.wait(60)
        if DELAY <= first < DELAY + 20:
            time.sleep(0.05 * (first - DELAY))
        return seeded_reply(content)


@pytest.fixture(scope="module")
def server():
    own = _Server()
    yield own
    own.release.set()
    own.http.shutdown()


@pytest.fixture(scope="module")
def parser():
    with ReplyParser(1) as shared:
        yield shared


def _client(url: str, **options) -> SGLangClient:
    client = SGLangClient(url, **{"max_retries": 1, "retry_backoff_s": 0.0, **options})

    def not_here(*args, **kwargs):
        raise AssertionError("the reply was fetched in the trainer's process")

    client.fetch_reply = not_here  # the class's stays, for worker_spec: the worker's is used
    return client


def _outcome(client: SGLangClient, prompts, parser, **kwargs):
    sampling = [SamplingParams(max_new_tokens=5, sampling_seed=7 + i) for i in range(len(prompts))]
    try:
        outputs = client.generate(prompts, sampling, reply_parser=parser, **kwargs)
    except Exception as e:  # the oracle compares any exception
        return "raised", type(e), str(e), getattr(e, "status_code", None)
    return "returned", [_fields(o) for o in outputs]


def test_outputs_are_bit_identical_to_the_in_thread_call(server, parser):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    here = SGLangClient(server.url)
    there = _client(server.url)
    assert there.worker_spec() is not None
    expected = _outcome(here, prompts, None, routing=ROUTING)
    assert expected[0] == "returned" and expected[1][0]["routes"][1] == (7 + 5 - 1, 48, 8)
    got = _outcome(there, prompts, parser, routing=ROUTING)
    assert got == expected
    assert got[1][0]["routes"][0] == "uint8"


def test_a_malformed_reply_is_resent_and_counted_in_the_callers_guard(server, parser):
    client = _client(server.url)
    (out,) = client.generate(
        [MALFORMED_ONCE, 1, 2],
        SamplingParams(max_new_tokens=4, sampling_seed=3),
        routing=ROUTING,
        reply_parser=parser,
    )
    assert server.seen[MALFORMED_ONCE] == 2 and client.guard.refused == {"malformed_json": 1}
    assert len(out.output_ids) >= 1 and out.routed_experts.shape[1:] == (48, 8)
    # on every try: the same error and counts as in the thread
    outcomes = []
    for reply_parser, c in (
        (None, SGLangClient(server.url, max_retries=1, retry_backoff_s=0.0)),
        (parser, _client(server.url)),
    ):
        outcomes.append(_outcome(c, [[ALWAYS_MALFORMED, 1]], reply_parser))
        assert c.guard.refused == {"malformed_json": 2}
    assert outcomes[0] == outcomes[1] and outcomes[0][1] is SGLangError
    assert "reply is not JSON" in outcomes[0][2] and "(after 2 tries)" in outcomes[0][2]


def test_the_size_cap_refuses_in_the_worker_and_counts_in_the_caller(server, parser):
    outcomes = []
    for reply_parser, client in (
        (None, SGLangClient(server.url, max_retries=1, retry_backoff_s=0.0)),
        (parser, _client(server.url)),
    ):
        client.guard.max_reply_bytes = 1000  # the parent's fixed cap reaches the worker
        outcomes.append(_outcome(client, [[1, 2, 3]], reply_parser, routing=ROUTING))
        assert client.guard.refused == {"too_large": 2}  # the first try and its retry
    assert outcomes[0] == outcomes[1] and outcomes[0][1] is SGLangError
    assert "larger than its cap of 1000 bytes" in outcomes[0][2]


def test_a_refused_connection_raises_what_the_thread_raises(parser):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    here = _outcome(SGLangClient(url, max_retries=1, retry_backoff_s=0.0), [[1, 2]], None)
    there = _outcome(_client(url), [[1, 2]], parser)
    assert here == there and here[1] is SGLangError  # the pool's "server failed" class
    assert "Connection refused" in here[2] or "ConnectError" in here[2]


def test_calls_in_flight_together_each_get_their_own_reply(server, parser):
    client = _client(server.url)
    prompts = [[DELAY + 8 - k, k, 3] for k in range(8)]  # the first sent answers last
    expected = [_outcome(SGLangClient(server.url), [p], None, routing=ROUTING) for p in prompts]
    got: dict[int, object] = {}

    def call(k: int) -> None:
        got[k] = _outcome(client, [prompts[k]], parser, routing=ROUTING)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [got[k] for k in range(8)] == expected


def test_a_worker_killed_with_calls_in_flight_fails_them_all_by_name(server):
    server.release.clear()
    client = _client(server.url)
    errors: list[BaseException | None] = [None] * 4
    with ReplyParser(1) as own:

        def call(k: int) -> None:
            try:
                client.generate(
                    [HOLD, k], SamplingParams(max_new_tokens=2, sampling_seed=k), reply_parser=own
                )
            except BaseException as e:  # the test inspects it
                errors[k] = e

        threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server.seen.get(HOLD, 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        (pid,) = own.pids
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a call waited for a dead worker"
        server.release.set()
        for error in errors:
            assert isinstance(error, ReplyParserError)
            assert f"reply parser worker 0 (pid {pid}) died with 4 call(s) in flight" in str(error)
            assert "exit code -9" in str(error)
        with pytest.raises(ReplyParserError, match="died with 4"):
            client.generate([1, 2], SamplingParams(max_new_tokens=2), reply_parser=own)


def _pool_samples(url: str, workers: int) -> list:
    records = (PromptRecord(prompt=f"{i}+1=", label="", source_index=i) for i in range(100))
    client = SGLangClient(url)
    pool = AsyncRolloutPool(
        [client],
        CharTokenizer(),
        lambda text, label: float(len(text)),
        records,
        AsyncPoolConfig(prompts_per_batch=2, group_size=2, reply_parse_workers=workers),
        SamplingParams(max_new_tokens=6),
        routing=ROUTING,
        seed_of=lambda batch, drawn, slot: 1000 * batch + 10 * drawn + slot,
    )
    if workers:  # every reply is fetched in the worker: none in this process
        client.fetch_reply = lambda *a, **k: pytest.fail("fetched in the trainer's process")
    pool.start()
    try:
        return [s for batch in (0, 1) for s in pool.get_batch(batch, timeout_s=60)]
    finally:
        pool.stop()
        client.close()


def test_the_pool_makes_the_same_samples_with_the_fetch_in_workers(server):
    without, with_workers = _pool_samples(server.url, 0), _pool_samples(server.url, 1)
    assert len(without) == 8
    assert_same_samples(without, with_workers)


def test_errors_cross_with_their_class_message_and_attributes():
    from megatron_sat.rollout.engine import RequestTimeoutError, SGLangRequestError
    from megatron_sat.rollout.protocol import ProtocolViolation, ReplyRefused
    from megatron_sat.rollout.reply_parser import _rebuild, portable

    errors = [
        SGLangRequestError("POST x/generate -> HTTP 400: too long", 400),
        RequestTimeoutError("POST x/generate timed out"),
        ProtocolViolation("x/generate: weight_version '9'", "future_version"),
        ReplyRefused("x/generate: reply larger than its cap", "too_large"),
        SGLangError("x/generate failed: ConnectError('refused')"),
    ]
    for error in errors:
        back = _rebuild(pickle.loads(pickle.dumps(portable(error))))
        assert (type(back), str(back)) == (type(error), str(error))
        assert getattr(back, "status_code", None) == getattr(error, "status_code", None)
        assert getattr(back, "kind", None) == getattr(error, "kind", None)
    assert RequestTimeoutError("t").status_code == 408 == _rebuild(portable(errors[1])).status_code
    # a class the parent cannot import is named, not changed silently
    lost = _rebuild(("no_such_module", "Boom", ("it broke",), {}))
    assert isinstance(lost, ReplyParserError)
    assert "no_such_module.Boom raised in a reply parser worker could not be rebuilt" in str(lost)
    assert "it broke" in str(lost)


def test_close_ends_the_calls_in_flight_with_a_named_error(server):
    server.release.clear()
    client = _client(server.url)
    held = server.seen.get(HOLD + 1, 0)
    errors: list[BaseException | None] = [None] * 2
    own = ReplyParser(1)
    own.start()
    assert len(own.pids) == 1

    def call(k: int) -> None:
        try:
            client.generate(
                [HOLD + 1, k], SamplingParams(max_new_tokens=2, sampling_seed=k), reply_parser=own
            )
        except BaseException as e:  # the test inspects it
            errors[k] = e

    threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.seen.get(HOLD + 1, 0) < held + 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    own.close()
    for t in threads:
        t.join(timeout=30)
    server.release.set()
    assert not any(t.is_alive() for t in threads), "close() left a call waiting"
    for error in errors:
        assert isinstance(error, ReplyParserError) and "closed" in str(error)
    with pytest.raises(ReplyParserError, match="used after close"):
        own.start()
