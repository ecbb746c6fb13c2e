"""Trainer side of the weight push: bucketed broadcast to SGLang-compatible rollout servers."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megatron_sat.platform.host_copy import unpacked_from_bytes as platform_unpacked_from_bytes
from megatron_sat.rollout.client import PAUSE_MODES, SGLangClient
from megatron_sat.weight_sync.buckets import Bucket, BucketProducer, pack_order
from megatron_sat.weight_sync.group import (
    WeightUpdateGroup,
    create_weight_update_group,
    host_store,
)

__all__ = ["UpdateStats", "WeightSyncError", "WeightUpdater", "pack_order"]


class WeightSyncError(RuntimeError):
    """A weight push failed; the message names the servers, parameters and the servers' state."""


@dataclass(frozen=True)
class UpdateStats:
    """What one ``WeightUpdater.update`` sent: tensors, bytes, buckets, wall seconds."""

    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float


class WeightUpdater:
    """Pushes HF-named tensors from trainer rank 0 to every rollout server (SGLang's protocol).

    Setup, ``connect()``: rank 0 hosts a TCPStore (``master_port=None`` lets the OS pick the
    port) and posts ``/init_weights_update_group`` (``rank_offset`` = 1 + ranks of the servers
    before it, ``world_size`` = 1 + all server ranks) to every server concurrently while it
    builds rank 0 of the group.

    One ``update(named_tensors, weight_version)`` (sglang 0.5.23's protocol):

    1. ``/pause_generation`` (``pause_mode``) on every server, then ``/begin_weight_update``
       (``{"selector": "all"}``): SGLang refuses ``/update_weights_from_distributed`` outside
       such a session (HTTP 400, before joining the broadcast).
    2. Tensors are packed in the caller's order into buckets of at most ``bucket_bytes`` (a
       larger tensor travels alone), each bucket ordered by element size (``pack_order``) so
       that every tensor is aligned in the flattened bytes. Per bucket,
       ``/update_weights_from_distributed`` with ``names``, ``dtypes`` ("float32", "bfloat16",
       ...), ``shapes`` and ``group_name`` is posted to every server concurrently while rank 0
       broadcasts each tensor of the bucket, in order, with its own dtype (by default
       flattened into one uint8 broadcast per bucket, SGLang's ``flattened_bucket``); then
       every reply is awaited before the next bucket is posted (a server receives whichever
       request it dequeues first, so posting ahead could pair a request with another
       bucket's broadcast). Meanwhile a background thread gathers (the export's collectives)
       and packs bucket k+1 into the second of two reused staging buffers
       (``buckets.BucketProducer``), so the sender's copy overlaps the wire. Tensors of at
       least ``unpacked_from_bytes`` (gloo default 256 KiB; none on nccl) go in buckets of
       their own, sent per tensor (``load_format`` null), no packing. Only the final
       bucket carries ``weight_version``, so a
       server's version changes only once all of its buckets loaded. The cache flush is
       SGLang's own, after loading (``flush_cache`` of the request; SGLang fails the update
       if the flush is refused because requests run or wait): on the final bucket for pause
       modes "abort" (nothing left) and "retract" (running requests went back to the waiting
       queue, which a paused server's flush ignores); never for "in_place", whose paused
       requests stay in the running batch with their KV cache, so a flush is refused until
       they finish -- keeping that cache across the update is what "in_place" means. No
       separate ``/flush_cache`` call: one before the update would be refused under
       "in_place", and the cache it clears is refilled by nothing while generation is paused.
    3. ``/end_weight_update`` (``{}``), then ``/continue_generation``, on every server.

    Failures: a failure inside the session (a rejected bucket, a failed call) first ends the
    session on every server that began one (``/end_weight_update``): SGLang refuses a second
    ``/begin_weight_update`` while one is open, so a retry could not start otherwise;
    ``weight_version`` stays the old one. A server validates each request before loading it
    (see the embedded server's docstring: a mismatching request is still received, then
    rejected whole, naming each bad parameter). If no server applied any bucket yet,
    generation is resumed and ``WeightSyncError`` raised: weights and versions are unchanged.
    If some bucket was already applied somewhere, the servers hold a mix of old and new
    weights under the old version, so they are left paused and ``WeightSyncError`` says so:
    retry ``update`` (it ends with ``/continue_generation``). Buckets are lazy: at most two
    are materialised at a time (2 x ``bucket_bytes`` of staging on the group's device).

    The three steps are also public (``begin_update``, ``send_buckets``, ``end_update``) for
    a push with several senders, one per pipeline stage, each over its own group
    (``megatron_push.push_megatron_weights``): one updater runs steps 1 and 3, every stage's
    updater sends its own buckets in turn, the last stage's last bucket with the version.

    Args:
        clients: one client per server.
        master_address: the trainer's address as the servers see it.
        master_port: TCPStore port; None lets the OS choose.
        group_name: name of the group on every server; default a fresh
            ``megatron_sat_weights_<hex>``, since torch registers group names per process and
            two updaters in one process must not share one.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        bucket_bytes: bucket size limit, bytes.
        ranks_per_server: group ranks each server takes (its TP size for SGLang); default 1.
        pause_mode: SGLang pause mode used in step 1.
        timeout_s: rendezvous and broadcast timeout, seconds.
        flatten_buckets: send each bucket as one uint8 broadcast (``load_format=
            "flattened_bucket"``, as SGLang) instead of one broadcast per tensor.
        unpacked_from_bytes: with ``flatten_buckets``, tensors of at least this many bytes
            travel in buckets of their own, one broadcast per tensor (``load_format`` null:
            no packing copy on either side), the smaller ones flattened; "auto": the
            platform's choice for ``backend`` (``platform.host_copy.unpacked_from_bytes``:
            256 KiB on gloo, everything flattened on nccl); None: everything flattened.
    """

    def __init__(
        self,
        clients: Sequence[SGLangClient],
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str | None = None,
        backend: str = "gloo",
        bucket_bytes: int = 512 * 2**20,
        *,
        ranks_per_server: Sequence[int] | None = None,
        pause_mode: str = "retract",
        timeout_s: float = 600.0,
        flatten_buckets: bool = True,
        unpacked_from_bytes: int | None | str = "auto",
    ) -> None:
        if not clients:
            raise ValueError("clients must not be empty")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.ranks_per_server = list(ranks_per_server or [1] * len(clients))
        if len(self.ranks_per_server) != len(clients) or min(self.ranks_per_server) < 1:
            raise ValueError(f"ranks_per_server {self.ranks_per_server} for {len(clients)} servers")
        self.clients = list(clients)
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name or f"megatron_sat_weights_{uuid.uuid4().hex[:8]}"
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.flatten_buckets = flatten_buckets
        if unpacked_from_bytes == "auto":
            unpacked_from_bytes = platform_unpacked_from_bytes(backend)
        if unpacked_from_bytes is not None and (
            isinstance(unpacked_from_bytes, str) or unpacked_from_bytes < 1
        ):
            raise ValueError(
                f"unpacked_from_bytes must be 'auto', None or >= 1, got {unpacked_from_bytes!r}"
            )
        self.unpacked_from_bytes = unpacked_from_bytes
        self.world_size = 1 + sum(self.ranks_per_server)
        self._pool = ThreadPoolExecutor(len(self.clients), thread_name_prefix="weight_sync")
        self._group: WeightUpdateGroup | None = None
        # Buckets are packed here, reused across updates (grown on demand): a fresh buffer per
        # bucket costs its page faults, on a CPU about as long as the broadcast itself. Two:
        # bucket k+1 is packed into one while bucket k is broadcast from the other.
        self._staging: list[torch.Tensor | None] = [None, None]
        self._loaded = False
        self._began: list[SGLangClient] = []

    def __enter__(self) -> WeightUpdater:
        self.connect()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def connect(self) -> None:
        """Form the group with every server (blocks until all joined, up to ``timeout_s``).

        Raises:
            WeightSyncError: naming each server that failed to join.
        """
        if self._group is not None:
            raise RuntimeError("WeightUpdater is already connected")
        store = host_store(
            self.master_address, self.master_port or 0, self.world_size, self.timeout_s
        )
        offsets = [1 + sum(self.ranks_per_server[:i]) for i in range(len(self.clients))]
        futures = [
            self._pool.submit(
                c.init_weights_update_group,
                self.master_address,
                store.port,
                offset,
                self.world_size,
                self.group_name,
                self.backend,
            )
            for c, offset in zip(self.clients, offsets, strict=True)
        ]
        # Rank 0 joins on a daemon thread so that a server that refuses to join fails connect()
        # now, instead of after the rendezvous timeout (the thread then times out on its own).
        built: dict[str, object] = {}

        def build() -> None:
            try:
                built["group"] = create_weight_update_group(
                    self.master_address,
                    store.port,
                    rank=0,
                    world_size=self.world_size,
                    group_name=self.group_name,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                    store=store,
                )
            except Exception as e:
                built["error"] = e

        thread = threading.Thread(target=build, name="weight_group_rank0", daemon=True)
        thread.start()
        self._raise_failures("init_weights_update_group", futures)
        thread.join()
        if "error" in built:
            raise WeightSyncError(f"rank 0 failed to join {self.group_name!r}: {built['error']!r}")
        self._group = built["group"]

    def update(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str
    ) -> UpdateStats:
        """Push every tensor (HF names, e.g. per-expert ``mlp.experts.{e}.up_proj.weight``):
        ``begin_update``, ``send_buckets`` (the version with the last bucket), ``end_update``.

        Raises:
            ValueError: on an empty update, an empty version or a repeated name.
            WeightSyncError: when a server rejects a bucket or a call fails (see class docstring).
        """
        if not weight_version:
            raise ValueError("weight_version must be a non-empty string")
        start = time.perf_counter()
        self.begin_update()
        try:
            stats = self.send_buckets(named_tensors, weight_version)
        except BaseException as e:
            self.end_update(e)
            raise  # end_update raised already; this is for type checkers
        self.end_update()
        return dataclasses.replace(stats, seconds=time.perf_counter() - start)

    def begin_update(self) -> None:
        """Step 1 on every server: ``/pause_generation``, then ``/begin_weight_update``.

        Raises:
            RuntimeError: when not connected.
            WeightSyncError: a call failed; the sessions that opened were ended and
                generation resumed (nothing changed on any server).
        """
        if self._group is None:
            raise RuntimeError("call connect() before update()")
        self._loaded = False
        self._began = []
        try:
            self._on_all_servers("pause_generation", lambda c: c.pause_generation(self.pause_mode))
            self._begin_sessions(self._began)
        except WeightSyncError as e:
            self.end_update(e)

    def send_buckets(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None
    ) -> UpdateStats:
        """Step 2 over this updater's group: the buckets of ``named_tensors``, the last one
        with ``weight_version`` and SGLang's flush (None: no bucket carries either, another
        sender's last bucket does). Bucket k+1 is gathered and packed on a background thread
        (``buckets.BucketProducer``) while bucket k is posted and broadcast; each bucket's
        ``/update_weights_from_distributed`` is posted only after every server answered the
        previous one, so a server (which receives whichever request it dequeues first) always
        joins the broadcast its request describes. Needs the servers inside a session
        (``begin_update``, here or on another updater of the same servers).

        Returns:
            What was sent; ``seconds`` is this call's wall time.

        Raises:
            RuntimeError: when not connected.
            ValueError: on no tensors or a repeated name.
            WeightSyncError: a server rejected a bucket or the broadcast failed.
            Whatever iterating ``named_tensors`` raised. After any failure ``loaded_any`` says
            whether some server loaded a bucket of this update.
        """
        if self._group is None:
            raise RuntimeError("call connect() before update()")
        start = time.perf_counter()
        self._loaded = False
        if self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        num_tensors = num_bytes = num_buckets = 0
        producer = BucketProducer(
            named_tensors,
            self.bucket_bytes,
            device,
            flatten=self.flatten_buckets,
            staging=self._staging,
            unpacked_from_bytes=self.unpacked_from_bytes,
        )
        with producer:
            for bucket in producer:
                version = weight_version if bucket.is_last else None
                num_loaded, failures = self._send_bucket(bucket, version)
                producer.release(bucket)
                self._loaded |= num_loaded > 0
                if failures:
                    names = ", ".join(bucket.names[:3])
                    raise WeightSyncError(
                        f"update_weights_from_distributed of bucket {num_buckets} "
                        f"({len(bucket.names)} tensors: {names}"
                        f"{', ...' if len(bucket.names) > 3 else ''}) failed:\n"
                        + "\n".join(failures)
                    )
                num_tensors += len(bucket.names)
                num_bytes += bucket.num_bytes
                num_buckets += 1
        if num_buckets == 0:
            raise ValueError("update() got no tensors")
        return UpdateStats(num_tensors, num_bytes, num_buckets, time.perf_counter() - start)

    @property
    def loaded_any(self) -> bool:
        """Whether some server loaded a bucket of the last ``send_buckets``."""
        return self._loaded

    def end_update(self, error: BaseException | None = None, *, loaded_elsewhere: bool = False):
        """Step 3 on every server: ``/end_weight_update`` where a session is open, then
        ``/continue_generation`` -- unless the update failed (``error``) after some server
        loaded a bucket (here, or through another sender: ``loaded_elsewhere``): the servers
        then stay paused with mixed weights under their old version until a retry.

        Raises:
            WeightSyncError: a call failed (after a successful update); or, given ``error``,
                always: ``error`` itself when it is neither a ``WeightSyncError`` nor a
                ``ValueError`` (an interrupt, the export's collective), else a
                ``WeightSyncError`` that says in which state the servers are (a
                ``ValueError`` raised before anything loaded is re-raised as is).
        """
        began, self._began = self._began, []
        loaded = self._loaded or loaded_elsewhere
        if error is None:
            self._on_servers("end_weight_update", began, lambda c: c.end_weight_update())
            self._on_all_servers("continue_generation", lambda c: c.continue_generation())
            return
        if not isinstance(error, (WeightSyncError, ValueError)):
            # Anything else (the tensor source's gather collective, a CUDA OOM while staging,
            # an interrupt) still ends the open sessions, or every retry's /begin_weight_update
            # would be refused; servers that loaded a bucket stay paused, as above.
            with contextlib.suppress(WeightSyncError):
                if began:
                    self._on_servers("end_weight_update", began, lambda c: c.end_weight_update())
                if not loaded:
                    self._on_all_servers("continue_generation", lambda c: c.continue_generation())
            raise error
        e = error
        if began:
            try:
                self._on_servers("end_weight_update", began, lambda c: c.end_weight_update())
            except WeightSyncError as end_error:
                e = WeightSyncError(f"{e}\n{end_error}")
        if loaded:
            raise WeightSyncError(
                f"{e}\nSome servers already loaded earlier buckets; all servers stay paused "
                "with mixed weights under their old weight_version: retry update()."
            ) from error
        self._on_all_servers("continue_generation", lambda c: c.continue_generation())
        if isinstance(e, ValueError):
            raise e
        raise WeightSyncError(f"{e}\nNo server changed weights; generation resumed.") from error

    def _send_bucket(self, bucket: Bucket, weight_version: str | None) -> tuple[int, list[str]]:
        """Post one bucket to all servers while broadcasting it.

        Returns:
            (servers that loaded the bucket, one line per failure).
        """
        load_format = "flattened_bucket" if bucket.flat is not None else None
        futures = [
            self._pool.submit(
                c.update_weights_from_distributed,
                bucket.names,
                bucket.dtypes,
                bucket.shapes,
                group_name=self.group_name,
                weight_version=weight_version,
                flush_cache=weight_version is not None and self.pause_mode != "in_place",
                load_format=load_format,
            )
            for c in self.clients
        ]
        broadcast_error = None
        try:
            if bucket.flat is not None:
                # One collective per bucket (SGLang's flattened_bucket).
                self._group.broadcast(bucket.flat, src=0)
            else:
                # SGLang's per-tensor protocol, as slime sends it: every tensor's broadcast
                # enqueued, then all awaited.
                works = [self._group.broadcast(t, src=0, async_op=True) for t in bucket.tensors]
                for work in works:
                    work.wait()
        except RuntimeError as e:  # gloo/nccl timeout or a peer that went away
            broadcast_error = e
        failures = _failures(self.clients, futures)
        num_loaded = len(self.clients) - len(failures)
        if broadcast_error is not None:
            failures.append(
                f"  rank 0 broadcast failed ({broadcast_error!r}); the group may be unusable: "
                "close() and connect() again"
            )
        return num_loaded, failures

    def _begin_sessions(self, began: list[SGLangClient]) -> None:
        """``/begin_weight_update`` on every server; ``began`` gets those that opened one."""
        futures = [self._pool.submit(c.begin_weight_update) for c in self.clients]
        for client, future in zip(self.clients, futures, strict=True):
            if future.exception() is None:
                began.append(client)
        self._raise_failures("begin_weight_update", futures)

    def _on_all_servers(self, what: str, call: Callable[[SGLangClient], None]) -> None:
        self._on_servers(what, self.clients, call)

    def _on_servers(
        self, what: str, clients: Sequence[SGLangClient], call: Callable[[SGLangClient], None]
    ) -> None:
        self._raise_failures(what, [self._pool.submit(call, c) for c in clients], clients)

    def _raise_failures(
        self, what: str, futures: list[Future], clients: Sequence[SGLangClient] | None = None
    ) -> None:
        failures = _failures(self.clients if clients is None else clients, futures)
        if failures:
            raise WeightSyncError(f"{what} failed:\n" + "\n".join(failures))

    def close(self) -> None:
        """Destroy the group on every server and here; safe to call twice.

        Raises:
            WeightSyncError: naming servers that failed to destroy their side (the local side
                and the thread pool are released regardless).
        """
        try:
            if self._group is not None:
                self._on_all_servers(
                    "destroy_weights_update_group",
                    lambda c: c.destroy_weights_update_group(self.group_name),
                )
        finally:
            if self._group is not None:
                self._group.destroy()
                self._group = None
            self._staging = [None, None]
            self._pool.shutdown(wait=True)


def _failures(clients: Sequence[SGLangClient], futures: Sequence[Future]) -> list[str]:
    """Wait for every future; one line per failed server."""
    lines = []
    for client, future in zip(clients, futures, strict=True):
        try:
            future.result()
        except Exception as e:
            lines.append(f"  {client.base_url}: {e}")
    return lines
