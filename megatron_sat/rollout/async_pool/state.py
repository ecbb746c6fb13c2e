"""Export and restore of the asynchronous pool's state for a run checkpoint, and the check
that a checkpointed pool has the shape of the pool resuming it (``check_pool_state``)."""

from __future__ import annotations

import dataclasses

from megatron_sat.rollout.async_pool.config import AsyncPoolConfig
from megatron_sat.rollout.async_pool.core import PoolCore, _Job
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.types import Sample

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


class PoolState(PoolCore):
    """``export_state`` / ``restore_state`` of ``AsyncRolloutPool`` (see there)."""

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

    def _shape(self) -> dict:
        """What a pool state must agree on with the pool that restores it."""
        return {name: getattr(self.config, name) for name in _SHAPE}
