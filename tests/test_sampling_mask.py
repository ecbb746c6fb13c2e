"""Sampling-mask replay (``objectives.sampling_mask``): the trainer's truncated log-prob is the
log-prob of the distribution the engine sampled from, with SGLang 0.5.23's own sampler as the
truth (``srt/layers/sampler.py`` ``top_k_top_p_min_p_sampling_from_probs_torch``, executed from
its source by ``tests/sglang_reference.py``), and the embedded engine samples by the same rule.
"""

from __future__ import annotations

from typing import Optional

import pytest
import sglang_reference as ref
import torch

from megatron_sat.objectives.sampling_mask import kept_mask, truncated_log_probs
from megatron_sat.rollout.embedded.engine import GenerationEngine
from megatron_sat.rollout.sampling import SamplingParams


@pytest.fixture(scope="module")
def sglang_sampler():
    return ref.function(
        "srt/layers/sampler.py",
        "top_k_top_p_min_p_sampling_from_probs_torch",
        {"torch": torch, "Optional": Optional, "multinomial_with_seed": None},
    )


def sglang_distribution(sampler, logits, temperature, top_p, top_k):
    """SGLang's sampling distribution [N, V] (its filtered probabilities, renormalised)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    n, vocab = probs.shape
    _, filtered, idx, _ = sampler(
        probs,
        torch.full((n,), top_k if top_k > 0 else vocab),
        torch.full((n,), top_p),
        torch.zeros(n),
        False,
        None,
        torch.zeros(n, dtype=torch.long),
        return_filtered_probs=True,
    )
    dist = torch.zeros_like(probs).scatter_(1, idx.long(), filtered)
    return dist / dist.sum(dim=-1, keepdim=True)


CASES = [(1.0, 0.9, -1), (0.7, 0.5, -1), (1.0, 1.0, 5), (1.3, 0.8, 3), (1.0, 0.05, -1)]


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), CASES)
def test_truncated_log_probs_are_sglangs_sampling_distribution(
    sglang_sampler, temperature, top_p, top_k
):
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    dist = sglang_distribution(sglang_sampler, logits, temperature, top_p, top_k)
    kept = kept_mask(torch.softmax(logits / temperature, dim=-1), top_p, top_k)
    assert torch.equal(kept, dist > 0)
    tokens = torch.multinomial(dist, 1).squeeze(1)  # what the engine can sample
    ours = truncated_log_probs(logits, tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    torch.testing.assert_close(
        ours, dist.gather(1, tokens[:, None]).squeeze(1).log(), atol=1e-5, rtol=0
    )
    full = torch.log_softmax(logits / temperature, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert (ours - full).abs().max() > 1e-3  # without replay the two differ


def test_hand_computed_top_p():
    # p = [0.5, 0.3, 0.15, 0.05]; exclusive sums 0, 0.5, 0.8, 0.95: top_p 0.85 keeps three.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert kept_mask(logits.softmax(-1), 0.85, -1).tolist() == [[True, True, True, False]]
    got = truncated_log_probs(logits, torch.tensor([1]), top_p=0.85)
    assert got.item() == pytest.approx(torch.tensor(0.3 / 0.95).log().item(), abs=1e-6)
    # The sampled token is kept even where rounding would drop it.
    got = truncated_log_probs(logits, torch.tensor([3]), top_p=0.85)
    assert got.item() == pytest.approx(torch.tensor(0.05 / 1.0).log().item(), abs=1e-6)
    # Nothing truncated: the plain log-softmax.
    plain = truncated_log_probs(logits, torch.tensor([2]))
    assert plain.item() == pytest.approx(torch.tensor(0.15).log().item(), abs=1e-6)


def test_gradient_flows_through_the_kept_tokens_only():
    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0]], requires_grad=True)
    # p = [0.705, 0.259, 0.095, 0.005]: top_p 0.8 keeps tokens 0 and 1.
    truncated_log_probs(logits, torch.tensor([0]), top_p=0.8).sum().backward()
    assert logits.grad[0, 2].abs() < 1e-6 and logits.grad[0, 3].abs() < 1e-6  # cancel exactly
    assert logits.grad[0, 1].item() == pytest.approx(-0.259 / (0.705 + 0.259), abs=2e-3)


def test_the_embedded_engine_samples_inside_sglangs_kept_set(tiny_checkpoint, sglang_sampler):
    """Every token the embedded engine draws at top_p / top_k lies in SGLang's kept set of its
    own logits, and its draws follow SGLang's distribution (frequencies within 4 sigma)."""
    engine = GenerationEngine(str(tiny_checkpoint), seed=3)
    torch.manual_seed(1)
    logits = torch.randn(1, engine.model.config.vocab_size) * 2
    params = SamplingParams(temperature=1.0, top_p=0.6, top_k=20)
    dist = sglang_distribution(sglang_sampler, logits, 1.0, 0.6, 20)[0]
    draws = 4000
    tokens, _ = engine._sample(logits.repeat(draws, 1), [params] * draws)
    counts = torch.bincount(tokens, minlength=dist.numel()).double()
    assert (counts[dist == 0] == 0).all()
    sigma = (draws * dist * (1 - dist)).sqrt()
    assert ((counts - draws * dist).abs() <= 4 * sigma + 1).all()
