"""The reward a run scores samples with, chosen by ``rollout.reward``."""

from __future__ import annotations

import os

from megatron_sat.config.run import RolloutConfig
from megatron_sat.rollout.remote_reward import RemoteReward
from megatron_sat.rollout.rewards import RewardWorkers

MATH_TIMEOUT_S = 5  # math-verify's per-expression timeout (RewardWorkers' default)


def open_reward(rollout: RolloutConfig) -> RewardWorkers | RemoteReward:
    """The reward function of ``rollout.reward``, started; use it as a context manager.

    - ``math``: `RewardWorkers` scoring `math_reward`, math-verify's 5 s timeouts on;
    - ``python``: `RewardWorkers` running ``rollout.reward_function``, each call bounded by
      ``rollout.reward_timeout_s``;
    - ``http``: `RemoteReward` on ``rollout.reward_url``.

    Raises:
        RewardPluginError: the plug-in cannot be imported or has the wrong signature.
        ValueError: ``rollout.reward_api_key_env`` names an unset environment variable.
    """
    if rollout.reward == "math":
        return RewardWorkers(timeout_s=MATH_TIMEOUT_S)
    if rollout.reward == "python":
        return RewardWorkers(timeout_s=rollout.reward_timeout_s, function=rollout.reward_function)
    api_key = None
    if rollout.reward_api_key_env is not None:
        # The key is read from the environment at start and never written to the config.
        api_key = os.environ.get(rollout.reward_api_key_env)
        if not api_key:
            raise ValueError(
                f"rollout.reward_api_key_env={rollout.reward_api_key_env!r}: that environment "
                "variable is unset or empty"
            )
    return RemoteReward(
        rollout.reward_url,
        batch_size=rollout.reward_batch_size,
        timeout_s=float(rollout.reward_timeout_s),
        max_retries=rollout.reward_max_retries,
        api_key=api_key,
    )
