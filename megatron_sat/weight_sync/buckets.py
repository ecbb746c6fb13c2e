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
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    is_last: bool
    num_bytes: int
    flat: torch.Tensor | None = None
    tensors: list[torch.Tensor] = field(default_factory=list)
    slot: int = 0


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
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="weight_sync_pack", daemon=True)

    def __enter__(self) -> BucketProducer:
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._free.put((None, None))  # wakes the thread if it waits for a slot
        self._thread.join()

    def __iter__(self) -> Iterator[Bucket]:
        """The buckets in order; re-raises what the thread raised (e.g. the export's error)."""
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

    def _run(self) -> None:
        try:
            if self._stream is not None:
                # The current CUDA device is per thread (a new one starts on cuda:0); the
                # export's collectives and copies on this thread must use the sender's.
                torch.cuda.set_device(self._device)
            groups = iter_buckets(self._source, self._bucket_bytes, self._unpacked_from_bytes)
            while True:
                # A slot first, then the next group: at most len(staging) buckets (and the
                # one tensor iter_buckets reads ahead) exist at a time.
                slot, event = self._free.get()
                if slot is None or self._stop.is_set():
                    return
                item = next(groups, None)
                if item is None:
                    break
                group, is_last, packed = item
                self._ready.put(self._build(pack_order(group), is_last, packed, slot, event))
            self._ready.put(self._DONE)
        except BaseException as e:  # handed to the sender, which re-raises it
            self._ready.put(e)

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
            buffer = self._staging[slot]
            if buffer is None or buffer.numel() < total:
                self._staging[slot] = None  # free the old one before allocating its successor
                buffer = torch.empty(total, dtype=torch.uint8, device=self._device)
                self._staging[slot] = buffer
            flat = pack_into(tensors, buffer)
            done = None
            if self._stream is not None:
                done = torch.cuda.Event()
                done.record(self._stream)
        return Bucket(names, dtypes, shapes, is_last, total, flat=flat, slot=slot), done
