"""The rollout engines, one registry entry each: how the trainer reaches an engine's servers
(client, fleet, weight updater) and how a launch script starts them.

``rollout.engine`` picks an :class:`EngineSpec` (the API the trainer speaks); the launch's
``launch.rollout_engine`` picks one of the engine's :class:`ServerLaunch` (which servers the
script starts: SGLang's API is served by SGLang and by our embedded CPU server). An engine is
one folder (``rollout/<engine>/``: client, updater, server arguments) plus its entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_sat.config.launch import LaunchConfig
from megatron_sat.rollout.auth import ServerKeys
from megatron_sat.rollout.client import SGLangClient
from megatron_sat.rollout.embedded import args as embedded_args
from megatron_sat.rollout.engine import RolloutClient
from megatron_sat.rollout.fleet import RolloutFleet
from megatron_sat.rollout.sglang import args as sglang_args
from megatron_sat.rollout.vllm import args as vllm_args
from megatron_sat.rollout.vllm.client import VLLMClient
from megatron_sat.rollout.vllm.fleet import VLLMFleet

# A client's timeout when none is given (``rollout.request_timeout_s``'s default), seconds.
DEFAULT_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ServerStart:
    """One server of a launch script, in the engine's terms.

    Attributes:
        model_path: the checkpoint it serves.
        host: the address it binds (a shell expansion in multi-node scripts).
        port: its HTTP port.
        seed: its random seed.
        key_config: the per-job key file argument (a shell expansion), or None without keys.
        max_running_requests: its batch limit (embedded servers).
        return_routed_experts: whether it captures routed experts (vLLM; SGLang always does).
    """

    model_path: str
    host: str
    port: int
    seed: int
    key_config: str | None
    max_running_requests: int
    return_routed_experts: bool


@dataclass(frozen=True)
class ServerLaunch:
    """How a launch script starts one kind of server.

    Attributes:
        args: the server's argv after its interpreter.
        python: the interpreter's shell variable, set by the script's preamble.
        preamble: extra preamble lines ``(env_python, uses_keys) -> lines`` (its own
            environment, its key), or None.
        env_python: the ``RenderContext`` field holding the interpreter of the server's own
            environment that ``preamble`` gets (``sglang_python``, ``vllm_python``), or None.
        mpirun_env: variables mpirun must hand a remote server (``-x``).
        plan_flags: what the printed plan shows of the server's flags.
    """

    args: Callable[[LaunchConfig, ServerStart], list[str]]
    python: str = '"$PY"'
    preamble: Callable[[str | None, bool], list[str]] | None = None
    env_python: str | None = None
    mpirun_env: tuple[str, ...] = ()
    plan_flags: Callable[[LaunchConfig], str] = lambda launch: ""


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine.

    Attributes:
        client: the client of a running server, ``(url, keys, timeout_s) -> RolloutClient``
            (``timeout_s``: ``rollout.request_timeout_s``; default ``DEFAULT_TIMEOUT_S``).
        fleet: the fleet class over its servers (its ``updater_cls`` is the weight push).
        servers: the ``launch.rollout_engine`` values that start servers speaking its API.
        embedded: whether it can run on embedded CPU servers started by the trainer (no
            ``rollout.server_urls``).
        per_stage_push: whether its updater supports one sender per pipeline stage
            (``weight_sync.megatron_push``; ``training.stage_senders``).
        single_sender_reason: without ``per_stage_push``, why the engine cannot take one
            sender per stage (its runs at PP > 1 push rank 0's gathered export, and say why).
    """

    client: Callable[..., RolloutClient]
    fleet: type[RolloutFleet]
    servers: Mapping[str, ServerLaunch] = field(default_factory=dict)
    embedded: bool = False
    per_stage_push: bool = False
    single_sender_reason: str = ""

    def fleet_from_urls(
        self,
        urls: Sequence[str],
        keys: ServerKeys | None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> RolloutFleet:
        """A fleet over running servers (reported, never restarted, when they die); every
        client's calls time out after ``timeout_s`` seconds."""
        return self.fleet([self.client(url, keys, timeout_s) for url in urls], **kwargs)


# vLLM 0.32-0.34's weight transfer takes one sender per server: a worker holds one
# weight-transfer engine with one group (v1/worker/gpu_worker.py: self.weight_transfer_engine;
# distributed/weight_transfer/nccl_engine.py init_transfer_engine replaces
# self.model_update_group), every bucket is broadcast from group rank 0 (receive_weights:
# src=0), and vLLM 0.33's NCCL trainer engine refuses a parameter whose first owner is not rank 0
# ("NCCL broadcast has a single sender, rank 0"). Per-stage groups would each replace the last.
VLLM_SINGLE_SENDER = (
    "vLLM's weight transfer takes one sender per server (one transfer engine and group per "
    "worker, every bucket broadcast from rank 0: vllm/distributed/weight_transfer/"
    "nccl_engine.py, 'NCCL broadcast has a single sender, rank 0'), so the pipeline stages "
    "cannot each push their own layers; trainer rank 0 gathers every stage's layers and "
    "pushes them, one tensor at a time"
)

ENGINES: dict[str, EngineSpec] = {
    "sglang": EngineSpec(
        client=lambda url, keys, timeout_s=DEFAULT_TIMEOUT_S: SGLangClient(
            url, timeout_s, keys=keys
        ),
        fleet=RolloutFleet,
        servers={
            "sglang": ServerLaunch(
                sglang_args.launch_args,
                python='"$SGLANG_PY"',
                preamble=sglang_args.launch_preamble,
                env_python="sglang_python",
                plan_flags=sglang_args.plan_flags,
            ),
            "embedded": ServerLaunch(embedded_args.launch_args),
        },
        embedded=True,
        per_stage_push=True,
    ),
    "vllm": EngineSpec(
        # vLLM has one key level: its --api-key (VLLM_API_KEY).
        client=lambda url, keys, timeout_s=DEFAULT_TIMEOUT_S: VLLMClient(
            url, timeout_s, api_key=None if keys is None else keys.api_key
        ),
        fleet=VLLMFleet,
        single_sender_reason=VLLM_SINGLE_SENDER,
        servers={
            "vllm": ServerLaunch(
                vllm_args.launch_args,
                python='"$VLLM_PY"',
                preamble=vllm_args.launch_preamble,
                env_python="vllm_python",
                mpirun_env=vllm_args.MPIRUN_ENV,
            )
        },
    ),
}


def server_launch(name: str) -> ServerLaunch:
    """The servers ``launch.rollout_engine=name`` starts.

    Raises:
        KeyError: naming the known values.
    """
    for spec in ENGINES.values():
        if name in spec.servers:
            return spec.servers[name]
    known = sorted(n for spec in ENGINES.values() for n in spec.servers)
    raise KeyError(f"launch.rollout_engine {name!r} is none of {known}")
