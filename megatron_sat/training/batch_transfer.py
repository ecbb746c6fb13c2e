"""Rank 0's batch to every trainer rank as flat CPU tensors, each rank receiving only its share.

What it replaces: ``dist.scatter_object_list`` of pickled ``Sample`` lists on the default
group. With NCCL that pickles every share, stages world-size x the largest pickled share on
GPU 0 (``scatter_object_list`` copies the byte tensors to the current device) and sends routes
inflated by pickling (tens of GB at the paper's shape: 8.4k tokens x 48 layers x 8 experts per
sample). Here each sample's fields become segments of one ``uint8`` buffer per destination --
token ids and versions int64, log-probs, rewards and advantages in their own dtypes (bitwise),
routes in the dtype they were decoded to (uint8 or int16, see ``routing.payload``), strings as
UTF-8 -- over a gloo group (``cpu_group``), so nothing touches a GPU. Each distinct share is
encoded once: at data-parallel size 1 (TP / EP / PP ranks all train on the whole batch) it is
broadcast, else sent to the ranks of its data-parallel rank concurrently, the next share encoded
while the previous one is in flight (rank 0 holds at most two encoded shares besides the batch).
A receiver's routes are views of the received buffer, their final host form: routes stay
compact and are copied nowhere until ``training.batching`` places them.

``encode_share`` / ``decode_share`` are exact inverses (every field of ``Sample``; a test
round-trips them bitwise).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import torch
import torch.distributed as dist

from megatron_sat.rollout.types import Sample

_MAGIC = 0x5341_5442  # "SATB": a buffer from another format or a torn transfer fails loudly
# Route and advantage dtypes a buffer may carry, by code (the code is what travels).
_DTYPES = [np.uint8, np.int16, np.uint16, np.int32, np.int64, np.float32, np.float64]
# Per-sample int64 fields, in this order.
_FIELDS = (
    "index",
    "group_index",
    "num_prompt",
    "num_response",
    "route_rows",  # -1: no routes
    "route_layers",
    "route_topk",
    "route_dtype",
    "has_reward",
    "prompt_bytes",
    "label_bytes",
    "text_bytes",
    "finish_bytes",
    "metadata_bytes",
)

_cpu_group = None


def cpu_group():
    """A gloo group over the whole world: the default group when its backend is gloo, else a
    new gloo group (created collectively on first use: call it on every rank at the same
    point, as ``distributed_rl_step`` does)."""
    global _cpu_group
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if _cpu_group is None:
        _cpu_group = dist.new_group(backend="gloo")
    return _cpu_group


def _code(dtype: np.dtype) -> int:
    for code, known in enumerate(_DTYPES):
        if np.dtype(known) == dtype:
            return code
    raise ValueError(f"dtype {dtype} cannot travel in a batch buffer (known: {_DTYPES})")


def _flat(lists: list[list], dtype) -> np.ndarray:
    """The concatenation of Python lists as one array, iterated in C."""
    total = sum(len(x) for x in lists)
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=total)


def _utf8(sample: Sample, name: str) -> bytes:
    """``sample.<name>`` as UTF-8; ValueError naming the sample and field when it is not
    encodable (a lone surrogate from a bad decode)."""
    try:
        return getattr(sample, name).encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"sample {sample.index}: {name} is not UTF-8 encodable ({e})") from e


def encode_share(
    samples: list[Sample], advantages: torch.Tensor, trainer_version: int | None
) -> torch.Tensor:
    """One rank's share as a flat uint8 CPU tensor.

    Args:
        samples: the share (may be empty).
        advantages: [len(samples)] float32 or float64 (any CPU tensor with that leading size).
        trainer_version: the version the share is trained at, or None.

    Raises:
        ValueError: naming the sample, for ``metadata`` that is not JSON, routes of an unknown
            dtype, ``response_versions`` or ``rollout_log_probs`` of another length than
            ``response_ids`` (the decoder cuts both at the response length: a mismatch would
            shift values into the next sample), a string field that is not UTF-8 encodable
            (a lone surrogate), token ids or versions outside int64; advantages of another
            length or of another dtype than float32/float64; a negative ``trainer_version``.
    """
    if advantages.shape[:1] != (len(samples),):
        raise ValueError(f"{tuple(advantages.shape)} advantages for {len(samples)} samples")
    if advantages.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"advantages must be float32 or float64, got {advantages.dtype}")
    if trainer_version is not None and trainer_version < 0:
        raise ValueError(f"trainer_version must be None or >= 0, got {trainer_version}")
    table = np.zeros((len(samples), len(_FIELDS)), dtype=np.int64)
    tokens, versions, log_probs, rewards, routes, text = [], [], [], [], [], []
    for row, s in enumerate(samples):
        try:
            meta = json.dumps(s.metadata, sort_keys=True).encode()
        except TypeError as e:
            raise ValueError(f"sample {s.index}: metadata is not JSON ({e})") from e
        if json.loads(meta) != s.metadata:
            raise ValueError(f"sample {s.index}: metadata does not survive JSON: {s.metadata!r}")
        n = len(s.response_ids)
        for name in ("response_versions", "rollout_log_probs"):
            if len(getattr(s, name)) != n:
                raise ValueError(
                    f"sample {s.index}: {len(getattr(s, name))} {name} for {n} response tokens"
                )
        strings = [_utf8(s, name) for name in ("prompt", "label", "response_text")]
        strings += [_utf8(s, "finish_reason"), meta]
        r = s.routed_experts
        shape = (-1, 0, 0, 0) if r is None else (*r.shape, _code(r.dtype))
        if r is not None and r.ndim != 3:
            raise ValueError(f"sample {s.index}: routed_experts has shape {r.shape}, not 3-d")
        table[row] = [
            s.index,
            s.group_index,
            len(s.prompt_ids),
            len(s.response_ids),
            *shape,
            s.reward is not None,
            *(len(b) for b in strings),
        ]
        tokens += [s.prompt_ids, s.response_ids]
        versions.append(s.response_versions)
        log_probs.append(s.rollout_log_probs)
        rewards.append(0.0 if s.reward is None else s.reward)
        if r is not None:
            routes.append(np.ascontiguousarray(r).view(np.uint8).reshape(-1))
        text += strings
    adv = advantages.detach().cpu().contiguous().numpy()
    header = np.array(
        [_MAGIC, len(samples), -1 if trainer_version is None else trainer_version,
         _code(adv.dtype), adv.ndim, *adv.shape],
        dtype=np.int64,
    )  # fmt: skip
    try:
        flat_tokens, flat_versions = _flat(tokens, np.int64), _flat(versions, np.int64)
    except OverflowError:
        for s in samples:  # only on the error path: name the sample
            for name in ("prompt_ids", "response_ids", "response_versions"):
                if any(not -(2**63) <= v < 2**63 for v in getattr(s, name)):
                    raise ValueError(f"sample {s.index}: {name} outside int64") from None
        raise
    segments = [
        table,
        flat_tokens,
        flat_versions,
        _flat(log_probs, np.float64),
        np.array(rewards, dtype=np.float64),
        adv,
        np.concatenate(routes) if routes else np.zeros(0, np.uint8),
        np.frombuffer(b"".join(text), dtype=np.uint8),
    ]
    raw = [np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in segments]
    lengths = np.array([len(header), *(len(b) for b in raw)], dtype=np.int64)
    out = np.concatenate([lengths.view(np.uint8), header.view(np.uint8), *raw])
    return torch.from_numpy(out)


def decode_share(buffer: torch.Tensor) -> tuple[list[Sample], torch.Tensor, int | None]:
    """The inverse of ``encode_share``: (samples, advantages, trainer_version).

    Raises:
        ValueError: for a buffer that is not one (wrong magic or sizes).
    """
    raw = buffer.numpy()  # views of it below: the routes are decoded without a copy
    num_segments = 9
    if raw.dtype != np.uint8 or raw.ndim != 1 or len(raw) < 8 * num_segments:
        raise ValueError(f"not a batch buffer: {raw.dtype} of shape {raw.shape}")
    lengths = raw[: 8 * num_segments].copy().view(np.int64)
    pos = 8 * num_segments
    header = raw[pos : pos + 8 * int(lengths[0])].copy().view(np.int64)
    pos += 8 * int(lengths[0])
    if len(header) < 5 or header[0] != _MAGIC:
        raise ValueError("not a batch buffer (bad magic): sender and receiver disagree")
    chunks = []
    for n in lengths[1:]:
        chunks.append(raw[pos : pos + int(n)])
        pos += int(n)
    if pos != len(raw):
        raise ValueError(f"batch buffer of {len(raw)} bytes, its segments add up to {pos}")
    n, version, adv_code, adv_ndim = (int(x) for x in header[1:5])
    # Segments start at arbitrary byte offsets: the small ones are copied to aligned arrays.
    table = chunks[0].copy().view(np.int64).reshape(n, len(_FIELDS))
    tokens = chunks[1].copy().view(np.int64)
    versions = chunks[2].copy().view(np.int64)
    log_probs = chunks[3].copy().view(np.float64)
    rewards = chunks[4].copy().view(np.float64)
    adv = chunks[5].copy().view(_DTYPES[adv_code]).reshape(header[5 : 5 + adv_ndim])
    routes, text = chunks[6], chunks[7].tobytes()
    samples = []
    t = v = r_pos = x_pos = 0
    for row in range(n):
        f = dict(zip(_FIELDS, (int(x) for x in table[row]), strict=True))
        p, r = f["num_prompt"], f["num_response"]
        strings = []
        for key in ("prompt_bytes", "label_bytes", "text_bytes", "finish_bytes", "metadata_bytes"):
            strings.append(text[x_pos : x_pos + f[key]].decode())
            x_pos += f[key]
        routed = None
        if f["route_rows"] >= 0:
            dtype = np.dtype(_DTYPES[f["route_dtype"]])
            shape = (f["route_rows"], f["route_layers"], f["route_topk"])
            count = shape[0] * shape[1] * shape[2]
            # A view of the received buffer (uint8 needs no alignment; int16 is aligned
            # when the segment is: else one copy), the routes' final host form.
            part = routes[r_pos : r_pos + count * dtype.itemsize]
            if part.ctypes.data % dtype.itemsize:
                part = part.copy()
            routed = part.view(dtype).reshape(shape)
            r_pos += count * dtype.itemsize
        samples.append(
            Sample(
                index=f["index"],
                group_index=f["group_index"],
                prompt=strings[0],
                label=strings[1],
                prompt_ids=tokens[t : t + p].tolist(),
                response_ids=tokens[t + p : t + p + r].tolist(),
                rollout_log_probs=log_probs[v : v + r].tolist(),
                response_versions=versions[v : v + r].tolist(),
                routed_experts=routed,
                finish_reason=strings[3],
                reward=float(rewards[row]) if f["has_reward"] else None,
                response_text=strings[2],
                metadata=json.loads(strings[4]),
            )
        )
        t += p + r
        v += r
    advantages = torch.from_numpy(adv.copy())
    return samples, advantages, None if version < 0 else version


def send_shares(
    shares: dict[int, tuple[list[Sample], torch.Tensor, int | None]],
    group=None,
    *,
    same_share: dict[int, int] | None = None,
) -> None:
    """Rank 0: send rank ``d`` its share ``shares[d]`` (every other rank of the group) over
    ``group`` (default ``cpu_group()``), the length then the buffer.

    Ranks with the same key in ``same_share`` (their data-parallel rank: the TP / EP / PP
    ranks of one DP rank train on the same share) get one encoded buffer, sent to all of them
    concurrently (``isend``); the next share is encoded while the previous one is in flight,
    so rank 0 holds at most two encoded shares besides the batch. Returns once every send
    completed.
    """
    group = cpu_group() if group is None else group
    same_share = same_share or {dst: dst for dst in shares}
    by_share: dict[int, list[int]] = {}
    for dst in sorted(shares):
        by_share.setdefault(same_share[dst], []).append(dst)
    in_flight: list = []
    for destinations in by_share.values():
        buffer = encode_share(*shares[destinations[0]])
        size = torch.tensor([buffer.numel()], dtype=torch.int64)
        _wait(in_flight)  # the previous share's sends, while this one was encoded
        in_flight = [
            work
            for dst in destinations
            for work in (
                dist.isend(size, dst=dst, group=group),
                dist.isend(buffer, dst=dst, group=group),
            )
        ]
    _wait(in_flight)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def receive_share(group=None) -> tuple[list[Sample], torch.Tensor, int | None]:
    """A non-zero rank: its share from rank 0 (``send_shares``)."""
    group = cpu_group() if group is None else group
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=0, group=group)
    buffer = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(buffer, src=0, group=group)
    return decode_share(buffer)


def broadcast_share(
    share: tuple[list[Sample], torch.Tensor, int | None] | None, group=None
) -> tuple[list[Sample], torch.Tensor, int | None]:
    """One share for every rank of ``group`` (data-parallel size 1 under TP / EP / PP): rank 0
    passes it, encodes it once and broadcasts the buffer; the others pass None and decode it.
    Rank 0 gets its own share back without a copy."""
    group = cpu_group() if group is None else group
    rank = dist.get_rank()
    buffer = encode_share(*share) if rank == 0 else None
    size = torch.tensor([0 if buffer is None else buffer.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    if buffer is None:
        buffer = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    return share if rank == 0 else decode_share(buffer)


def distribute_batch(
    samples: list[Sample] | None,
    advantages: torch.Tensor | None,
    trainer_version: int | None,
    slices: list[slice] | None,
    dp_rank: int,
) -> tuple[list[Sample], torch.Tensor, int | None]:
    """Every rank's share of rank 0's batch: rank ``r`` gets
    ``(samples[slices[dp_rank of r]], advantages[same], trainer_version)``.

    Collective over ``cpu_group()``: one all-gather of the data-parallel ranks (int64); then,
    when every rank has the same data-parallel rank (DP 1 with TP / EP / PP), one encode and
    one broadcast (``broadcast_share``); else each distinct share is encoded once and sent to
    its ranks concurrently (``send_shares`` / ``receive_share``). Rank 0 keeps its own share
    without a copy.

    Args:
        samples, advantages, trainer_version, slices: rank 0's batch and its shares by
            data-parallel rank; None on the other ranks.
        dp_rank: this rank's data-parallel rank.

    Raises:
        ValueError: rank 0 without the batch or its slices.
    """
    group = cpu_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([dp_rank], dtype=torch.int64), group=group)
    dp_ranks = [int(t) for t in gathered]
    if rank == 0 and (samples is None or advantages is None or slices is None):
        raise ValueError("rank 0 must pass the batch, its advantages and the shares' slices")

    def share(d: int):
        return samples[slices[d]], advantages[slices[d]], trainer_version

    if len(set(dp_ranks)) == 1:
        return broadcast_share(share(dp_ranks[0]) if rank == 0 else None, group)
    if rank != 0:
        return receive_share(group)
    others = {r: share(d) for r, d in enumerate(dp_ranks) if r != 0}
    send_shares(others, group, same_share={r: dp_ranks[r] for r in others})
    return share(dp_ranks[0])
