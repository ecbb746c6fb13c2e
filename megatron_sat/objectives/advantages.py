"""GRPO group-relative advantages (ALGORITHMS.md, "Advantages").

Sources: Shao et al., DeepSeekMath, arXiv 2402.03300, Section 4.1.2 (outcome supervision);
Liu et al., "Understanding R1-Zero-Like Training" (Dr.GRPO), arXiv 2503.20783 (no std division).
"""

from __future__ import annotations

import torch
from torch import Tensor


def compute_grpo_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-response advantages `A_i = (R_i - mean(R)) / (std(R) + eps)` within each prompt group.

    `std` is the *unbiased* (Bessel-corrected, divisor G - 1) sample standard deviation, as in
    `torch.std` and the GRPO implementations of verl, TRL and slime. With `normalize_std=False`
    the advantage is only mean-centred, `A_i = R_i - mean(R)` (Dr.GRPO).

    Non-finite rewards (NaN, e.g. a failed reward call, or +-inf) are masked: they are left out
    of their group's mean and std and get advantage exactly 0. A group whose valid rewards are
    all equal (or that has fewer than one valid reward) gets exactly 0 for all members, not
    rounding residue: e.g. mean(0.1, 0.1, 0.1) evaluates to 0.10000000000000002. A group with a
    single valid reward has std 0 (Bessel's divisor would be 0) and therefore also gets 0.

    Args:
        rewards: [N] float, N = num_groups * group_size, each group's G responses contiguous.
        group_size: G >= 1.
        normalize_std: divide by std + eps (GRPO) or not (Dr.GRPO).
        eps: >= 0, added to std.

    Returns:
        [N] tensor, dtype of `rewards` (promoted to float32 if not floating), never NaN.

    Raises:
        ValueError: `rewards` not 1-D, `group_size < 1`, `N % group_size != 0`, or `eps < 0`;
            or finite rewards whose group mean or std overflow `rewards`' dtype (e.g.
            [1e20, 0, 1, 0.5] in float32: the squares overflow, and masking that as non-finite
            gave the whole group advantage 0 silently), naming the group.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide the number of rewards {rewards.numel()}"
        )
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.to(dtype).view(-1, group_size)  # [num_groups, G]
    valid = torch.isfinite(r)
    zero = torch.zeros_like(r)
    r = torch.where(valid, r, zero)
    count = valid.sum(dim=-1, keepdim=True).to(dtype)
    mean = r.sum(dim=-1, keepdim=True) / count.clamp_min(1)
    centred = torch.where(valid, r - mean, zero)
    if normalize_std:
        var = (centred**2).sum(dim=-1, keepdim=True) / (count - 1).clamp_min(1)
        _refuse_overflow(r, mean + var, dtype)
        adv = centred / (var.sqrt() + eps)
    else:
        _refuse_overflow(r, mean, dtype)
        adv = centred
    # Exact zeros for constant groups
    adv = torch.where(valid & ~_constant_groups(r, valid), adv, zero)
    return adv.reshape(-1)


def _refuse_overflow(r: Tensor, statistics: Tensor, dtype: torch.dtype) -> None:
    """Raises for a group whose statistics ([num_groups, 1]) are not finite: its valid rewards
    are finite, so only overflow makes them so. (Statistics in float64 would avoid it but
    change ordinary advantages in the last bit; a reward this large is a bug to report.)"""
    bad = ~torch.isfinite(statistics.squeeze(-1))
    if bool(bad.any()):  # one device sync per call, once per step
        group = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"group {group} (samples {group * r.shape[1]}..{(group + 1) * r.shape[1] - 1}): "
            f"rewards {r[group].tolist()} overflow {dtype} in the group mean / std; "
            "scale the reward down"
        )


def _constant_groups(r: Tensor, valid: Tensor) -> Tensor:
    """[num_groups, 1] bool: max == min over the valid rewards (true with none valid)."""
    big = torch.full_like(r, float("inf"))
    group_max = torch.where(valid, r, -big).amax(dim=-1, keepdim=True)
    group_min = torch.where(valid, r, big).amin(dim=-1, keepdim=True)
    return group_max <= group_min


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Which prompt groups carry a learning signal: their finite rewards are not all equal.

    A group whose rewards are all equal (all solved or all failed) gets zero advantages, so it
    only dilutes the loss; DAPO's dynamic sampling (Yu et al., arXiv 2503.14476, Eq. 11:
    `0 < |{correct}| < G`) drops such groups and samples more prompts. Non-finite rewards are
    ignored, as in `compute_grpo_advantages`, so a group is informative exactly when that
    function gives it a non-zero advantage.

    Args:
        rewards: [N] float, N = num_groups * group_size, each group contiguous.
        group_size: G >= 1.

    Returns:
        [num_groups] bool.

    Raises:
        ValueError: as `compute_grpo_advantages`.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} cannot form groups of {group_size}"
        )
    r = rewards.to(torch.float64).view(-1, group_size)
    valid = torch.isfinite(r)
    return ~_constant_groups(torch.where(valid, r, torch.zeros_like(r)), valid).squeeze(-1)
