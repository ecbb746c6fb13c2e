"""Rollout pool: turns prompts into groups of scored samples through N rollout servers.

Each sample carries the policy version that produced its tokens, taken from the server's
``meta_info.weight_version`` (which the trainer sets on every weight sync), never from a local
counter. This version generates synchronously, one batch per trainer step, with prompts spread
over the servers in parallel; the configured lag comes from how often the trainer syncs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from megatron_sat.rollout.client import GenerateOutput, RoutingSpec, SamplingParams, SGLangClient
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.types import Sample

RewardFn = Callable[[str, str], float]


def parse_weight_version(version: str, server: str) -> int:
    """The integer policy version of a server's ``weight_version`` string.

    Raises:
        ValueError: naming the server when the version is not an integer (e.g. SGLang's
            ``"default"``: start servers with ``--weight-version 0``).
    """
    try:
        return int(version)
    except (TypeError, ValueError):
        raise ValueError(
            f"server {server} reports weight_version={version!r}, not an integer policy "
            "version; start it with --weight-version 0"
        ) from None


class RolloutPool:
    """Generates G samples per prompt on a set of SGLang-compatible servers and scores them.

    Args:
        clients: one client per server; prompts are split evenly among them.
        tokenizer: encodes prompts, decodes responses (HF tokenizer).
        reward_fn: ``reward_fn(response_text, label) -> float``.
        routing: shape of the served model's routing; when given, routed experts are requested
            and attached to every sample (R3).
        stop_token_ids: stop tokens besides the model's eos.
    """

    def __init__(
        self,
        clients: Sequence[SGLangClient],
        tokenizer,
        reward_fn: RewardFn,
        *,
        routing: RoutingSpec | None,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        if not clients:
            raise ValueError("the rollout pool needs at least one server")
        self.clients = list(clients)
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.routing = routing
        self.stop_token_ids = tuple(stop_token_ids)
        self._next_index = itertools.count()
        self._next_group = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=len(self.clients))

    def close(self) -> None:
        """Stop the worker threads (the servers are not touched)."""
        self._executor.shutdown(wait=True)

    def generate_groups(
        self,
        records: Sequence[PromptRecord],
        group_size: int,
        *,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = -1,
        max_new_tokens: int,
        with_routing: bool = True,
    ) -> list[Sample]:
        """``group_size`` scored samples per record, grouped contiguously in record order.

        Raises:
            SGLangError: when a server fails (naming it); no partial batch is returned.
            ValueError: for a non-integer weight version.
        """
        sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            stop_token_ids=self.stop_token_ids,
        )
        prompts = [self.tokenizer.encode(r.prompt) for r in records]
        requests = [(g, ids) for g, ids in enumerate(prompts) for _ in range(group_size)]
        shards = [requests[i :: len(self.clients)] for i in range(len(self.clients))]
        routing = self.routing if with_routing else None

        def run(client: SGLangClient, shard):
            if not shard:
                return []
            outputs = client.generate([ids for _, ids in shard], sampling, routing=routing)
            return [
                (g, ids, out, client.base_url) for (g, ids), out in zip(shard, outputs, strict=True)
            ]

        results = [
            item
            for future in [
                self._executor.submit(run, c, s) for c, s in zip(self.clients, shards, strict=True)
            ]
            for item in future.result()
        ]
        results.sort(key=lambda item: item[0])  # stable: groups contiguous, in record order
        group_ids = [next(self._next_group) for _ in records]
        return [
            self._to_sample(records[g], group_ids[g], ids, out, url) for g, ids, out, url in results
        ]

    def _to_sample(
        self,
        record: PromptRecord,
        group: int,
        prompt_ids: list[int],
        out: GenerateOutput,
        url: str,
    ) -> Sample:
        version = parse_weight_version(out.weight_version, url)
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        return Sample(
            index=next(self._next_index),
            group_index=group,
            prompt=record.prompt,
            label=record.label,
            prompt_ids=list(prompt_ids),
            response_ids=list(out.output_ids),
            rollout_log_probs=list(out.output_token_logprobs),
            response_versions=[version] * len(out.output_ids),
            routed_experts=out.routed_experts,
            finish_reason=out.finish_reason,
            reward=float(self.reward_fn(text, record.label)),
            response_text=text,
        )
