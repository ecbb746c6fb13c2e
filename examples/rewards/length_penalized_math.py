"""Example reward plug-in (``rollout.reward=python``): math correctness minus a length penalty.

Use it with::

    rollout.reward=python
    rollout.reward_function=examples/rewards/length_penalized_math.py:length_penalized_math

The score is math-verify's 1.0 / 0.0 (``megatron_sat.rollout.rewards.math_reward``) plus a
penalty that grows linearly from 0 at ``budget`` characters of response to ``-max_penalty`` at
twice the budget and stays there (the shape of DAPO's overlong reward shaping, Yu et al. 2025,
Eq. 13, in characters since a plug-in gets text). The budget is ``metadata["length_budget"]``
when the sample's metadata has one, else ``DEFAULT_BUDGET``. Both parts are returned as
metrics, logged per step as ``reward/correct`` and ``reward/length_penalty``.
"""

from __future__ import annotations

from megatron_sat.rollout.rewards import math_reward

DEFAULT_BUDGET = 2000  # characters
MAX_PENALTY = 0.5


def length_penalty(num_chars: int, budget: int, max_penalty: float = MAX_PENALTY) -> float:
    """0 up to ``budget`` characters, then linear down to ``-max_penalty`` at ``2 * budget``."""
    over = min(max(num_chars - budget, 0), budget)
    return -max_penalty * over / budget


def length_penalized_math(prompt: str, response: str, label: str, metadata: dict) -> dict:
    """``{"score": correct + length_penalty, "correct": ..., "length_penalty": ...}``."""
    correct = math_reward(response, label)
    penalty = length_penalty(len(response), int(metadata.get("length_budget", DEFAULT_BUDGET)))
    return {"score": correct + penalty, "correct": correct, "length_penalty": penalty}
