"""Asynchronous rollout pool: servers generate continuously while the trainer steps.

Every prompt group belongs to a batch ``b`` (the trainer consumes batch ``b`` at trainer version
``b``: one optimizer step per batch). Staleness control is admission control, one rule for
every mode (AReaL, Fu et al., arXiv 2505.24298, Sec. 5.1): a group of batch ``b`` may start only
once the servers hold version ``>= b - lag``. With FIFO consumption by batch index, a sample's
age (trainer version minus the oldest version that produced one of its tokens, see
:func:`~megatron_sat.rollout.types.staleness`) is then at most ``lag``.

- ``fixed_lag`` (the SAT paper's configured lag n): in addition the trainer does not push
  version ``v`` until every batch ``b <= v - 1 + lag`` has finished, so each batch is generated
  by exactly version ``b - lag`` and every sample's age equals ``lag`` after warm-up
  (batches ``b < lag`` come from version 0).
- ``bounded`` (maximum staleness eta = ``lag``): weight pushes never wait; requests in flight
  during a push are either resumed from their partial output (each token keeps the version that
  produced it) or restarted from the prompt (``on_update``).

Resilience: a request whose server fails (connection error, timeout, HTTP error) is re-issued on
another live server; the failed server is marked dead and reported. A group is delivered once,
when all its samples are complete.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from megatron_sat.rollout.client import GenerateOutput, SamplingParams, SGLangClient, SGLangError
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.pool import RewardFn, parse_weight_version
from megatron_sat.rollout.types import Sample

MODES = ("fixed_lag", "bounded")
ON_UPDATE = ("resume", "restart")


@dataclass(frozen=True)
class AsyncPoolConfig:
    """Asynchronous generation.

    Attributes:
        mode: ``fixed_lag`` or ``bounded`` (see the module docstring).
        lag: the fixed lag n, or the staleness bound eta, in versions (>= 0).
        prompts_per_batch: prompt groups per trainer batch.
        group_size: samples per prompt.
        on_update: what happens to a request aborted by a weight push (bounded mode).
    """

    mode: str = "fixed_lag"
    lag: int = 1
    prompts_per_batch: int = 32
    group_size: int = 8
    on_update: str = "resume"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"async_pool.mode must be one of {MODES}, got {self.mode!r}")
        if self.on_update not in ON_UPDATE:
            raise ValueError(f"async_pool.on_update must be one of {ON_UPDATE}")
        if self.lag < 0:
            raise ValueError(f"async_pool.lag must be >= 0, got {self.lag}")
        if self.prompts_per_batch < 1 or self.group_size < 1:
            raise ValueError("async_pool.prompts_per_batch and group_size must be >= 1")


@dataclass
class _Job:
    """One sample in progress (one request; re-issued or resumed as needed)."""

    batch: int
    group: int
    slot: int
    record: PromptRecord
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    attempts: int = 0


@dataclass
class PoolStats:
    """Counters since start: re-issued requests, resumed/restarted requests, dead servers,
    samples generated per server."""

    reissued: int = 0
    resumed: int = 0
    restarted: int = 0
    dead_servers: list[str] = field(default_factory=list)
    samples_per_server: dict[str, int] = field(default_factory=dict)


class AsyncRolloutPool:
    """Background generation over N servers with version-bounded admission.

    Args:
        clients: one client per server.
        tokenizer: HF tokenizer (encode prompts, decode responses).
        reward_fn: ``reward_fn(response_text, label) -> float``.
        prompts: endless iterator of prompt records (consumed in order).
        config: staleness mode and batch shape.
        sampling: sampling parameters of every request.
        routing: routing spec for R3 payloads, or None.
        max_attempts: attempts of one request over all servers before the pool fails.
    """

    def __init__(
        self,
        clients: Sequence[SGLangClient],
        tokenizer,
        reward_fn: RewardFn,
        prompts: Iterator[PromptRecord],
        config: AsyncPoolConfig,
        sampling: SamplingParams,
        *,
        routing=None,
        max_attempts: int = 5,
    ) -> None:
        self.clients = list(clients)
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.prompts = prompts
        self.config = config
        self.sampling = sampling
        self.routing = routing
        self.max_attempts = max_attempts
        self.stats = PoolStats(samples_per_server={c.base_url: 0 for c in self.clients})
        self._cond = threading.Condition()
        self._version = 0
        self._next_batch = 0  # next batch to admit
        self._queue: deque[_Job] = deque()
        self._done: dict[int, dict[int, list[Sample | None]]] = {}  # batch -> group -> slots
        self._pending: dict[int, int] = {}  # batch -> unfinished samples
        self._next_index = 0
        self._error: BaseException | None = None
        self._stopped = False
        self._alive = set(range(len(self.clients)))
        self._threads = [
            threading.Thread(target=self._worker, args=(i,), name=f"rollout{i}", daemon=True)
            for i in range(len(self.clients))
        ]

    # -- trainer side ------------------------------------------------------------------------
    def start(self) -> None:
        """Admit what the current version allows and start one worker per server."""
        with self._cond:
            self._admit()
        for thread in self._threads:
            thread.start()

    def get_batch(self, batch: int, timeout_s: float | None = None) -> list[Sample]:
        """Block until batch ``batch`` is complete; its samples, groups contiguous in order.

        Raises:
            RuntimeError: when the pool failed (the cause chained) or the wait timed out.
        """
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._error is not None or self._pending.get(batch) == 0, timeout_s
            )
            self._raise_if_failed()
            if not ok:
                raise RuntimeError(f"batch {batch} not complete after {timeout_s} s")
            groups = self._done.pop(batch)
            del self._pending[batch]
        return [s for g in sorted(groups) for s in groups[g]]

    def wait_before_update(self, new_version: int, timeout_s: float | None = None) -> None:
        """In fixed-lag mode, block until every batch generated by version ``new_version - 1``
        has finished (so no batch straddles two versions); a no-op in bounded mode."""
        if self.config.mode != "fixed_lag":
            return
        last = new_version - 1 + self.config.lag
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self._error is not None
                    or all(self._pending.get(b, 0) == 0 for b in range(last + 1))
                ),
                timeout_s,
            )
            self._raise_if_failed()
            if not ok:
                raise RuntimeError(f"batches up to {last} not generated after {timeout_s} s")

    def set_version(self, version: int) -> None:
        """The servers now hold ``version``: admit the batches it allows."""
        with self._cond:
            self._version = version
            self._admit()
            self._cond.notify_all()

    def stop(self) -> None:
        """Stop the workers after their current request (servers are left running)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=60)

    # -- internals ---------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the rollout pool failed") from self._error

    def _admit(self) -> None:
        """Queue every batch ``b`` with ``b - lag <= version`` (caller holds the lock)."""
        cfg = self.config
        while self._next_batch - cfg.lag <= self._version:
            b = self._next_batch
            self._next_batch += 1
            self._done[b] = {}
            self._pending[b] = cfg.prompts_per_batch * cfg.group_size
            for g in range(cfg.prompts_per_batch):
                record = next(self.prompts)
                group = b * cfg.prompts_per_batch + g
                self._done[b][group] = [None] * cfg.group_size
                ids = self.tokenizer.encode(record.prompt)
                for slot in range(cfg.group_size):
                    self._queue.append(_Job(b, group, slot, record, ids))
        self._cond.notify_all()

    def _worker(self, server: int) -> None:
        client = self.clients[server]
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._queue or self._error)
                if self._stopped or self._error is not None:
                    return
                # A server's share of the queue, at most one batch, in one batched request.
                share = max(1, len(self._queue) // max(1, len(self._alive)))
                share = min(share, self.config.prompts_per_batch * self.config.group_size)
                jobs = [self._queue.popleft() for _ in range(min(share, len(self._queue)))]
            try:
                outputs = client.generate(
                    [j.prompt_ids + j.response_ids for j in jobs],
                    self._sampling_for(jobs),
                    routing=self.routing,
                )
            except (SGLangError, OSError) as e:
                self._server_failed(server, jobs, e)
                return
            self._finish(server, jobs, outputs)

    def _sampling_for(self, jobs: list[_Job]) -> SamplingParams:
        done = max(len(j.response_ids) for j in jobs)
        if done == 0:
            return self.sampling
        # Resumed requests continue up to the original length limit.
        left = max(1, self.sampling.max_new_tokens - done)
        return SamplingParams(**{**self.sampling.__dict__, "max_new_tokens": left})

    def _server_failed(self, server: int, jobs: list[_Job], error: Exception) -> None:
        with self._cond:
            self._alive.discard(server)
            self.stats.dead_servers.append(self.clients[server].base_url)
            for job in reversed(jobs):
                job.attempts += 1
                if job.attempts >= self.max_attempts or not self._alive:
                    self._error = RuntimeError(
                        f"sample of group {job.group} failed {job.attempts} times; last server "
                        f"{self.clients[server].base_url}: {error}; live servers: "
                        f"{[self.clients[i].base_url for i in sorted(self._alive)]}"
                    )
                self._queue.appendleft(job)
                self.stats.reissued += 1
            self._cond.notify_all()

    def _finish(self, server: int, jobs: list[_Job], outputs: list[GenerateOutput]) -> None:
        url = self.clients[server].base_url
        finished: list[tuple[_Job, GenerateOutput]] = []
        requeue: list[_Job] = []
        for job, out in zip(jobs, outputs, strict=True):
            version = parse_weight_version(out.weight_version, url)
            if out.finish_reason == "abort":
                if self.config.on_update == "resume":
                    job.response_ids += out.output_ids
                    job.log_probs += out.output_token_logprobs
                    job.versions += [version] * len(out.output_ids)
                    self.stats.resumed += 1
                else:
                    job.response_ids, job.log_probs, job.versions = [], [], []
                    self.stats.restarted += 1
                requeue.append(job)
                continue
            job.response_ids += out.output_ids
            job.log_probs += out.output_token_logprobs
            job.versions += [version] * len(out.output_ids)
            finished.append((job, out))
        samples = [(job, self._to_sample(job, out)) for job, out in finished]
        with self._cond:
            self._queue.extendleft(reversed(requeue))
            for job, sample in samples:
                sample.index = self._next_index
                self._next_index += 1
                self._done[job.batch][job.group][job.slot] = sample
                self._pending[job.batch] -= 1
            self.stats.samples_per_server[url] += len(samples)
            self._cond.notify_all()

    def _to_sample(self, job: _Job, out: GenerateOutput) -> Sample:
        text = self.tokenizer.decode(job.response_ids, skip_special_tokens=True)
        return Sample(
            index=-1,
            group_index=job.group,
            prompt=job.record.prompt,
            label=job.record.label,
            prompt_ids=list(job.prompt_ids),
            response_ids=list(job.response_ids),
            rollout_log_probs=list(job.log_probs),
            response_versions=list(job.versions),
            routed_experts=out.routed_experts,
            finish_reason=out.finish_reason,
            reward=float(self.reward_fn(text, job.record.label)),
            response_text=text,
        )
