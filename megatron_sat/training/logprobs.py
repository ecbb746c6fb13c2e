"""Per-token log-probabilities from a megatron-core GPT forward, and routing agreement."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_sat.training.batching import MicroBatch


def forward_log_probs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """log pi(labels[b, t] | input_ids[b, :t+1]) for every position: float32 [B, S].

    Uses megatron-core's vocab-parallel cross entropy (``labels=`` forward), so it holds under
    tensor parallelism without gathering the vocabulary. Positions outside ``mb.loss_mask``
    hold log-probs of padding labels: mask them.
    """
    per_token_ce = model(mb.input_ids, mb.position_ids, None, labels=mb.labels)
    return -per_token_ce.float()


def routing_agreement(
    captured: Mapping[int, torch.Tensor], mb: MicroBatch
) -> dict[str, torch.Tensor]:
    """How often the experts a forward used equal the rollout engine's, per layer and overall.

    Args:
        captured: Layer number -> bool routing map [S * B, E] from
            :func:`megatron_sat.routing.replay.capture_routing`.
        mb: The micro-batch whose ``routes`` hold the rollout engine's experts.

    Returns:
        ``{"topk_match": fraction, "topk_match_layer{l}": fraction, ...}`` over the positions of
        ``mb.loss_mask`` (the tokens whose hidden states give response log-probs), counting a
        token as a match when its set of top-k experts is identical. 0-dim float tensors.
    """
    if mb.routes is None:
        raise ValueError("micro-batch has no rollout routes to compare with")
    batch, seq = mb.input_ids.shape
    active = mb.loss_mask.bool().transpose(0, 1).reshape(-1)  # sequence-major like the router
    out: dict[str, torch.Tensor] = {}
    matches = []
    for layer, used in sorted(captured.items()):
        rollout = mb.routes[:, :, layer - 1].transpose(0, 1).reshape(seq * batch, -1)
        rollout_map = torch.zeros_like(used).scatter_(1, rollout, True)
        same = (rollout_map == used).all(dim=1)[active].float()
        out[f"topk_match_layer{layer}"] = same.mean()
        matches.append(same)
    out["topk_match"] = torch.cat(matches).mean()
    return out
