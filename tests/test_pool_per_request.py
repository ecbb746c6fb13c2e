"""Per-request rollouts: a long response holds only itself; rewards scored concurrently with
math-verify's timeouts; the batch comes back in (prompt, sample) order whatever the arrival."""

from __future__ import annotations

import threading
import time

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from megatron_sat.rollout.client import RoutingSpec
from megatron_sat.rollout.datasets import PromptRecord
from megatron_sat.rollout.embedded.launch import EmbeddedServer
from megatron_sat.rollout.pool import RolloutPool
from megatron_sat.rollout.rewards import RewardWorkers
from megatron_sat.weight_sync.broadcast import WeightUpdater

LONG, SHORT = 60, 2  # max_new_tokens; greedy decoding of the tiny model never stops early


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    norm = load_file(tiny_checkpoint / "model.safetensors")["model.norm.weight"]
    with EmbeddedServer(tiny_checkpoint, random_seed=0, max_running_requests=64) as server:
        client = server.client()
        with WeightUpdater([client]) as updater:  # an integer weight_version for the pool
            updater.update([("model.norm.weight", norm)], weight_version="3")
        yield client


def _pool(client, tiny_checkpoint, hf_config, **options):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    routing = RoutingSpec(
        hf_config["num_hidden_layers"], hf_config["num_experts_per_tok"], num_experts=8
    )
    return RolloutPool(
        [client], tokenizer, lambda text, label: float(len(text)), routing=routing, **options
    )


@pytest.mark.slow
def test_short_requests_are_consumed_before_the_long_one_finishes(
    served, tiny_checkpoint, tiny_hf_config
):
    pool = _pool(served, tiny_checkpoint, tiny_hf_config, dispatch="per_request")
    records = [PromptRecord(f"{i}+1=", str(i + 1), source_index=i) for i in range(6)]
    limits = [SHORT, SHORT, LONG, SHORT, SHORT, SHORT]  # the long one is record 2
    group_size = 2
    # Paused (retract) the server queues what arrives; once every request is there, one
    # batch holds them all, so the short ones can only come back first if each request is
    # answered when it finishes and the pool takes each as it arrives.
    served.pause_generation("retract")
    out: list = []

    def generate() -> None:
        try:
            out.append(
                pool.generate_groups(records, group_size, temperature=0.0, max_new_tokens=limits)
            )
        except BaseException as e:  # shown by the assertion below
            out.append(e)

    worker = threading.Thread(target=generate)
    worker.start()
    deadline = time.monotonic() + 60
    while pool.meter._in_flight[0] < len(records) * group_size and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # the last requests reach the server's queue
    served.continue_generation()
    worker.join(timeout=600)
    pool.close()
    (samples,) = out
    assert isinstance(samples, list), samples
    long_ids = {2 * group_size, 2 * group_size + 1}
    order = pool.last_arrival_order
    assert sorted(order) == list(range(len(records) * group_size))
    assert set(order[-2:]) == long_ids  # every short one was consumed before a long one
    # Returned in (prompt, sample) order, not arrival order; the long ones complete.
    assert [(s.prompt, s.group_index) for s in samples] == [
        (r.prompt, samples[0].group_index + g) for g, r in enumerate(records) for _ in range(2)
    ]
    lengths = [len(s.response_ids) for s in samples]
    assert lengths == [LONG if i in long_ids else SHORT for i in range(len(samples))]
    for s in samples:
        assert s.finish_reason == "length" and s.response_versions == [3] * len(s.response_ids)
        assert len(s.rollout_log_probs) == len(s.response_ids)
        assert s.routed_experts.shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1
        assert s.reward == float(len(s.response_text))
    # Greedy: the two long samples of one prompt are the same tokens.
    assert samples[4].response_ids == samples[5].response_ids


@pytest.mark.slow
def test_per_request_and_per_server_give_the_same_samples(served, tiny_checkpoint, tiny_hf_config):
    """Seeded requests: dispatch changes neither the tokens nor the order of the batch."""
    records = [PromptRecord(f"{i}-2=", str(i - 2), source_index=i) for i in range(4)]
    batches = {}
    for dispatch in ("per_request", "per_server"):
        pool = _pool(served, tiny_checkpoint, tiny_hf_config, dispatch=dispatch)
        batches[dispatch] = pool.generate_groups(
            records, 3, temperature=1.0, max_new_tokens=6, seed_of=lambda g, k: 1000 * g + k
        )
        pool.close()
    a, b = batches["per_request"], batches["per_server"]
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.prompt for s in a] == [r.prompt for r in records for _ in range(3)]
    assert len({tuple(s.response_ids) for s in a}) > 1  # the seeds do differ


def test_reward_workers_score_concurrently_with_timeouts():
    """In worker processes math-verify's timeouts work: the adversarial answer that ran for
    minutes without them (rollout.rewards) scores 0.0 within its timeout (2 s)."""
    with RewardWorkers(num_workers=2, timeout_s=2) as workers:
        start = time.monotonic()
        futures = [
            workers.submit("so \\boxed{10^{10^{10^{10}}}}", "82"),
            workers.submit("\\boxed{82}", "82"),
            workers.submit("\\boxed{\\frac{164}{2}}", "82"),
            workers.submit("\\boxed{81}", "82"),
        ]
        assert [f.result(timeout=120) for f in futures] == [0.0, 1.0, 1.0, 0.0]
        assert time.monotonic() - start < 60
        assert workers("\\boxed{-8}", "-8") == 1.0
    with pytest.raises(ValueError, match="timeout_s"):
        RewardWorkers(timeout_s=0)


def test_reward_workers_survive_a_killed_worker(capfd):
    """A SIGKILLed worker (the OOM killer) breaks a ProcessPoolExecutor for good and fails
    every pending task (found by review: one kill ended the RL run): the pool is replaced,
    said on stderr and counted (the run logs ``rollout/reward_worker_restarts``), and the
    pending pair scored again; later pairs score as before."""
    import os
    import signal

    with RewardWorkers(num_workers=1, timeout_s=2) as workers:
        pending = workers.submit("so \\boxed{10^{10^{10^{10}}}}", "82")  # runs into its 2 s
        time.sleep(0.5)
        for pid in list(workers._executor._processes):
            os.kill(pid, signal.SIGKILL)
        assert pending.result(timeout=120) == 0.0
        assert workers.restarts == 1
        assert "reward workers: a worker died" in capfd.readouterr().err
        assert workers("\\boxed{82}", "82") == 1.0
        with pytest.raises(ValueError):
            workers("\\boxed{82}", "")  # math_reward's own error still reaches the caller
