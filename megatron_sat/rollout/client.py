"""Typed HTTP client for SGLang's native API (a real SGLang server or our embedded server).

Field names, request and response shapes follow sglang 0.5.23 (``srt/managers/io_struct.py``,
``srt/entrypoints/http_server.py``). The contract it implements, with its retries, timeouts and
errors, is ``rollout.engine`` (``RolloutClient``, ``HTTPClient``); the request and output types
are ``rollout.sampling``'s. Every error names the server URL and the endpoint.

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

from collections.abc import Callable, Sequence
from typing import Any

import httpx

from megatron_sat.rollout.auth import ServerKeys
from megatron_sat.rollout.engine import (
    RETRY_TRANSPORT_ERRORS,
    HTTPClient,
    SGLangError,
    SGLangRequestError,
    check_client_options,
    is_batch,
    per_prompt_params,
    prompt_batch,
    request_with_retries,
)
from megatron_sat.rollout.generate_reply import ReplyRequest, parse_outputs
from megatron_sat.rollout.protocol import ReplyGuard, ReplyRefused, generate_reply_cap
from megatron_sat.rollout.reply_parser import ParsedReply, ReplyParser, parse_in_thread
from megatron_sat.rollout.sampling import (
    SAMPLING_EPS,
    GenerateOutput,
    RoutingSpec,
    SamplingParams,
)
from megatron_sat.weight_sync.channel import PAUSE_MODES

# The engine-neutral names (``rollout.engine``, ``rollout.sampling``) stay importable from here.
__all__ = [
    "PAUSE_MODES",
    "RETRY_TRANSPORT_ERRORS",
    "SAMPLING_EPS",
    "GenerateOutput",
    "RoutingSpec",
    "SGLangClient",
    "SGLangError",
    "SGLangRequestError",
    "SamplingParams",
    "check_client_options",
    "is_batch",
    "request_with_retries",
]


class SGLangClient(HTTPClient):
    """Blocking, thread-safe client of one server (``rollout.engine.RolloutClient``).

    SGLang's /health (``health``) runs a one-token generation: on a paused server it waits and
    answers 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s), and marks the server unhealthy.
    Ask :meth:`alive` about a server that may be paused.

    Args:
        base_url: e.g. "http://127.0.0.1:30000".
        timeout_s: timeout of every HTTP call, seconds (generation included).
        max_retries: extra attempts of idempotent calls on connection errors / HTTP 503.
        retry_backoff_s: sleep before the first retry, doubled after each.
        paused_timeout_s: how long a call waits for a paused server to resume, seconds
            (``rollout.engine``); None = ``timeout_s``.
        keys: the server's API / admin API keys (SGLang's ``--api-key``, ``--admin-api-key``);
            None for a server started without keys.
    """

    # A reply refused by the protocol checks (rollout.protocol) is retried like these.
    retry_on = (*RETRY_TRANSPORT_ERRORS, ReplyRefused)

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        *,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        keys: ServerKeys | None = None,
        paused_timeout_s: float | None = None,
    ) -> None:
        super().__init__(
            base_url,
            timeout_s,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
            paused_timeout_s=paused_timeout_s,
        )
        self.keys = keys or ServerKeys()
        self.guard = ReplyGuard(self.base_url)  # size, JSON, log-probs, versions
        self.guard.install(self._http)
        self._built_http = self._http  # worker_spec: a replaced connection is not rebuilt

    # ---- generation -------------------------------------------------------------------------

    def generate(
        self,
        input_ids: Sequence[int] | Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        *,
        routing: RoutingSpec | None = None,
        routed_experts_start_len: int = 0,
        return_logprob: bool = True,
        reply_parser: ReplyParser | None = None,
    ) -> list[GenerateOutput]:
        """POST /generate with token ids; one output per prompt, in order.

        Args:
            input_ids: one prompt (list of ids) or a batch (list of lists).
            sampling: sampling parameters shared by the batch, or one per prompt (SGLang
                takes a list of ``sampling_params`` for a batch).
            routing: when given, ask for routed experts and decode them with this shape.
            routed_experts_start_len: first token position whose routing is returned.
            return_logprob: ask for ``output_token_logprobs``.
            reply_parser: fetch and parse the reply in its worker processes
                (``rollout.reply_parser``; the pool's, ``rollout.reply_parse_workers``): the
                body never enters this process; a client :meth:`worker_spec` cannot rebuild
                there reads it here and has it parsed there. None: both in the calling thread.
                The outputs, errors and refusal counts are the same.

        Raises:
            SGLangError: on HTTP errors, a missing field (e.g. routed_experts when the server
                was started without --enable-return-routed-experts) or inconsistent output.
            ReplyParserError: when a worker process of ``reply_parser`` died.
        """
        batch = prompt_batch(input_ids)
        if isinstance(sampling, SamplingParams):
            params: Any = sampling.to_json()
        else:
            params = [s.to_json() for s in per_prompt_params(sampling, len(batch))]
            params = params if is_batch(input_ids) else params[0]
        body: dict[str, Any] = {
            "input_ids": batch if is_batch(input_ids) else batch[0],
            "sampling_params": params,
            "return_logprob": return_logprob,
        }
        if routing is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = routed_experts_start_len
        news = [p.max_new_tokens for p in per_prompt_params(sampling, len(batch))]
        request = ReplyRequest(
            self.base_url,
            tuple(len(p) for p in batch),
            routing,
            routed_experts_start_len,
            return_logprob,
        )
        cap = generate_reply_cap(list(request.prompt_lens), news, routing)
        spec = None if reply_parser is None else self.worker_spec()
        if spec is not None:  # the whole call in a worker process: the body never comes here
            parsed = reply_parser.fetch(spec, body, request, self.guard.max_reply_bytes or cap)
            self.guard.add_refused(parsed.refused)
        else:
            parse = parse_in_thread if reply_parser is None else reply_parser.parse
            parsed = self.fetch_reply(body, request, cap, parse)
        return [self.guard.check_output(out) for out in parsed.outputs()]

    def fetch_reply(
        self,
        body: dict[str, Any],
        request: ReplyRequest,
        cap: int,
        parse: Callable[[bytes | bytearray, ReplyRequest], ParsedReply] = parse_in_thread,
    ) -> ParsedReply:
        """POST ``body`` to /generate and parse the reply with ``parse``, in the calling
        thread (the half of :meth:`generate` before the guard's content checks; a reply worker
        process runs it too, ``rollout.reply_worker``).

        The routes stay in the body's bytes until decoded (routing.wire): no 2 KB/token str. A
        body that does not split as JSON is refused and sent again (the guard's retry); the
        outputs' own errors are in the result (rollout.generate_reply's two stages).

        Args:
            body: the request's JSON.
            request: what the parse needs of the request.
            cap: the reply's size cap, bytes (the guard's ``max_reply_bytes`` replaces it).
            parse: the body's parse (:func:`parse_in_thread`, or ``ReplyParser.parse``).

        Raises:
            SGLangError: as :meth:`generate`, for the HTTP call or a body malformed on every try.
        """
        with self.guard.expecting(cap):
            return self.guard.fetch_json(
                lambda: self._request("POST", "/generate", body, retry=True),
                attempts=1 + self.max_retries,
                backoff_s=self.retry_backoff_s,
                error=self.error,
                parse=lambda content: parse(content, request),
            )

    def worker_spec(self) -> dict[str, Any] | None:
        """The constructor arguments a reply worker process (``rollout.reply_parser``) builds
        this client's twin from, with its class (``"module:name"``); None when a worker could
        not make the same call: a subclass that changes how a call is made (``_request``,
        ``_headers``, ``_accept``, ``fetch_reply``, the error or retry classes) or a client
        whose HTTP connection was replaced after construction (a test's mock transport). Such a
        client's reply is read here and parsed in the worker."""
        cls = type(self)
        same = all(getattr(cls, name) is getattr(SGLangClient, name) for name in _CALL_MEMBERS)
        if not same or self._http is not self._built_http:
            return None
        return {
            "class": f"{SGLangClient.__module__}:{SGLangClient.__qualname__}",
            "base_url": self.base_url,
            "timeout_s": self.timeout_s,
            "max_retries": self.max_retries,
            "retry_backoff_s": self.retry_backoff_s,
            "keys": self.keys,
            "paused_timeout_s": self.paused_timeout_s,
        }

    def outputs(
        self,
        items: list[dict[str, Any]],
        payloads: list[memoryview | None],
        prompt_lens: Sequence[int],
        *,
        routing: RoutingSpec | None = None,
        routed_experts_start_len: int = 0,
        return_logprob: bool = True,
    ) -> list[GenerateOutput]:
        """The checked outputs of a ``/generate`` reply already split by
        ``routing.wire.split_generate_reply`` (``items``, ``payloads``), one per prompt of
        ``prompt_lens`` tokens: what :meth:`generate` returns after the HTTP call in the
        calling thread (and what bench/data_path.py times as the parse). Arguments as
        :meth:`generate`.

        Raises:
            SGLangError: as :meth:`generate`, for a reply of another length than the batch or
                a malformed output; ``ProtocolViolation`` from the guard's checks.
        """
        request = ReplyRequest(
            self.base_url,
            tuple(prompt_lens),
            routing,
            routed_experts_start_len,
            return_logprob,
        )
        return [self.guard.check_output(o) for o in parse_outputs(items, payloads, request)]

    # ---- status -----------------------------------------------------------------------------

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

    def get_server_info(self) -> dict[str, Any]:
        """GET /server_info: the server's resolved start-up arguments (``ServerArgs`` fields
        such as ``enable_deterministic_inference``, ``dp_size``) and live state."""
        info = self._request("GET", "/server_info", None, retry=True).json()
        if not isinstance(info, dict):
            raise SGLangError(f"{self.base_url}/server_info: not an object: {info!r:.300}")
        return info

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

    def _headers(self, endpoint: str) -> dict[str, str]:
        return self.keys.header_for(endpoint)

    def _accept(self, response: httpx.Response) -> bool:
        """A weight-update reply with HTTP 400 and ``success: false`` is returned, not raised,
        so the caller can surface the server's message."""
        return response.is_success or _is_success_false(response)


# What a call of SGLangClient is made of: a subclass that changes one of them makes calls a
# reply worker's twin (built as SGLangClient) would not (SGLangClient.worker_spec).
_CALL_MEMBERS = (
    "_request",
    "_headers",
    "_accept",
    "fetch_reply",
    "error",
    "request_error",
    "retry_on",
)


def _is_success_false(response: httpx.Response) -> bool:
    """SGLang answers failed weight/group calls with HTTP 400 and {"success": false, ...}."""
    if response.status_code != 400:
        return False
    try:
        reply = response.json()
    except ValueError:
        return False
    return isinstance(reply, dict) and reply.get("success") is False
