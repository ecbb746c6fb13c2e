"""A small fake SGLang server on loopback that breaks the protocol on demand, for the tests of
``rollout.protocol`` and ``bench/fault_matrix.py``.

``/generate`` answers every prompt with two tokens (ids 5, 6) in SGLang 0.5.23's reply shape
(``output_ids``, ``meta_info.finish_reason`` / ``weight_version`` / ``output_token_logprobs``
``[logprob, token_id, None]``), ``/model_info`` with the weight version, ``/health`` with 200.
``FakeSGLang.fault`` picks what goes wrong (``FAULTS``); ``faulty_replies`` bounds how many
replies carry it (then the server answers correctly: a flaky server).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = (
    "none",
    "positive_logprob",  # +3.5 for every token
    "nan_logprob",
    "future_version",  # weight_version "7"
    "truncated_json",  # a 200 whose body stops half-way
    "oversized",  # Content-Length of 300 MB (nothing more is sent)
    "oversized_chunked",  # no Content-Length, 8 MB of a JSON string until the connection ends
    "hang",  # never answers within the client's timeout
)


class FakeSGLang:
    """The server; use as a context manager (``url`` while inside)."""

    def __init__(self, fault: str = "none", *, faulty_replies: int | None = None) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.fault, self.faulty_replies = fault, faulty_replies
        self.version = "0"
        self.requests = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeSGLang:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _fault_now(self) -> str:
        with self._lock:
            self.requests += 1
            if self.faulty_replies is not None and self.requests > self.faulty_replies:
                return "none"
            return self.fault

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes, length: int | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/model_info":
                    self._send(200, json.dumps({"weight_version": fake.version}).encode())
                else:
                    self._send(200, b"{}")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path != "/generate":
                    self._send(200, json.dumps({"success": True}).encode())
                    return
                fault = fake._fault_now()
                if fault == "hang":
                    time.sleep(30)
                    return
                prompts = body["input_ids"]
                batch = prompts and not isinstance(prompts[0], int)
                items = [_item(p, fault, fake.version) for p in (prompts if batch else [prompts])]
                text = json.dumps(items if batch else items[0]).encode()
                if fault == "truncated_json":
                    self._send(200, text[: len(text) // 2])
                elif fault == "oversized":
                    self._send(200, b"", length=300_000_000)
                    self.close_connection = True
                elif fault == "oversized_chunked":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = True
                    try:
                        self.wfile.write(b'"')
                        for _ in range(8):
                            self.wfile.write(b"x" * (1 << 20))
                        self.wfile.write(b'"')
                    except OSError:  # the client refused it and hung up
                        pass
                else:
                    self._send(200, text)

        return Handler


def _item(prompt: list[int], fault: str, version: str) -> dict:
    logprob = {"positive_logprob": 3.5, "nan_logprob": float("nan")}.get(fault, -0.5)
    return {
        "output_ids": [5, 6],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 2},
            "weight_version": "7" if fault == "future_version" else version,
            "output_token_logprobs": [[logprob, 5, None], [logprob, 6, None]],
            "prompt_tokens": len(prompt),
            "completion_tokens": 2,
        },
    }
