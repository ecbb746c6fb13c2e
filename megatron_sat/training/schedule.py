"""The rollout schedule of one RL run: per ``rollout.mode``, the order of getting a batch,
pushing weights, evaluating, exporting the pool's state for a run checkpoint and telling the
pool the servers' version. The run loop (``training.rl``) calls the same four methods in every
mode; the mode is chosen once, by ``make_schedule``.

- ``sync``: each step generates its batch (``RolloutPool``, replacing equal-reward groups
  when ``filter_groups``), trains, and pushes every ``update_weights_interval`` steps; the
  evaluation runs after the push, in the loop's log phase.
- ``fixed_lag`` and ``bounded``: an ``AsyncRolloutPool`` generates while the trainer steps.
  After each step: ``wait_before_update`` (fixed lag: the batches of the version being
  replaced are done; the logical clock: its pause; bounded on the wall clock: no wait) ->
  push -> evaluation when due (the pool stands still, so no rollout shares a server batch with
  it) -> the pool's state when a run checkpoint is due -> ``set_version``. What differs
  between fixed lag and bounded (what the wait waits for, what the export holds) is the pool's
  (``rollout.async_pool``).

Adding a mode: a ``Schedule`` subclass here, its pool in ``rollout``, its branch in
``make_schedule`` and its name in ``config.run.RolloutConfig``'s checks.
"""

from __future__ import annotations

import abc
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from megatron_sat.config import RunConfig
from megatron_sat.rollout.async_pool import AsyncPoolConfig, AsyncRolloutPool
from megatron_sat.rollout.client import RoutingSpec, SamplingParams
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.meter import ServerMeter
from megatron_sat.rollout.pool import RewardFn, RolloutPool, informative_batch
from megatron_sat.rollout.seeds import request_seed
from megatron_sat.rollout.types import Sample

T = TypeVar("T")


class PromptSource(Protocol):
    """The run's prompt stream (``training.rl.PromptStream``): records in order, and how many
    it gave (the data position)."""

    consumed: int

    def __next__(self) -> PromptRecord: ...

    def __iter__(self) -> Iterator[PromptRecord]: ...


class RunHooks(Protocol):
    """What the run loop lends its schedule."""

    def push(self) -> object:
        """The trainer's current weights and version to every server (dead ones replaced)."""

    def revived(self, call: Callable[[], T]) -> T:
        """``call()``, reviving the servers and calling again while every server is dead."""

    def evaluate(self, after_step: int) -> dict[str, float]:
        """The held-out evaluation after step ``after_step`` (metrics ``eval/*``)."""


@dataclass
class AfterStep:
    """What the schedule did after a train step.

    Attributes:
        sync_s: seconds of the weight push (restarts and regrouping included); 0 without one.
        eval_s: seconds of an evaluation the schedule ran itself (excluded from the step's
            time); 0 otherwise.
        evaluated: that evaluation's metrics, or None (the loop evaluates when due).
        pool_state: the asynchronous pool's state for the run checkpoint, or None.
    """

    sync_s: float = 0.0
    eval_s: float = 0.0
    evaluated: dict[str, float] | None = None
    pool_state: dict | None = None


def rollout_dispatch(cfg: RunConfig) -> str:
    """How the pools send requests (``rollout.pool.DISPATCH``): ``per_request`` to servers
    given by URL (SGLang, vLLM: continuous batching, so a long response holds only itself;
    rendered SGLang servers run ``--enable-deterministic-inference``, batch-invariant), and
    ``per_server`` to embedded servers: their engine is not batch-invariant (the same seeded
    request's log-probs differ by up to 1e-6 alone and in a batch, measured) and batches
    statically, so per-request arrival would make seeded runs differ bit for bit and would
    not free a server sooner. The logical clock (``rollout.clock_tokens``) sends one batched
    request per server and round, whatever the servers."""
    if cfg.rollout.clock_tokens:
        return "per_server"
    return "per_request" if cfg.rollout.server_urls else "per_server"


def async_pool_config(cfg: RunConfig) -> AsyncPoolConfig:
    """The asynchronous pool of ``rollout.mode`` fixed_lag or bounded, from the run config."""
    ro = cfg.rollout
    return AsyncPoolConfig(
        mode=ro.mode,
        lag=ro.lag,
        prompts_per_batch=ro.prompts_per_step,
        group_size=ro.group_size,
        on_update=ro.on_update,
        clock_tokens=ro.clock_tokens,
        filter_groups=ro.filter_groups,
        max_replacements=ro.max_replacement_groups,
        dispatch=rollout_dispatch(cfg),
        # the vLLM client parses its own replies (per prompt, in its threads)
        reply_parse_workers=ro.reply_parse_workers if ro.engine == "sglang" else 0,
    )


class Schedule(abc.ABC):
    """The per-mode order around a train step (module docstring). ``pools`` are the pools the
    schedule adds to the run's (weight pushes regroup them; their counters are logged)."""

    pools: tuple[AsyncRolloutPool, ...] = ()

    def start(self) -> None:  # noqa: B027 (a hook: nothing to do by default)
        """Before the first step (after the initial evaluation)."""

    @abc.abstractmethod
    def generate(self, step: int) -> list[Sample]:
        """The batch step ``step`` trains on, groups contiguous."""
        ...

    @abc.abstractmethod
    def after_step(self, step: int, version: int, *, eval_due: bool, save_due: bool) -> AfterStep:
        """Push, evaluate, export: what follows the train step that made ``version``."""
        ...

    @abc.abstractmethod
    def data_position(self, step: int, pool_state: dict | None) -> int:
        """The prompts a run checkpoint after ``step`` records as consumed."""
        ...

    @property
    @abc.abstractmethod
    def filtered_groups(self) -> int:
        """Groups replaced for equal rewards in the batches returned so far."""
        ...

    def stop(self) -> None:  # noqa: B027 (a hook: nothing to do by default)
        """After the last step."""


class SyncSchedule(Schedule):
    """Generate, then train, one batch at a time; push every ``update_weights_interval``."""

    def __init__(
        self, cfg: RunConfig, pool: RolloutPool, prompts: PromptSource, hooks: RunHooks
    ) -> None:
        self.cfg, self.pool, self.prompts, self.hooks = cfg, pool, prompts, hooks
        self._filtered = 0  # replaced groups, since the start of this process

    def generate(self, step: int) -> list[Sample]:
        ro = self.cfg.rollout
        samples, replaced = informative_batch(
            lambda records: self.hooks.revived(self._seeded(records, step)),
            self.prompts,
            ro.prompts_per_step,
            ro.group_size,
            ro.max_replacement_groups,
        )
        self._filtered += replaced
        return samples

    def _seeded(self, records: list[PromptRecord], step: int) -> Callable[[], list[Sample]]:
        """The generation of ``records`` with each request's seed of its data position."""
        ro = self.cfg.rollout
        # The records were just drawn: data positions consumed - len .. consumed.
        first = self.prompts.consumed - len(records)
        return functools.partial(
            self.pool.generate_groups,
            records,
            ro.group_size,
            temperature=ro.temperature,
            top_p=ro.top_p,
            top_k=ro.top_k,
            max_new_tokens=ro.max_new_tokens,
            seed_of=lambda g, j: request_seed(self.cfg.train.seed, step, first + g, j),
        )

    def after_step(self, step: int, version: int, *, eval_due: bool, save_due: bool) -> AfterStep:
        if version % self.cfg.rollout.update_weights_interval:
            return AfterStep()
        t1 = time.time()
        self.hooks.push()
        return AfterStep(sync_s=time.time() - t1)

    def data_position(self, step: int, pool_state: dict | None) -> int:
        return self.prompts.consumed

    @property
    def filtered_groups(self) -> int:
        return self._filtered


class AsyncSchedule(Schedule):
    """``fixed_lag`` and ``bounded``: the pool generates ahead; the trainer's batch ``b``
    (``step - first_step``) is generated by pool versions up to ``b - lag`` behind.

    Args:
        pool: the pool, restored from the run checkpoint if any, not started.
        first_step: the first step of this process (batch 0 of the pool).
        base_version: the trainer's version at ``first_step`` (the pool counts from it).
        pool_start: the data position where the pool starts drawing.
    """

    def __init__(
        self,
        pool: AsyncRolloutPool,
        hooks: RunHooks,
        *,
        first_step: int,
        base_version: int,
        pool_start: int,
    ) -> None:
        self.pool, self.hooks = pool, hooks
        self.pools = (pool,)
        self.first_step, self.base_version, self.pool_start = first_step, base_version, pool_start

    def start(self) -> None:
        self.pool.start()

    def generate(self, step: int) -> list[Sample]:
        return self.hooks.revived(functools.partial(self.pool.get_batch, step - self.first_step))

    def after_step(self, step: int, version: int, *, eval_due: bool, save_due: bool) -> AfterStep:
        pool, hooks, out = self.pool, self.hooks, AfterStep()
        hooks.revived(functools.partial(pool.wait_before_update, version - self.base_version))
        t1 = time.time()
        hooks.push()
        out.sync_s = time.time() - t1
        if eval_due:
            # Before the pool goes on: none of its requests is in flight now (fixed lag: the
            # batches of the pushed version are done; the logical clock pauses), so no rollout
            # shares a server batch with the evaluation (the embedded engine's log-probs
            # depend on the batch).
            out.evaluated = hooks.evaluate(step)
            out.eval_s = time.time() - t1 - out.sync_s
        if save_due:
            # Fixed lag: the complete batches ahead are saved, the next one re-created;
            # bounded: everything admitted, as it stands (the logical clock: paused).
            out.pool_state = hooks.revived(
                functools.partial(pool.export_state, step - self.first_step + 1)
            )
        pool.set_version(version - self.base_version)
        return out

    def data_position(self, step: int, pool_state: dict | None) -> int:
        # The prompts admitted ahead are drawn again on resume.
        if pool_state is not None:
            return self.pool_start + pool_state["drawn"]
        return self.pool_start + self.pool.drawn_before(step - self.first_step + 1)

    @property
    def filtered_groups(self) -> int:
        return self.pool.stats.filtered_groups

    def stop(self) -> None:
        self.pool.stop()


@dataclass(frozen=True)
class PoolParts:
    """What an asynchronous pool shares with the run's synchronous one."""

    clients: list
    tokenizer: object
    reward_fn: RewardFn
    routing: RoutingSpec | None
    meter: ServerMeter


def make_schedule(
    cfg: RunConfig,
    pool: RolloutPool,
    prompts: PromptSource,
    hooks: RunHooks,
    parts: PoolParts,
    *,
    first_step: int,
    version: int,
    restored: dict | None,
) -> Schedule:
    """The schedule of ``rollout.mode``. An asynchronous one builds its pool over
    ``parts`` at the prompt stream's position (restoring the checkpoint's batches ahead from
    ``restored``, a run checkpoint's rollout state), the servers at ``version``."""
    if cfg.rollout.mode == "sync":
        return SyncSchedule(cfg, pool, prompts, hooks)
    ro = cfg.rollout
    pool_start = prompts.consumed  # the data position where the async pool starts drawing
    async_pool = AsyncRolloutPool(
        parts.clients,
        parts.tokenizer,
        parts.reward_fn,
        prompts,
        async_pool_config(cfg),
        SamplingParams(
            temperature=ro.temperature,
            top_p=ro.top_p,
            top_k=ro.top_k,
            max_new_tokens=ro.max_new_tokens,
            stop_token_ids=(parts.tokenizer.eos_token_id,),
        ),
        routing=parts.routing,
        meter=parts.meter,
        # Batch b is consumed by step first_step + b; drawn counts from pool_start.
        seed_of=lambda b, drawn, slot: request_seed(
            cfg.train.seed, first_step + b, pool_start + drawn, slot
        ),
    )
    if (restored or {}).get("batches") is not None:
        # The batches generated ahead of the checkpoint, exactly as they were (bounded mode:
        # with the requests in flight then, see AsyncRolloutPool.export_state).
        async_pool.restore_state(restored)
    return AsyncSchedule(
        async_pool, hooks, first_step=first_step, base_version=version, pool_start=pool_start
    )
