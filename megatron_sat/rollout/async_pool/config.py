"""The asynchronous pool's configuration (mode, lag, batch shape, dispatch)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sat.rollout.pool import DISPATCH

MODES = ("fixed_lag", "bounded")
ON_UPDATE = ("resume", "restart")


@dataclass(frozen=True)
class AsyncPoolConfig:
    """Asynchronous generation.

    Attributes:
        mode: ``fixed_lag`` or ``bounded`` (see the module docstring).
        lag: the fixed lag n, or the staleness bound eta, in versions (>= 0).
        prompts_per_batch: prompt groups per trainer batch.
        group_size: samples per prompt.
        on_update: what happens to a request aborted by a weight push (bounded mode).
        filter_groups: drop a completed group whose rewards are all equal (zero advantages)
            and generate a group of the next prompt for the same batch instead (DAPO's
            dynamic sampling, Yu et al., arXiv 2503.14476, Eq. 11).
        max_replacements: replacement groups per batch at most; once used up, groups are kept
            whatever their rewards (so an all-solved dataset still makes batches).
        dispatch: ``per_request``: every server slot runs ``max_in_flight_per_server``
            workers that each take one sample at a time from the queue, so a server that
            finishes sooner takes more (the least loaded one gets the next request) and a long
            response holds only its own worker. ``per_server``: one worker per slot takes its
            share of the queue (at most one batch) in one batched request (the server's batches
            are then the same every run: see ``rollout.pool.RolloutPool``).
        max_in_flight_per_server: ``per_request`` requests in flight per server (>= 1).
        clock_tokens: bounded mode only: 0 runs it on the wall clock; K > 0 on the logical
            clock of rounds of K tokens per request (see the module docstring), which repeats
            bit for bit. Rounds send one batched request per server (``per_server``).
        reply_parse_workers: processes that make the servers' ``/generate`` calls
            (``rollout.reply_parser``: the request, the reply's read and its parse), so that
            the reply body never enters the trainer's process and its read and parse do not
            hold the trainer's GIL while it steps; 0 makes each call in the pool's worker
            thread. For SGLang clients (the vLLM client parses its own replies).
    """

    mode: str = "fixed_lag"
    lag: int = 1
    prompts_per_batch: int = 32
    group_size: int = 8
    on_update: str = "resume"
    filter_groups: bool = False
    max_replacements: int = 0
    dispatch: str = "per_server"
    max_in_flight_per_server: int = 64
    clock_tokens: int = 0
    reply_parse_workers: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.reply_parse_workers, bool) or self.reply_parse_workers < 0:
            raise ValueError(
                "async_pool.reply_parse_workers must be >= 0 (0: in the worker threads), got "
                f"{self.reply_parse_workers!r}"
            )
        if self.clock_tokens < 0:
            raise ValueError(f"async_pool.clock_tokens must be >= 0, got {self.clock_tokens}")
        if self.clock_tokens and self.mode != "bounded":
            raise ValueError(
                f"async_pool.clock_tokens={self.clock_tokens} applies to mode='bounded' "
                f"(fixed_lag repeats without it), got mode={self.mode!r}"
            )
        if self.clock_tokens and self.dispatch != "per_server":
            raise ValueError(
                f"async_pool.clock_tokens={self.clock_tokens} runs rounds of one batched "
                f"request per server: it needs dispatch='per_server', got {self.dispatch!r}"
            )
        if self.dispatch not in DISPATCH:
            raise ValueError(
                f"async_pool.dispatch must be one of {DISPATCH}, got {self.dispatch!r}"
            )
        if self.max_in_flight_per_server < 1:
            raise ValueError(
                "async_pool.max_in_flight_per_server must be >= 1, got "
                f"{self.max_in_flight_per_server}"
            )
        if self.mode not in MODES:
            raise ValueError(f"async_pool.mode must be one of {MODES}, got {self.mode!r}")
        if self.on_update not in ON_UPDATE:
            raise ValueError(f"async_pool.on_update must be one of {ON_UPDATE}")
        if self.lag < 0:
            raise ValueError(f"async_pool.lag must be >= 0, got {self.lag}")
        if self.prompts_per_batch < 1 or self.group_size < 1:
            raise ValueError("async_pool.prompts_per_batch and group_size must be >= 1")
        if self.max_replacements < 0:
            raise ValueError(
                f"async_pool.max_replacements must be >= 0, got {self.max_replacements}"
            )
