"""The rollout engine contract: what the pools, the fleet and the weight updaters call on a
client of one inference server, whatever the engine (SGLang, vLLM, our embedded server).

A client (:class:`RolloutClient`) is blocking and thread-safe; the pools call ``generate``
from many threads at once. Fields: ``base_url`` names the server in every error and log line;
``timeout_s`` bounds every HTTP call. Calls:

- ``generate(input_ids, sampling, *, routing, routed_experts_start_len, return_logprob)``:
  one prompt or a batch; one :class:`~megatron_sat.rollout.sampling.GenerateOutput` per
  prompt, in order, with the log-probs of SGLang's convention (temperature-scaled, before
  top-p/top-k truncation), the weight version (per request, or per token), and the routed
  experts when ``routing`` is given.
- ``get_weight_version()``: the version the server serves now.
- ``pause_generation(mode)``, ``continue_generation()``, ``flush_cache()``: SGLang's pause
  modes (``weight_sync.channel.PAUSE_MODES``), mapped by the client to its engine's.
- the weight-update session, one engine's protocol
  (``weight_sync.channel.SGLangUpdateChannel``, ``rollout.vllm.updater.VLLMUpdateChannel``),
  driven by that engine's updater (``rollout.engines.EngineSpec.updater``);
- ``health(timeout_s)``: True on HTTP 200 from GET /health, False otherwise (never raises).
- ``close()``: release the connections.

Errors, and what each means to the caller:

- ``ValueError``: the caller's arguments are wrong (empty prompt, sampling the engine cannot
  score); raised before anything is sent.
- :class:`SGLangRequestError` (an engine's own subclass, e.g. ``VLLMRequestError``): the server
  refused the request itself (HTTP 4xx other than 408/429, or a configuration the server
  lacks): the data or the caller is at fault, the server is alive. The pools drop or fail the
  request; they do not mark the server dead.
- :class:`SGLangError` (anything else: connection errors after the retries, HTTP 5xx, a
  malformed answer): the server is treated as dead by the pools and the fleet.

Retries and timeouts live in the client only (:func:`request_with_retries`): idempotent calls
(generation, status, pause/continue/flush) are retried on connection errors and HTTP 503 with
a doubling back-off; the weight-update calls are never retried (one half of a collective whose
other half, the broadcast, cannot be replayed). Callers never retry a call themselves. Two
cases are not failures of the server:

- a *paused* server's refusal (vLLM >= 0.33 answers HTTP 503 to new requests while paused in
  mode "abort" or "wait", ``vllm/v1/engine/core.py`` ``EngineCore._reject_add_while_paused``;
  vLLM 0.32 and SGLang 0.5.23 queue them instead, ``TokenizerManager.generate_request`` waits
  on ``is_pause_cond``): the request waits and is re-sent until the server resumes, without
  using an attempt (bounded by ``paused_timeout_s``);
- a *timeout* (``rollout.request_timeout_s``) of a retried call: the server is asked whether it
  lives (``alive``, a probe that a paused or busy server answers at once); a living one gets
  the call again, and one still timing out after every attempt raises
  :class:`RequestTimeoutError` (a request error: the server stays in the fleet, the run stops
  naming the timeout). Only a server whose probe fails too is declared dead.

:class:`HTTPClient` is the shared half of every client: options, the connection pool,
``close``, ``health``, the retry policy and the batch checks of ``generate``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import httpx
import numpy as np

from megatron_sat.rollout.sampling import GenerateOutput, RoutingSpec, SamplingParams


class SGLangError(RuntimeError):
    """An SGLang endpoint failed or answered something we cannot use."""


class SGLangRequestError(SGLangError):
    """The server refused the request itself (HTTP 4xx other than 408/429: e.g. a prompt
    longer than the context): a data or caller error, not a sign that the server is dead.

    Attributes:
        status_code: the HTTP status.
    """

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class RequestTimeoutError(SGLangRequestError):
    """A call timed out on every attempt while the server answered its liveness probe: the
    server is alive but slower than the timeout (``rollout.request_timeout_s``). HTTP status
    408 (Request Timeout) stands for it; the pools fail the run with it rather than drop a
    living server."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 408)


# vLLM >= 0.33's answer to a new request while paused (vllm/v1/engine/core.py,
# EngineCore._reject_add_while_paused: RequestError(code="engine_paused", retryable=True), which
# vllm/outputs.py RequestError.to_exception turns into RetryableRequestError, HTTP 503 with an
# OpenAI ErrorResponse body, entrypoints/serve/exception_handling/error_response.py).
VLLM_PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
# How often a request refused by a paused server is re-sent, seconds (a push takes seconds).
PAUSED_POLL_S = 0.2
# Cap of the doubling back-off between retries, seconds.
MAX_BACKOFF_S = 30.0
# Timeout of the liveness probe after a timed-out call (at most the call's own), seconds.
LIVENESS_TIMEOUT_S = 30.0


def is_paused_reply(response: httpx.Response) -> bool:
    """Whether ``response`` is a paused server's refusal of a new request (vLLM >= 0.33: HTTP 503
    ``{"error": {"message": VLLM_PAUSED_MESSAGE, ...}}``); any other 503 is not."""
    if response.status_code != 503:
        return False
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("message") == VLLM_PAUSED_MESSAGE


class RolloutClient(Protocol):
    """One server's client, as the pools, fleet and evaluation use it (module docstring)."""

    base_url: str
    timeout_s: float

    def generate(
        self,
        input_ids: Sequence[int] | Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        *,
        routing: RoutingSpec | None = None,
        routed_experts_start_len: int = 0,
        return_logprob: bool = True,
    ) -> list[GenerateOutput]: ...

    def get_weight_version(self) -> str: ...

    def pause_generation(self, mode: str = "abort") -> None: ...

    def continue_generation(self) -> None: ...

    def flush_cache(self) -> None: ...

    def health(self, timeout_s: float | None = None) -> bool: ...

    def close(self) -> None: ...


def check_client_options(timeout_s: float, max_retries: int) -> None:
    """Validate a rollout client's timeout (seconds) and retry count.

    Raises:
        ValueError: for ``timeout_s <= 0`` or ``max_retries < 0``, naming the argument.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")


# Transport errors after which a retry may succeed: the server was not reached.
RETRY_TRANSPORT_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
)


def request_with_retries(
    http: httpx.Client,
    method: str,
    endpoint: str,
    body: Any,
    *,
    attempts: int,
    backoff_s: float,
    headers: dict[str, str] | None = None,
    accept: Callable[[httpx.Response], bool] = lambda response: response.is_success,
    retry_on: tuple[type[httpx.TransportError], ...] = RETRY_TRANSPORT_ERRORS,
    error: type[SGLangError] = SGLangError,
    request_error: type[SGLangRequestError] = SGLangRequestError,
    alive: Callable[[], bool] | None = None,
    paused_timeout_s: float = 0.0,
) -> httpx.Response:
    """One HTTP call of a rollout client, with the retry policy of this module's docstring
    (shared by the SGLang and vLLM clients): up to ``attempts`` tries, retried after a
    ``retry_on`` transport error, a timeout of a server that ``alive`` finds living, or HTTP
    503, sleeping ``backoff_s``, doubled after each (at most ``MAX_BACKOFF_S``). A paused
    server's refusal (:func:`is_paused_reply`) is re-sent every ``PAUSED_POLL_S`` for up to
    ``paused_timeout_s`` seconds without using an attempt (0: not waited for, a plain 503).

    Returns:
        the first response ``accept`` takes (default: any 2xx).

    Raises:
        request_error: on another HTTP 4xx than 408/429 (the request is at fault; its
            ``status_code`` is set).
        RequestTimeoutError: when every attempt timed out and ``alive`` still says the server
            lives.
        error: on any other failure (a server paused for longer than ``paused_timeout_s``
            included), naming the method, the URL and the endpoint.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    where = f"{method} {str(http.base_url).rstrip('/')}{endpoint}"
    delay = backoff_s
    attempt = 0
    paused_since: float | None = None
    while True:
        last = attempt + 1 >= attempts
        try:
            response = http.request(method, endpoint, json=body, headers=headers)
        except httpx.TransportError as e:
            _check_transport_error(e, where, last, retry_on, alive, error)
            time.sleep(delay)
            delay, attempt = min(2 * delay, MAX_BACKOFF_S), attempt + 1
            continue
        if paused_timeout_s > 0 and is_paused_reply(response):
            paused_since = paused_since if paused_since is not None else time.monotonic()
            if time.monotonic() - paused_since > paused_timeout_s:
                raise error(f"{where}: server paused for more than {paused_timeout_s} s")
            time.sleep(PAUSED_POLL_S)
            continue
        paused_since = None
        if response.status_code == 503 and not last:
            time.sleep(delay)
            delay, attempt = min(2 * delay, MAX_BACKOFF_S), attempt + 1
            continue
        if accept(response):
            return response
        status = response.status_code
        message = f"{where} -> HTTP {status}: {response.text[:1000]}"
        if 400 <= status < 500 and status not in (408, 429):
            raise request_error(message, status)
        raise error(message)


def _check_transport_error(
    e: httpx.TransportError,
    where: str,
    last: bool,
    retry_on: tuple[type[httpx.TransportError], ...],
    alive: Callable[[], bool] | None,
    error: type[SGLangError],
) -> None:
    """Return when the call that raised ``e`` may be tried again; else raise what it means:
    RequestTimeoutError for a timeout of a living server, ``error`` (a dead server) otherwise.
    A timeout is retried only when ``alive`` (the liveness probe) says the server lives."""
    timed_out = isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout)
    living = timed_out and alive is not None and alive()
    if not last and (isinstance(e, retry_on) or living):
        return
    if living:
        raise RequestTimeoutError(
            f"{where} timed out on every attempt ({e!r}) while the server answers its "
            "liveness probe: the server is alive but slower than the timeout; raise "
            "rollout.request_timeout_s"
        ) from e
    raise error(f"{where} failed: {e!r}") from e


def is_batch(input_ids: Sequence[int] | Sequence[Sequence[int]]) -> bool:
    """Whether ``input_ids`` is a batch of prompts (a list of lists) rather than one prompt."""
    return len(input_ids) > 0 and not isinstance(input_ids[0], (int, np.integer))


class HTTPClient:
    """The shared half of a rollout client: options, connections, ``close``, ``health`` and
    the retry policy (module docstring). A subclass sets ``error`` / ``request_error`` (its
    exception types) and ``retry_on``, and may override ``_headers`` and ``_accept``.

    Args:
        base_url: e.g. "http://127.0.0.1:30000".
        timeout_s: timeout of every HTTP call, seconds (generation included).
        max_retries: extra attempts of idempotent calls on connection errors, timeouts of a
            living server and HTTP 503.
        retry_backoff_s: sleep before the first retry, doubled after each.
        paused_timeout_s: how long an idempotent call refused by a paused server waits for
            it to resume, seconds; None = ``timeout_s``.
        http_options: further ``httpx.Client`` arguments (headers, limits).
    """

    error: type[SGLangError] = SGLangError
    request_error: type[SGLangRequestError] = SGLangRequestError
    retry_on: tuple[type[httpx.TransportError], ...] = RETRY_TRANSPORT_ERRORS

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        *,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        paused_timeout_s: float | None = None,
        **http_options: Any,
    ) -> None:
        check_client_options(timeout_s, max_retries)
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.paused_timeout_s = timeout_s if paused_timeout_s is None else paused_timeout_s
        if self.paused_timeout_s <= 0:
            raise ValueError(f"paused_timeout_s must be > 0, got {self.paused_timeout_s}")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, **http_options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def health(self, timeout_s: float | None = None) -> bool:
        """GET /health: True on HTTP 200, False on any other status or a connection error."""
        try:
            timeout = self.timeout_s if timeout_s is None else timeout_s
            return self._http.get("/health", timeout=timeout).status_code == 200
        except httpx.TransportError:
            return False

    def alive(self, timeout_s: float | None = None) -> bool:
        """The liveness probe of a server that may be paused or busy (here GET /health, which
        vLLM answers from its engine state without generating); never raises."""
        return self.health(timeout_s)

    def _headers(self, endpoint: str) -> dict[str, str] | None:
        """Per-call headers of ``endpoint`` (authentication); None: the client's defaults."""
        return None

    def _accept(self, response: httpx.Response) -> bool:
        """Whether a response is returned to the caller rather than raised."""
        return response.is_success

    def _request(
        self, method: str, endpoint: str, body: Any, *, retry: bool = False
    ) -> httpx.Response:
        """Send one call (retried only with ``retry``); raise ``error`` / ``request_error``
        naming URL and endpoint on failure."""
        return request_with_retries(
            self._http,
            method,
            endpoint,
            body,
            attempts=1 + (self.max_retries if retry else 0),
            backoff_s=self.retry_backoff_s,
            headers=self._headers(endpoint),
            accept=self._accept,
            retry_on=self.retry_on,
            error=self.error,
            request_error=self.request_error,
            alive=(lambda: self.alive(min(LIVENESS_TIMEOUT_S, self.timeout_s))) if retry else None,
            paused_timeout_s=self.paused_timeout_s if retry else 0.0,
        )


def prompt_batch(input_ids: Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    """``generate``'s prompts as a batch (one prompt becomes a batch of one).

    Raises:
        ValueError: for no prompt or an empty one.
    """
    batch = [list(p) for p in input_ids] if is_batch(input_ids) else [list(input_ids)]
    if not batch or any(len(p) == 0 for p in batch):
        raise ValueError("every prompt needs at least one token")
    return batch


def per_prompt_params(
    sampling: SamplingParams | Sequence[SamplingParams], num_prompts: int
) -> list[SamplingParams]:
    """``generate``'s sampling parameters, one per prompt (a shared one repeated).

    Raises:
        ValueError: for a list of another length than the batch.
    """
    if isinstance(sampling, SamplingParams):
        return [sampling] * num_prompts
    params = list(sampling)
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts")
    return params
