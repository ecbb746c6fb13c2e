"""The command line of one vLLM server (vLLM 0.32's OpenAI server module), shared by
:class:`megatron_sat.rollout.vllm.server.VLLMServer` and the launch scripts
(``megatron_sat.launch.render``). Pure: imports nothing heavy, so the launcher can use it.

What the rollout client relies on: ``--enable-scale-out`` (``/inference/v1/generate``),
``--logprobs-mode processed_logprobs`` (log-probs of the temperature-scaled distribution;
vLLM's default ignores the temperature), ``--weight-transfer-config`` (our gloo backend on
CPU, vLLM's nccl on GPUs), and ``VLLM_SERVER_DEV_MODE=1`` in the environment (the pause,
resume and weight routes).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_sat.config.launch import VLLM_SERVER_FLAGS, LaunchConfig

if TYPE_CHECKING:
    from megatron_sat.rollout.engines import ServerStart

# Our weight-transfer backends by torch.distributed backend: the gloo one is ours
# (registered through the vllm.general_plugins entry point), nccl is vLLM's.
VLLM_BACKENDS = {"gloo": "megatron_sat_gloo", "nccl": "nccl"}
# VLLM_SERVER_DEV_MODE=1 registers the pause, resume and weight-transfer routes
# (vllm/entrypoints/serve/__init__.py); every vLLM server of a run needs it.
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
SERVER_FLAGS = VLLM_SERVER_FLAGS  # the flags server_args sets (declared with the launch config)


def server_args(
    model: str | Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    backend: str = "gloo",
    dtype: str = "float32",
    max_model_len: int | None = None,
    seed: int = 0,
    tensor_parallel_size: int = 1,
    enforce_eager: bool = True,
    enable_return_routed_experts: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The arguments of one vLLM server after its interpreter (module docstring); ``model``
    and ``host`` are kept as given (the launch scripts pass shell expansions). The API key is
    not among them: vLLM reads ``VLLM_API_KEY`` when ``--api-key`` is absent, which keeps the
    key off the command line.

    Raises:
        ValueError: for a backend other than "gloo" or "nccl".
    """
    if backend not in VLLM_BACKENDS:
        raise ValueError(f"backend must be one of {sorted(VLLM_BACKENDS)}, got {backend!r}")
    cmd = [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model if isinstance(model, str) else str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--weight-transfer-config",
        json.dumps({"backend": VLLM_BACKENDS[backend]}),
    ]
    if tensor_parallel_size != 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    return cmd + list(extra_args)


def launch_args(launch: LaunchConfig, start: ServerStart) -> list[str]:
    """One vLLM server of a launch script (``server_args``, as the tests start it): gloo
    weight transfer and eager fp32 on CPU, nccl on CUDA. Its key, when the launch has keys,
    comes from ``VLLM_API_KEY`` (``launch_preamble``), never from the command line."""
    cpu = launch.device == "cpu"
    return server_args(
        start.model_path,
        start.port,
        host=start.host,
        backend="gloo" if cpu else "nccl",
        dtype="float32" if cpu else "auto",
        seed=start.seed,
        tensor_parallel_size=launch.rollout_server_tp,
        enforce_eager=cpu,
        enable_return_routed_experts=start.return_routed_experts,
        extra_args=launch.vllm_args,
    )


# vLLM 0.32 takes --api-key or VLLM_API_KEY (entrypoints/serve/middleware/register.py); the
# environment keeps the key off every command line. vLLM has no admin key: its
# AuthenticationMiddleware guards only /v1, /v2, /inference and /cohere, so the weight and
# pause routes of VLLM_SERVER_DEV_MODE stay open to whoever reaches the port.
_VLLM_KEY = """API_KEY_PY='import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["api-key"])'
VLLM_API_KEY="$("$PY" -c "$API_KEY_PY" "$KEY_FILE")"
export VLLM_API_KEY
"""
# What mpirun must hand a remote vLLM server besides the launch's own variables.
MPIRUN_ENV = ("VLLM_SERVER_DEV_MODE", "VLLM_API_KEY")


def launch_preamble(vllm_python: str | None, keys: bool) -> list[str]:
    """The vLLM servers' interpreter (their own environment and pins: ``$VLLM_PY``), the
    dev-mode routes (pause, resume, weight transfer), and with keys the API key in
    ``VLLM_API_KEY``."""
    lines = [
        "# vLLM servers run from their own environment (tools/vllm_env.sh makes the CPU one).",
        f"VLLM_PY={shlex.quote(str(vllm_python))}",
        '[[ -x "$VLLM_PY" ]] || { echo "no vLLM interpreter at $VLLM_PY (launch.vllm_env; '
        'bash tools/vllm_env.sh makes the CPU one)" >&2; exit 1; }',
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in DEV_MODE_ENV.items()]
    if keys:
        lines += [_VLLM_KEY]
    return lines
