"""Start and stop an embedded rollout server as a subprocess of this process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from megatron_sat.platform.lifetime import parent_env
from megatron_sat.rollout.auth import ServerKeys
from megatron_sat.rollout.client import SGLangClient


@dataclass(frozen=True)
class EmbeddedServerConfig:
    """How to launch one embedded server.

    Attributes:
        model_path: HF checkpoint directory.
        random_seed: sampling seed of the server.
        dtype: the engine's precision, ``--dtype`` ("float32" or "bfloat16").
        enable_return_routed_experts: pass --enable-return-routed-experts.
        max_running_requests: prompts decoded together in one batch.
        dist_timeout_s: weight-update group timeout, seconds.
        startup_timeout_s: how long to wait for /health, seconds.
        client_timeout_s: HTTP timeout of the client returned by ``client()``, seconds.
        env: extra environment variables for the subprocess (e.g. OMP_NUM_THREADS,
            SGLANG_HEALTH_CHECK_TIMEOUT).
        keys: start the server with these API / admin API keys (SGLang's ``--api-key``,
            ``--admin-api-key``), handed over in a 0600 YAML file (``--config``), never on
            the command line; ``client()`` sends them.
    """

    model_path: str
    random_seed: int = 0
    dtype: str = "float32"
    enable_return_routed_experts: bool = True
    max_running_requests: int = 64
    dist_timeout_s: float = 600.0
    startup_timeout_s: float = 180.0
    client_timeout_s: float = 600.0
    env: dict[str, str] = field(default_factory=dict)
    keys: ServerKeys | None = None


class EmbeddedServer:
    """Context manager: a server on 127.0.0.1 at a free port, up once ``__enter__`` returns.

    The subprocess's stdout and stderr go to a log file (``log_path``); if the process dies or
    /health does not answer in time, ``__enter__`` raises RuntimeError with the log's tail. On
    exit the process (only the one we started, by its handle) is terminated, then killed after
    10 s if it has not exited; the log is deleted unless the block raised.

    ``restart()`` replaces a dead (or live) process by a fresh one at a new port: it serves the
    checkpoint's weights under weight_version "default" until the trainer pushes weights.

    The server ends with this process, also when this one is SIGKILLed (the parent-death
    signal when started from the main thread, and a poll of its parent pid:
    ``platform.lifetime.end_with_parent``), and its port is freed with it.
    """

    host = "127.0.0.1"

    def __init__(self, model_path: str, **options) -> None:
        """``options``: any other field of ``EmbeddedServerConfig`` (e.g. ``random_seed``)."""
        self.config = EmbeddedServerConfig(model_path=str(model_path), **options)
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(
            prefix="embedded_server_", suffix=".log", delete=False
        )
        self.log_path = Path(self._log.name)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedServer is not started")
        return f"http://{self.host}:{self.port}"

    def client(self) -> SGLangClient:
        """A new client of this server."""
        return SGLangClient(self.url, timeout_s=self.config.client_timeout_s, keys=self.config.keys)

    def command(self, port: int) -> list[str]:
        """The server's command line."""
        c = self.config
        cmd = [
            sys.executable,
            "-m",
            "megatron_sat.rollout.embedded.server",
            "--model-path",
            str(c.model_path),
            "--host",
            self.host,
            "--port",
            str(port),
            "--random-seed",
            str(c.random_seed),
            "--dtype",
            c.dtype,
            "--max-running-requests",
            str(c.max_running_requests),
            "--dist-timeout",
            str(c.dist_timeout_s),
        ]
        if c.enable_return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        if c.keys is not None:
            cmd += ["--config", str(self._key_file())]
        return cmd

    def _key_file(self) -> Path:
        """The keys as SGLang's ``--config`` YAML, created with mode 0600."""
        path = self.log_path.with_suffix(".keys.yaml")
        keys = {  # the flags' spelling, as SGLang's --config needs
            "api-key": self.config.keys.api_key,
            "admin-api-key": self.config.keys.admin_api_key,
        }
        # safe_dump quotes a key YAML would otherwise read as another value ("yes", "0123", "a #b")
        text = yaml.safe_dump({k: v for k, v in keys.items() if v is not None})
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path

    @property
    def running(self) -> bool:
        """Whether the subprocess was started and has not exited."""
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def start(self) -> None:
        """Start the subprocess and wait until /health answers.

        Raises:
            RuntimeError: when the process exits first or /health does not answer within
                ``startup_timeout_s`` (with the log's tail), or no free port could be bound.
        """
        # The free port is found by binding port 0 and releasing it, so another process may
        # grab it first; that shows up as "address already in use" and we try a new port.
        for _attempt in range(3):
            self.port = _free_port(self.host)
            self.process = subprocess.Popen(
                self.command(self.port),
                stdout=self._log,
                stderr=subprocess.STDOUT,
                # Its pid, so the server ends with this process even after a SIGKILL.
                env={**os.environ, **self.config.env, **parent_env()},
                # Its own session: a Ctrl-C in the terminal reaches the trainer only, which then
                # shuts the server down in order instead of losing it mid-step.
                start_new_session=True,
            )
            try:
                self._wait_healthy()
                return
            except RuntimeError:
                if "address already in use" not in self.log_tail().lower():
                    self.stop()
                    self._log.close()  # kept on disk: the error names it
                    raise
                self.stop()
        raise RuntimeError(f"embedded server could not bind a free port:\n{self.log_tail()}")

    def restart(self) -> None:
        """Stop the subprocess if it still runs, then start a fresh one (new port, so ``url``
        changes; the log file continues, with a marker line).

        Raises:
            RuntimeError: as ``start``.
        """
        self.stop()
        exit_code = None if self.process is None else self.process.returncode
        if self._log.closed:  # a failed start closed it; keep one log per server slot
            self._log = open(self.log_path, "ab")
        marker = f"\n--- restarting (previous process exit code {exit_code}) ---\n"
        self._log.write(marker.encode())
        self._log.flush()
        self.start()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"embedded server ({self.config.model_path}) exited with code "
                    f"{self.process.returncode} before /health answered; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise RuntimeError(
            f"embedded server at {self.url} not healthy after {self.config.startup_timeout_s} s;"
            f" log {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, num_chars: int = 4000) -> str:
        """The last characters of the server's combined stdout/stderr."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        """Terminate the subprocess (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()
        self._log.close()
        self.log_path.with_suffix(".keys.yaml").unlink(missing_ok=True)
        if exc_type is None:
            self.log_path.unlink(missing_ok=True)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
