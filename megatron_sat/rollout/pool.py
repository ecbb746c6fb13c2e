"""Rollout pool: turns prompts into groups of scored samples through N rollout servers.

Each sample carries the policy version that produced its tokens, taken from the server's
``meta_info.weight_version`` (which the trainer sets on every weight sync), never from a local
counter. This version generates synchronously, one batch per trainer step, with prompts spread
over the servers in parallel; the configured lag comes from how often the trainer syncs.

Resilience: a server whose request fails (connection error, timeout, HTTP error) is marked dead
and reported (``stats``, ``down_servers``), and its share of the call is re-issued on the live
servers, so one call still returns every sample exactly once. The pool never sends a dead
server anything again until its slot is revived with ``replace_server`` (the owner of the
servers restarts and re-syncs it first, see ``rollout.fleet``). When no live server remains the
call raises :class:`NoLiveServer` and returns nothing: the caller retries the same prompts once
a server is back.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from megatron_sat.objectives.advantages import informative_groups
from megatron_sat.rollout.client import (
    GenerateOutput,
    RoutingSpec,
    SamplingParams,
    SGLangClient,
    SGLangError,
    SGLangRequestError,
)
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.meter import ServerMeter
from megatron_sat.rollout.reward_plugins import RewardResult, as_reward_result
from megatron_sat.rollout.types import Sample

RewardFn = Callable[[str, str], float]
# How a pool sends its requests: one /generate per sample to the least loaded live server,
# collected as they finish ("per_request"), or one batched /generate per server for its whole
# share ("per_server", deterministic server batches: see RolloutPool).
DISPATCH = ("per_request", "per_server")


def submit_reward(
    reward_fn: RewardFn, executor: ThreadPoolExecutor, text: str, record: PromptRecord
) -> Future:
    """``reward_fn(text, record.label)`` started concurrently: through its own ``submit`` when
    it has one (``rollout.rewards.RewardWorkers``: worker processes, timeouts on;
    ``rollout.remote_reward.RemoteReward``), which also gets the prompt and metadata, else on
    ``executor``'s threads. The future resolves to the reward (a float or a
    ``reward_plugins.RewardResult``)."""
    submit = getattr(reward_fn, "submit", None)
    if submit is not None:
        return submit(text, record.label, record.prompt, record.metadata)
    return executor.submit(reward_fn, text, record.label)


class NoLiveServer(SGLangError):
    """Every server slot of a pool is dead; the work that needed one is kept (asynchronous
    pool) or was not returned (synchronous pool) and can be retried after ``replace_server``."""


@dataclass
class FailureStats:
    """Failures since the pool was built.

    Attributes:
        reissued: samples re-issued on another server after their server failed.
        dead_servers: URL of each server marked dead, in the order they were found.
        replaced: slots revived by ``replace_server``.
    """

    reissued: int = 0
    dead_servers: list[str] = field(default_factory=list)
    replaced: int = 0


def parse_weight_version(version: str, server: str) -> int:
    """The integer policy version of a server's ``weight_version`` string.

    Raises:
        ValueError: naming the server when the version is not an integer (e.g. SGLang's
            ``"default"``: start servers with ``--weight-version 0``).
    """
    try:
        return int(version)
    except (TypeError, ValueError):
        raise ValueError(
            f"server {server} reports weight_version={version!r}, not an integer policy "
            "version; start it with --weight-version 0"
        ) from None


def token_versions(out: GenerateOutput, server: str) -> list[int]:
    """The integer policy version of each output token of ``out`` (``GenerateOutput``'s
    ``token_versions``, each parsed by :func:`parse_weight_version`): each distinct version
    string parsed once, in order of first appearance (so the first bad one is named, as a
    per-token parse would name it), then looked up per token. The request's
    ``weight_version`` is parsed too, even for an output without tokens.

    Raises:
        ValueError: as :func:`parse_weight_version`, or from ``token_versions``.
    """
    parse_weight_version(out.weight_version, server)
    versions = out.token_versions()
    number = {v: parse_weight_version(v, server) for v in dict.fromkeys(versions)}
    if len(number) == 1:
        return [next(iter(number.values()))] * len(versions)
    return [number[v] for v in versions]


class RolloutPool:
    """Generates G samples per prompt on a set of SGLang-compatible servers and scores them.

    Args:
        clients: one client per server; prompts are split evenly among them.
        tokenizer: encodes prompts, decodes responses (HF tokenizer).
        reward_fn: ``reward_fn(response_text, label) -> float``, or an object whose
            ``submit(response_text, label, prompt, metadata)`` returns a future of the reward
            (``rollout.reward_choice.open_reward``'s); see ``pool.submit_reward``.
        routing: shape of the served model's routing; when given, routed experts are requested
            and attached to every sample (R3).
        stop_token_ids: stop tokens besides the model's eos.
        meter: per-server request accounting, shared with other pools over the same servers;
            default a new one.
        dispatch: ``per_request``: one ``/generate`` per sample, each sent to the live server
            with the fewest requests in flight (at most ``max_in_flight_per_server``) and
            collected as it finishes, so a long response holds only itself and its reward is
            computed while the others still generate. ``per_server``: one batched
            ``/generate`` per server for its whole share (the server's batches are then the
            same every run; the embedded engine is not batch-invariant, so only this keeps
            its seeded runs bit-identical). Either way the samples come back in (prompt,
            sample) order, whatever order they finished in.
        max_in_flight_per_server: ``per_request`` requests in flight per server at most (>= 1).

    Raises:
        ValueError: without clients, for a meter of another server count, an unknown
            ``dispatch`` or ``max_in_flight_per_server`` < 1.
    """

    def __init__(
        self,
        clients: Sequence[SGLangClient],
        tokenizer,
        reward_fn: RewardFn,
        *,
        routing: RoutingSpec | None,
        stop_token_ids: Sequence[int] = (),
        meter: ServerMeter | None = None,
        dispatch: str = "per_server",
        max_in_flight_per_server: int = 256,
    ) -> None:
        if not clients:
            raise ValueError("the rollout pool needs at least one server")
        if dispatch not in DISPATCH:
            raise ValueError(f"dispatch must be one of {DISPATCH}, got {dispatch!r}")
        if max_in_flight_per_server < 1:
            raise ValueError(
                f"max_in_flight_per_server must be >= 1, got {max_in_flight_per_server}"
            )
        self.dispatch = dispatch
        self.max_in_flight_per_server = max_in_flight_per_server
        # Request index (record * group_size + sample) of each sample of the last
        # generate_groups, in the order its response arrived (per_server: its server's share).
        self.last_arrival_order: list[int] = []
        self.meter = meter or ServerMeter(len(clients))
        if self.meter.num_servers != len(clients):
            raise ValueError(f"meter of {self.meter.num_servers} servers for {len(clients)}")
        self.clients = list(clients)
        self.stats = FailureStats()
        self._alive = set(range(len(self.clients)))
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.routing = routing
        self.stop_token_ids = tuple(stop_token_ids)
        self._next_index = itertools.count()
        self._next_group = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=len(self.clients))
        self._request_executor = ThreadPoolExecutor(  # per_request: one thread per request
            max_workers=len(self.clients) * max_in_flight_per_server,
            thread_name_prefix="rollout-request",
        )
        self._reward_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")

    def close(self) -> None:
        """Stop the worker threads (the servers are not touched)."""
        self._executor.shutdown(wait=True)
        self._request_executor.shutdown(wait=True)
        self._reward_executor.shutdown(wait=True)

    def down_servers(self) -> set[int]:
        """Indices of the server slots marked dead and not replaced since."""
        return set(range(len(self.clients))) - self._alive

    def mark_dead(self, index: int) -> None:
        """Send server ``index`` nothing more (e.g. its owner found it dead); reported in
        ``stats.dead_servers``. A no-op for a slot already dead."""
        if index in self._alive:
            self._alive.discard(index)
            self.stats.dead_servers.append(self.clients[index].base_url)

    def replace_server(self, index: int, client: SGLangClient) -> None:
        """Serve slot ``index`` from ``client`` from the next call on.

        The caller must have pushed the current weights and weight_version to the new server
        first: the pool sends it requests as soon as this returns.

        Raises:
            IndexError: for an index outside the pool.
        """
        if not 0 <= index < len(self.clients):
            raise IndexError(f"server index {index} outside 0..{len(self.clients) - 1}")
        self.clients[index] = client
        self._alive.add(index)
        self.stats.replaced += 1

    def generate_groups(
        self,
        records: Sequence[PromptRecord],
        group_size: int,
        *,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = -1,
        max_new_tokens: int | Sequence[int],
        with_routing: bool = True,
        seed_of: Callable[[int, int], int] | None = None,
    ) -> list[Sample]:
        """``group_size`` scored samples per record, grouped contiguously in record order.

        ``max_new_tokens``: one limit for all, or one per record.

        ``seed_of(record_index, sample_index)`` (indices within this call), when given, is
        each request's ``sampling_seed`` (``rollout.seeds``): the samples then do not depend
        on the servers' generators, which server serves them, or a re-issue.

        A server that fails is marked dead and its requests are re-issued on the live ones.

        Raises:
            NoLiveServer: when every server is dead (naming each failure); nothing is returned
                and no sample index or group id is used up, so the caller can retry.
            ValueError: for a non-integer weight version.
        """
        limits = [max_new_tokens] * len(records) if isinstance(max_new_tokens, int) else None
        limits = list(max_new_tokens) if limits is None else limits
        if len(limits) != len(records):
            raise ValueError(f"{len(limits)} max_new_tokens for {len(records)} records")
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=limits[0] if limits else 0,
            stop_token_ids=self.stop_token_ids,
        )
        prompts = [self.tokenizer.encode(r.prompt) for r in records]
        requests = [(g, ids) for g, ids in enumerate(prompts) for _ in range(group_size)]
        routing = self.routing if with_routing else None
        per_request = None
        if seed_of is not None or len(set(limits)) > 1:
            per_request = [
                dataclasses.replace(
                    sampling,
                    max_new_tokens=limits[g],
                    sampling_seed=None if seed_of is None else seed_of(g, k),
                )
                for g in range(len(prompts))
                for k in range(group_size)
            ]

        self.last_arrival_order = []
        rewards: dict[int, Future] = {}

        def score(i: int, out: GenerateOutput, url: str) -> None:
            text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
            record = records[requests[i][0]]
            rewards[i] = submit_reward(self.reward_fn, self._reward_executor, text, record)

        if self.dispatch == "per_request":
            results = self._generate_per_request(
                records, requests, sampling, per_request, routing, score
            )
        else:
            results = self._generate_per_server(records, requests, sampling, per_request, routing)
            for i in sorted(results):
                score(i, *results[i])
        group_ids = [next(self._next_group) for _ in records]
        return [
            self._to_sample(records[g], group_ids[g], ids, *results[i], rewards[i].result())
            for i, (g, ids) in enumerate(requests)
        ]

    def _generate_per_server(
        self,
        records: Sequence[PromptRecord],
        requests: list[tuple[int, list[int]]],
        sampling: SamplingParams,
        per_request: list[SamplingParams] | None,
        routing: RoutingSpec | None,
    ) -> dict[int, tuple[GenerateOutput, str]]:
        """``dispatch="per_server"``: each live server's share in one batched request."""

        def run(server: int, client: SGLangClient, shard: list[int]) -> list[GenerateOutput]:
            params = sampling if per_request is None else [per_request[i] for i in shard]
            prompts = [requests[i][1] for i in shard]
            return self._send(server, client, prompts, params, routing, batched=True)

        results: dict[int, tuple[GenerateOutput, str]] = {}
        todo = list(range(len(requests)))
        errors: list[str] = []
        while todo:
            alive = sorted(self._alive)
            if not alive:
                raise self._no_live_server(len(todo), len(requests), errors)
            shards = [(s, self.clients[s], todo[k :: len(alive)]) for k, s in enumerate(alive)]
            shards = [shard for shard in shards if shard[2]]
            futures = [self._executor.submit(run, *shard) for shard in shards]
            todo = []
            for (server, client, shard), future in zip(shards, futures, strict=True):
                try:
                    outputs = future.result()
                except SGLangRequestError as e:
                    # The request is at fault, not the server: another server would refuse it
                    # too, and marking this one dead would condemn a healthy server.
                    sent = [records[requests[i][0]] for i in shard]
                    raise self._refused(client, refused_prompts(e, sent), e) from e
                except (SGLangError, OSError) as e:
                    # Dead or timed out: stop using it and give its share to the others.
                    self._server_down(server, client, e, errors, len(shard))
                    todo += shard
                    continue
                for i, out in zip(shard, outputs, strict=True):
                    results[i] = (out, client.base_url)
                    self.last_arrival_order.append(i)
            todo.sort()
        return results

    def _generate_per_request(
        self,
        records: Sequence[PromptRecord],
        requests: list[tuple[int, list[int]]],
        sampling: SamplingParams,
        per_request: list[SamplingParams] | None,
        routing: RoutingSpec | None,
        on_output: Callable[[int, GenerateOutput, str], None],
    ) -> dict[int, tuple[GenerateOutput, str]]:
        """``dispatch="per_request"``: one request per sample to the live server with the
        fewest in flight; ``on_output(i, output, url)`` runs as each one arrives."""
        in_flight: dict[Future, tuple[int, int, SGLangClient]] = {}
        load = dict.fromkeys(range(len(self.clients)), 0)
        results: dict[int, tuple[GenerateOutput, str]] = {}
        todo = deque(range(len(requests)))
        errors: list[str] = []

        def run(server: int, client: SGLangClient, i: int) -> GenerateOutput:
            params = sampling if per_request is None else per_request[i]
            (out,) = self._send(server, client, requests[i][1], params, routing, batched=False)
            return out

        while todo or in_flight:
            alive = sorted(self._alive)
            if todo and not alive and not in_flight:
                raise self._no_live_server(len(todo), len(requests), errors)
            while todo and alive:
                server = min(alive, key=lambda k: (load[k], k))
                if load[server] >= self.max_in_flight_per_server:
                    break
                i = todo.popleft()
                client = self.clients[server]
                in_flight[self._request_executor.submit(run, server, client, i)] = (
                    i,
                    server,
                    client,
                )
                load[server] += 1
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            # Handled in request order, so what happens next does not depend on which of two
            # requests that finished together was seen first.
            for future in sorted(done, key=lambda f: in_flight[f][0]):
                i, server, client = in_flight.pop(future)
                load[server] -= 1
                try:
                    out = future.result()
                except SGLangRequestError as e:
                    # The request is at fault, not the server (see _generate_per_server).
                    what = "prompt " + prompt_summary([records[requests[i][0]]])
                    raise self._refused(client, what, e) from e
                except (SGLangError, OSError) as e:
                    self._server_down(server, client, e, errors, 1)
                    todo.appendleft(i)
                    continue
                results[i] = (out, client.base_url)
                self.last_arrival_order.append(i)
                on_output(i, out, client.base_url)
        return results

    def _send(
        self,
        server: int,
        client: SGLangClient,
        prompts: list[int] | list[list[int]],
        params: SamplingParams | list[SamplingParams],
        routing: RoutingSpec | None,
        *,
        batched: bool,
    ) -> list[GenerateOutput]:
        """One /generate of both dispatch modes, metered (a failure counted as one):
        ``batched``, a list of prompts (per server); else one prompt, whose one output is
        checked (per request). The outputs, in prompt order.

        Raises:
            what ``client.generate`` raises; ValueError for a single prompt not answered by
            exactly one output.
        """
        self.meter.begin(server)
        try:
            outputs = client.generate(prompts, params, routing=routing)
            if not batched:
                (_,) = outputs
        except BaseException:
            self.meter.end(server, failed=True)
            raise
        self.meter.end(
            server,
            samples=sum(o.finish_reason != "abort" for o in outputs),
            tokens=sum(len(o.output_ids) for o in outputs),
        )
        return outputs

    def _server_down(
        self, server: int, client: SGLangClient, error: Exception, errors: list[str], count: int
    ) -> None:
        """Server ``server`` failed (dead or timed out): send it nothing more; its ``count``
        requests are re-issued by the caller; ``error`` joins the call's failures."""
        errors.append(f"  {client.base_url}: {error}")
        self.mark_dead(server)
        self.stats.reissued += count

    @staticmethod
    def _refused(client: SGLangClient, what: str, error: SGLangRequestError) -> Exception:
        """The request is at fault, not the server (e.g. a prompt beyond the context): the
        error naming ``what`` was refused, to fail the call with rather than condemn every
        server in turn."""
        return SGLangRequestError(f"{client.base_url} refused {what}: {error}", error.status_code)

    @staticmethod
    def _no_live_server(left: int, total: int, errors: list[str]) -> NoLiveServer:
        return NoLiveServer(
            f"every rollout server is dead ({left} of {total} requests left); failures:\n"
            + "\n".join(errors)
        )

    def _to_sample(
        self,
        record: PromptRecord,
        group: int,
        prompt_ids: list[int],
        out: GenerateOutput,
        url: str,
        reward: float | RewardResult,
    ) -> Sample:
        # Per token: an engine reporting per-token versions (vLLM's spans) keeps them.
        versions = token_versions(out, url)  # refused even for an empty response
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        return Sample(
            index=next(self._next_index),
            group_index=group,
            prompt=record.prompt,
            label=record.label,
            prompt_ids=list(prompt_ids),
            response_ids=list(out.output_ids),
            rollout_log_probs=list(out.output_token_logprobs),
            response_versions=versions,
            routed_experts=out.routed_experts,
            finish_reason=out.finish_reason,
            reward=as_reward_result(reward).score,
            response_text=text,
            reward_metrics=as_reward_result(reward).metrics,
            # A copy per sample: a reward plug-in that edits its sample's metadata must not
            # change the group's other samples or the prompt's later draws.
            metadata=copy.deepcopy(record.metadata),
        )


def prompt_summary(records: Sequence[PromptRecord], limit: int = 3) -> str:
    """The first few prompts of a request by dataset row, for error messages."""
    shown = ", ".join(f"row {r.source_index} {r.prompt[:40]!r}" for r in records[:limit])
    return shown + (f" and {len(records) - limit} more" if len(records) > limit else "")


def refused_prompts(error: Exception, sent: Sequence[PromptRecord]) -> str:
    """The prompt a server refused in a batched request, when its message says which
    (``prompt <i>``, the embedded server's form); else the prompts of the request."""
    match = re.search(r"\bprompt (\d+)\b", str(error))
    if match and int(match[1]) < len(sent):
        return "prompt " + prompt_summary([sent[int(match[1])]])
    return f"a request of {len(sent)} prompts: " + prompt_summary(sent)


def informative_batch(
    generate: Callable[[list[PromptRecord]], list[Sample]],
    prompts: Iterator[PromptRecord],
    num_groups: int,
    group_size: int,
    max_replacements: int,
) -> tuple[list[Sample], int]:
    """A batch of ``num_groups`` groups in which groups of equal rewards were replaced.

    DAPO's dynamic sampling (Yu et al., arXiv 2503.14476, Eq. 11) for the synchronous loop:
    a group whose rewards are all equal has zero advantages and only dilutes the loss, so it is
    dropped and a group of the next prompt generated instead, at most ``max_replacements``
    times per batch; after that, groups are kept whatever their rewards.

    Args:
        generate: ``generate(records)`` -> ``group_size`` scored samples per record, grouped
            contiguously (e.g. ``RolloutPool.generate_groups`` with the sampling bound).
        prompts: where the first and every replacement prompt come from, in order.
        num_groups, group_size: the batch's shape.
        max_replacements: >= 0.

    Returns:
        (samples grouped contiguously, number of groups replaced).
    """
    kept: list[list[Sample]] = []
    replaced = 0
    records = [next(prompts) for _ in range(num_groups)]
    while records:
        samples = generate(records)
        groups = [samples[i : i + group_size] for i in range(0, len(samples), group_size)]
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        for group, informative in zip(
            groups, informative_groups(rewards, group_size).tolist(), strict=True
        ):
            if informative or replaced >= max_replacements:
                kept.append(group)
            else:
                replaced += 1
        records = [next(prompts) for _ in range(num_groups - len(kept))]
    return [s for group in kept for s in group], replaced
