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
other half, the broadcast, cannot be replayed). Callers never retry a call themselves.

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
) -> httpx.Response:
    """One HTTP call of a rollout client, with the retry policy of this module's docstring
    (shared by the SGLang and vLLM clients): up to ``attempts`` tries, retried after a
    ``retry_on`` transport error or HTTP 503, sleeping ``backoff_s``, doubled after each.

    Returns:
        the first response ``accept`` takes (default: any 2xx).

    Raises:
        request_error: on another HTTP 4xx than 408/429 (the request is at fault; its
            ``status_code`` is set).
        error: on any other failure, naming the method, the URL and the endpoint.
    """
    base = str(http.base_url).rstrip("/")
    delay = backoff_s
    for attempt in range(attempts):
        last = attempt + 1 == attempts
        try:
            response = http.request(method, endpoint, json=body, headers=headers)
        except httpx.TransportError as e:
            if not last and isinstance(e, retry_on):
                time.sleep(delay)
                delay *= 2
                continue
            raise error(f"{method} {base}{endpoint} failed: {e!r}") from e
        if response.status_code == 503 and not last:
            time.sleep(delay)
            delay *= 2
            continue
        if accept(response):
            return response
        status = response.status_code
        message = f"{method} {base}{endpoint} -> HTTP {status}: {response.text[:1000]}"
        if 400 <= status < 500 and status not in (408, 429):
            raise request_error(message, status)
        raise error(message)
    raise ValueError(f"attempts must be >= 1, got {attempts}")


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
        max_retries: extra attempts of idempotent calls on connection errors / HTTP 503.
        retry_backoff_s: sleep before the first retry, doubled after each.
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
        **http_options: Any,
    ) -> None:
        check_client_options(timeout_s, max_retries)
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
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
