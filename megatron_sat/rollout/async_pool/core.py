"""The asynchronous pool's shared parts: a sample in progress (``_Job``), the counters
(``PoolStats``) and the state every part reads (``PoolCore``), with the failure helpers."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from megatron_sat.rollout.async_pool.config import AsyncPoolConfig
from megatron_sat.rollout.client import SamplingParams, SGLangClient
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.meter import ServerMeter
from megatron_sat.rollout.pool import RewardFn
from megatron_sat.rollout.reply_parser import ReplyParser
from megatron_sat.rollout.types import Sample


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
    seed: int | None = None  # sampling_seed (rollout.seeds), kept when resumed or re-issued


@dataclass
class PoolStats:
    """Counters since start.

    Attributes:
        reissued: samples re-queued for another server after their server failed.
        resumed: requests aborted by a weight push and resumed from their partial output.
        restarted: requests aborted by a weight push and restarted from the prompt.
        dead_servers: URL of each server marked dead, in the order they were found.
        replaced: slots revived by ``replace_server``.
        samples_per_server: finished samples per server URL (a restarted server has a new URL;
            per-index counters are in the pool's ``meter``).
        filtered_groups: groups dropped for equal rewards and replaced (``filter_groups``), in
            the batches ``get_batch`` returned so far (so the count at a step does not depend
            on how far the servers are ahead).
    """

    reissued: int = 0
    resumed: int = 0
    restarted: int = 0
    dead_servers: list[str] = field(default_factory=list)
    replaced: int = 0
    samples_per_server: dict[str, int] = field(default_factory=dict)
    filtered_groups: int = 0


class PoolCore:
    """The state every part of the asynchronous pool shares, guarded by ``_cond``'s lock (set
    up by ``AsyncRolloutPool.__init__``), and the failure helpers all parts use."""

    config: AsyncPoolConfig
    clients: list[SGLangClient]
    tokenizer: Any
    reward_fn: RewardFn
    prompts: Iterator[PromptRecord]
    sampling: SamplingParams
    routing: Any
    max_attempts: int
    meter: ServerMeter
    seed_of: Callable[[int, int, int], int] | None
    stats: PoolStats
    _cond: threading.Condition
    _version: int
    _next_batch: int
    _queue: deque[_Job]
    _done: dict[int, dict[int, list[Sample | None]]]
    _pending: dict[int, int]
    _next_index: int
    _index_floor: int
    _next_group: int
    _replacements: dict[int, int]
    _drawn: int
    _first_draw: dict[int, int]
    _first_group: dict[int, int]
    _error: BaseException | None
    _stopped: bool
    _started: bool
    _alive: set[int]
    _generation: list[int]
    _threads: list[threading.Thread]
    _overlap_left: int
    _round_busy: bool
    _reward_executor: ThreadPoolExecutor
    _reply_parser: ReplyParser | None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the rollout pool failed") from self._error

    def _no_server_message(self, what: str) -> str:
        return (
            f"{what} incomplete and every rollout server is dead "
            f"({self.stats.dead_servers}); {len(self._queue)} samples stay queued"
        )

    def _fail(self, jobs: list[_Job], error: BaseException) -> None:
        """Fail the pool with ``error`` (its jobs back in the queue, for the record)."""
        with self._cond:
            self._queue.extendleft(reversed(jobs))
            if self._error is None:
                self._error = error
            self._cond.notify_all()
