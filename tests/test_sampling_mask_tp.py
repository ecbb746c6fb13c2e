"""Vocab-parallel sampling-mask replay (``training.sampling_mask_tp``): equal to the
full-vocabulary ``objectives.sampling_mask.truncated_log_probs`` (itself checked against
SGLang's sampler in tests/test_sampling_mask.py) at TP 1 and with the vocabulary split over 2
gloo ranks, gradients included; ties follow ascending vocabulary order.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import run_torchrun
from test_host_syncs import CountSyncs

from megatron_sat.objectives.sampling_mask import kept_mask, truncated_log_probs
from megatron_sat.training.sampling_mask_tp import SamplingMask, _kept, truncated_log_probs_tp

CASES = [
    (1.0, 0.9, -1),
    (0.7, 0.5, -1),
    (1.0, 1.0, 5),
    (1.3, 0.8, 20),
    (1.0, 0.95, 3),
    (1.0, 1.0, -1),
]


@pytest.mark.parametrize("temperature,top_p,top_k", CASES)
def test_equals_full_vocabulary_formula(temperature, top_p, top_k):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 300, generator=gen) * 3
    logits[:8, :40] = 2.0  # ties
    labels = torch.randint(0, 300, (64,), generator=gen)
    weights = torch.randn(64, generator=gen)
    full, mine = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ref = truncated_log_probs(full, labels, temperature=temperature, top_p=top_p, top_k=top_k)
    got = truncated_log_probs_tp(mine, labels, SamplingMask(temperature, top_p, top_k))
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine.grad, full.grad, rtol=1e-5, atol=1e-6)
    if top_p < 1 or top_k > 0:  # (at top_p 1 kept_mask's cumsum rounding drops ~1e-7 of tail)
        probs = torch.softmax(logits / temperature, dim=-1)
        mask = SamplingMask(temperature, top_p, top_k)
        assert torch.equal(_kept(probs, mask, None), kept_mask(probs, top_p, top_k))
        # something is truncated: the replay raises the log-prob by the lost mass
        assert (got - torch.log_softmax(logits / temperature, -1)[range(64), labels]).max() > 0.01


def test_ties_at_the_boundary_keep_the_lowest_ids():
    """Ten equal leaders of 0.1 each (the rest ~0): top_p 0.45 keeps ids with exclusive sums
    0, .1, .2, .3, .4 -> the first five in vocabulary order (a stable descending sort's
    order); top_k 3 the first three; the sampled label is kept anyway. (torch.sort without
    ``stable=True``, as SGLang and kept_mask call it, orders these ten ties 29, 28, ..., 20
    on this CPU: its tie order is not promised, see the module docstring.)"""
    logits = torch.full((1, 50), -40.0)
    logits[0, 20:30] = 0.0
    probs = torch.softmax(logits, -1)
    for mask, n in ((SamplingMask(top_p=0.45), 5), (SamplingMask(top_k=3), 3)):
        kept = _kept(probs, mask, None)[0]
        assert kept.nonzero().flatten().tolist() == list(range(20, 20 + n))
        order = probs.sort(dim=-1, descending=True, stable=True).indices[0]
        assert order[:n].tolist() == list(range(20, 20 + n))
    # label 29 (not kept by the rule) is added: 6 kept tokens of equal mass; 21 is kept
    got = truncated_log_probs_tp(logits, torch.tensor([29]), SamplingMask(top_p=0.45))
    torch.testing.assert_close(got, -torch.tensor([6.0]).log(), rtol=0, atol=1e-6)
    got = truncated_log_probs_tp(logits, torch.tensor([21]), SamplingMask(top_k=3))
    torch.testing.assert_close(got, -torch.tensor([3.0]).log(), rtol=0, atol=1e-6)


def test_leading_dimensions_and_bad_labels():
    logits = torch.randn(2, 3, 40)
    labels = torch.randint(0, 40, (2, 3))
    got = truncated_log_probs_tp(logits, labels, SamplingMask(top_p=0.7))
    ref = truncated_log_probs(logits.view(6, 40), labels.view(6), top_p=0.7)
    torch.testing.assert_close(got, ref.view(2, 3), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="labels"):
        truncated_log_probs_tp(logits, labels.view(6), SamplingMask(top_p=0.7))
    with pytest.raises(ValueError, match="top_p"):
        SamplingMask(top_p=0.0)


def test_no_host_synchronisation():
    """Nothing is read back to the host (a fixed bisection length, no data-dependent
    branch): the step calls it inside its passes (tests/test_host_syncs.py)."""
    logits = torch.randn(16, 100, requires_grad=True)
    labels = torch.randint(0, 100, (16,))
    with CountSyncs() as counter:
        truncated_log_probs_tp(logits, labels, SamplingMask(0.8, 0.9, 7)).sum().backward()
    assert counter.all_counts == Counter(), counter.all_counts


def test_two_ranks_each_half_the_vocabulary():
    run_torchrun("tests/dist/sampling_mask_tp.py", done="SAMPLING_MASK_TP_OK", timeout=300)


@pytest.mark.slow  # a TP2 trainer on 2 ranks: ~25 s here
def test_trainer_at_tp2_replays_over_megatron_cores_group(tiny_checkpoint):
    run_torchrun(
        "tests/dist/sampling_mask_trainer_tp.py",
        str(tiny_checkpoint),
        done="SAMPLING_MASK_TRAINER_TP_OK",
        timeout=600,
    )
