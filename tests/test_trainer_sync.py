"""Trainer -> rollout server: after a weight sync the server's log-probs equal the Megatron
trainer's; an RL step on real rollouts moves the policy; the main loop end to end."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_sat.config import ParallelConfig, TrainConfig, load_config
from megatron_sat.objectives import ObjectiveConfig, compute_grpo_advantages
from megatron_sat.rollout.arith import make_arith_splits
from megatron_sat.rollout.client import RoutingSpec, SamplingParams, SGLangClient
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.embedded.launch import EmbeddedServer
from megatron_sat.rollout.pool import RolloutPool
from megatron_sat.training.batching import build_micro_batch
from megatron_sat.training.logprobs import forward_log_probs
from megatron_sat.training.trainer import PolicyTrainer
from megatron_sat.weight_sync.broadcast import WeightUpdater

PROMPTS = [
    PromptRecord(prompt=p, label=str(eval(p[:-1])), source_index=i)
    for i, p in enumerate(["12+7=", "3-9=", "45+45=", "8+1="])
]


@pytest.fixture(scope="module")
def setup(megatron_world, tiny_checkpoint, tiny_hf_config):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    trainer = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(lr=1e-2, micro_batch_size=8),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
    )
    with EmbeddedServer(tiny_checkpoint, random_seed=0, max_running_requests=32) as server:
        client = server.client()
        updater = WeightUpdater([client], bucket_bytes=64 * 1024)
        updater.connect()
        pool = RolloutPool(
            [client],
            tokenizer,
            lambda text, label: float(label in text),
            routing=RoutingSpec(*trainer.routing_shape),
            stop_token_ids=[tokenizer.eos_token_id],
        )
        yield trainer, client, updater, pool
        pool.close()
        updater.close()


def _server_vs_trainer_gap(trainer, pool) -> float:
    samples = pool.generate_groups(PROMPTS, 2, temperature=1.0, max_new_tokens=6)
    mb = build_micro_batch(samples, [0.0] * len(samples), pad_token_id=0)
    with torch.no_grad():
        log_probs = forward_log_probs(trainer.model, mb)
    return float(((log_probs - mb.rollout_log_probs).abs() * mb.loss_mask).max())


def test_server_matches_trainer_after_sync_and_rl_step(setup):
    trainer, client, updater, pool = setup
    updater.update(trainer.hf_tensors(), weight_version="0")
    assert client.get_weight_version() == "0"
    assert _server_vs_trainer_gap(trainer, pool) <= 1e-4

    samples = pool.generate_groups(PROMPTS, 4, temperature=1.0, max_new_tokens=6)
    assert all(s.response_versions == [0] * len(s.response_ids) for s in samples)
    rewards = torch.tensor([float(i % 2) for i in range(len(samples))])  # varied groups
    metrics = trainer.rl_step(
        samples, compute_grpo_advantages(rewards, 4), ObjectiveConfig(name="sat-gspo")
    )
    assert metrics["grad_norm"] > 0
    assert metrics["topk_match_r3"] == 1.0
    # The trainer moved; the server still holds version 0 until the sync.
    assert _server_vs_trainer_gap(trainer, pool) > 1e-3
    updater.update(trainer.hf_tensors(), weight_version="1")
    assert client.get_weight_version() == "1"
    assert _server_vs_trainer_gap(trainer, pool) <= 1e-4
    samples = pool.generate_groups(PROMPTS[:1], 2, temperature=1.0, max_new_tokens=4)
    assert {v for s in samples for v in s.response_versions} == {1}


def test_greedy_sampling_is_deterministic(setup):
    _, client, _, _ = setup
    a = client.generate([[10, 11, 12]], SamplingParams(temperature=0.0, max_new_tokens=5))
    b = client.generate([[10, 11, 12]], SamplingParams(temperature=0.0, max_new_tokens=5))
    assert a[0].output_ids == b[0].output_ids


def test_main_loop_end_to_end(tmp_path, tiny_checkpoint, megatron_world):
    from megatron_sat.training.rl import run_rl

    train, test = make_arith_splits(64, 8, seed=0, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        f"init_checkpoint={tiny_checkpoint}",
        f"run_dir={tmp_path / 'run'}",
        f"data.train_path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'test.jsonl'}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "rollout.eval_samples_per_prompt=2",
        "train.eval_every=1",
        "train.micro_batch_size=8",  # two micro-batches: SAT's q over the whole batch
        "train.num_steps=2",
    ]
    summary = run_rl(load_config(None, overrides))
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "train/sat_q",
        "train/sat_gate_rate",
        "train/mismatch_abs_logratio",
        "train/topk_match_r3",
        "train/topk_match_live",
        "train/clipfrac_high",
        "rollout/reward",
        "eval/acc_greedy",
    ):
        assert key in rows[2], key
    assert rows[2]["train/topk_match_r3"] == 1.0
    assert json.loads((run / "summary.json").read_text()) == summary
    assert (summary["rollout_mode"], summary["lag"]) == ("sync", None)
    assert summary["acc_greedy"]["warm_start"] == rows[0]["eval/acc_greedy"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "checkpoint")

    # Resume: the run checkpoint after step 2 continues to step 3 with the saved data position.
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002"]
    resumed = load_config(None, [*overrides[:-1], "train.num_steps=3", "train.resume=true"])
    summary = run_rl(resumed)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert summary["acc_greedy"]["warm_start"] == rows[0]["eval/acc_greedy"]
    # Killed after its last run checkpoint (step 3), before the HF export and the summary:
    # the resume writes both, equal to the uninterrupted run's (timing aside).
    weights = (run / "checkpoint" / "model.safetensors").read_bytes()
    shutil.rmtree(run / "checkpoint")
    (run / "summary.json").unlink()
    finished = run_rl(resumed)
    assert (run / "checkpoint" / "model.safetensors").read_bytes() == weights
    assert {k: v for k, v in finished.items() if k != "wall_time_s"} == {
        k: v for k, v in summary.items() if k != "wall_time_s"
    }
    assert json.loads((run / "summary.json").read_text()) == finished
    rows_after = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows_after == rows
    with pytest.raises(ValueError, match="nothing to resume"):
        run_rl(resumed)


def test_main_loop_with_fixed_lag(tmp_path, tiny_checkpoint, megatron_world):
    """The asynchronous pool inside the RL loop: after warm-up every sample is `lag` old."""
    from megatron_sat.training.rl import run_rl

    train, test = make_arith_splits(64, 4, seed=1, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_rl(
        load_config(
            None,
            [
                f"init_checkpoint={tiny_checkpoint}",
                f"run_dir={tmp_path / 'run'}",
                f"data.train_path={tmp_path / 'train.jsonl'}",
                f"data.eval_path={tmp_path / 'test.jsonl'}",
                "rollout.prompts_per_step=2",
                "rollout.group_size=2",
                "rollout.max_new_tokens=3",
                "rollout.eval_samples_per_prompt=1",
                "rollout.mode=fixed_lag",
                "rollout.lag=2",
                "train.num_steps=4",
                "train.eval_every=4",
            ],
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    ages = [(r["rollout/staleness_mean"], r["rollout/staleness_max"]) for r in rows[1:]]
    assert ages == [(0.0, 0.0), (1.0, 1.0), (2.0, 2.0), (2.0, 2.0)]
    assert rows[-1]["rollout/staleness_frac_age2"] == 1.0
    assert (summary["rollout_mode"], summary["lag"]) == ("fixed_lag", 2)
    with pytest.raises(ValueError, match="update_weights_interval applies to mode=sync"):
        load_config(None, ["rollout.mode=bounded", "rollout.update_weights_interval=2"])


class _DtypeRecordingClient(SGLangClient):
    """Records the dtypes of every ``/update_weights_from_distributed`` request it sends."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: dict[str, str] = {}

    def update_weights_from_distributed(self, names, dtypes, shapes, **kwargs):
        self.sent.update(zip(names, dtypes, strict=True))
        return super().update_weights_from_distributed(names, dtypes, shapes, **kwargs)


# A bf16 trainer's forward (bf16 matmuls) vs the fp32 server's on the same bf16 weights: the
# rounding of bf16 activations over 2 layers, measured here: max 0.01-0.02 nats per token
# (test_bf16_trainer.py measures 0.031 max for 4 layers).
BF16_PUSH_MAX_GAP = 0.05


def test_bf16_trainer_pushes_bf16_and_the_server_matches(
    megatron_world, tiny_checkpoint, tiny_hf_config
):
    """train.params_dtype=bf16: the push sends bf16 on the wire (routers and norms stay fp32),
    about half the bytes of fp32; the bytes arrive intact (bitwise: the server's log-probs
    equal those after pushing the same values as fp32); the server's log-probs then match the
    trainer's within bf16 rounding of the trainer's activations."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    trainer = PolicyTrainer(
        tiny_hf_config,
        TrainConfig(params_dtype="bf16", micro_batch_size=8),
        ParallelConfig(),
        pad_token_id=0,
        load_from=tiny_checkpoint,
    )
    tensors = [(name, t.detach().clone()) for name, t in trainer.hf_tensors()]
    # The wire carries the trainer's own dtypes: bf16 matrices and embeddings; the router in
    # fp32 (as the trainer keeps it); the norms, which megatron-core keeps in fp32, too.
    dtypes = {n: t.dtype for n, t in tensors}
    matrices = [n for n in dtypes if n.endswith(("_proj.weight", "embed_tokens.weight"))]
    assert len(matrices) > len(dtypes) // 2
    assert {dtypes[n] for n in matrices} == {torch.bfloat16}
    routers = [n for n in dtypes if n.endswith("mlp.gate.weight")]
    assert routers and {dtypes[n] for n in routers} == {torch.float32}

    def seeded(i: int, j: int) -> int:
        return 100 * i + j

    with EmbeddedServer(tiny_checkpoint, random_seed=0, max_running_requests=32) as server:
        client = _DtypeRecordingClient(server.url, keys=server.config.keys)
        pool = RolloutPool(
            [client],
            tokenizer,
            lambda text, label: 0.0,
            routing=RoutingSpec(*trainer.routing_shape),
            stop_token_ids=[tokenizer.eos_token_id],
        )
        with WeightUpdater([client], bucket_bytes=64 * 1024) as updater:
            stats = updater.update(tensors, weight_version="1")  # bf16
            assert client.sent == {n: str(t.dtype).removeprefix("torch.") for n, t in tensors}
            fp32_bytes = sum(t.numel() * 4 for _, t in tensors)
            assert stats.num_bytes == sum(t.numel() * t.element_size() for _, t in tensors)
            assert stats.num_bytes < 0.55 * fp32_bytes
            bf16_samples = pool.generate_groups(
                PROMPTS, 2, temperature=1.0, max_new_tokens=6, seed_of=seeded
            )
            updater.update([(n, t.float()) for n, t in tensors], weight_version="2")
            fp32_samples = pool.generate_groups(
                PROMPTS, 2, temperature=1.0, max_new_tokens=6, seed_of=seeded
            )
        pool.close()
    for a, b in zip(bf16_samples, fp32_samples, strict=True):
        assert a.response_ids == b.response_ids
        assert a.rollout_log_probs == b.rollout_log_probs  # bitwise: the same weights arrived
    mb = build_micro_batch(bf16_samples, [0.0] * len(bf16_samples), pad_token_id=0)
    with torch.no_grad():
        log_probs = forward_log_probs(trainer.model, mb)
    gap = ((log_probs.float() - mb.rollout_log_probs).abs() * mb.loss_mask).max()
    assert 0 < float(gap) <= BF16_PUSH_MAX_GAP, float(gap)
