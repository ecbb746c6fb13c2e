"""When a push may post bucket k+1's request before bucket k's reply (pipelined requests).

A server pairs an ``/update_weights_from_distributed`` request with whatever broadcasts follow
on the group, in order: were it to take bucket k+1's request while rank 0 broadcasts bucket k,
it would load bucket k's bytes under bucket k+1's names. What SGLang 0.5.23 does with two
update requests in flight (``srt/managers/tokenizer_control_mixin.py``,
``update_weights_from_distributed``): while generation is paused (our push pauses first) each
request holds ``is_pause_cond`` (an ``asyncio.Condition``, whose lock wakes waiters first in,
first out) from before it is sent to the scheduler until the scheduler's reply, and the
scheduler receives then loads one request at a time. So a request that reached that lock is
served before every later one; but which of two requests reaches it first depends on how the
HTTP server reads two connections, so posting ahead alone is not safe.

What makes it safe: post bucket k+1 only after a message of rank 0's broadcast of bucket k
completed (the first tensor's, for a per-tensor bucket), and only where that completion
proves every server joined it. gloo sends a message only once its receiver posted the
matching receive (``gloo/transport/tcp/pair.cc``, ``Pair::send``: the data goes after the
peer's ``NOTIFY_RECV_READY``), so rank 0's sends completing prove that each rank rank 0 sends
to has taken bucket k's request, which then holds the lock; bucket k+1's request, posted
after, waits behind it, and travels while the rest of bucket k is on the wire. gloo's
broadcast is a binomial tree (``gloo/broadcast.cc``): rank 0 sends to ranks 1, 2, 4, 8, ...;
every server must have a rank among them (all ranks of one SGLang server take the same
request stream). NCCL gives rank 0 no such proof (a small bucket
fits the peer's receive buffers before the peer's kernel runs), so its requests are not
pipelined.
"""

from __future__ import annotations

from collections.abc import Sequence


def gloo_root_peers(world_size: int) -> list[int]:
    """The ranks that rank 0 sends to itself in gloo's broadcast from rank 0 of a group of
    ``world_size`` (``gloo/broadcast.cc``, binomial tree: 1, 2, 4, ... below ``world_size``).

    Raises:
        ValueError: on ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    peers, step = [], 1
    while step < world_size:
        peers.append(step)
        step *= 2
    return peers


def can_pipeline_requests(backend: str, ranks_per_server: Sequence[int]) -> bool:
    """Whether rank 0's completed broadcast proves every server joined it (module docstring):
    gloo, and each server (``ranks_per_server[i]`` consecutive ranks after rank 0 and the
    servers before it) has a rank that rank 0 sends to directly.

    Raises:
        ValueError: on an unknown backend or a server with no rank.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not ranks_per_server or min(ranks_per_server) < 1:
        raise ValueError(f"every server needs >= 1 rank, got {list(ranks_per_server)}")
    if backend == "nccl":
        return False
    peers = set(gloo_root_peers(1 + sum(ranks_per_server)))
    first = 1
    for ranks in ranks_per_server:
        if not peers.intersection(range(first, first + ranks)):
            return False
        first += ranks
    return True
