"""What a rollout engine's ``generate`` takes and returns, in SGLang's terms (sglang 0.5.23
``srt/sampling/sampling_params.py``, ``srt/managers/io_struct.py``); every engine's client
speaks these (``rollout.engine.RolloutClient``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# SGLang treats temperature below this as greedy (temperature 1, top_k 1):
# sglang/srt/sampling/sampling_params.py:_SAMPLING_EPS.
SAMPLING_EPS = 1e-6
# Other SGLang sampling_params, accepted only at values that leave sampling unchanged
# (token-id responses have no text, so the text-only switches are neutral at any value).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_new_tokens": (0,),
    "ignore_eos": (False,),
    "n": (1,),
    "stop": ([], ""),
    "skip_special_tokens": (True, False),
    "spaces_between_special_tokens": (True, False),
    "no_stop_trim": (True, False),
}


@dataclass(frozen=True)
class SamplingParams:
    """The subset of SGLang's ``sampling_params`` we use; defaults are SGLang's.

    Attributes:
        temperature: softmax temperature; < 1e-6 means greedy (SGLang's convention).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 keeps the whole vocabulary.
        max_new_tokens: maximum response length in tokens (>= 0).
        stop_token_ids: extra stop tokens (the model's eos ids always stop).
        sampling_seed: per-request seed (SGLang 0.5.23 ``sampling_params.sampling_seed``,
            an int64; honoured by SGLang with ``--enable-deterministic-inference``): each
            token is drawn from noise hashed from (seed, position), independent of the
            server's state and of the batch (see ``rollout.seeds``). None: the server's
            generator.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        # Callers pass lists; keep the frozen record hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("top_k", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        seed = self.sampling_seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63
        ):
            raise ValueError(f"sampling_seed must be an int64 or None, got {seed!r}")

    @property
    def greedy(self) -> bool:
        """True when SGLang would decode greedily."""
        return self.temperature < SAMPLING_EPS

    def to_json(self) -> dict[str, Any]:
        """SGLang's ``sampling_params`` JSON object."""
        out = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
        }
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SamplingParams:
        """Parse SGLang's ``sampling_params``; None means SGLang's default.

        Raises:
            ValueError: on a key this class does not implement set to a value that would change
                sampling (naming it), or a bad value.
        """
        ours = set(cls.__dataclass_fields__)
        for key, value in obj.items():
            if key not in ours and value is not None and value not in _NEUTRAL.get(key, ()):
                raise ValueError(f"unsupported sampling_params {key}={value!r}")
        return cls(**{k: v for k, v in obj.items() if k in ours and v is not None})


@dataclass(frozen=True)
class RoutingSpec:
    """Shape of the served model's routing, needed to decode ``routed_experts``."""

    num_layers: int
    top_k: int
    num_experts: int


@dataclass
class GenerateOutput:
    """One finished request of ``/generate``.

    Attributes:
        output_ids: response token ids, length R (a matched stop token included).
        output_token_logprobs: natural log-prob of each output token under the engine's
            temperature-scaled distribution before top-p/top-k truncation (SGLang's default);
            length R, or empty when not requested.
        finish_reason: "stop", "length" or "abort".
        weight_version: the server's weight version when the request finished.
        routed_experts: [P + R - 1 - routed_experts_start_len, num_layers, top_k] uint8 (<= 256
            experts) or int16; None when not requested or when an aborted request never ran.
        prompt_tokens: P.
        completion_tokens: R.
        meta_info: the raw meta_info object, for anything not typed above. From SGLang's
            client, less what is typed above in bulk: ``routed_experts`` (the base64 routes)
            and ``output_token_logprobs`` (the per-token triples;
            ``rollout.generate_reply.TYPED_META_KEYS``).
        output_token_versions: the weight version of each output token (length R) when the
            engine reports one per token (vLLM's ``weight_versions`` spans: a request that
            runs across a weight update has tokens of both versions); None when it reports one
            per request (SGLang: every token is given ``weight_version``).
    """

    output_ids: list[int]
    output_token_logprobs: list[float]
    finish_reason: str
    weight_version: str
    routed_experts: np.ndarray | None
    prompt_tokens: int
    completion_tokens: int
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)
    output_token_versions: list[str] | None = None

    def token_versions(self) -> list[str]:
        """The weight version of each output token: ``output_token_versions`` when the engine
        reported them, else ``weight_version`` for every token.

        Raises:
            ValueError: when ``output_token_versions`` does not have one entry per token.
        """
        if self.output_token_versions is None:
            return [self.weight_version] * len(self.output_ids)
        if len(self.output_token_versions) != len(self.output_ids):
            raise ValueError(
                f"{len(self.output_token_versions)} output_token_versions for "
                f"{len(self.output_ids)} output tokens"
            )
        return list(self.output_token_versions)
