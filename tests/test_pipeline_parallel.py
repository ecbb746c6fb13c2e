"""PolicyTrainer under pipeline parallelism (megatron-core's 1F1B schedule, gloo, CPU).

From the same HF checkpoint and the same global batch with R3 routes, ONE SAT-GSPO ``rl_step``
(with the entropy bonus) at PP2 (2 ranks: one decoder layer per stage), at PP2 with full
activation recompute, at PP2 with token-budget micro-batches of other shapes, at PP2 x TP2 and at
PP2 x EP2 with uneven data-parallel shares (4 ranks) gives the metrics, gradients and updated
weights (exported as HF tensors) of a single-rank trainer on the whole batch with the same
micro-batches (2 of 8 samples). Each stage
replays only its own MoE layer's routes. A run checkpoint written at PP2 resumes bit-exactly.
One torchrun launch per world size (tests/dist/pp_parallel.py); the single-rank reference runs
in this process.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest
import torch
from conftest import run_torchrun
from test_trainer_parallel import (
    GROUP_SIZE,
    OBJECTIVE,
    REFERENCE_MICRO_BATCH,
    TRAIN,
    TRAINER_VERSION,
    attach_rollout_log_probs,
    hf_state,
    make_samples,
    max_abs,
    max_abs_diff,
)

from megatron_sat.config import ParallelConfig, TrainConfig
from megatron_sat.objectives import ObjectiveConfig, compute_grpo_advantages
from megatron_sat.training.trainer import PolicyTrainer

ROOT = Path(__file__).resolve().parents[1]
MB = {"micro_batch_size": REFERENCE_MICRO_BATCH}
CASES = [
    # Same micro-batches as the reference (2 of 8 samples, each padded to its own longest
    # sample: the stages exchange shapes), then a bit-exact resume from a PP2 run checkpoint.
    {"name": "pp2", "pp": 2, "train": MB, "resume": True, "sft": True, "nproc": 2, "exact": True},
    # Full recompute: each stage's recompute replays its own micro-batch's routes.
    {
        "name": "pp2_recompute",
        "pp": 2,
        "train": dict(MB, recompute_granularity="full", recompute_num_layers=1),
        "nproc": 2,
        "exact": True,
    },
    # Token-budget micro-batches (regrouped by length, shapes differ): another split.
    {
        "name": "pp2_token_budget",
        "pp": 2,
        "train": dict(MB, max_tokens_per_micro_batch=24),
        "nproc": 2,
    },
    {"name": "pp2_tp2", "pp": 2, "tp": 2, "train": MB, "nproc": 4},
    # PP2 x EP2 (data-parallel size 2), uneven shares of 3 groups and 1 (micro-batches of 6):
    # DP rank 1 runs a filler micro-batch through the schedule so the all-to-alls stay in step.
    {
        "name": "pp2_ep2_uneven",
        "pp": 2,
        "ep": 2,
        "shares": [slice(0, 12), slice(12, 16)],
        "train": {"micro_batch_size": 6},
        "nproc": 4,
    },
    # PP2 x DP2 with one data-parallel rank holding no sample (no EP: nothing to follow, its
    # pipeline runs no schedule at all).
    {
        "name": "pp2_dp2_empty_rank",
        "pp": 2,
        "shares": [slice(0, 16), slice(16, 16)],
        "train": MB,
        "nproc": 4,
        "exact": True,
    },
]


@pytest.fixture(scope="module")
def reference(megatron_world, tiny_checkpoint, tiny_hf_config):
    """The global batch and ONE single-rank rl_step on it (2 micro-batches)."""
    trainer = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(**TRAIN, micro_batch_size=16),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
    )
    samples = make_samples(trainer.routing_shape, tiny_hf_config["vocab_size"])
    attach_rollout_log_probs(trainer, samples)
    rewards = torch.tensor([float((i * 7) % 5 > 1) for i in range(len(samples))])
    advantages = compute_grpo_advantages(rewards, GROUP_SIZE)
    trainer.train_config = TrainConfig(**TRAIN, **MB)
    metrics = trainer.rl_step(
        samples, advantages, ObjectiveConfig(**OBJECTIVE), trainer_version=TRAINER_VERSION
    )
    weights, grads = hf_state(trainer)
    sft = trainer.sft_step(samples)  # then one supervised step (the warm start's)
    sft_weights = {name: t.detach().clone() for name, t in trainer.hf_tensors()}
    return {
        "sft": sft,
        "sft_weights": sft_weights,
        "samples": samples,
        "advantages": advantages,
        "metrics": metrics,
        "weights": weights,
        "grads": grads,
    }


def _launch(tmp_path_factory, reference, checkpoint, hf_config, nproc: int):
    tmp = tmp_path_factory.mktemp(f"pp_parallel_{nproc}")
    spec = {
        "checkpoint": str(checkpoint),
        "hf_config": hf_config,
        "pad_token_id": 0,
        "train": TRAIN,
        "samples": reference["samples"],
        "advantages": reference["advantages"],
        "objective": OBJECTIVE,
        "trainer_version": TRAINER_VERSION,
        "cases": [c for c in CASES if c["nproc"] == nproc],
    }
    (tmp / "spec.pkl").write_bytes(pickle.dumps(spec))
    start = time.perf_counter()
    run_torchrun(
        "tests/dist/pp_parallel.py",
        str(tmp / "spec.pkl"),
        str(tmp),
        done="PP_PARALLEL_DONE",
        timeout=900,
        nproc=nproc,
    )
    wall = time.perf_counter() - start
    print(f"\ntorchrun --nproc_per_node={nproc}: {wall:.1f} s")
    return torch.load(tmp / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory, reference, tiny_checkpoint, tiny_hf_config):
    """Every 2-rank and 4-rank case, each world size in one torchrun launch."""
    results = {}
    for nproc in sorted({c["nproc"] for c in CASES}):
        results.update(_launch(tmp_path_factory, reference, tiny_checkpoint, tiny_hf_config, nproc))
    return results


def _diffs(name: str, got: dict, reference: dict) -> dict[str, float]:
    metrics = got["layout"][0]["metrics"]
    out = {
        "loss": abs(metrics["loss"] - reference["metrics"]["loss"]),
        "metrics": max(abs(metrics[k] - v) for k, v in reference["metrics"].items()),
        "grads": max_abs_diff(got["grads"], reference["grads"]),
        "weights": max_abs_diff(got["weights"], reference["weights"]),
    }
    print(f"\n{name}: max |diff| vs PP1 {out}; seconds {got['layout'][0]['seconds']}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_pipeline_step_equals_single_rank(pp_run, reference, name):
    case = next(c for c in CASES if c["name"] == name)
    got = pp_run[name]
    layouts = got["layout"]
    sizes = (2, case.get("tp", 1), case.get("ep", 1), len(case.get("shares", [None])))
    assert [(r["pp"], r["tp"], r["ep"], r["dp"]) for r in layouts] == [sizes] * len(layouts)
    # Each stage holds and replays only its own layer (2 decoder layers, one per stage).
    assert {r["stage"]: r["replayed_layers"] for r in layouts} == {0: [1], 1: [2]}
    recompute = case["train"].get("recompute_granularity")
    for r in layouts:  # a recompute per micro-batch of the stage's layer, or none
        assert r["recompute_granularity"] == recompute
        assert r["recomputes"] == ({r["stage"] + 1: 2} if recompute else {}), r
    if "shares" in case:  # DP rank 0: 2 micro-batches; DP rank 1: 1 (+ 1 filler with EP2) or 0
        assert sorted({r["micro_batches"] for r in layouts}) == [1 if "ep" in case else 0, 2]
    # Every rank returns the last stage's metrics.
    assert all(r["metrics"] == layouts[0]["metrics"] for r in layouts)
    metrics, want = layouts[0]["metrics"], reference["metrics"]
    assert set(metrics) == set(want), set(metrics) ^ set(want)
    assert metrics["topk_match_r3"] == 1.0 and metrics["topk_match_live"] < 0.5
    diffs = _diffs(name, got, reference)
    assert max_abs(reference["grads"]) > 1e-2  # the step has gradients to compare
    # The acceptance bound, for every case. Measured: 0 at PP2 (with and without recompute),
    # grads 1.0e-7 / weights 3.6e-7 at PP2 x TP2, 9.2e-8 / 3.3e-7 with token-budget batches,
    # 4.7e-8 / 1.5e-7 at PP2 x EP2 (a wrong data-parallel loss scale doubles every gradient).
    assert diffs["grads"] <= 1e-6, diffs
    assert diffs["weights"] <= 1e-6, diffs
    if case.get("exact", False):
        # The same micro-batches through the same kernels: the schedule only moves the
        # activations between processes, so the loss is bitwise the PP1 loss. The metrics
        # differ by rounding only where a sum is taken in another order (measured: grad_norm
        # 6e-8 of 1.98, summed per stage; mismatch_abs_logratio_live 3e-8 of 0.75).
        assert metrics["loss"] == want["loss"], diffs
        for key, value in want.items():
            assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    else:
        # TP2 (vocab-parallel sums) or another split: fp32 rounding of other reductions, as
        # in tests/test_trainer_parallel.py (measured: loss 9.5e-8, metrics <= 3.5e-6 abs on
        # sat_c_minus_min = 0.333).
        assert diffs["loss"] <= 1e-6, diffs
        for key, value in want.items():
            assert metrics[key] == pytest.approx(value, rel=2e-5, abs=1e-6), key


@pytest.mark.slow
def test_pipeline_sft_step_equals_single_rank(pp_run, reference):
    got = pp_run["pp2"]
    sft = [r["sft"] for r in got["layout"]]
    assert all(s == sft[0] for s in sft)  # the last stage's loss on every stage
    # measured: loss bitwise equal, grad_norm 4e-8 relative, weights 6e-8 (fp32 rounding)
    assert sft[0]["loss"] == reference["sft"]["loss"]
    assert sft[0]["grad_norm"] == pytest.approx(reference["sft"]["grad_norm"], rel=1e-6)
    assert max_abs_diff(got["sft_weights"], reference["sft_weights"]) <= 1e-6
    assert max_abs_diff(reference["sft_weights"], reference["weights"]) > 1e-4  # it moved


@pytest.mark.slow
def test_pipeline_run_checkpoint_resumes_bit_exactly(pp_run):
    for rank in pp_run["pp2"]["layout"]:
        resume = rank["resume"]
        assert resume["step"] == 1
        assert resume["metrics_equal"] and resume["metric_keys"] > 20, resume
        assert resume["different"] == [] and resume["num_params"] > 5, resume


def test_pipeline_parallelism_needs_a_world_that_fits(megatron_world, tiny_hf_config):
    # One process cannot hold two stages: refused by the parallel set-up, naming the sizes.
    with pytest.raises(ValueError, match="world size 1 is not divisible by TP\\*CP\\*PP=2"):
        PolicyTrainer(
            tiny_hf_config,
            TrainConfig(**TRAIN, micro_batch_size=4),
            ParallelConfig(pipeline_model_parallel_size=2),
            pad_token_id=0,
            load_from=None,
        )


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory, tiny_checkpoint) -> Path:
    """The whole RL loop at PP2 (tests/dist/rl_parallel.py, 2 ranks): synchronous rollouts
    with a weight push after every step, the sharded reference policy, a run checkpoint."""
    import json

    from megatron_sat.rollout.arith import make_arith_splits

    tmp = tmp_path_factory.mktemp("rl_pp2")
    train, test = make_arith_splits(64, 8, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        f"init_checkpoint={tiny_checkpoint}",
        f"run_dir={tmp / 'pp2'}",
        f"data.train_path={tmp / 'train.jsonl'}",
        f"data.eval_path={tmp / 'test.jsonl'}",
        "data.num_eval_prompts=4",
        "rollout.prompts_per_step=3",
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "rollout.eval_samples_per_prompt=2",
        "rollout.temperature=1.0",
        "train.num_steps=3",
        "train.eval_every=3",
        "train.micro_batch_size=4",  # 3 micro-batches through the 1F1B schedule per step
        "train.lr=0.01",  # weights move visibly, so a stale or partial push would show
        "objective.kl_coef=0.001",
        "objective.entropy_coef=0.01",  # a gradient at every step whatever the rewards
        "parallel.pipeline_model_parallel_size=2",
    ]
    # The same run again with its server killed before the push after step 2 (the fleet
    # restarts it; every stage sender joins the new server's groups).
    restart = [o for o in overrides if not o.startswith("run_dir=")] + [
        f"run_dir={tmp / 'pp2_restart'}"
    ]
    run_torchrun(
        "tests/dist/rl_parallel.py",
        "pp2=" + ";".join(overrides),
        "pp2_restart=" + ";".join(restart),
        done="RL_PARALLEL_DONE",
        timeout=1200,
    )
    return tmp / "pp2"


@pytest.mark.slow
def test_rl_loop_at_pp2_pushes_every_stage(rl_run):
    """Each step's rollouts come from the weights the previous step pushed (interval 1), so the
    server-vs-trainer log-prob mismatch measures the push: a push missing the second stage's
    layer (or the output layer of the last stage) would show as a large mismatch."""
    import json

    rows = [json.loads(line) for line in (rl_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert row["train/num_seqs"] == 12
        assert row["train/topk_match_r3"] == 1.0
        assert row["train/mismatch_abs_logratio"] < 1e-4, row
    assert all(prev["train/grad_norm"] > 0.0 for prev in rows[1:-1])
    assert rows[1]["train/kl_loss"] == 0.0 and rows[-1]["train/kl_loss"] > 0.0
    print(
        f"\nPP2 RL loop: mismatch per step {[r['train/mismatch_abs_logratio'] for r in rows[1:]]}"
    )
    summary = json.loads((rl_run / "summary.json").read_text())
    assert summary["num_steps"] == 3 and (rl_run / "checkpoint" / "config.json").exists()


@pytest.mark.slow
def test_rl_loop_at_pp2_each_stage_sends_its_own_layers(rl_run):
    """The RL loop at PP2 pushes with one sender per stage
    (``stage_senders.uses_stage_senders``): rank 0 exports (and sends) stage 0's layers only
    and never gathers stage 1's; rank 1 exports stage 1's; together they are exactly the saved
    checkpoint's tensors, at every push (the initial one and one after each of the 3 steps).
    The parity test above shows they arrived."""
    import json

    from safetensors import safe_open

    got = [json.loads((rl_run / f"exports_rank{r}.json").read_text()) for r in (0, 1)]
    assert [g["gathered"] for g in got] == [0, 0]  # no gathered export on either rank
    assert [len(g["stage"]) for g in got] == [4, 4]
    stage0, stage1 = (set(g["stage"][0]) for g in got)
    for g, names in zip(got, (stage0, stage1), strict=True):
        assert all(set(push) == names for push in g["stage"])
    saved = set()
    for path in (rl_run / "checkpoint").glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            saved |= set(f.keys())
    assert not stage0 & stage1 and stage0 | stage1 == saved
    # The tiny model has 2 layers (one per stage), untied embeddings.
    assert "model.embed_tokens.weight" in stage0 and "lm_head.weight" in stage1
    assert "model.norm.weight" in stage1
    assert {n.split(".")[2] for n in stage0 if n.startswith("model.layers.")} == {"0"}
    assert {n.split(".")[2] for n in stage1 if n.startswith("model.layers.")} == {"1"}
    print(f"\nPP2 push: rank 0 exported {len(stage0)} tensors, rank 1 {len(stage1)}")


@pytest.mark.slow
def test_rl_loop_at_pp2_stage_senders_rejoin_a_restarted_server(rl_run):
    """The server is killed before the push after step 2: the fleet restarts it and regroups,
    and every stage sender connects to the new server (its own group) and sends its layers.
    The new server loaded the initial checkpoint, so a stage that did not send would leave
    step 3's rollouts on step-0 weights for its layers: a mismatch far above 1e-4 (lr 0.01)."""
    import json

    run = rl_run.parent / "pp2_restart"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["rollout/server_restarts"] for r in rows[1:]] == [0.0, 1.0, 1.0]
    assert rows[-1]["rollout/dead_servers"] == 0.0
    for row in rows[1:]:
        assert row["train/mismatch_abs_logratio"] < 1e-4, row
    got = [json.loads((run / f"exports_rank{r}.json").read_text()) for r in (0, 1)]
    assert [g["gathered"] for g in got] == [0, 0]
    assert [len(g["stage"]) for g in got] == [4, 4]  # one export per push, none retried
    mismatch = [r["train/mismatch_abs_logratio"] for r in rows[1:]]
    print(f"\nPP2 restart: mismatch per step {mismatch}")
