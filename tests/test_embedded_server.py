"""Embedded rollout server end to end: SGLang wire format, transformers parity, weight sync.

One server (a subprocess) serves the whole module. Oracles: a full (uncached, unpadded)
transformers forward of prompt + response for log-probs, greedy tokens and router top-k; the
on-disk tensors of a second checkpoint for the weight push.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from megatron_sat.rollout.client import RoutingSpec, SamplingParams, SGLangClient
from megatron_sat.rollout.embedded.launch import EmbeddedServer
from megatron_sat.routing.payload import decode_routed_experts, encode_routed_experts
from megatron_sat.weight_sync.broadcast import WeightSyncError, WeightUpdater

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=128,
)
ROUTING = RoutingSpec(num_layers=2, top_k=2, num_experts=8)
PROMPTS = [[5, 17, 3, 9, 30, 2, 11], [42, 7], [1, 2, 3, 4]]


def _tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**TINY)).eval()
    # Norms start as constant ones: randomise every tensor so that a weight landing in the
    # wrong place (or not at all) changes the logits.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2 if param.dim() > 1 else 0.1).add_(1.0 if param.dim() == 1 else 0)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    _tiny_model(0).save_pretrained(root / "base")
    _tiny_model(1).save_pretrained(root / "other")
    return root / "base", root / "other"


@pytest.fixture(scope="module")
def base_model(checkpoints):
    return AutoModelForCausalLM.from_pretrained(checkpoints[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(checkpoints):
    # max_running_requests=2 splits the 3-prompt batches into two engine batches.
    with EmbeddedServer(
        str(checkpoints[0]), random_seed=0, dist_timeout_s=60, max_running_requests=2
    ) as server:
        c = server.client()
        yield c
        c.close()


class _VersionSpy:
    """Delegates to a client; after each update request records (version sent, server's)."""

    def __init__(self, inner: SGLangClient) -> None:
        self.inner = inner
        self.records: list[tuple[str | None, str]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def update_weights_from_distributed(self, *args, **kwargs) -> None:
        try:
            self.inner.update_weights_from_distributed(*args, **kwargs)
        finally:
            self.records.append((kwargs["weight_version"], self.inner.get_weight_version()))


@pytest.fixture(scope="module")
def spy_updater(client):
    spy = _VersionSpy(client)
    with WeightUpdater([spy], bucket_bytes=16 * 1024, timeout_s=60) as updater:
        yield spy, updater


def _full_forward(model, prompt: list[int], response: list[int], temperature: float):
    """Log-probs [R] of ``response`` under softmax(logits / T), greedy tokens [R], routes."""
    captured = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda m, a, out, i=i: captured.__setitem__(i, out[2].clone())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    step_logits = logits[len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(step_logits / temperature, dim=-1)
    logprobs = logprobs.gather(1, torch.tensor(response)[:, None]).view(-1)
    routes = torch.stack([captured[i] for i in range(len(captured))], dim=1)[:-1].numpy()
    return logprobs, step_logits.argmax(-1), routes


def test_generate_matches_full_forward(client, base_model):
    """Batched, left-padded, cached sampling == a full forward at the sampled tokens."""
    for sampling in (
        SamplingParams(temperature=1.0, max_new_tokens=6),
        # Log-probs are of softmax(logits / T) before truncation (SGLang's), not of top-k/p.
        SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=5),
    ):
        outputs = client.generate(PROMPTS, sampling, routing=ROUTING)
        assert len(outputs) == len(PROMPTS)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            num_out = len(out.output_ids)
            assert out.finish_reason == "length" and num_out == sampling.max_new_tokens
            assert len(out.output_token_logprobs) == num_out
            assert out.weight_version == "default"
            assert out.routed_experts.shape == (len(prompt) + num_out - 1, 2, 2)
            assert out.routed_experts.dtype == np.uint8 and out.routed_experts.max() < 8
            ref_logprobs, _, ref_routes = _full_forward(
                base_model, prompt, out.output_ids, sampling.temperature
            )
            torch.testing.assert_close(
                torch.tensor(out.output_token_logprobs), ref_logprobs, atol=1e-4, rtol=0
            )
            np.testing.assert_array_equal(out.routed_experts, ref_routes)


def test_routed_experts_start_len(client, base_model):
    prompt = PROMPTS[0]
    (out,) = client.generate(
        prompt,
        SamplingParams(temperature=0, max_new_tokens=3),
        routing=ROUTING,
        routed_experts_start_len=4,
    )
    _, _, ref_routes = _full_forward(base_model, prompt, out.output_ids, 1.0)
    np.testing.assert_array_equal(out.routed_experts, ref_routes[4:])


def test_greedy_is_deterministic_argmax(client, base_model):
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    first = client.generate(PROMPTS, greedy)
    second = client.generate(PROMPTS, greedy)
    for prompt, a, b in zip(PROMPTS, first, second, strict=True):
        assert a.output_ids == b.output_ids
        ref_logprobs, ref_argmax, _ = _full_forward(base_model, prompt, a.output_ids, 1.0)
        assert a.output_ids == ref_argmax.tolist()
        # SGLang's greedy is T=1, top_k=1: log-probs of the untempered softmax.
        torch.testing.assert_close(
            torch.tensor(a.output_token_logprobs), ref_logprobs, atol=1e-4, rtol=0
        )


def test_stop_token_ids(client):
    prompt = PROMPTS[1]
    (free,) = client.generate(prompt, SamplingParams(temperature=0, max_new_tokens=8))
    stop = free.output_ids[2]
    cut = free.output_ids.index(stop)
    (out,) = client.generate(
        prompt,
        SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=(stop,)),
        routing=ROUTING,
    )
    assert out.output_ids == free.output_ids[: cut + 1]
    assert out.finish_reason == "stop" and out.meta_info["finish_reason"]["matched"] == stop
    assert out.routed_experts.shape == (len(prompt) + cut, 2, 2)


def test_pause_blocks_generation_until_continue(client):
    client.pause_generation("abort")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.generate, PROMPTS[0], SamplingParams(max_new_tokens=2))
        time.sleep(0.5)
        assert not pending.done()
        client.continue_generation()
        (out,) = pending.result(timeout=30)
    assert out.finish_reason == "length" and len(out.output_ids) == 2


def test_decode_routed_experts_checks_shape_and_range():
    ids = np.arange(12, dtype=np.int32).reshape(3, 2, 2) % 8
    payload = encode_routed_experts(ids)
    decoded = decode_routed_experts(payload, num_tokens=3, num_layers=2, top_k=2, num_experts=8)
    assert decoded.dtype == np.uint8
    np.testing.assert_array_equal(decoded, ids)
    with pytest.raises(ValueError, match="12 int32 values, expected 16"):
        decode_routed_experts(payload, num_tokens=4, num_layers=2, top_k=2, num_experts=8)
    with pytest.raises(ValueError, match=r"out of range \[0, 4\)"):
        decode_routed_experts(payload, num_tokens=3, num_layers=2, top_k=2, num_experts=4)
    wide = decode_routed_experts(
        encode_routed_experts(ids + 256), num_tokens=3, num_layers=2, top_k=2, num_experts=300
    )
    assert wide.dtype == np.int16 and int(wide.max()) == 263


@pytest.mark.parametrize(
    "bad, culprit",
    [
        (("model.layers.0.mlp.experts.99.up_proj.weight", torch.zeros(16, 32)), "experts.99"),
        (("model.norm.weight", torch.zeros(31)), "model.norm.weight"),
        # a float of another precision is cast on load, as SGLang's weight loader copies it;
        # a non-float into a float parameter is refused
        (("model.norm.weight", torch.zeros(32, dtype=torch.int32)), "int32"),
    ],
)
def test_weight_update_rejects_bad_parameter(client, base_model, spy_updater, bad, culprit):
    """Rejected whole: the good tensor of the same request is not applied either."""
    _, updater = spy_updater
    version = client.get_weight_version()
    good = ("model.layers.1.input_layernorm.weight", torch.full((32,), 3.0))
    with pytest.raises(WeightSyncError, match=culprit):
        updater.update([good, bad], weight_version="never")
    assert client.get_weight_version() == version
    # Still serving (generation resumed), with the old weights.
    (out,) = client.generate(PROMPTS[0], SamplingParams(max_new_tokens=4))
    ref_logprobs, _, _ = _full_forward(base_model, PROMPTS[0], out.output_ids, 1.0)
    torch.testing.assert_close(
        torch.tensor(out.output_token_logprobs), ref_logprobs, atol=1e-4, rtol=0
    )


def test_weight_update_loads_other_model(client, checkpoints, spy_updater):
    spy, updater = spy_updater
    other_tensors = load_file(checkpoints[1] / "model.safetensors")  # per-expert HF names
    spy.records.clear()
    stats = updater.update(sorted(other_tensors.items()), weight_version="v1")
    assert stats.num_buckets >= 3 and stats.num_tensors == len(other_tensors)
    # The version moves only with the final bucket.
    assert spy.records[:-1] == [(None, "default")] * (stats.num_buckets - 1)
    assert spy.records[-1] == ("v1", "v1")
    other = AutoModelForCausalLM.from_pretrained(checkpoints[1], dtype=torch.float32).eval()
    outputs = client.generate(PROMPTS, SamplingParams(max_new_tokens=5), routing=ROUTING)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.weight_version == "v1"
        ref_logprobs, _, ref_routes = _full_forward(other, prompt, out.output_ids, 1.0)
        torch.testing.assert_close(
            torch.tensor(out.output_token_logprobs), ref_logprobs, atol=1e-5, rtol=0
        )
        np.testing.assert_array_equal(out.routed_experts, ref_routes)


def test_sync_failing_on_second_bucket_keeps_version(client, spy_updater):
    """Bucket 1 loads, bucket 2 is rejected: the version must not move, the servers stay
    paused (mixed weights), and the error says so; restoring the weights resumes service."""
    _, updater = spy_updater
    version = client.get_weight_version()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=3)
    norm = torch.ones(32)
    updater.update([("model.norm.weight", norm)], weight_version=version)
    (before,) = client.generate(PROMPTS[0], greedy)
    big = torch.zeros(16 * 1024 // 4 + 1)  # its own bucket
    with pytest.raises(WeightSyncError, match="stay paused"):
        updater.update(
            [("model.norm.weight", norm + 1.0), ("model.layers.0.mlp.unknown", big)],
            weight_version="never",
        )
    assert client.get_weight_version() == version
    updater.update([("model.norm.weight", norm)], weight_version=version)
    (after,) = client.generate(PROMPTS[0], greedy)
    assert after.output_ids == before.output_ids
    torch.testing.assert_close(
        torch.tensor(after.output_token_logprobs),
        torch.tensor(before.output_token_logprobs),
        atol=1e-6,
        rtol=0,
    )


def test_generate_rejects_non_integer_ids_nan_temperature_and_context_overflow(client):
    with pytest.raises(ValueError, match="temperature must be finite"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        SamplingParams(max_new_tokens=2.5)
    for body, culprit in [
        ({"input_ids": [1.7, 2]}, "input_ids must be a list of integers"),
        ({"input_ids": [True, 2]}, "input_ids must be a list of integers"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": float("nan")}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}}, "context length"),
    ]:
        reply = client._http.post("/generate", content=json.dumps(body))
        assert reply.status_code == 400 and culprit in reply.text, (body, reply.text)
    (out,) = client.generate([1, 2], SamplingParams(max_new_tokens=2))  # still serving
    assert len(out.output_ids) == 2


def test_mixed_dtype_bucket_is_aligned_and_unflattens():
    # A float32 tensor after an odd-length bfloat16 one: the sender orders by element size so
    # every tensor is aligned; a receiver given the unaligned order still reads it (a copy).
    from megatron_sat.rollout.embedded.server import unflatten
    from megatron_sat.weight_sync.broadcast import pack_order

    bias = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    router = torch.tensor([[0.1, 0.2]], dtype=torch.float32)
    flag = torch.tensor([7], dtype=torch.uint8)
    bucket = [("b", bias), ("f", flag), ("r", router)]
    assert [n for n, _ in pack_order(bucket)] == ["r", "b", "f"]
    for order in (pack_order(bucket), bucket):
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in order])
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in order]
        for (name, t), got in zip(order, unflatten(flat, specs), strict=True):
            assert got.dtype == t.dtype and torch.equal(got, t), name
