"""The asynchronous rollout pool: the trainer's side (start, batches, versions, servers)
over its parts (admission, workers, clock, state; see the package docstring)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from megatron_sat.rollout.async_pool.admission import Admission
from megatron_sat.rollout.async_pool.clock import Clock
from megatron_sat.rollout.async_pool.config import AsyncPoolConfig
from megatron_sat.rollout.async_pool.core import PoolStats, _Job
from megatron_sat.rollout.async_pool.state import PoolState
from megatron_sat.rollout.client import SamplingParams, SGLangClient
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.meter import ServerMeter
from megatron_sat.rollout.pool import NoLiveServer, RewardFn
from megatron_sat.rollout.reply_parser import ReplyParser
from megatron_sat.rollout.types import Sample


class AsyncRolloutPool(Admission, Clock, PoolState):
    """Background generation over N servers with version-bounded admission.

    Args:
        clients: one client per server.
        tokenizer: HF tokenizer (encode prompts, decode responses).
        reward_fn: ``reward_fn(response_text, label) -> float``, or an object whose
            ``submit(response_text, label, prompt, metadata)`` returns a future of the reward
            (``rollout.reward_choice.open_reward``'s); see ``pool.submit_reward``.
        prompts: endless iterator of prompt records (consumed in order).
        config: staleness mode and batch shape.
        sampling: sampling parameters of every request.
        routing: routing spec for R3 payloads, or None.
        max_attempts: attempts of one request over all servers before the pool fails.
        meter: per-server request accounting, shared with other pools over the same servers;
            default a new one.
        seed_of: ``seed_of(batch, drawn, slot) -> int``, the ``sampling_seed`` of the request
            of sample ``slot`` of the prompt drawn ``drawn``-th (0-based) by this pool for
            ``batch``; None leaves sampling to the servers' generators. Seeded requests
            continue at their positions when resumed (SGLang's seeded sampling hashes the
            position), so a sample does not depend on which server or attempt served it.

    The pool owns the reply parser of ``config.reply_parse_workers`` (its processes start with
    :meth:`start` and stop with :meth:`stop`; they make the ``/generate`` calls) and hands it to
    its ``SGLangClient``s; other clients (vLLM's) make and parse their calls themselves.

    Raises:
        ValueError: without clients, for a meter of another server count, or for
            ``clock_tokens`` without ``seed_of``.
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
        meter: ServerMeter | None = None,
        seed_of=None,
    ) -> None:
        if not clients:
            raise ValueError("the rollout pool needs at least one server")
        if config.clock_tokens and seed_of is None:
            raise ValueError(
                "async_pool.clock_tokens makes runs repeat, which needs a sampling_seed per "
                "request: pass seed_of"
            )
        self.seed_of = seed_of
        self.meter = meter or ServerMeter(len(clients))
        if self.meter.num_servers != len(clients):
            raise ValueError(f"meter of {self.meter.num_servers} servers for {len(clients)}")
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
        self._index_floor = 0  # sample indices start here (restore_state)
        self._next_group = 0
        self._replacements: dict[int, int] = {}  # batch -> replacement groups admitted
        self._drawn = 0  # prompts taken from ``prompts``
        self._first_draw: dict[int, int] = {}  # batch -> ``_drawn`` before its first prompt
        self._first_group: dict[int, int] = {}  # batch -> ``_next_group`` at its first group
        self._error: BaseException | None = None
        self._stopped = False
        self._started = False
        self._alive = set(range(len(self.clients)))
        # A slot's worker serves while its generation is current (see the module docstring).
        self._generation = [0] * len(self.clients)
        self._threads: list[threading.Thread] = []
        # The logical clock (clock_tokens): rounds left at this version once batch
        # ``_version`` is complete, and whether a round is in flight.
        self._overlap_left = 1
        self._round_busy = False
        self._reward_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")
        workers = config.reply_parse_workers
        self._reply_parser = ReplyParser(workers) if workers else None

    def start(self) -> None:
        """Admit what the current version allows and start one worker per live server.

        Raises:
            RuntimeError: when called twice.
            ReplyParserError: when a reply worker process died starting.
        """
        if self._reply_parser is not None:
            # Ready, its clients built, before the first request: it is sent from there.
            self._reply_parser.start(
                [c.worker_spec() for c in self.clients if isinstance(c, SGLangClient)]
            )
        with self._cond:
            if self._started:
                raise RuntimeError("AsyncRolloutPool.start() called twice")
            self._started = True
            self._admit()
            if self.config.clock_tokens:
                self._spawn_clock()
                return
            for i in sorted(self._alive):
                self._spawn_worker(i)

    def down_servers(self) -> set[int]:
        """Indices of the server slots marked dead and not replaced since."""
        with self._cond:
            return set(range(len(self.clients))) - self._alive

    def mark_dead(self, index: int) -> None:
        """Send server ``index`` nothing more (e.g. its owner found it dead); reported in
        ``stats.dead_servers``. A request already in flight to it is re-issued elsewhere if it
        fails, delivered if it succeeds. A no-op for a slot already dead."""
        with self._cond:
            if index in self._alive:
                self._alive.discard(index)
                self._generation[index] += 1  # its idle worker retires
                self.stats.dead_servers.append(self.clients[index].base_url)
            self._cond.notify_all()

    def replace_server(self, index: int, client: SGLangClient) -> None:
        """Serve slot ``index`` from ``client`` from now on, with a new worker.

        The caller must have pushed the weights and weight_version the pool currently
        generates with to the new server first: its worker takes queued work as soon as this
        returns. The slot's previous worker, if any, retires (see the module docstring).

        Raises:
            IndexError: for an index outside the pool.
            RuntimeError: after ``stop()``.
        """
        if not 0 <= index < len(self.clients):
            raise IndexError(f"server index {index} outside 0..{len(self.clients) - 1}")
        with self._cond:
            if self._stopped:
                raise RuntimeError("replace_server after stop()")
            self._generation[index] += 1
            self.clients[index] = client
            self._alive.add(index)
            self.stats.replaced += 1
            self.stats.samples_per_server.setdefault(client.base_url, 0)
            if self._started and not self.config.clock_tokens:  # the clock serves every slot
                self._spawn_worker(index)
            self._cond.notify_all()

    def get_batch(self, batch: int, timeout_s: float | None = None) -> list[Sample]:
        """Block until batch ``batch`` is complete; its samples, groups contiguous in order.

        Raises:
            NoLiveServer: when every server is dead before the batch completed (its unfinished
                samples stay queued: call again after ``replace_server``).
            RuntimeError: when the pool failed (the cause chained) or the wait timed out.
        """

        def complete() -> bool:
            return self._pending.get(batch) == 0

        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._error is not None or complete() or not self._alive, timeout_s
            )
            self._raise_if_failed()
            if not complete() and not self._alive:
                raise NoLiveServer(self._no_server_message(f"batch {batch}"))
            if not ok:
                raise RuntimeError(f"batch {batch} not complete after {timeout_s} s")
            groups = self._done.pop(batch)
            del self._pending[batch]
            self.stats.filtered_groups += self._replacements.pop(batch)
        return [s for g in sorted(groups) for s in groups[g]]

    def wait_before_update(self, new_version: int, timeout_s: float | None = None) -> None:
        """In fixed-lag mode, block until every batch generated by version ``new_version - 1``
        has finished (so no batch straddles two versions); on the logical clock
        (``clock_tokens``), until version ``new_version - 1``'s rounds are done (the pause: the
        push lands between rounds); a no-op in bounded mode on the wall clock.

        Raises:
            NoLiveServer: when every server is dead first (call again after
                ``replace_server``).
            RuntimeError: when the pool failed (the cause chained) or the wait timed out.
        """
        if self.config.clock_tokens:
            self._wait_for_pause(f"the rounds of version {new_version - 1}", timeout_s)
            return
        if self.config.mode != "fixed_lag":
            return
        last = new_version - 1 + self.config.lag

        def generated() -> bool:
            return all(self._pending.get(b, 0) == 0 for b in range(last + 1))

        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._error is not None or generated() or not self._alive, timeout_s
            )
            self._raise_if_failed()
            if not generated() and not self._alive:
                raise NoLiveServer(self._no_server_message(f"batches up to {last}"))
            if not ok:
                raise RuntimeError(f"batches up to {last} not generated after {timeout_s} s")

    def set_version(self, version: int) -> None:
        """The servers now hold ``version``: admit the batches it allows. On the logical clock
        the requests cut by the last round are resumed or restarted (``on_update``) here, as
        the wall clock's push aborts them, and the rounds of ``version`` begin."""
        with self._cond:
            self._change_version(version)
            self._admit()
            self._cond.notify_all()

    def drawn_before(self, batch: int) -> int:
        """Prompts this pool drew before the first prompt of ``batch`` (all it drew when the
        batch is not admitted yet).

        A run checkpoint taken when the trainer has consumed batches ``< batch`` stores this as
        the data position (plus where the pool started), so a resumed run draws the prompts of
        the batches admitted ahead again instead of skipping them (a replacement prompt of an
        earlier batch drawn after that point is drawn twice; none is lost).
        """
        with self._cond:
            return self._first_draw.get(batch, self._drawn)

    def stop(self) -> None:
        """Stop the workers after their current request (servers are left running), then the
        reply parser's processes."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=60)
        if self._reply_parser is not None:
            self._reply_parser.close()
