"""Held-out accuracy through the rollout servers, with its sampling noise."""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.pool import RolloutPool


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error ``std / sqrt(n)`` (population std of the n values)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to average")
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n
    return mean, math.sqrt(var / n)


def evaluate(
    pool: RolloutPool,
    records: Sequence[PromptRecord],
    *,
    samples_per_prompt: int,
    temperature: float,
    max_new_tokens: int,
    seed_of=None,
) -> dict[str, float]:
    """Greedy accuracy and sampled avg@k on ``records``.

    ``seed_of(prompt_index, sample_index) -> int``, when given, seeds each sampled request
    (``rollout.seeds``), so an evaluation repeats exactly whatever the servers' state.

    The noise of each figure is the standard error of the mean over prompts (for avg@k, of the
    per-prompt mean over its k samples): the spread a different draw of held-out prompts (and
    of samples) would give. Two evaluations differ beyond noise when the gap exceeds twice
    ``sqrt(se_1^2 + se_2^2)``.

    Returns:
        ``eval/acc_greedy``, ``eval/acc_greedy_stderr``, ``eval/avg_at_k``,
        ``eval/avg_at_k_stderr``, ``eval/pass_at_k`` (fraction of prompts with any correct
        sample), ``eval/num_prompts``.
    """
    greedy = pool.generate_groups(
        records, 1, temperature=0.0, max_new_tokens=max_new_tokens, with_routing=False
    )
    sampled = pool.generate_groups(
        records,
        samples_per_prompt,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        with_routing=False,
        seed_of=seed_of,
    )
    acc, acc_se = mean_and_stderr([s.reward for s in greedy])
    k = samples_per_prompt
    per_prompt = [sum(s.reward for s in sampled[i : i + k]) / k for i in range(0, len(sampled), k)]
    avg, avg_se = mean_and_stderr(per_prompt)
    return {
        "eval/acc_greedy": acc,
        "eval/acc_greedy_stderr": acc_se,
        "eval/avg_at_k": avg,
        "eval/avg_at_k_stderr": avg_se,
        "eval/pass_at_k": sum(p > 0 for p in per_prompt) / len(per_prompt),
        "eval/num_prompts": float(len(records)),
    }
