"""Data records that flow from the rollout engine to the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sample:
    """One generated response to one prompt, with everything the trainer needs.

    Attributes:
        index: Global, unique id of the sample (never reused, survives retries).
        group_index: Id of the prompt group (the G samples of one prompt share it).
        prompt: Prompt text as fed to the tokenizer (after any chat template).
        label: Ground-truth answer used by the reward function.
        prompt_ids: Prompt token ids, length P.
        response_ids: Generated token ids, length R (R >= 0), the stop token included when the
            engine emitted one.
        rollout_log_probs: log mu(y_t | s_t) of each response token under the rollout engine
            (natural log, float), length R.
        response_versions: Policy version (trainer optimizer step whose weights the engine held)
            that produced each response token, length R.
        routed_experts: Experts the rollout engine routed each token to, shape
            [P + R - 1, num_hidden_layers, top_k], uint8 (<= 256 experts) or int16; the last
            token has no row (SGLang's convention). None when routing was not returned.
        finish_reason: "stop", "length" or "abort" (SGLang's finish_reason type).
        reward: Scalar reward, set by the reward function after generation.
        reward_metrics: the reward plug-in's extra metrics by name (``rollout.reward_plugins``;
            logged as the step's mean, ``reward/<name>``); empty for ``math``. Rank 0's only:
            not sent to the other trainer ranks.
    """

    index: int
    group_index: int
    prompt: str
    label: str
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    response_versions: list[int]
    routed_experts: np.ndarray | None = None
    finish_reason: str = "length"
    reward: float | None = None
    response_text: str = ""
    metadata: dict = field(default_factory=dict)
    reward_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Prompt plus response length in tokens."""
        return len(self.prompt_ids) + len(self.response_ids)


def staleness(sample: Sample, trainer_version: int) -> int:
    """How many versions old a sample is when the trainer at ``trainer_version`` consumes it.

    The one definition used by every metric and by admission control: trainer version minus
    the oldest version that produced a token of the sample, in optimizer steps (0 = on-policy).

    Raises:
        ValueError: for a sample without response tokens (nothing produced it).
    """
    if not sample.response_versions:
        raise ValueError(f"sample {sample.index} has no response tokens, so no version")
    return trainer_version - min(sample.response_versions)
