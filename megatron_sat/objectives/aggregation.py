"""Reduce a per-token loss [B, T] to the scalar the optimizer minimises.

Mode names follow the `loss_agg_mode` field (ALGORITHMS.md, "Loss aggregation modes"; the same
names as verl). Under data parallelism and gradient accumulation the denominators must be global
(all-reduced over every micro-batch of the optimizer step on every rank): pass
`global_num_tokens` / `global_num_seqs` and each call returns its *share* of the global mean, so
summing the returned losses over micro-batches and ranks gives the global value.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _denominator(
    global_value: float | Tensor | None, local_count: Tensor, name: str, dtype: torch.dtype
) -> Tensor | float:
    """The global denominator if given (validated when it is a Python number), else the local one.

    A local count of 0 (an empty micro-batch) becomes 1 so the loss is an exact, differentiable 0
    instead of 0/0.
    """
    if global_value is None:
        return local_count.clamp_min(1).to(dtype)
    if isinstance(global_value, (int, float)) and not global_value > 0:
        # `not > 0` also rejects NaN. Tensors are not checked: that would force a device sync.
        raise ValueError(f"{name} must be > 0 when given, got {global_value!r}")
    return global_value


def aggregate_loss(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    mode: str,
    *,
    global_num_tokens: float | Tensor | None = None,
    global_num_seqs: float | Tensor | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """Aggregate a per-token loss over the active tokens of a batch.

    With `m` the mask, `l` the loss, `n_b = sum_t m_bt` and `S` the set of responses with
    `n_b > 0`:

    - `token-mean`:              `sum_bt m l / N_tok`                (DAPO token-level mean)
    - `seq-mean-token-mean`:     `sum_b (sum_t m l / n_b) / N_seq`    (GRPO, GSPO Eq. 5)
    - `seq-mean-token-sum`:      `sum_b (sum_t m l) / N_seq`
    - `seq-mean-token-sum-norm`: `sum_b (sum_t m l / C) / N_seq`      (Dr.GRPO, a constant C)

    `N_tok` = `global_num_tokens` or the number of active tokens here; `N_seq` =
    `global_num_seqs` or `|S|` here (responses with no active token never count). Responses with
    `n_b = 0` contribute 0.

    Args:
        per_token_loss: [B, T] float. Values at inactive positions are ignored, even NaN/inf
            (selected away with `torch.where`, so they reach neither the value nor the gradient).
        loss_mask: [B, T] bool or 0/1, true on active response tokens.
        mode: One of `LOSS_AGG_MODES`.
        global_num_tokens: Active tokens in the whole optimizer step (all micro-batches, all
            data-parallel ranks); None = this batch alone. Used by `token-mean` only.
        global_num_seqs: Responses with at least one active token in the whole optimizer step;
            None = this batch alone. Used by the `seq-mean-*` modes.
        norm_constant: C of `seq-mean-token-sum-norm` (Dr.GRPO uses the generation budget, i.e.
            the maximum response length). None = T, the padded width of this batch. That default
            depends on padding; trainers should pass the configured maximum response length.

    Returns:
        0-dim tensor of `per_token_loss.dtype`.

    Raises:
        ValueError: unknown `mode`, shape mismatch, or a non-positive global denominator or
            `norm_constant`.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    if per_token_loss.dim() != 2 or per_token_loss.shape != loss_mask.shape:
        raise ValueError(
            f"per_token_loss and loss_mask must both be [B, T], got {tuple(per_token_loss.shape)} "
            f"and {tuple(loss_mask.shape)}"
        )
    if norm_constant is not None and not norm_constant > 0:
        raise ValueError(f"norm_constant must be > 0 when given, got {norm_constant!r}")
    mask = loss_mask.to(torch.bool)
    loss = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    dtype = loss.dtype
    if mode == "token-mean":
        num_tokens = _denominator(global_num_tokens, mask.sum(), "global_num_tokens", dtype)
        return loss.sum() / num_tokens

    seq_sum = loss.sum(dim=-1)  # [B]
    seq_len = mask.sum(dim=-1)  # [B]
    num_seqs = _denominator(global_num_seqs, (seq_len > 0).sum(), "global_num_seqs", dtype)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_len.clamp_min(1).to(dtype)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    else:  # seq-mean-token-sum-norm
        per_seq = seq_sum / (norm_constant if norm_constant is not None else loss.shape[-1])
    return per_seq.sum() / num_seqs
