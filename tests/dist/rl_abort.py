"""Rank 0 fails inside a train step while rank 1 is in the step's collectives (EP2: DP 2).

argv: ``name=override;...`` as tests/dist/rl_parallel.py. Rank 0's ``rl_step`` raises at once;
rank 1 is then inside its own ``rl_step`` collectives. Rank 0 must exit without broadcasting an
``abort`` rank 1 could only meet at the collective timeout, so the launcher ends the job in
seconds (tests/test_rl_parallel.py). With ``RL_ABORT_MARK`` set, rank 0 writes the wall time
of its failure (``time.time()``) into that file first, so the test times the job's end from the
failure, not from the launch.
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist


def main(argv: list[str]) -> None:
    from megatron.core import parallel_state

    from megatron_sat.config import load_config
    from megatron_sat.training import rl
    from megatron_sat.config import ParallelConfig
    from megatron_sat.platform.distributed import init_distributed
    from megatron_sat.training.trainer import PolicyTrainer

    rl.math_reward = lambda response, label: float(len(response) % 2)
    init_distributed(ParallelConfig(), timeout_minutes=1)  # the world; run_rl sets up EP2
    parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:

        def injected(*args, **kwargs):
            if mark := os.environ.get("RL_ABORT_MARK"):
                with open(mark, "w") as f:
                    f.write(repr(time.time()))
            raise RuntimeError("injected failure on rank 0")

        PolicyTrainer.rl_step = injected
    name, _, overrides = argv[0].partition("=")
    rl.run_rl(load_config(None, overrides.split(";")))


if __name__ == "__main__":
    main(sys.argv[1:])
