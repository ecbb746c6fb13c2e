"""The rollout servers as one unit: who is alive, the weight-update group over them, restarts.

A :class:`RolloutFleet` owns the server processes (embedded ones it started) and the trainer's
:class:`~megatron_sat.weight_sync.broadcast.WeightUpdater`. Every weight push goes through
:meth:`RolloutFleet.push`, which is also where dead servers are dealt with, because a restarted
server has to be synced before it may serve and a push is the only moment the trainer's
weights are at hand:

1. Servers reported dead (by the pools, which notice failed requests) or found dead by a
   health probe (a server that died while idle, which no pool noticed) leave the group.
2. A dead *embedded* server is restarted (at most ``max_restarts`` times per slot); a server
   given by URL is only reported, since we did not start it and cannot restart it.
3. The group has a fixed world size, so a change of membership means a new group: the old
   updater is closed (the dead server cannot destroy its side, which ``close`` reports after
   releasing ours; we log it) and a new one connects every live server.
4. The weights and version are pushed to every live server, the restarted ones included; a push
   that fails because another server died meanwhile is retried after steps 1-3.
5. Each restarted server must then report the pushed version, else the push fails.

Only then does the caller hand a restarted slot's new client to the pools
(:func:`sync_servers` does steps 1-5 and the hand-over), so no pool sends a restarted server a
request before it holds the current weights. A pool keeps sending nothing to a slot it marked
dead until it gets the new client; exactly-once delivery of samples is the pools' part (their
dead server's requests are re-issued elsewhere).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx
import torch

from megatron_sat.platform.threads import child_env
from megatron_sat.rollout.auth import ServerKeys
from megatron_sat.rollout.client import SGLangClient
from megatron_sat.rollout.embedded.launch import EmbeddedServer
from megatron_sat.rollout.protocol import guard_clients
from megatron_sat.weight_sync.broadcast import UpdateStats, WeightSyncError, WeightUpdater
from megatron_sat.weight_sync.updater import BaseWeightUpdater

logger = logging.getLogger("megatron_sat.rollout.fleet")

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class FleetConfig:
    """How the fleet handles dead servers.

    Attributes:
        restart_dead: restart a dead embedded server at the next push (URL servers are only
            reported).
        max_restarts: restarts per server slot over the fleet's life; a slot that would need
            more stays dead (reported), so a server that crashes on start cannot loop forever.
        probe_health: check every member before each push (process alive, GET /health), so a
            server that died while idle is replaced before the group needs it.
        health_timeout_s: timeout of one probe, seconds.

    Probes follow SGLang 0.5.23 (``http_server.health_generate``): /health runs a one-token
    generation, which waits while the server is paused and answers 503 after 20 s (marking
    the server unhealthy). A server the updater may have left paused -- after any failed
    push -- is therefore probed with GET /model_info instead, which the HTTP process answers
    at once, paused or not: a paused but living server is not declared dead.
    """

    restart_dead: bool = True
    max_restarts: int = 3
    probe_health: bool = True
    health_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.health_timeout_s <= 0:
            raise ValueError(f"health_timeout_s must be > 0, got {self.health_timeout_s}")


@dataclass(frozen=True)
class PushReport:
    """What one :meth:`RolloutFleet.push` did.

    Attributes:
        update: what the successful weight push sent.
        found_dead: slots that left the group at this push (reported dead or found dead).
        restarted: slots restarted and synced at this push; their new client is
            ``fleet.clients[i]`` and must replace the old one in every pool.
        down: every slot without a serving server after this push (URL servers that died,
            restarts exhausted or failed); the pools must not use them.
        regrouped: whether the weight-update group was rebuilt.
        restart_s: seconds spent restarting servers and rebuilding the group.
    """

    update: UpdateStats
    found_dead: tuple[int, ...]
    restarted: tuple[int, ...]
    down: tuple[int, ...]
    regrouped: bool
    restart_s: float


class RolloutFleet:
    """N rollout server slots, the weight-update group over the live ones, and restarts.

    Build it with :meth:`embedded` (starts the servers; the fleet stops them) or
    :meth:`from_urls` (running SGLang servers). Not thread-safe: the trainer thread calls
    ``push``; the pools only read ``clients`` through :func:`sync_servers`.

    Args:
        clients: one client per slot.
        servers: per slot, the embedded server behind it, or None for a URL server.
        updater_options: keyword arguments of ``WeightUpdater`` (``ranks_per_server`` is per
            slot and subset to the live slots of each group).
        config: dead-server handling.
        client_factory: makes the client of a (re)started embedded server; default
            ``server.client()``.

    Raises:
        ValueError: without clients, or when ``servers`` or ``ranks_per_server`` do not have
            one entry per client.
    """

    # The weight push over the live members, an updater of weight_sync.updater's protocol (a
    # subclass for another engine replaces it: rollout.vllm.fleet.VLLMFleet).
    updater_cls: type[BaseWeightUpdater] = WeightUpdater

    def __init__(
        self,
        clients: Sequence[SGLangClient],
        *,
        servers: Sequence[EmbeddedServer | None] | None = None,
        updater_options: Mapping[str, object] | None = None,
        config: FleetConfig | None = None,
        client_factory: Callable[[EmbeddedServer], SGLangClient] | None = None,
    ) -> None:
        if not clients:
            raise ValueError("a rollout fleet needs at least one server")
        self.clients = list(clients)
        self.servers = list(servers) if servers is not None else [None] * len(self.clients)
        if len(self.servers) != len(self.clients):
            raise ValueError(f"{len(self.servers)} servers for {len(self.clients)} clients")
        options = dict(updater_options or {})
        self._ranks = list(options.pop("ranks_per_server", None) or [1] * len(self.clients))
        if len(self._ranks) != len(self.clients):
            raise ValueError(f"ranks_per_server {self._ranks} for {len(self.clients)} servers")
        self._options = options
        self.config = config or FleetConfig()
        self.client_factory = client_factory or (lambda server: server.client())
        self.restarts = [0] * len(self.clients)
        self._live = set(range(len(self.clients)))
        self._updater: BaseWeightUpdater | None = None
        # A member that left makes the group unusable even if its slot is live again (a
        # restarted server is a new process that never joined it).
        self._group_stale = True
        self._retired: list[SGLangClient] = []  # old clients; a pool thread may still hold one
        self._given_up: set[int] = set()
        # Whether the servers may be paused by an update that did not complete (see config).
        self._left_paused = False

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def embedded(
        cls,
        model_path: str,
        num_servers: int,
        *,
        server_options: Callable[[int], Mapping[str, object]] | None = None,
        **kwargs,
    ) -> RolloutFleet:
        """Start ``num_servers`` embedded servers (one after the other) and a fleet over them.

        Args:
            server_options: per slot index, ``EmbeddedServer`` options (e.g. ``random_seed``).
            kwargs: the other arguments of the constructor.

        Raises:
            RuntimeError: when a server fails to start (the ones already up are stopped).
        """
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        servers: list[EmbeddedServer] = []
        try:
            for i in range(num_servers):
                options = dict(server_options(i)) if server_options else {}
                # The servers generate at once: each takes its share of the cores' threads.
                options["env"] = {**child_env(num_servers), **options.get("env", {})}
                servers.append(EmbeddedServer(model_path, **options).__enter__())
        except BaseException as e:
            for server in reversed(servers):
                server.__exit__(type(e), e, e.__traceback__)
            raise
        factory = kwargs.get("client_factory") or (lambda server: server.client())
        return cls([factory(s) for s in servers], servers=servers, **kwargs)

    @classmethod
    def from_urls(
        cls, urls: Sequence[str], *, keys: ServerKeys | None = None, **kwargs
    ) -> RolloutFleet:
        """A fleet over running servers (never restarted: a dead one is only reported);
        ``keys``: their API / admin API keys."""
        return cls([SGLangClient(url, keys=keys) for url in urls], **kwargs)

    def __enter__(self) -> RolloutFleet:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        finally:
            for server in reversed(self.servers):
                if server is not None:
                    server.__exit__(exc_type, exc, tb)

    # -- state -------------------------------------------------------------------------------
    @property
    def live(self) -> set[int]:
        """Slots with a server in the fleet (it may have died since the last check)."""
        return set(self._live)

    @property
    def down(self) -> set[int]:
        """Slots without a serving server."""
        return set(range(len(self.clients))) - self._live

    # -- the weight push ---------------------------------------------------------------------
    def push(
        self, named_tensors: NamedTensors, version: int, *, dead: Iterable[int] = ()
    ) -> PushReport:
        """Push weights and ``version`` to every live server, replacing dead embedded servers
        first (see the module docstring).

        Args:
            named_tensors: returns the (HF name, tensor) pairs to push; called once per
                attempt (again after a push that failed because a server died during it).
            version: the weight version the servers must report afterwards.
            dead: slots a pool found dead since the last push.

        Raises:
            WeightSyncError: when no server is left to push to, when a push fails with every
                member healthy (the updater's message says what the servers hold), or when a
                restarted server does not report ``version`` afterwards.
            IndexError: for a dead slot outside the fleet.
        """
        found: list[int] = []
        restarted: list[int] = []
        restart_s = 0.0
        regrouped = False
        for i in sorted(set(dead)):
            if not 0 <= i < len(self.clients):
                raise IndexError(f"dead server index {i} outside 0..{len(self.clients) - 1}")
            if i in self._live:
                self._leave(i, "reported dead by a rollout pool")
                found.append(i)
        if self.config.probe_health:
            # A server left paused by the last failed push would time out a /health probe.
            found += self._probe(may_be_paused=self._left_paused)
        # One retry per slot at most: each retry needs a server that died during the push.
        for attempt in range(len(self.clients) + 1):
            t0 = time.perf_counter()
            restarted += self._restart_down()
            try:
                if self._group_stale:
                    regrouped = True
                    self._regroup()
                restart_s += time.perf_counter() - t0
                self._left_paused = True  # until the update returns
                stats = self._updater.update(named_tensors(), weight_version=str(version))
                self._left_paused = False
                break
            except WeightSyncError as e:
                restart_s += time.perf_counter() - t0
                newly_dead = self._probe(may_be_paused=True)
                if not newly_dead or attempt == len(self.clients):
                    raise
                logger.warning("weight push failed with servers %s dead: %s", newly_dead, e)
                found += newly_dead
        # A slot restarted and then found dead again in a retry is down, not restarted.
        restarted = [i for i in dict.fromkeys(restarted) if i in self._live]
        for i in restarted:
            reported = self.clients[i].get_weight_version()
            if reported != str(version):
                raise WeightSyncError(
                    f"restarted server {self.clients[i].base_url} reports weight_version "
                    f"{reported!r} after the push of version {version}"
                )
        return PushReport(
            update=stats,
            found_dead=tuple(dict.fromkeys(found)),
            restarted=tuple(restarted),
            down=tuple(sorted(self.down)),
            regrouped=regrouped,
            restart_s=restart_s,
        )

    def close(self) -> None:
        """Close the weight-update group (a dead member's failure is logged, not raised: the
        local side is released regardless) and the retired clients. Servers keep running."""
        self._close_updater()
        for client in self._retired:
            client.close()
        self._retired.clear()

    # -- internals ---------------------------------------------------------------------------
    def _leave(self, i: int, why: str) -> None:
        self._live.discard(i)
        self._group_stale = True
        logger.warning("rollout server %d (%s) is dead: %s", i, self.clients[i].base_url, why)

    def _probe(self, may_be_paused: bool = False) -> list[int]:
        """Members that are dead now (they leave the fleet); ``may_be_paused`` probes with
        /model_info instead of /health (see ``FleetConfig``)."""
        dead = []
        for i in sorted(self._live):
            server = self.servers[i]
            if server is not None and not server.running:
                why = f"process exited with code {server.process.returncode}"
            else:
                why = self._health_error(self.clients[i], may_be_paused)
                if why is None:
                    continue
            self._leave(i, why)
            dead.append(i)
        return dead

    def _health_error(self, client: SGLangClient, may_be_paused: bool = False) -> str | None:
        """None when the probe (GET /health, or /model_info for a server that may be paused)
        answers 200 within the probe timeout, else why not."""
        endpoint = "/model_info" if may_be_paused else "/health"
        try:
            response = httpx.get(
                f"{client.base_url}{endpoint}",
                timeout=self.config.health_timeout_s,
                headers=client.keys.header_for(endpoint),
            )
        except httpx.HTTPError as e:
            return f"{endpoint} failed: {e!r}"
        return None if response.status_code == 200 else f"{endpoint} -> {response.status_code}"

    def _restart_down(self) -> list[int]:
        """Restart every down embedded slot allowed to restart; the ones that came back."""
        back = []
        for i in sorted(self.down):
            server = self.servers[i]
            if server is None or not self.config.restart_dead:
                continue
            if self.restarts[i] >= self.config.max_restarts:
                if i not in self._given_up:  # once, not at every push
                    self._given_up.add(i)
                    logger.error(
                        "rollout server %d stays dead: %d restarts used", i, self.restarts[i]
                    )
                continue
            self.restarts[i] += 1
            try:
                server.restart()
            except RuntimeError as e:
                logger.error("restart %d of rollout server %d failed: %s", self.restarts[i], i, e)
                continue
            # The old client is not closed now: a pool thread may still be inside a call on
            # it, and a closed httpx client raises an error the pool would not read as a dead
            # server. It is closed with the fleet.
            self._retired.append(self.clients[i])
            self.clients[i] = self.client_factory(server)
            self._live.add(i)
            back.append(i)
            logger.warning("rollout server %d restarted at %s", i, server.url)
        return back

    def _regroup(self) -> None:
        """Close the current group and connect a new one over the live slots.

        Raises:
            WeightSyncError: when no slot is live or a member fails to join.
        """
        self._close_updater()
        members = tuple(sorted(self._live))
        if not members:
            raise WeightSyncError(
                f"no live rollout server left (restarts per slot: {self.restarts}, "
                f"max_restarts={self.config.max_restarts}; URL servers are not restarted)"
            )
        updater = self.updater_cls(
            [self.clients[i] for i in members],
            ranks_per_server=[self._ranks[i] for i in members],
            **self._options,
        )
        try:
            updater.connect()
        except BaseException:
            try:
                updater.close()
            except WeightSyncError as e:
                logger.warning("closing a weight-update group that failed to form: %s", e)
            raise
        self._updater, self._group_stale = updater, False

    def _close_updater(self) -> None:
        if self._updater is None:
            return
        updater, self._updater, self._group_stale = self._updater, None, True
        try:
            updater.close()
        except WeightSyncError as e:
            # A dead member cannot destroy its side; ours is released regardless.
            logger.warning("closing the weight-update group: %s", e)


class ServerSlots(Protocol):
    """What :func:`sync_servers` needs of a rollout pool (both pools have it)."""

    def down_servers(self) -> set[int]: ...

    def mark_dead(self, index: int) -> None: ...

    def replace_server(self, index: int, client: SGLangClient) -> None: ...


def sync_servers(
    fleet: RolloutFleet,
    pools: Sequence[ServerSlots],
    named_tensors: NamedTensors,
    version: int,
    *,
    max_reply_bytes: int = 0,
) -> PushReport:
    """One weight push with the pools kept in step: the servers the pools found dead are
    replaced or dropped, the weights pushed (:meth:`RolloutFleet.push`), and only then each
    restarted slot's new client handed to every pool, and every down slot marked dead in every
    pool (one pool may not have noticed what another, or the fleet's probe, found).

    Every client's reply guard (``rollout.protocol``) learns ``version`` before the push (a
    server may answer with it as soon as its last bucket landed) and again after it (restarted
    servers' new clients), with the fixed reply cap ``max_reply_bytes`` (0: per request).

    Raises:
        WeightSyncError: as :meth:`RolloutFleet.push`.
        TypeError: a client without a reply guard.
    """
    dead = set().union(*(pool.down_servers() for pool in pools))
    guard_clients(fleet.clients, version, max_reply_bytes)
    report = fleet.push(named_tensors, version, dead=dead)
    guard_clients(fleet.clients, version, max_reply_bytes)
    for pool in pools:
        for i in report.down:
            pool.mark_dead(i)
        for i in report.restarted:
            pool.replace_server(i, fleet.clients[i])
    return report
