"""The rollout protocol checked at the edge (``rollout.protocol``), against a fake SGLang
server on loopback (``tests/fake_sglang.py``) through the real ``SGLangClient``."""

from __future__ import annotations

import threading
import time

import pytest
from fake_sglang import FakeSGLang

from megatron_sat.rollout.client import SGLangClient, SGLangError
from megatron_sat.rollout.protocol import (
    BYTES_PER_SAMPLE,
    BYTES_PER_TOKEN,
    ProtocolViolation,
    ReplyGuard,
    generate_reply_cap,
    guard_clients,
    refusal_metrics,
)
from megatron_sat.rollout.sampling import GenerateOutput, RoutingSpec, SamplingParams

PARAMS = SamplingParams(max_new_tokens=2)


def _client(url: str, **kwargs) -> SGLangClient:
    client = SGLangClient(url, max_retries=kwargs.pop("max_retries", 1), retry_backoff_s=0.01)
    for key, value in kwargs.items():
        setattr(client, key, value)
    return client


def test_a_correct_reply_passes_and_counts_nothing():
    with FakeSGLang() as server:
        client = _client(server.url)
        guard_clients([client], version=0, max_reply_bytes=0)
        out = client.generate([[1, 2, 3], [4]], PARAMS)
    assert [o.output_token_logprobs for o in out] == [[-0.5, -0.5]] * 2
    assert client.guard.refused == {}
    assert refusal_metrics([client]) == {}


@pytest.mark.parametrize(
    ("fault", "kind", "message"),
    [
        ("positive_logprob", "positive_logprob", "output_token_logprobs[0] = 3.5 > 0"),
        ("future_version", "future_version", "weight_version '7' was never pushed"),
    ],
)
def test_contents_that_break_the_protocol_are_refused_and_counted(fault, kind, message):
    with FakeSGLang(fault) as server:
        client = _client(server.url)
        guard_clients([client], version=1, max_reply_bytes=0)
        with pytest.raises(ProtocolViolation) as info:
            client.generate([1, 2, 3], PARAMS)
    assert isinstance(info.value, SGLangError)  # the pools treat the server as failed
    assert info.value.kind == kind
    assert str(info.value).startswith(f"{server.url}/generate: {message}")
    assert refusal_metrics([client]) == {f"rollout/server0/refused_{kind}": 1.0}


def test_a_nan_logprob_is_refused():
    """A ``NaN`` literal is not JSON (RFC 8259; SGLang's orjson writes a NaN as null), so the
    body reader refuses the reply as malformed and it is retried; a non-finite value that does
    reach a parsed output is refused by the guard."""
    with FakeSGLang("nan_logprob") as server:
        client = _client(server.url)
        guard_clients([client], version=1, max_reply_bytes=0)
        with pytest.raises(SGLangError, match=r"/generate: reply is not JSON \(.*after 2 tries"):
            client.generate([1, 2, 3], PARAMS)
    assert client.guard.refused == {"malformed_json": 2}
    guard = ReplyGuard("http://s")
    out = GenerateOutput([5], [float("nan")], "stop", "0", None, 1, 1)
    with pytest.raises(ProtocolViolation, match=r"output_token_logprobs\[0\] = nan is not fin"):
        guard.check_output(out)
    assert guard.refused == {"nonfinite_logprob": 1}


def test_versions_are_checked_once_a_version_was_pushed():
    """``megatron-sat eval`` pushes nothing: a server's own version is not checked there."""
    with FakeSGLang("future_version") as server:
        client = _client(server.url)
        assert client.generate([1], PARAMS)[0].weight_version == "7"


def test_per_token_versions_are_checked_too():
    guard = ReplyGuard("http://s")
    guard.pushed_version = 2
    out = GenerateOutput([5, 6], [-0.1, -0.2], "stop", "2", None, 1, 2)
    assert guard.check_output(out) is out
    out.output_token_versions = ["2", "3"]
    with pytest.raises(ProtocolViolation, match="http://s/generate: weight_version '3' was never"):
        guard.check_output(out)
    out.output_token_versions = ["2", "default"]
    with pytest.raises(ProtocolViolation, match="'default' is not a version the trainer pushed"):
        guard.check_output(out)
    assert guard.refused == {"future_version": 1, "bad_version": 1}


def test_a_logprob_within_the_tolerance_of_zero_passes():
    guard = ReplyGuard("http://s")
    out = GenerateOutput([5], [5e-5], "stop", "0", None, 1, 1)
    assert guard.check_output(out) is out


def test_truncated_json_is_retried_then_named():
    with FakeSGLang("truncated_json") as server:
        client = _client(server.url, max_retries=2)
        with pytest.raises(SGLangError) as info:
            client.generate([1, 2], PARAMS)
    text = str(info.value)
    assert text.startswith(f"{server.url}/generate: reply is not JSON (")
    assert "(after 3 tries)" in text
    assert server.requests == 3
    assert client.guard.refused == {"malformed_json": 3}


def test_a_flaky_truncated_reply_is_recovered_by_the_retry():
    with FakeSGLang("truncated_json", faulty_replies=1) as server:
        client = _client(server.url, max_retries=2)
        out = client.generate([1, 2], PARAMS)
    assert out[0].output_ids == [5, 6] and server.requests == 2
    assert client.guard.refused == {"malformed_json": 1}


@pytest.mark.parametrize("fault", ["oversized", "oversized_chunked"])
def test_an_oversized_reply_is_refused_while_read_and_named(fault):
    """300 MB announced (refused on its Content-Length), or 8 MB without a length (refused
    once the bytes pass the cap): the per-request cap of 1 prompt of 2 tokens is ~131 kB."""
    with FakeSGLang(fault) as server:
        client = _client(server.url, max_retries=1)
        with pytest.raises(SGLangError) as info:
            client.generate([1, 2], PARAMS)
    text = str(info.value)
    assert text.startswith(f"POST {server.url}/generate failed: ReplyRefused(")
    assert f"cap of {generate_reply_cap([2], [2], None)} bytes" in text
    assert server.requests == 2  # retried once, like a transport error
    assert client.guard.refused == {"too_large": 2}


def test_a_fixed_cap_replaces_the_per_request_one():
    with FakeSGLang() as server:
        client = _client(server.url, max_retries=0)
        guard_clients([client], version=0, max_reply_bytes=100)
        with pytest.raises(SGLangError, match="larger than its cap of 100 bytes"):
            client.generate([1, 2], PARAMS)


def test_a_hung_server_ends_in_a_named_timeout():
    """The fake's /generate hangs while its liveness probe answers: the client's timeout
    rule (issue 21, ``rollout.engine.request_with_retries``) names the endpoint and the
    field to raise, and does not wait for ever."""
    with FakeSGLang("hang") as server:
        client = SGLangClient(server.url, timeout_s=0.5, max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(
            SGLangError,
            match=f"POST {server.url}/generate timed out on every attempt .*"
            "rollout.request_timeout_s",
        ):
            client.generate([1], PARAMS)
    assert time.monotonic() - t0 < 5


def test_the_reply_cap_by_hand():
    # 2 prompts (3 and 5 tokens), 4 new tokens each, routes 2 layers x top-2:
    # sample 1: 65536 + 64 * 7 + ceil(4 * 7 * 4 / 3) * 4 = 65536 + 448 + 38 * 4 = 66136
    # sample 2: 65536 + 64 * 9 + ceil(4 * 9 * 4 / 3) * 4 = 65536 + 576 + 48 * 4 = 66304
    routing = RoutingSpec(num_layers=2, top_k=2, num_experts=4)
    assert generate_reply_cap([3, 5], [4, 4], routing) == 2 * (66136 + 66304)
    assert generate_reply_cap([3], [4], None) == 2 * (BYTES_PER_SAMPLE + BYTES_PER_TOKEN * 7)


def test_a_client_without_a_guard_is_refused():
    class Bare:
        base_url = "fake://bare"

    with pytest.raises(TypeError, match="fake://bare.*has no ReplyGuard"):
        guard_clients([Bare()], 0, 0)


def test_the_cap_is_per_thread():
    """Concurrent generate calls (the pools' threads) each read their own request's cap."""
    guard = ReplyGuard("http://s")
    seen = {}

    def worker(cap: int) -> None:
        with guard.expecting(cap):
            time.sleep(0.05)
            seen[cap] = guard._local.cap

    threads = [threading.Thread(target=worker, args=(c,)) for c in (10, 20, 30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {10: 10, 20: 20, 30: 30}
