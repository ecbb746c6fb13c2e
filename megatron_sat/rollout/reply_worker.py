"""The worker process of ``rollout.reply_parser``: serves its parent's calls (fetch and parse a
``/generate`` reply, or parse a body sent along) on one socket, each call in a thread of its
own, its reply frame tagged with the call's id (the wire is ``rollout.reply_parser``'s).

A fetch is ``SGLangClient.fetch_reply`` on a client built from the parent client's constructor
arguments (``SGLangClient.worker_spec``; one client per spec, shared by the calls, its
connections pooled): the same retries, paused wait, size cap and malformed-JSON resend as in the
parent's thread. Each call's refusals are counted apart (``ReplyGuard.counting``) and sent back
with its result; the content checks (``ReplyGuard.check_output``) are the parent's.
"""

from __future__ import annotations

import dataclasses
import encodings.idna  # noqa: F401  # httpx imports it at a client's first request (20 ms)
import importlib
import pickle
import signal
import socket
import threading
import traceback
from typing import Any

import numpy as np

from megatron_sat.platform.lifetime import end_with_parent
from megatron_sat.rollout.client import SGLangClient
from megatron_sat.rollout.generate_reply import ReplyRequest, parse_outputs
from megatron_sat.rollout.reply_parser import (
    CALL_HEAD,
    FETCH,
    PARSE,
    STAGE_OK,
    STAGE_PARSE,
    STAGE_RAISE,
    parse_in_thread,
    portable,
    recv_frame,
    recv_into,
    send_frame,
)
from megatron_sat.routing.wire import split_generate_reply


def serve_fd(fd: int) -> None:
    """A worker process's entry point: :func:`serve` on the inherited socket ``fd``, ending
    with the trainer (``platform.lifetime.end_with_parent``: a forked child of the trainer
    holding the socket's other end would otherwise keep it open after a SIGKILL)."""
    end_with_parent()
    serve(socket.socket(fileno=fd))


_UNLOADABLE = "unloadable"  # a call whose (kind, args) pickle did not load here


def serve(sock: socket.socket) -> None:
    """A worker's loop: read each call (its frame: ``CALL_HEAD``'s id and body size, then the
    pickle of ``(kind, args)``; then the body) and run it in a new thread, until the parent
    closes its end. Ctrl-C is the parent's to handle: the worker exits with the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = _Server(sock)
    try:
        for spec in pickle.loads(recv_frame(sock)):  # the clients to build before any call
            server.client(spec)
        send_frame(sock, b"")  # ready
    except (EOFError, OSError):
        return
    while True:
        try:
            frame = recv_frame(sock)
            call_id, size = CALL_HEAD.unpack_from(frame)
            body = bytearray(size)
            recv_into(sock, memoryview(body))
        except (EOFError, OSError):
            return
        try:
            kind, args = pickle.loads(memoryview(frame)[CALL_HEAD.size :])
        except Exception as e:  # e.g. a class of the trainer's __main__: this call fails alone
            kind, args = _UNLOADABLE, e
        threading.Thread(
            target=server.run, args=(call_id, kind, args, body), name=f"call{call_id}", daemon=True
        ).start()


class _Server:
    """The calls' shared state: the socket's send lock and the clients by spec."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()
        self.clients: dict[tuple[Any, ...], SGLangClient] = {}
        self.clients_lock = threading.Lock()

    def run(self, call_id: int, kind: str, args: Any, body: bytearray) -> None:
        """Run one call and send its reply."""
        refused: dict[str, int] = {}
        if kind == PARSE:
            stage, result, remote_tb = _parse_one(body, args)
        elif kind == FETCH:
            stage, result, remote_tb, refused = self._fetch(*args)
        elif kind == _UNLOADABLE:
            error = ValueError(f"reply worker cannot load the call's arguments: {args!r}")
            stage, result, remote_tb = STAGE_RAISE, portable(error), ""
        else:
            error = ValueError(f"reply worker: unknown call kind {kind!r}")
            stage, result, remote_tb = STAGE_RAISE, portable(error), ""
        del body  # the outputs hold no view of it
        try:
            self._reply(call_id, stage, result, remote_tb, refused)
        except OSError:
            pass  # the parent is gone: the main loop ends on its EOF

    def _fetch(
        self, spec: dict[str, Any], body: dict[str, Any], request: ReplyRequest, cap: int
    ) -> tuple[str, Any, str, dict[str, int]]:
        client = self.client(spec)
        with client.guard.counting() as tally:
            try:
                outputs = client.fetch_reply(body, request, cap, parse_in_thread).outputs()
                return STAGE_OK, outputs, "", dict(tally)
            except Exception as e:  # handed to the parent with its class
                return STAGE_RAISE, portable(e), traceback.format_exc(), dict(tally)

    def client(self, spec: dict[str, Any]) -> SGLangClient:
        """The client of ``spec`` (``SGLangClient.worker_spec``), built on first use."""
        key = tuple(sorted(spec.items()))
        with self.clients_lock:
            client = self.clients.get(key)
            if client is None:
                kwargs = dict(spec)
                module, name = kwargs.pop("class").rsplit(":", 1)
                client = getattr(importlib.import_module(module), name)(**kwargs)
                self.clients[key] = client
            return client

    def _reply(
        self, call_id: int, stage: str, result: Any, remote_tb: str, refused: dict[str, int]
    ) -> None:
        """The reply frame, then (outputs) each one's routes raw, under the send lock."""
        if stage != STAGE_OK:
            frame = pickle.dumps((call_id, stage, result, remote_tb, refused), -1)
            with self.send_lock:
                send_frame(self.sock, frame)
            return
        light = [
            (
                dataclasses.replace(out, routed_experts=None),
                None
                if out.routed_experts is None
                else (out.routed_experts.dtype.str, out.routed_experts.shape),
            )
            for out in result
        ]
        frame = pickle.dumps((call_id, stage, light, "", refused), pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            send_frame(self.sock, frame)
            for out in result:
                if out.routed_experts is not None and out.routed_experts.size:
                    self.sock.sendall(
                        memoryview(np.ascontiguousarray(out.routed_experts)).cast("B")
                    )


def _parse_one(body: bytes | bytearray, request: ReplyRequest) -> tuple[str, Any, str]:
    try:
        items, payloads = split_generate_reply(body)
    except Exception as e:
        return STAGE_RAISE, portable(e), traceback.format_exc()
    try:
        return STAGE_OK, parse_outputs(items, payloads, request), ""
    except Exception as e:
        return STAGE_PARSE, portable(e), traceback.format_exc()
