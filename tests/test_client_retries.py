"""The rollout clients' retry policy against real HTTP servers on loopback
(``rollout.engine.request_with_retries``):

- a ``/generate`` that exceeds the timeout once is re-sent, and the server stays in the pool;
- a server that times out and fails its liveness probe too is declared dead, as is one that
  refuses connections; a living server that times out on every attempt stops the run with
  :class:`RequestTimeoutError` (naming ``rollout.request_timeout_s``) instead;
- vLLM >= 0.33 refuses new requests while paused in mode "abort" or "wait" with HTTP 503: the
  stand-in below answers as vLLM 0.33's code does (cited at each step), and requests wait and
  are re-sent after ``/resume``, with no server marked dead.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_sat.rollout.client import SamplingParams, SGLangClient, SGLangRequestError
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.engine import VLLM_PAUSED_MESSAGE, RequestTimeoutError
from megatron_sat.rollout.pool import NoLiveServer, RolloutPool
from megatron_sat.rollout.tokenizer import build_char_tokenizer
from megatron_sat.rollout.vllm.client import VLLMClient

TIMEOUT_S = 0.5


class FakeServer:
    """A loopback HTTP server; ``routes[(method, path)] -> (status, json body)`` answers, after
    ``delay(path, count)`` seconds (``count``: calls of the path so far, this one included)."""

    def __init__(self, routes, delay=lambda path, count: 0.0):
        self.routes, self.delay = routes, delay
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, method):
                path = self.path.split("?", 1)[0]
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                with owner.lock:
                    owner.calls[path] = owner.calls.get(path, 0) + 1
                    count = owner.calls[path]
                time.sleep(owner.delay(path, count))
                status, reply = owner.routes[(method, path)](body, self.path)
                data = json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timed out)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def sglang_generate(body, path):
    """SGLang's /generate reply for a batch: two tokens per prompt, version "0"."""
    items = []
    for _ in body["input_ids"]:
        items.append(
            {
                "output_ids": [50, 51],
                "meta_info": {
                    "finish_reason": {"type": "length", "length": 2},
                    "weight_version": "0",
                    "weight_versions": [{"version": "0", "start": 0, "end": 2}],
                    "output_token_logprobs": [[-0.1, 50, None], [-0.2, 51, None]],
                },
            }
        )
    return 200, items


SGLANG_ROUTES = {
    ("POST", "/generate"): sglang_generate,
    ("GET", "/model_info"): lambda body, path: (200, {"weight_version": "0"}),
    ("GET", "/health"): lambda body, path: (200, {}),
}


def make_pool(clients):
    tokenizer = build_char_tokenizer()
    return RolloutPool(clients, tokenizer, lambda text, label: 0.0, routing=None, stop_token_ids=[])


RECORDS = [PromptRecord(prompt=f"{a}+1=", label=str(a + 1), source_index=a) for a in range(3)]


def test_generate_over_the_timeout_once_is_retried_and_the_server_stays():
    server = FakeServer(
        SGLANG_ROUTES,
        delay=lambda path, n: 3 * TIMEOUT_S if (path == "/generate" and n == 1) else 0.0,
    )
    client = SGLangClient(server.url, TIMEOUT_S, retry_backoff_s=0.01)
    pool = make_pool([client])
    try:
        samples = pool.generate_groups(
            RECORDS, 2, temperature=1.0, max_new_tokens=2, with_routing=False
        )
        assert len(samples) == 6
        assert all(s.response_versions == [0, 0] for s in samples)
        assert pool.down_servers() == set()
        assert server.calls["/generate"] == 2  # the timed-out one and its retry
        assert server.calls["/model_info"] == 1  # the liveness probe after the timeout
    finally:
        pool.close()
        server.close()


def test_a_hung_server_whose_probe_fails_is_dead_and_its_work_moves():
    hung = FakeServer(SGLANG_ROUTES, delay=lambda path, n: 3 * TIMEOUT_S)
    good = FakeServer(SGLANG_ROUTES)
    clients = [SGLangClient(s.url, TIMEOUT_S, retry_backoff_s=0.01) for s in (hung, good)]
    pool = make_pool(clients)
    try:
        samples = pool.generate_groups(
            RECORDS, 2, temperature=1.0, max_new_tokens=2, with_routing=False
        )
        assert len(samples) == 6
        assert pool.down_servers() == {0}
        assert hung.calls["/generate"] == 1  # no retry: its probe failed at once
    finally:
        pool.close()
        hung.close()
        good.close()


def test_a_server_that_refuses_connections_is_dead():
    server = FakeServer(SGLANG_ROUTES)
    url = server.url
    server.close()
    pool = make_pool([SGLangClient(url, TIMEOUT_S, max_retries=1, retry_backoff_s=0.01)])
    try:
        with pytest.raises(NoLiveServer):
            pool.generate_groups(RECORDS, 2, temperature=1.0, max_new_tokens=2, with_routing=False)
        assert pool.down_servers() == {0}
    finally:
        pool.close()


def test_a_living_server_slower_than_the_timeout_stops_the_run_and_stays():
    server = FakeServer(
        SGLANG_ROUTES, delay=lambda path, n: 3 * TIMEOUT_S if path == "/generate" else 0.0
    )
    client = SGLangClient(server.url, TIMEOUT_S, max_retries=2, retry_backoff_s=0.01)
    pool = make_pool([client])
    try:
        with pytest.raises(RequestTimeoutError, match="rollout.request_timeout_s"):
            client.generate([1, 2], SamplingParams(max_new_tokens=2))
        assert server.calls["/generate"] == 3  # every attempt
        # The pool stops the run with it (a request error, 408) and keeps the server.
        with pytest.raises(SGLangRequestError, match="rollout.request_timeout_s") as info:
            pool.generate_groups(RECORDS, 2, temperature=1.0, max_new_tokens=2, with_routing=False)
        assert info.value.status_code == 408
        assert pool.down_servers() == set()
    finally:
        pool.close()
        server.close()


class PausingVLLM:
    """A stand-in of vLLM 0.33's routes the client uses, paused as vLLM 0.33 pauses.

    - ``POST /pause?mode=...`` (``entrypoints/rl/online/api_router.py`` ``pause_generation``)
      calls ``EngineCore.pause_generation`` (``vllm/v1/engine/core.py``), which sets
      ``reject_new_requests = mode != "keep"``; ``POST /resume`` (``resume_scheduler``) clears it.
    - A new request while ``reject_new_requests`` (``EngineCore._reject_add_while_paused``)
      finishes with ``RequestError(code="engine_paused", message="Generation is paused. Please
      retry after it resumes.", retryable=True)``; ``vllm/outputs.py``
      ``RequestError.to_exception`` makes it ``RetryableRequestError``
      (``vllm/exceptions.py``: ``status_code = HTTPStatus.SERVICE_UNAVAILABLE``), which the
      app's ``VLLMError`` handler answers with ``create_error_response``
      (``entrypoints/serve/exception_handling/error_response.py``): HTTP 503, ``ErrorResponse``
      ``{"error": {"message", "type": "ServiceUnavailableError", "param": null, "code": 503}}``.
    - In mode "keep" (and in vLLM 0.32, which had no such rule) new requests are queued.
    """

    def __init__(self):
        self.reject_new_requests = False
        self.refused = 0
        self.version = "7"
        self.server = FakeServer(
            {
                ("POST", "/inference/v1/generate"): self.generate,
                ("POST", "/pause"): self.pause,
                ("POST", "/resume"): self.resume,
                ("GET", "/health"): lambda body, path: (200, {}),
                ("GET", "/weight_info"): lambda body, path: (200, {"weight_version": self.version}),
            }
        )

    def pause(self, body, path):
        mode = path.split("mode=", 1)[1] if "mode=" in path else "abort"
        self.reject_new_requests = mode != "keep"
        return 200, {"status": "paused"}

    def resume(self, body, path):
        self.reject_new_requests = False
        return 200, {"status": "resumed"}

    def generate(self, body, path):
        if self.reject_new_requests:
            self.refused += 1
            error = {
                "message": VLLM_PAUSED_MESSAGE,
                "type": "ServiceUnavailableError",
                "param": None,
                "code": 503,
            }
            return 503, {"error": error}
        tokens = [60, 61, 62]
        choice = {
            "index": 0,
            "token_ids": tokens,
            "finish_reason": "length",
            "weight_versions": [{"version": self.version, "start": 0, "end": 3}],
            "logprobs": {"content": [{"token_id": t, "logprob": -0.3} for t in tokens]},
        }
        return 200, {"choices": [choice], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}


@pytest.mark.parametrize("mode", ["abort", "retract"])  # vLLM's "abort" and "wait"
def test_requests_to_a_paused_vllm_wait_for_the_resume(mode):
    vllm = PausingVLLM()
    client = VLLMClient(vllm.server.url, 30.0, retry_backoff_s=0.01)
    pool = make_pool([client])
    try:
        client.pause_generation(mode)
        assert vllm.reject_new_requests

        def resume_later():
            time.sleep(1.0)
            vllm.version = "8"
            client.continue_generation()

        threading.Thread(target=resume_later).start()
        t0 = time.monotonic()
        samples = pool.generate_groups(
            RECORDS, 2, temperature=1.0, max_new_tokens=3, with_routing=False
        )
        assert time.monotonic() - t0 >= 1.0
        assert vllm.refused >= 6  # every request was refused at least once while paused
        assert pool.down_servers() == set()
        assert all(s.response_versions == [8, 8, 8] for s in samples)
    finally:
        pool.close()
        vllm.server.close()


def test_a_paused_vllm_that_never_resumes_fails_after_the_paused_timeout():
    vllm = PausingVLLM()
    client = VLLMClient(vllm.server.url, 30.0, paused_timeout_s=0.5)
    client.pause_generation("abort")
    try:
        with pytest.raises(Exception, match=r"paused for more than 0.5 s"):
            client.generate([1, 2], SamplingParams(max_new_tokens=3))
    finally:
        client.close()
        vllm.server.close()
