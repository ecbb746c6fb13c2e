"""Host memory of the rollout pool: where finished samples wait for the trainer, and how much.

The pool (``rollout.pool``, ``rollout.async_pool``) holds finished samples on trainer rank 0
until the trainer consumes their batch (``rollout.pool_storage``: ``rank0_host``, numpy arrays in
rank 0's memory; the only holding place so far). What a sample holds once its reply is decoded
(``routing.wire`` + ``routing.payload``: no base64 string, JSON body or int32 copy outlives the
decode): its compact routes, ``num_layers x top_k`` expert ids per token in uint8 (<= 256
experts) or int16, plus the Python lists of token ids, log-probs and versions
(:data:`OTHER_BYTES_PER_TOKEN`).

How many batches: in ``sync`` mode one (generated, then trained). In the asynchronous modes a
group of batch b may start once the servers hold version >= b - lag, and the trainer at version
v consumes batch v, so batches v .. v + lag can be complete or in flight at once: lag + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sat.config.run import POOL_STORAGES
from megatron_sat.routing.payload import compact_expert_dtype

# Per token besides the routes, measured by bench/data_path.py
# (rank0_samples_host_bytes_per_token minus compact_route_bytes_per_token: 75 at 48 x 8): a
# response token's id (an 8-byte list slot + a 28-32 byte int), log-prob (8 + 24) and version
# (8; small ints are shared), a prompt token's id.
OTHER_BYTES_PER_TOKEN = 80


@dataclass(frozen=True)
class PoolMemory:
    """The pool's host memory at its fullest.

    Attributes:
        storage: the holding place (``rollout.pool_storage``).
        batches: batches held at once (1 in sync mode, lag + 1 otherwise).
        samples_per_batch: prompts per step x group size.
        tokens_per_sample: prompt + response tokens assumed per sample.
        route_bytes_per_token: num_layers x top_k x the compact id's bytes (0 without routes).
        other_bytes_per_token: :data:`OTHER_BYTES_PER_TOKEN`.
    """

    storage: str
    batches: int
    samples_per_batch: int
    tokens_per_sample: int
    route_bytes_per_token: int
    other_bytes_per_token: int = OTHER_BYTES_PER_TOKEN

    @property
    def tokens(self) -> int:
        """Tokens held at the fullest."""
        return self.batches * self.samples_per_batch * self.tokens_per_sample

    @property
    def route_bytes(self) -> int:
        """Bytes of compact routes held at the fullest."""
        return self.tokens * self.route_bytes_per_token

    @property
    def total_bytes(self) -> int:
        """Routes plus the per-token lists, bytes."""
        return self.tokens * (self.route_bytes_per_token + self.other_bytes_per_token)


def pool_batches(mode: str, lag: int) -> int:
    """Batches the pool holds at once: 1 for ``sync``, ``lag + 1`` for ``fixed_lag`` and
    ``bounded`` (module docstring).

    Raises:
        ValueError: for another mode or a negative lag.
    """
    if lag < 0:
        raise ValueError(f"rollout.lag must be >= 0, got {lag}")
    if mode == "sync":
        return 1
    if mode in ("fixed_lag", "bounded"):
        return lag + 1
    raise ValueError(f"rollout.mode must be sync, fixed_lag or bounded, got {mode!r}")


def pool_memory(
    *,
    storage: str,
    mode: str,
    lag: int,
    samples_per_batch: int,
    tokens_per_sample: int,
    routing_shape: tuple[int, int, int] | None,
) -> PoolMemory:
    """The pool's host memory at its fullest.

    Args:
        storage: ``rollout.pool_storage``.
        mode, lag: ``rollout.mode`` and ``rollout.lag``.
        samples_per_batch: ``rollout.prompts_per_step x rollout.group_size``.
        tokens_per_sample: prompt + response tokens per sample (a mean for the expected
            figure, the limit for a bound).
        routing_shape: (num_layers, top_k, num_experts) of the routes the samples carry, or
            None when the servers return none (``rollout.return_routed_experts=false``).

    Raises:
        ValueError: naming the field, for an unknown storage or mode, a negative lag, or a
            count < 1.
    """
    if storage not in POOL_STORAGES:
        raise ValueError(f"rollout.pool_storage must be one of {POOL_STORAGES}, got {storage!r}")
    for name, value in (
        ("samples_per_batch", samples_per_batch),
        ("tokens_per_sample", tokens_per_sample),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    route_bytes = 0
    if routing_shape is not None:
        num_layers, top_k, num_experts = routing_shape
        route_bytes = num_layers * top_k * compact_expert_dtype(num_experts).itemsize
    return PoolMemory(
        storage=storage,
        batches=pool_batches(mode, lag),
        samples_per_batch=samples_per_batch,
        tokens_per_sample=tokens_per_sample,
        route_bytes_per_token=route_bytes,
    )


def rollout_pool_memory(
    rollout, hf_config: dict, *, with_routes: bool, max_prompt_tokens: int
) -> tuple[PoolMemory, str]:
    """:func:`pool_memory` of a run's ``rollout`` section (``config.RolloutConfig``) and its
    model's ``config.json``, and its line for the launch plan's report. Without
    ``rollout.pool_tokens_per_sample`` a sample is sized at its longest,
    ``max_prompt_tokens`` (``launch.max_prompt_tokens``) + ``rollout.max_new_tokens``: the
    routes and ids cover the prompt too.

    Raises:
        ValueError: as :func:`pool_memory`, or a config.json without ``num_hidden_layers``,
            ``num_experts_per_tok`` or an expert count when routes are asked for.
    """
    tokens = rollout.pool_tokens_per_sample
    note = "rollout.pool_tokens_per_sample"
    if tokens is None:
        tokens = max_prompt_tokens + rollout.max_new_tokens
        note = "launch.max_prompt_tokens + rollout.max_new_tokens, the longest sample"
    shape = None
    if with_routes:
        experts = next(
            (hf_config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
             if hf_config.get(k)),
            None,
        )  # fmt: skip
        if experts is None or not hf_config.get("num_experts_per_tok"):
            raise ValueError("config.json: no expert count or num_experts_per_tok for the routes")
        shape = (
            int(hf_config["num_hidden_layers"]),
            int(hf_config["num_experts_per_tok"]),
            int(experts),
        )
    memory = pool_memory(
        storage=rollout.pool_storage,
        mode=rollout.mode,
        lag=rollout.lag,
        samples_per_batch=rollout.prompts_per_step * rollout.group_size,
        tokens_per_sample=tokens,
        routing_shape=shape,
    )
    return memory, format_pool_memory(memory, tokens_note=note)


def format_pool_memory(memory: PoolMemory, *, tokens_note: str) -> str:
    """One line for the launch plan's memory report (GiB = 2**30 bytes)."""
    gib = 2**30
    return (
        f"rollout pool host memory ({memory.storage}): up to {memory.batches} batch(es) x "
        f"{memory.samples_per_batch} samples x {memory.tokens_per_sample:,} tokens "
        f"({tokens_note}) x ({memory.route_bytes_per_token} B compact routes + "
        f"{memory.other_bytes_per_token} B ids, log-probs, versions) per token = "
        f"{memory.total_bytes / gib:.1f} GiB (routes {memory.route_bytes / gib:.1f} GiB)"
    )


def pool_memory_errors(rollout, memory: PoolMemory) -> list[str]:
    """The pool against ``rollout.pool_host_memory_gib`` (none when it is null or enough)."""
    limit = rollout.pool_host_memory_gib
    if limit is None or memory.total_bytes <= limit * 2**30:
        return []
    return [
        f"rollout.pool_host_memory_gib={limit:g}: the pool holds up to "
        f"{memory.total_bytes / 2**30:.1f} GiB on rank 0 ({memory.batches} batch(es) of "
        f"{memory.samples_per_batch} samples x {memory.tokens_per_sample} tokens); lower "
        "rollout.lag or rollout.prompts_per_step, or raise the limit"
    ]
