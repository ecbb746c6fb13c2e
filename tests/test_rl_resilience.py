"""The RL loop survives a dead embedded server: it is restarted and re-synced at the next push,
serves again, the fixed lag stays exact, and the per-server metrics are logged every step."""

from __future__ import annotations

import dataclasses
import json

from megatron_sat.config import load_config
from megatron_sat.rollout.arith import make_arith_splits
from megatron_sat.rollout.client import SGLangClient
from megatron_sat.rollout.engines import ENGINES
from megatron_sat.rollout.fleet import RolloutFleet


class ProbeClient(SGLangClient):
    """Records its server's weight_version at its first /generate; with ``kill_on_call`` = n,
    kills its server as call n arrives (the server dies with that request in flight)."""

    def __init__(self, server, kill_on_call=None):
        super().__init__(
            server.url,
            timeout_s=120,
            max_retries=1,
            retry_backoff_s=0.1,
            keys=server.config.keys,  # the keys the run generated for its embedded servers
        )
        self.server, self.kill_on_call = server, kill_on_call
        self.calls = 0
        self.version_at_first_generate = None

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            self.version_at_first_generate = self.get_weight_version()
        if self.calls == self.kill_on_call:
            self.server.process.kill()
            self.server.process.wait()
        return super().generate(*args, **kwargs)


def test_rl_loop_restarts_a_dead_embedded_server(
    tmp_path, tiny_checkpoint, megatron_world, monkeypatch
):
    import megatron_sat.training.rl as rl

    made: list[tuple[int, ProbeClient]] = []
    pushes = []

    def factory(server):
        slot = server.config.random_seed - 7  # train.seed below
        first_of_slot1 = slot == 1 and not any(s == 1 for s, _ in made)
        # Calls 1 and 2 are the initial evaluation; call 3 is the async pool's first request.
        client = ProbeClient(server, kill_on_call=3 if first_of_slot1 else None)
        made.append((slot, client))
        return client

    class Fleet(RolloutFleet):
        @classmethod
        def embedded(cls, *args, **kwargs):
            return super().embedded(*args, client_factory=factory, **kwargs)

        def push(self, named_tensors, version, *, dead=()):
            report = super().push(named_tensors, version, dead=dead)
            pushes.append((version, report))
            return report

    # The run builds its fleet from the engine registry (rollout.engines.ENGINES).
    monkeypatch.setitem(ENGINES, "sglang", dataclasses.replace(ENGINES["sglang"], fleet=Fleet))
    train, test = make_arith_splits(64, 4, seed=1, max_digits=1)
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rl.run_rl(
        load_config(
            None,
            [
                f"init_checkpoint={tiny_checkpoint}",
                f"run_dir={tmp_path / 'run'}",
                f"data.train_path={tmp_path / 'train.jsonl'}",
                f"data.eval_path={tmp_path / 'test.jsonl'}",
                "rollout.num_embedded_servers=2",
                "rollout.prompts_per_step=2",
                "rollout.group_size=2",
                "rollout.max_new_tokens=3",
                "rollout.eval_samples_per_prompt=1",
                "rollout.mode=fixed_lag",
                "rollout.lag=2",
                "train.seed=7",
                "train.num_steps=4",
                "train.eval_every=4",
            ],
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    restarts = [(v, r) for v, r in pushes if r.restarted]
    assert [r.restarted for _, r in restarts] == [(1,)]
    restart_version = restarts[0][0]
    # Server 1 dies at the first push after the step it was killed in, step 1 (version 1):
    # the async pool starts right after the initial evaluation with batches 0-2 queued
    # (b - lag <= 0: 12 samples); each of the two per_server workers takes its share (12 // 2
    # and 8 // 2, capped at one batch: 4 samples) at once, so slot 1's first request (call 3,
    # the kill) goes out while slot 0 is still on its first request, long before
    # wait_before_update(1) lets the push of version 1 run (it needs batches 0-2 complete);
    # that push's health probe finds the exited process (the pool also reported the slot).
    assert restart_version == 1
    assert [v for v, _ in pushes] == [0, 1, 2, 3, 4]  # the initial sync, then one per step
    new = [c for s, c in made[2:] if s == 1]
    assert len(new) == 1
    # Re-synced before its first request, a share of batch 3 (admitted at version 1, complete
    # before version 2 is pushed); then it served the last evaluation's greedy and sampled
    # requests (split over both servers): 3 calls at least.
    assert new[0].version_at_first_generate == str(restart_version)
    assert new[0].calls >= 3
    last = rows[-1]
    assert [r["rollout/server_restarts"] for r in rows[1:]] == [1.0] * 4
    assert [r["rollout/dead_servers"] for r in rows[1:]] == [0.0] * 4
    # The killed request's share (4 samples, see above) re-issued on server 0; nothing else.
    assert [r["rollout/reissued"] for r in rows[1:]] == [4.0] * 4
    assert rows[restart_version]["time/restart_s"] > 0
    assert last["rollout/server1/samples_per_s"] > 0
    for row in rows[1:]:
        for i in (0, 1):
            assert 0.0 <= row[f"rollout/server{i}/utilisation"] <= 1.0
    ages = [(r["rollout/staleness_mean"], r["rollout/staleness_max"]) for r in rows[1:]]
    assert ages == [(0.0, 0.0), (1.0, 1.0), (2.0, 2.0), (2.0, 2.0)]
