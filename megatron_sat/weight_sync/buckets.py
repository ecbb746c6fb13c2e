"""Buckets of a weight push: grouping, packing into SGLang's ``flattened_bucket`` bytes, and a
producer thread that gathers and packs bucket k+1 while bucket k is on the wire.

SGLang 0.5.23's ``flattened_bucket`` (``srt/weight_sync/tensor_bucket.py``,
``FlattenedTensorBucket``): the tensors' bytes back to back in one uint8 tensor, in the order of
the request's ``names``; the receiver views each tensor at its offset. One broadcast per bucket
instead of one per tensor: on a loopback gloo group a broadcast costs far more than its bytes
for small tensors, and NCCL launches one kernel per call.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from megatron_sat.platform.host_copy import copy_bytes_into


@dataclass
class Bucket:
    """One ``/update_weights_from_distributed`` request's worth of tensors.

    Attributes:
        names: HF names, in wire order (``pack_order``).
        dtypes: SGLang's dtype names ("float32", "bfloat16", ...), in the same order.
        shapes: the tensors' shapes, in the same order.
        is_last: whether no bucket follows in this push (it carries ``weight_version``).
        num_bytes: bytes of all its tensors.
        flat: the packed bytes (uint8 [num_bytes]) when packed, else None: a view of a
            staging buffer that is repacked once the bucket is released.
        tensors: the tensors on the group's device (contiguous) when not packed, else empty.
        slot: the in-flight slot it holds until released.
        packed: set once ``flat`` holds the bytes, for a bucket handed out before it is
            packed (host buckets, ``BucketProducer``); None: ready when handed out.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    is_last: bool
    num_bytes: int
    flat: torch.Tensor | None = None
    tensors: list[torch.Tensor] = field(default_factory=list)
    slot: int = 0
    packed: threading.Event | None = None
    pack_error: BaseException | None = None

    def wait_packed(self) -> None:
        """Block until ``flat`` holds the bucket's bytes; re-raises the packing's error."""
        if self.packed is not None:
            self.packed.wait()
        if self.pack_error is not None:
            raise self.pack_error


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def pack_order(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors by element size, largest first (stable within a size): in the
    flattened bucket every tensor then starts at a multiple of its element size, so a receiver
    can view it in place (SGLang's views the bytes; a float32 tensor after an odd-length
    bfloat16 one could not be viewed). The names travel with the tensors, so order is free."""
    return sorted(bucket, key=lambda item: -item[1].element_size())


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    unpacked_from_bytes: int | None = None,
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool, bool]]:
    """Groups of at most ``bucket_bytes`` bytes (a bigger tensor alone), lazily, each with
    whether it is the last and whether it is to be packed.

    Without ``unpacked_from_bytes`` every group is packed and consecutive: a group is yielded
    as soon as the next tensor does not fit, so the source is never read more than one tensor
    ahead. With it, tensors of at least that many bytes form groups of their own, sent
    unpacked (one broadcast each), and the smaller ones packed groups; each kind is yielded
    when its next tensor does not fit, and the packed group pending at a time holds at most
    ``bucket_bytes`` of tensors read earlier.

    Raises:
        ValueError: on ``bucket_bytes`` < 1 or a name seen twice.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    pending: dict[bool, list[tuple[str, torch.Tensor]]] = {True: [], False: []}
    size = {True: 0, False: 0}
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one update")
        seen.add(name)
        packed = unpacked_from_bytes is None or nbytes(tensor) < unpacked_from_bytes
        if pending[packed] and size[packed] + nbytes(tensor) > bucket_bytes:
            yield pending[packed], False, packed
            pending[packed], size[packed] = [], 0
        pending[packed].append((name, tensor))
        size[packed] += nbytes(tensor)
    rest = [(group, packed) for packed, group in pending.items() if group]
    for i, (group, packed) in enumerate(rest):
        yield group, i == len(rest) - 1, packed


def pack_into(tensors: list[torch.Tensor], staging: torch.Tensor) -> torch.Tensor:
    """Every tensor's bytes, in order, into a prefix of ``staging`` (uint8, large enough);
    returns that prefix. Bitwise: ``unflatten`` of it gives back equal tensors. On the host a
    single-threaded memcpy (``platform.host_copy``), which overlaps the broadcast instead of
    competing with it for the cores."""
    total = sum(nbytes(t) for t in tensors)
    if staging.dtype != torch.uint8 or staging.numel() < total:
        raise ValueError(f"staging must be uint8 with >= {total} elements, got {staging.shape}")
    flat = staging[:total]
    copy_bytes_into(flat, tensors)
    return flat


class BucketProducer:
    """Builds the buckets of one push on a background thread, ahead of the sender.

    The thread walks ``named_tensors`` (the export: its TP/EP all-gathers run on this thread),
    groups tensors into buckets, moves them to ``device`` and, when ``flatten``, packs each
    into one of the reused ``staging`` buffers (grown on demand). At most ``len(staging)``
    buckets exist at a time: with two, bucket k+1 is gathered and packed while bucket k is
    broadcast, and the sender's ``release`` of bucket k lets the thread build bucket k+2 in
    its buffer. Without ``flatten`` the thread only gathers ahead (no buffers are used).

    On the host a bucket is handed out gathered but not yet packed (``Bucket.wait_packed``),
    and packed only once the bucket before it is released, its broadcast complete: the sender
    posts its request meanwhile, and the copy runs while the server loads the previous
    bucket (SGLang receives a request, then loads it, before it joins the next broadcast)
    instead of competing for the cores with the wire, where a loopback gloo broadcast keeps
    a core busy on each side (the CPU time of the sending process about 90% of the
    broadcast's wall time, measured on the 2-core test machine).

    On CUDA the packing runs on a side stream: it waits for the stream the export's tensors
    were made on, each bucket carries an event the sender's stream waits on before its
    broadcast, and a released buffer is repacked only after the sender's stream passed that
    broadcast (NCCL orders its own stream after the caller's).

    Use it as a context manager: leaving stops the thread and joins it (after at most the
    tensor it is reading), so that the caller may then drain ``named_tensors`` itself.

    Args:
        named_tensors: (HF name, tensor) pairs, each read once.
        bucket_bytes: bucket size limit, bytes.
        device: the group's device (CPU for gloo, CUDA for nccl).
        flatten: pack each bucket (SGLang's ``flattened_bucket``); else only gather ahead.
        staging: the reused staging buffers, one per bucket in flight (entries are replaced
            when a bucket needs a bigger one; None: not allocated yet).
        unpacked_from_bytes: with ``flatten``, tensors of at least this many bytes travel
            unpacked, in buckets of their own (``iter_buckets``); None: all packed.
    """

    _DONE = object()

    def __init__(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        device: torch.device,
        *,
        flatten: bool,
        staging: list[torch.Tensor | None],
        unpacked_from_bytes: int | None = None,
    ) -> None:
        if not staging:
            raise ValueError("staging needs at least one slot")
        self._source = named_tensors
        self._bucket_bytes = bucket_bytes
        self._device = device
        self._flatten = flatten
        self._unpacked_from_bytes = unpacked_from_bytes if flatten else None
        self._staging = staging
        self._ready: queue.Queue = queue.Queue()
        self._free: queue.Queue = queue.Queue()
        for slot in range(len(staging)):
            self._free.put((slot, None))
        self._stop = threading.Event()
        self._released = 0  # buckets the sender released (it releases them in order)
        self._released_changed = threading.Condition()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="weight_sync_pack", daemon=True)

    def __enter__(self) -> BucketProducer:
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._free.put((None, None))  # wakes the thread if it waits for a slot
        with self._released_changed:  # or for a release, to pack
            self._released_changed.notify_all()
        self._thread.join()

    def __iter__(self) -> Iterator[Bucket]:
        """The buckets in order; re-raises what the thread raised (e.g. the export's error).

        Raises:
            RuntimeError: when the producer was not entered (no thread would ever hand out a
                bucket).
        """
        if self._thread.ident is None:
            raise RuntimeError("enter the BucketProducer (with producer: ...) before iterating")
        while True:
            item = self._ready.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            bucket, event = item
            if event is not None:
                torch.cuda.current_stream(self._device).wait_event(event)
            yield bucket

    def release(self, bucket: Bucket) -> None:
        """The sender is done with ``bucket`` (its broadcast completed, or is enqueued on the
        current CUDA stream): its slot may take the next bucket."""
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        self._free.put((bucket.slot, event))
        with self._released_changed:
            self._released += 1
            self._released_changed.notify_all()

    def _run(self) -> None:
        try:
            if self._stream is not None:
                # The current CUDA device is per thread (a new one starts on cuda:0); the
                # export's collectives and copies on this thread must use the sender's.
                torch.cuda.set_device(self._device)
            groups = iter_buckets(self._source, self._bucket_bytes, self._unpacked_from_bytes)
            for index in itertools.count():
                # A slot first, then the next group: at most len(staging) buckets (and the
                # one tensor iter_buckets reads ahead) exist at a time.
                slot, event = self._free.get()
                if slot is None or self._stop.is_set():
                    return
                item = next(groups, None)
                if item is None:
                    break
                group, is_last, packed = item
                if self._stream is None and self._flatten and packed:
                    self._build_host(index, pack_order(group), is_last, slot)
                else:
                    self._ready.put(self._build(pack_order(group), is_last, packed, slot, event))
            self._ready.put(self._DONE)
        except BaseException as e:  # handed to the sender, which re-raises it
            self._ready.put(e)

    def _build_host(self, index: int, group, is_last: bool, slot: int) -> None:
        """Hand out host bucket ``index`` gathered, then pack it once bucket ``index - 1`` is
        released (``__init__``'s docstring says why)."""
        tensors = [t.detach().cpu().contiguous() for _, t in group]
        total = sum(nbytes(t) for t in tensors)
        buffer = self._staging_buffer(slot, total)
        bucket = Bucket(
            names=[name for name, _ in group],
            dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            is_last=is_last,
            num_bytes=total,
            flat=buffer[:total],
            slot=slot,
            packed=threading.Event(),
        )
        self._ready.put((bucket, None))
        try:
            with self._released_changed:
                while self._released < index and not self._stop.is_set():
                    self._released_changed.wait()
            if self._stop.is_set():
                raise RuntimeError("the weight push stopped before this bucket was packed")
            pack_into(tensors, buffer)
        except BaseException as e:  # the sender may wait for this bucket: hand it the error
            bucket.pack_error = e
            raise
        finally:
            bucket.packed.set()

    def _staging_buffer(self, slot: int, num_bytes: int) -> torch.Tensor:
        """Staging buffer ``slot``, grown to at least ``num_bytes``."""
        buffer = self._staging[slot]
        if buffer is None or buffer.numel() < num_bytes:
            self._staging[slot] = None  # free the old one before allocating its successor
            buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self._device)
            self._staging[slot] = buffer
        return buffer

    def _build(self, group, is_last: bool, packed: bool, slot: int, event):
        names = [name for name, _ in group]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in group]
        shapes = [list(t.shape) for _, t in group]
        total = sum(nbytes(t) for _, t in group)
        if not (self._flatten and packed):
            tensors = [t.detach().to(self._device).contiguous() for _, t in group]
            return Bucket(names, dtypes, shapes, is_last, total, tensors=tensors, slot=slot), None
        context = contextlib.nullcontext()
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            if event is not None:
                self._stream.wait_event(event)
            context = torch.cuda.stream(self._stream)
        with context:
            tensors = [t.detach().to(self._device).contiguous() for _, t in group]
            if self._stream is not None:
                for t in tensors:  # their memory must outlive the copy on the side stream
                    t.record_stream(self._stream)
            flat = pack_into(tensors, self._staging_buffer(slot, total))
            done = None
            if self._stream is not None:
                done = torch.cuda.Event()
                done.record(self._stream)
        return Bucket(names, dtypes, shapes, is_last, total, flat=flat, slot=slot), done
