"""A :class:`~megatron_sat.rollout.fleet.RolloutFleet` of vLLM servers given by URL: the same
dead-server handling (URL servers are reported, never restarted), the weight push through
vLLM's weight-transfer API (:class:`~megatron_sat.rollout.vllm.updater.VLLMWeightUpdater`)."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_sat.rollout.fleet import RolloutFleet
from megatron_sat.rollout.vllm.client import VLLMClient
from megatron_sat.rollout.vllm.updater import VLLMWeightUpdater


class VLLMFleet(RolloutFleet):
    """Running vLLM servers as one fleet (see :class:`RolloutFleet`)."""

    updater_cls = VLLMWeightUpdater

    def _health_error(self, client: VLLMClient, may_be_paused: bool = False) -> str | None:
        """None when GET /health answers 200 within the probe timeout, else why not. vLLM's
        /health reads the engine's error state without generating, so it answers at once on
        a paused server too: the same probe whether or not a failed push left it paused."""
        del may_be_paused
        if client.health(self.config.health_timeout_s):
            return None
        return f"GET {client.base_url}/health did not answer 200"

    @classmethod
    def from_urls(cls, urls: Sequence[str], *, api_key: str | None = None, **kwargs) -> VLLMFleet:
        """A fleet over running vLLM servers; ``api_key``: their ``--api-key``, if any."""
        return cls([VLLMClient(url, api_key=api_key) for url in urls], **kwargs)
