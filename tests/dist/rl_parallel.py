"""The whole RL loop (``run_rl``) at TP2 (sequence parallel) and at EP2 on 2 gloo ranks.

argv: one ``name=override;override;...`` per run. Each run is a fresh trainer
(megatron-core's parallel state is destroyed in between); rank 0 prints ``RL_PARALLEL_DONE``
at the end. The pytest side (tests/test_rl_parallel.py) reads the run directories.
"""

from __future__ import annotations

import sys

import torch.distributed as dist


def main(argv: list[str]) -> None:
    from megatron.core import parallel_state

    from megatron_sat.config import load_config
    from megatron_sat.training import rl
    from megatron_sat.training.distributed import ParallelConfig, init_distributed

    # The tiny random model never writes a boxed answer, so math rewards would all be 0, the
    # advantages 0 and the weights would never move. A reward that varies within each group
    # (odd response length in characters) gives a real policy gradient.
    rl.math_reward = lambda response, label: float(len(response) % 2)
    init_distributed(ParallelConfig())  # the world and the CPU shims
    for run in argv:
        name, _, overrides = run.partition("=")
        parallel_state.destroy_model_parallel()
        summary = rl.run_rl(load_config(None, overrides.split(";")))
        if dist.get_rank() == 0:
            print(f"{name}: {summary['wall_time_s']} s", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        print("RL_PARALLEL_DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
