"""The logical clock (``clock_tokens`` > 0, bounded mode): generation in rounds of K tokens
per request, a push landing between rounds (see the package docstring)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from megatron_sat.rollout.async_pool.workers import Workers
from megatron_sat.rollout.pool import NoLiveServer


class Clock(Workers):
    """The rounds of ``AsyncRolloutPool`` on the logical clock."""

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
