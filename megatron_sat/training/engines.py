"""The run's rollout engine from its config: clients of the configured servers, the fleet
that owns them (restarts, weight pushes), and the weight updater's options."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from megatron_sat.config import RunConfig
from megatron_sat.platform.device import get_device, weight_sync_backend
from megatron_sat.platform.threads import child_env
from megatron_sat.rollout.auth import ServerKeys, generate_server_keys, load_server_keys
from megatron_sat.rollout.client import SGLangClient
from megatron_sat.rollout.embedded.launch import EmbeddedServer
from megatron_sat.rollout.engines import ENGINES
from megatron_sat.rollout.fleet import RolloutFleet
from megatron_sat.rollout.sglang.server_info import server_flag_errors
from megatron_sat.weight_sync.options import weight_sync_options


def server_keys(cfg: RunConfig) -> ServerKeys | None:
    """The keys of ``rollout.server_key_file`` (None without one); raises ValueError naming
    the file when it is readable by others (see ``load_server_keys``)."""
    path = cfg.rollout.server_key_file
    return None if path is None else load_server_keys(path)


@contextlib.contextmanager
def rollout_clients(cfg: RunConfig) -> Iterator[list[SGLangClient]]:
    """SGLang clients of the configured servers (evaluation speaks SGLang's API), starting
    embedded CPU servers when no URL is given."""
    if cfg.rollout.server_urls:
        keys = server_keys(cfg)
        timeout = cfg.rollout.request_timeout_s
        clients = [SGLangClient(url, timeout, keys=keys) for url in cfg.rollout.server_urls]
        yield clients
        return
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                EmbeddedServer(
                    cfg.init_checkpoint,
                    **embedded_server_options(cfg, i),
                    # the servers generate at once: each takes its share of the cores' threads
                    env=child_env(cfg.rollout.num_embedded_servers),
                )
            )
            for i in range(cfg.rollout.num_embedded_servers)
        ]
        yield [server.client() for server in servers]


def embedded_server_options(cfg: RunConfig, index: int) -> dict:
    """``EmbeddedServer`` options of embedded server ``index``: its seed, dtype, batch, and
    API keys generated for it (``rollout.auth.generate_server_keys``), as the multi-node
    launch scripts give theirs: its port on 127.0.0.1 answers only the trainer."""
    return {
        "random_seed": cfg.train.seed + index,
        "dtype": cfg.rollout.dtype,
        "enable_return_routed_experts": True,
        "max_running_requests": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        "client_timeout_s": cfg.rollout.request_timeout_s,
        "keys": generate_server_keys(),
    }


def rollout_fleet(cfg: RunConfig) -> RolloutFleet:
    """The configured servers as a fleet (``rollout.fleet``) of the engine
    ``rollout.engine`` picks in ``rollout.engines.ENGINES``: the servers of
    ``rollout.server_urls`` (reported, never restarted, when they die), else
    ``rollout.num_embedded_servers`` embedded CPU servers started here (restarted when they
    die; they speak SGLang's API). Use it as a context manager: it stops the servers it
    started."""
    options = sync_options(cfg, len(cfg.rollout.server_urls) or cfg.rollout.num_embedded_servers)
    spec = ENGINES[cfg.rollout.engine]
    if cfg.rollout.server_urls or not spec.embedded:
        fleet = spec.fleet_from_urls(
            cfg.rollout.server_urls,
            server_keys(cfg),
            timeout_s=cfg.rollout.request_timeout_s,
            updater_options=options,
        )
        if cfg.rollout.engine == "sglang":
            try:
                check_sglang_servers(fleet.clients, cfg)
            except BaseException:
                fleet.close()
                raise
        return fleet
    return spec.fleet.embedded(
        cfg.init_checkpoint,
        cfg.rollout.num_embedded_servers,
        server_options=lambda i: embedded_server_options(cfg, i),
        updater_options=options,
    )


def check_sglang_servers(clients: list[SGLangClient], cfg: RunConfig) -> None:
    """Refuse SGLang servers given by URL that were started without what the run needs
    (``rollout.sglang.server_info``), read from each one's ``/server_info``.

    Raises:
        ValueError: naming every server and the flag it lacks.
    """
    problems = []
    for client in clients:
        errors = server_flag_errors(
            client.get_server_info(),
            deterministic=cfg.rollout.clock_tokens > 0,
            routed_experts=cfg.rollout.return_routed_experts,
            tp_size=cfg.launch.rollout_server_tp,
        )
        problems += [f"  {client.base_url}: {error}" for error in errors]
    if problems:
        raise ValueError(
            "rollout.server_urls: SGLang servers unfit for this run:\n" + "\n".join(problems)
        )


def sync_options(cfg: RunConfig, num_servers: int) -> dict:
    """WeightUpdater options: SGLang servers given by URL join with their TP ranks over the
    backend the platform decides (``platform.weight_sync_backend``: NCCL when the trainer and
    the servers, ``launch.device``, are on CUDA; ``rollout.weight_sync_backend`` overrides
    it); embedded servers run on the CPU, one gloo rank each. Bounded
    mode pauses with "abort", so requests in flight at a push come back partial and the pool
    resumes or restarts them (``rollout.on_update``); in the other modes nothing is in flight
    at a push and "retract" lets a stray request finish."""
    options = weight_sync_options(cfg.launch, num_servers, os.environ)
    server_device = cfg.launch.device  # servers given by URL run where the launch put them
    if not cfg.rollout.server_urls:
        options.update(ranks_per_server=[1] * num_servers)
        server_device = "cpu"  # the embedded engine has no CUDA path
    options["backend"] = weight_sync_backend(
        get_device().type, server_device, cfg.rollout.weight_sync_backend
    )
    options["pause_mode"] = "abort" if cfg.rollout.mode == "bounded" else "retract"
    return options
