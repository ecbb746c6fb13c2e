"""TIS in slime's form (as the SAT paper ran it) and the baselines' recomputed denominator.

TIS clips the update ratio pi / pi_old and multiplies by sg[min(pi_old / mu, C)]
(ALGORITHMS.md, corrected), so pi / mu is counted once. Hand values: r = pi / mu = 1.1,
pi_old = pi (one optimizer step per batch: the trainer recomputes pi_old with the weights it is
about to update), C = 2, A = 1, one token, token-mean:
  update ratio pi / pi_old = 1 (inside the clip), weight min(1.1, 2) = 1.1
  loss = -(pi / pi_old) * 1.1 = -1.1; d loss / d log pi = -(pi / pi_old) * 1.1 = -1.1
The double-counting form (ratio pi / mu times the weight) gives -1.1 * 1.1 = -1.21.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_sat.config import load_config
from megatron_sat.objectives import ObjectiveConfig, policy_loss

F64 = torch.float64
LOG_R = math.log(1.1)


def _tis_step(name: str, **config):
    log_probs = torch.tensor([[LOG_R]], dtype=F64, requires_grad=True)
    rollout = torch.zeros(1, 1, dtype=F64)  # log mu = 0
    old = log_probs.detach().clone()  # pi_old recomputed at the current weights = pi
    adv, mask = torch.ones(1, dtype=F64), torch.ones(1, 1, dtype=torch.bool)
    cfg = ObjectiveConfig(name=name, tis_cap=2.0, **config)
    loss, metrics = policy_loss(log_probs, rollout, adv, mask, cfg, old_log_probs=old)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss.item(), grad.item(), metrics


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo-token"])
def test_tis_gradient_weight_is_min_r_c_not_r_times_min_r_c(name):
    loss, grad, metrics = _tis_step(name)
    assert grad == pytest.approx(-1.1, abs=1e-12), "pi/mu counted twice (1.21)?"
    assert loss == pytest.approx(-1.1, abs=1e-12)
    assert metrics["tis_weight_mean"].item() == pytest.approx(1.1, abs=1e-12)
    # the mismatch metric still compares with mu
    assert metrics["mismatch_abs_logratio"].item() == pytest.approx(LOG_R, abs=1e-12)


def test_tis_cap_binds():
    # r = pi / mu = e (> C = 2): weight = 2, update ratio 1 -> grad -2 (double counting: -2e)
    log_probs = torch.tensor([[1.0]], dtype=F64, requires_grad=True)
    cfg = ObjectiveConfig(name="grpo", tis_cap=2.0)
    loss, _ = policy_loss(
        log_probs,
        torch.zeros(1, 1, dtype=F64),
        torch.ones(1, dtype=F64),
        torch.ones(1, 1, dtype=torch.bool),
        cfg,
        old_log_probs=log_probs.detach(),
    )
    (grad,) = torch.autograd.grad(loss, log_probs)
    assert grad.item() == pytest.approx(-2.0, abs=1e-12)


def test_tis_with_mu_as_denominator_is_refused():
    with pytest.raises(ValueError, match=r"ObjectiveConfig\.ratio_denominator must be.*twice"):
        ObjectiveConfig(name="grpo", tis_cap=2.0, ratio_denominator="rollout")
    with pytest.raises(ValueError, match=r"ObjectiveConfig\.ratio_denominator must be.*twice"):
        ObjectiveConfig(name="grpo", icepop_range=(0.5, 5.0), ratio_denominator="rollout")
    assert ObjectiveConfig(name="grpo").ratio_denominator == "rollout"
    assert ObjectiveConfig(name="grpo", tis_cap=2.0).ratio_denominator == "recomputed_old"


@pytest.mark.parametrize("mode", ["rollout.mode=fixed_lag", "rollout.update_weights_interval=4"])
def test_tis_recomputed_old_is_allowed_in_async_runs(mode):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no inert-clip warning: TIS corrects pi_old to mu
        cfg = load_config(None, ["objective.name=grpo", "objective.tis_cap=2", mode])
    assert cfg.objective.ratio_denominator == "recomputed_old"


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_baselines_as_the_paper_ran_them_warn_that_the_clip_is_inert(name):
    overrides = [f"objective.name={name}", "objective.ratio_denominator=recomputed_old"]
    with pytest.warns(UserWarning, match="clip is inert"):
        cfg = load_config(None, [*overrides, "rollout.mode=fixed_lag", "rollout.lag=8"])
    assert cfg.objective.ratio_denominator == "recomputed_old"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on-policy (sync, interval 1): nothing to warn about
        load_config(None, overrides)


@pytest.mark.parametrize("name", ["sat-grpo", "sat-gspo", "dppo-tv", "m2po"])
def test_staleness_aware_objectives_refuse_a_recomputed_denominator_in_async_runs(name):
    overrides = [f"objective.name={name}", "objective.ratio_denominator=recomputed_old"]
    with pytest.raises(ValueError, match=f"recomputed_old.*mode=fixed_lag.*{name}"):
        load_config(None, [*overrides, "rollout.mode=fixed_lag"])
