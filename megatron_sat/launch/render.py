"""Render the launch script of a resolved plan: torchrun (one node), sbatch, or mpirun.

Every script does the same four things, with its launcher's tools:

1. start the rollout servers on their devices (SGLang with ``--enable-return-routed-experts``,
   ``--weight-version 0`` and ``--enable-deterministic-inference``, or the embedded CPU
   server), one log file each;
2. wait until every server answers ``/health`` (failing early when one exits);
3. start the trainer ranks with ``megatron-sat train --config <resolved config>
   rollout.server_urls=[...]``, one log per node;
4. on exit, stop the servers it started, by the pids it recorded (never by name), and exit
   with the trainer's status.

The resolved config is written next to the script, so every process reads the same config.

Who may talk to the servers (SGLang's ``--api-key`` / ``--admin-api-key``,
``megatron_sat.rollout.auth``): a launch whose servers and trainer share one node
(``torchrun``; ``slurm`` with one node, where the batch script runs on that node) binds the
servers to 127.0.0.1 and needs no key. Otherwise (``slurm`` with several nodes; ``mpirun``,
whose hosts may be other machines than the one running the script) each server binds its
node's address, and the script generates an API key and an admin API key for this job at run
time into ``$LOG_DIR/server_keys.<job>.yaml``, created with umask 077 (mode 0600: the job's
user only; ``$LOG_DIR`` must be on a file system every node sees, as for the logs). The servers
read it through SGLang's ``--config`` (so no key is on a command line), the trainer through
``rollout.server_key_file``; the script's text holds no key, and the script deletes the file
on exit. SGLang 0.5.23 logs its resolved ``server_args`` at start-up with the keys in clear
(``entrypoints/engine.py``, only watermark secrets are redacted), so each server's output
passes through a filter that replaces the keys by ``<redacted>`` before it reaches its log.
SGLang 0.5.23 turns each ``--config`` entry ``k: v`` back into the arguments ``--k v``
(``utils/server_args_config_parser.py``), so the file's keys are spelled as the flags
(``api-key``, ``admin-api-key``: ``--api_key`` is not a flag of its parser), and each key starts
with ``sk-`` (argparse reads a value that starts with ``-``, 1 in 64 ``token_urlsafe`` draws, as
an option). Either way that server would not start.
"""

from __future__ import annotations

import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

from megatron_sat.launch.plan import LaunchPlan, RolloutServer, format_plan
from megatron_sat.rollout.engines import ServerStart, server_launch

_HEALTH_FUNCTION = """\
FREE_PORT_PY='import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
HEALTH_PY='import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=5)'
wait_healthy() {  # URL PID LOG: poll URL/health until it answers, the server dies or time is up
  local deadline=$((SECONDS + SERVER_STARTUP_TIMEOUT_S))
  until "$PY" -c "$HEALTH_PY" "$1" 2>/dev/null; do
    if ! kill -0 "$2" 2>/dev/null; then
      echo "rollout server $1 exited before /health answered; log: $3" >&2
      tail -n 30 "$3" >&2 || true
      return 1
    fi
    if (( SECONDS >= deadline )); then
      echo "rollout server $1 not healthy after ${SERVER_STARTUP_TIMEOUT_S} s; log: $3" >&2
      return 1
    fi
    sleep 0.5
  done
  echo "rollout server $1 is up" >&2
}
SERVER_PIDS=()
stop_servers() {  # only the processes this script started, by pid
  local pid
  for pid in "${SERVER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${SERVER_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [[ -n "${KEY_FILE:-}" ]]; then rm -f "$KEY_FILE"; fi
}
trap stop_servers EXIT
"""


_KEYS_FUNCTION = """\
KEYGEN_PY='import secrets
for name in ("api-key", "admin-api-key"):
    print(name + ": sk-" + secrets.token_urlsafe(32))'
REDACT_PY='import sys
keys = [line.split(":", 1)[1].strip() for line in open(sys.argv[1]) if ":" in line]
for line in sys.stdin:
    for key in keys:
        line = line.replace(key, "<redacted>")
    sys.stdout.write(line)
    sys.stdout.flush()'
# This job's server keys: made now, readable by this user only, never printed.
KEY_FILE="$LOG_DIR/server_keys.${SLURM_JOB_ID:-$$}.yaml"
(umask 077 && "$PY" -c "$KEYGEN_PY" > "$KEY_FILE")
"""


@dataclass(frozen=True)
class RenderContext:
    """What a script needs beyond the plan.

    Attributes:
        config_path: the resolved run config (YAML) every process loads.
        model_path: checkpoint the servers load (``init_checkpoint``).
        workdir: directory the script ``cd``s into.
        python: interpreter for every process.
        log_dir: directory of the per-node and per-server logs.
        seed: base random seed of the servers (server i gets seed + i).
        max_running_requests: batch limit of an embedded server.
        return_routed_experts: whether vLLM servers capture routed experts
            (``rollout.return_routed_experts``; SGLang's flag is always passed).
        vllm_python: the vLLM environment's interpreter (``launch.vllm_env``), for
            ``launch.rollout_engine=vllm``.
        sglang_python: the SGLang environment's interpreter (``launch.sglang_env``), for
            ``launch.rollout_engine=sglang``.
    """

    config_path: str
    model_path: str
    workdir: str
    python: str
    log_dir: str
    seed: int
    max_running_requests: int
    return_routed_experts: bool = True
    vllm_python: str | None = None
    sglang_python: str | None = None


def _q(value: object) -> str:
    return value if isinstance(value, Raw) else shlex.quote(str(value))


def _argv(args: list[str]) -> str:
    return " ".join(_q(a) for a in args)


def _server_log(log: str, keys: bool) -> str:
    """Where a server's output goes: its log, through the key filter when there are keys."""
    if keys:
        return f'> >("$PY" -u -c "$REDACT_PY" "$KEY_FILE" > {log}) 2>&1'
    return f"> {log} 2>&1"


class Raw(str):
    """An argument rendered as is (a shell expansion such as ``"$KEY_FILE"``), not quoted."""


def uses_keys(plan: LaunchPlan) -> bool:
    """Whether the servers bind a node address with per-job keys (see the module docstring),
    rather than 127.0.0.1 without keys."""
    return plan.launch.launcher == "mpirun" or plan.launch.num_nodes > 1


def server_command(
    plan: LaunchPlan, ctx: RenderContext, server: RolloutServer, host: str = "127.0.0.1"
) -> list[str]:
    """The argv (after the interpreter) of one rollout server listening on ``host``, built by
    its engine (``rollout.engines.server_launch``); with per-job keys (``uses_keys``) an
    SGLang-API server reads them from ``"$KEY_FILE"`` (``--config``)."""
    start = ServerStart(
        model_path=ctx.model_path,
        host=host,
        port=server.port,
        seed=ctx.seed + server.index,
        key_config=Raw('"$KEY_FILE"') if uses_keys(plan) else None,
        max_running_requests=ctx.max_running_requests,
        return_routed_experts=ctx.return_routed_experts,
    )
    return server_launch(plan.launch.rollout_engine).args(plan.launch, start)


def server_python(plan: LaunchPlan) -> str:
    """The interpreter of the rollout servers in a script: their engine's own environment
    (SGLang's ``$SGLANG_PY``, vLLM's ``$VLLM_PY``) or, for the embedded server, the
    trainer's (``$PY``)."""
    return server_launch(plan.launch.rollout_engine).python


def _trainer_args(ctx: RenderContext) -> str:
    return f"-m megatron_sat.cli train --config {_q(ctx.config_path)}"


def _preamble(plan: LaunchPlan, ctx: RenderContext, title: str) -> list[str]:
    comment = ["# " + line if line else "#" for line in format_plan(plan).splitlines()]
    lines = [
        f"# {title}, rendered by `megatron-sat launch` from the resolved config",
        f"# {ctx.config_path}. Re-render rather than edit: the plan below is what was validated.",
        *comment,
        "set -euo pipefail",
        f"cd {_q(ctx.workdir)}",
        f"PY={_q(ctx.python)}",
        f"LOG_DIR={_q(ctx.log_dir)}",
        'mkdir -p "$LOG_DIR"',
        f"SERVER_STARTUP_TIMEOUT_S={int(plan.launch.server_startup_timeout_s)}",
        "export PYTHONUNBUFFERED=1",
    ]
    lines += [f"export {k}={_q(v)}" for k, v in sorted(plan.launch.env.items())]
    lines += [_HEALTH_FUNCTION] + ([_KEYS_FUNCTION] if uses_keys(plan) else [])
    launch = server_launch(plan.launch.rollout_engine)
    if launch.preamble is not None:
        python = None if launch.env_python is None else getattr(ctx, launch.env_python)
        lines += launch.preamble(python, uses_keys(plan))
    return lines


def _devices(values: tuple[int, ...] | range) -> str:
    return ",".join(str(v) for v in values)


def _urls_line(plan: LaunchPlan) -> list[str]:
    if plan.server_source == "launcher":
        return [
            'SERVER_URLS="[$(IFS=,; echo "${URLS[*]}")]"',
            'echo "rollout servers: $SERVER_URLS" >&2',
        ]
    return ['SERVER_URLS=""']


def _master_port(plan: LaunchPlan) -> list[str]:
    """Set MASTER_PORT: the configured port, or one found free on this node just now."""
    if plan.launch.master_port:
        return [f"MASTER_PORT={plan.launch.master_port}"]
    return ['MASTER_PORT="$("$PY" -c "$FREE_PORT_PY")"', 'echo "master port $MASTER_PORT" >&2']


def _url_override(plan: LaunchPlan) -> str:
    keys = ' "rollout.server_key_file=$KEY_FILE"' if uses_keys(plan) else ""
    return '${SERVER_URLS:+"rollout.server_urls=$SERVER_URLS"}' + keys


def render_torchrun(plan: LaunchPlan, ctx: RenderContext) -> str:
    """A bash script for one node: servers as background processes, then torchrun.

    Raises:
        ValueError: naming ``launch.launcher`` when the plan has more than one node.
    """
    la = plan.launch
    if la.num_nodes != 1:
        raise ValueError("launch.launcher=torchrun renders one node; use slurm or mpirun")
    lines = ["#!/usr/bin/env bash", *_preamble(plan, ctx, "Single-node torchrun launch"), "URLS=()"]
    for s in plan.servers:
        log = f'"$LOG_DIR/server_{s.index}.log"'
        env = f"CUDA_VISIBLE_DEVICES={_devices(s.devices)} " if la.device == "cuda" else ""
        argv = _argv(server_command(plan, ctx, s))
        lines += [
            f"{env}{server_python(plan)} {argv} > {log} 2>&1 &",
            "SERVER_PIDS+=($!)",
            f'URLS+=("\\"http://127.0.0.1:{s.port}\\"")',
        ]
    for s in plan.servers:
        lines.append(
            f'wait_healthy "http://127.0.0.1:{s.port}" "${{SERVER_PIDS[{s.index}]}}" '
            f'"$LOG_DIR/server_{s.index}.log"'
        )
    lines += _urls_line(plan)
    devices = _devices(range(la.trainer_ranks_per_node))
    env = f"CUDA_VISIBLE_DEVICES={devices} " if la.device == "cuda" else ""
    lines += _master_port(plan)
    lines += [
        "set +e",
        f'{env}"$PY" -m megatron_sat.platform.torchrun --nnodes=1 --node-rank=0 '
        f"--nproc-per-node={la.trainer_ranks_per_node} --master-addr=127.0.0.1 "
        f'--master-port="$MASTER_PORT" {_trainer_args(ctx)} {_url_override(plan)} '
        '2>&1 | tee "$LOG_DIR/trainer_node0.log"',
        "status=${PIPESTATUS[0]}",
        "set -e",
        'echo "trainer exited with status $status" >&2',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def render_sbatch(plan: LaunchPlan, ctx: RenderContext) -> str:
    """An sbatch script: srun steps start the servers and one torchrun per trainer node;
    host names come from ``SLURM_JOB_NODELIST``, logs go to one file per node and server."""
    la = plan.launch
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={la.job_name or plan.run_name}",
        f"#SBATCH --nodes={la.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --output={ctx.log_dir}/sbatch_%j.log",
    ]
    if la.device == "cuda":
        header.append(f"#SBATCH --gres=gpu:{la.gpus_per_node}")
    for flag, value in (
        ("cpus-per-task", la.cpus_per_node),
        ("partition", la.partition),
        ("account", la.account),
        ("time", la.time_limit),
    ):
        if value is not None:
            header.append(f"#SBATCH --{flag}={value}")
    if la.stop_signal_lead_s:  # to the batch shell only (B:), which passes it to the trainer
        header.append(f"#SBATCH --signal=B:USR1@{la.stop_signal_lead_s}")
    lines = header + _preamble(plan, ctx, "SLURM launch")
    lines += [
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"if (( ${{#NODES[@]}} != {la.num_nodes} )); then",
        f'  echo "allocation has ${{#NODES[@]}} nodes, the plan {la.num_nodes}" >&2; exit 1',
        "fi",
        'MASTER_ADDR="${NODES[0]}"',
        f'TRAINER_NODELIST="$(IFS=,; echo "${{NODES[*]:0:{la.trainer_nodes}}}")"',
        'echo "job $SLURM_JOB_ID: nodes ${NODES[*]}; trainer on $TRAINER_NODELIST" >&2',
        "URLS=()",
    ]
    # Steps get every GPU of the job (SLURM's default for a step without --gres) and share
    # the node with --overlap; CUDA_VISIBLE_DEVICES picks the plan's devices, as in torchrun.
    keys = uses_keys(plan)
    for s in plan.servers:
        node = f"${{NODES[{s.node}]}}"
        host = node if keys else "127.0.0.1"
        argv = _argv(server_command(plan, ctx, s, Raw(f'"{node}"') if keys else host))
        env = f"env CUDA_VISIBLE_DEVICES={_devices(s.devices)} " if la.device == "cuda" else ""
        # With keys, the step's output comes back through srun and the key filter.
        log = f'"$LOG_DIR/server_{s.index}_{node}.log"'
        output = _server_log(log, True) if keys else f'--output="$LOG_DIR/server_{s.index}_%N.log"'
        step = f'srun --overlap --nodes=1 --ntasks=1 --nodelist="{node}"'
        lines += [
            f"{step} {env}{server_python(plan)} {argv} {output} &"
            if keys
            else f"{step} {output} {env}{server_python(plan)} {argv} &",
            "SERVER_PIDS+=($!)",
            f'URLS+=("\\"http://{host}:{s.port}\\"")',
        ]
    for s in plan.servers:
        node = f"${{NODES[{s.node}]}}"
        host = node if keys else "127.0.0.1"
        lines.append(
            f'wait_healthy "http://{host}:{s.port}" "${{SERVER_PIDS[{s.index}]}}" '
            f'"$LOG_DIR/server_{s.index}_{node}.log"'
        )
    lines += _urls_line(plan)
    visible = _devices(range(la.trainer_ranks_per_node))
    inner = (
        (f"export CUDA_VISIBLE_DEVICES={visible}; " if la.device == "cuda" else "")
        + f'exec "$0" -m megatron_sat.platform.torchrun --nnodes={la.trainer_nodes} '
        f'--node-rank="$SLURM_PROCID" --nproc-per-node={la.trainer_ranks_per_node} '
        f'--master-addr="$1" --master-port="$2" {_trainer_args(ctx)} '
        '${3:+"rollout.server_urls=$3"}' + (' "rollout.server_key_file=$4"' if keys else "")
    )
    lines += _master_port(plan)
    lines += [
        "set +e",
        f"srun --overlap --nodes={la.trainer_nodes} --ntasks-per-node=1 "
        f'--nodelist="$TRAINER_NODELIST" '
        f'--output="$LOG_DIR/trainer_%N.log" bash -c {_q(inner)} "$PY" "$MASTER_ADDR" '
        '"$MASTER_PORT" "$SERVER_URLS"' + (' "$KEY_FILE"' if keys else "") + " &",
        *_STOP_FORWARD,
        "set -e",
        'echo "trainer exited with status $status" >&2',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


# SLURM's SIGUSR1 (--signal=B:USR1@s) reaches this shell only: it is passed to the trainer's
# srun, which forwards the signals it gets to its tasks (srun(1), "SIGNALS"), the torchrun
# agents, which pass it to the ranks (platform.torchrun): they save after their step and exit
# 0 (training.stop). Bash's wait returns when a trapped signal arrives: wait again.
_STOP_FORWARD = [
    "TRAINER_PID=$!",
    'trap \'echo "SIGUSR1: asking the trainer to save and stop" >&2; '
    'kill -USR1 "$TRAINER_PID" 2>/dev/null\' USR1',
    'wait "$TRAINER_PID"',
    "status=$?",
    'while kill -0 "$TRAINER_PID" 2>/dev/null; do wait "$TRAINER_PID"; status=$?; done',
]


def render_mpirun(plan: LaunchPlan, ctx: RenderContext) -> str:
    """A bash script: one ``mpirun -np 1`` per server, then ``mpirun`` of the trainer ranks
    (Open MPI; ranks mapped from ``OMPI_COMM_WORLD_*`` by :mod:`megatron_sat.launch.env`)."""
    la = plan.launch
    hosts = la.hosts or [socket.gethostname()]
    lines = ["#!/usr/bin/env bash", *_preamble(plan, ctx, "Open MPI launch")]
    lines += [
        "# Open MPI hands this environment to local ranks: stale torchrun variables would give",
        "# every rank the same identity.",
        "unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE",
        "MPI_FLAGS=(--bind-to none)",
        '[[ "$(id -u)" == 0 ]] && MPI_FLAGS+=(--allow-run-as-root)',
        "URLS=()",
    ]
    exports = " ".join(f"-x {k}" for k in ["PYTHONUNBUFFERED", *sorted(la.env)])
    # mpirun hands a remote rank only the variables named by -x (values taken from here).
    server_exports = exports + "".join(
        f" -x {k}" for k in server_launch(la.rollout_engine).mpirun_env
    )
    for s in plan.servers:
        host = hosts[s.node]
        log = f'"$LOG_DIR/server_{s.index}.log"'
        cuda = f" -x CUDA_VISIBLE_DEVICES={_devices(s.devices)}" if la.device == "cuda" else ""
        argv = _argv(server_command(plan, ctx, s, host))
        lines += [
            f'mpirun "${{MPI_FLAGS[@]}}" -np 1 --host {_q(host)}:1 {server_exports}{cuda} '
            f"{server_python(plan)} {argv} {_server_log(log, True)} &",
            "SERVER_PIDS+=($!)",
            f'URLS+=("\\"http://{host}:{s.port}\\"")',
        ]
    for s in plan.servers:
        lines.append(
            f'wait_healthy "http://{hosts[s.node]}:{s.port}" "${{SERVER_PIDS[{s.index}]}}" '
            f'"$LOG_DIR/server_{s.index}.log"'
        )
    lines += _urls_line(plan)
    per_node = la.trainer_ranks_per_node
    host_list = ",".join(f"{h}:{per_node}" for h in hosts[: la.trainer_nodes])
    cuda = f" -x CUDA_VISIBLE_DEVICES={_devices(range(per_node))}" if la.device == "cuda" else ""
    lines += _master_port(plan)
    lines += [
        "set +e",
        f'mpirun "${{MPI_FLAGS[@]}}" -np {plan.world_size} --host {host_list} '
        f"--map-by ppr:{per_node}:node {exports}{cuda} -x MASTER_ADDR={_q(hosts[0])} "
        '-x MASTER_PORT="$MASTER_PORT" '
        f'--output-filename "$LOG_DIR/trainer" "$PY" {_trainer_args(ctx)} {_url_override(plan)}',
        "status=$?",
        "set -e",
        'echo "trainer exited with status $status" >&2',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


RENDERERS = {"torchrun": render_torchrun, "slurm": render_sbatch, "mpirun": render_mpirun}
SCRIPT_NAMES = {"torchrun": "torchrun.sh", "slurm": "job.sbatch", "mpirun": "mpirun.sh"}


def render(plan: LaunchPlan, ctx: RenderContext) -> str:
    """The script of ``plan.launch.launcher``."""
    return RENDERERS[plan.launch.launcher](plan, ctx)


def script_name(launcher: str) -> str:
    """File name of a launcher's script inside the launch directory."""
    return SCRIPT_NAMES[launcher]


def write_executable(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` with mode 0755; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path
