"""The rollout protocol checked at the edge: what a client refuses in a server's reply before
a sample is built from it.

Every rollout client (``rollout.client.SGLangClient``, ``rollout.vllm.client.VLLMClient``)
owns a :class:`ReplyGuard` and calls it on each reply:

- **Size**: a reply larger than its cap is refused while it is read (the body is never held
  whole): ``Content-Length`` first, then the bytes as they arrive (chunked replies too). The cap
  of a ``/generate`` reply is sized per request from the prompts, ``max_new_tokens`` and the
  routing shape (:func:`generate_reply_cap`); ``rollout.max_reply_bytes`` > 0 replaces it with a
  fixed cap for every reply (``ReplyGuard.max_reply_bytes``).
- **JSON**: a ``/generate`` reply that does not parse as JSON is refused.

  Both raise :class:`ReplyRefused`, an ``httpx.RemoteProtocolError`` (a transport error: the
  server broke the protocol). The clients retry it like a connection error (an oversized
  reply inside ``rollout.engine.request_with_retries``, a malformed one in
  :meth:`ReplyGuard.fetch_json`), then raise their engine's error naming the server and the
  endpoint.
- **Contents** (:meth:`ReplyGuard.check_output`): every log-prob finite and at most
  ``LOGPROB_TOLERANCE`` above 0, and the reply's ``weight_version`` (and every per-token
  version) one that was pushed: an integer <= the newest version the trainer started to push
  (``ReplyGuard.pushed_version``, set by ``rollout.fleet.sync_servers`` before and after each
  push; None: no push yet, e.g. ``megatron-sat eval``, and versions are not checked). A
  violation raises :class:`ProtocolViolation`, an ``SGLangError``: the pools treat the server
  as failed and re-issue its work on another one.

Each refusal is counted per kind in ``ReplyGuard.refused`` (``too_large``, ``malformed_json``,
``positive_logprob``, ``nonfinite_logprob``, ``future_version``, ``bad_version``); the run loop
logs them per server (``rollout/server<i>/refused_<kind>``, cumulative).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx

from megatron_sat.rollout.engine import SGLangError
from megatron_sat.rollout.sampling import GenerateOutput, RoutingSpec

# Engines compute log-probs as fp32 log_softmax (SGLang, vLLM): a value above 0 is rounding
# at most (measured: 0 exactly for a certain token); anything larger is not a log-probability.
LOGPROB_TOLERANCE = 1e-4

# JSON bytes a /generate reply may spend per output token outside the routes: the id in
# output_ids (<= 8) and an output_token_logprobs entry ``[-1.2345678901234567e-05, 151643,
# null]`` (<= 48); per prompt token the same again when an engine echoes the prompt; per
# sample a fixed allowance for meta_info's other fields.
BYTES_PER_TOKEN = 64
BYTES_PER_SAMPLE = 64 * 1024


# (a module name, before ReplyGuard.json shadows ``json`` inside the class body)
_json_loads = json.loads


class ReplyRefused(httpx.RemoteProtocolError):
    """A reply the protocol does not allow (too large, not JSON); ``kind`` names the check.
    Pickles with its message and kind (it may cross a process boundary)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (str(self), self.kind)


class ProtocolViolation(SGLangError):
    """A parsed reply whose contents break the protocol; ``kind`` names the check. Pickles
    with its message and kind."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (str(self), self.kind)


def generate_reply_cap(
    prompt_lens: Sequence[int], max_new_tokens: Sequence[int], routing: RoutingSpec | None
) -> int:
    """The largest ``/generate`` reply a well-behaved server sends for these prompts, bytes:
    per sample ``BYTES_PER_SAMPLE`` + ``BYTES_PER_TOKEN`` per prompt and output token + the
    base64 of the int32 routes ``[P + R - 1, num_layers, top_k]`` (SGLang's
    ``routed_experts``), twice over (JSON escapes, pretty printing)."""
    total = 0
    for prompt, new in zip(prompt_lens, max_new_tokens, strict=True):
        size = BYTES_PER_SAMPLE + BYTES_PER_TOKEN * (prompt + new)
        if routing is not None:
            size += math.ceil(4 * (prompt + new) * routing.num_layers * routing.top_k / 3) * 4
        total += size
    return 2 * total


class _CappedStream(httpx.SyncByteStream):
    """The response's byte stream, refused once more than ``cap`` bytes arrived."""

    def __init__(self, inner: httpx.SyncByteStream, cap: int, where: str, guard: ReplyGuard):
        self.inner, self.cap, self.where, self.guard = inner, cap, where, guard

    def __iter__(self) -> Iterator[bytes]:
        seen = 0
        for chunk in self.inner:
            seen += len(chunk)
            if seen > self.cap:
                raise self.guard.refuse(
                    f"{self.where}: reply larger than its cap of {self.cap} bytes "
                    "(rollout.max_reply_bytes; 0 sizes it from max_new_tokens and the routes)",
                    "too_large",
                )
            yield chunk

    def close(self) -> None:
        self.inner.close()


class ReplyGuard:
    """One client's reply checks (module docstring) and its refusal counts.

    Args:
        where: the server, as every error names it (the client's ``base_url``).

    Attributes:
        pushed_version: the newest weight version pushed to the server (None: not checked).
        max_reply_bytes: a fixed cap of every reply, bytes (0: per request).
        refused: refusals so far, by kind.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.pushed_version: int | None = None
        self.max_reply_bytes = 0
        self.refused: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._local = threading.local()  # the cap of the calling thread's request

    def install(self, http: httpx.Client) -> None:
        """Check every reply of ``http`` before its body is read."""
        http.event_hooks["response"] = [*http.event_hooks["response"], self._on_response]

    @contextmanager
    def expecting(self, cap: int) -> Iterator[None]:
        """The replies of this thread's calls inside the block are capped at ``cap`` bytes
        (unless ``max_reply_bytes`` fixes the cap) and must be JSON."""
        self._local.cap = cap
        try:
            yield
        finally:
            self._local.cap = None

    @contextmanager
    def counting(self) -> Iterator[Counter[str]]:
        """The refusals of this thread's calls inside the block, by kind (counted in
        ``refused`` as well): a reply worker process (``rollout.reply_parser``) serves many
        calls at once with one client and hands each call's own counts to the trainer's guard."""
        tally: Counter[str] = Counter()
        self._local.tally = tally
        try:
            yield tally
        finally:
            self._local.tally = None

    def add_refused(self, counts: Counter[str] | dict[str, int]) -> None:
        """Add refusals counted elsewhere (a reply worker process's, :meth:`counting`)."""
        with self._lock:
            self.refused.update(counts)

    def refuse(self, message: str, kind: str) -> ReplyRefused:
        """Count a refusal of ``kind``; the error to raise."""
        self._count(kind)
        return ReplyRefused(message, kind)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.refused[kind] += 1
        tally = getattr(self._local, "tally", None)
        if tally is not None:
            tally[kind] += 1

    def _on_response(self, response: httpx.Response) -> None:
        cap = self.max_reply_bytes or getattr(self._local, "cap", None)
        if not cap:
            return
        where = f"{self.where}{response.request.url.path}"
        length = response.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cap:
            raise self.refuse(
                f"{where}: reply of {int(length)} bytes (Content-Length) is larger than its "
                f"cap of {cap} bytes (rollout.max_reply_bytes; 0 sizes it from "
                "max_new_tokens and the routes)",
                "too_large",
            )
        response.stream = _CappedStream(response.stream, cap, where, self)

    def json(self, response: httpx.Response, parse: Callable[[bytes], Any] = _json_loads) -> Any:
        """The reply's JSON, as ``parse`` reads the body's bytes (``json.loads``, or the
        client's own reader, e.g. ``routing.wire.split_generate_reply``).

        Raises:
            ReplyRefused: (``malformed_json``) naming the server, the endpoint and where the
                text stops parsing.
        """
        try:
            return parse(response.content)
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            where = f"{self.where}{response.request.url.path}"
            raise self.refuse(
                f"{where}: reply is not JSON ({e}; {len(response.content)} bytes, HTTP "
                f"{response.status_code})",
                "malformed_json",
            ) from e

    def fetch_json(
        self,
        send: Callable[[], httpx.Response],
        *,
        attempts: int,
        backoff_s: float,
        error: type[SGLangError],
        parse: Callable[[bytes], Any] = _json_loads,
    ) -> Any:
        """``send()``'s reply as JSON (read by ``parse``, see `json`), sending again (up to
        ``attempts`` times, sleeping ``backoff_s``, doubled each time) while it is malformed.

        Raises:
            error: naming the server, the endpoint and the parse error after the last try.
        """
        delay = backoff_s
        for attempt in range(attempts):
            response = send()
            try:
                return self.json(response, parse)
            except ReplyRefused as e:
                if attempt + 1 == attempts:
                    raise error(f"{e} (after {attempts} tries)") from e
                time.sleep(delay)
                delay *= 2
        raise ValueError(f"attempts must be >= 1, got {attempts}")

    def _violation(self, message: str, kind: str) -> ProtocolViolation:
        self._count(kind)
        return ProtocolViolation(message, kind)

    def check_output(self, out: GenerateOutput, endpoint: str = "/generate") -> GenerateOutput:
        """``out`` if its log-probs and versions keep the protocol.

        Raises:
            ProtocolViolation: naming the server, the endpoint, the token position and value.
        """
        where = f"{self.where}{endpoint}"
        if not _logprobs_pass(out.output_token_logprobs):
            self._name_bad_logprob(where, out.output_token_logprobs)
        if self.pushed_version is not None:
            versions = [out.weight_version, *(out.output_token_versions or ())]
            for version in dict.fromkeys(versions):
                self._check_version(where, version)
        return out

    def _name_bad_logprob(self, where: str, logprobs: Sequence[float]) -> None:
        """The per-token check of :meth:`check_output`: raise for the first bad log-prob."""
        for pos, value in enumerate(logprobs):
            if not math.isfinite(value):
                raise self._violation(
                    f"{where}: output_token_logprobs[{pos}] = {value} is not finite",
                    "nonfinite_logprob",
                )
            if value > LOGPROB_TOLERANCE:
                raise self._violation(
                    f"{where}: output_token_logprobs[{pos}] = {value} > 0: not a log-probability",
                    "positive_logprob",
                )

    def _check_version(self, where: str, version: str) -> None:
        try:
            number = int(version)
        except ValueError:
            raise self._violation(
                f"{where}: weight_version {version!r} is not a version the trainer pushed "
                f"(integers 0..{self.pushed_version})",
                "bad_version",
            ) from None
        if not 0 <= number <= self.pushed_version:
            raise self._violation(
                f"{where}: weight_version {version!r} was never pushed (the newest pushed is "
                f"{self.pushed_version})",
                "future_version",
            )


def _logprobs_pass(logprobs: Sequence[float]) -> bool:
    """True when every log-prob is finite and at most ``LOGPROB_TOLERANCE``: two passes in C
    (``math.isfinite`` mapped, then ``max``) where the per-token loop took one Python
    iteration per token. False (or a ``TypeError`` from a value that is not a number, as the
    loop raises) sends the caller to the loop, which names the first bad value."""
    return all(map(math.isfinite, logprobs)) and max(logprobs, default=0.0) <= LOGPROB_TOLERANCE


def guard_clients(clients: Sequence[Any], version: int, max_reply_bytes: int) -> None:
    """Tell every client's guard the newest pushed ``version`` and the fixed reply cap
    (``rollout.max_reply_bytes``; 0: per request). A client without a guard is refused.

    Raises:
        TypeError: naming a client that has no ``guard``.
    """
    for client in clients:
        guard = getattr(client, "guard", None)
        if not isinstance(guard, ReplyGuard):
            name = getattr(client, "base_url", repr(client))
            raise TypeError(f"client {name} has no ReplyGuard: its replies would go unchecked")
        guard.pushed_version = version
        guard.max_reply_bytes = max_reply_bytes


def refusal_metrics(clients: Sequence[Any]) -> dict[str, float]:
    """``rollout/server<i>/refused_<kind>``: the cumulative refusals of each server slot's
    current client (a restarted server's client counts from 0)."""
    out: dict[str, float] = {}
    for i, client in enumerate(clients):
        guard = getattr(client, "guard", None)
        if isinstance(guard, ReplyGuard):
            for kind, count in sorted(guard.refused.items()):
                out[f"rollout/server{i}/refused_{kind}"] = float(count)
    return out
