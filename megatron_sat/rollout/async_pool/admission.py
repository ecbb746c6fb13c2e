"""Admission: which groups of which batch may start. A group of batch ``b`` is queued once
the servers hold version ``>= b - lag`` (the staleness rule, see the package docstring); a
complete group of equal rewards is replaced by one of the next prompt (``filter_groups``)."""

from __future__ import annotations

import torch

from megatron_sat.objectives.advantages import informative_groups
from megatron_sat.rollout.async_pool.core import PoolCore, _Job


class Admission(PoolCore):
    """The admission rule of ``AsyncRolloutPool`` (caller holds the lock in every method)."""

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
