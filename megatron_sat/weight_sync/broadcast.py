"""Trainer side of the weight push: bucketed broadcast to SGLang-compatible rollout servers."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megatron_sat.rollout.client import PAUSE_MODES, SGLangClient
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
       every reply is awaited. Only the final bucket carries ``weight_version``, so a
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
    are materialised at a time.

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
        self.world_size = 1 + sum(self.ranks_per_server)
        self._pool = ThreadPoolExecutor(len(self.clients), thread_name_prefix="weight_sync")
        self._group: WeightUpdateGroup | None = None
        # Buckets are packed here, reused across updates (grown on demand): a fresh buffer per
        # bucket costs its page faults, on a CPU about as long as the broadcast itself.
        self._staging: torch.Tensor | None = None

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
        """Push every tensor (HF names, e.g. per-expert ``mlp.experts.{e}.up_proj.weight``).

        Raises:
            ValueError: on an empty update, an empty version or a repeated name.
            WeightSyncError: when a server rejects a bucket or a call fails (see class docstring).
        """
        if self._group is None:
            raise RuntimeError("call connect() before update()")
        if not weight_version:
            raise ValueError("weight_version must be a non-empty string")
        start = time.perf_counter()
        num_tensors = num_bytes = num_buckets = 0
        applied_somewhere = False
        began: list[SGLangClient] = []
        try:
            self._on_all_servers("pause_generation", lambda c: c.pause_generation(self.pause_mode))
            self._begin_sessions(began)
            seen: set[str] = set()
            buckets = _buckets(named_tensors, self.bucket_bytes)
            bucket = next(buckets, None)
            if bucket is None:
                raise ValueError("update() got no tensors")
            while bucket is not None:
                following = next(buckets, None)
                for name, _ in bucket:
                    if name in seen:
                        raise ValueError(f"tensor {name!r} appears twice in one update")
                    seen.add(name)
                is_last = following is None
                num_loaded, failures = self._send_bucket(
                    bucket, weight_version if is_last else None
                )
                applied_somewhere |= num_loaded > 0
                if failures:
                    names = ", ".join(name for name, _ in bucket[:3])
                    raise WeightSyncError(
                        f"update_weights_from_distributed of bucket {num_buckets} ({len(bucket)} "
                        f"tensors: {names}{', ...' if len(bucket) > 3 else ''}) failed:\n"
                        + "\n".join(failures)
                    )
                num_tensors += len(bucket)
                num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                num_buckets += 1
                bucket = following
            ending, began = began, []
            self._on_servers("end_weight_update", ending, lambda c: c.end_weight_update())
        except (WeightSyncError, ValueError) as e:
            if began:
                try:
                    self._on_servers("end_weight_update", began, lambda c: c.end_weight_update())
                except WeightSyncError as end_error:
                    e = WeightSyncError(f"{e}\n{end_error}")
            if applied_somewhere:
                raise WeightSyncError(
                    f"{e}\nSome servers already loaded earlier buckets; all servers stay paused "
                    "with mixed weights under their old weight_version: retry update()."
                ) from e
            self._on_all_servers("continue_generation", lambda c: c.continue_generation())
            if isinstance(e, ValueError):
                raise
            raise WeightSyncError(f"{e}\nNo server changed weights; generation resumed.") from e
        except BaseException:
            # Anything else (the tensor source's gather collective, a CUDA OOM while staging,
            # an interrupt) still ends the open sessions, or every retry's /begin_weight_update
            # would be refused; servers that loaded a bucket stay paused, as above.
            with contextlib.suppress(WeightSyncError):
                if began:
                    self._on_servers("end_weight_update", began, lambda c: c.end_weight_update())
                if not applied_somewhere:
                    self._on_all_servers("continue_generation", lambda c: c.continue_generation())
            raise
        self._on_all_servers("continue_generation", lambda c: c.continue_generation())
        return UpdateStats(num_tensors, num_bytes, num_buckets, time.perf_counter() - start)

    def _send_bucket(
        self, bucket: list[tuple[str, torch.Tensor]], weight_version: str | None
    ) -> tuple[int, list[str]]:
        """Post one bucket to all servers while broadcasting it.

        Returns:
            (servers that loaded the bucket, one line per failure).
        """
        if self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        bucket = pack_order(bucket)
        tensors = [t.detach().to(device).contiguous() for _, t in bucket]
        load_format = "flattened_bucket" if self.flatten_buckets else None
        futures = [
            self._pool.submit(
                c.update_weights_from_distributed,
                [name for name, _ in bucket],
                [str(t.dtype).removeprefix("torch.") for t in tensors],
                [list(t.shape) for t in tensors],
                group_name=self.group_name,
                weight_version=weight_version,
                flush_cache=weight_version is not None and self.pause_mode != "in_place",
                load_format=load_format,
            )
            for c in self.clients
        ]
        broadcast_error = None
        try:
            if self.flatten_buckets:
                # One collective per bucket: many small broadcasts cost far more than their
                # bytes (SGLang's flattened_bucket: each tensor's bytes, in order, as uint8).
                flat = self._pack(tensors, device)
                self._group.broadcast(flat, src=0)
            else:
                for tensor in tensors:
                    self._group.broadcast(tensor, src=0)
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

    def _pack(self, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Every tensor's bytes, in order, in (a prefix of) the reused staging buffer."""
        total = sum(t.numel() * t.element_size() for t in tensors)
        if self._staging is None or self._staging.numel() < total:
            self._staging = None  # free the old one before allocating its successor
            self._staging = torch.empty(total, dtype=torch.uint8, device=device)
        flat = self._staging[:total]
        torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors], out=flat)
        return flat

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
            self._staging = None
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


def pack_order(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors by element size, largest first (stable within a size): in the
    flattened bucket every tensor then starts at a multiple of its element size, so a receiver
    can view it in place (SGLang's views the bytes; a float32 tensor after an odd-length
    bfloat16 one could not be viewed). The names travel with the tensors, so order is free."""
    return sorted(bucket, key=lambda item: -item[1].element_size())


def _buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``bucket_bytes`` bytes (a bigger tensor alone), lazily."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
