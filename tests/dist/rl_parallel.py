"""The whole RL loop (``run_rl``) at TP2 (sequence parallel) and at EP2 on 2 gloo ranks.

argv: one ``name=override;override;...`` per run. Each run is a fresh trainer
(megatron-core's parallel state is destroyed in between); rank 0 prints ``RL_PARALLEL_DONE``
at the end. The pytest side (tests/test_rl_parallel.py) reads the run directories.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch.distributed as dist


def main(argv: list[str]) -> None:
    from megatron.core import parallel_state

    from megatron_sat.config import load_config
    from megatron_sat.training import rl
    from megatron_sat.config import ParallelConfig
    from megatron_sat.platform.distributed import init_distributed

    # The tiny random model never writes a boxed answer, so math rewards would all be 0, the
    # advantages 0 and the weights would never move. A reward that varies within each group
    # (odd response length in characters) gives a real policy gradient.
    rl.math_reward = lambda response, label: float(len(response) % 2)
    init_distributed(ParallelConfig())  # the world and the CPU shims
    exports = record_exports()
    for run in argv:
        name, _, overrides = run.partition("=")
        parallel_state.destroy_model_parallel()
        cfg = load_config(None, overrides.split(";"))
        exports.update(stage=[], gathered=0)
        with kill_server_before_push(2 if name.endswith("_restart") else None):
            summary = rl.run_rl(cfg)
        # What this rank exported for the weight pushes (the pytest side checks who sent what).
        out = Path(cfg.run_dir) / f"exports_rank{dist.get_rank()}.json"
        out.write_text(json.dumps(exports))
        if dist.get_rank() == 0:
            print(f"{name}: {summary['wall_time_s']} s", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        print("RL_PARALLEL_DONE", flush=True)


@contextlib.contextmanager
def kill_server_before_push(version: int | None):
    """With ``version``: the fleet kills its first embedded server (SIGKILL) just before the
    push of ``version`` (rank 0: the fleet's probe finds it dead, restarts it and regroups)."""
    from megatron_sat.rollout.fleet import RolloutFleet

    if version is None:
        yield
        return
    push = RolloutFleet.push

    def killing_push(self, named_tensors, v, *, dead=()):
        if v == version:
            self.servers[0].process.kill()
            self.servers[0].process.wait()
        return push(self, named_tensors, v, dead=dead)

    RolloutFleet.push = killing_push
    try:
        yield
    finally:
        RolloutFleet.push = push


def record_exports() -> dict:
    """Record, on this rank, the HF names of every per-stage export
    (``megatron_push.export_stage_hf_tensors``: one list per push) and count the gathered
    exports (``PolicyTrainer.hf_tensors``: every stage's layers on every rank, what the single
    sender on rank 0 pushes)."""
    from megatron_sat.training.trainer import PolicyTrainer
    from megatron_sat.weight_sync import megatron_push

    record: dict = {"stage": [], "gathered": 0}
    stage_export, gathered_export = megatron_push.export_stage_hf_tensors, PolicyTrainer.hf_tensors

    def export_stage_hf_tensors(model, hf_config):
        names = []
        record["stage"].append(names)
        for name, tensor in stage_export(model, hf_config):
            names.append(name)
            yield name, tensor

    def hf_tensors(self):
        record["gathered"] += 1
        return gathered_export(self)

    megatron_push.export_stage_hf_tensors = export_stage_hf_tensors
    PolicyTrainer.hf_tensors = hf_tensors
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
