"""Golden-value tests for megatron_sat.objectives (advantages, aggregation, objectives, metrics).

Every expected number is worked out by hand in the comments (natural logs; e^x written exp(x)).
Most tests use float64 so that the hand numbers can be checked to 1e-9; the numerical-safety
tests use float32, the trainer's dtype. SAT-specific tests live in tests/test_sat.py.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_sat.objectives import (
    LOSS_AGG_MODES,
    OBJECTIVES,
    ObjectiveConfig,
    aggregate_loss,
    compute_grpo_advantages,
    informative_groups,
    mismatch_metrics,
    policy_loss,
    prepare_inputs,
)
from megatron_sat.objectives.policy_loss import binary_kl, binary_tv

F64 = torch.float64


def leaf(values, dtype=F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, requires_grad=True)


def run(name, log_probs, advantages, mask, rollout=None, **kwargs):
    """policy_loss with log mu = 0 unless given, so r = exp(log_probs)."""
    config_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in ObjectiveConfig.__annotations__}
    config = ObjectiveConfig(name=name, **config_kwargs)
    if rollout is None:
        rollout = torch.zeros_like(log_probs)
    loss, metrics = policy_loss(log_probs, rollout, advantages, mask, config, **kwargs)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss, grad, metrics


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", "reinforce"),
        ("eps_low", -0.1),
        ("eps_low", 1.5),
        ("eps_high", -0.2),
        ("eps_high", math.inf),
        ("sat_alpha", 0.0),
        ("sat_alpha", 1.0),
        ("loss_agg_mode", "sum"),
        ("loss_agg_norm_constant", 0.0),
        ("dppo_threshold", -1e-3),
        ("tis_cap", 0.0),
        ("icepop_range", (5.0, 0.5)),
        ("icepop_range", (0.5,)),
        ("dual_clip_c", 1.0),
        ("kl_coef", -1e-3),
        ("kl_coef", math.nan),
    ],
)
def test_config_rejects_bad_value_naming_field(field, value):
    with pytest.raises(ValueError, match=rf"ObjectiveConfig\.{field} must be"):
        ObjectiveConfig(**{field: value})


def test_config_accepts_every_registered_name_and_mode():
    assert set(OBJECTIVES) == {
        "grpo",
        "ppo",
        "gspo",
        "gspo-token",
        "sat-grpo",
        "sat-gspo",
        "dppo-tv",
        "dppo-kl",
        "cispo",
        "m2po",
    }
    for name in OBJECTIVES:
        for mode in LOSS_AGG_MODES:
            ObjectiveConfig(name=name, loss_agg_mode=mode)
    assert ObjectiveConfig(icepop_range=[0.5, 5]).icepop_range == (0.5, 5.0)


def test_config_warns_on_ignored_norm_constant():
    with pytest.warns(UserWarning, match="loss_agg_norm_constant is ignored"):
        ObjectiveConfig(loss_agg_mode="token-mean", loss_agg_norm_constant=4096.0)


def test_policy_loss_input_errors_name_the_argument():
    lp = torch.zeros(2, 3, dtype=F64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    cfg = ObjectiveConfig(name="grpo")
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss(lp, torch.zeros(2, 4, dtype=F64), torch.zeros(2), mask, cfg)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lp, torch.zeros(3), mask, cfg)
    with pytest.raises(ValueError, match="loss_mask"):
        policy_loss(lp, lp, torch.zeros(2), mask[:, :2], cfg)
    with pytest.raises(ValueError, match="ref_log_probs"):
        policy_loss(lp, lp, torch.zeros(2), mask, ObjectiveConfig(name="grpo", kl_coef=1e-3))
    with pytest.raises(ValueError, match="global_num_tokens"):
        policy_loss(lp, lp, torch.zeros(2), mask, cfg, global_num_tokens=0)
    with pytest.raises(ValueError, match="sat_quantile"):
        policy_loss(
            lp, lp, torch.zeros(2), mask, ObjectiveConfig(name="sat-grpo"), sat_quantile=-1.0
        )


# ---------------------------------------------------------------- advantages


def test_grpo_advantages_by_hand():
    # group 0: R = [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 0.5773503
    #   -> A = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239
    # group 1: R = [0.1, 0.1, 0.1, 0.1] -> exactly 0
    # group 2: R = [1, NaN, 0, 0]: valid [1, 0, 0], mean 1/3,
    #   unbiased std = sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3) = 0.5773503
    #   -> A = [0.6666667 / 0.5773513, 0, -0.3333333 / 0.5773513, same] = [1.1547, 0, -0.57735, ..]
    rewards = torch.tensor([1, 0, 0, 1, 0.1, 0.1, 0.1, 0.1, 1, math.nan, 0, 0], dtype=F64)
    adv = compute_grpo_advantages(rewards, group_size=4)
    s = math.sqrt(1 / 3) + 1e-6
    expected = [
        0.5 / s,
        -0.5 / s,
        -0.5 / s,
        0.5 / s,
        0,
        0,
        0,
        0,
        (2 / 3) / s,
        0,
        -1 / 3 / s,
        -1 / 3 / s,
    ]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    assert abs(adv[0].item() - 0.8660239) < 1e-6
    assert torch.equal(adv[4:8], torch.zeros(4, dtype=F64))  # exact zeros, not 1e-11
    assert adv[9].item() == 0.0 and not torch.isnan(adv).any()


def test_grpo_advantages_equal_rewards_with_rounding_residue_are_exactly_zero():
    # mean(0.1, 0.1, 0.1) evaluates to 0.30000000000000004 / 3 = 0.10000000000000002, so a naive
    # (R - mean) / (std + eps) gives -1.4e-17 / 1e-6 = -1.4e-11, not 0.
    rewards = torch.tensor([0.1, 0.1, 0.1], dtype=F64)
    assert (rewards.sum() / 3).item() != 0.1  # the residue this test is about
    for normalize_std in (True, False):
        adv = compute_grpo_advantages(rewards, group_size=3, normalize_std=normalize_std)
        assert torch.equal(adv, torch.zeros(3, dtype=F64))


def test_grpo_advantages_float32_equal_groups_exact_zero_and_dr_grpo():
    rewards = torch.tensor([0.3, 0.3, 0.3, 0.7, 0.2, 0.6], dtype=torch.float32)
    adv = compute_grpo_advantages(rewards, group_size=3)
    assert torch.equal(adv[:3], torch.zeros(3))
    # Dr.GRPO: mean-centred only; group 1 mean = 0.5 -> [0.2, -0.3, 0.1]
    dr = compute_grpo_advantages(rewards, group_size=3, normalize_std=False)
    torch.testing.assert_close(dr[3:], torch.tensor([0.2, -0.3, 0.1]), rtol=0, atol=1e-6)
    assert torch.equal(dr[:3], torch.zeros(3))


def test_grpo_advantages_refuse_finite_rewards_whose_float32_statistics_overflow():
    # Before: the squares overflowed, the inf/nan variance was masked and the whole group got
    # advantage 0 (and -0.0) with no error.
    ok = torch.tensor([0.0, 1.0, 1.0, 0.0])
    rewards = torch.cat([ok, torch.tensor([1e20, 0.0, 1.0, 0.5])])
    with pytest.raises(
        ValueError,
        match=r"group 1 \(samples 4..7\): rewards \[1.0000000200408773e"
        r"\+20, 0.0, 1.0, 0.5\] overflow torch.float32 in the group mean / std",
    ):
        compute_grpo_advantages(rewards, 4)
    with pytest.raises(ValueError, match=r"group 0 .*overflow torch.float32"):  # the mean
        compute_grpo_advantages(torch.tensor([3e38, 3e38, 1.0, 0.5]), 4, normalize_std=False)
    # ordinary rewards: by hand, 0/1 group mean 0.5, unbiased std sqrt(1/3)
    expected = torch.tensor([-0.5, 0.5, 0.5, -0.5]) / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(compute_grpo_advantages(ok, 4), expected, rtol=0, atol=1e-6)
    # float64 is the wider range: the same rewards are fine there
    assert compute_grpo_advantages(rewards.double()[4:], 4)[0] > 1.4


def test_informative_groups_match_nonzero_advantages():
    # groups: all solved, all failed, mixed, equal up to a NaN, mixed with an inf, all NaN
    rewards = torch.tensor(
        [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, math.nan, 0.5, 0.5]
        + [0.0, math.inf, 1.0, math.nan, math.nan, math.nan]
    )
    keep = informative_groups(rewards, group_size=3)
    assert keep.tolist() == [False, False, True, False, True, False]
    adv = compute_grpo_advantages(rewards, group_size=3).view(-1, 3)
    assert torch.equal((adv != 0).any(-1), keep)
    with pytest.raises(ValueError, match="groups of 4"):
        informative_groups(torch.zeros(6), group_size=4)


def test_grpo_advantages_all_nan_group_and_errors():
    adv = compute_grpo_advantages(torch.tensor([math.nan, math.nan, 1.0, 3.0]), group_size=2)
    # group 1: mean 2, std sqrt(2) -> +-1/(1.4142136 + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, -0.7071063, 0.7071063]))
    with pytest.raises(ValueError, match="group_size"):
        compute_grpo_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="rewards"):
        compute_grpo_advantages(torch.zeros(2, 2), group_size=2)


# ---------------------------------------------------------------- aggregation


LOSS_2x3 = [[1.0, 2.0, 3.0], [4.0, 5.0, math.nan]]
MASK_2x3 = [[1, 1, 1], [1, 1, 0]]


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, 15 / 5),  # (1+2+3+4+5) / 5 = 3
        ("token-mean", {"global_num_tokens": 10}, 1.5),  # 15 / 10
        ("seq-mean-token-mean", {}, 3.25),  # (6/3 + 9/2) / 2 = (2 + 4.5) / 2
        ("seq-mean-token-mean", {"global_num_seqs": 5}, 1.3),  # 6.5 / 5
        ("seq-mean-token-sum", {}, 7.5),  # (6 + 9) / 2
        ("seq-mean-token-sum-norm", {}, 2.5),  # (6/3 + 9/3) / 2, C = T = 3
        ("seq-mean-token-sum-norm", {"norm_constant": 10.0}, 0.75),  # (0.6 + 0.9) / 2
    ],
)
def test_aggregation_by_hand(mode, kwargs, expected):
    loss = torch.tensor(LOSS_2x3, dtype=F64)
    out = aggregate_loss(loss, torch.tensor(MASK_2x3), mode, **kwargs)
    assert out.item() == pytest.approx(expected, abs=1e-12)


def test_aggregation_empty_rows_and_empty_batch():
    loss = torch.tensor([[1.0, 2.0], [7.0, 7.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]])
    # the empty row counts in no denominator: seq-mean-token-mean = (3/2) / 1
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == 1.5
    empty = aggregate_loss(loss, torch.zeros(2, 2), "token-mean")
    assert empty.item() == 0.0
    (grad,) = torch.autograd.grad(empty, loss)
    assert torch.equal(grad, torch.zeros(2, 2, dtype=F64))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_denominators_sum_to_full_batch(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen, dtype=F64)
    mask = torch.rand(6, 5, generator=gen) > 0.3
    mask[0] = False  # an empty response
    num_tokens = mask.sum().item()
    num_seqs = (mask.sum(-1) > 0).sum().item()
    kw = {"global_num_tokens": num_tokens, "global_num_seqs": num_seqs, "norm_constant": 5.0}
    parts = sum(aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, **kw) for i in (0, 2, 4))
    full = aggregate_loss(loss, mask, mode, norm_constant=5.0)
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)


# ---------------------------------------------------------------- objectives, golden values


def grpo_batch():
    # two responses, T = 3, log mu = 0 so r = exp(log pi); the pad holds NaN.
    lp = leaf([[0.3, -0.3, 0.1], [0.3, -0.3, math.nan]])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return lp, adv, mask


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_grpo_token_mean_by_hand(name):
    # r = [exp(0.3), exp(-0.3), exp(0.1) | exp(0.3), exp(-0.3)]
    #   = [1.3498588, 0.7408182, 1.1051709 | 1.3498588, 0.7408182], eps = 0.2 -> clip [0.8, 1.2]
    # A = +1: S = min(r, clip(r)) = [1.2 (clipped), 0.7408182, 1.1051709]
    # A = -1: S = min(-r, -clip(r)) = [-1.3498588 (unclipped), -0.8 (clipped)]
    # loss = -sum(S) / 5 = -(1.2 + 0.7408182 + 1.1051709 - 1.3498588 - 0.8) / 5 = -0.1792261
    # dloss/dlog pi = -(dS/dr) r / 5 = [0, -0.7408182, -1.1051709 | +1.3498588, 0] / 5
    lp, adv, mask = grpo_batch()
    loss, grad, m = run(name, lp, adv, mask)
    assert loss.item() == pytest.approx(-0.1792260662362725, abs=1e-12)
    expected = [[0.0, -0.1481636441363436, -0.22103418361512955], [0.26997176151520064, 0.0, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    # clipfrac_high: token (0,0), A > 0, r > 1.2; clipfrac_low: token (1,1), A < 0, r < 0.8
    assert m["clipfrac_high"].item() == pytest.approx(0.2)
    assert m["clipfrac_low"].item() == pytest.approx(0.2)


def test_grpo_seq_mean_token_mean_by_hand():
    # per-token loss -S = [-1.2, -0.7408182, -1.1051709 | 1.3498588, 0.8]
    # seq means: -3.0459891/3 = -1.0153297 and 2.1498588/2 = 1.0749294 -> mean 0.0297998
    lp, adv, mask = grpo_batch()
    loss, _, _ = run("grpo", lp, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(0.02979984543443992, abs=1e-12)


def gspo_batch():
    # seq 0: d = [0.2, 0.1, 0.6]... see tests; log mu = 0
    lp = leaf([[0.3, -0.3, 0.6], [0.1, -0.3, math.inf]])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return lp, adv, mask


@pytest.mark.parametrize("name", ["gspo", "gspo-token"])
def test_gspo_by_hand(name):
    # seq 0: log rho = (0.3 - 0.3 + 0.6) / 3 = 0.2, rho = 1.2214028 > 1.2, A = +1 -> S = 1.2,
    #        clipped, zero gradient
    # seq 1: log rho = (0.1 - 0.3) / 2 = -0.1 (the inf pad is ignored), rho = 0.9048374, A = -1
    #        -> S = -0.9048374 (inside [0.8, 1.2])
    # token-mean: -(3 * 1.2 - 2 * 0.9048374) / 5 = -0.3580650
    lp, adv, mask = gspo_batch()
    loss, _, m = run(name, lp, adv, mask, loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx(-0.35806503278561613, abs=1e-12)
    assert m["clipfrac_high"].item() == pytest.approx(3 / 5)
    # seq-mean-token-mean: -(1.2 - 0.9048374) / 2 = -0.1475813;
    # gradient on seq 1 tokens: loss = rho/2 -> d/dlog pi_t = (rho / 2) (1/2) = 0.2262094
    lp, adv, mask = gspo_batch()
    loss, grad, _ = run(name, lp, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-0.14758129098202022, abs=1e-12)
    # the GSPO paper's aggregation is the default for the name (objectives/paper_defaults.py)
    default_loss, _, _ = run(name, *gspo_batch())
    assert default_loss.item() == loss.item()
    g = 0.22620935450898988
    torch.testing.assert_close(
        grad, torch.tensor([[0, 0, 0], [g, g, 0]], dtype=F64), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("name", ["gspo", "gspo-token", "sat-gspo"])
def test_sequence_ratio_beyond_the_clamp_has_zero_gradient(name):
    # log rho = 25 > 20 (MAX_ABS_LOG_RATIO): rho = exp(20) in value. With A < 0 the unclipped
    # branch r A is the minimum, so only the clamp stops a gradient of about exp(20) A: in
    # every form, per-token advantages (the token form's own path) included. Row 1 is inside
    # the clamp and the trust region, and has a gradient.
    lp = leaf([[25.0, 25.0], [0.05, 0.05]])
    adv = torch.tensor([[-1.0, -0.5], [-1.0, -1.0]], dtype=F64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    _, grad, _ = run(name, lp, adv, mask)
    assert torch.equal(grad[0], torch.zeros(2, dtype=F64))
    assert (grad[1] != 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_sequence_and_token_forms_agree(mode):
    # GSPO Eqs. 13-14: same value (bitwise) and same gradient with per-sequence advantages.
    gen = torch.Generator().manual_seed(1)
    base = 0.15 * torch.randn(4, 7, generator=gen, dtype=F64)
    mu = torch.randn(4, 7, generator=gen, dtype=F64) - 1.0
    adv = torch.randn(4, generator=gen, dtype=F64)
    mask = torch.rand(4, 7, generator=gen) > 0.2
    out = {}
    for name in ("gspo", "gspo-token"):
        lp = (mu + base).clone().requires_grad_(True)
        out[name] = run(name, lp, adv, mask, rollout=mu, loss_agg_mode=mode)
    assert torch.equal(out["gspo"][0], out["gspo-token"][0])
    torch.testing.assert_close(out["gspo"][1], out["gspo-token"][1], rtol=1e-12, atol=1e-14)
    # and [B] advantages == the same advantages broadcast to [B, T]
    lp = (mu + base).clone().requires_grad_(True)
    loss_bt, grad_bt, _ = run(
        "gspo", lp, adv[:, None].expand(4, 7), mask, rollout=mu, loss_agg_mode=mode
    )
    assert torch.equal(loss_bt, out["gspo"][0]) and torch.equal(grad_bt, out["gspo"][1])


def test_gspo_long_sequence_uses_the_mean_not_the_sum():
    # 10,000 tokens each with log-ratio 1e-4 -> rho = exp(mean) = exp(1e-4) = 1.000100005,
    # not exp(sum) = e. A = 1: inside the clip, S = rho, loss = -rho (token-mean).
    # fp32: log mu = -0.5, log pi = -0.5 + 1e-4 (representation error of d ~ 3e-8 << 1e-6).
    n = 10_000
    mu = torch.full((1, n + 500), -0.5)
    lp = (mu + 1e-4).clone()
    lp[0, n:] = math.nan  # padding
    lp.requires_grad_(True)
    mask = torch.zeros(1, n + 500, dtype=torch.bool)
    mask[0, :n] = True
    loss, grad, _ = run("gspo", lp, torch.ones(1), mask, rollout=mu)
    assert abs(-loss.item() - math.exp(1e-4)) < 1e-6
    # gradient of -rho w.r.t. each token: -rho / n
    assert abs(grad[0, 0].item() + math.exp(1e-4) / n) < 1e-9
    assert torch.equal(grad[0, n:], torch.zeros(500))


def dppo_batch():
    # one response, per-token A; mu and pi are probabilities of the sampled token
    mu = [0.5, 0.5, 0.5, 0.5, 0.001]
    pi = [0.5005, 0.502, 0.498, 0.498, 0.0015]
    lp = leaf([[math.log(p) for p in pi]])
    rollout = torch.tensor([[math.log(p) for p in mu]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, 1.0]], dtype=F64)
    return lp, adv, torch.ones(1, 5, dtype=torch.bool), rollout


def test_dppo_tv_by_hand():
    # token  r      TV     A   outward  dropped (delta 1e-3)   GRPO S
    # 0      1.001  5e-4   +1  yes      no  (TV small)          1.001
    # 1      1.004  2e-3   +1  yes      yes                     0
    # 2      0.996  2e-3   +1  no       no  (inward)            0.996
    # 3      0.996  2e-3   -1  yes      yes                     0
    # 4      1.5    5e-4   +1  yes      no  -> GRPO clip        1.2 (zero gradient)
    # loss = -(1.001 + 0.996 + 1.2) / 5 = -0.6394; grad = [-1.001, 0, -0.996, 0, 0] / 5
    lp, adv, mask, mu = dppo_batch()
    loss, grad, m = run("dppo-tv", lp, adv, mask, rollout=mu)
    assert loss.item() == pytest.approx(-0.6394, abs=1e-12)
    expected = torch.tensor([[-0.2002, 0.0, -0.1992, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    assert m["dppo_drop_rate"].item() == pytest.approx(0.4)


def test_dppo_kl_by_hand():
    # binary KL(mu || pi) = mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi)):
    # token 0: 0.5 log(0.5/0.5005) + 0.5 log(0.5/0.4995) = 5.0e-7   (keep, delta 2e-6)
    # tokens 1-3: 8.0e-6 (1 and 3 outward -> dropped, 2 inward -> kept)
    # token 4: 0.001 log(0.001/0.0015) + 0.999 log(0.999/0.9985) = -4.0547e-4 + 5.0013e-4
    #          = 9.466e-5 > 2e-6, outward -> dropped (TV kept it)
    # loss = -(1.001 + 0.996) / 5 = -0.3994
    lp, adv, mask, mu = dppo_batch()
    loss, grad, m = run("dppo-kl", lp, adv, mask, rollout=mu, dppo_threshold=2e-6)
    assert loss.item() == pytest.approx(-0.3994, abs=1e-12)
    expected = torch.tensor([[-0.2002, 0.0, -0.1992, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    assert m["dppo_drop_rate"].item() == pytest.approx(0.6)


def test_binary_kl_direction_and_saturation():
    # KL(mu || pi) with mu = 0.5, pi = 0.9: 0.5 log(0.5/0.9) + 0.5 log(0.5/0.1)
    #   = 0.5 (-0.5877867) + 0.5 (1.6094379) = 0.5108256   (KL(pi || mu) would be 0.3680642)
    # mu = 1 (log mu = 0), pi = 0.5: p clamped to 1 - 1e-12 -> log 2 + ~1e-12 log(1e-12/0.5),
    #   finite, = 0.6931472 to 1e-9
    inp = prepare_inputs(
        torch.tensor([[math.log(0.9), math.log(0.5)]], dtype=F64),
        torch.tensor([[math.log(0.5), 0.0]], dtype=F64),
        torch.zeros(1, dtype=F64),
        torch.ones(1, 2, dtype=torch.bool),
    )
    kl = binary_kl(inp)
    assert kl[0, 0].item() == pytest.approx(0.5108256237659907, abs=1e-12)
    assert kl[0, 1].item() == pytest.approx(math.log(2), abs=1e-9)
    assert binary_tv(inp)[0, 0].item() == pytest.approx(0.4, abs=1e-12)


def test_dual_clip_by_hand():
    # response 0: A = -1, r = [5, 1]; response 1: A = +1, r = [1, 1]
    # PPO: S = [min(-5, -1.2), -1 | 1, 1] = [-5, -1 | 1, 1] -> loss = -(-5 - 1 + 1 + 1)/4 = 1.0
    # dual clip c = 3 (A < 0 only): S_00 = max(-5, -3) = -3 with zero gradient; A > 0 tokens keep
    #   S = 1 (not max(1, 3)) -> loss = -(-3 - 1 + 1 + 1)/4 = 0.5
    # grad = -A r / 4 on unclipped tokens: [0, 0.25 | -0.25, -0.25]
    def batch():
        return leaf([[math.log(5.0), 0.0], [0.0, 0.0]]), torch.tensor([-1.0, 1.0], dtype=F64)

    mask = torch.ones(2, 2, dtype=torch.bool)
    lp, adv = batch()
    loss, _, _ = run("grpo", lp, adv, mask)
    assert loss.item() == pytest.approx(1.0, abs=1e-12)
    lp, adv = batch()
    loss, grad, m = run("grpo", lp, adv, mask, dual_clip_c=3.0)
    assert loss.item() == pytest.approx(0.5, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.25], [-0.25, -0.25]], dtype=F64))
    assert m["clipfrac_dual"].item() == pytest.approx(0.25)


def test_tis_and_icepop_by_hand():
    # log mu = 0, log pi = log pi_old (TIS's update ratio pi/pi_old = 1, S = A), A = +1;
    # x = log pi_old - log mu = [log 3, log 0.5, 0]
    # TIS C = 2: w = [min(3, 2), 0.5, 1] = [2, 0.5, 1] -> loss = -(2 + 0.5 + 1) / 3 = -7/6,
    #   grad = -w / 3 (w detached)
    old = torch.tensor([[math.log(3.0), math.log(0.5), 0.0]], dtype=F64)
    adv, mask = torch.ones(1, dtype=F64), torch.ones(1, 3, dtype=torch.bool)
    loss, grad, m = run("grpo", leaf(old.tolist()), adv, mask, old_log_probs=old, tis_cap=2.0)
    assert loss.item() == pytest.approx(-7 / 6, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-2 / 3, -0.5 / 3, -1 / 3]], dtype=F64))
    assert m["tis_weight_mean"].item() == pytest.approx(3.5 / 3)
    # IcePop (0.6, 2.5): pi_old/mu = [3, 0.5, 1] -> keep only token 2; dropped tokens stay in the
    #   token-mean denominator: loss = -1/3
    loss, grad, m = run(
        "grpo", leaf(old.tolist()), adv, mask, old_log_probs=old, icepop_range=(0.6, 2.5)
    )
    assert loss.item() == pytest.approx(-1 / 3, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -1 / 3]], dtype=F64))
    assert m["icepop_keep_rate"].item() == pytest.approx(1 / 3)


def test_tis_without_old_log_probs_is_refused():
    # TIS implies the recomputed-old denominator (slime's form), which needs old_log_probs
    assert ObjectiveConfig(tis_cap=2.0).ratio_denominator == "recomputed_old"
    lp, adv, mask = grpo_batch()
    with pytest.raises(ValueError, match="old_log_probs is required.*recomputed_old"):
        run("grpo", lp, adv, mask, tis_cap=2.0)


def test_reference_kl_k3_by_hand():
    # log pi - log pi_ref = x = 0.5 on the one token: k3 = exp(-0.5) - 1 + 0.5 = 0.1065307
    # r = 1, A = 1 -> pg_loss = -1; loss = -1 + 0.1 * 0.1065307; d k3 / dx = 1 - exp(-x)
    lp = leaf([[0.0, 7.0]])
    ref = torch.tensor([[-0.5, math.nan]], dtype=F64)
    mask = torch.tensor([[1, 0]], dtype=torch.bool)
    loss, grad, m = run("grpo", lp, torch.ones(1, dtype=F64), mask, ref_log_probs=ref, kl_coef=0.1)
    assert m["kl_loss"].item() == pytest.approx(0.10653065971263342, abs=1e-12)
    assert loss.item() == pytest.approx(-1 + 0.010653065971263342, abs=1e-12)
    assert grad[0, 0].item() == pytest.approx(-1 + 0.1 * (1 - math.exp(-0.5)), abs=1e-12)
    assert grad[0, 1].item() == 0.0


@pytest.mark.parametrize(("x", "expected"), [(100.0, 9.000045399929762), (-100.0, 22015.4658)])
def test_reference_kl_k3_extreme_log_ratio_fp32_is_finite(x, expected):
    # x clamped to +-10: k3(10) = exp(-10) + 9 = 9.0000454; k3(-10) = exp(10) - 11 = 22015.47
    lp = torch.tensor([[x]], dtype=torch.float32, requires_grad=True)
    ref = torch.zeros(1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, grad, m = run(
        "grpo",
        lp,
        torch.zeros(1),
        mask,
        rollout=lp.detach().clone(),
        ref_log_probs=ref,
        kl_coef=1.0,
    )
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert m["kl_loss"].item() == pytest.approx(expected, rel=1e-6)


def test_entropy_bonus_by_hand():
    # H = [0.7, 0.2 | 0.4, garbage]: token mean over the 3 active tokens = 1.3 / 3; with
    # coefficient 0.05 the loss drops by 0.05 * 1.3 / 3 and d loss / d H = -0.05 / 3 per token
    lp = leaf([[0.0, 0.0], [0.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    entropy = torch.tensor([[0.7, 0.2], [0.4, math.nan]], dtype=F64, requires_grad=True)
    adv = torch.ones(2, dtype=F64)
    base, _, _ = run("grpo", lp, adv, mask)
    config = ObjectiveConfig(name="grpo", entropy_coef=0.05)
    loss, metrics = policy_loss(lp, torch.zeros_like(lp), adv, mask, config, entropy=entropy)
    assert loss.item() == pytest.approx(base.item() - 0.05 * 1.3 / 3, abs=1e-12)
    assert metrics["entropy"].item() == pytest.approx(1.3 / 3, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, entropy)
    expected = torch.tensor([[-0.05 / 3, -0.05 / 3], [-0.05 / 3, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)
    # coefficient 0: the metric only, the loss unchanged
    loss0, m0 = policy_loss(
        lp, torch.zeros_like(lp), adv, mask, ObjectiveConfig(name="grpo"), entropy=entropy
    )
    assert torch.equal(loss0, base) and m0["entropy"].item() == pytest.approx(1.3 / 3)
    with pytest.raises(ValueError, match="entropy is required"):
        policy_loss(lp, torch.zeros_like(lp), adv, mask, config)
    with pytest.raises(ValueError, match="entropy_coef"):
        ObjectiveConfig(entropy_coef=-0.1)


def test_mismatch_metrics_by_hand():
    # d = [0.3, -0.3, 0.1]; mean |d| = 0.2333333; k1 = mean(-d) = -0.0333333;
    # k3 = mean(exp(d) - 1 - d) = (0.0498588 + 0.0408182 + 0.0051709) / 3 = 0.0319493
    lp = torch.tensor([[0.3, -0.3], [0.1, math.nan]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    m = mismatch_metrics(lp, torch.zeros(2, 2, dtype=F64), mask)
    assert m["mismatch_abs_logratio"].item() == pytest.approx(0.2333333333333333, abs=1e-12)
    assert m["k1"].item() == pytest.approx(-0.03333333333333333, abs=1e-12)
    assert m["k3"].item() == pytest.approx(0.03194931544445623, abs=1e-12)


def test_mismatch_metrics_are_token_level_for_gspo():
    lp, adv, mask = gspo_batch()
    _, _, m = run("gspo", lp, adv, mask)
    # |d| over the 5 active tokens: (0.3 + 0.3 + 0.6 + 0.1 + 0.3) / 5 = 0.32
    assert m["mismatch_abs_logratio"].item() == pytest.approx(0.32, abs=1e-12)


# ---------------------------------------------------------------- padding and metrics contract


def random_batch(seed, b=4, t=9, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([t, 5, 1, 3])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mu = -torch.rand(b, t, generator=gen, dtype=dtype) * 3
    lp = mu + 0.2 * torch.randn(b, t, generator=gen, dtype=dtype)
    old = mu + 0.1 * torch.randn(b, t, generator=gen, dtype=dtype)
    ref = mu + 0.1 * torch.randn(b, t, generator=gen, dtype=dtype)
    adv = torch.randn(b, t, generator=gen, dtype=dtype)
    return lp, mu, adv, mask, ref, old


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_padding_garbage_changes_nothing(name, mode, per_token_adv):
    # The same batch padded to T = 12 with NaN/inf garbage vs trimmed to T = 9 (its longest
    # response): identical loss, identical gradient on active tokens, zero gradient on the pad.
    lp, mu, adv, mask, ref, old = random_batch(seed=3)
    if not per_token_adv:
        adv = adv[:, 0]
    extra = {"ref_log_probs": ref, "old_log_probs": old}
    cfg = {
        "loss_agg_mode": mode,
        "loss_agg_norm_constant": 16.0 if mode == "seq-mean-token-sum-norm" else None,
        "kl_coef": 1e-3,
        "tis_cap": 2.0,
        "icepop_range": (0.5, 5.0),
        "dual_clip_c": None if name in ("cispo", "m2po") else 3.0,  # no clip to bound there
    }

    def pad(x, fill):
        return torch.cat([x, torch.full((x.shape[0], 3), fill, dtype=x.dtype)], dim=1)

    trimmed_lp = lp.clone().requires_grad_(True)
    garbage = [math.nan, math.inf, -math.inf, 1e30]
    # Also put garbage inside the trimmed tensor's own padded positions.
    dirty = lambda x, g: torch.where(mask, x, torch.full_like(x, g))  # noqa: E731
    padded_lp = pad(dirty(lp, math.nan), math.nan).requires_grad_(True)
    padded = {
        "rollout": pad(dirty(mu, math.inf), garbage[1]),
        "ref_log_probs": pad(dirty(ref, -math.inf), garbage[2]),
        "old_log_probs": pad(dirty(old, 1e30), garbage[3]),
    }
    padded_adv = pad(dirty(adv, math.nan), math.nan) if per_token_adv else adv
    padded_mask = pad(mask, False)
    loss_t, grad_t, m_t = run(name, trimmed_lp, adv, mask, rollout=mu, **extra, **cfg)
    loss_p, grad_p, m_p = run(name, padded_lp, padded_adv, padded_mask, **padded, **cfg)
    assert torch.isfinite(loss_p)
    torch.testing.assert_close(loss_p, loss_t, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_p[:, :9][mask], grad_t[mask], rtol=1e-12, atol=0)
    assert torch.equal(grad_p[~padded_mask], torch.zeros_like(grad_p[~padded_mask]))
    for key, value in m_t.items():
        torch.testing.assert_close(m_p[key], value, rtol=1e-12, atol=1e-15, msg=key)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_metrics_contract(name):
    lp, mu, adv, mask, ref, _ = random_batch(seed=5)
    lp.requires_grad_(True)
    loss, metrics = policy_loss(
        lp, mu, adv, mask, ObjectiveConfig(name=name, kl_coef=1e-3), ref_log_probs=ref
    )
    assert loss.dim() == 0 and loss.requires_grad
    required = {"clipfrac_low", "clipfrac_high", "mismatch_abs_logratio", "k1", "k3", "kl_loss"}
    if name.startswith("sat-"):
        required |= {
            "sat_q",
            "sat_gate_rate",
            "sat_eps_low_mean",
            "sat_eps_high_mean",
            "sat_c_plus_min",
            "sat_c_minus_min",
        }
    assert required <= set(metrics)
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad, key


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("shape", [(3, 4), (0, 4)])
def test_batch_without_active_tokens_gives_exact_zero(name, shape):
    # A data-parallel rank or micro-batch may hold no active token: loss exactly 0 (with the
    # global denominators too), zero gradient, finite metrics, even with NaN everywhere.
    lp = torch.full(shape, math.nan, dtype=F64, requires_grad=True)
    garbage = torch.full(shape, math.nan, dtype=F64)
    mask = torch.zeros(shape, dtype=torch.bool)
    for kw in ({}, {"global_num_tokens": 7.0, "global_num_seqs": 2.0}):
        loss, grad, m = run(
            name,
            lp,
            garbage[:, 0],
            mask,
            rollout=garbage,
            ref_log_probs=garbage,
            kl_coef=1e-3,
            **kw,
        )
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros(shape, dtype=F64))
        assert all(torch.isfinite(v) for v in m.values())


def test_float32_and_bfloat16_inputs_compute_in_float32():
    lp, mu, adv, mask, _, _ = random_batch(seed=6, dtype=torch.float32)
    lp16 = lp.to(torch.bfloat16).requires_grad_(True)
    loss, _ = policy_loss(lp16, mu, adv, mask, ObjectiveConfig(name="sat-gspo"))
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp16.grad.dtype == torch.bfloat16 and torch.isfinite(lp16.grad.float()).all()


def test_sat_quantile_for_non_sat_objective_warns():
    lp, adv, mask = grpo_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run("grpo", lp, adv, mask, sat_quantile=0.1)
    assert any("sat_quantile is ignored" in str(w.message) for w in caught)


# ---------------------------------------------------------------- ratio denominator, age buckets


def test_recomputed_old_denominator_by_hand():
    # log pi = 0.15, log pi_old = 0.1, log mu = 0, A = +1, eps 0.2, token-mean:
    # "rollout":        r = exp(0.15) = 1.1618342 (inside) -> loss = -1.1618342, grad = -r
    # "recomputed_old": r = exp(0.05) = 1.0512711 (inside) -> loss = -1.0512711, grad = -r
    #   + TIS cap 2: w = min(exp(0.1 - 0), 2) = 1.1051709 -> loss = -1.0512711 * 1.1051709
    # the mismatch metric always compares with mu: |0.15 - 0| = 0.15
    old = torch.tensor([[0.1]], dtype=F64)
    adv, mask = torch.tensor([1.0], dtype=F64), torch.tensor([[True]])
    loss, grad, m = run("grpo", leaf([[0.15]]), adv, mask, old_log_probs=old)
    assert loss.item() == pytest.approx(-1.1618342427282833, abs=1e-12)
    loss, grad, m = run(
        "grpo", leaf([[0.15]]), adv, mask, old_log_probs=old, ratio_denominator="recomputed_old"
    )
    assert loss.item() == pytest.approx(-1.0512710963760241, abs=1e-12)
    assert grad.item() == pytest.approx(-1.0512710963760241, abs=1e-12)
    assert m["mismatch_abs_logratio"].item() == pytest.approx(0.15, abs=1e-12)
    loss, _, m = run(
        "grpo",
        leaf([[0.15]]),
        adv,
        mask,
        old_log_probs=old,
        ratio_denominator="recomputed_old",
        tis_cap=2.0,
    )
    assert loss.item() == pytest.approx(-1.0512710963760241 * math.exp(0.1), abs=1e-12)
    assert m["tis_weight_mean"].item() == pytest.approx(math.exp(0.1), abs=1e-12)
    with pytest.raises(ValueError, match="old_log_probs is required.*recomputed_old"):
        run("grpo", leaf([[0.15]]), adv, mask, ratio_denominator="recomputed_old")


def test_age_bucket_metrics_by_hand():
    # grpo, log mu = 0 so d = log pi; eps 0.2.
    # row 0, age 0, A = +1: d = [0.3, -0.3]: r = 1.3499 > 1.2 -> clip high; 0.7408 (A > 0: none)
    # row 1, age 1, A = -1: d = [0.1]:       r = 1.1052 (A < 0, > 0.8: none)
    # row 2, age 0, A = -1: d = [-0.4, 0]:   r = 0.6703 < 0.8 -> clip low; 1.0 none
    # row 3, age 2, no active token -> no age2 keys; row 4, age -1 (left out) with one token.
    # age0 (4 tokens, 2 rows): clipfrac_high = 1/4, clipfrac_low = 1/4,
    #   mismatch = (0.3 + 0.3 + 0.4 + 0) / 4 = 0.25, k1 = -(0.3 - 0.3 - 0.4 + 0) / 4 = 0.1,
    #   k3 = (0.0498588 + 0.0408182 + 0.0703200 + 0) / 4 = 0.0402493
    # age1 (1 token, 1 row): clipfracs 0, mismatch 0.1, k1 = -0.1, k3 = exp(0.1) - 1.1 = 0.0051709
    nan = math.nan
    lp = leaf([[0.3, -0.3], [0.1, nan], [-0.4, 0.0], [nan, nan], [2.0, nan]])
    mask = ~torch.isnan(lp.detach())
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], dtype=F64)
    age = torch.tensor([0, 1, 0, 2, -1])
    _, _, m = run("grpo", lp, adv, mask, sample_age=age)
    expected = {
        "age0/clipfrac_high": 0.25,
        "age0/clipfrac_low": 0.25,
        "age0/mismatch_abs_logratio": 0.25,
        "age0/k1": 0.1,
        "age0/k3": 0.0402492685733401,
        "age0/num_active_tokens": 4,
        "age0/num_seqs": 2,
        "age1/clipfrac_high": 0.0,
        "age1/clipfrac_low": 0.0,
        "age1/mismatch_abs_logratio": 0.1,
        "age1/k1": -0.1,
        "age1/k3": 0.005170918075647624,
        "age1/num_active_tokens": 1,
        "age1/num_seqs": 1,
    }
    assert {k for k in m if k.startswith("age")} == set(expected)
    for key, value in expected.items():
        assert m[key].item() == pytest.approx(value, abs=1e-12), key
    # the whole-batch metrics still count the left-out row: 6 tokens, 4 rows with a token
    assert m["num_active_tokens"].item() == 6 and m["num_seqs"].item() == 4
    with pytest.raises(ValueError, match="row_bucket must be an integer"):
        run("grpo", leaf([[0.1]]), adv[:1], mask[:1, :1], sample_age=torch.tensor([0.5]))


def test_sequence_metric_averages_rows_with_a_token():
    # seq_abs_log_ratio = mean over rows with >= 1 active token of |mean_t d|:
    # rows: [0.3, -0.1] -> 0.1; [-0.4] -> 0.4; [] -> left out => (0.1 + 0.4) / 2 = 0.25
    nan = math.nan
    lp = leaf([[0.3, -0.1], [-0.4, nan], [nan, nan]])
    mask = ~torch.isnan(lp.detach())
    _, _, m = run("gspo", lp, torch.tensor([1.0, 1.0, 1.0], dtype=F64), mask)
    assert m["seq_abs_log_ratio"].item() == pytest.approx(0.25, abs=1e-12)
    assert m["num_seqs"].item() == 2


def test_saved_config_keeps_unset_fields_null_and_reloads_per_objective(tmp_path):
    """The run directory's config.yaml writes the fields a rule filled as null: reloaded, it
    is the same run; reloaded with another objective.name, that objective's paper defaults."""
    import yaml

    from megatron_sat.config import load_config

    cfg = load_config(None, ["objective.name=sat-gspo", "train.eval_every=5"])
    saved = cfg.to_dict()
    assert [saved["objective"][k] for k in ("loss_agg_mode", "eps_low", "ratio_denominator")] == [
        None,
        None,
        None,
    ]
    assert saved["train"]["routing_diagnostic_interval"] is None
    resolved = cfg.to_dict(resolved=True)
    assert (resolved["objective"]["loss_agg_mode"], resolved["objective"]["eps_low"]) == (
        "seq-mean-token-mean",
        0.2,
    )
    assert resolved["train"]["routing_diagnostic_interval"] == 5
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    assert load_config(str(path)).to_dict(resolved=True) == resolved
    cispo = load_config(str(path), ["objective.name=cispo"]).objective
    assert (cispo.loss_agg_mode, cispo.eps_low) == ("token-mean", 1.0)
    # a value the config set stays as set
    explicit = load_config(None, ["objective.name=gspo", "objective.eps_low=0.2"]).to_dict()
    assert explicit["objective"]["eps_low"] == 0.2
