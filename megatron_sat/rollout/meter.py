"""Per-server utilisation and throughput of the rollout servers, by server index.

Both pools (``rollout.pool.RolloutPool`` for synchronous generation and evaluation,
``rollout.async_pool.AsyncRolloutPool`` for background generation) report every request they
send to a shared :class:`ServerMeter`. A server counts as busy while at least one request to it
is in flight, whichever pool sent it, so overlapping requests are not counted twice and the
utilisation is the fraction of wall time the server had work. Counters are cumulative; the
trainer takes a :meth:`ServerMeter.snapshot` after each step and logs the difference of two
snapshots (:func:`server_metrics`). A server index is a slot: a restarted server keeps the index
(and the counters) of the one it replaced.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ServerCounters:
    """Cumulative counters of one server slot.

    Attributes:
        busy_s: seconds during which at least one request to the server was in flight.
        requests: requests sent (one batched /generate call is one request).
        failures: requests that failed (connection error, timeout, HTTP error).
        samples: samples the server finished (aborted partial outputs excluded).
        tokens: response tokens the server generated (aborted partial outputs included: they
            are generated work, and resumed requests keep them).
    """

    busy_s: float = 0.0
    requests: int = 0
    failures: int = 0
    samples: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class MeterSnapshot:
    """Counters of every server at clock time ``time`` (busy time of in-flight requests
    included up to ``time``)."""

    time: float
    servers: tuple[ServerCounters, ...]


class ServerMeter:
    """Thread-safe request accounting for ``num_servers`` server slots.

    Args:
        num_servers: number of server slots (>= 1).
        clock: monotonic clock in seconds; injectable so tests can measure without sleeping.

    Raises:
        ValueError: for ``num_servers < 1``.
    """

    def __init__(self, num_servers: int, clock: Callable[[], float] = time.monotonic) -> None:
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.clock = clock
        self._lock = threading.Lock()
        self._counters = [ServerCounters() for _ in range(num_servers)]
        self._in_flight = [0] * num_servers
        self._busy_since: list[float | None] = [None] * num_servers

    @property
    def num_servers(self) -> int:
        return len(self._counters)

    def begin(self, server: int) -> None:
        """A request to ``server`` was sent."""
        with self._lock:
            if self._in_flight[server] == 0:
                self._busy_since[server] = self.clock()
            self._in_flight[server] += 1
            c = self._counters[server]
            self._counters[server] = replace(c, requests=c.requests + 1)

    def end(self, server: int, *, samples: int = 0, tokens: int = 0, failed: bool = False) -> None:
        """A request to ``server`` returned (``failed``: with an error) after finishing
        ``samples`` samples and generating ``tokens`` tokens.

        Raises:
            RuntimeError: when no request to ``server`` is in flight (a caller bug).
        """
        with self._lock:
            if self._in_flight[server] == 0:
                raise RuntimeError(f"ServerMeter.end({server}) without a matching begin()")
            self._in_flight[server] -= 1
            c = self._counters[server]
            busy = c.busy_s
            if self._in_flight[server] == 0:
                busy += self.clock() - self._busy_since[server]
                self._busy_since[server] = None
            self._counters[server] = ServerCounters(
                busy_s=busy,
                requests=c.requests,
                failures=c.failures + int(failed),
                samples=c.samples + samples,
                tokens=c.tokens + tokens,
            )

    def snapshot(self) -> MeterSnapshot:
        """Every server's counters now; a request in flight counts as busy up to now."""
        with self._lock:
            now = self.clock()
            servers = tuple(
                c if since is None else replace(c, busy_s=c.busy_s + now - since)
                for c, since in zip(self._counters, self._busy_since, strict=True)
            )
        return MeterSnapshot(now, servers)


def server_metrics(before: MeterSnapshot, after: MeterSnapshot) -> dict[str, float]:
    """Per server index ``i``, over the interval between two snapshots: utilisation (fraction
    of the interval with a request in flight), finished samples/s and generated tokens/s; plus
    requests and failures in the interval.

    Raises:
        ValueError: when the snapshots cover different server counts or ``after`` is not
            later than ``before``.
    """
    if len(before.servers) != len(after.servers):
        raise ValueError(
            f"snapshots of {len(before.servers)} and {len(after.servers)} servers differ"
        )
    wall = after.time - before.time
    if wall <= 0:
        raise ValueError(f"snapshot interval must be > 0 s, got {wall}")
    out: dict[str, float] = {}
    for i, (a, b) in enumerate(zip(before.servers, after.servers, strict=True)):
        prefix = f"rollout/server{i}"
        out[f"{prefix}/utilisation"] = (b.busy_s - a.busy_s) / wall
        out[f"{prefix}/samples_per_s"] = (b.samples - a.samples) / wall
        out[f"{prefix}/tokens_per_s"] = (b.tokens - a.tokens) / wall
        out[f"{prefix}/requests"] = float(b.requests - a.requests)
        out[f"{prefix}/failures"] = float(b.failures - a.failures)
    return out
