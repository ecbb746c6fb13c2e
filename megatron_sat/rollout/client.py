"""Typed HTTP client for SGLang's native API (a real SGLang server or our embedded server).

Field names, request and response shapes follow sglang 0.5.23 (``srt/managers/io_struct.py``,
``srt/entrypoints/http_server.py``). Retries and timeouts live here and only here: idempotent
calls are retried on connection errors and HTTP 503; the weight-update calls are never retried,
because they are one half of a collective whose other half (the broadcast) cannot be replayed.
Every error names the server URL and the endpoint.

Authentication (``megatron_sat.rollout.auth``): with ``keys``, each call carries
``Authorization: Bearer <key>``, the API key on normal routes (``/generate``, ``/model_info``)
and the admin key (the API key when the server has no admin key) on SGLang's admin routes.
Weight updates (sglang 0.5.23 ``scheduler_components/weight_updater.py``): every
``/update_weights_from_distributed`` must fall between ``/begin_weight_update`` and
``/end_weight_update``; outside a session SGLang answers 400 ``{"success": false, "message":
"update_weights_from_distributed must run between begin_weight_update() and
end_weight_update()"}`` before it joins the broadcast.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from megatron_sat.rollout.auth import ServerKeys
from megatron_sat.routing.payload import decode_routed_experts

# SGLang treats temperature below this as greedy (temperature 1, top_k 1):
# sglang/srt/sampling/sampling_params.py:_SAMPLING_EPS.
SAMPLING_EPS = 1e-6
PAUSE_MODES = ("abort", "retract", "in_place")
# Other SGLang sampling_params, accepted only at values that leave sampling unchanged
# (token-id responses have no text, so the text-only switches are neutral at any value).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_new_tokens": (0,),
    "ignore_eos": (False,),
    "n": (1,),
    "stop": ([], ""),
    "skip_special_tokens": (True, False),
    "spaces_between_special_tokens": (True, False),
    "no_stop_trim": (True, False),
}


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


@dataclass(frozen=True)
class SamplingParams:
    """The subset of SGLang's ``sampling_params`` we use; defaults are SGLang's.

    Attributes:
        temperature: softmax temperature; < 1e-6 means greedy (SGLang's convention).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 keeps the whole vocabulary.
        max_new_tokens: maximum response length in tokens (>= 0).
        stop_token_ids: extra stop tokens (the model's eos ids always stop).
        sampling_seed: per-request seed (SGLang 0.5.23 ``sampling_params.sampling_seed``,
            an int64; honoured by SGLang with ``--enable-deterministic-inference``): each
            token is drawn from noise hashed from (seed, position), independent of the
            server's state and of the batch (see ``rollout.seeds``). None: the server's
            generator.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        # Callers pass lists; keep the frozen record hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("top_k", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        seed = self.sampling_seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63
        ):
            raise ValueError(f"sampling_seed must be an int64 or None, got {seed!r}")

    @property
    def greedy(self) -> bool:
        """True when SGLang would decode greedily."""
        return self.temperature < SAMPLING_EPS

    def to_json(self) -> dict[str, Any]:
        """SGLang's ``sampling_params`` JSON object."""
        out = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
        }
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SamplingParams:
        """Parse SGLang's ``sampling_params``; None means SGLang's default.

        Raises:
            ValueError: on a key this class does not implement set to a value that would change
                sampling (naming it), or a bad value.
        """
        ours = set(cls.__dataclass_fields__)
        for key, value in obj.items():
            if key not in ours and value is not None and value not in _NEUTRAL.get(key, ()):
                raise ValueError(f"unsupported sampling_params {key}={value!r}")
        return cls(**{k: v for k, v in obj.items() if k in ours and v is not None})


@dataclass(frozen=True)
class RoutingSpec:
    """Shape of the served model's routing, needed to decode ``routed_experts``."""

    num_layers: int
    top_k: int
    num_experts: int


@dataclass
class GenerateOutput:
    """One finished request of ``/generate``.

    Attributes:
        output_ids: response token ids, length R (a matched stop token included).
        output_token_logprobs: natural log-prob of each output token under the engine's
            temperature-scaled distribution before top-p/top-k truncation (SGLang's default);
            length R, or empty when not requested.
        finish_reason: "stop", "length" or "abort".
        weight_version: the server's weight version when the request finished.
        routed_experts: [P + R - 1 - routed_experts_start_len, num_layers, top_k] uint8 (<= 256
            experts) or int16; None when not requested or when an aborted request never ran.
        prompt_tokens: P.
        completion_tokens: R.
        meta_info: the raw meta_info object, for anything not typed above.
        output_token_versions: the weight version of each output token (length R) when the
            engine reports one per token (vLLM's ``weight_versions`` spans: a request that
            runs across a weight update has tokens of both versions); None when it reports one
            per request (SGLang: every token is given ``weight_version``).
    """

    output_ids: list[int]
    output_token_logprobs: list[float]
    finish_reason: str
    weight_version: str
    routed_experts: np.ndarray | None
    prompt_tokens: int
    completion_tokens: int
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)
    output_token_versions: list[str] | None = None

    def token_versions(self) -> list[str]:
        """The weight version of each output token: ``output_token_versions`` when the engine
        reported them, else ``weight_version`` for every token.

        Raises:
            ValueError: when ``output_token_versions`` does not have one entry per token.
        """
        if self.output_token_versions is None:
            return [self.weight_version] * len(self.output_ids)
        if len(self.output_token_versions) != len(self.output_ids):
            raise ValueError(
                f"{len(self.output_token_versions)} output_token_versions for "
                f"{len(self.output_ids)} output tokens"
            )
        return list(self.output_token_versions)


class SGLangClient:
    """Blocking, thread-safe client of one server.

    Args:
        base_url: e.g. "http://127.0.0.1:30000".
        timeout_s: timeout of every HTTP call, seconds (generation included).
        max_retries: extra attempts of idempotent calls on connection errors / HTTP 503.
        retry_backoff_s: sleep before the first retry, doubled after each.
        keys: the server's API / admin API keys (SGLang's ``--api-key``, ``--admin-api-key``);
            None for a server started without keys.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        *,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        keys: ServerKeys | None = None,
    ) -> None:
        check_client_options(timeout_s, max_retries)
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.keys = keys or ServerKeys()
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r})"

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # ---- generation -------------------------------------------------------------------------

    def generate(
        self,
        input_ids: Sequence[int] | Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        *,
        routing: RoutingSpec | None = None,
        routed_experts_start_len: int = 0,
        return_logprob: bool = True,
    ) -> list[GenerateOutput]:
        """POST /generate with token ids; one output per prompt, in order.

        Args:
            input_ids: one prompt (list of ids) or a batch (list of lists).
            sampling: sampling parameters shared by the batch, or one per prompt (SGLang
                takes a list of ``sampling_params`` for a batch).
            routing: when given, ask for routed experts and decode them with this shape.
            routed_experts_start_len: first token position whose routing is returned.
            return_logprob: ask for ``output_token_logprobs``.

        Raises:
            SGLangError: on HTTP errors, a missing field (e.g. routed_experts when the server
                was started without --enable-return-routed-experts) or inconsistent output.
        """
        batch = [list(p) for p in input_ids] if is_batch(input_ids) else [list(input_ids)]
        if not batch or any(len(p) == 0 for p in batch):
            raise ValueError("every prompt needs at least one token")
        if isinstance(sampling, SamplingParams):
            params: Any = sampling.to_json()
        else:
            params = [s.to_json() for s in sampling]
            if len(params) != len(batch):
                raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
            params = params if is_batch(input_ids) else params[0]
        body: dict[str, Any] = {
            "input_ids": batch if is_batch(input_ids) else batch[0],
            "sampling_params": params,
            "return_logprob": return_logprob,
        }
        if routing is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = routed_experts_start_len
        reply = self._request("POST", "/generate", body, retry=True).json()
        items = reply if isinstance(reply, list) else [reply]
        if len(items) != len(batch):
            raise SGLangError(f"{self.base_url}/generate: {len(items)} outputs for {len(batch)}")
        return [
            self._parse_output(item, len(prompt), routing, routed_experts_start_len, return_logprob)
            for item, prompt in zip(items, batch, strict=True)
        ]

    def _parse_output(
        self,
        item: dict[str, Any],
        prompt_len: int,
        routing: RoutingSpec | None,
        start_len: int,
        return_logprob: bool,
    ) -> GenerateOutput:
        where = f"{self.base_url}/generate"
        try:
            meta = item["meta_info"]
            output_ids = [int(t) for t in item["output_ids"]]
            finish = meta["finish_reason"]
            weight_version = str(meta["weight_version"])
        except (KeyError, TypeError) as e:
            raise SGLangError(f"{where}: malformed output, missing {e}: {item!r:.300}") from e
        if not isinstance(finish, dict) or "type" not in finish:
            raise SGLangError(f"{where}: request did not finish (finish_reason={finish!r})")
        logprobs: list[float] = []
        if return_logprob:
            entries = meta.get("output_token_logprobs")
            if entries is None or len(entries) != len(output_ids):
                count = None if entries is None else len(entries)
                raise SGLangError(
                    f"{where}: output_token_logprobs has {count} entries for "
                    f"{len(output_ids)} output tokens"
                )
            for pos, (entry, token) in enumerate(zip(entries, output_ids, strict=True)):
                if int(entry[1]) != token:
                    raise SGLangError(
                        f"{where}: output_token_logprobs[{pos}] is for token {entry[1]}, "
                        f"output_ids[{pos}] is {token}"
                    )
                logprobs.append(float(entry[0]))
        routed = None
        payload = meta.get("routed_experts")
        # A request aborted before it ran has no routing; the caller retries it anyway.
        if routing is not None and not (payload is None and finish["type"] == "abort"):
            if payload is None:
                raise SGLangError(
                    f"{where}: no routed_experts in the response; start the server with "
                    "--enable-return-routed-experts"
                )
            try:
                routed = decode_routed_experts(
                    payload,
                    num_tokens=max(0, prompt_len + len(output_ids) - 1 - start_len),
                    num_layers=routing.num_layers,
                    top_k=routing.top_k,
                    num_experts=routing.num_experts,
                )
            except ValueError as e:
                raise SGLangError(f"{where}: {e}") from e
        return GenerateOutput(
            output_ids=output_ids,
            output_token_logprobs=logprobs,
            finish_reason=str(finish["type"]),
            weight_version=weight_version,
            routed_experts=routed,
            prompt_tokens=int(meta.get("prompt_tokens", prompt_len)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            meta_info=meta,
        )

    # ---- status -----------------------------------------------------------------------------

    def health(self, timeout_s: float | None = None) -> bool:
        """GET /health: True on HTTP 200, False on any other status or a connection error.

        SGLang's /health runs a one-token generation: on a paused server it waits and answers
        503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s), and marks the server unhealthy. Ask
        :meth:`alive` about a server that may be paused.
        """
        try:
            timeout = self.timeout_s if timeout_s is None else timeout_s
            return self._http.get("/health", timeout=timeout).status_code == 200
        except httpx.TransportError:
            return False

    def alive(self, timeout_s: float | None = None) -> bool:
        """GET /model_info: True on HTTP 200. SGLang answers it from the HTTP process without
        the scheduler, so a paused server answers at once: liveness of the server process
        that is safe to ask while generation may be paused."""
        try:
            timeout = self.timeout_s if timeout_s is None else timeout_s
            headers = self.keys.header_for("/model_info")
            return self._http.get("/model_info", timeout=timeout, headers=headers).is_success
        except httpx.TransportError:
            return False

    def get_weight_version(self) -> str:
        """The server's ``weight_version`` (SGLang serves it in GET /model_info)."""
        info = self._request("GET", "/model_info", None, retry=True).json()
        if "weight_version" not in info:
            raise SGLangError(f"{self.base_url}/model_info: no weight_version in {info!r:.300}")
        return str(info["weight_version"])

    # ---- generation control -----------------------------------------------------------------

    def pause_generation(self, mode: str = "abort") -> None:
        """POST /pause_generation; ``mode`` is SGLang's "abort", "retract" or "in_place"."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._request("POST", "/pause_generation", {"mode": mode}, retry=True)

    def continue_generation(self) -> None:
        """POST /continue_generation."""
        self._request("POST", "/continue_generation", {}, retry=True)

    def flush_cache(self) -> None:
        """POST /flush_cache. SGLang refuses it (HTTP 400, text body) while requests are running
        or queued; a server paused with mode "retract" or "abort" has none, one paused with
        "in_place" keeps its running requests and refuses. Raises SGLangRequestError then."""
        self._request("POST", "/flush_cache", None, retry=True)

    # ---- weight update (never retried) ------------------------------------------------------

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """POST /init_weights_update_group; returns once the server joined the group.

        Raises:
            SGLangError: naming the server and its message when it fails.
        """
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._check_success(self._request("POST", "/init_weights_update_group", body))

    def begin_weight_update(self, selector: str = "all") -> None:
        """POST /begin_weight_update ``{"selector": ...}``: open SGLang's weight-update session.

        Raises:
            SGLangError: with the server's message (e.g. a session is already open).
        """
        body = {"selector": selector}
        self._check_success(self._request("POST", "/begin_weight_update", body))

    def end_weight_update(self) -> None:
        """POST /end_weight_update ``{}``: close the session (SGLang then finalises weights).

        Raises:
            SGLangError: with the server's message (e.g. no session is open).
        """
        self._check_success(self._request("POST", "/end_weight_update", {}))

    def destroy_weights_update_group(self, group_name: str) -> None:
        """POST /destroy_weights_update_group."""
        body = {"group_name": group_name}
        self._check_success(self._request("POST", "/destroy_weights_update_group", body))

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None:
        """POST /update_weights_from_distributed; returns after the server loaded the tensors.

        The caller must broadcast the tensors (in ``names`` order, src rank 0) concurrently,
        inside a session (:meth:`begin_weight_update` ... :meth:`end_weight_update`).

        Raises:
            SGLangError: with the server's message (it names a rejected parameter).
        """
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "weight_version": weight_version,
            "load_format": load_format,
        }
        self._check_success(self._request("POST", "/update_weights_from_distributed", body))

    # ---- plumbing ---------------------------------------------------------------------------

    def _check_success(self, response: httpx.Response) -> None:
        reply = response.json()
        if not reply.get("success", False):
            raise SGLangError(f"{response.request.url}: {reply.get('message', reply)}")

    def _request(
        self, method: str, endpoint: str, body: Any, *, retry: bool = False
    ) -> httpx.Response:
        """Send one call; raise SGLangError naming URL and endpoint on failure.

        A weight-update reply with HTTP 400 and ``success: false`` is returned, not raised, so
        the caller can surface the server's message.
        """
        return request_with_retries(
            self._http,
            method,
            endpoint,
            body,
            attempts=1 + (self.max_retries if retry else 0),
            backoff_s=self.retry_backoff_s,
            headers=self.keys.header_for(endpoint),
            accept=lambda r: r.is_success or _is_success_false(r),
        )


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


def _is_success_false(response: httpx.Response) -> bool:
    """SGLang answers failed weight/group calls with HTTP 400 and {"success": false, ...}."""
    if response.status_code != 400:
        return False
    try:
        reply = response.json()
    except ValueError:
        return False
    return isinstance(reply, dict) and reply.get("success") is False
