"""The weight push's protocol, written once for every engine.

One ``update(named_tensors, weight_version)``:

1. ``begin_update``: pause generation on every server, then open its weight-update session.
2. ``send_buckets``: per bucket, post its metadata to every server while rank 0 broadcasts it
   over the group; no server may take a bucket's request before the previous one's (the
   engine's updater says when the next may be posted).
3. ``end_update``: close the sessions (the engine sets the version then, or with the last
   bucket), then continue generation; the servers report ``weight_version`` afterwards.

Set-up (``connect``): rank 0 hosts the group's TCPStore, posts the engine's join call to every
server concurrently (``rank_offset`` = 1 + ranks of the servers before it, ``world_size`` =
1 + all server ranks) and builds rank 0 of the group on a daemon thread meanwhile, so that a
server that refuses to join fails ``connect`` at once. ``close`` makes every server leave.

A subclass is one engine's transport: its join / begin / bucket / end / leave calls and what a
failure leaves on the servers (``_fail``); the servers are reached through channels
(``weight_sync.channel``), never through a rollout client's type.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

import torch

from megatron_sat.weight_sync.channel import UpdateChannel
from megatron_sat.weight_sync.group import (
    WeightUpdateGroup,
    create_weight_update_group,
    host_store,
)


class WeightSyncError(RuntimeError):
    """A weight push failed; the message names the servers, parameters and the servers' state."""


@dataclass(frozen=True)
class UpdateStats:
    """What one ``WeightUpdater.update`` sent: tensors, bytes, buckets, wall seconds."""

    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float


class BaseWeightUpdater(abc.ABC):
    """Pushes HF-named tensors from trainer rank 0 to every server (module docstring).

    Args:
        clients: one channel per server.
        master_address: the trainer's address as the servers see it.
        master_port: the group's TCP port; None lets the OS choose.
        group_name: the group's name on every server; default a fresh ``<group_prefix><hex>``
            (torch registers group names per process: two updaters must not share one).
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        bucket_bytes: bucket size limit, bytes.
        ranks_per_server: group ranks each server takes; default 1.
        pause_mode: the pause mode of step 1.
        timeout_s: rendezvous and broadcast timeout, seconds.
    """

    group_prefix = "megatron_sat_weights_"
    thread_name = "weight_sync"
    # The engine's name of each step's call, as failures report it.
    calls = {
        "join": "init_weights_update_group",
        "pause": "pause_generation",
        "begin": "begin_weight_update",
        "end": "end_weight_update",
        "resume": "continue_generation",
        "leave": "destroy_weights_update_group",
    }

    def __init__(
        self,
        clients: Sequence[UpdateChannel],
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str | None = None,
        backend: str = "gloo",
        bucket_bytes: int = 512 * 2**20,
        *,
        ranks_per_server: Sequence[int] | None = None,
        pause_mode: str = "retract",
        timeout_s: float = 600.0,
    ) -> None:
        if not clients:
            raise ValueError("clients must not be empty")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.ranks_per_server = list(ranks_per_server or [1] * len(clients))
        if len(self.ranks_per_server) != len(clients) or min(self.ranks_per_server) < 1:
            raise ValueError(f"ranks_per_server {self.ranks_per_server} for {len(clients)} servers")
        self.clients = list(clients)
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name or f"{self.group_prefix}{uuid.uuid4().hex[:8]}"
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.world_size = 1 + sum(self.ranks_per_server)
        # Two calls per server may be in flight: a pipelined push posts bucket k+1 while
        # bucket k's reply is outstanding.
        self._pool = ThreadPoolExecutor(2 * len(self.clients), thread_name_prefix=self.thread_name)
        self._group: WeightUpdateGroup | Any | None = None
        self._loaded = False
        self._open: list[UpdateChannel] = []  # servers inside a session
        self._updating = threading.Lock()  # held by update()

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    # -- set-up -------------------------------------------------------------------------------
    def connect(self) -> None:
        """Form the group with every server (blocks until all joined, up to ``timeout_s``).

        Raises:
            WeightSyncError: naming each server that failed to join.
        """
        if self._group is not None:
            raise RuntimeError(f"{type(self).__name__} is already connected")
        store = self._host_store()
        port = self.master_port if store is None else store.port
        offsets = [1 + sum(self.ranks_per_server[:i]) for i in range(len(self.clients))]
        futures = [
            self._pool.submit(self._join, c, port, offset)
            for c, offset in zip(self.clients, offsets, strict=True)
        ]
        built: dict[str, Any] = {}

        def build() -> None:
            try:
                built["group"] = self._rank0_group(port, store)
            except Exception as e:
                built["error"] = e

        # Rank 0 joins on a daemon thread so that a server that refuses to join fails connect()
        # now, instead of after the rendezvous timeout (the thread then times out on its own).
        thread = threading.Thread(target=build, name=f"{self.thread_name}_rank0", daemon=True)
        thread.start()
        self._raise_failures(self.calls["join"], futures)
        thread.join()
        if "error" in built:
            raise WeightSyncError(f"rank 0 failed to join {self.group_name!r}: {built['error']!r}")
        self._group = built["group"]

    def _host_store(self) -> Any:
        """The group's store, hosted here (None when the backend rendezvous on its own)."""
        return host_store(
            self.master_address, self.master_port or 0, self.world_size, self.timeout_s
        )

    def _rank0_group(self, port: int, store: Any) -> Any:
        """This process's end of the group (rank 0)."""
        return create_weight_update_group(
            self.master_address,
            port,
            rank=0,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
            timeout_s=self.timeout_s,
            store=store,
        )

    @abc.abstractmethod
    def _join(self, channel: Any, port: int, rank_offset: int) -> None:
        """Ask one server to join the group at ``rank_offset``."""
        ...

    # -- one update ---------------------------------------------------------------------------
    def update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str
    ) -> UpdateStats:
        """Push every tensor (HF names, e.g. per-expert ``mlp.experts.{e}.up_proj.weight``):
        ``begin_update``, ``send_buckets``, ``end_update`` with ``weight_version``.

        Raises:
            ValueError: on an empty update, an empty version or a repeated name.
            RuntimeError: when not connected, or while another ``update`` of this updater
                runs (on another thread).
            WeightSyncError: when a server rejects a bucket or a call fails (``_fail`` says in
                which state the servers are).
        """
        if not weight_version:
            raise ValueError("weight_version must be a non-empty string")
        if self._group is None:
            raise RuntimeError("call connect() before update()")
        # One push at a time: a second would share the sessions and the staging buffers.
        if not self._updating.acquire(blocking=False):
            raise RuntimeError(f"{type(self).__name__}: another update() is in progress")
        try:
            return self._update(named_tensors, weight_version)
        finally:
            self._updating.release()

    def _update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str
    ) -> UpdateStats:
        """``update``'s three steps, the tensors taken through ``prepare`` from the start."""
        start = time.perf_counter()
        with self.prepare(named_tensors) as source:
            self.begin_update()
            try:
                stats = self.send_buckets(source, weight_version)
            except BaseException as e:
                self.end_update(e)
                raise  # end_update raised already; this is for type checkers
        self.end_update(weight_version=weight_version)
        return dataclasses.replace(stats, seconds=time.perf_counter() - start)

    def prepare(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> contextlib.AbstractContextManager[Any]:
        """A context whose value ``update`` hands to ``send_buckets``, entered before the
        servers pause, so that an engine's transport may start on the tensors meanwhile
        (``WeightUpdater`` gathers and packs its first buckets); leaving it stops that work.
        Default: the tensors themselves."""
        return contextlib.nullcontext(named_tensors)

    def begin_update(self) -> None:
        """Step 1 on every server: pause, then open the session.

        Raises:
            RuntimeError: when not connected.
            WeightSyncError: a call failed; as ``end_update`` with that error (so is any
                other exception, e.g. an interrupt, re-raised as it is).
        """
        if self._group is None:
            raise RuntimeError("call connect() before update()")
        self._loaded = False
        self._open = []
        pauses: list[Future] = []
        begins: list[Future] = []
        try:
            pause = self.pause_mode
            pauses = [self._pool.submit(c.pause_generation, pause) for c in self.clients]
            self._raise_failures(self.calls["pause"], pauses)
            begins = [self._pool.submit(self._begin, c) for c in self.clients]
            self._raise_failures(self.calls["begin"], begins)
        except BaseException as e:
            # Also an interrupt while the calls travel: let them land first, so that every
            # session that opened is ended (SGLang refuses a second begin while one is open,
            # so it would refuse every later push) and the resume comes after the pauses.
            futures_wait(pauses + begins)
            self._open = [c for c, f in zip(self.clients, begins) if f.exception() is None]
            self.end_update(e)
            raise  # end_update raised already; this is for type checkers
        self._open = list(self.clients)

    @abc.abstractmethod
    def send_buckets(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None
    ) -> UpdateStats:
        """Step 2: every bucket of ``named_tensors``; sets ``loaded_any``."""
        ...

    @property
    def loaded_any(self) -> bool:
        """Whether some server loaded a bucket of the last ``send_buckets``."""
        return self._loaded

    def end_update(
        self,
        error: BaseException | None = None,
        *,
        loaded_elsewhere: bool = False,
        weight_version: str | None = None,
    ) -> None:
        """Step 3 on every server: close the open sessions (``_end``, with ``weight_version``
        where the engine sets it there), then ``_after_sessions`` and continue generation.
        Given ``error`` (the update failed), or when step 3 fails, ``_fail`` decides what the
        servers are left with and raises.

        Raises:
            WeightSyncError: always given ``error`` (or ``error`` itself: see ``_fail``); on
                a failed call otherwise.
        """
        if error is None:
            try:
                self._end_sessions(weight_version)
                self._after_sessions()
                self._on_servers(
                    self.calls["resume"], self.clients, lambda c: c.continue_generation()
                )
                return
            except WeightSyncError as e:
                self._end_failed(e)
                return
        self._fail(error, self._loaded or loaded_elsewhere)

    def _end_sessions(self, weight_version: str | None) -> None:
        """Close every open session (raising on failures); ``_open`` keeps the ones that did
        not close."""
        open_, self._open = self._open, []
        futures = [self._pool.submit(self._end, c, weight_version) for c in open_]
        self._open = [c for c, f in zip(open_, futures, strict=True) if f.exception() is not None]
        self._raise_failures(self.calls["end"], futures, open_)

    def _after_sessions(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """What the engine needs between closing the sessions and continuing generation."""

    def _end_failed(self, error: WeightSyncError) -> None:
        """Step 3 failed after a successful ``send_buckets``: the servers stay paused."""
        raise error

    @abc.abstractmethod
    def _begin(self, channel: Any) -> None: ...

    @abc.abstractmethod
    def _end(self, channel: Any, weight_version: str | None) -> None: ...

    @abc.abstractmethod
    def _fail(self, error: BaseException, loaded: bool) -> None:
        """The update failed with ``error`` (``loaded``: some server loaded a bucket): close
        what is open, resume when nothing changed, and raise saying in which state the
        servers are."""
        ...

    @abc.abstractmethod
    def _leave(self, channel: Any) -> None: ...

    # -- plumbing -----------------------------------------------------------------------------
    def _on_servers(self, what: str, clients: Sequence[Any], call: Callable[[Any], None]) -> None:
        self._raise_failures(what, [self._pool.submit(call, c) for c in clients], clients)

    def _raise_failures(
        self, what: str, futures: list[Future], clients: Sequence[Any] | None = None
    ) -> None:
        failures = failure_lines(self.clients if clients is None else clients, futures)
        if failures:
            raise WeightSyncError(f"{what} failed:\n" + "\n".join(failures))

    def close(self) -> None:
        """Make every server leave the group, and leave it here; safe to call twice.

        Raises:
            WeightSyncError: naming servers that failed to leave (the local side and the
                thread pool are released regardless).
        """
        try:
            if self._group is not None:
                self._on_servers(self.calls["leave"], self.clients, self._leave)
        finally:
            if self._group is not None:
                if isinstance(self._group, WeightUpdateGroup):
                    self._group.destroy()
                self._group = None
            self._release_staging()
            self._pool.shutdown(wait=True)

    def _release_staging(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """Drop the reused staging buffers."""


def failure_lines(clients: Sequence[Any], futures: Sequence[Future]) -> list[str]:
    """Wait for every future; one line per failed server."""
    lines = []
    for client, future in zip(clients, futures, strict=True):
        try:
            future.result()
        except Exception as e:
            lines.append(f"  {client.base_url}: {e}")
    return lines
