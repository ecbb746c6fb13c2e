"""Worker processes that fetch and parse ``/generate`` replies, so the reply body never enters
the trainer's process.

At the paper's shape a reply is about 2 KB of JSON per token (48 layers x top-8 routes in
base64): some 70 GB per step at full scale. Read by httpx in a thread of the trainer's process
it costs 1.2-1.7 CPU-s per GB, mostly Python (h11, 64 KB chunks) holding the trainer's GIL; its
parse (``rollout.generate_reply``) another 1.4 s of one core per million tokens. Here both run
in ``num_workers`` processes (``rollout.reply_worker``): the calling thread sends the small
request (ids, sampling parameters, routing shape, the reply's size cap and the client's
constructor arguments, :meth:`ReplyParser.fetch`) and takes the compact outputs back (pickled,
less their routes, which arrive raw straight into their arrays: the kernel copies them with the
GIL released). The worker runs ``SGLangClient``'s own fetch (retries, the paused wait, the size
cap, the malformed-JSON resend) with a client built from the same arguments; the refusals it
counted come back with each result for the caller's guard, whose content checks
(``ReplyGuard.check_output``: the versions pushed) stay in the trainer's process.
:meth:`ReplyParser.parse` parses a body the caller fetched itself (a client whose HTTP cannot be
rebuilt in a worker: see ``SGLangClient.worker_spec``).

Many calls are in flight at once (the async pool's ``max_in_flight_per_server`` x servers, each
lasting as long as its generation): a worker serves each call in a thread of its own, and the
calls share its socket, each frame tagged with its call's id; one reader thread per worker here
hands each reply to the caller waiting for it. A call goes to the worker with the fewest calls
in flight.

Each worker is a fresh interpreter (never a ``fork``: the trainer's process runs torch and
threads) that imports only the client and the parse: ``subprocess`` with the socket's descriptor
passed, not ``multiprocessing``'s ``spawn``, which would import the trainer's main module (torch,
and a user's script without a main guard would run again). They start on the first call and stop
with :meth:`ReplyParser.close` (or the ``with`` block), or when the trainer's process ends (their
socket closes). A worker that dies (killed, out of memory) fails its calls in flight and every
later call with :class:`ReplyParserError` naming it and its exit code: no call hangs, and no
call falls back to the caller's thread. Exceptions come back with their class, message and
attributes (``status_code``, ``kind``), the worker's traceback as their ``__cause__``.
"""

from __future__ import annotations

import importlib
import itertools
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_sat.platform.lifetime import parent_env
from megatron_sat.rollout.generate_reply import ReplyRequest, parse_outputs
from megatron_sat.rollout.sampling import GenerateOutput
from megatron_sat.routing.wire import split_generate_reply

# What a worker's reply frame says of its call: raised (the parse's stage 1, or the fetch's
# error), stage 2's error handed back in the result, or the outputs.
STAGE_RAISE, STAGE_PARSE, STAGE_OK = "raise", "parse", "ok"
# What a call asks of a worker: parse a body sent with it, or fetch and parse a reply.
PARSE, FETCH = "parse", "fetch"
_LENGTH = struct.Struct("<Q")  # the byte length before each frame
# A call's frame: its id and body size, then the pickle of (kind, args); the worker can answer
# a call whose pickle it cannot load (a class only the trainer's __main__ defines) and skip its
# body, so that call fails alone.
CALL_HEAD = struct.Struct("<QQ")


class ReplyParserError(RuntimeError):
    """A reply parser worker died, or the parser was used after ``close()``."""


class RemoteTraceback(Exception):
    """The worker's traceback of an exception raised there (set as its ``__cause__``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ParsedReply:
    """Stage 2's result of one reply (``rollout.generate_reply``): the outputs, or the
    exception that stage (or, from :meth:`ReplyParser.fetch`, the fetch) raised, re-raised by
    :meth:`outputs`; ``refused``: the guard refusals counted while fetching it, by kind."""

    _outputs: list[GenerateOutput] | None = None
    _error: BaseException | None = None
    refused: Mapping[str, int] = field(default_factory=dict)

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
    """``num_workers`` processes fetching and parsing ``/generate`` replies (module
    docstring); thread-safe, any number of calls in flight.

    Args:
        num_workers: worker processes (>= 1; ``rollout.reply_parse_workers``).

    Raises:
        ValueError: if ``num_workers`` < 1.
    """

    def __init__(self, num_workers: int) -> None:
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"reply parser needs num_workers >= 1, got {num_workers!r}")
        self.num_workers = num_workers
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._closed = False
        self._broken: str | None = None  # why every call now fails
        self._first_loss: str | None = None  # the first cause a worker was lost, for _broken

    def __enter__(self) -> ReplyParser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, client_specs: Sequence[dict[str, Any] | None] = ()) -> None:
        """Start the workers now and wait until each is ready to serve (about 0.3 s: its
        imports; then the clients of ``client_specs`` built: a worker's first call to a server
        otherwise waits for its client, 40 ms measured), so that the first calls go out at
        once (the async pool starts its parser with itself: a push right after the pool's
        first requests must find them at the server).
        Idempotent (a second call builds nothing); the first call starts them otherwise.

        Args:
            client_specs: ``SGLangClient.worker_spec()`` of the clients to serve (None ones
                skipped).

        Raises:
            ReplyParserError: when a worker died starting, or after ``close()``.
        """
        with self._lock:
            if self._closed:
                raise ReplyParserError("reply parser used after close()")
            if not self._workers and self._broken is None:
                self._start([spec for spec in client_specs if spec is not None])
            if self._broken is not None:
                raise ReplyParserError(self._broken)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (empty before the first call)."""
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
        stage, payload = self._call(PARSE, request, body)
        if stage == STAGE_RAISE:
            raise payload
        return ParsedReply(payload) if stage == STAGE_OK else ParsedReply(_error=payload)

    def fetch(
        self, client_spec: dict[str, Any], body: dict[str, Any], request: ReplyRequest, cap: int
    ) -> ParsedReply:
        """POST ``body`` to ``/generate`` and parse the reply, in a worker process, as
        ``SGLangClient.fetch_reply`` does in the calling thread.

        Args:
            client_spec: the client's class and constructor arguments
                (``SGLangClient.worker_spec``); the worker builds one client per spec.
            body: the ``/generate`` request's JSON.
            request: what the parse needs of the request.
            cap: the reply's size cap, bytes (the guard's fixed cap, or the request's).

        Returns:
            The outputs, or the error the fetch or the parse raised (SGLangError,
            SGLangRequestError, ...: class, message and attributes kept), with the refusals
            the worker's guard counted for this call (``ParsedReply.refused``).

        Raises:
            ReplyParserError: when a worker died (now or before), or after ``close()``.
        """
        stage, payload, refused = self._call(FETCH, (client_spec, body, request, cap))
        if stage == STAGE_OK:
            return ParsedReply(payload, refused=refused)
        return ParsedReply(_error=payload, refused=refused)

    def close(self) -> None:
        """Stop the workers (each exits when its socket closes; killed after 5 s); calls in
        flight fail with ReplyParserError. Idempotent."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        for worker in workers:
            _shut(worker.sock)  # wakes its reader, which fails the calls in flight
        for worker in workers:
            worker.reader.join(timeout=10)
            worker.sock.close()
            _end(worker.process, timeout_s=5)

    def _call(self, kind: str, args: Any, body: bytes | bytearray | None = None) -> Any:
        """Send one call to the least-loaded worker and wait for its reply: ``(stage,
        payload)`` for a parse, ``(stage, payload, refused)`` for a fetch."""
        if body is not None and not isinstance(body, (bytes, bytearray)):
            # the in-thread parse's refusal (routing.wire), before anything is sent
            raise TypeError(f"reply body must be bytes or bytearray, got {type(body).__name__}")
        call = _Call(next(self._ids))
        size = 0 if body is None else len(body)
        # Pickled before the call is taken: an argument that does not pickle fails this call
        # alone, with nothing sent (the worker's stream stays in step).
        frame = CALL_HEAD.pack(call.id, size) + pickle.dumps((kind, args), pickle.HIGHEST_PROTOCOL)
        worker = self._take(call)
        try:
            with worker.send_lock:
                send_frame(worker.sock, frame)
                if body is not None:
                    worker.sock.sendall(body)
        except OSError as e:
            raise self._lost(worker, f"died while a call was sent to it ({e!r})") from e
        except BaseException as e:  # e.g. Ctrl-C half-way: the worker's stream is out of step
            self._lost(worker, f"was stopped half-way through a call ({type(e).__name__})")
            raise
        call.done.wait()  # an interrupted wait leaves the stream whole: its reply is dropped
        if isinstance(call.result, ReplyParserError):
            raise call.result
        stage, payload, refused = call.result
        return (stage, payload) if kind == PARSE else (stage, payload, refused)

    def _take(self, call: _Call) -> _Worker:
        """The worker with the fewest calls in flight (starting them on first use), ``call``
        registered with it; raise once the parser is closed or broken."""
        with self._lock:
            if self._closed:
                raise ReplyParserError("reply parser used after close()")
            if self._broken is not None:
                raise ReplyParserError(self._broken)
            if not self._workers:
                self._start()
            if self._broken is not None:
                raise ReplyParserError(self._broken)
            worker = min(self._workers, key=lambda w: len(w.calls))
            worker.calls[call.id] = call
            return worker

    def _start(self, client_specs: Sequence[dict[str, Any]] = ()) -> None:
        """Spawn the workers, hand each ``client_specs`` (the clients it builds before its
        first call) and wait until each is ready; a worker that dies starting breaks the
        parser."""
        # The package's root first on the worker's path, as it is importable here.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        spawned: list[_Worker] = []
        try:
            for index in range(self.num_workers):
                ours, theirs = socket.socketpair()
                process = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    # the worker ends with the trainer, also a SIGKILLed one (platform.lifetime)
                    env={**os.environ, "PYTHONPATH": path, **parent_env()},
                )
                theirs.close()  # the worker's death then reads as EOF here
                spawned.append(_Worker(index, process, ours))
        except OSError as e:  # e.g. out of file descriptors: no parser of fewer workers
            for worker in spawned:
                worker.sock.close()
                _end(worker.process, timeout_s=5)
            self._broken = (
                f"reply parser could not start worker {len(spawned)} of {self.num_workers} "
                f"({e!r}; rollout.reply_parse_workers): no reply is parsed"
            )
            return
        for worker in spawned:
            try:
                send_frame(worker.sock, pickle.dumps(list(client_specs), pickle.HIGHEST_PROTOCOL))
                recv_frame(worker.sock)  # the worker's ready frame: imports and clients done
            except (EOFError, OSError) as e:
                code = _end(worker.process, timeout_s=5)
                self._broken = self._broken or (
                    f"reply parser worker {worker.index} (pid {worker.process.pid}) died "
                    f"starting ({e!r}, exit code {code}; its stderr says why): no reply is parsed"
                )
            worker.reader = threading.Thread(
                target=self._read, args=(worker,), name=f"reply-parser{worker.index}", daemon=True
            )
            self._workers.append(worker)
            worker.reader.start()

    def _read(self, worker: _Worker) -> None:
        """``worker``'s reader thread: hand each reply to its call (its routes received
        straight into their arrays) until the socket ends; then fail the calls in flight."""
        try:
            while True:
                call_id, stage, payload, remote_tb, refused = pickle.loads(recv_frame(worker.sock))
                if stage == STAGE_OK:
                    payload = _receive_routes(worker.sock, payload)
                else:
                    payload = _rebuild(payload)
                    payload.__cause__ = RemoteTraceback(remote_tb)
                with self._lock:
                    call = worker.calls.pop(call_id)
                call.result = (stage, payload, refused)
                call.done.set()
        except BaseException as e:  # EOF, a reset, or a stream out of step: the worker is lost
            inflight = len(worker.calls)
            error = self._lost(worker, f"died with {inflight} call(s) in flight ({e!r})")
            with self._lock:
                calls, worker.calls = list(worker.calls.values()), {}
            for call in calls:
                call.result = error
                call.done.set()

    def _lost(self, worker: _Worker, what: str) -> ReplyParserError:
        """Mark the parser broken by ``worker`` (dead, or stopped half-way and killed here);
        the error every caller gets from now on."""
        if self._closed:
            return ReplyParserError(f"reply parser closed while worker {worker.index} was busy")
        with self._lock:  # the first cause is named, not the EOF its own kill gives the reader
            if self._first_loss is None:
                self._first_loss = what
            what = self._first_loss
        _shut(worker.sock)  # a worker stopped half-way: its reader ends too
        code = _end(worker.process, timeout_s=1)
        with self._lock:
            if self._broken is None:
                self._broken = (
                    f"reply parser worker {worker.index} (pid {worker.process.pid}) {what} "
                    f"(exit code {code}; a negative code is the signal that ended it): the "
                    "/generate replies of this pool are fetched and parsed in these processes "
                    "(rollout.reply_parse_workers); no reply is parsed any more"
                )
        return ReplyParserError(self._broken)


@dataclass
class _Call:
    id: int
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None  # (stage, payload, refused), or the ReplyParserError that ended it


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen
    sock: socket.socket
    calls: dict[int, _Call] = field(default_factory=dict)  # in flight, by id
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    reader: threading.Thread | None = None


# A worker's main: serve on the socket whose descriptor is argv[1].
_WORKER_MAIN = (
    "import sys; from megatron_sat.rollout.reply_worker import serve_fd; serve_fd(int(sys.argv[1]))"
)


def _end(process: subprocess.Popen, timeout_s: float) -> int:
    """Wait up to ``timeout_s`` for ``process`` to exit, then kill it; its exit code."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def _shut(sock: socket.socket) -> None:
    """End both directions of ``sock`` (wakes a thread blocked reading it); never raises."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or reset


# The wire between the caller and a worker: length-prefixed frames on a socket pair, and the
# routes of a reply's outputs raw after its frame, received straight into their arrays (the
# GIL released while the kernel copies them; a pickle would copy them again with the GIL held:
# 0.2-0.3 s per million tokens at 48 x top-8, measured).


def send_frame(sock: socket.socket, data: bytes) -> None:
    """One length-prefixed frame."""
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``. Raises EOFError when the other end closed first."""
    if view.nbytes == 0:  # e.g. routes of no rows; memoryview refuses to cast a zero shape
        return
    view = view.cast("B")
    while view.nbytes:
        got = sock.recv_into(view)
        if got == 0:
            raise EOFError("the other end of the reply parser's socket closed")
        view = view[got:]


def recv_frame(sock: socket.socket) -> bytearray:
    """One length-prefixed frame. Raises EOFError when the other end closed first."""
    head = bytearray(_LENGTH.size)
    recv_into(sock, memoryview(head))
    data = bytearray(_LENGTH.unpack(head)[0])
    recv_into(sock, memoryview(data))
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
            recv_into(sock, memoryview(array))
            output.routed_experts = array
        outputs.append(output)
    return outputs


def portable(error: BaseException) -> tuple[str, str, tuple[Any, ...], dict[str, Any]]:
    """``error`` as what crosses the socket: its class's module and name, its ``args`` and
    its attributes (``status_code``, ``kind``; those that do not pickle are left out).
    :func:`_rebuild` makes it again without calling its constructor (``SGLangRequestError``'s
    takes two arguments, ``RequestTimeoutError``'s one), and checks the class and message."""
    cls = type(error)
    attrs = {}
    for key, value in vars(error).items():
        try:
            pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
        except Exception:  # e.g. httpx's request object: not needed to classify the error
            continue
        attrs[key] = value
    try:
        args = pickle.loads(pickle.dumps(error.args, pickle.HIGHEST_PROTOCOL))
    except Exception:  # args that do not pickle: the message stands for them
        args = (str(error),)
    return cls.__module__, cls.__qualname__, args, attrs


def _rebuild(crossed: tuple[str, str, tuple[Any, ...], dict[str, Any]]) -> BaseException:
    """The exception :func:`portable` sent; a ``ReplyParserError`` naming it when it cannot
    be made again (never a silent change of class)."""
    module, qualname, args, attrs = crossed
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        error = cls.__new__(cls)
        error.args = args
        error.__dict__.update(attrs)
        return error
    except Exception as e:  # any failure to rebuild is reported, with the message
        return ReplyParserError(
            f"{module}.{qualname} raised in a reply parser worker could not be rebuilt "
            f"({e!r}): {args!r:.500}"
        )
