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

Bounded mode runs on the wall clock by default: where a push cuts a request, and which version
starts which request, depend on how fast the trainer and the servers are, so two runs with the
same seed differ. With ``clock_tokens`` = K > 0 it runs on a logical clock instead, and a run
repeats bit for bit (and resumes exactly from a checkpoint). Generation advances in *rounds*:
every queued request (all admitted work: at most ``lag + 1`` batches, split in order over the
live servers) generates up to K tokens, in one batched request per server, and the servers'
answers are taken in server order once all have answered. At version ``v`` the servers run rounds
until batch ``v`` (the one the trainer consumes next) is complete, then one more round (the
generation that overlaps the trainer's step), then wait: a push lands between rounds
(``wait_before_update`` waits for that pause), never inside one. A request cut by the end of a
round continues in a later one, at whatever version then holds (``on_update``), so a sample's
tokens can still span versions and its age ranges from 0 to ``lag``; the cut points are
functions of K, the seeds and the batch shapes only. K stands for how fast the servers are
against the trainer: the larger, the further ahead they get (at K = ``max_new_tokens`` the
servers finish every admitted batch while the trainer steps, and samples reach the bound).
Every request carries its own ``sampling_seed`` (``seed_of``), so a request's draws do not
depend on which round, server or attempt generated them. The only server dying in a round
while the trainer waits for its batch is exact: the round is redone by the restarted server,
at the same version. Not exact: a server dying while others live (its requests go to the
others, whose batches then differ), and one dying in the overlap round, while the trainer
steps: the trainer has moved on, so the restarted server gets the next version's weights and
the round's lost work is done at that version.

Resilience: a request whose server fails (connection error, timeout, HTTP error) is re-issued on
another live server; the failed server is marked dead and reported (``stats.dead_servers``,
``down_servers()``). A group is delivered once, when all its samples are complete. Every job is
owned by exactly one worker between leaving the queue and being delivered or re-queued, which
is what makes delivery exactly-once across failures and restarts. The pool does not restart
servers itself: the owner of the servers (``rollout.fleet.RolloutFleet``) restarts a dead
embedded server, pushes it the current weights and version, and only then hands the fresh
client to ``replace_server``, which starts the slot's new worker; until then nothing is sent to
that slot. Each slot's worker carries a generation number, so a worker left over from the old
server (idle, or with a request in flight that then fails) retires without touching the new one.
When no live server remains, ``get_batch`` and ``wait_before_update`` raise
:class:`~megatron_sat.rollout.pool.NoLiveServer` with every unfinished job still queued; they can
be called again after ``replace_server``.

Per-server request accounting (utilisation, samples and tokens per server index) goes to
``meter`` (:class:`~megatron_sat.rollout.meter.ServerMeter`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from megatron_sat.objectives.advantages import informative_groups
from megatron_sat.rollout.client import (
    GenerateOutput,
    SamplingParams,
    SGLangClient,
    SGLangError,
    SGLangRequestError,
)
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.meter import ServerMeter
from megatron_sat.rollout.pool import (
    DISPATCH,
    NoLiveServer,
    RewardFn,
    parse_weight_version,
    refused_prompts,
    submit_reward,
)
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
        filter_groups: drop a completed group whose rewards are all equal (zero advantages)
            and generate a group of the next prompt for the same batch instead (DAPO's
            dynamic sampling, Yu et al., arXiv 2503.14476, Eq. 11).
        max_replacements: replacement groups per batch at most; once used up, groups are kept
            whatever their rewards (so an all-solved dataset still makes batches).
        dispatch: ``per_request``: every server slot runs ``max_in_flight_per_server``
            workers that each take one sample at a time from the queue, so a server that
            finishes sooner takes more (the least loaded one gets the next request) and a long
            response holds only its own worker. ``per_server``: one worker per slot takes its
            share of the queue (at most one batch) in one batched request (the server's batches
            are then the same every run: see ``rollout.pool.RolloutPool``).
        max_in_flight_per_server: ``per_request`` requests in flight per server (>= 1).
        clock_tokens: bounded mode only: 0 runs it on the wall clock; K > 0 on the logical
            clock of rounds of K tokens per request (see the module docstring), which repeats
            bit for bit. Rounds send one batched request per server (``per_server``).
    """

    mode: str = "fixed_lag"
    lag: int = 1
    prompts_per_batch: int = 32
    group_size: int = 8
    on_update: str = "resume"
    filter_groups: bool = False
    max_replacements: int = 0
    dispatch: str = "per_server"
    max_in_flight_per_server: int = 64
    clock_tokens: int = 0

    def __post_init__(self) -> None:
        if self.clock_tokens < 0:
            raise ValueError(f"async_pool.clock_tokens must be >= 0, got {self.clock_tokens}")
        if self.clock_tokens and self.mode != "bounded":
            raise ValueError(
                f"async_pool.clock_tokens={self.clock_tokens} applies to mode='bounded' "
                f"(fixed_lag repeats without it), got mode={self.mode!r}"
            )
        if self.clock_tokens and self.dispatch != "per_server":
            raise ValueError(
                f"async_pool.clock_tokens={self.clock_tokens} runs rounds of one batched "
                f"request per server: it needs dispatch='per_server', got {self.dispatch!r}"
            )
        if self.dispatch not in DISPATCH:
            raise ValueError(
                f"async_pool.dispatch must be one of {DISPATCH}, got {self.dispatch!r}"
            )
        if self.max_in_flight_per_server < 1:
            raise ValueError(
                "async_pool.max_in_flight_per_server must be >= 1, got "
                f"{self.max_in_flight_per_server}"
            )
        if self.mode not in MODES:
            raise ValueError(f"async_pool.mode must be one of {MODES}, got {self.mode!r}")
        if self.on_update not in ON_UPDATE:
            raise ValueError(f"async_pool.on_update must be one of {ON_UPDATE}")
        if self.lag < 0:
            raise ValueError(f"async_pool.lag must be >= 0, got {self.lag}")
        if self.prompts_per_batch < 1 or self.group_size < 1:
            raise ValueError("async_pool.prompts_per_batch and group_size must be >= 1")
        if self.max_replacements < 0:
            raise ValueError(
                f"async_pool.max_replacements must be >= 0, got {self.max_replacements}"
            )


# What a resumed pool must share with the checkpointed one (async_pool field: run config field).
_SHAPE = {
    "mode": "rollout.mode",
    "lag": "rollout.lag",
    "prompts_per_batch": "rollout.prompts_per_step",
    "group_size": "rollout.group_size",
    "clock_tokens": "rollout.clock_tokens",
}


def check_pool_state(state: dict, config: AsyncPoolConfig) -> None:
    """Refuse a pool state (``AsyncRolloutPool.export_state``) made by a pool of another
    shape than ``config``: the batches ahead were admitted, sized or cut by it, so a resumed
    run would break its staleness bound (a smaller lag), split its groups (another group
    size) or leave the logical clock's path. Call it before starting servers: the RL loop
    does at resume.

    Raises:
        ValueError: naming each field that differs, with the run config's name
            (``rollout.lag``, ``rollout.group_size``, ...), its value in the checkpoint and
            here.
    """
    saved = state.get("config")
    if saved is None:  # a state written before the shape was recorded: what it does show
        saved = {
            "mode": state.get("mode", "fixed_lag"),
            "clock_tokens": state.get("clock_tokens", 0),
        }
        if saved["mode"] != "bounded":
            saved["lag"] = len(state["batches"])
    differ = [
        f"{field}={saved[name]!r} in the checkpoint, {getattr(config, name)!r} here"
        for name, field in _SHAPE.items()
        if name in saved and saved[name] != getattr(config, name)
    ]
    if differ:
        raise ValueError(
            "the run checkpoint's rollout pool was made with another shape ("
            + "; ".join(differ)
            + "): resume with the values it was saved with"
        )


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
        meter: per-server request accounting, shared with other pools over the same servers;
            default a new one.
        seed_of: ``seed_of(batch, drawn, slot) -> int``, the ``sampling_seed`` of the request
            of sample ``slot`` of the prompt drawn ``drawn``-th (0-based) by this pool for
            ``batch``; None leaves sampling to the servers' generators. Seeded requests
            continue at their positions when resumed (SGLang's seeded sampling hashes the
            position), so a sample does not depend on which server or attempt served it.

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

    # -- trainer side ------------------------------------------------------------------------
    def start(self) -> None:
        """Admit what the current version allows and start one worker per live server.

        Raises:
            RuntimeError: when called twice.
        """
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

    def export_state(self, next_batch: int) -> dict:
        """What a run checkpoint taken when the trainer has consumed the batches
        ``< next_batch`` needs to re-create this pool exactly (``restore_state``). Call it
        after the push of version ``next_batch`` (``wait_before_update`` ran), before or after
        ``set_version(next_batch)``; the RL loop calls it before, when the pool stands still
        in fixed-lag mode and on the logical clock.

        In fixed-lag mode the batches ``next_batch .. next_batch + lag - 1`` are complete at
        that point (``wait_before_update`` ran before the push): their samples are exported,
        with the data position where the next batch's first prompt was drawn and the group
        and sample counters. Batch ``next_batch + lag`` and later are re-created by the rule
        (admitted at the version the checkpoint holds, per-request seeds), not exported.

        In bounded mode which version produced which token depends on timing, so no rule can
        re-create the batches ahead: the pool is quiesced instead (``_quiesce``: every worker
        finishes its request in flight and leaves it delivered or queued, then new workers
        start) and everything admitted is exported as it is at that instant: each batch
        ``>= next_batch``'s finished samples and unfinished slots, every queued request with
        its partial response, log-probs and per-token versions (``on_update="resume"``), its
        attempts and ``sampling_seed``, and the counters. What happens after the checkpoint
        depends on timing again, in the uninterrupted run as in the resumed one. On the logical
        clock (``clock_tokens``) the same is exported at the clock's pause (waited for, after
        ``set_version`` the pause of the new version), a state that does not depend on
        timing, so the resumed run continues exactly as the uninterrupted one.

        Returns:
            fixed lag: ``{"batches": [samples of each complete batch], "drawn": int,
            "next_group": int, "next_index": int}``; bounded: ``_export_bounded``'s dict
            (``"mode": "bounded"``). Picklable; batch indices relative to ``next_batch``.

        Raises:
            ValueError: when a batch that must be complete is not (fixed lag).
            RuntimeError: (bounded) when a worker does not finish its request in 60 s.
            NoLiveServer: (logical clock) when every server is dead before the pause.
        """
        if self.config.mode == "bounded":
            return self._export_bounded(next_batch)
        first_ahead = next_batch + self.config.lag  # the first batch re-created by the rule
        with self._cond:
            batches = []
            for b in range(next_batch, first_ahead):
                if self._pending.get(b) != 0:
                    raise ValueError(f"batch {b} is not complete at the checkpoint")
                groups = self._done[b]
                batches.append([s for g in sorted(groups) for s in groups[g]])
            first = self._first_draw.get(first_ahead, self._drawn)
            indices = [s.index for batch in batches for s in batch]
            return {
                "config": self._shape(),
                "batches": batches,
                # Replacement groups of each: counted (stats.filtered_groups) when consumed.
                "replacements": [self._replacements[b] for b in range(next_batch, first_ahead)],
                "drawn": first,
                "next_group": self._first_group.get(first_ahead, self._next_group),
                # Sample.index only names samples in messages; kept increasing.
                "next_index": (max(indices) + 1) if indices else self._index_floor,
            }

    def restore_state(self, state: dict) -> None:
        """Before ``start``: take the complete batches of ``export_state`` as batches
        ``0 .. lag - 1`` of this pool (its caller positioned the prompt stream at the exported
        ``drawn``), so the batch admitted next is the one the checkpointed pool would have.

        A bounded-mode state (``"mode": "bounded"``) is put back as exported: its batches as
        batches ``0 ..`` (finished samples, unfinished slots), its queued requests with their
        partial responses, and the counters (the caller positions the prompt stream at
        ``drawn``, everything the exported pool had drawn).

        Raises:
            RuntimeError: after ``start``.
            ValueError: for a state of a pool of another shape (``check_pool_state``).
        """
        if self._started:
            raise RuntimeError("restore_state after start()")
        check_pool_state(state, self.config)
        if state.get("mode") == "bounded":
            self._restore_bounded(state)
            return
        replacements = state.get("replacements", [0] * self.config.lag)
        with self._cond:
            for b, samples in enumerate(state["batches"]):
                groups: dict[int, list] = {}
                for sample in samples:
                    # A run checkpoint stores dataclasses as dicts (RunState goes through asdict).
                    sample = sample if isinstance(sample, Sample) else Sample(**sample)
                    groups.setdefault(sample.group_index, []).append(sample)
                self._done[b], self._pending[b] = groups, 0
                self._replacements[b] = replacements[b]
                self._first_draw[b] = 0
            self._next_batch = len(state["batches"])
            self._next_group = state["next_group"]
            self._next_index = state["next_index"]
            self._index_floor = state["next_index"]

    def _quiesce(self) -> None:
        """Let every worker finish its request in flight (delivered, or queued again with its
        partial output) and exit, then start new ones for the live slots; the caller holds
        nothing. Between the two the pool's state stands still (the exporter reads it then).

        Raises:
            RuntimeError: when a worker is still busy after 60 s.
        """
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            threads, self._threads = list(self._threads), []
        for thread in threads:
            thread.join(timeout=60)
            if thread.is_alive():
                raise RuntimeError(f"rollout worker {thread.name} busy for 60 s at a checkpoint")

    def _export_bounded(self, next_batch: int) -> dict:
        """Bounded mode's ``export_state`` (see there): the pool stands still while read."""
        started = self._started and not self.config.clock_tokens
        if started:
            self._quiesce()
        elif self._started:
            self._wait_for_pause("the pause before a checkpoint", None)
        try:
            with self._cond:
                self._raise_if_failed()
                batches = []
                for b in range(next_batch, self._next_batch):
                    groups = self._done[b]
                    batches.append(
                        {
                            "groups": {
                                g: [None if s is None else dataclasses.asdict(s) for s in slots]
                                for g, slots in groups.items()
                            },
                            "pending": self._pending[b],
                            "replacements": self._replacements[b],
                            "first_draw": self._first_draw.get(b, self._drawn) - self._drawn,
                        }
                    )
                queue = []
                for job in self._queue:
                    entry = dataclasses.asdict(job)
                    entry["batch"] -= next_batch
                    queue.append(entry)
                return {
                    "mode": "bounded",
                    "config": self._shape(),
                    "overlap_left": self._overlap_left,
                    "batches": batches,
                    "queue": queue,
                    "drawn": self._drawn,
                    "version": self._version - next_batch,
                    "next_group": self._next_group,
                    "next_index": self._next_index,
                }
        finally:
            if started:
                with self._cond:
                    self._stopped = False
                    for i in sorted(self._alive):
                        self._spawn_worker(i)

    def _restore_bounded(self, state: dict) -> None:
        """Bounded mode's ``restore_state`` (see there); the caller checked the state."""
        with self._cond:
            self._overlap_left = state.get("overlap_left", 1)
            for b, batch in enumerate(state["batches"]):
                self._done[b] = {
                    int(g): [None if s is None else Sample(**s) for s in slots]
                    for g, slots in batch["groups"].items()
                }
                self._pending[b] = batch["pending"]
                self._replacements[b] = batch["replacements"]
                self._first_draw[b] = batch["first_draw"]
                self._first_group[b] = min(self._done[b], default=state["next_group"])
            for entry in state["queue"]:
                entry = dict(entry)
                record = entry.pop("record")
                record = record if isinstance(record, PromptRecord) else PromptRecord(**record)
                self._queue.append(_Job(record=record, **entry))
            self._next_batch = len(state["batches"])
            # -1: exported before the trainer's set_version(next_batch) (the RL loop's order);
            # the servers hold that version, so it is made now, as set_version would have.
            self._version = state["version"]
            self._change_version(0)
            self._next_group = state["next_group"]
            self._next_index = state["next_index"]
            self._index_floor = state["next_index"]

    def stop(self) -> None:
        """Stop the workers after their current request (servers are left running)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=60)

    # -- internals ---------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the rollout pool failed") from self._error

    def _no_server_message(self, what: str) -> str:
        return (
            f"{what} incomplete and every rollout server is dead "
            f"({self.stats.dead_servers}); {len(self._queue)} samples stay queued"
        )

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

    def _shape(self) -> dict:
        """What a pool state must agree on with the pool that restores it."""
        return {name: getattr(self.config, name) for name in _SHAPE}

    def _change_version(self, version: int) -> None:
        """``set_version``'s change, before it admits (caller holds the lock)."""
        if self.config.clock_tokens and version != self._version:
            for job in self._queue:
                if not job.response_ids:
                    continue
                if self.config.on_update == "resume":
                    self.stats.resumed += 1
                else:
                    job.response_ids, job.log_probs, job.versions = [], [], []
                    self.stats.restarted += 1
            self._overlap_left = 1
        self._version = version

    def _admit(self) -> None:
        """Queue every batch ``b`` with ``b - lag <= version`` (caller holds the lock)."""
        cfg = self.config
        while self._next_batch - cfg.lag <= self._version:
            b = self._next_batch
            self._next_batch += 1
            self._done[b] = {}
            self._pending[b] = 0
            self._replacements[b] = 0
            for _ in range(cfg.prompts_per_batch):
                self._admit_group(b)
        self._cond.notify_all()

    def _admit_group(self, batch: int) -> None:
        """Queue one group of the next prompt for ``batch`` (caller holds the lock)."""
        self._first_draw.setdefault(batch, self._drawn)
        self._first_group.setdefault(batch, self._next_group)
        record = next(self.prompts)
        self._drawn += 1
        group = self._next_group
        self._next_group += 1
        self._done[batch][group] = [None] * self.config.group_size
        self._pending[batch] += self.config.group_size
        ids = self.tokenizer.encode(record.prompt)
        drawn = self._drawn - 1
        for slot in range(self.config.group_size):
            seed = None if self.seed_of is None else self.seed_of(batch, drawn, slot)
            self._queue.append(_Job(batch, group, slot, record, ids, seed=seed))

    def _filter(self, batch: int, group: int) -> None:
        """Replace ``group`` of ``batch`` if it is complete, uninformative (equal rewards) and
        the batch has replacements left (caller holds the lock). The replacement starts at the
        servers' current version, which is one the batch may be generated with (fixed lag: the
        batch is incomplete, so no newer version was pushed; bounded: at least ``b - lag``)."""
        slots = self._done[batch][group]
        if any(s is None for s in slots):
            return
        if self._replacements[batch] >= self.config.max_replacements:
            return
        rewards = torch.tensor([s.reward for s in slots], dtype=torch.float64)
        if informative_groups(rewards, len(slots))[0]:
            return
        del self._done[batch][group]
        self._replacements[batch] += 1  # counted in stats when the batch is consumed
        self._admit_group(batch)

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
        self.meter.begin(server)
        try:
            return client.generate(
                [j.prompt_ids + j.response_ids for j in jobs],
                self._sampling_for(jobs),
                routing=self.routing,
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

    def _spawn_clock(self) -> None:
        """Start the logical clock's thread (caller holds the lock)."""
        thread = threading.Thread(target=self._clock, name="rollout-clock", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _work_due(self) -> bool:
        """Whether the logical clock has a round to run at this version: batch ``_version``
        is incomplete, or its overlap round is left (caller holds the lock)."""
        incomplete = self._pending.get(self._version, 0) > 0
        return bool(self._queue) and (incomplete or self._overlap_left > 0)

    def _wait_for_pause(self, what: str, timeout_s: float | None) -> None:
        """Block until the logical clock pauses at this version (no round in flight, none
        due).

        Raises:
            NoLiveServer: when every server is dead first.
            RuntimeError: when the pool failed (the cause chained) or the wait timed out.
        """

        def paused() -> bool:
            return not self._round_busy and not self._work_due()

        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self._error is not None
                    or paused()
                    or (not self._alive and not self._round_busy)
                ),
                timeout_s,
            )
            self._raise_if_failed()
            if not paused() and not self._alive:
                raise NoLiveServer(self._no_server_message(what))
            if not ok:
                raise RuntimeError(f"{what} not reached after {timeout_s} s")

    def _clock(self) -> None:
        """The logical clock (see the module docstring): rounds until stopped or failed."""
        with ThreadPoolExecutor(len(self.clients), thread_name_prefix="round") as pool:
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda: (
                            self._stopped
                            or self._error is not None
                            or (bool(self._alive) and self._work_due())
                        )
                    )
                    if self._stopped or self._error is not None:
                        return
                    overlap = self._pending.get(self._version, 0) == 0
                    live = sorted(self._alive)
                    total = len(self._queue)  # everything admitted, at most lag + 1 batches
                    requests = []
                    for k, server in enumerate(live):  # the queue's head, in order over slots
                        n = total // len(live) + (k < total % len(live))
                        jobs = [self._queue.popleft() for _ in range(n)]
                        if jobs:
                            requests.append(
                                (server, self._generation[server], self.clients[server], jobs)
                            )
                    self._round_busy = True
                try:
                    futures = [pool.submit(self._request, s, c, j) for s, _, c, j in requests]
                    # Taken in slot order once all answered: the round's outcome (sample
                    # order, queue order) does not depend on which server answered first.
                    outcomes = [f.result() for f in futures]
                    for (server, generation, client, jobs), outcome in zip(
                        requests, outcomes, strict=True
                    ):
                        self._take(server, generation, client, jobs, outcome)
                finally:
                    with self._cond:
                        if overlap:
                            self._overlap_left = max(0, self._overlap_left - 1)
                        self._round_busy = False
                        self._cond.notify_all()

    def _fail(self, jobs: list[_Job], error: BaseException) -> None:
        """Fail the pool with ``error`` (its jobs back in the queue, for the record)."""
        with self._cond:
            self._queue.extendleft(reversed(jobs))
            if self._error is None:
                self._error = error
            self._cond.notify_all()

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
                parse_weight_version(out.weight_version, url)  # even for an empty output
                # Per token: an engine reporting per-token versions (vLLM's spans) keeps them.
                versions = [parse_weight_version(v, url) for v in out.token_versions()]
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
            submit_reward(self.reward_fn, self._reward_executor, text, job.record.label)
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

    def _to_sample(self, job: _Job, out: GenerateOutput, text: str, reward: float) -> Sample:
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
            reward=float(reward),
            response_text=text,
        )
