"""Batched sampling with a transformers MoE causal LM on the CPU, SGLang's semantics.

What it returns per request mirrors SGLang 0.5.23:

- ``output_token_logprobs``: natural log of the sampled token under ``softmax(logits / T)``,
  taken *before* top-p/top-k truncation (``srt/layers/sampler.py``: it returns
  ``log(probs)`` of the untruncated probs; top-k/top-p only mask a sorted copy). Greedy requests
  (T < 1e-6) become T = 1, top_k = 1 as in SGLang, so their log-probs are ``log_softmax(logits)``.
- ``routed_experts``: int32 [prompt_len + output_len - 1, num_hidden_layers, top_k], one row per
  token that went through the model (the last sampled token never does), the router's top-k in
  its own order; dense layers (no router) are 0, as in SGLang's zero-initialised capture buffer.
- ``finish_reason``: "stop" (eos or a ``stop_token_ids`` token, which stays in ``output_ids``),
  "length" (``max_new_tokens`` reached) or "abort".

Batching: left padding, a 2-d attention mask and explicit position ids, one DynamicCache for the
batch; finished rows stay in the batch (their outputs are ignored) so the cache never needs
re-indexing. Routing is captured by a forward hook on every MoE router (``mlp.gate``, whose
forward returns ``(router_logits, router_scores, router_indices)`` in transformers 5.23
``modeling_qwen3_moe.py``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache

from megatron_sat.platform.host_copy import copy_into
from megatron_sat.rollout.client import SamplingParams

# On-disk per-expert names; transformers 5 fuses them in memory as experts.gate_up_proj
# [E, 2I, H] (gate rows first, then up: Qwen3MoeExperts.forward chunks the output in two) and
# experts.down_proj [E, H, I].
_EXPERT_NAME = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$"
)


@dataclass(frozen=True)
class EngineRequest:
    """One prompt to complete: token ids (length P >= 1) and its sampling parameters."""

    input_ids: list[int]
    sampling: SamplingParams


@dataclass
class EngineOutput:
    """One completed request; see the module docstring for the semantics of each field."""

    output_ids: list[int]
    output_token_logprobs: list[float]
    finish_reason: str
    matched_stop: int | None
    routed_experts: np.ndarray | None


# SGLang's --dtype names the engine accepts (float32 = "float", bfloat16 as on GPUs).
ENGINE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class GenerationEngine:
    """A transformers MoE model on the CPU that samples like SGLang.

    Args:
        model_path: Hugging Face checkpoint directory (safetensors).
        seed: seed of the engine's torch.Generator (all sampling draws come from it).
        dtype: weights and activations, a key of ``ENGINE_DTYPES`` (SGLang's ``--dtype``).
            "bfloat16" gives a realistic train-rollout mismatch against an fp32 trainer
            (different precision and kernels, as SGLang against Megatron): log-probs differ
            and router top-k flips, which R3 removes. Logits are upcast to float32 before
            sampling either way; pushed weights are cast on load, as SGLang's weight loader
            copies into its parameters.

    Raises:
        ValueError: an unknown ``dtype``.

    Not thread-safe: the server serialises ``generate`` and ``load_weights``.
    """

    def __init__(self, model_path: str, seed: int, dtype: str = "float32") -> None:
        if dtype not in ENGINE_DTYPES:
            raise ValueError(f"engine dtype must be one of {sorted(ENGINE_DTYPES)}, got {dtype!r}")
        self.dtype = ENGINE_DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).eval()
        config = self.model.config
        self.num_layers: int = config.num_hidden_layers
        self.top_k: int = config.num_experts_per_tok
        # Qwen-MoE's num_experts, DeepSeek-V3's n_routed_experts, Mixtral's num_local_experts.
        self.num_experts: int = next(
            getattr(config, name)
            for name in ("num_experts", "n_routed_experts", "num_local_experts")
            if getattr(config, name, None)
        )
        self.eos_token_ids = _eos_token_ids(config, self.model.generation_config)
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_targets = _weight_targets(self.model, Path(model_path))
        self._routes: dict[int, torch.Tensor] = {}
        num_routers = 0
        for layer_idx, layer in enumerate(self.model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if isinstance(gate, torch.nn.Module) and hasattr(gate, "top_k"):
                gate.register_forward_hook(self._route_hook(layer_idx))
                num_routers += 1
            elif hasattr(layer.mlp, "experts"):
                # An MoE layer whose router we cannot hook would silently report zeros.
                raise ValueError(f"layer {layer_idx}: MoE block without a top-k router mlp.gate")
        if num_routers == 0:
            raise ValueError(f"{type(self.model).__name__} has no MoE router (mlp.gate) to capture")

    def _route_hook(self, layer_idx: int) -> Callable:
        def hook(module, args, output) -> None:
            indices = output[2]  # (router_logits, router_scores, router_indices [B*S, top_k])
            if indices.shape[-1] != self.top_k:
                raise RuntimeError(f"layer {layer_idx} router returned {indices.shape} indices")
            self._routes[layer_idx] = indices.detach()

        return hook

    @torch.no_grad()
    def _forward(self, ids, mask, pos, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns last-position logits [B, V] float32 and routes int32 [B, S, L, top_k]."""
        self._routes.clear()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch, seq = ids.shape
        routes = torch.zeros(batch, seq, self.num_layers, self.top_k, dtype=torch.int32)
        for layer_idx, indices in self._routes.items():
            routes[:, :, layer_idx] = indices.view(batch, seq, self.top_k).to(torch.int32)
        return out.logits[:, -1].float(), routes

    def generate(
        self,
        requests: Sequence[EngineRequest],
        should_abort: Callable[[], bool] = lambda: False,
        on_finish: Callable[[int, EngineOutput], None] | None = None,
    ) -> list[EngineOutput]:
        """Complete a batch; ``should_abort`` is polled between decode steps.

        ``on_finish(b, output)``, when given, is called as soon as request ``b`` stops or
        reaches its length (its output, routed experts included, is final then), so a server
        can answer it while longer requests of the batch still decode, as SGLang returns each
        request when it finishes. Aborted requests are not reported there.

        Raises:
            ValueError: on an empty prompt or a token id outside the vocabulary.
        """
        vocab = self.model.config.vocab_size
        for i, req in enumerate(requests):
            if not req.input_ids:
                raise ValueError(f"request {i}: input_ids is empty")
            if min(req.input_ids) < 0 or max(req.input_ids) >= vocab:
                raise ValueError(f"request {i}: token id outside [0, {vocab})")
        batch, seq = len(requests), max(len(r.input_ids) for r in requests)
        ids = torch.zeros(batch, seq, dtype=torch.long)
        mask = torch.zeros(batch, seq, dtype=torch.long)
        for b, req in enumerate(requests):
            ids[b, seq - len(req.input_ids) :] = torch.tensor(req.input_ids)
            mask[b, seq - len(req.input_ids) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits, routes = self._forward(ids, mask, pos, cache)
        # Drop the left padding rows: each request keeps its own P rows.
        route_rows = [[routes[b, seq - len(r.input_ids) :]] for b, r in enumerate(requests)]
        outputs = [EngineOutput([], [], "length", None, None) for _ in requests]
        active = [r.sampling.max_new_tokens > 0 for r in requests]
        stops = [set(r.sampling.stop_token_ids) | self.eos_token_ids for r in requests]
        while any(active):
            # pos[:, -1]: the position of each row's last input token (SGLang's positions).
            tokens, logprobs = self._sample(logits, [r.sampling for r in requests], pos[:, -1])
            for b, req in enumerate(requests):
                if not active[b]:
                    continue
                token = int(tokens[b])
                outputs[b].output_ids.append(token)
                outputs[b].output_token_logprobs.append(float(logprobs[b]))
                if token in stops[b]:
                    outputs[b].finish_reason, outputs[b].matched_stop = "stop", token
                    active[b] = False
                elif len(outputs[b].output_ids) >= req.sampling.max_new_tokens:
                    active[b] = False
                if not active[b] and on_finish is not None:
                    # Its last token never goes through the model: its routes are complete.
                    outputs[b].routed_experts = torch.cat(route_rows[b]).numpy()
                    on_finish(b, outputs[b])
            if not any(active):
                break
            if should_abort():
                for b in range(batch):
                    if active[b]:
                        outputs[b].finish_reason, active[b] = "abort", False
                break
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1
            logits, routes = self._forward(tokens.view(batch, 1), mask, pos, cache)
            for b in range(batch):
                if active[b]:
                    route_rows[b].append(routes[b])
        for out, rows in zip(outputs, route_rows, strict=True):
            if out.routed_experts is None:
                out.routed_experts = torch.cat(rows).numpy()
        return outputs

    def _sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row as SGLang's torch sampler does.

        A row whose params carry ``sampling_seed`` draws from Gumbel noise that depends only
        on (seed, position, vocabulary index), as SGLang's ``multinomial_with_seed`` (its
        hash is murmur3 on the GPU; ours is a torch generator seeded from (seed, position)):
        neither the engine's generator nor the batch it shares changes its token.

        Args:
            logits: [B, V] float32.
            positions: [B] int64, position of each row's last input token (needed for seeded
                rows).

        Returns:
            tokens [B] int64 and their log-probs [B] under softmax(logits / T), untruncated.
        """
        vocab = logits.shape[-1]
        greedy = torch.tensor([p.greedy for p in params])
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
        top_ks = torch.tensor(
            [1 if p.greedy else (p.top_k if p.top_k > 0 else vocab) for p in params]
        )
        top_ps = torch.tensor([p.top_p for p in params])
        logprobs_all = torch.log_softmax(logits / temps[:, None], dim=-1)
        probs_sort, probs_idx = logprobs_all.exp().sort(dim=-1, descending=True)
        probs_sum = probs_sort.cumsum(dim=-1)
        probs_sort[torch.arange(vocab)[None, :] >= top_ks[:, None]] = 0.0
        probs_sort[(probs_sum - probs_sort) > top_ps[:, None]] = 0.0
        seeded = [b for b, p in enumerate(params) if p.sampling_seed is not None and not p.greedy]
        unseeded = [b for b in range(len(params)) if b not in set(seeded)]
        sampled = torch.zeros(len(params), 1, dtype=torch.long)
        if unseeded:  # the engine's generator draws for these rows only, in row order
            rows = torch.tensor(unseeded)
            draws = torch.multinomial(probs_sort[rows], 1, generator=self.generator)
            sampled[rows] = probs_idx[rows].gather(1, draws)
        if seeded:
            if positions is None:
                raise ValueError("seeded sampling needs the token positions")
            for b in seeded:
                truncated = torch.zeros(vocab, dtype=torch.float64)
                truncated[probs_idx[b]] = probs_sort[b].double()
                noise = _gumbel(params[b].sampling_seed, int(positions[b]), vocab)
                sampled[b, 0] = int((truncated.log() + noise).argmax())
        tokens = torch.where(greedy, logits.argmax(dim=-1), sampled.view(-1))
        return tokens, logprobs_all.gather(1, tokens[:, None]).view(-1)

    @torch.no_grad()
    def load_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the live model by on-disk HF name (validated by the caller); a
        float tensor of another precision is cast (as SGLang's loaders do)."""
        for name, tensor in named_tensors:
            copy_into(self.weight_targets[name], tensor)


def _gumbel(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Gumbel noise [vocab] float64 that depends only on (seed, position): SGLang's seeded
    sampling draws argmax(log p + noise) (float64, uniforms clamped away from 0 and 1)."""
    key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    u = torch.rand(vocab, dtype=torch.float64, generator=generator)
    u = u.clamp(min=2.0**-53, max=1.0 - 2.0**-53)
    return -torch.log(-torch.log(u))


def _eos_token_ids(config, generation_config) -> set[int]:
    """eos ids from config.json and generation_config.json (as SGLang's model config reads)."""
    ids: set[int] = set()
    for source in (config, generation_config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return ids


def _weight_targets(model: torch.nn.Module, model_path: Path) -> dict[str, torch.Tensor]:
    """Map every tensor name of the checkpoint on disk to the live tensor (or view) it loads.

    Raises:
        ValueError: if the directory has no safetensors, or an on-disk name or shape has no
            counterpart in the model (so a transformers layout change fails at startup).
    """
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_path}: no *.safetensors files (needed for the weight-name map)")
    params = model.state_dict(keep_vars=True)
    targets: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                target = _resolve(params, name)
                if target is None or tuple(target.shape) != shape:
                    got = None if target is None else tuple(target.shape)
                    raise ValueError(f"{file.name}: {name} {shape} has no model tensor (got {got})")
                targets[name] = target
    return targets


def _resolve(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    if name in params:
        return params[name].data
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    prefix, expert, proj = match["prefix"], int(match["e"]), match["proj"]
    if proj == "down":
        fused = params.get(f"{prefix}.down_proj")
        return None if fused is None else fused.data[expert]
    fused = params.get(f"{prefix}.gate_up_proj")
    if fused is None:
        return None
    half = fused.shape[1] // 2
    return fused.data[expert, :half] if proj == "gate" else fused.data[expert, half:]
