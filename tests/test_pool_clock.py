"""Bounded mode on the logical clock (``AsyncPoolConfig.clock_tokens``): a schedule worked
out by hand, runs that repeat bit for bit whatever the servers' latencies, and a pool that
resumes from its checkpointed state exactly as the uninterrupted one goes on."""

from __future__ import annotations

import io
import random
import time
from dataclasses import asdict

import pytest
import torch
from test_async_pool import CharTokenizer, records

from megatron_sat.config import RolloutConfig
from megatron_sat.rollout.async_pool import AsyncPoolConfig, AsyncRolloutPool, check_pool_state
from megatron_sat.rollout.client import GenerateOutput, SamplingParams


class ClockFake:
    """A server that generates exactly ``max_new_tokens`` tokens per request (no EOS): token
    ``i`` of a request depends on its seed and position only, its log-prob also on the size
    of the batch it came in and on the server (a batch-variant engine, as the embedded one),
    so a changed round shape shows. Weights carry ``holder["version"]``; answers come after a
    random delay."""

    def __init__(self, name: str, holder: dict, rng: random.Random) -> None:
        self.base_url = f"fake://{name}"
        self.name, self.holder, self.rng = name, holder, rng
        self.batches: list[int] = []  # requests per /generate, in order

    def generate(self, input_ids, sampling, routing=None):
        version = self.holder["version"]
        time.sleep(self.rng.uniform(0.0, 0.005))
        self.batches.append(len(input_ids))
        outs = []
        for ids, params in zip(input_ids, sampling, strict=True):
            n = params.max_new_tokens
            tokens = [48 + (params.sampling_seed + len(ids) + i) % 10 for i in range(n)]
            logprob = -0.01 * len(input_ids) - (0.5 if self.name == "b" else 0.0)
            outs.append(
                GenerateOutput(
                    output_ids=tokens,
                    output_token_logprobs=[logprob] * n,
                    finish_reason="length",
                    weight_version=str(version),
                    routed_experts=None,
                    prompt_tokens=len(ids),
                    completion_tokens=n,
                )
            )
        return outs


def clock_pool(clients, *, prompts_per_batch=1, group_size=1, lag=1, clock_tokens=1, skip=0):
    prompts = records()
    for _ in range(skip):
        next(prompts)
    return AsyncRolloutPool(
        clients,
        CharTokenizer(),
        lambda text, label: float(len(text) % 3),
        prompts,
        AsyncPoolConfig(
            mode="bounded",
            lag=lag,
            prompts_per_batch=prompts_per_batch,
            group_size=group_size,
            clock_tokens=clock_tokens,
        ),
        SamplingParams(max_new_tokens=2),
        seed_of=lambda b, drawn, slot: 1000 * b + 10 * drawn + slot,
    )


def run_steps(pool, holder, steps: int, batch: int = 0, version: int = 0, saves=None):
    """The RL loop's calls from the pool's batch ``batch`` on, the servers at ``version``:
    take the batch, wait for the pause, push the next version, export the pool's state when
    ``saves`` (a dict) asks for it at this next batch, set_version. The samples, as dicts."""
    out = []
    for k in range(steps):
        out += [asdict(s) for s in pool.get_batch(batch + k, timeout_s=30)]
        pool.wait_before_update(batch + k + 1, timeout_s=30)
        holder["version"] = version + k + 1
        if saves is not None and batch + k + 1 in saves:
            saves[batch + k + 1] = pool.export_state(batch + k + 1)
        pool.set_version(batch + k + 1)
    return out


def test_the_clock_follows_the_schedule_worked_out_by_hand():
    """One server, one sample per batch, two tokens per sample, rounds of one token, lag 1.
    Version 0 admits batches 0 and 1; two rounds finish both (nothing is left for an
    overlap round). Version 1 admits batch 2, which its overlap round starts (a token of
    version 1). Version 2 admits batch 3: a round finishes batch 2 (a token of version 2) and
    starts batch 3, the overlap round finishes it. Version 3 starts batch 4, and so on."""
    holder = {"version": 0}
    server = ClockFake("a", holder, random.Random(0))
    pool = clock_pool([server])
    pool.start()
    try:
        got = run_steps(pool, holder, 4)
    finally:
        pool.stop()
    assert [s["response_versions"] for s in got] == [[0, 0], [0, 0], [1, 2], [2, 2]]
    # Requests per round, up to version 3's pause (version 4's may have begun since).
    assert server.batches[:6] == [2, 2, 1, 2, 1, 1]
    assert pool.stats.resumed == 2  # batch 2's request at version 2, batch 4's at 4
    assert [s["response_ids"] for s in got][0] == [48 + (0 + 4 + i) % 10 for i in range(2)]


def _two_server_run(latency_seed: int, steps: int):
    holder = {"version": 0}
    servers = [ClockFake(n, holder, random.Random(latency_seed + i)) for i, n in enumerate("ab")]
    pool = clock_pool(servers, prompts_per_batch=2, group_size=3, lag=2, clock_tokens=1)
    pool.start()
    try:
        got = run_steps(pool, holder, steps)
    finally:
        pool.stop()
    return got, [s.batches for s in servers], pool


def test_bounded_runs_on_the_clock_repeat_whatever_the_latencies():
    """Two servers with other random latencies each run: the same samples bit for bit (the
    log-probs also say which server and batch size made each token), the same requests per
    server, and samples of mixed versions, no older than the bound."""
    a, batches_a, pool = _two_server_run(0, 6)
    b, batches_b, _ = _two_server_run(100, 6)
    assert a == b and batches_a == batches_b
    ages = [k - min(s["response_versions"]) for k in range(6) for s in a[6 * k : 6 * k + 6]]
    assert max(ages) <= 2
    assert any(len(set(s["response_versions"])) == 2 for s in a)
    assert {lp for s in a for lp in s["rollout_log_probs"]} >= {-0.06, -0.56}  # both servers
    assert pool.stats.resumed > 0


def test_a_pool_restored_from_its_checkpoint_goes_on_as_the_uninterrupted_one():
    """The state exported at the pause of version 2, after the push of 3 and before
    set_version(3) (the RL loop's order), saved as the run checkpoint stores it, restored into
    a fresh pool: the following batches equal the uninterrupted pool's, bit for bit. So does
    a state exported after set_version(3) (at the pause of version 3)."""
    holder = {"version": 0}
    shape = {"prompts_per_batch": 2, "group_size": 2, "lag": 2, "clock_tokens": 1}
    a = clock_pool([ClockFake("a", holder, random.Random(1))], **shape)
    a.start()
    saves = {3: None}
    run_steps(a, holder, 3, saves=saves)
    after = a.export_state(3)
    buffer = io.BytesIO()
    torch.save(saves[3], buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert saved["overlap_left"] == 0 and saved["version"] == -1  # version 2's pause
    assert any(j["response_ids"] for j in saved["queue"])  # cut by the overlap round
    assert after["overlap_left"] == 0 and after["version"] == 0  # version 3's pause
    later_a = run_steps(a, holder, 4, batch=3, version=3)  # the uninterrupted pool's 3..6
    a.stop()

    for state in (saved, after):
        holder_b = {"version": 3}
        b = clock_pool([ClockFake("a", holder_b, random.Random(2))], skip=state["drawn"], **shape)
        b.restore_state(state)
        b.start()
        # The resumed pool counts batches from the checkpoint: its 0..3 are a's 3..6.
        later_b = run_steps(b, holder_b, 4, version=3)
        b.stop()
        assert later_b == later_a
    # Batches 3..6 hold tokens of versions 1..5: up to the bound (lag 2) old.
    assert {v for s in later_a for v in s["response_versions"]} == {1, 2, 3, 4, 5}


def test_the_clock_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="clock_tokens=2 applies to mode='bounded'"):
        AsyncPoolConfig(mode="fixed_lag", clock_tokens=2)
    with pytest.raises(ValueError, match="needs dispatch='per_server'"):
        AsyncPoolConfig(mode="bounded", clock_tokens=2, dispatch="per_request")
    with pytest.raises(ValueError, match="must be >= 0"):
        AsyncPoolConfig(mode="bounded", clock_tokens=-1)
    with pytest.raises(ValueError, match="needs a sampling_seed per request: pass seed_of"):
        AsyncRolloutPool(
            [ClockFake("a", {"version": 0}, random.Random(0))],
            CharTokenizer(),
            lambda text, label: 0.0,
            records(),
            AsyncPoolConfig(mode="bounded", clock_tokens=1),
            SamplingParams(max_new_tokens=2),
        )
    with pytest.raises(ValueError, match="rollout.clock_tokens must be >= 0 and applies to mode"):
        RolloutConfig(mode="fixed_lag", clock_tokens=4)


@pytest.mark.parametrize(
    ("saved", "here", "message"),
    [
        ({"clock_tokens": 0}, {}, "rollout.clock_tokens=0 in the checkpoint, 1 here"),
        ({"lag": 2}, {}, "rollout.lag=2 in the checkpoint, 1 here"),  # ages would pass lag
        ({}, {"group_size": 2}, "rollout.group_size=1 in the checkpoint, 2 here"),
        ({"prompts_per_batch": 3}, {}, "rollout.prompts_per_step=3 in the checkpoint, 1 here"),
    ],
)
def test_a_pool_state_of_another_shape_is_refused_naming_the_field(saved, here, message):
    """Found by review: a bounded checkpoint resumed with a smaller lag gave ages of 2 at lag
    1, and one of another group size returned groups the advantages would split."""
    state = clock_pool([ClockFake("a", {"version": 0}, random.Random(0))], **saved).export_state(0)
    pool = clock_pool([ClockFake("a", {"version": 0}, random.Random(0))], **here)
    with pytest.raises(ValueError, match=f"made with another shape \\({message}\\)"):
        check_pool_state(state, pool.config)
    with pytest.raises(ValueError, match=message):
        pool.restore_state(state)
    fixed = AsyncPoolConfig(mode="fixed_lag", lag=1, prompts_per_batch=1, group_size=1)
    with pytest.raises(ValueError, match="rollout.mode='bounded' in the checkpoint"):
        check_pool_state(state, fixed)
