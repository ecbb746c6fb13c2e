"""Trainer side of the weight push: bucketed broadcast to SGLang-compatible rollout servers."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from megatron_sat.weight_sync.buckets import Bucket, BucketProducer, pack_order
from megatron_sat.weight_sync.channel import PAUSE_MODES, SGLangUpdateChannel
from megatron_sat.weight_sync.request_order import can_pipeline_requests
from megatron_sat.weight_sync.updater import (
    BaseWeightUpdater,
    UpdateStats,
    WeightSyncError,
    failure_lines,
)

__all__ = ["UpdateStats", "WeightSyncError", "WeightUpdater", "pack_order"]

# SGLang 0.5.23's answer when an update loaded (and recorded its weight_version) but the cache
# flush after it was refused (srt/managers/scheduler_components/weight_updater.py,
# flush_cache_after_weight_update): the weights are in, unlike any other failure.
SGLANG_FLUSH_REFUSED = "Weights were updated, but the cache was not flushed"


@dataclass
class _Posted:
    """A bucket whose request is posted: its index, names, whether it travels per tensor
    (``load_format`` null), one reply future per server, and its broadcast's error."""

    index: int
    names: list[str]
    per_tensor: bool
    futures: list[Future]
    broadcast_error: RuntimeError | None = None


class WeightUpdater(BaseWeightUpdater):
    """Pushes HF-named tensors from trainer rank 0 to every rollout server (SGLang's protocol).

    Setup, ``connect()``: rank 0 hosts a TCPStore (``master_port=None`` lets the OS pick the
    port) and posts ``/init_weights_update_group`` (``rank_offset`` = 1 + ranks of the servers
    before it, ``world_size`` = 1 + all server ranks) to every server concurrently while it
    builds rank 0 of the group.

    One ``update(named_tensors, weight_version)`` (sglang 0.5.23's protocol; the buckets are
    built from the start, ``prepare``, so the first one is ready when the sessions open):

    1. ``/pause_generation`` (``pause_mode``) on every server, then ``/begin_weight_update``
       (``{"selector": "all"}``): SGLang refuses ``/update_weights_from_distributed`` outside
       such a session (HTTP 400, before joining the broadcast).
    2. Tensors are packed in the caller's order into buckets of at most ``bucket_bytes`` (a
       larger tensor travels alone), each bucket ordered by element size (``pack_order``) so
       that every tensor is aligned in the flattened bytes. Per bucket,
       ``/update_weights_from_distributed`` with ``names``, ``dtypes`` ("float32", "bfloat16",
       ...), ``shapes`` and ``group_name`` is posted to every server concurrently while rank 0
       broadcasts each tensor of the bucket, in order, with its own dtype (by default
       flattened into one uint8 broadcast per bucket, SGLang's ``flattened_bucket``). The
       next bucket is posted once every reply is in, or, with ``pipeline_requests``, once
       the first message of rank 0's broadcast of this one completed and the replies before
       it are in (a server
       takes whichever request reaches it first, so posting ahead is safe only where that
       completion proves every server took this bucket's request:
       ``weight_sync.request_order``). Meanwhile a background thread gathers (the export's
       collectives) and packs bucket k+1 into the second of two reused staging buffers
       (``buckets.BucketProducer``): on CUDA on a side stream while bucket k is on the wire,
       on the host once bucket k's broadcast completed, while the servers load it. With
       ``unpacked_from_bytes``, tensors of at least that size go in buckets of their own,
       sent per tensor (``load_format`` null). Only the final bucket carries
       ``weight_version``, so a
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
    retry ``update`` (it ends with ``/continue_generation``). One failure is not a failure to
    load: SGLang answers ``SGLANG_FLUSH_REFUSED`` when the final bucket loaded and the version
    was recorded but the flush after it was refused; the error then says the servers hold the
    new weights and version (with a cache that may hold the old weights' entries) and leaves
    them paused for a retry. Buckets are lazy: at most two
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
            no packing copy on the sender), the smaller ones flattened; None (default):
            everything flattened. SGLang receives either format aside and then copies it in,
            so a per-tensor broadcast saves only the sender's copy, and on gloo each message
            costs a rendezvous of sender and receiver: against a server that receives as
            SGLang does, all-flattened pushed 1.33-1.36x faster than per tensor on the CPU
            test machine (2 cores, ``bench/weight_sync.py``), the 256 KiB split 1.07x.
        pipeline_requests: post bucket k+1's request before bucket k's reply, once the
            first message of rank 0's broadcast of bucket k completed (``send_buckets``);
            "auto": where that
            completion proves every server joined (``request_order.can_pipeline_requests``:
            gloo, rank 0 sending to a rank of every server); True elsewhere is refused.
    """

    # Whether the last failure was only a refused flush after a complete load (see _fail).
    _flush_refused = False

    def __init__(
        self,
        clients: Sequence[SGLangUpdateChannel],
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
        unpacked_from_bytes: int | None = None,
        pipeline_requests: bool | str = "auto",
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        super().__init__(
            clients,
            master_address,
            master_port,
            group_name,
            backend,
            bucket_bytes,
            ranks_per_server=ranks_per_server,
            pause_mode=pause_mode,
            timeout_s=timeout_s,
        )
        self.flatten_buckets = flatten_buckets
        if unpacked_from_bytes is not None and (
            not isinstance(unpacked_from_bytes, int) or unpacked_from_bytes < 1
        ):
            raise ValueError(
                f"unpacked_from_bytes must be None or an int >= 1, got {unpacked_from_bytes!r}"
            )
        self.unpacked_from_bytes = unpacked_from_bytes
        safe = can_pipeline_requests(backend, self.ranks_per_server)
        if pipeline_requests == "auto":
            pipeline_requests = safe
        if not isinstance(pipeline_requests, bool):
            raise ValueError(
                f"pipeline_requests must be 'auto' or a bool, got {pipeline_requests!r}"
            )
        if pipeline_requests and not safe:
            raise ValueError(
                f"pipeline_requests=True needs a gloo group in which rank 0 sends to a rank of "
                f"every server (backend {backend!r}, ranks_per_server {self.ranks_per_server}): "
                "elsewhere a server could take bucket k+1's request during bucket k's broadcast "
                "(weight_sync.request_order)"
            )
        self.pipeline_requests = pipeline_requests
        # Buckets are packed here, reused across updates (grown on demand): a fresh buffer per
        # bucket costs its page faults, on a CPU about as long as the broadcast itself. Two:
        # bucket k+1 is packed into one while bucket k is broadcast from the other.
        self._staging: list[torch.Tensor | None] = [None, None]

    # -- SGLang's calls -----------------------------------------------------------------------
    def _join(self, channel: SGLangUpdateChannel, port: int, rank_offset: int) -> None:
        channel.init_weights_update_group(
            self.master_address,
            port,
            rank_offset,
            self.world_size,
            self.group_name,
            self.backend,
        )

    def _begin(self, channel: SGLangUpdateChannel) -> None:
        channel.begin_weight_update()

    def _end(self, channel: SGLangUpdateChannel, weight_version: str | None) -> None:
        del weight_version  # SGLang's version travels with the last bucket
        channel.end_weight_update()

    def _leave(self, channel: SGLangUpdateChannel) -> None:
        channel.destroy_weights_update_group(self.group_name)

    def _release_staging(self) -> None:
        self._staging = [None, None]

    def prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> BucketProducer:
        """The buckets of ``named_tensors``, built ahead by a ``BucketProducer``: ``update``
        enters it before the servers pause, so that the first bucket is gathered (the
        export's collectives) and packed while they pause and open their sessions; so does
        ``send_buckets`` given tensors. A subclass that changes the tensors (renames, filters)
        overrides this method: both paths take the tensors through it."""
        if self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return BucketProducer(
            named_tensors,
            self.bucket_bytes,
            device,
            flatten=self.flatten_buckets,
            staging=self._staging,
            unpacked_from_bytes=self.unpacked_from_bytes,
        )

    def send_buckets(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | BucketProducer,
        weight_version: str | None,
    ) -> UpdateStats:
        """Step 2 over this updater's group: the buckets of ``named_tensors`` (or of an entered
        ``prepare``), the last one with ``weight_version`` and SGLang's flush (None: no
        bucket carries either, another sender's last bucket does). Bucket k+1 is gathered
        and packed on a background thread (``buckets.BucketProducer``; on the host its
        packing waits for bucket k's broadcast to complete). Bucket k+1's
        ``/update_weights_from_distributed`` is posted once the first message of rank 0's
        broadcast of bucket k completed (a flattened bucket is one message) and every reply
        before bucket k's is in, so that it travels while bucket k is on the wire
        (``pipeline_requests``; the
        second and the last bucket wait for every reply: a push whose first bucket is
        refused changes nothing, and the version, which the last bucket sets, never lands
        over a failed bucket), else once bucket k's reply is in: a server receives
        whichever request it takes first, so it must take them in order
        (``weight_sync.request_order``). After a failure nothing more is posted; the
        buckets already posted are broadcast and their replies awaited.

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
        if isinstance(named_tensors, BucketProducer):  # prepare()'s, entered by the caller
            return self._send_produced(named_tensors, weight_version)
        with self.prepare(named_tensors) as producer:
            return self._send_produced(producer, weight_version)

    def _send_produced(self, producer: BucketProducer, weight_version: str | None) -> UpdateStats:
        """``send_buckets`` of the buckets of an entered ``producer``."""
        start = time.perf_counter()
        self._loaded = self._flush_refused = False
        self._server_failures: list[str] = []
        in_flight: list[_Posted] = []
        failures: list[str] = []
        try:
            counts = self._send_all(iter(producer), producer, weight_version, in_flight, failures)
        finally:
            # Every posted bucket is broadcast already: its replies come (or fail) on their own.
            self._await_replies(in_flight, 0, failures)
        if failures:
            raise WeightSyncError("\n".join(failures))
        if counts[2] == 0:
            raise ValueError("update() got no tensors")
        return UpdateStats(*counts, time.perf_counter() - start)

    def _send_all(
        self,
        buckets: Iterator[Bucket],
        producer: BucketProducer,
        weight_version: str | None,
        in_flight: list[_Posted],
        failures: list[str],
    ) -> tuple[int, int, int]:
        """Post and broadcast every bucket (``send_buckets``), appending each posted one to
        ``in_flight``; stops at the first failure. Returns (tensors, bytes, buckets) sent."""
        num_tensors = num_bytes = index = 0
        bucket, ahead = next(buckets, None), None
        while bucket is not None:
            current, ahead = ahead, None
            if current is None:  # not posted ahead: after every reply
                self._await_replies(in_flight, 0, failures)
                if failures:
                    break
                # Packed (while the servers loaded the previous bucket) before its request
                # goes out: a packing error then leaves no server waiting in its broadcast.
                bucket.wait_packed()
                current = self._post(bucket, index, weight_version)
                in_flight.append(current)
            current.broadcast_error, rest = self._start_broadcast(bucket)
            # Every server joined this bucket's broadcast (gloo's rendezvous), so holds its
            # request: the next one, posted now, queues behind it (request_order).
            upcoming = next(buckets, None) if current.broadcast_error is None else None
            if upcoming is not None and self._posts_ahead(index + 1, upcoming):
                self._await_replies(in_flight, 1, failures)  # all but the current bucket's
                if not failures:
                    ahead = self._post(upcoming, index + 1, weight_version)
                    in_flight.append(ahead)
            current.broadcast_error = current.broadcast_error or self._finish_broadcast(rest)
            producer.release(bucket)
            num_tensors += len(bucket.names)
            num_bytes += bucket.num_bytes
            index += 1
            if current.broadcast_error is not None or failures:
                break
            bucket = upcoming
        if ahead is not None:  # posted, then the current bucket failed: broadcast it too
            ahead.broadcast_error, rest = self._start_broadcast(upcoming)
            ahead.broadcast_error = ahead.broadcast_error or self._finish_broadcast(rest)
            producer.release(upcoming)
        return num_tensors, num_bytes, index

    def _posts_ahead(self, index: int, bucket: Bucket) -> bool:
        """Whether bucket ``index`` may be posted before the previous bucket's reply: with
        ``pipeline_requests``, except the second bucket (a push whose first bucket is
        refused changes nothing) and the last (it sets the version: never over a bucket
        that failed)."""
        return self.pipeline_requests and index >= 2 and not bucket.is_last

    def _post(self, bucket: Bucket, index: int, weight_version: str | None) -> _Posted:
        """Post bucket ``index``'s request to every server (replies awaited later)."""
        version = weight_version if bucket.is_last else None
        futures = [
            self._pool.submit(
                c.update_weights_from_distributed,
                bucket.names,
                bucket.dtypes,
                bucket.shapes,
                group_name=self.group_name,
                weight_version=version,
                flush_cache=version is not None and self.pause_mode != "in_place",
                load_format="flattened_bucket" if bucket.flat is not None else None,
            )
            for c in self.clients
        ]
        return _Posted(index, bucket.names, bucket.flat is None, futures)

    def _start_broadcast(self, bucket: Bucket) -> tuple[RuntimeError | None, list[Any]]:
        """Rank 0's broadcast of ``bucket`` until its first message completed (on gloo:
        every receiving rank joined it); returns (the error, if it failed; the works still
        to await). A flattened bucket is one message: completed on return. A host bucket
        posted ahead is packed while its request travels: wait for its bytes first."""
        try:
            bucket.wait_packed()
        except BaseException:
            # Only a bucket posted ahead gets here unpacked, and its servers wait in this
            # broadcast: send the buffer as it is, so that they answer and the group stays in
            # step, then fail. They load those bytes, so they count as changed and stay
            # paused until a retry; a bucket posted ahead never carries the version.
            with contextlib.suppress(RuntimeError):
                self._group.broadcast(bucket.flat, src=0)
            raise
        try:
            if bucket.flat is not None:
                # One collective per bucket (SGLang's flattened_bucket).
                self._group.broadcast(bucket.flat, src=0)
                return None, []
            # SGLang's per-tensor protocol, as slime sends it: every tensor's broadcast
            # enqueued, then all awaited.
            works = [self._group.broadcast(t, src=0, async_op=True) for t in bucket.tensors]
            works[0].wait()
            return None, works[1:]
        except RuntimeError as e:  # gloo/nccl timeout or a peer that went away
            return e, []

    @staticmethod
    def _finish_broadcast(works: list[Any]) -> RuntimeError | None:
        """Await the rest of a bucket's broadcast; the error, if it failed."""
        try:
            for work in works:
                work.wait()
        except RuntimeError as e:
            return e
        return None

    def _await_replies(self, in_flight: list[_Posted], keep: int, lines: list[str]) -> None:
        """Await the replies of every posted bucket but the last ``keep`` (removed from
        ``in_flight``); sets ``_loaded`` and ``_flush_refused``; appends to ``lines`` what
        failed, and once something failed, what loaded after it."""
        while len(in_flight) > keep:
            posted = in_flight.pop(0)
            failures = failure_lines(self.clients, posted.futures)
            # A refused flush is reported after the bucket loaded (SGLang's message says so).
            num_loaded = len(self.clients) - sum(SGLANG_FLUSH_REFUSED not in f for f in failures)
            if posted.broadcast_error is not None and posted.per_tensor:
                # SGLang 0.5.23 and the embedded server receive aside and load nothing of a
                # broken broadcast, but a server that received per-tensor requests straight
                # into its parameters would be partly written: count the servers as changed
                # (they stay paused until a retry), which costs nothing but that retry.
                num_loaded = len(self.clients)
            if posted.broadcast_error is not None:
                failures.append(
                    f"  rank 0 broadcast failed ({posted.broadcast_error!r}); the group may be "
                    "unusable: close() and connect() again"
                )
            self._loaded |= num_loaded > 0
            # Every failure a refused flush after a complete load: weights and version in.
            self._server_failures += failures
            self._flush_refused = bool(self._server_failures) and all(
                SGLANG_FLUSH_REFUSED in f for f in self._server_failures
            )
            if failures:
                names = ", ".join(posted.names[:3])
                more = ", ..." if len(posted.names) > 3 else ""
                lines.append(
                    f"update_weights_from_distributed of bucket {posted.index} "
                    f"({len(posted.names)} tensors: {names}{more}) failed:\n" + "\n".join(failures)
                )
            elif lines:
                lines.append(
                    f"bucket {posted.index}, posted before that failure was known, loaded "
                    f"on every server"
                )

    def _fail(self, error: BaseException, loaded: bool) -> None:
        """After a failed update: ``/end_weight_update`` where a session is open, then
        ``/continue_generation`` unless some server loaded a bucket (here, or through another
        sender: ``end_update``'s ``loaded_elsewhere``): the servers then stay paused with
        mixed weights under their old version until a retry.

        Raises:
            always: ``error`` itself when it is neither a ``WeightSyncError`` nor a
            ``ValueError`` (an interrupt, the export's collective), else a
            ``WeightSyncError`` that says in which state the servers are (a ``ValueError``
            raised before anything loaded is re-raised as is).
        """
        began, self._open = self._open, []
        end = self.calls["end"]
        if not isinstance(error, (WeightSyncError, ValueError)):
            # Anything else (the tensor source's gather collective, a CUDA OOM while staging,
            # an interrupt) still ends the open sessions, or every retry's /begin_weight_update
            # would be refused; servers that loaded a bucket stay paused, as above.
            with contextlib.suppress(WeightSyncError):
                if began:
                    self._on_servers(end, began, lambda c: c.end_weight_update())
                if not loaded:
                    self._resume_all()
            raise error
        e = error
        if began:
            try:
                self._on_servers(end, began, lambda c: c.end_weight_update())
            except WeightSyncError as end_error:
                e = WeightSyncError(f"{e}\n{end_error}")
        if loaded and self._flush_refused:
            raise WeightSyncError(
                f"{e}\nEvery server loaded all buckets and holds the new weight_version, but "
                "the servers named above refused the cache flush after them (requests still "
                "running or queued), so their cache may hold entries of the old weights; all "
                "servers stay paused: retry update() (it loads, flushes and resumes)."
            ) from error
        if loaded:
            raise WeightSyncError(
                f"{e}\nSome servers already loaded earlier buckets; all servers stay paused "
                "with mixed weights under their old weight_version: retry update()."
            ) from error
        self._resume_all()
        if isinstance(e, ValueError):
            raise e
        raise WeightSyncError(f"{e}\nNo server changed weights; generation resumed.") from error

    def _resume_all(self) -> None:
        self._on_servers(self.calls["resume"], self.clients, lambda c: c.continue_generation())
