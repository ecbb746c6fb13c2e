"""The command line of one embedded CPU server (``megatron_sat.rollout.embedded.server``, which
speaks SGLang's API and takes SGLang's flags), for the launch scripts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_sat.config.launch import LaunchConfig
from megatron_sat.rollout.sglang.args import common_args

if TYPE_CHECKING:
    from megatron_sat.rollout.engines import ServerStart


def launch_args(launch: LaunchConfig, start: ServerStart) -> list[str]:
    """The arguments of one embedded server after its interpreter."""
    del launch  # one CPU process, one weight-sync rank: nothing of the launch applies
    return [
        "-m",
        "megatron_sat.rollout.embedded.server",
        *common_args(start),
        "--enable-return-routed-experts",
        "--random-seed",
        str(start.seed),
        "--max-running-requests",
        str(start.max_running_requests),
    ]
