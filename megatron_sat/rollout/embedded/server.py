"""Embedded rollout server: SGLang's native HTTP API over ``GenerationEngine`` on the CPU.

Run: ``python -m megatron_sat.rollout.embedded.server --model-path DIR --host 127.0.0.1
--port P --random-seed S [--enable-return-routed-experts] [--max-running-requests N]
[--dist-timeout SECONDS] [--api-key K] [--admin-api-key K] [--config KEYS.yaml]`` (flags
spelled as ``sglang.launch_server``'s; ``--config`` is SGLang's YAML of flags, here only
``api-key`` / ``admin-api-key``, so keys need not appear on a command line).

Endpoints and JSON as sglang 0.5.23 (``srt/entrypoints/http_server.py``, ``io_struct.py``):
``/health`` and ``/health_generate``, ``/ready``, ``/model_info`` (carries ``weight_version``),
``/server_info`` and ``/get_server_info`` (the start-up flags a trainer checks),
``/generate`` (token ids in, token ids out, as SGLang with ``--skip-tokenizer-init``: no
``text``), ``/flush_cache``, ``/pause_generation``, ``/continue_generation``,
``/init_weights_update_group``, ``/destroy_weights_update_group``, ``/begin_weight_update``,
``/end_weight_update``, ``/update_weights_from_distributed``. SGLang's behaviour we follow
(each checked in its source; ``tests/test_sglang_conformance.py`` compares):

- Auth (``srt/utils/auth.py``): ``--api-key`` / ``--admin-api-key`` and the three auth levels,
  decided by ``megatron_sat.rollout.auth.decide_request_auth`` (SGLang's rule); refused
  requests get 401 ``{"error": "Unauthorized"}`` or 403 ``{"error": "Forbidden"}``.
- ``/update_weights_from_distributed`` outside a ``/begin_weight_update`` ...
  ``/end_weight_update`` session: HTTP 400 ``{"success": false, "message":
  "update_weights_from_distributed must run between begin_weight_update() and
  end_weight_update()"}``, without joining the broadcast. A second begin, or an end without a
  session, is 400 with SGLang's messages.
- ``/health`` (= ``/health_generate``; SGLang's default ``SGLANG_ENABLE_HEALTH_ENDPOINT_
  GENERATION=1``) stands for a one-token generation: while generation is paused it waits, and
  answers 503 once ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (default 20; read from the
  environment as SGLang does, fractional values allowed here) pass without a resume.
  ``/ready`` is 503 while paused. ``/model_info`` answers at once, paused or not.
- ``/flush_cache`` is refused (HTTP 400, text ``Flush cache failed.``) while requests run or
  (unpaused) wait, as SGLang's scheduler ``flush_cache``; an update with ``flush_cache`` true
  (SGLang's default) in that state loads the weights and records its ``weight_version``, then
  fails with SGLang's message (SGLang 0.5.23 records the version before it flushes).

Deliberate differences from SGLang, each loud rather than silent:

- Request fields we do not implement (``text``, ``stream``, top logprobs, penalties, ...) get
  HTTP 400 naming the field, instead of being honoured.
- ``return_routed_experts`` without ``--enable-return-routed-experts`` is HTTP 400 (SGLang
  silently omits the field).
- There is no prefix cache, so a permitted ``/flush_cache`` has nothing to drop.
- Batching is static: requests that arrive while a batch decodes wait until it ends (SGLang
  admits them between decode steps: continuous batching). Within a batch each ``/generate``
  is answered as soon as its own requests finish, as SGLang does, so a short request does not
  wait for a long one it was batched with.
- Pause mode "in_place" suspends the running batch after its current decode step with its KV
  cache (as SGLang) and resumes it at ``/continue_generation``; "retract" lets the running
  batch finish before the pause returns (SGLang retracts it to the waiting queue and recomputes
  it later); queued requests wait until ``/continue_generation``. "abort" (SGLang's default)
  stops the running batch after its current decode step and aborts queued requests
  (finish_reason ``{"type": "abort", ...}``, partial outputs kept).

Failed weight updates (the protocol, chosen so that no side can hang): the handler validates the
whole request before touching the group. (1) If the request cannot even describe the tensors to
receive (unknown ``group_name``, ``names``/``dtypes``/``shapes`` of different lengths, an unknown
dtype, a negative dimension, a ``load_format`` other than null or ``flattened_bucket``) it
answers HTTP 400 at once without joining the broadcast; a sender that builds its metadata from
real tensors (our WeightUpdater) never produces these, and the group's timeout bounds anyone
else's wait.
(2) If the metadata is well formed but does not match the model (unknown parameter name, wrong
shape or dtype), it still receives every declared tensor into scratch buffers -- so the
sender's broadcasts complete and the group stays in step for the next request -- then answers
HTTP 400 ``{"success": false, "message": ...}`` naming each bad parameter, with no weight
modified and ``weight_version`` unchanged. (3) Otherwise it receives all tensors of the request,
then copies them into the model (a request is applied whole or not at all) and sets
``weight_version`` if the request carries one. As in SGLang, every request is received aside
and then loaded (``receive_update``), so a broadcast that breaks half way (the sender died or
timed out: the group is unusable then anyway) loads nothing and leaves ``weight_version``
unchanged.
"""

from __future__ import annotations

# First: a parent killed during the slow imports below must not leave this server behind.
from megatron_sat.rollout.embedded import _parent_guard  # noqa: F401  isort: skip

import argparse
import asyncio
import logging
import math
import os
import secrets
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from megatron_sat.rollout.auth import (
    ENDPOINT_AUTH_LEVELS,
    AuthLevel,
    auth_error_body,
    decide_request_auth,
    load_server_keys,
)
from megatron_sat.rollout.client import PAUSE_MODES, SamplingParams
from megatron_sat.rollout.embedded.engine import EngineOutput, EngineRequest, GenerationEngine
from megatron_sat.routing.payload import encode_routed_experts
from megatron_sat.weight_sync.group import WeightUpdateGroup, create_weight_update_group

logger = logging.getLogger("megatron_sat.embedded")
LOAD_FORMATS = (None, "flattened_bucket")
SELECTORS = ("target", "draft", "all")  # io_struct.BeginWeightUpdateReqInput.selector
# SGLang's texts (http_server.flush_cache, scheduler_components/weight_updater.py).
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_FAILED = "Flush cache failed.\n"
FLUSH_AFTER_UPDATE_FAILED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)
OUTSIDE_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)

# Top-level /generate fields we honour, and those we accept only at SGLang's default value.
_GENERATE_FIELDS = {
    "input_ids",
    "sampling_params",
    "return_logprob",
    "return_routed_experts",
    "routed_experts_start_len",
    "rid",
}
_GENERATE_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "logprob_start_len": (-1,),
    "top_logprobs_num": (0,),
    "return_text_in_logprobs": (False,),
}


@dataclass(frozen=True)
class ServerConfig:
    """Command-line configuration (SGLang's flag names).

    Attributes:
        model_path: HF checkpoint directory.
        host, port: where uvicorn listens.
        random_seed: seed of the sampling generator.
        dtype: the engine's weights and activations, SGLang's ``--dtype`` ("float32" or
            "bfloat16", ``engine.ENGINE_DTYPES``).
        enable_return_routed_experts: allow ``return_routed_experts`` requests.
        max_running_requests: most prompts decoded together in one batch.
        dist_timeout_s: timeout of the weight-update group's rendezvous and broadcasts, seconds.
        api_key, admin_api_key: SGLang's ``--api-key`` / ``--admin-api-key``; None = unset.
        health_check_timeout_s: how long /health waits for a paused server, seconds
            (SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT``).
    """

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    random_seed: int = 0
    dtype: str = "float32"
    enable_return_routed_experts: bool = False
    max_running_requests: int = 64
    dist_timeout_s: float = 600.0
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    health_check_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if self.health_check_timeout_s <= 0:
            raise ValueError(
                f"health_check_timeout_s must be > 0, got {self.health_check_timeout_s}"
            )
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")


@dataclass
class _Work:
    requests: list[EngineRequest]
    future: Future = field(default_factory=Future)


class _Scheduler:
    """Batches queued /generate work on one thread; honours pause/abort; owns the model lock.

    ``model_lock`` is held while a batch runs and while weights are loaded, so the two never
    overlap. Lock order: ``_cond`` may be held when taking ``model_lock``, never the reverse,
    except by the generation thread itself (between decode steps, ``_between_steps``), the
    only thread that takes ``model_lock`` under ``_cond``.
    """

    def __init__(self, engine: GenerationEngine, max_running_requests: int) -> None:
        self.engine = engine
        self.max_running_requests = max_running_requests
        self.model_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pending: deque[_Work] = deque()
        self._paused = False
        self._pause_mode: str | None = None
        self._running = 0  # requests of the batch being decoded (a suspended one included)
        self._suspended = False  # the running batch waits in an "in_place" pause
        self._abort = threading.Event()
        # Changed only under model_lock, so a batch reads the version its weights carry.
        self.weight_version = "default"  # SGLang's default --weight-version
        # The running batch's decode steps and its weight-update events (old version, tokens
        # per request then): a push lands inside a batch only in an "in_place" pause.
        self._steps = 0
        self._events: list[tuple[str, int]] = []
        threading.Thread(target=self._loop, name="generation", daemon=True).start()

    def submit(self, requests: list[EngineRequest]) -> list[Future]:
        """Queue requests in chunks of at most ``max_running_requests``; one future per chunk.

        Each future resolves to (outputs of its chunk, weight_version when it finished, the
        weight-update events of its batch: (old version, tokens per request then)).
        """
        size = self.max_running_requests
        works = [_Work(requests[i : i + size]) for i in range(0, len(requests), size)]
        with self._cond:
            self._pending.extend(works)
            self._cond.notify_all()
        return [work.future for work in works]

    def pause(self, mode: str) -> None:
        """Stop taking batches; return once no batch decodes (see the module docstring)."""
        with self._cond:
            self._paused, self._pause_mode = True, mode
        if mode == "abort":
            self.abort_all()
            return
        with self._cond:  # "in_place": until the batch is suspended; "retract": finished
            while self._running and not (mode == "in_place" and self._suspended):
                self._cond.wait()

    def resume(self) -> None:
        with self._cond:
            self._paused, self._pause_mode = False, None
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def busy(self) -> bool:
        """Whether SGLang would refuse a cache flush: requests running (or suspended in
        place), or waiting while not paused (a paused scheduler's flush ignores its queue)."""
        # No _cond here: the caller may hold model_lock, and _loop takes _cond before it.
        return self._running > 0 or (not self._paused and bool(self._pending))

    def _between_steps(self) -> bool:
        """Polled by the engine between decode steps: True aborts the batch; in an "in_place"
        pause the batch waits here, without the model lock, until resumed or aborted."""
        _crash_hook()
        self._steps += 1  # every live request of the (lockstep) batch has this many tokens
        if self._abort.is_set():
            return True
        with self._cond:
            if not (self._paused and self._pause_mode == "in_place"):
                return False
            self._suspended = True
            self._cond.notify_all()
        old_version = self.weight_version
        self.model_lock.release()
        try:
            with self._cond:
                while self._paused and not self._abort.is_set():
                    self._cond.wait()
                self._suspended = False
        finally:
            self.model_lock.acquire()
        if self.weight_version != old_version:  # SGLang's record_weight_version_events
            self._events.append((old_version, self._steps))
        return self._abort.is_set()

    def abort_all(self) -> None:
        """Abort queued work now and the running batch after its current decode step."""
        with self._cond:
            aborted = list(self._pending)
            self._pending.clear()
            self._abort.set()
            self._cond.notify_all()  # wakes a batch suspended in place
        for work in aborted:
            work.future.set_result(([_aborted(r) for r in work.requests], self.weight_version, []))
        with self._cond:
            while self._running:
                self._cond.wait()
            self._abort.clear()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._paused or not self._pending:
                    self._cond.wait()
                batch = [self._pending.popleft()]
                size = len(batch[0].requests)
                while (
                    self._pending
                    and size + len(self._pending[0].requests) <= self.max_running_requests
                ):
                    size += len(self._pending[0].requests)
                    batch.append(self._pending.popleft())
                self._running = size
                self.model_lock.acquire()
                self._steps, self._events = 0, []
            try:
                self._run(batch)
            finally:
                self.model_lock.release()
                with self._cond:
                    self._running = 0
                    self._cond.notify_all()

    def _run(self, batch: list[_Work]) -> None:
        """Decode ``batch`` (caller holds ``model_lock``). Each work (one /generate) is
        answered once all its requests finished, while the rest of the batch decodes on
        (SGLang answers each request when it finishes)."""
        requests = [r for work in batch for r in work.requests]
        owner = [w for w, work in enumerate(batch) for _ in work.requests]
        starts = [sum(len(work.requests) for work in batch[:w]) for w in range(len(batch))]
        finished = [0] * len(batch)
        outputs: list[EngineOutput | None] = [None] * len(requests)
        answered: set[int] = set()

        def answer(w: int) -> None:
            answered.add(w)
            mine = outputs[starts[w] : starts[w] + len(batch[w].requests)]
            # weight_version cannot change while this thread holds model_lock.
            batch[w].future.set_result((mine, self.weight_version, list(self._events)))

        def on_finish(b: int, output: EngineOutput) -> None:
            outputs[b] = output
            finished[owner[b]] += 1
            if finished[owner[b]] == len(batch[owner[b]].requests):
                answer(owner[b])

        try:
            outputs[:] = self.engine.generate(
                requests, should_abort=self._between_steps, on_finish=on_finish
            )
        except Exception as e:
            logger.exception("generation failed")
            for w, work in enumerate(batch):
                if w not in answered:
                    work.future.set_exception(e)
            return
        for w in range(len(batch)):
            if w not in answered:
                answer(w)


def version_spans(
    events: Sequence[tuple[str, int]], current: str, num_tokens: int
) -> list[dict[str, Any]]:
    """SGLang 0.5.23's ``weight_versions`` of an output of ``num_tokens`` tokens (as its
    ``compute_weight_version_spans`` then ``add_weight_versions_to_meta_info``,
    ``srt/utils/weight_versions.py``): each event ``(old version, n)`` says the first ``n``
    tokens (at most) came from ``old version``; later tokens from the next event's, the last
    ones from ``current``. Consecutive equal versions merge; no tokens gives ``[current, 0, 0)``.
    """
    changes = [(old, min(n, num_tokens)) for old, n in events] + [(current, num_tokens)]
    spans: list[dict[str, Any]] = []
    for version, end in changes:
        start = spans[-1]["end"] if spans else 0
        if spans and end <= start:
            continue
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
        else:
            spans.append({"version": version, "start": start, "end": end})
    return spans


def _aborted(request: EngineRequest) -> EngineOutput:
    """Output of a request aborted before it ran: nothing generated, no routing computed."""
    return EngineOutput([], [], "abort", None, None)


class ServerState:
    """Everything the endpoints share: the one object held by the FastAPI app."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine = GenerationEngine(
            config.model_path, seed=config.random_seed, dtype=config.dtype
        )
        self.scheduler = _Scheduler(self.engine, config.max_running_requests)
        self.groups: dict[str, WeightUpdateGroup] = {}
        # SGLang's weight-update session: the selector of the open one, None when closed.
        self.session: str | None = None
        # SGLang 0.5.23 serves the weight-update calls of a paused server one at a time, first
        # come first served: each holds the tokenizer manager's is_pause_cond (an asyncio
        # lock, FIFO) until the scheduler answered (tokenizer_control_mixin.py,
        # update_weights_from_distributed and _weight_update_session_call). A pipelined push's
        # bucket k+1 waits here while bucket k is received and loaded.
        self.update_lock = asyncio.Lock()
        # Weight updates land here, reused across requests (grown on demand): a fresh buffer
        # per bucket costs its page faults, about as long as the broadcast itself on a CPU.
        self._receive_buffer = torch.empty(0, dtype=torch.uint8)

    # ---- /generate --------------------------------------------------------------------------

    def parse_generate(self, body: dict[str, Any]) -> tuple[list[EngineRequest], bool]:
        """Requests of a /generate body and whether it was a batch.

        Raises:
            ValueError: naming the offending field.
        """
        for key, value in body.items():
            if key in _GENERATE_FIELDS or value is None:
                continue
            if value not in _GENERATE_DEFAULTS.get(key, ()):
                raise ValueError(f"unsupported /generate field {key!r}={value!r:.80}")
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids or of lists")
        is_batch = isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        raw = body.get("sampling_params") or {}
        raw_list = raw if isinstance(raw, list) else [raw] * len(prompts)
        if len(raw_list) != len(prompts):
            raise ValueError(f"{len(raw_list)} sampling_params for {len(prompts)} prompts")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt
            ):
                raise ValueError(f"prompt {i}: input_ids must be a list of integers")
        requests = [
            EngineRequest(list(p), SamplingParams.from_json(s))
            for p, s in zip(prompts, raw_list, strict=True)
        ]
        vocab = self.engine.model.config.vocab_size
        context = getattr(self.engine.model.config, "max_position_embeddings", None)
        for i, req in enumerate(requests):
            # Checked here, not in the engine, so a bad prompt cannot fail a shared batch.
            if not req.input_ids or min(req.input_ids) < 0 or max(req.input_ids) >= vocab:
                raise ValueError(f"prompt {i}: empty or token id outside [0, {vocab})")
            total = len(req.input_ids) + req.sampling.max_new_tokens
            if context is not None and total > context:
                raise ValueError(
                    f"prompt {i}: {len(req.input_ids)} prompt tokens + max_new_tokens "
                    f"{req.sampling.max_new_tokens} exceed the context length {context}"
                )
        if body.get("return_routed_experts") and not self.config.enable_return_routed_experts:
            raise ValueError("return_routed_experts needs --enable-return-routed-experts")
        start = body.get("routed_experts_start_len") or 0
        for i, req in enumerate(requests):
            if not 0 <= start <= len(req.input_ids):
                raise ValueError(
                    f"routed_experts_start_len={start} outside [0, {len(req.input_ids)}] "
                    f"(prompt {i} has {len(req.input_ids)} tokens)"
                )
        return requests, is_batch

    def model_info(self) -> dict[str, Any]:
        """``/model_info`` (SGLang's fields; answered at once, paused or not)."""
        return {
            "model_path": self.config.model_path,
            "is_generation": True,
            "weight_version": self.scheduler.weight_version,
            "architectures": self.engine.model.config.architectures,
            "model_type": self.engine.model.config.model_type,
        }

    def server_info(self) -> dict[str, Any]:
        """``/server_info``: SGLang 0.5.23 answers ``ServerArgs.resolved_dict()`` plus live
        state; these are the fields of it a trainer reads (``rollout.sglang.server_info``).
        This server always honours ``sampling_seed`` (SGLang only with
        ``--enable-deterministic-inference``) and is one process (no TP, DP or PP)."""
        c = self.config
        return {
            "model_path": c.model_path,
            "host": c.host,
            "port": c.port,
            "random_seed": c.random_seed,
            "dtype": c.dtype,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "enable_return_routed_experts": c.enable_return_routed_experts,
            "enable_deterministic_inference": True,
            "max_running_requests": c.max_running_requests,
            "weight_version": self.scheduler.weight_version,
        }

    def render_all(
        self,
        body: dict[str, Any],
        requests: list[EngineRequest],
        chunks: Sequence[tuple[list[EngineOutput], str, list[tuple[str, int]]]],
    ) -> list[dict]:
        """The /generate output objects of ``requests``, from the scheduler's chunks
        (outputs, weight_version, weight-update events: ``_Scheduler.submit``)."""
        outputs = [(out, version, events) for chunk, version, events in chunks for out in chunk]
        return [
            self.render(body, r, o, version, events)
            for r, (o, version, events) in zip(requests, outputs, strict=True)
        ]

    def render(
        self,
        body: dict[str, Any],
        req: EngineRequest,
        out: EngineOutput,
        weight_version: str,
        events: Sequence[tuple[str, int]] = (),
    ) -> dict:
        """One SGLang /generate output object; ``events``: the batch's weight updates (old
        version, tokens per request then), which make its ``weight_versions`` spans."""
        spans = version_spans(events, weight_version, len(out.output_ids))
        finish: dict[str, Any]
        if out.finish_reason == "stop":
            finish = {"type": "stop", "matched": out.matched_stop}
        elif out.finish_reason == "length":
            finish = {"type": "length", "length": req.sampling.max_new_tokens}
        else:
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        meta: dict[str, Any] = {
            "id": body.get("rid") or uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(out.output_ids),
            "cached_tokens": 0,
            # SGLang 0.5.23 (utils/weight_versions.py, add_weight_versions_to_meta_info): the
            # spans of every finished or aborted output, and the last span's version.
            "weight_versions": spans,
            "weight_version": spans[-1]["version"],
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [
                [lp, tok, None]
                for lp, tok in zip(out.output_token_logprobs, out.output_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(out.output_ids)
        if body.get("return_routed_experts") and out.routed_experts is not None:
            start = body.get("routed_experts_start_len") or 0
            meta["routed_experts"] = encode_routed_experts(out.routed_experts[start:])
        return {"output_ids": out.output_ids, "meta_info": meta}

    # ---- weight-update group ----------------------------------------------------------------

    def init_group(self, body: dict[str, Any]) -> tuple[bool, str]:
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            return False, f"weight update group {name!r} already exists; destroy it first"
        try:
            self.groups[name] = create_weight_update_group(
                master_address=body["master_address"],
                master_port=int(body["master_port"]),
                rank=int(body["rank_offset"]),
                world_size=int(body["world_size"]),
                group_name=name,
                backend=body.get("backend", "nccl"),
                timeout_s=self.config.dist_timeout_s,
            )
        except Exception as e:
            return False, f"Failed to initialize custom process group: {e!r}."
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, body: dict[str, Any]) -> tuple[bool, str]:
        group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        group.destroy()
        return True, "Succeeded to destroy custom process group."

    async def set_session(self, selector: str | None) -> tuple[bool, str]:
        """``/begin_weight_update`` (``selector``) or ``/end_weight_update`` (None), in turn
        with the update requests (``update_lock``), with SGLang's refusals."""
        async with self.update_lock:
            if selector is not None and self.session is not None:
                return False, (
                    "a weight-update session is already open; call end_weight_update() first"
                )
            if selector is None and self.session is None:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self.session = selector
        return True, "Success"

    async def serve_update(self, body: dict[str, Any]) -> tuple[bool, str]:
        """One ``/update_weights_from_distributed``: SGLang's abort first, then, holding
        ``update_lock``, the session check, ``check_update`` and ``receive_update``."""
        if body.get("abort_all_requests"):  # SGLang aborts before it takes the lock
            await asyncio.to_thread(self.scheduler.abort_all)
        async with self.update_lock:
            if self.session is None:  # SGLang checks this before joining the broadcast
                return False, OUTSIDE_SESSION
            try:
                fatal, specs, mismatches = self.check_update(body)
            except (ValueError, TypeError) as e:
                fatal, specs, mismatches = f"malformed request: {e!r}", [], []
            if fatal is not None:
                return False, fatal
            return await asyncio.to_thread(self.receive_update, body, specs, mismatches)

    def check_update(
        self, body: dict[str, Any]
    ) -> tuple[str | None, list[tuple[str, torch.dtype, tuple[int, ...]]], list[str]]:
        """Validate an update request before any broadcast is consumed.

        Returns:
            (fatal, specs, mismatches): ``fatal`` is a message when the request cannot be
            received at all (answer without joining); ``specs`` the (name, dtype, shape) to
            receive; ``mismatches`` one message per parameter the model cannot take.
        """
        group_name = body.get("group_name", "weight_update_group")
        if group_name not in self.groups:
            return f"group {group_name!r} not initialized; call /init_weights_update_group", [], []
        if body.get("load_format") not in LOAD_FORMATS:
            return f"load_format={body['load_format']!r} is not supported {LOAD_FORMATS}", [], []
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            return "names, dtypes and shapes must be lists", [], []
        if not len(names) == len(dtypes) == len(shapes):
            lengths = (len(names), len(dtypes), len(shapes))
            return f"names/dtypes/shapes lengths differ: {lengths}", [], []
        specs, mismatches = [], []
        for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
            dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                return f"{name}: unknown dtype {dtype_name!r}", [], []
            if any(int(d) < 0 for d in shape):
                return f"{name}: negative dimension in shape {shape}", [], []
            specs.append((name, dtype, tuple(int(d) for d in shape)))
            target = self.engine.weight_targets.get(name)
            if target is None:
                mismatches.append(f"{name}: unknown parameter name")
            elif tuple(target.shape) != tuple(shape) or not _loadable(dtype, target.dtype):
                mismatches.append(
                    f"{name}: expected {target.dtype} {list(target.shape)}, "
                    f"got {dtype} {list(shape)}"
                )
        return None, specs, mismatches

    def receive_update(
        self, body: dict[str, Any], specs, mismatches: list[str]
    ) -> tuple[bool, str]:
        """Receive every declared tensor (src rank 0) into the reused receive buffer, then load
        them unless any mismatched (copied into the parameters, cast where dtypes differ).

        SGLang receives each request into fresh ``torch.empty`` buffers and only then loads it
        (sglang 0.5.23 ``model_runner_components/weight_updater.py``:
        ``receive_weights_from_distributed``, then ``load_weights_from_distributed``), both
        formats: a request costs the server one copy after its broadcast, and a broken
        broadcast loads nothing. The reused buffer stands in for CUDA's caching allocator (a
        fresh host allocation would add page faults that SGLang on a GPU does not pay).
        """
        group = self.groups[body.get("group_name", "weight_update_group")]
        with self.scheduler.model_lock:
            try:
                if body.get("load_format") == "flattened_bucket":
                    received = self._receive_flattened(group, specs)
                else:
                    received = self._receive_per_tensor(group, specs)
            except RuntimeError as e:  # timeout or a sender that went away
                return False, f"broadcast failed, no weight loaded (group may be unusable): {e!r}"
            if mismatches:
                return False, f"rejected {len(mismatches)} parameter(s): " + "; ".join(mismatches)
            self.engine.load_weights(received)
            # SGLang records the version before its flush (weight_updater.py:
            # record_weight_version_after_update, then flush_cache_after_weight_update)
            if body.get("weight_version") is not None:
                self.scheduler.weight_version = str(body["weight_version"])
            if body.get("flush_cache", True) and self.scheduler.busy():
                return False, FLUSH_AFTER_UPDATE_FAILED  # SGLang: loaded, version changed
        return True, "Succeeded to update parameter online."

    def _receive_buffer_for(self, num_bytes: int) -> torch.Tensor:
        """The first ``num_bytes`` of the reused receive buffer (grown on demand)."""
        if self._receive_buffer.numel() < num_bytes:
            self._receive_buffer = torch.empty(num_bytes, dtype=torch.uint8)
        return self._receive_buffer[:num_bytes]

    def _receive_flattened(self, group, specs) -> list[tuple[str, torch.Tensor]]:
        """SGLang's ``flattened_bucket``: one uint8 broadcast holding every tensor's bytes in
        order (sglang ``srt/weight_sync/tensor_bucket.py``), received into the reused buffer;
        returns (name, tensor) per spec (``unflatten``), valid until the next update."""
        flat = self._receive_buffer_for(sum(_nbytes(dtype, shape) for _, dtype, shape in specs))
        group.broadcast(flat, src=0)
        return [(s[0], t) for s, t in zip(specs, unflatten(flat, specs), strict=True)]

    def _receive_per_tensor(self, group, specs) -> list[tuple[str, torch.Tensor]]:
        """SGLang's per-tensor protocol (``load_format`` null): one broadcast per spec, all
        enqueued then awaited, as the sender enqueues them, each into its own 64-byte-aligned
        slice of the reused receive buffer. Returns (name, tensor) per spec, valid until the
        next update."""
        offsets, end = [], 0
        for _, dtype, shape in specs:
            offsets.append(end)
            end += -(-_nbytes(dtype, shape) // 64) * 64
        scratch = self._receive_buffer_for(end)
        received = [
            (name, scratch[offset : offset + _nbytes(dtype, shape)].view(dtype).view(shape))
            for (name, dtype, shape), offset in zip(specs, offsets, strict=True)
        ]
        works = [group.broadcast(t, src=0, async_op=True) for _, t in received]
        for work in works:
            work.wait()
        return received


def _loadable(sent: torch.dtype, target: torch.dtype) -> bool:
    """A float tensor loads into a float parameter of another precision (cast on copy, as
    SGLang's weight loader does: fp32 trainer weights into a bf16 engine); else dtypes match."""
    return sent == target or (sent.is_floating_point and target.is_floating_point)


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def unflatten(flat: torch.Tensor, specs) -> list[torch.Tensor]:
    """The tensors of a flattened bucket: ``flat`` (uint8) holds each spec's ``(name, dtype,
    shape)`` bytes back to back. Views of ``flat``, except a tensor whose offset is not a
    multiple of its element size (e.g. float32 after an odd-length bfloat16 tensor), which
    torch cannot view: it is copied out."""
    out, start = [], 0
    for _, dtype, shape in specs:
        size = _nbytes(dtype, shape)
        chunk = flat[start : start + size]
        if start % max(1, torch.empty((), dtype=dtype).element_size()):
            chunk = chunk.clone()
        out.append(chunk.view(dtype).reshape(shape))
        start += size
    return out


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app; ``state`` is its only shared object (``app.state.server``)."""
    app = FastAPI()
    app.state.server = state
    config = state.config

    @app.middleware("http")
    async def authenticate(request: Request, call_next) -> Response:
        decision = decide_request_auth(
            method=request.method,
            path=request.url.path,
            authorization_header=request.headers.get("Authorization"),
            api_key=config.api_key,
            admin_api_key=config.admin_api_key,
            auth_level=ENDPOINT_AUTH_LEVELS.get(request.url.path, AuthLevel.NORMAL),
        )
        if not decision.allowed:
            return JSONResponse(auth_error_body(decision), decision.error_status_code)
        return await call_next(request)

    def error(message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=400)

    def result(success: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": success, "message": message}, 200 if success else 400)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        # SGLang's health generation cannot run while paused: wait for a resume, then 503.
        deadline = time.monotonic() + config.health_check_timeout_s
        while state.scheduler.paused:
            if time.monotonic() >= deadline:
                return Response(status_code=503)
            await asyncio.sleep(min(0.05, config.health_check_timeout_s))
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=503 if state.scheduler.paused else 200)

    @app.get("/model_info")
    async def model_info() -> dict:
        return state.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        return state.server_info()

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            body = await request.json()
            requests, is_batch = state.parse_generate(body)
        except (ValueError, TypeError, AttributeError) as e:
            return error(f"invalid /generate request: {e}")
        futures = state.scheduler.submit(requests)
        try:
            chunks = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except Exception as e:  # the engine failed; the log has the traceback
            return JSONResponse({"error": {"message": f"generation failed: {e!r}"}}, 500)
        rendered = state.render_all(body, requests, chunks)
        return JSONResponse(rendered if is_batch else rendered[0])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if state.scheduler.busy():
            return PlainTextResponse(FLUSH_FAILED, status_code=400)
        return PlainTextResponse(FLUSH_OK)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        mode = (await _json_or_empty(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            return error(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await asyncio.to_thread(state.scheduler.pause, mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        state.scheduler.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Response:
        return result(*await asyncio.to_thread(state.init_group, await request.json()))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Response:
        return result(*await asyncio.to_thread(state.destroy_group, await request.json()))

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> Response:
        selector = (await _json_or_empty(request)).get("selector", "all")
        if selector not in SELECTORS:
            return error(f"selector must be one of {SELECTORS}, got {selector!r}")
        return result(*await state.set_session(selector))

    @app.post("/end_weight_update")
    async def end_weight_update() -> Response:
        return result(*await state.set_session(None))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Response:
        return result(*await state.serve_update(await request.json()))

    return app


async def _json_or_empty(request: Request) -> dict[str, Any]:
    raw = await request.body()
    return {} if not raw else await request.json()


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    """Parse SGLang-style flags into a ServerConfig."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--random-seed", type=int, default=None, help="default: a random seed")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--dist-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-api-key", default=None)
    p.add_argument("--config", default=None, help="YAML with api-key / admin-api-key")
    a = p.parse_args(argv)
    if a.config is not None:  # the trainer's rule for key files (mode 0600, key names)
        keys = load_server_keys(a.config)
        for key in ("api_key", "admin_api_key"):
            if getattr(a, key) is None:  # a flag given on the command line wins
                setattr(a, key, getattr(keys, key))
    seed = a.random_seed if a.random_seed is not None else secrets.randbelow(2**31)
    return ServerConfig(
        model_path=a.model_path,
        host=a.host,
        port=a.port,
        random_seed=seed,
        dtype=a.dtype,
        enable_return_routed_experts=a.enable_return_routed_experts,
        max_running_requests=a.max_running_requests,
        dist_timeout_s=a.dist_timeout,
        api_key=a.api_key,
        admin_api_key=a.admin_api_key,
        health_check_timeout_s=float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20)),
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if argv is None:  # the server process itself: its threads (the wait policy is inherited)
        from megatron_sat.platform.threads import configure_threads

        configure_threads()
    config = parse_args(argv)
    # Before the model loads: a trainer killed meanwhile must not leave this server behind.
    _exit_with_parent()
    start = time.perf_counter()
    state = ServerState(config)
    logger.info(
        "loaded %s in %.1f s (seed %d)",
        config.model_path,
        time.perf_counter() - start,
        config.random_seed,
    )
    uvicorn.run(create_app(state), host=config.host, port=config.port, log_level="warning")


SERVER_CRASH_AT_ENV = "MEGATRON_SAT_SERVER_CRASH_AT"
_decode_steps = 0


def _crash_hook() -> None:
    """Crash tests only: ``MEGATRON_SAT_SERVER_CRASH_AT=<n>:<marker>`` SIGKILLs this server
    at its ``n``-th decode step (mid-generation), once per marker file: the first server to
    get there creates the marker, so its restarted successor (same environment) runs on."""
    global _decode_steps
    spec = os.environ.get(SERVER_CRASH_AT_ENV)
    if not spec:
        return
    _decode_steps += 1
    steps, _, marker = spec.partition(":")
    if _decode_steps == int(steps):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def _exit_with_parent(poll_s: float = 2.0) -> None:
    """End this server when the process that started it dies, also by SIGKILL (it runs in
    its own session, so no terminal signal reaches it): the parent-death signal and a poll of
    the parent pid (``platform.lifetime.end_with_parent``; ``EmbeddedServer`` passes the
    parent's pid)."""
    from megatron_sat.platform.lifetime import end_with_parent

    def log(parent: int) -> None:
        logger.warning("parent process %d exited; shutting down", parent)

    end_with_parent(poll_s, on_exit=log)


if __name__ == "__main__":
    main()
