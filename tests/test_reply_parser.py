"""The /generate reply parse in a worker process (rollout.reply_parser) against the same parse in
the calling thread (rollout.generate_reply, the client's path with ``reply_parse_workers`` = 0).

Oracle: the in-thread parse. On real SGLang-shaped replies the two give the same outputs bit
for bit (ids, log-prob bits, routes' dtype, shape and bytes, versions, meta_info); on every
malformed body and payload the tests of the in-thread path refuse (tests/test_route_decode.py),
the process raises the same class with the same message. One parser serves the module (a
worker starts in about a second).
"""

from __future__ import annotations

import base64
import os
import pickle
import signal
import struct
import threading

import httpx
import numpy as np
import orjson
import pytest
from test_route_decode import MALFORMED, MALFORMED_BODIES, _reply, decode_stdlib

from megatron_sat.rollout.async_pool import AsyncPoolConfig, AsyncRolloutPool
from megatron_sat.rollout.client import SGLangClient, SGLangError
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.generate_reply import ReplyRequest
from megatron_sat.rollout.protocol import ProtocolViolation, ReplyRefused
from megatron_sat.rollout.reply_parser import (
    RemoteTraceback,
    ReplyParser,
    ReplyParserError,
    parse_in_thread,
)
from megatron_sat.rollout.sampling import RoutingSpec, SamplingParams

ROUTING = RoutingSpec(num_layers=48, top_k=8, num_experts=128)
URL = "http://sglang.test"


@pytest.fixture(scope="module")
def parser():
    with ReplyParser(1) as shared:
        yield shared


def _fields(out) -> dict:
    """Everything an output holds, floats as their bits, routes as (dtype, shape, bytes)."""
    routes = out.routed_experts
    return {
        "output_ids": [(type(t), t) for t in out.output_ids],
        "logprobs": [struct.pack("<d", v) for v in out.output_token_logprobs],
        "finish_reason": out.finish_reason,
        "weight_version": out.weight_version,
        "routes": None if routes is None else (routes.dtype, routes.shape, routes.tobytes()),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "meta_info": out.meta_info,
        "output_token_versions": out.output_token_versions,
    }


def _outcome(parse, body: bytes, request: ReplyRequest):
    """("returned", fields of each output) or ("raised", class, message)."""
    try:
        outputs = parse(body, request).outputs()
    except Exception as e:  # the oracle compares any exception
        return "raised", type(e), str(e)
    return "returned", [_fields(o) for o in outputs]


def test_process_parse_is_bit_identical_on_real_replies(parser):
    replies = [_reply(30, num_tokens=5), _reply(31, num_tokens=11, text='"routed_experts" \\')]
    replies.append(_reply(32, routes=False, num_tokens=3))
    replies[-1]["meta_info"]["finish_reason"] = {"type": "abort"}  # aborted: no routes
    replies[0]["meta_info"]["weight_versions"] = [
        {"version": "2", "start": 0, "end": 2},
        {"version": "3", "start": 2, "end": 5},
    ]
    body = orjson.dumps(replies)
    request = ReplyRequest(URL, (7, 7, 7), ROUTING)
    want = _outcome(parse_in_thread, body, request)
    assert want[0] == "returned"
    assert _outcome(parser.parse, body, request) == want
    outs = parser.parse(body, request).outputs()
    # hand values: _reply's log-probs are -0.25 * i, its routes the base64 of the int32 ids
    assert outs[1].output_token_logprobs == [-0.25 * i for i in range(11)]
    assert outs[0].output_token_versions == ["2", "2", "3", "3", "3"]
    routes = orjson.loads(body)[1]["meta_info"]["routed_experts"]
    shape = {"num_tokens": 7 + 11 - 1, "num_layers": 48, "top_k": 8, "num_experts": 128}
    assert outs[1].routed_experts.tobytes() == decode_stdlib(routes, **shape).tobytes()
    assert outs[1].routed_experts.dtype == np.uint8 and outs[2].routed_experts is None
    # the typed, bulky per-token triples do not come back in meta_info (either path)
    assert "output_token_logprobs" not in outs[0].meta_info
    assert outs[0].meta_info["e2e_latency"] == 0.5


def test_routes_of_no_rows_come_back_empty_and_the_parser_stays_whole(parser):
    """A one-token prompt with no output has routes of 0 rows (SGLang sends ""): the worker
    returns the in-thread path's empty (0, 48, 8) array (found by review: memoryview refused
    to cast the zero shape, the worker died and the parser broke)."""
    from megatron_sat.routing.payload import encode_routed_experts

    reply = _reply(40, routes=False, num_tokens=0)
    reply["meta_info"]["routed_experts"] = encode_routed_experts(np.zeros((0, 48, 8), np.int32))
    body, request = orjson.dumps([reply]), ReplyRequest(URL, (1,), ROUTING)
    want = _outcome(parse_in_thread, body, request)
    assert want[0] == "returned" and want[1][0]["routes"][1] == (0, 48, 8)
    assert _outcome(parser.parse, body, request) == want
    again = orjson.dumps([_reply(41, num_tokens=2)])
    assert _outcome(parser.parse, again, ReplyRequest(URL, (7,), ROUTING))[0] == "returned"


@pytest.mark.parametrize(("case", "payload", "shape"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_every_malformed_route_payload_is_refused_alike(parser, case, payload, shape):
    reply = _reply(40, routes=False, num_tokens=1)
    reply["meta_info"]["routed_experts"] = payload
    num_layers, top_k, num_experts = shape["num_layers"], shape["top_k"], shape["num_experts"]
    # one output token: the routes then have prompt_len rows
    request = ReplyRequest(
        URL, (max(0, shape["num_tokens"]),), RoutingSpec(num_layers, top_k, num_experts)
    )
    body = orjson.dumps(reply)
    want = _outcome(parse_in_thread, body, request)
    assert want[0] == "raised" or case == "negative_num_tokens"
    assert _outcome(parser.parse, body, request) == want


@pytest.mark.parametrize(("body", "message"), MALFORMED_BODIES)
def test_every_malformed_body_is_refused_alike(parser, body, message):
    """Stage 1 raises from ``parse`` itself (the guard refuses the body), same class and
    message, with the worker's traceback as the cause."""
    request = ReplyRequest(URL, (1,), ROUTING)
    with pytest.raises(ValueError) as local:
        parse_in_thread(body, request)
    with pytest.raises(ValueError) as remote:
        parser.parse(body, request)
    assert type(remote.value) is type(local.value)
    assert str(remote.value) == str(local.value) and str(local.value).startswith(message)
    assert isinstance(remote.value.__cause__, RemoteTraceback)
    assert "split_routed_experts" in str(remote.value.__cause__)


@pytest.mark.parametrize(
    "change",
    [
        {"output_ids": [3.9, True]},
        {"output_ids": "ab"},
        {"output_token_logprobs": [[None, 5]]},
        {"output_token_logprobs": [[-0.1, True]]},
        {"finish_reason": None},
        {"weight_versions": [{"version": "1", "start": 0, "end": 9}]},
        {"prompt_tokens": "abc"},  # these two escaped as ValueError / TypeError (review)
        {"completion_tokens": [1]},
    ],
)
def test_malformed_outputs_are_refused_alike(parser, change):
    reply = {
        "output_ids": change.pop("output_ids", [5]),
        "meta_info": {
            "finish_reason": {"type": "length", "length": 1},
            "weight_version": "0",
            "output_token_logprobs": [[-0.1, 5]],
            **change,
        },
    }
    body = orjson.dumps(reply)
    request = ReplyRequest(URL, (1,))
    want = _outcome(parse_in_thread, body, request)
    assert want[0] == "raised" and want[1] is SGLangError and URL in want[2]
    assert _outcome(parser.parse, body, request) == want


def _client(bodies: list[bytes]) -> tuple[SGLangClient, list[int]]:
    """A client whose server answers ``bodies`` in turn; the list counts the requests."""
    client = SGLangClient(URL, max_retries=1, retry_backoff_s=0.0)
    sent, replies = [], iter(bodies)

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(1)
        return httpx.Response(200, content=next(replies))

    client._http = httpx.Client(base_url=URL, transport=httpx.MockTransport(answer))
    return client, sent


def test_a_malformed_body_is_refused_counted_and_sent_again(parser):
    good = orjson.dumps(_reply(50, num_tokens=4))
    client, sent = _client([b'{"meta_info": [1]}', good])
    (out,) = client.generate(
        [1] * 7, SamplingParams(max_new_tokens=4), routing=ROUTING, reply_parser=parser
    )
    assert len(sent) == 2 and client.guard.refused == {"malformed_json": 1}
    assert out.output_ids == orjson.loads(good)["output_ids"]
    # after the last try: the client's error, the message the in-thread path gives
    messages = []
    for reply_parser in (None, parser):
        client, sent = _client([b"{"] * 2)
        with pytest.raises(SGLangError) as info:
            client.generate([1], SamplingParams(max_new_tokens=1), reply_parser=reply_parser)
        messages.append(str(info.value))
        assert len(sent) == 2 and client.guard.refused == {"malformed_json": 2}
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"{URL}/generate: reply is not JSON (reply body is not")


def test_the_guard_checks_stay_with_the_client(parser):
    client, _ = _client([orjson.dumps(_reply(51, num_tokens=2))])
    client.guard.pushed_version = 2  # the reply says version 3: never pushed
    with pytest.raises(ProtocolViolation, match="weight_version '3' was never pushed"):
        client.generate([1] * 7, SamplingParams(max_new_tokens=2), reply_parser=parser)
    assert client.guard.refused == {"future_version": 1}


def test_protocol_errors_pickle_with_their_kind():
    import pickle

    for error in (ReplyRefused("too big", "too_large"), ProtocolViolation("v 9", "bad_version")):
        back = pickle.loads(pickle.dumps(error))
        assert (type(back), str(back), back.kind) == (type(error), str(error), error.kind)


def test_a_killed_worker_is_named_not_waited_for():
    body = orjson.dumps(_reply(60, num_tokens=2))
    request = ReplyRequest(URL, (7,), ROUTING)
    with ReplyParser(1) as own:
        own.parse(body, request)
        (pid,) = own.pids
        os.kill(pid, signal.SIGKILL)
        errors = []
        caller = threading.Thread(target=lambda: errors.append(_raised(own, body, request)))
        caller.start()
        caller.join(timeout=30)
        assert not caller.is_alive(), "parse waited for a dead worker"
        (error,) = errors
        assert isinstance(error, ReplyParserError)
        assert f"reply parser worker 0 (pid {pid}) died" in str(error)
        assert "exit code -9" in str(error)
        # every later call fails the same way, at once
        assert str(_raised(own, body, request)) == str(error)
    with pytest.raises(ReplyParserError, match="used after close"):
        own.parse(body, request)


def test_a_call_stopped_half_way_breaks_the_parser_loudly(monkeypatch):
    """Ctrl-C (here a BaseException) half-way through sending a call leaves the worker's
    stream out of step: later calls get a named error instead of a wrong reply or a wait for a
    worker that never comes back."""
    import megatron_sat.rollout.reply_parser as reply_parser

    class Interrupt(BaseException):
        pass

    real = reply_parser.send_frame

    def interrupted(sock, data):
        real(sock, data)  # the call's frame went, its body not
        raise Interrupt

    body = orjson.dumps(_reply(61, num_tokens=2))
    request = ReplyRequest(URL, (7,), ROUTING)
    with ReplyParser(1) as own:
        own.parse(body, request)
        monkeypatch.setattr(reply_parser, "send_frame", interrupted)
        with pytest.raises(Interrupt):
            own.parse(body, request)
        monkeypatch.setattr(reply_parser, "send_frame", real)
        error = _raised(own, body, request)
        assert isinstance(error, ReplyParserError)
        assert "worker 0" in str(error) and "stopped half-way through a call (Interrupt)" in str(
            error
        )


def _raised(parser: ReplyParser, body: bytes, request: ReplyRequest) -> BaseException | None:
    try:
        parser.parse(body, request)
    except BaseException as e:  # the test inspects it
        return e
    return None


# ---- the pool: the same samples with the parse in a process as without -------------------------


class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(33 + i % 90) for i in ids)


def seeded_reply(content: bytes) -> bytes:
    """The reply of a server whose answer is a function of the request alone (its prompt and
    sampling seed): ids, log-probs and routes (48 x top-8 of 128) drawn from a generator seeded
    by them."""
    sent = orjson.loads(content)
    prompts, params = sent["input_ids"], sent["sampling_params"]
    batch = isinstance(prompts[0], list)
    prompts, params = (prompts, params) if batch else ([prompts], [params])
    replies = []
    for prompt, param in zip(prompts, params, strict=True):
        rng = np.random.default_rng([param["sampling_seed"], *prompt])
        n = int(rng.integers(1, param["max_new_tokens"] + 1))
        ids = rng.integers(3, 1000, size=n).tolist()
        logprobs = (-rng.exponential(0.5, size=n)).tolist()
        routes = rng.integers(0, 128, size=(len(prompt) + n - 1, 48, 8)).astype("<i4")
        meta = {
            "finish_reason": {"type": "length"},
            "weight_version": "0",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
            "routed_experts": base64.b64encode(routes.tobytes()).decode(),
        }
        replies.append({"output_ids": ids, "meta_info": meta})
    return orjson.dumps(replies if batch else replies[0])


def _seeded_client() -> SGLangClient:
    """A client of :func:`seeded_reply`'s server (a mock transport: read here, parsed in the
    worker)."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=seeded_reply(request.content))

    client = SGLangClient(URL)
    client._http = httpx.Client(base_url=URL, transport=httpx.MockTransport(answer))
    return client


def _pool_samples(workers: int) -> list:
    records = (PromptRecord(prompt=f"{i}+1=", label="", source_index=i) for i in range(100))
    pool = AsyncRolloutPool(
        [_seeded_client()],
        CharTokenizer(),
        lambda text, label: float(len(text)),
        records,
        AsyncPoolConfig(prompts_per_batch=2, group_size=2, reply_parse_workers=workers),
        SamplingParams(max_new_tokens=6),
        routing=ROUTING,
        seed_of=lambda batch, drawn, slot: 1000 * batch + 10 * drawn + slot,
    )
    pool.start()
    try:
        samples = [s for batch in (0, 1) for s in pool.get_batch(batch, timeout_s=60)]
        # the replies went through the pool's parser processes (none with 0 workers)
        assert len(pool._reply_parser.pids if workers else []) == workers
        return samples
    finally:
        pool.stop()


def assert_same_samples(want: list, got: list) -> None:
    """The two pools' samples are equal bit for bit: ids, log-probs (as their bits), versions,
    rewards, uint8 routes."""
    for a, b in zip(want, got, strict=True):
        assert (a.index, a.group_index, a.prompt_ids, a.response_ids) == (
            b.index,
            b.group_index,
            b.prompt_ids,
            b.response_ids,
        )
        assert [struct.pack("<d", v) for v in a.rollout_log_probs] == [
            struct.pack("<d", v) for v in b.rollout_log_probs
        ]
        assert a.response_versions == b.response_versions and a.reward == b.reward
        assert a.routed_experts.dtype == b.routed_experts.dtype == np.uint8
        assert a.routed_experts.tobytes() == b.routed_experts.tobytes()


def test_the_pool_makes_the_same_samples_with_parse_workers():
    without, with_workers = _pool_samples(0), _pool_samples(1)
    assert len(without) == 8
    assert_same_samples(without, with_workers)


@pytest.mark.parametrize("body", ["[]", memoryview(b"[]")], ids=["str", "memoryview"])
def test_a_body_of_another_type_is_refused_as_in_thread_and_the_parser_stays_whole(parser, body):
    """The in-thread parse's TypeError, nothing sent (found by review: a str killed the worker,
    a memoryview was parsed)."""
    request = ReplyRequest(URL, (7,), ROUTING)
    with pytest.raises(TypeError, match=f"must be bytes or bytearray, got {type(body).__name__}"):
        parse_in_thread(body, request)
    with pytest.raises(TypeError, match=f"must be bytes or bytearray, got {type(body).__name__}"):
        parser.parse(body, request)
    good = orjson.dumps([_reply(42, num_tokens=2)])
    assert _outcome(parser.parse, good, request)[0] == "returned"


def test_a_request_that_does_not_pickle_fails_alone(parser):
    """Pickled before anything is sent: the call fails, the parser stays whole."""
    request = ReplyRequest(URL, (7,), ROUTING)
    bad = ReplyRequest(lambda: None, (7,), ROUTING)
    good = orjson.dumps([_reply(43, num_tokens=2)])
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        parser.parse(good, bad)
    assert _outcome(parser.parse, good, request)[0] == "returned"


def test_a_worker_that_cannot_start_breaks_the_parser_by_name(monkeypatch):
    """Out of file descriptors at the third worker: a named ReplyParserError on every call,
    the two started workers ended, no parser of fewer workers (found by review: a bare
    OSError, which the pool takes for a dead server, then 2 of 3 workers silently)."""
    import subprocess

    import megatron_sat.rollout.reply_parser as reply_parser

    real, started = subprocess.Popen, []

    def popen(*args, **kwargs):
        if len(started) == 2:
            raise OSError(24, "Too many open files")
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(reply_parser.subprocess, "Popen", popen)
    body, request = orjson.dumps([_reply(44, num_tokens=2)]), ReplyRequest(URL, (7,), ROUTING)
    with ReplyParser(3) as own:
        for _ in range(2):
            with pytest.raises(ReplyParserError, match="could not start worker 2 of 3"):
                own.parse(body, request)
    assert [p.poll() is not None for p in started] == [True, True]
    with pytest.raises(ValueError, match="num_workers >= 1"):
        ReplyParser(1.5)


ORPHAN = """
import os, sys, time
from megatron_sat.rollout.reply_parser import ReplyParser
parser = ReplyParser(1)
parser.start()
if os.fork() == 0:  # a child of the trainer holding the socket's other end
    time.sleep(60)
    os._exit(0)
os.write(1, f"{parser.pids[0]}\\n".encode())
time.sleep(60)
"""


def test_a_worker_ends_with_a_sigkilled_trainer_whose_child_holds_its_socket():
    """Found by review: the worker outlived a SIGKILLed trainer while a forked child of the
    trainer held the socket open (it waited for EOF); now it ends with its parent."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 10
        while time.time() < deadline and os.path.exists(f"/proc/{worker}"):
            with open(f"/proc/{worker}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.1)
        alive = os.path.exists(f"/proc/{worker}")
        if alive:
            with open(f"/proc/{worker}/stat") as f:
                alive = f.read().rsplit(")", 1)[1].split()[0] != "Z"
        assert not alive
    finally:
        proc.kill()
        subprocess.run(["pkill", "-f", "time.sleep\\(60\\)"], check=False)


class _TrainerOnlyStr(str):
    """A class the worker cannot import (this test module is not on its path), as a class
    of a trainer's own script would be."""


def test_a_call_the_worker_cannot_load_fails_alone(parser):
    """Found by review: a call that pickles here but not there killed the worker (its frame
    could not be read, the stream fell out of step) and broke the parser."""
    good = orjson.dumps([_reply(45, num_tokens=2)])
    odd = ReplyRequest(_TrainerOnlyStr(URL), (7,), ROUTING)
    with pytest.raises(ValueError, match="cannot load the call's arguments"):
        parser.parse(good, odd).outputs()
    assert _outcome(parser.parse, good, ReplyRequest(URL, (7,), ROUTING))[0] == "returned"
