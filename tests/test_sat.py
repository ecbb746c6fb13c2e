"""SAT tests: quantile convention, Hill kernel, golden SAT-GRPO / SAT-GSPO values and gradients,
and the properties of SAT paper Proposition 4.1 on seeded random batches."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sat.objectives import (
    ObjectiveConfig,
    clipped_surrogate,
    hill_kernel,
    policy_loss,
    sat_abs_staleness,
    sat_metrics,
    sat_radii,
    sat_reference_quantile,
)

F64 = torch.float64


def run(name, log_probs, advantages, mask, rollout=None, sat_quantile=None, **config_kwargs):
    config = ObjectiveConfig(name=name, **config_kwargs)
    if rollout is None:
        rollout = torch.zeros_like(log_probs)
    loss, metrics = policy_loss(
        log_probs, rollout, advantages, mask, config, sat_quantile=sat_quantile
    )
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss, grad, metrics


# ---------------------------------------------------------------- quantile (Eq. 14)


def test_quantile_lower_inverse_cdf_convention():
    # |d| = 0.1 .. 1.0, alpha 0.9: F(0.9) = 9/10 >= 0.9 and F(x) < 0.9 for x < 0.9 -> q = 0.9
    # (interpolating conventions give 0.91 or 0.95; an upper convention gives 1.0)
    values = torch.tensor([0.7, 0.1, 1.0, 0.4, 0.9, 0.2, 0.5, 0.8, 0.3, 0.6], dtype=F64)
    assert sat_reference_quantile(values, 0.9).item() == 0.9
    assert sat_reference_quantile(values, 0.85).item() == 0.9  # ceil(8.5) = 9th
    assert sat_reference_quantile(values, 0.8).item() == 0.8
    assert sat_reference_quantile(values, 0.05).item() == 0.1
    assert sat_reference_quantile(values, 0.99).item() == 1.0


def test_quantile_is_robust_to_alpha_rounding():
    # 0.07 * 100 evaluates to 7.000000000000001 in floating point; the 7th value is right.
    values = torch.arange(1, 101, dtype=F64) / 100
    assert sat_reference_quantile(values, 0.07).item() == 0.07
    assert sat_reference_quantile(values, 0.9).item() == 0.9


def test_quantile_ties_empty_and_errors():
    ties = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5])
    assert sat_reference_quantile(ties, 0.6).item() == 0.0  # 3rd smallest
    assert sat_reference_quantile(ties, 0.61).item() == 0.5  # ceil(3.05) = 4th
    empty = sat_reference_quantile(torch.zeros(0), 0.9)
    assert empty.item() == 0.0 and empty.dim() == 0
    with pytest.raises(ValueError, match="alpha"):
        sat_reference_quantile(ties, 1.0)
    with pytest.raises(ValueError, match="abs_d"):
        sat_reference_quantile(ties.view(1, 5), 0.5)


def test_hill_kernel_values():
    # psi(u; q) = 1 / (1 + (u/q)^2): psi(0) = 1, psi(q) = 1/2, psi(2q) = 1/5, psi(3q) = 1/10
    u = torch.tensor([0.0, 0.1, 0.2, 0.3], dtype=F64)
    torch.testing.assert_close(hill_kernel(u, 0.1), torch.tensor([1.0, 0.5, 0.2, 0.1], dtype=F64))


def test_sat_radii_are_detached_and_one_sided():
    # d = [0.3, -0.3, 0.05], q = 0.1 given: token 0 gated upward, c+ = 1/(1 + 9) = 0.1;
    # token 1 gated downward, c- = 0.1; token 2 not gated. Radii carry no gradient (d = sg[log r]).
    d = torch.tensor([[0.3, -0.3, 0.05]], dtype=F64, requires_grad=True)
    radii = sat_radii(d, torch.ones(1, 3, dtype=torch.bool), 0.2, 0.28, 0.9, q=0.1)
    assert not radii.eps_low.requires_grad and not radii.eps_high.requires_grad
    torch.testing.assert_close(radii.eps_high, torch.tensor([[0.028, 0.28, 0.28]], dtype=F64))
    torch.testing.assert_close(radii.eps_low, torch.tensor([[0.2, 0.02, 0.2]], dtype=F64))
    assert radii.gate.tolist() == [[True, True, False]]
    with pytest.raises(ValueError, match="sat_quantile"):
        sat_radii(d, torch.ones(1, 3, dtype=torch.bool), 0.2, 0.2, 0.9, q=math.nan)


# ---------------------------------------------------------------- golden SAT-GRPO (Eqs. 13-19)


def sat_grpo_batch():
    # One response of 6 tokens plus a NaN pad; log mu = 0 so d = log pi; per-token advantages.
    lp = torch.tensor([[0.05, -0.1, 0.15, -0.15, 0.5, -0.4, math.nan]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0, math.nan]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    return lp.requires_grad_(True), adv, mask


def test_sat_grpo_by_hand():
    # |d| sorted = [0.05, 0.1, 0.15, 0.15, 0.4, 0.5]; alpha = 0.3 -> k = ceil(1.8) = 2 -> q = 0.1
    # gated (|d| > 0.1, strict: token 1 with |d| = q is not): tokens 2, 3, 4, 5
    # tok  d      A   r          c+          c-          interval              S
    # 0    0.05  +1  1.0512711  1           1           [0.8, 1.2]            1.0512711
    # 1   -0.10  -1  0.9048374  1           1           [0.8, 1.2]           -0.9048374
    # 2    0.15  +1  1.1618342  1/3.25      1           [0.8, 1.0615385]      1.0615385 (clip)
    # 3   -0.15  -1  0.8607080  1           1/3.25      [0.9384615, 1.2]     -0.9384615 (clip)
    # 4    0.50  +1  1.6487213  1/26        1           [0.8, 1.0076923]      1.0076923 (clip)
    # 5   -0.40  -1  0.6703200  1           1/17        [0.9882353, 1.2]     -0.9882353 (clip)
    # loss = -sum(S) / 6 = -0.0481613; grads: only tokens 0, 1: -A r / 6 = [-0.1752118, 0.1508062]
    # (PPO would give tokens 2 and 3 gradients -1.1618342/6 and 0.8607080/6.)
    lp, adv, mask = sat_grpo_batch()
    loss, grad, m = run("sat-grpo", lp, adv, mask, sat_alpha=0.3)
    assert loss.item() == pytest.approx(-0.04816126916527471, abs=1e-12)
    expected = torch.tensor([[-0.175211849396004, 0.15080623633932658, 0, 0, 0, 0, 0]], dtype=F64)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    assert m["sat_q"].item() == pytest.approx(0.1, abs=1e-15)
    assert m["sat_gate_rate"].item() == pytest.approx(4 / 6)
    # mean eps_low' = 0.2 (4 + 1/3.25 + 1/17) / 6; mean eps_high' = 0.2 (4 + 1/3.25 + 1/26) / 6
    assert m["sat_eps_low_mean"].item() == pytest.approx(0.1455505279034691, abs=1e-12)
    assert m["sat_eps_high_mean"].item() == pytest.approx(0.14487179487179488, abs=1e-12)
    assert m["sat_c_plus_min"].item() == pytest.approx(1 / 26, abs=1e-12)
    assert m["sat_c_minus_min"].item() == pytest.approx(1 / 17, abs=1e-12)
    # clipfrac_high: tokens 2, 4 (A > 0, r > 1 + eps_high'); clipfrac_low: tokens 3, 5
    assert m["clipfrac_high"].item() == pytest.approx(2 / 6)
    assert m["clipfrac_low"].item() == pytest.approx(2 / 6)


def test_sat_grpo_with_external_quantile_by_hand():
    # q = 0.45 given (global batch): only token 4 (|d| = 0.5) gated;
    # c+ = 1 / (1 + (0.5/0.45)^2) = 0.4475138 -> upper 1.0895028, S_4 = 1.0895028 (clipped)
    # the rest is plain GRPO: S = [1.0512711, -0.9048374, 1.1618342, -0.8607080, ., -0.8]
    # loss = -(sum S)/6 = -0.1228438; grads -A r / 6 on tokens 0-3, 0 on 4 and 5 (clipped)
    lp, adv, mask = sat_grpo_batch()
    loss, grad, m = run("sat-grpo", lp, adv, mask, sat_quantile=0.45, sat_alpha=0.3)
    assert loss.item() == pytest.approx(-0.1228437845123715, abs=1e-12)
    expected = [
        -0.175211849396004,
        0.15080623633932658,
        -0.19363904045471383,
        0.1434513294041763,
        0,
        0,
        0,
    ]
    torch.testing.assert_close(grad, torch.tensor([expected], dtype=F64), rtol=0, atol=1e-12)
    assert m["sat_q"].item() == 0.45 and m["sat_gate_rate"].item() == pytest.approx(1 / 6)


# ---------------------------------------------------------------- golden SAT-GSPO (Eq. 20)


def sat_gspo_batch():
    lp = torch.tensor(
        [
            [0.2, 0.1, math.nan, math.nan],  # log rho = 0.15, A = +1
            [-0.1, -0.1, -0.1, math.nan],  # log rho = -0.1, A = -1
            [0.05, -0.05, math.nan, math.nan],  # log rho = 0,   A = +1
            [0.3, 0.2, 0.1, math.nan],  # log rho = 0.2, A = -1
        ],
        dtype=F64,
    )
    mask = ~torch.isnan(lp)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64)
    return lp.requires_grad_(True), adv, mask


def test_sat_gspo_loss_and_gradient_by_hand():
    # |d| per active token = |log rho_b| broadcast: [0.15 x2, 0.1 x3, 0 x2, 0.2 x3] (10 tokens)
    # sorted [0, 0, 0.1, 0.1, 0.1, 0.15, 0.15, 0.2, 0.2, 0.2]; alpha 0.5 -> k = 5 -> q = 0.1
    # gated: responses 0 (0.15) and 3 (0.2); response 1 has |d| = q, not gated.
    # resp 0: c+ = 1/(1 + 1.5^2) = 0.3076923, upper 1.0615385; rho = exp(0.15) = 1.1618342
    #         > upper, A > 0 -> S = 1.0615385, zero gradient (GSPO: S = rho, with gradient)
    # resp 1: rho = exp(-0.1) = 0.9048374, A = -1, inside -> S = -0.9048374
    # resp 2: rho = 1, A = +1 -> S = 1
    # resp 3: c+ = 1/(1 + 2^2) = 0.2, c- = 1 (d > 0); A = -1 clips only below 0.8:
    #         rho = exp(0.2) = 1.2214028 -> S = -1.2214028 (unclipped)
    # seq-mean-token-mean: loss = (1/4) (-1.0615385 + 0.9048374 - 1 + 1.2214028) = 0.0161754
    # gradient per token of response b: (1/4) (-A_b dS/drho) rho_b / n_b
    #   resp 0: 0; resp 1: 0.9048374 / 12 = 0.0754031; resp 2: -1 / 8; resp 3: 1.2214028 / 12
    lp, adv, mask = sat_gspo_batch()
    loss, grad, m = run(
        "sat-gspo", lp, adv, mask, sat_alpha=0.5, loss_agg_mode="seq-mean-token-mean"
    )
    assert loss.item() == pytest.approx(0.016175428664416958, abs=1e-12)
    g1, g2, g3 = 0.07540311816966329, -0.125, 0.10178356318001415
    expected = torch.tensor(
        [[0, 0, 0, 0], [g1, g1, g1, 0], [g2, g2, 0, 0], [g3, g3, g3, 0]], dtype=F64
    )
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    assert m["sat_q"].item() == pytest.approx(0.1, abs=1e-15)
    assert m["sat_gate_rate"].item() == pytest.approx(0.5)
    # eps_high' mean = (2 (0.2/3.25) + 3 (0.2) + 2 (0.2) + 3 (0.2 * 0.2)) / 10 = 0.1243077
    assert m["sat_eps_high_mean"].item() == pytest.approx(0.12430769230769231, abs=1e-12)
    assert m["sat_eps_low_mean"].item() == pytest.approx(0.2, abs=1e-15)
    assert m["sat_c_plus_min"].item() == pytest.approx(0.2, abs=1e-12)
    assert m["sat_c_minus_min"].item() == 1.0
    assert m["clipfrac_high"].item() == pytest.approx(0.2)  # response 0's 2 tokens of 10
    # mismatch stays token level: mean |log pi - log mu| over the 10 tokens = 1.3 / 10
    assert m["mismatch_abs_logratio"].item() == pytest.approx(0.13, abs=1e-12)


# ---------------------------------------------------------------- Proposition 4.1


def random_batch(seed, b=8, t=16, scale=0.15):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mu = -3 * torch.rand(b, t, generator=gen, dtype=F64)
    lp = mu + scale * torch.randn(b, t, generator=gen, dtype=F64)
    adv = torch.randn(b, t, generator=gen, dtype=F64)
    return lp, mu, adv, mask


SAT_BASE = {"sat-grpo": "grpo", "sat-gspo": "gspo-token"}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sat_name", sorted(SAT_BASE))
@pytest.mark.parametrize("alpha", [0.5, 0.9])
def test_proposition_4_1(seed, sat_name, alpha):
    # The bands are non-empty only when q < log(1 + eps): choose the spread of log r so that q is
    # about 0.1 (|N(0, s)| has median 0.67 s and 90th percentile 1.64 s); GSPO averages log r
    # over a response, so it needs a wider spread.
    scale = (0.15 if alpha == 0.5 else 0.06) * (1 if sat_name == "sat-grpo" else 3)
    lp, mu, adv, mask = random_batch(seed, b=16 if sat_name == "sat-grpo" else 48, scale=scale)
    if sat_name == "sat-gspo":
        adv = adv[:, 0]  # GSPO: one advantage per response
    eps = {"eps_low": 0.2, "eps_high": 0.28}
    config = ObjectiveConfig(name=sat_name, sat_alpha=alpha, **eps)
    abs_d = sat_abs_staleness(lp, mu, mask, config)
    q = sat_reference_quantile(abs_d, alpha)

    # d and the base ratio, as the objective sees them
    log_r = torch.where(mask, lp - mu, torch.zeros_like(lp))
    if sat_name == "sat-gspo":
        seq = log_r.sum(-1) / mask.sum(-1)
        log_r = torch.where(mask, seq[:, None].expand_as(lp), torch.zeros_like(lp))
    r = log_r.exp()
    a = (adv[:, None] if adv.dim() == 1 else adv).expand_as(lp)
    radii = sat_radii(log_r, mask, eps["eps_low"], eps["eps_high"], alpha)
    assert radii.q.item() == q.item()

    # (i) the SAT interval lies inside the PPO interval, only one side shrinks per token
    assert (radii.eps_low <= 0.2).all() and (radii.eps_high <= 0.28).all()
    assert ((radii.c_plus == 1) | (radii.c_minus == 1)).all()
    assert (radii.c_plus[log_r <= 0] == 1).all() and (radii.c_minus[log_r >= 0] == 1).all()

    # (ii) S_SAT <= S_PPO pointwise
    s_sat = clipped_surrogate(r, a, radii.eps_low, radii.eps_high)
    s_ppo = clipped_surrogate(r, a, torch.tensor(0.2, dtype=F64), torch.tensor(0.28, dtype=F64))
    assert (s_sat[mask] <= s_ppo[mask]).all()

    # (iii) gradients differ only on the outward bands (closed, to include ties at the edges)
    _, grad_sat, m = run(
        sat_name, lp.clone().requires_grad_(True), adv, mask, rollout=mu, sat_alpha=alpha, **eps
    )
    # SAT-GSPO with one advantage per response clips GSPO's sequence-form ratio
    base = "gspo" if sat_name == "sat-gspo" else SAT_BASE[sat_name]
    _, grad_ppo, _ = run(base, lp.clone().requires_grad_(True), adv, mask, rollout=mu, **eps)
    upper_band = (a > 0) & (1 + radii.eps_high <= r) & (r <= 1.28)
    lower_band = (a < 0) & (1 - 0.2 <= r) & (r <= 1 - radii.eps_low)
    band = mask & (upper_band | lower_band)
    if sat_name == "sat-gspo":  # a response's gradient changes when its sequence ratio is banded
        band = band.any(-1, keepdim=True) & mask
    differ = grad_sat != grad_ppo
    assert not (differ & ~band).any()
    # ... and on the strict interior of the bands they do differ (the SAT clip binds there)
    strict = mask & (
        ((a > 0) & (1 + radii.eps_high < r) & (r < 1.28))
        | ((a < 0) & (0.8 < r) & (r < 1 - radii.eps_low))
    )
    assert (differ | ~strict).all()
    assert strict.any()  # the batch exercised the bands

    # (iv) at most (1 - alpha) of the active tokens are gated (Eq. 14: n - ceil(alpha n))
    assert m["sat_gate_rate"].item() <= 1 - alpha + 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_gate_rate_bound_with_ties(seed):
    # quantised |d| -> many ties at q; ties are never gated (strict |d| > q)
    lp, mu, adv, mask = random_batch(seed, scale=0.1)
    lp = mu + torch.round((lp - mu) * 20) / 20
    for alpha in (0.1, 0.3, 0.5, 0.75, 0.9, 0.97):
        radii = sat_radii(lp - mu, mask, 0.2, 0.2, alpha)
        rate = radii.gate[mask].double().mean().item()
        assert rate <= 1 - alpha + 1e-12
        assert not radii.gate[~mask].any()


@pytest.mark.parametrize("sat_name", sorted(SAT_BASE))
@pytest.mark.parametrize("how", ["inf-quantile", "alpha-near-1", "on-policy"])
def test_sat_disabled_is_bit_identical_to_base(sat_name, how):
    lp, mu, adv, mask = random_batch(seed=11)
    if how == "on-policy":
        lp = mu.clone()  # d = 0 everywhere -> q = 0 -> no gate
    kwargs = {"sat_quantile": math.inf} if how == "inf-quantile" else {}
    # alpha-near-1: 0.999 with < 1000 active tokens -> k = n -> q = max |d| -> nothing exceeds it
    alpha = 0.999 if how == "alpha-near-1" else 0.9
    for dtype in (F64, torch.float32):
        lp_d, mu_d, adv_d = lp.to(dtype), mu.to(dtype), adv.to(dtype)
        loss_sat, grad_sat, m = run(
            sat_name,
            lp_d.clone().requires_grad_(True),
            adv_d,
            mask,
            rollout=mu_d,
            sat_alpha=alpha,
            **kwargs,
        )
        loss_base, grad_base, _ = run(
            SAT_BASE[sat_name], lp_d.clone().requires_grad_(True), adv_d, mask, rollout=mu_d
        )
        assert m["sat_gate_rate"].item() == 0.0
        assert torch.equal(loss_sat, loss_base)
        assert torch.equal(grad_sat, grad_base)
        if sat_name == "sat-gspo":  # the sequence-level GSPO form has the same value bitwise
            loss_seq, _, _ = run(
                "gspo", lp_d.clone().requires_grad_(True), adv_d, mask, rollout=mu_d
            )
            assert torch.equal(loss_sat, loss_seq)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_sat_gspo_disabled_with_per_sequence_advantages_is_gspo_bitwise(dtype):
    # One advantage per response: SAT-GSPO clips GSPO's sequence-form ratio, so with no gated
    # response (q = inf) loss and gradient are GSPO's bit for bit, and with a gate they differ.
    lp, mu, adv, mask = random_batch(seed=5, b=48, scale=0.18)  # q ~ 0.1 (test above)
    lp, mu, adv = lp.to(dtype), mu.to(dtype), adv[:, 0].to(dtype)
    out = {}
    cases = [("gspo", {}), ("sat-gspo", {"sat_quantile": math.inf}), ("sat", {"sat_alpha": 0.5})]
    for name, kwargs in cases:
        objective = "gspo" if name == "gspo" else "sat-gspo"
        out[name] = run(objective, lp.clone().requires_grad_(True), adv, mask, rollout=mu, **kwargs)
    assert torch.equal(out["sat-gspo"][0], out["gspo"][0])
    assert torch.equal(out["sat-gspo"][1], out["gspo"][1])
    assert out["sat"][2]["sat_gate_rate"].item() > 0
    assert not torch.equal(out["sat"][1], out["gspo"][1])


@pytest.mark.parametrize("sat_name", sorted(SAT_BASE))
def test_global_quantile_over_micro_batches_matches_full_batch(sat_name):
    # The DP recipe: |d| from every micro-batch -> one q -> global denominators; the sum of the
    # micro-batch losses equals the loss of the whole batch, and so do the gradients.
    lp, mu, adv, mask = random_batch(seed=21, scale=0.3)
    # token-mean: the split below passes the global token count (SAT-GSPO's own default,
    # seq-mean-token-mean, would need the global sequence count)
    config = ObjectiveConfig(name=sat_name, sat_alpha=0.5, loss_agg_mode="token-mean")
    chunks = [slice(0, 3), slice(3, 8)]
    abs_d = torch.cat([sat_abs_staleness(lp[c], mu[c], mask[c], config) for c in chunks])
    q = sat_reference_quantile(abs_d, 0.5)
    full_lp = lp.clone().requires_grad_(True)
    full, metrics = policy_loss(full_lp, mu, adv, mask, config)
    assert metrics["sat_q"].item() == q.item() and metrics["sat_gate_rate"].item() > 0
    split_lp = lp.clone().requires_grad_(True)
    total = sum(
        policy_loss(
            split_lp[c],
            mu[c],
            adv[c],
            mask[c],
            config,
            global_num_tokens=mask.sum().item(),
            sat_quantile=q,
        )[0]
        for c in chunks
    )
    torch.testing.assert_close(total, full, rtol=1e-12, atol=0)
    (g_full,) = torch.autograd.grad(full, full_lp)
    (g_split,) = torch.autograd.grad(total, split_lp)
    torch.testing.assert_close(g_split, g_full, rtol=1e-12, atol=1e-15)


def test_sat_abs_staleness_rejects_non_sat_objective():
    lp, mu, _, mask = random_batch(seed=0)
    with pytest.raises(ValueError, match="ObjectiveConfig.name"):
        sat_abs_staleness(lp, mu, mask, ObjectiveConfig(name="grpo"))


def test_weighted_quantile_equals_expanded_list():
    # values [0.3, 0.1, 0.2, 5.0] with weights [1, 3, 2, 0] = [0.1, 0.1, 0.1, 0.2, 0.2, 0.3]:
    # alpha 0.5 -> k = 3 -> 0.1; 0.51 -> k = ceil(3.06) = 4 -> 0.2; 0.9 -> k = 6 -> 0.3
    values = torch.tensor([0.3, 0.1, 0.2, 5.0], dtype=F64)
    weights = torch.tensor([1, 3, 2, 0])
    for alpha, expected in ((0.5, 0.1), (0.51, 0.2), (0.9, 0.3)):
        assert sat_reference_quantile(values, alpha, weights).item() == expected
        expanded = values.repeat_interleave(weights)
        assert sat_reference_quantile(expanded, alpha).item() == expected
    assert sat_reference_quantile(values, 0.5, torch.zeros(4, dtype=torch.long)).item() == 0.0
    with pytest.raises(ValueError, match="weights must be an integer tensor"):
        sat_reference_quantile(values, 0.5, torch.ones(4))


@pytest.mark.parametrize("seed", range(3))
def test_sat_gspo_row_radii_equal_token_radii(seed):
    # SAT-GSPO computes its radii once per response with a token-weighted quantile; the metrics
    # equal those of the token-level computation on the broadcast proxy of Eq. 20.
    lp, mu, adv, mask = random_batch(seed, b=24, scale=0.4)
    config = ObjectiveConfig(name="sat-gspo", sat_alpha=0.7)
    _, metrics = policy_loss(lp, mu, adv[:, 0], mask, config)
    log_r = torch.where(mask, lp - mu, torch.zeros_like(lp))
    seq = log_r.sum(-1) / mask.sum(-1)
    d = torch.where(mask, seq[:, None].expand_as(lp), torch.zeros_like(lp))
    token = sat_metrics(sat_radii(d, mask, 0.2, 0.2, 0.7), mask)
    assert metrics["sat_gate_rate"].item() > 0
    for key, value in token.items():
        torch.testing.assert_close(metrics[key], value, rtol=1e-12, atol=1e-15, msg=key)


def test_sat_diagnostics_per_age_bucket_by_hand():
    # The golden SAT-GSPO batch (q = 0.1 at alpha 0.5), rows 0-1 of age 0 and rows 2-3 of age 1.
    # row 0: gated, c+ = 1 / (1 + 1.5^2) = 0.3076923, eps_high' = 0.0615385 (2 tokens)
    # row 1: |d| = q, not gated (3 tokens); row 2: d = 0 (2 tokens)
    # row 3: gated, c+ = 1 / (1 + 2^2) = 0.2, eps_high' = 0.04 (3 tokens)
    # age0: gate 2/5 = 0.4, eps_high' mean (2 * 0.0615385 + 3 * 0.2) / 5 = 0.1446154, c+ min 0.3077
    # age1: gate 3/5 = 0.6, eps_high' mean (2 * 0.2 + 3 * 0.04) / 5 = 0.104, c+ min 0.2
    # eps_low' = 0.2 and c- = 1 everywhere (no gated row has d < 0)
    lp, adv, mask = sat_gspo_batch()
    config = ObjectiveConfig(name="sat-gspo", sat_alpha=0.5)
    _, m = policy_loss(
        lp, torch.zeros_like(lp), adv, mask, config, sample_age=torch.tensor([0, 0, 1, 1])
    )
    expected = {
        "age0/sat_gate_rate": 0.4,
        "age0/sat_eps_high_mean": 0.14461538461538462,
        "age0/sat_eps_low_mean": 0.2,
        "age0/sat_c_plus_min": 1 / 3.25,
        "age0/sat_c_minus_min": 1.0,
        "age1/sat_gate_rate": 0.6,
        "age1/sat_eps_high_mean": 0.104,
        "age1/sat_eps_low_mean": 0.2,
        "age1/sat_c_plus_min": 0.2,
        "age1/sat_c_minus_min": 1.0,
        "age0/num_active_tokens": 5,
        "age1/num_active_tokens": 5,
    }
    for key, value in expected.items():
        assert m[key].item() == pytest.approx(value, abs=1e-12), key
