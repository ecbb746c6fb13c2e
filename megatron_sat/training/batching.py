"""Samples -> padded micro-batch tensors, with the R3 routes aligned exactly like the tokens.

Layout (right padding, one sample per row, S = longest prompt + response in the micro-batch,
optionally rounded up): ``input_ids[b, :P+R]`` = prompt ids then response ids. Position t
predicts token t + 1, so the log-prob of response token j (absolute position P + j) sits at
position ``P + j - 1``: ``labels``, ``loss_mask``, ``rollout_log_probs`` and
``response_versions`` live at those positions.

Routes: SGLang returns ``routed_experts`` [P + R - 1, num_layers, top_k] (no row for the last
token). A filler row is appended for the last token and for every padding position. Filler rows
hold valid ids that differ within the row and cycle over all experts (and so over all EP ranks),
so padding never piles onto one expert. megatron-core's router sees tokens sequence-major, so
the per-layer target is the [S, B, K] tensor flattened to [S * B, K].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_sat.rollout.types import Sample


@dataclass
class MicroBatch:
    """One micro-batch of B samples padded to S tokens.

    Attributes:
        input_ids: int64 [B, S].
        position_ids: int64 [B, S].
        labels: int64 [B, S], next token at each position (0 at padding).
        loss_mask: float32 [B, S], 1.0 where ``labels`` is a response token.
        rollout_log_probs: float32 [B, S], log mu of the label token (0 where inactive).
        response_versions: int64 [B, S], policy version that sampled the label (-1 inactive).
        advantages: float32 [B], one per sample.
        routes: int64 [B, S, L, K] expert ids per token and MoE layer (filler rows included), or
            None without routing data.
        routes_valid: bool [B, S], True where ``routes`` came from the rollout engine.
        sample_indices: the ``Sample.index`` of each row.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    response_versions: torch.Tensor
    advantages: torch.Tensor
    routes: torch.Tensor | None
    routes_valid: torch.Tensor
    sample_indices: list[int]

    def routing_targets(self) -> dict[int, torch.Tensor]:
        """Global 1-based layer number -> int64 [S * B, K] in the router's token order."""
        if self.routes is None:
            raise ValueError("this micro-batch carries no routing data (R3 needs routed experts)")
        routes = self.routes.transpose(0, 1)  # [S, B, L, K]: sequence-major like the router
        seq, batch, layers, top_k = routes.shape
        return {
            layer + 1: routes[:, :, layer].reshape(seq * batch, top_k).contiguous()
            for layer in range(layers)
        }


def filler_routes(num_rows: int, top_k: int, num_experts: int, start: int = 0) -> np.ndarray:
    """Expert ids [num_rows, top_k] for rows without rollout routes.

    Row i holds experts ``((start + i) * top_k + j) % num_experts``: distinct within a row
    (top_k <= num_experts) and spread evenly over all experts.
    """
    rows = np.arange(start, start + num_rows)[:, None] * top_k + np.arange(top_k)[None, :]
    return rows % num_experts


def aligned_routes(
    sample: Sample, seq_len: int, num_layers: int, top_k: int, num_experts: int
) -> tuple[np.ndarray, int]:
    """The sample's routes padded to ``seq_len`` rows: (int64 [S, L, K], number of real rows).

    Raises:
        ValueError: naming the sample when its ``routed_experts`` is missing or its shape is not
            [P + R - 1, num_layers, top_k], or when an id is outside [0, num_experts).
    """
    routed = sample.routed_experts
    expected = (sample.num_tokens - 1, num_layers, top_k)
    if routed is None:
        raise ValueError(f"sample {sample.index} has no routed_experts but R3 replay is on")
    if tuple(routed.shape) != expected:
        raise ValueError(
            f"sample {sample.index}: routed_experts has shape {tuple(routed.shape)}, expected "
            f"{expected} = [prompt {len(sample.prompt_ids)} + response "
            f"{len(sample.response_ids)} - 1 tokens, {num_layers} layers, top_k {top_k}]"
        )
    if routed.size and (routed.min() < 0 or routed.max() >= num_experts):
        raise ValueError(f"sample {sample.index}: routed_experts ids outside [0, {num_experts})")
    real = expected[0]
    out = np.empty((seq_len, num_layers, top_k), dtype=np.int64)
    out[:real] = routed
    filler = filler_routes(seq_len - real, top_k, num_experts, start=real)
    out[real:] = filler[:, None, :]
    return out, real


def build_micro_batch(
    samples: Sequence[Sample],
    advantages: Sequence[float] | torch.Tensor,
    *,
    pad_token_id: int,
    routing_shape: tuple[int, int, int] | None = None,
    pad_to_multiple_of: int = 1,
) -> MicroBatch:
    """Pad ``samples`` into one :class:`MicroBatch`.

    Args:
        samples: B samples with at least one prompt token each.
        advantages: B per-sample advantages.
        pad_token_id: Token id written at padding positions.
        routing_shape: (num_layers, top_k, num_experts) to align routes for R3, or None.
        pad_to_multiple_of: Round S up (e.g. to the TP size for sequence parallelism).

    Raises:
        ValueError: for an empty batch, a sample without prompt tokens, mismatched lengths of
            ``rollout_log_probs``/``response_versions``, a NaN/inf rollout log-prob, or bad
            routes (naming the sample).
    """
    if not samples:
        raise ValueError("empty micro-batch")
    advantages = torch.as_tensor(advantages, dtype=torch.float32)
    if advantages.shape != (len(samples),):
        raise ValueError(f"advantages shape {tuple(advantages.shape)} != ({len(samples)},)")
    seq = max(s.num_tokens for s in samples)
    seq = -(-seq // pad_to_multiple_of) * pad_to_multiple_of
    b = len(samples)
    input_ids = torch.full((b, seq), pad_token_id, dtype=torch.long)
    labels = torch.zeros((b, seq), dtype=torch.long)
    loss_mask = torch.zeros((b, seq), dtype=torch.float32)
    rollout_lp = torch.zeros((b, seq), dtype=torch.float32)
    versions = torch.full((b, seq), -1, dtype=torch.long)
    routes_valid = torch.zeros((b, seq), dtype=torch.bool)
    routes = None
    if routing_shape is not None:
        routes = torch.empty((b, seq, routing_shape[0], routing_shape[1]), dtype=torch.long)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p == 0:
            raise ValueError(f"sample {s.index} has an empty prompt")
        if len(s.rollout_log_probs) != r or len(s.response_versions) != r:
            raise ValueError(
                f"sample {s.index}: {r} response tokens but {len(s.rollout_log_probs)} "
                f"rollout_log_probs and {len(s.response_versions)} response_versions"
            )
        lp = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
        if not torch.isfinite(lp).all():
            bad = int((~torch.isfinite(lp)).nonzero()[0])
            raise ValueError(f"sample {s.index}: rollout_log_probs[{bad}] = {lp[bad].item()}")
        tokens = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        input_ids[row, : p + r] = tokens
        labels[row, : p + r - 1] = tokens[1:]
        loss_mask[row, p - 1 : p + r - 1] = 1.0
        rollout_lp[row, p - 1 : p + r - 1] = lp
        versions[row, p - 1 : p + r - 1] = torch.tensor(s.response_versions, dtype=torch.long)
        if routes is not None:
            aligned, real = aligned_routes(s, seq, *routing_shape)
            routes[row] = torch.from_numpy(aligned)
            routes_valid[row, :real] = True
    position_ids = torch.arange(seq, dtype=torch.long).expand(b, seq).contiguous()
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        labels=labels,
        loss_mask=loss_mask,
        rollout_log_probs=rollout_lp,
        response_versions=versions,
        advantages=advantages,
        routes=routes,
        routes_valid=routes_valid,
        sample_indices=[s.index for s in samples],
    )
