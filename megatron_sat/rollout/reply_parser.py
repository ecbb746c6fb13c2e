"""Worker processes that parse ``/generate`` reply bodies, so the trainer's process keeps only
the hand-over per reply.

At the paper's shape a reply is about 2 KB of JSON per token (48 layers x top-8 routes in
base64) and its parse (``rollout.generate_reply``: the JSON less the routes, the ids and
log-probs typed, the routes decoded) is about 1.4 s of one core per million tokens. In a thread
of the trainer's process, as the async pool's workers ran it, that Python holds the GIL beside
the trainer's own: bench/data_path.py measured the trainer step 2.3-2.5x slower with the pool
parsing at full rate beside it. Here the parse runs in ``num_workers`` processes; the calling
thread sends the body down a socket pair and takes the outputs back (pickled, less their
routes, which it receives raw straight into their arrays): the kernel copies the bytes with the
GIL released, and what the trainer's process still holds the GIL for per reply is the small
unpickle (ids, log-probs, meta_info) and the client's checks.

Each worker is a fresh interpreter (never a ``fork``: the trainer's process runs torch and
threads) that imports only the parse's modules: ``subprocess`` with the socket's descriptor
passed, not ``multiprocessing``'s ``spawn``, which would import the trainer's main module (torch,
and a user's script without a main guard would run again). They start on the first
:meth:`ReplyParser.parse` and stop with :meth:`ReplyParser.close` (or the ``with`` block),
or when the trainer's process ends (their socket closes). A worker that dies (killed, out of
memory) fails every later call with :class:`ReplyParserError` naming it and its exit code: no
call hangs, and no call falls back to parsing in the caller's thread. The parse is
``rollout.generate_reply``'s, so both places give the same outputs bit for bit; exceptions come
back with their class and message (and the worker's traceback as their ``__cause__``), stage
1's raised by :meth:`ReplyParser.parse` itself (the client's guard refuses the body and sends
the request again) and stage 2's when the outputs are taken (:class:`ParsedReply`).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_sat.rollout.generate_reply import ReplyRequest, parse_outputs
from megatron_sat.rollout.sampling import GenerateOutput
from megatron_sat.routing.wire import split_generate_reply

_SPLIT, _PARSE, _OK = "split", "parse", "ok"  # which stage failed, or none
_LENGTH = struct.Struct("<Q")  # the byte length before each frame


class ReplyParserError(RuntimeError):
    """A reply parser worker died, or the parser was used after ``close()``."""


class RemoteTraceback(Exception):
    """The worker's traceback of an exception raised there (set as its ``__cause__``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ParsedReply:
    """Stage 2's result of one reply (``rollout.generate_reply``): the outputs, or the
    exception that stage raised, re-raised by :meth:`outputs`."""

    _outputs: list[GenerateOutput] | None = None
    _error: BaseException | None = None

    def outputs(self) -> list[GenerateOutput]:
        """The reply's outputs, unchecked by the client's guard.

        Raises:
            SGLangError (or whatever stage 2 raised): with its class and message.
        """
        if self._error is not None:
            raise self._error
        assert self._outputs is not None
        return self._outputs


def parse_in_thread(body: bytes | bytearray, request: ReplyRequest) -> ParsedReply:
    """:meth:`ReplyParser.parse` in the calling thread (``rollout.reply_parse_workers`` = 0):
    stage 1 raises here, stage 2's error comes back in the result. Same outputs."""
    items, payloads = split_generate_reply(body)
    try:
        return ParsedReply(parse_outputs(items, payloads, request))
    except Exception as e:  # handed back to the client, which raises it (ParsedReply.outputs)
        return ParsedReply(_error=e)


class ReplyParser:
    """``num_workers`` processes parsing ``/generate`` bodies (module docstring); thread-safe,
    one reply per worker at a time (a caller waits for a free worker).

    Args:
        num_workers: worker processes (>= 1; ``rollout.reply_parse_workers``).

    Raises:
        ValueError: if ``num_workers`` < 1.
    """

    def __init__(self, num_workers: int) -> None:
        if isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"reply parser needs num_workers >= 1, got {num_workers!r}")
        self.num_workers = num_workers
        self._lock = threading.Lock()
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._closed = False
        self._broken: str | None = None  # why every call now fails

    def __enter__(self) -> ReplyParser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (empty before the first parse)."""
        return [w.process.pid for w in self._workers]

    def parse(self, body: bytes | bytearray, request: ReplyRequest) -> ParsedReply:
        """Parse one reply body in a worker process.

        Args:
            body: the raw HTTP body of an SGLang ``/generate`` reply.
            request: what the parse needs of the request (prompt lengths, routing shape, ...).

        Returns:
            Stage 2's outputs or error (:class:`ParsedReply`).

        Raises:
            ValueError, TypeError, UnicodeDecodeError: stage 1's (``routing.wire``), with the
                message the in-thread parse gives.
            ReplyParserError: when a worker died (now or before), or after ``close()``.
        """
        worker = self._take()
        try:
            _send_frame(worker.sock, pickle.dumps((request, len(body)), pickle.HIGHEST_PROTOCOL))
            worker.sock.sendall(body)
            stage, payload, remote_tb = pickle.loads(_recv_frame(worker.sock))
            if stage == _OK:
                payload = _receive_routes(worker.sock, payload)
        except (EOFError, OSError) as e:
            raise self._lost(worker, f"died while parsing a reply of {len(body)} bytes") from e
        except BaseException as e:  # e.g. Ctrl-C half-way: the worker's stream is out of step
            self._lost(worker, f"was stopped half-way through a reply ({type(e).__name__})")
            raise
        self._idle.put(worker)
        if stage == _OK:
            return ParsedReply(payload)
        error = pickle.loads(payload)
        error.__cause__ = RemoteTraceback(remote_tb)
        if stage == _SPLIT:
            raise error
        return ParsedReply(_error=error)

    def close(self) -> None:
        """Stop the workers (each exits when its pipe closes; killed after 5 s). Idempotent."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        self._idle.put(None)  # wakes a caller waiting for a worker
        for worker in workers:
            worker.sock.close()
        for worker in workers:
            _end(worker.process, timeout_s=5)

    def _take(self) -> _Worker:
        """A free worker (starting them on first use); raise once the parser is broken."""
        with self._lock:
            if self._closed:
                raise ReplyParserError("reply parser used after close()")
            if self._broken is None and not self._workers:
                self._start()
        while True:
            if self._broken is not None:
                raise ReplyParserError(self._broken)
            worker = self._idle.get()
            if worker is not None:
                return worker
            self._idle.put(None)  # pass the wake-up on to the next waiter
            if self._closed:
                raise ReplyParserError("reply parser closed while waiting for a worker")

    def _start(self) -> None:
        # The package's root first on the worker's path, as it is importable here.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        for index in range(self.num_workers):
            ours, theirs = socket.socketpair()
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": path},
            )
            theirs.close()  # the worker's death then reads as EOF here
            worker = _Worker(index, process, ours)
            self._workers.append(worker)
            self._idle.put(worker)

    def _lost(self, worker: _Worker, what: str) -> ReplyParserError:
        """Mark the parser broken by ``worker`` (dead, or stopped half-way and killed here);
        the error every caller gets from now on."""
        if self._closed:
            return ReplyParserError(f"reply parser closed while worker {worker.index} {what}")
        code = _end(worker.process, timeout_s=1)
        with self._lock:
            if self._broken is None:
                self._broken = (
                    f"reply parser worker {worker.index} (pid {worker.process.pid}) {what} "
                    f"(exit code {code}; a negative code is the signal that ended it): the "
                    "/generate replies of this pool are parsed in these processes "
                    "(rollout.reply_parse_workers); no reply is parsed any more"
                )
        self._idle.put(None)
        return ReplyParserError(self._broken)


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen
    sock: socket.socket


# A worker's main: serve on the socket whose descriptor is argv[1].
_WORKER_MAIN = (
    "import sys; from megatron_sat.rollout.reply_parser import serve_fd; serve_fd(int(sys.argv[1]))"
)


def _end(process: subprocess.Popen, timeout_s: float) -> int:
    """Wait up to ``timeout_s`` for ``process`` to exit, then kill it; its exit code."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def serve_fd(fd: int) -> None:
    """A worker process's entry point: :func:`_serve` on the inherited socket ``fd``."""
    _serve(socket.socket(fileno=fd))


# The wire between the caller and a worker: length-prefixed frames on a socket pair, and the
# routes of a reply's outputs raw after its frame, received straight into their arrays (the
# GIL released while the kernel copies them; a pickle would copy them again with the GIL held:
# 0.2-0.3 s per million tokens at 48 x top-8, measured).


def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``. Raises EOFError when the other end closed first."""
    view = view.cast("B")
    while view.nbytes:
        got = sock.recv_into(view)
        if got == 0:
            raise EOFError("the other end of the reply parser's socket closed")
        view = view[got:]


def _recv_frame(sock: socket.socket) -> bytearray:
    head = bytearray(_LENGTH.size)
    _recv_into(sock, memoryview(head))
    data = bytearray(_LENGTH.unpack(head)[0])
    _recv_into(sock, memoryview(data))
    return data


def _receive_routes(
    sock: socket.socket, sent: list[tuple[GenerateOutput, tuple[str, tuple[int, ...]] | None]]
) -> list[GenerateOutput]:
    """The outputs of a reply, each one's routes (dtype, shape in its frame) read into a new
    array from the raw bytes after the frame."""
    outputs = []
    for output, routes in sent:
        if routes is not None:
            dtype, shape = routes
            array = np.empty(shape, dtype=dtype)
            _recv_into(sock, memoryview(array))
            output.routed_experts = array
        outputs.append(output)
    return outputs


def _serve(sock: socket.socket) -> None:
    """A worker's loop: (request, body) in, ``(stage, result, traceback)`` out (then the
    routes raw), until the parent closes its end. Ctrl-C is the parent's to handle: the worker
    exits with the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            request, size = pickle.loads(_recv_frame(sock))
            body = bytearray(size)
            _recv_into(sock, memoryview(body))
        except (EOFError, OSError):
            return
        stage, result, remote_tb = _parse_one(body, request)
        del body  # the outputs hold no view of it
        if stage != _OK:
            _send_frame(sock, pickle.dumps((stage, result, remote_tb), pickle.HIGHEST_PROTOCOL))
            continue
        light = [
            (
                dataclasses.replace(out, routed_experts=None),
                None
                if out.routed_experts is None
                else (out.routed_experts.dtype.str, out.routed_experts.shape),
            )
            for out in result
        ]
        _send_frame(sock, pickle.dumps((stage, light, ""), pickle.HIGHEST_PROTOCOL))
        for out in result:
            if out.routed_experts is not None:
                sock.sendall(memoryview(np.ascontiguousarray(out.routed_experts)).cast("B"))


def _parse_one(body: bytes | bytearray, request: ReplyRequest) -> tuple[str, Any, str]:
    try:
        items, payloads = split_generate_reply(body)
    except Exception as e:
        return _SPLIT, _portable(e), traceback.format_exc()
    try:
        return _OK, parse_outputs(items, payloads, request), ""
    except Exception as e:
        return _PARSE, _portable(e), traceback.format_exc()


def _portable(error: BaseException) -> bytes:
    """``error`` pickled, checked to come back with its class and message; else a
    ``ReplyParserError`` saying which exception could not cross (never a silent change)."""
    try:
        data = pickle.dumps(error, pickle.HIGHEST_PROTOCOL)
        back = pickle.loads(data)
        if type(back) is type(error) and str(back) == str(error):
            return data
    except Exception:  # any failure to cross is reported below
        pass
    return pickle.dumps(
        ReplyParserError(
            f"{type(error).__module__}.{type(error).__qualname__} raised in a reply parser "
            f"worker does not pickle: {error}"
        )
    )
