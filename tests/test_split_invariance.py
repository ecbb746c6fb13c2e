"""Split invariance of the real PolicyTrainer: one micro-batch, four micro-batches and data
parallelism (torchrun, 2 gloo ranks, uneven shares of whole groups) give the same loss,
gradients and global metrics up to fp32 rounding, for every aggregation mode and SAT's global
quantile; the RL loop runs end to end at DP = 2; per-age metrics; denominator refusals."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_torchrun

from megatron_sat.config import ParallelConfig, TrainConfig, load_config
from megatron_sat.objectives import (
    ObjectiveConfig,
    compute_grpo_advantages,
    sat_abs_staleness,
    sat_reference_quantile,
)
from megatron_sat.rollout.arith import make_arith_splits
from megatron_sat.rollout.types import Sample
from megatron_sat.training.micro_batches import token_budget_micro_batches
from megatron_sat.training.trainer import PolicyTrainer

ROOT = Path(__file__).resolve().parents[1]
GROUP_SIZE = 4
NUM_GROUPS = 6
TRAINER_VERSION = 3
# The full reduced gradients are compared (main_grad): megatron-core's distributed optimizer
# (on by default at a DP size > 1) reduce-scatters them, leaving each rank only its shard.
TRAIN = {
    "lr": 1e-3,
    "clip_grad": 0.0,
    "micro_batch_size": 24,
    "use_r3": True,
    "use_distributed_optimizer": False,
}
# Whole groups, uneven on purpose: rank 0 has 4 groups (16 samples), rank 1 has 2 (8).
SHARES = [slice(0, 16), slice(16, 24)]
CASES = [
    {"name": "sat-gspo/token-mean", "objective": {"name": "sat-gspo"}},
    {
        "name": "sat-gspo/seq-mean-token-mean",
        "objective": {"name": "sat-gspo", "loss_agg_mode": "seq-mean-token-mean"},
    },
    {
        "name": "sat-gspo/seq-mean-token-sum",
        "objective": {"name": "sat-gspo", "loss_agg_mode": "seq-mean-token-sum", "sat_alpha": 0.5},
    },
    {
        "name": "sat-gspo/seq-mean-token-sum-norm",
        "objective": {
            "name": "sat-gspo",
            "loss_agg_mode": "seq-mean-token-sum-norm",
            "loss_agg_norm_constant": 8.0,
        },
    },
    {"name": "sat-grpo/token-mean", "objective": {"name": "sat-grpo", "sat_alpha": 0.5}},
    {
        "name": "grpo/recomputed_old+tis",
        "objective": {
            "name": "grpo",
            "ratio_denominator": "recomputed_old",
            "tis_cap": 1.05,
            "loss_agg_mode": "seq-mean-token-mean",
        },
        "trainer_version": None,  # on-policy: "recomputed_old" needs samples 0 versions old
    },
]
for _case in CASES:
    _case.setdefault("trainer_version", TRAINER_VERSION)
    _case["dp_micro_batch_size"] = 5  # rank 0: 5 + 5 + 5 + 1 rows, rank 1: 5 + 3
    _case["dp_max_tokens"] = 40  # token-budget micro-batches, regrouped by length on each rank


def make_samples(trainer: PolicyTrainer, vocab: int, seed: int = 0) -> list[Sample]:
    """NUM_GROUPS x GROUP_SIZE samples with random tokens and R3 routes; one empty response.

    ``rollout_log_probs`` are filled in by ``attach_rollout_log_probs``. Responses were produced
    by versions 1..3 (ages 0..2 at TRAINER_VERSION), some mixing two versions.
    """
    rng = np.random.default_rng(seed)
    layers, top_k, experts = trainer.routing_shape
    samples = []
    for i in range(NUM_GROUPS * GROUP_SIZE):
        p = int(rng.integers(2, 6))
        r = 0 if i == 5 else int(rng.integers(1, 8))
        tokens = rng.integers(3, vocab, size=p + r).tolist()
        routes = np.stack(
            [
                np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)])
                for _ in range(p + r - 1)
            ]
        ).astype(np.uint8)
        oldest = TRAINER_VERSION - (i % 3)
        versions = [min(oldest + (t % 2), TRAINER_VERSION) for t in range(r)]
        samples.append(
            Sample(
                index=i,
                group_index=i // GROUP_SIZE,
                prompt="",
                label="",
                prompt_ids=tokens[:p],
                response_ids=tokens[p:],
                rollout_log_probs=[0.0] * r,
                response_versions=versions,
                routed_experts=routes,
            )
        )
    return samples


def attach_rollout_log_probs(trainer: PolicyTrainer, samples: list[Sample], seed: int = 1):
    """log mu = the trainer's own log-prob (R3 replay) plus N(0, s) noise, so that clips and
    SAT's gate are active; s = 0.2 on rank 0's share and 0.6 on rank 1's, so that each share's
    own SAT quantile is far from the global one."""
    gen = torch.Generator().manual_seed(seed)
    mb = trainer.micro_batches(samples, torch.zeros(len(samples)), with_routes=True)
    assert len(mb) == 1
    ((log_probs, _),) = trainer._no_grad_log_probs(mb, replay=True)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        noise = (0.2 if row < SHARES[1].start else 0.6) * torch.randn(r, generator=gen)
        s.rollout_log_probs = (log_probs[row, p - 1 : p + r - 1] + noise).tolist()


@pytest.fixture(scope="module")
def trainer(megatron_world, tiny_checkpoint, tiny_hf_config):
    return PolicyTrainer(
        tiny_hf_config,
        TrainConfig(**TRAIN),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
    )


@pytest.fixture(scope="module")
def batch(trainer, tiny_hf_config):
    samples = make_samples(trainer, tiny_hf_config["vocab_size"])
    attach_rollout_log_probs(trainer, samples)
    rewards = torch.tensor([float((i * 7) % 5 > 1) for i in range(len(samples))])
    rewards[8:12] = 1.0  # one group of equal rewards: advantages exactly 0
    return samples, compute_grpo_advantages(rewards, GROUP_SIZE)


def step(trainer, samples, advantages, case, micro_batch_size, max_tokens=None):
    """rl_step with the given micro-batch size (or token budget); returns (metrics, flat
    gradient) and restores the weights so that every call starts from the same policy."""
    params = [p for _, p in trainer.model.named_parameters()]
    saved = [p.detach().clone() for p in params]
    base = trainer.train_config
    trainer.train_config = dataclasses.replace(
        base, micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens
    )
    try:
        metrics = trainer.rl_step(
            samples,
            advantages,
            ObjectiveConfig(**case["objective"]),
            trainer_version=case["trainer_version"],
        )
    finally:
        trainer.train_config = base
    grads = torch.cat([p.main_grad.detach().reshape(-1).clone() for p in params])
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    return metrics, grads


@pytest.fixture(scope="module")
def reference(trainer, batch):
    """One micro-batch, one process: the reference of every case."""
    samples, advantages = batch
    return {c["name"]: step(trainer, samples, advantages, c, len(samples)) for c in CASES}


def assert_same_step(got, want, what):
    (m_got, g_got), (m_want, g_want) = got, want
    assert g_want.abs().max() > 0, what
    scale = float(g_want.abs().max())
    torch.testing.assert_close(
        g_got, g_want, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}"
    )
    assert set(m_got) == set(m_want), (what, set(m_got) ^ set(m_want))
    for key, value in m_want.items():
        assert m_got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (what, key)


# ---------------------------------------------------------------- micro-batches (one process)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_four_micro_batches_equal_one(trainer, batch, reference, case):
    samples, advantages = batch
    four = step(trainer, samples, advantages, case, micro_batch_size=6)
    assert_same_step(four, reference[case["name"]], case["name"])


# 24 samples of 2..12 tokens: about 4 rows per micro-batch, regrouped by length.
TOKEN_BUDGET = 40


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_token_budget_micro_batches_equal_one(trainer, batch, reference, case):
    samples, advantages = batch
    rows = token_budget_micro_batches([s.num_tokens for s in samples], TOKEN_BUDGET)
    assert len(rows) >= 5 and [i for r in rows for i in r] != list(range(len(samples)))
    grouped = step(trainer, samples, advantages, case, len(samples), max_tokens=TOKEN_BUDGET)
    assert_same_step(grouped, reference[case["name"]], case["name"])


def test_packed_reference_equals_padded(trainer, batch, reference, monkeypatch):
    # On the CPU (no transformer-engine) the one 24-sample micro-batch of the reference is
    # packed with a block mask (fewer rows than samples); the same step padded must agree.
    import megatron_sat.training.step_batch as step_batch_module
    from megatron_sat.training.packing import PackedMicroBatch

    samples, advantages = batch
    (mb,) = trainer.micro_batches(samples, advantages, with_routes=True)
    assert isinstance(mb, PackedMicroBatch) and mb.input_ids.shape[0] < len(samples)
    assert mb.sample_indices == [s.index for s in samples]  # the losses' rows keep the order
    monkeypatch.setattr(step_batch_module, "dense_packing_rows", lambda *a, **k: None)
    (padded_mb,) = trainer.micro_batches(samples, advantages, with_routes=True)
    assert not isinstance(padded_mb, PackedMicroBatch)
    for case in (CASES[0], CASES[4]):
        padded = step(trainer, samples, advantages, case, len(samples))
        assert_same_step(padded, reference[case["name"]], case["name"])


def test_token_budget_refuses_a_sample_longer_than_the_budget(trainer, batch):
    samples, advantages = batch
    longest = max(samples, key=lambda s: s.num_tokens)
    with pytest.raises(ValueError, match=f"sample {longest.index} has {longest.num_tokens} tok"):
        step(trainer, samples, advantages, CASES[0], 4, max_tokens=longest.num_tokens - 1)


def test_reference_exercises_clips_gate_and_ages(reference):
    # The batch is not trivial: SAT gates tokens, clips bind, three age buckets, and SAT's
    # global q differs from the q of either rank's share (checked in the DP test).
    for name in ("sat-gspo/seq-mean-token-sum", "sat-grpo/token-mean"):
        metrics, _ = reference[name]
        assert metrics["sat_gate_rate"] > 0 and metrics["sat_q"] > 0, name
        assert metrics["clipfrac_high"] + metrics["clipfrac_low"] > 0, name
        assert {f"age{a}/clipfrac_high" for a in range(3)} <= set(metrics)
        assert {f"age{a}/sat_gate_rate" for a in range(3)} <= set(metrics)
        assert sum(metrics[f"age{a}/num_active_tokens"] for a in range(3)) == metrics["num_tokens"]
    metrics, _ = reference["grpo/recomputed_old+tis"]
    assert not any(key.startswith("age") for key in metrics)
    # recomputed_old: ratio pi / pi_old = 1 exactly (same weights, same routes), no clip
    assert metrics["clipfrac_high"] == metrics["clipfrac_low"] == 0.0
    assert 0 < metrics["tis_weight_mean"] < 1.05


# ---------------------------------------------------------------- data parallel (torchrun)


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory, trainer, batch, tiny_checkpoint, tiny_hf_config):
    """ONE torchrun launch (2 ranks) for every DP case and a 2-step RL run at DP = 2."""
    tmp = tmp_path_factory.mktemp("dp")
    samples, advantages = batch
    train, test = make_arith_splits(64, 8, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rl_overrides = [
        f"init_checkpoint={tiny_checkpoint}",
        f"run_dir={tmp / 'run'}",
        f"data.train_path={tmp / 'train.jsonl'}",
        f"data.eval_path={tmp / 'test.jsonl'}",
        "data.num_eval_prompts=4",
        "rollout.prompts_per_step=3",  # 3 groups over 2 ranks: shares of 2 and 1 groups
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "rollout.eval_samples_per_prompt=2",
        "train.num_steps=2",
        "train.eval_every=2",
        "train.micro_batch_size=4",
    ]
    spec = {
        "checkpoint": str(tiny_checkpoint),
        "hf_config": tiny_hf_config,
        "pad_token_id": 0,
        "train": TRAIN,
        "samples": samples,
        "advantages": advantages,
        "shares": SHARES,
        "cases": CASES,
        "rl_overrides": rl_overrides,
    }
    (tmp / "spec.pkl").write_bytes(pickle.dumps(spec))
    run_torchrun(
        "tests/dist/dp_split_invariance.py", str(tmp / "spec.pkl"), str(tmp), done="DP_DONE"
    )
    return torch.load(tmp / "result.pt", weights_only=False), tmp


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_data_parallel_two_ranks_equal_one_process(dp_run, reference, case):
    results, _ = dp_run
    got = results[case["name"]]
    assert_same_step((got["metrics"], got["grads"]), reference[case["name"]], case["name"])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_data_parallel_token_budget_equals_one_process(dp_run, reference, case):
    results, _ = dp_run
    got = results[f"{case['name']}/token_budget"]
    assert got["micro_batches"] >= 2  # each rank's share is regrouped into several
    assert_same_step((got["metrics"], got["grads"]), reference[case["name"]], case["name"])


@pytest.mark.slow
def test_data_parallel_quantile_is_global_not_per_rank(dp_run, reference, trainer, batch):
    # The DP q equals the single-process q, and a per-rank q would gate a different set of
    # tokens on at least one rank (so the gradient comparison above would have caught it).
    results, _ = dp_run
    samples, _ = batch
    name = "sat-grpo/token-mean"
    config = ObjectiveConfig(**CASES[4]["objective"])
    global_q = results[name]["metrics"]["sat_q"]
    assert global_q == pytest.approx(reference[name][0]["sat_q"], rel=1e-5)  # fp32 log-probs
    differs = []
    for share in SHARES:
        share_samples = samples[share]
        mbs = trainer.micro_batches(share_samples, torch.zeros(len(share_samples)), True)
        ((lp, _),) = trainer._no_grad_log_probs(mbs, replay=True)
        abs_d = sat_abs_staleness(lp, mbs[0].rollout_log_probs, mbs[0].loss_mask, config)
        local_q = float(sat_reference_quantile(abs_d, config.sat_alpha))
        differs.append(int((abs_d > local_q).sum()) != int((abs_d > global_q).sum()))
    assert any(differs)


@pytest.mark.slow
def test_rl_loop_runs_at_data_parallel_two(dp_run):
    results, tmp = dp_run
    run = tmp / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert results["rl_summary"] == json.loads((run / "summary.json").read_text())
    for row in rows[1:]:
        # global metrics: the denominators count the whole batch of 3 groups x 4 samples, not
        # one rank's share (8 or 4 samples)
        assert row["train/num_seqs"] == 12
        assert row["train/num_tokens"] >= 12 and row["train/topk_match_r3"] == 1.0
        assert "train/sat_q" in row and "train/age0/clipfrac_high" in row
    assert (run / "checkpoint" / "config.json").exists()


# ---------------------------------------------------------------- refusals


def test_recomputed_old_denominator_is_refused_for_stale_samples(trainer, batch):
    # SAT measures staleness against mu: refused; a plain GRPO clip (as the SAT paper ran its
    # baselines) is allowed with a warning that it is inert (checked by tests/test_tis.py)
    samples, advantages = batch
    objective = ObjectiveConfig(name="sat-grpo", ratio_denominator="recomputed_old")
    with pytest.raises(ValueError, match="recomputed_old.*2 version"):
        trainer.rl_step(samples, advantages, objective, trainer_version=TRAINER_VERSION)


def test_norm_mode_without_constant_is_refused(trainer, batch):
    samples, advantages = batch
    objective = ObjectiveConfig(name="gspo", loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_agg_norm_constant"):
        trainer.rl_step(samples, advantages, objective)


def test_config_refuses_recomputed_denominator_in_async_run():
    with pytest.raises(ValueError, match="ratio_denominator='recomputed_old'.*interval=4 > 1"):
        load_config(
            None,
            ["objective.ratio_denominator=recomputed_old", "rollout.update_weights_interval=4"],
        )  # the default objective is sat-gspo
    cfg = load_config(None, ["objective.ratio_denominator=recomputed_old"])  # on-policy: fine
    assert cfg.objective.ratio_denominator == "recomputed_old"
    with pytest.raises(ValueError, match="ratio_denominator must be one of"):
        ObjectiveConfig(ratio_denominator="old")
    with pytest.raises(ValueError, match="loss_agg_norm_constant must be set"):
        load_config(None, ["objective.loss_agg_mode=seq-mean-token-sum-norm"])


# ---------------------------------------------------------------- reduction helpers, shares


def test_metric_accumulator_by_hand():
    # Two micro-batches. Token means weight by num_active_tokens (4 and 1 tokens):
    #   clipfrac_high = (0.5 * 4 + 1.0 * 1) / 5 = 0.6
    # age buckets weight by their own counts: age0 has 2 + 1 tokens -> (0.5 * 2 + 0 * 1) / 3;
    #   age1 only in the first -> 0.25
    # seq_* weight by num_seqs (2 and 1): (0.3 * 2 + 0.6 * 1) / 3 = 0.4
    # sums: loss shares 0.1 + 0.2, counts; min (also per bucket) / same-everywhere keys
    from megatron_sat.training.loss_reduction import MetricAccumulator

    acc = MetricAccumulator()
    acc.add(
        {
            "loss": 0.1,
            "num_active_tokens": 4.0,
            "num_seqs": 2.0,
            "clipfrac_high": 0.5,
            "seq_abs_log_ratio": 0.3,
            "age0/clipfrac_high": 0.5,
            "age0/num_active_tokens": 2.0,
            "age1/clipfrac_high": 0.25,
            "age1/num_active_tokens": 2.0,
            "sat_q": 0.7,
            "sat_c_plus_min": 0.4,
            "age0/sat_c_plus_min": 0.5,
        }
    )
    acc.add(
        {
            "loss": 0.2,
            "num_active_tokens": 1.0,
            "num_seqs": 1.0,
            "clipfrac_high": 1.0,
            "seq_abs_log_ratio": 0.6,
            "age0/clipfrac_high": 0.0,
            "age0/num_active_tokens": 1.0,
            "sat_q": 0.7,
            "sat_c_plus_min": 0.9,
            "age0/sat_c_plus_min": 0.3,
        }
    )
    acc.add({"topk_match_live": 1.0}, {"num_active_tokens": 3.0})
    out = acc.reduce(None)
    assert out["loss"] == pytest.approx(0.3) and out["num_active_tokens"] == 5.0
    assert out["clipfrac_high"] == pytest.approx(0.6)
    assert out["seq_abs_log_ratio"] == pytest.approx(0.4)
    assert out["age0/clipfrac_high"] == pytest.approx(1 / 3)
    assert out["age1/clipfrac_high"] == 0.25 and out["age0/num_active_tokens"] == 3.0
    assert out["sat_q"] == 0.7 and out["sat_c_plus_min"] == 0.4
    assert out["age0/sat_c_plus_min"] == 0.3  # a minimum per bucket too, not a mean
    assert out["topk_match_live"] == 1.0
    with pytest.raises(KeyError, match="needs the weight 'num_active_tokens'"):
        MetricAccumulator().add({"k1": 0.1})


def test_single_process_helpers_communicate_nothing():
    from megatron_sat.training.loss_reduction import (
        all_gather_uneven,
        global_loss_denominators,
        global_sat_quantile,
    )

    masks = [torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 0, 0]])]
    assert global_loss_denominators(masks, None) == (3.0, 2.0)
    assert global_loss_denominators([], None) == (0.0, 0.0)
    values = torch.tensor([0.3, 0.1])
    assert torch.equal(all_gather_uneven(values, None), values)
    q = global_sat_quantile([torch.tensor([0.3, 0.1]), torch.tensor([0.2])], 0.5, None)
    assert q.item() == pytest.approx(0.2)  # k = ceil(1.5) = 2nd of [0.1, 0.2, 0.3]
    assert global_sat_quantile([], 0.9, None).item() == 0.0
    with pytest.raises(ValueError, match="1-D"):
        all_gather_uneven(torch.zeros(2, 2), None)


def test_dp_shares_are_contiguous_whole_groups():
    from megatron_sat.training.rl import dp_shares

    assert dp_shares(12, 4, 2) == [slice(0, 8), slice(8, 12)]  # 3 groups: 2 + 1
    assert dp_shares(16, 4, 2) == [slice(0, 8), slice(8, 16)]
    assert dp_shares(4, 4, 3) == [slice(0, 4), slice(4, 4), slice(4, 4)]  # ranks without a group
    with pytest.raises(ValueError, match="not whole groups"):
        dp_shares(10, 4, 2)
