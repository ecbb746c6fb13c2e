"""Hand-valued tests of the objectives beyond the SAT paper's grid (CISPO, M2PO) and of the
importance weights' effective sample size (ALGORITHMS.md "Beyond the paper's grid").

log mu = 0 everywhere, so r = exp(log pi); token-mean aggregation; float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sat.objectives import (
    ObjectiveConfig,
    ess_from_moments,
    importance_weight_metrics,
    m2po_mask,
    policy_loss,
)

F64 = torch.float64


def _run(name, log_pi, adv, **config):
    log_probs = torch.tensor([log_pi], dtype=F64, requires_grad=True)
    mask = torch.ones_like(log_probs, dtype=torch.bool)
    cfg = ObjectiveConfig(name=name, **config)
    loss, metrics = policy_loss(
        log_probs, torch.zeros_like(log_probs), torch.tensor([adv], dtype=F64), mask, cfg
    )
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss.item(), grad[0].tolist(), metrics


def test_cispo_by_hand():
    # r = [1.5, 0.5, 1.1], A = [+1, -1, +1], eps_low = 1 (no lower bound), eps_high = 0.2:
    # w = sg[clip(r, 0, 1.2)] = [1.2, 0.5, 1.1]; S = w A log pi
    # loss = -(1.2 log 1.5 - 0.5 log 0.5 + 1.1 log 1.1) / 3; grad = -w A / 3: the clipped token
    # (r = 1.5 > 1.2, A > 0) still passes gradient -0.4 (GRPO would give 0 there)
    log_pi = [math.log(1.5), math.log(0.5), math.log(1.1)]
    loss, grad, m = _run("cispo", log_pi, [1.0, -1.0, 1.0], eps_low=1.0, eps_high=0.2)
    expected = -(1.2 * math.log(1.5) - 0.5 * math.log(0.5) + 1.1 * math.log(1.1)) / 3
    assert loss == pytest.approx(expected, abs=1e-12)
    assert grad == pytest.approx([-0.4, 0.5 / 3, -1.1 / 3], abs=1e-12)
    assert m["clipfrac_high"].item() == pytest.approx(1 / 3)
    _, grpo_grad, _ = _run("grpo", log_pi, [1.0, -1.0, 1.0], eps_low=1.0, eps_high=0.2)
    assert grpo_grad[0] == 0.0


def test_m2po_by_hand():
    # d = log r = [0.5, 0.3, -0.4, 0.1, 0.2], A = [+1, +1, -1, -1, +1]
    # trust-region tokens (A d > 0): 0, 1, 2, 4 with M2 = [0.25, 0.09, 0.16, 0.04]; tau = 0.07:
    #   mean 0.54/4 = 0.135 > tau -> drop 0 (0.25); 0.29/3 = 0.0967 > tau -> drop 2 (0.16);
    #   0.13/2 = 0.065 <= tau -> stop. Kept: 1, 3 (not trust-region), 4.
    # S = M r A unclipped; token-mean over all 5 (masked stay in the denominator):
    #   loss = -(e^0.3 - e^0.1 + e^0.2) / 5; grad = -M r A / 5
    # m2po_m2 = (0.25 + 0.09 + 0.16 + 0.01 + 0.04) / 5 = 0.11; mask rate 2/5
    d, adv = [0.5, 0.3, -0.4, 0.1, 0.2], [1.0, 1.0, -1.0, -1.0, 1.0]
    loss, grad, m = _run("m2po", d, adv, m2po_tau=0.07)
    e = math.exp
    assert loss == pytest.approx(-(e(0.3) - e(0.1) + e(0.2)) / 5, abs=1e-12)
    assert grad == pytest.approx([0.0, -e(0.3) / 5, 0.0, e(0.1) / 5, -e(0.2) / 5], abs=1e-12)
    assert m["m2po_m2"].item() == pytest.approx(0.11, abs=1e-12)
    assert m["m2po_mask_rate"].item() == pytest.approx(0.4, abs=1e-12)
    assert m["clipfrac_low"].item() == 0.0 and m["clipfrac_high"].item() == 0.0


def test_m2po_mask_edges():
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.ones(1, 3, dtype=F64)
    # no trust-region token (all d <= 0 with A > 0): keep everything
    keep = m2po_mask(torch.tensor([[-1.0, -2.0, 0.0]], dtype=F64), adv, mask, 0.04)
    assert keep.all()
    # every trust-region token far out: all of them dropped (empty remainder has mean 0)
    keep = m2po_mask(torch.tensor([[1.0, 2.0, -3.0]], dtype=F64), adv, mask, 0.04)
    assert keep.tolist() == [[False, False, True]]
    # below tau already: nothing dropped
    keep = m2po_mask(torch.tensor([[0.1, 0.1, 0.1]], dtype=F64), adv, mask, 0.04)
    assert keep.all()
    # inactive positions are never trust-region tokens
    keep = m2po_mask(torch.tensor([[5.0, 0.1, 0.1]], dtype=F64), adv, mask & (adv < 0), 0.04)
    assert keep.all()


def test_m2po_mask_makes_every_tensor_on_its_input_device():
    # A tensor made without device= lands on the default device, not the batch's (on a GPU
    # trainer torch.cat then refuses a CPU and a CUDA tensor). A meta default device stands in
    # for "not the input's device" on a CPU-only machine.
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.ones(1, 3, dtype=F64)
    log_ratio = torch.tensor([[1.0, 2.0, -3.0]], dtype=F64)
    torch.set_default_device("meta")
    try:
        keep = m2po_mask(log_ratio, adv, mask, 0.04)
    finally:
        torch.set_default_device(None)
    assert keep.device.type == "cpu"
    assert keep.tolist() == [[False, False, True]]


def test_ess_by_hand():
    # w = [1, 2] (log w = [0, log 2]): ess = (1 + 2)^2 / (2 (1 + 4)) = 0.9; padded token ignored
    log_pi = torch.tensor([[0.0, math.log(2.0), 7.0]], dtype=F64)
    mask = torch.tensor([[True, True, False]])
    m = importance_weight_metrics(log_pi, torch.zeros_like(log_pi), mask)
    assert m["ess"].item() == pytest.approx(0.9, abs=1e-12)
    assert m["is_weight_mean"].item() == pytest.approx(1.5, abs=1e-12)
    assert m["is_weight_sq_mean"].item() == pytest.approx(2.5, abs=1e-12)
    # on-policy: 1 exactly; no active token: 1
    m = importance_weight_metrics(torch.zeros(1, 3, dtype=F64), torch.zeros(1, 3, dtype=F64), mask)
    assert m["ess"].item() == 1.0
    none = torch.zeros(1, 3, dtype=torch.bool)
    assert importance_weight_metrics(log_pi, torch.zeros_like(log_pi), none)["ess"].item() == 1.0
    # the global ess of two micro-batches from their token-mean moments: w = [1] and [2]
    assert ess_from_moments(1.5, 2.5) == pytest.approx(0.9)
    # policy_loss reports it for every objective
    _, _, metrics = _run("grpo", [0.0, math.log(2.0)], [1.0, 1.0])
    assert metrics["ess"].item() == pytest.approx(0.9, abs=1e-12)


@pytest.mark.parametrize("field", ["m2po_tau"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.inf])
def test_m2po_tau_validated(field, value):
    with pytest.raises(ValueError, match=rf"ObjectiveConfig\.{field} must be"):
        ObjectiveConfig(name="m2po", **{field: value})


@pytest.mark.parametrize("name", ["cispo", "m2po"])
def test_dual_clip_refused_where_there_is_no_clip(name):
    # cispo/m2po never call clipped_surrogate: a dual_clip_c would be silently ignored
    with pytest.raises(ValueError, match="ObjectiveConfig.dual_clip_c"):
        ObjectiveConfig(name=name, dual_clip_c=3.0)
    assert ObjectiveConfig(name="grpo", dual_clip_c=3.0).dual_clip_c == 3.0
