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
from collections.abc import Sequence
from pathlib import Path

from megatron_sat.config.launch import VLLM_SERVER_FLAGS

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
