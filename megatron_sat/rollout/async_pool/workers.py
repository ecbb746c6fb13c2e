"""Per-server workers: each takes its share of the queue, sends it, and delivers or re-queues
the jobs after the outcome (request, take, finish); a failed server is marked dead and its jobs
re-issued elsewhere (see the package docstring)."""

from __future__ import annotations

import copy
import threading

from megatron_sat.rollout.async_pool.core import PoolCore, _Job
from megatron_sat.rollout.client import (
    GenerateOutput,
    SamplingParams,
    SGLangClient,
    SGLangError,
    SGLangRequestError,
)
from megatron_sat.rollout.pool import refused_prompts, submit_reward, token_versions
from megatron_sat.rollout.reward_plugins import RewardResult, as_reward_result
from megatron_sat.rollout.types import Sample


class Workers(PoolCore):
    """The request path of ``AsyncRolloutPool``, shared by the workers and the logical
    clock's rounds."""

    def _spawn_worker(self, server: int) -> None:
        """Start the workers of slot ``server`` at its current generation (caller holds the
        lock): one, or ``max_in_flight_per_server`` with per-request dispatch."""
        count = self.config.max_in_flight_per_server if self.config.dispatch == "per_request" else 1
        for k in range(count):
            thread = threading.Thread(
                target=self._worker,
                args=(server, self._generation[server]),
                name=f"rollout{server}.{self._generation[server]}.{k}",
                daemon=True,
            )
            self._threads.append(thread)
            thread.start()

    def _worker(self, server: int, generation: int) -> None:
        def retired() -> bool:
            return self._generation[server] != generation

        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopped or self._queue or self._error is not None or retired()
                )
                if self._stopped or self._error is not None or retired():
                    return
                client = self.clients[server]
                # A server's share of the queue, at most one batch, in one batched request;
                # per request: one sample.
                share = max(1, len(self._queue) // max(1, len(self._alive)))
                share = min(share, self.config.prompts_per_batch * self.config.group_size)
                share = 1 if self.config.dispatch == "per_request" else share
                jobs = [self._queue.popleft() for _ in range(min(share, len(self._queue)))]
            outcome = self._request(server, client, jobs)
            if not self._take(server, generation, client, jobs, outcome):
                return

    def _request(
        self, server: int, client: SGLangClient, jobs: list[_Job]
    ) -> list[GenerateOutput] | BaseException:
        """One batched /generate of ``jobs`` to ``client`` (metered): its outputs, or what it
        raised."""
        # SGLang's replies go to the pool's parser processes; the vLLM client parses its own.
        parse = {"reply_parser": self._reply_parser} if isinstance(client, SGLangClient) else {}
        self.meter.begin(server)
        try:
            return client.generate(
                [j.prompt_ids + j.response_ids for j in jobs],
                self._sampling_for(jobs),
                routing=self.routing,
                **parse,
            )
        except BaseException as e:
            self.meter.end(server, failed=True)
            return e

    def _take(
        self,
        server: int,
        generation: int,
        client: SGLangClient,
        jobs: list[_Job],
        outcome: list[GenerateOutput] | BaseException,
    ) -> bool:
        """Deliver or re-queue ``jobs`` after their request's ``outcome``; False when the
        slot's worker must end (its server failed, or the pool did)."""
        if isinstance(outcome, SGLangRequestError):
            # The request is at fault, not the server (e.g. a prompt beyond the context):
            # fail the run naming it rather than condemn every server in turn.
            sent = [j.record for j in jobs]
            self._fail(
                jobs,
                SGLangRequestError(
                    f"{client.base_url} refused {refused_prompts(outcome, sent)}: {outcome}",
                    outcome.status_code,
                ),
            )
            return False
        if isinstance(outcome, (SGLangError, OSError)):
            self._server_failed(server, generation, client, jobs, outcome)
            return False
        if isinstance(outcome, BaseException):
            self._fail(jobs, outcome)
            return False
        try:
            self._finish(server, client, jobs, outcome)
        except BaseException as e:
            # E.g. a server without an integer weight_version: fail the run loudly rather
            # than let this thread die with its jobs (the trainer would wait forever).
            self._fail([], e)
            return False
        return True

    def _sampling_for(self, jobs: list[_Job]) -> SamplingParams | list[SamplingParams]:
        if self.seed_of is not None:  # one per request: each carries its own seed
            return [
                SamplingParams(
                    **{
                        **self.sampling.__dict__,
                        "max_new_tokens": self._budget(j),
                        "sampling_seed": j.seed,
                    }
                )
                for j in jobs
            ]
        done = max(len(j.response_ids) for j in jobs)
        if done == 0:
            return self.sampling
        # Resumed requests continue up to the original length limit.
        left = max(1, self.sampling.max_new_tokens - done)
        return SamplingParams(**{**self.sampling.__dict__, "max_new_tokens": left})

    def _budget(self, job: _Job) -> int:
        """``max_new_tokens`` of ``job``'s next request (seeded): up to the original length
        limit (a resumed request continues), and on the logical clock at most a round's
        ``clock_tokens``."""
        left = self.sampling.max_new_tokens - len(job.response_ids)
        left = max(1, left) if job.response_ids else self.sampling.max_new_tokens
        return min(left, self.config.clock_tokens) if self.config.clock_tokens else left

    def _server_failed(
        self,
        server: int,
        generation: int,
        client: SGLangClient,
        jobs: list[_Job],
        error: Exception,
    ) -> None:
        with self._cond:
            # A retired worker's failure is the old server's: the slot may already serve a
            # new one, which must stay alive. Its jobs are re-queued either way.
            if self._generation[server] == generation and server in self._alive:
                self._alive.discard(server)
                self._generation[server] += 1  # the slot's other workers (per_request) retire
                self.stats.dead_servers.append(client.base_url)
            for job in reversed(jobs):
                job.attempts += 1
                if job.attempts >= self.max_attempts:
                    self._error = RuntimeError(
                        f"sample of group {job.group} failed {job.attempts} times; last server "
                        f"{client.base_url}: {error}; live servers: "
                        f"{[self.clients[i].base_url for i in sorted(self._alive)]}"
                    )
                self._queue.appendleft(job)
                self.stats.reissued += 1
            self._cond.notify_all()

    def _finish(
        self, server: int, client: SGLangClient, jobs: list[_Job], outputs: list[GenerateOutput]
    ) -> None:
        url = client.base_url
        finished: list[tuple[_Job, GenerateOutput]] = []
        requeue: list[_Job] = []
        try:
            for job, out in zip(jobs, outputs, strict=True):
                # Per token: an engine reporting per-token versions (vLLM's spans) keeps them;
                # the request's version is checked even for an empty output.
                versions = token_versions(out, url)
                # The end of a round (logical clock): the full budget came back, cut by the
                # round's length, not the sample's; it continues in a later round.
                cut = (
                    self.config.clock_tokens > 0
                    and out.finish_reason == "length"
                    and len(out.output_ids) == self._budget(job)
                    and len(job.response_ids) + len(out.output_ids) < self.sampling.max_new_tokens
                )
                if cut:
                    job.response_ids += out.output_ids
                    job.log_probs += out.output_token_logprobs
                    job.versions += versions
                    requeue.append(job)
                    continue
                if out.finish_reason == "abort":
                    if self.config.on_update == "resume":
                        job.response_ids += out.output_ids
                        job.log_probs += out.output_token_logprobs
                        job.versions += versions
                        self.stats.resumed += 1
                    else:
                        job.response_ids, job.log_probs, job.versions = [], [], []
                        self.stats.restarted += 1
                    requeue.append(job)
                    continue
                job.response_ids += out.output_ids
                job.log_probs += out.output_token_logprobs
                job.versions += versions
                finished.append((job, out))
        finally:
            # Before the samples are published, so a snapshot taken once the trainer has them
            # includes this request's busy time.
            self.meter.end(
                server,
                samples=len(finished),
                tokens=sum(len(out.output_ids) for out in outputs),
            )
        # Scored concurrently (reward workers or threads), then published together.
        texts = [
            self.tokenizer.decode(job.response_ids, skip_special_tokens=True) for job, _ in finished
        ]
        rewards = [
            submit_reward(self.reward_fn, self._reward_executor, text, job.record)
            for text, (job, _) in zip(texts, finished, strict=True)
        ]
        samples = [
            (job, self._to_sample(job, out, text, reward.result()))
            for (job, out), text, reward in zip(finished, texts, rewards, strict=True)
        ]
        with self._cond:
            self._queue.extendleft(reversed(requeue))
            for job, sample in samples:
                sample.index = self._next_index
                self._next_index += 1
                self._done[job.batch][job.group][job.slot] = sample
                self._pending[job.batch] -= 1
            if self.config.filter_groups:
                for batch, group in {(job.batch, job.group) for job, _ in samples}:
                    self._filter(batch, group)
            per_url = self.stats.samples_per_server
            per_url[url] = per_url.get(url, 0) + len(samples)
            self._cond.notify_all()

    def _to_sample(
        self, job: _Job, out: GenerateOutput, text: str, reward: float | RewardResult
    ) -> Sample:
        result = as_reward_result(reward)
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
            reward=result.score,
            response_text=text,
            reward_metrics=result.metrics,
            # A copy per sample: a reward plug-in that edits its sample's metadata must not
            # change the group's other samples or the prompt's later draws.
            metadata=copy.deepcopy(job.record.metadata),
        )
