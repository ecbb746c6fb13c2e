"""Rank 0 fails inside a train step while rank 1 is in the step's collectives (EP2: DP 2).

argv: ``name=override;...`` as tests/dist/rl_parallel.py. Rank 0's ``rl_step`` raises at once;
rank 1 is then inside its own ``rl_step`` collectives. Rank 0 must exit without broadcasting an
``abort`` rank 1 could only meet at the collective timeout, so the launcher ends the job in
seconds (tests/test_rl_parallel.py).
"""

from __future__ import annotations

import sys

import torch.distributed as dist


def main(argv: list[str]) -> None:
    from megatron_sat.config import load_config
    from megatron_sat.training import rl
    from megatron_sat.training.distributed import ParallelConfig, init_distributed
    from megatron_sat.training.trainer import PolicyTrainer

    from megatron.core import parallel_state

    rl.math_reward = lambda response, label: float(len(response) % 2)
    init_distributed(ParallelConfig(), timeout_minutes=1)  # the world; run_rl sets up EP2
    parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:

        def injected(*args, **kwargs):
            raise RuntimeError("injected failure on rank 0")

        PolicyTrainer.rl_step = injected
    name, _, overrides = argv[0].partition("=")
    rl.run_rl(load_config(None, overrides.split(";")))


if __name__ == "__main__":
    main(sys.argv[1:])
