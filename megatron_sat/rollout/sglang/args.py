"""The command line of one SGLang server (sglang 0.5.23's ``sglang.launch_server``), for the
launch scripts (``megatron_sat.launch.render``). Pure: imports nothing heavy."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from megatron_sat.config.launch import LaunchConfig

if TYPE_CHECKING:
    from megatron_sat.rollout.engines import ServerStart


def common_args(start: ServerStart) -> list[str]:
    """The flags SGLang's server and our embedded imitation share: model, address, and with
    per-job keys the key file (``--config``, which SGLang turns back into ``--api-key`` ...)."""
    args = ["--model-path", start.model_path, "--host", start.host, "--port", str(start.port)]
    if start.key_config is not None:
        args += ["--config", start.key_config]
    return args


def launch_args(launch: LaunchConfig, start: ServerStart) -> list[str]:
    """The arguments of one SGLang server after its interpreter."""
    return [
        "-m",
        "sglang.launch_server",
        *common_args(start),
        "--tp-size",
        str(launch.rollout_server_tp),
        "--enable-return-routed-experts",
        "--weight-version",
        "0",
        # SGLang 0.5.23 uses a request's sampling_seed only under this flag
        # (sampling/sampling_batch_info.py; it also selects the pytorch sampler): the
        # per-request seeds that keep a resumed run on its path (rollout/seeds.py).
        "--enable-deterministic-inference",
        "--random-seed",
        str(start.seed),
        *launch.sglang_args,
    ]


def plan_flags(launch: LaunchConfig) -> str:
    """What the printed plan shows of a server's flags beyond the common ones."""
    return f" --tp-size {launch.rollout_server_tp}"


def launch_preamble(sglang_python: str | None, keys: bool) -> list[str]:
    """The SGLang servers' interpreter, ``$SGLANG_PY``: their own environment
    (``launch.sglang_env``; sglang 0.5.23 pins torch 2.14.1, transformers 5.19.0 and a CUDA 13
    flashinfer, which must not replace the trainer's torch under its transformer-engine build).
    The script stops at once, naming the field, when the interpreter is missing."""
    del keys  # SGLang reads its keys from --config (rollout.sglang.args.common_args)
    return [
        "# SGLang servers run from their own environment (launch.sglang_env).",
        f"SGLANG_PY={shlex.quote(str(sglang_python))}",
        '[[ -x "$SGLANG_PY" ]] || { echo "no SGLang interpreter at $SGLANG_PY (launch.sglang_env; '
        'bash tools/sglang_env.sh makes one on a CUDA machine)" >&2; exit 1; }',
    ]
