"""Threads of every process the project starts: one decision, made at process start.

Two settings decide how a CPU process behaves when other processes want the same cores:

- the intra-op thread count (OpenMP, MKL and oneDNN in torch): ``os.sched_getaffinity(0)``
  (the cores this process may run on, which a container, ``taskset`` or SLURM can narrow)
  divided by the number of local processes the caller says share them, at least 1;
- the wait policy of the OpenMP runtime: PASSIVE, so that a worker that waits for work or for
  its peers at a barrier sleeps instead of spinning on a core another process needs.

Which runtime: the torch CPU wheels link GNU OpenMP (``torch/lib/libgomp.so.1``;
``torch.__config__.parallel_info()`` says "ATen parallel backend: OpenMP"), whose idle workers
spin about 300,000 iterations before they sleep unless ``OMP_WAIT_POLICY=PASSIVE``. Builds
with Intel OpenMP (conda, some containers) read ``KMP_BLOCKTIME`` (ms of spinning; 0 sleeps at
once) and honour ``OMP_WAIT_POLICY`` too; both are set, each ignored by the other runtime.
bench/cpu_contention.py measures the effect on this build: the warm start's step loop (tiny
model, batch 16, OMP_NUM_THREADS=2 both) ran at 0.10 steps/s with the runtime's default wait
policy and at 8.8 steps/s with PASSIVE, both on 2 cores under a load average of about 40 from
other jobs, and 0.035 against 3.2 steps/s with 2 more busy processes beside it (one run each,
2026-12-03; to be measured again on an idle machine).

Both runtimes read these variables ONCE, when the library loads, which is when ``torch`` is
first imported: :func:`configure_threads` must run at process start, before anything imports
torch. It sets the variables in ``os.environ``, so that the processes this one starts inherit
them. Called after torch was imported, it still sets the thread counts (torch calls) and the
environment for children, and warns that this process keeps the wait policy it started with.

A count from the environment above the core count is capped at the core count by torch (2.13:
``OMP_NUM_THREADS=3`` on 2 cores gives ``torch.get_num_threads() == 2``); an explicit
``torch.set_num_threads`` is not capped.

Precedence of the thread count, highest first:
1. ``OMP_NUM_THREADS`` set by the user (tools/test.sh and examples/run_cpu.sh set 2, so the
   main job's and the tests' float reductions keep their order: their numbers are unchanged);
2. ``MEGATRON_SAT_THREADS`` (the user's override of the project's own choice);
3. the caller's ``threads`` argument (a process that knows it needs few, e.g. a reward worker);
4. affinity // (local processes): the caller's ``num_local_processes``, times
   ``MEGATRON_SAT_LOCAL_PROCESSES`` (set by a parent that runs several such processes at once:
   ``megatron-sat sweep --jobs N`` sets N for its cells, see :func:`child_env`), times
   torchrun's ``LOCAL_WORLD_SIZE`` (the trainer ranks of this node) where it is set.
``OMP_NUM_THREADS`` written by this module for its children is marked
(``MEGATRON_SAT_THREADS_CHOSEN``), so a child decides afresh rather than reading its parent's
choice as the user's. ``OMP_WAIT_POLICY`` and ``KMP_BLOCKTIME`` set by the user are kept.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field

THREADS_ENV = "MEGATRON_SAT_THREADS"
CHOSEN_ENV = "MEGATRON_SAT_THREADS_CHOSEN"  # the OMP_NUM_THREADS this module wrote
LOCAL_PROCESSES_ENV = "MEGATRON_SAT_LOCAL_PROCESSES"  # siblings sharing the cores (a parent's)
WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


@dataclass(frozen=True)
class ThreadPolicy:
    """What :func:`decide_threads` chose.

    Attributes:
        num_threads: intra-op threads (torch, OpenMP, MKL), >= 1.
        num_interop_threads: torch's inter-op pool (parallel graph ops: none on our paths), >= 1.
        source: where ``num_threads`` came from: "OMP_NUM_THREADS", "MEGATRON_SAT_THREADS",
            "argument" or "affinity".
        num_cores: cores in this process's affinity mask.
        env: the variables to set in ``os.environ`` (thread count, wait policy), those the user
            already set left out.
    """

    num_threads: int
    num_interop_threads: int
    source: str
    num_cores: int
    env: dict[str, str] = field(default_factory=dict)


def _positive_int(value: str | int, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def decide_threads(
    *,
    num_local_processes: int = 1,
    threads: int | None = None,
    environ: Mapping[str, str] | None = None,
    affinity: Iterable[int] | None = None,
) -> ThreadPolicy:
    """Choose the thread count and wait policy (pure: reads only its arguments).

    Args:
        num_local_processes: processes of this job that share the cores of ``affinity`` and
            compute at the same time, >= 1; multiplied by ``MEGATRON_SAT_LOCAL_PROCESSES``
            and torchrun's ``LOCAL_WORLD_SIZE`` from ``environ`` where set.
        threads: the caller's own count, used when neither ``OMP_NUM_THREADS`` (user-set) nor
            ``MEGATRON_SAT_THREADS`` is in ``environ``.
        environ: the environment to read (default ``os.environ``).
        affinity: the CPU ids this process may run on (default ``os.sched_getaffinity(0)``).

    Returns:
        The :class:`ThreadPolicy`.

    Raises:
        ValueError: for ``num_local_processes`` or ``threads`` < 1, an empty affinity, or an
            ``OMP_NUM_THREADS`` / ``MEGATRON_SAT_THREADS`` / ``MEGATRON_SAT_LOCAL_PROCESSES``
            / ``LOCAL_WORLD_SIZE`` that is not a positive integer (the variable named).
    """
    env = os.environ if environ is None else environ
    cores = len(set(os.sched_getaffinity(0) if affinity is None else affinity))
    if cores < 1:
        raise ValueError("the CPU affinity of this process is empty")
    sharing = _positive_int(num_local_processes, "num_local_processes")
    for name in (LOCAL_PROCESSES_ENV, "LOCAL_WORLD_SIZE"):
        if env.get(name, "").strip():
            sharing *= _positive_int(env[name], name)
    user_omp = env.get("OMP_NUM_THREADS")
    if user_omp is not None and not user_omp.strip():
        user_omp = None  # set but empty, as shells write "unset": OpenMP ignores it too
    if user_omp is not None and user_omp == env.get(CHOSEN_ENV):
        user_omp = None  # written by this module in a parent process, not by the user
    if user_omp is not None:
        # OpenMP accepts a list ("4,2") for nested levels; the first is the outer count.
        num, source = _positive_int(user_omp.split(",")[0], "OMP_NUM_THREADS"), "OMP_NUM_THREADS"
    elif env.get(THREADS_ENV) is not None:
        num, source = _positive_int(env[THREADS_ENV], THREADS_ENV), THREADS_ENV
    elif threads is not None:
        num, source = _positive_int(threads, "threads"), "argument"
    else:
        num, source = max(1, cores // sharing), "affinity"
    out = {k: v for k, v in WAIT_ENV.items() if k not in env}
    if source != "OMP_NUM_THREADS":
        out.update({"OMP_NUM_THREADS": str(num), CHOSEN_ENV: str(num)})
    return ThreadPolicy(
        num_threads=num,
        num_interop_threads=min(num, 2),
        source=source,
        num_cores=cores,
        env=out,
    )


def configure_threads(
    *,
    num_local_processes: int = 1,
    threads: int | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> ThreadPolicy:
    """Decide (:func:`decide_threads`) and apply the thread policy; call at process start.

    Sets ``policy.env`` in ``environ`` (default ``os.environ``; inherited by the processes
    this one starts). If torch is already imported, also calls ``torch.set_num_threads`` and,
    when its inter-op pool has not started, ``torch.set_num_interop_threads``; if torch is not
    imported yet, it picks the settings up from the environment when it loads (nothing here
    imports it). Must run before torch is imported for the wait policy to apply to this
    process (the OpenMP runtime reads it once, at load); otherwise warns that it applies to
    child processes only.

    Returns:
        The applied :class:`ThreadPolicy`.

    Raises:
        ValueError: as :func:`decide_threads`.
    """
    env = os.environ if environ is None else environ
    policy = decide_threads(num_local_processes=num_local_processes, threads=threads, environ=env)
    torch = sys.modules.get("torch")
    late = torch is not None and any(
        key in policy.env for key in WAIT_ENV
    )  # the runtime loaded without the wait policy
    env.update(policy.env)
    if torch is not None:
        torch.set_num_threads(policy.num_threads)
        try:
            torch.set_num_interop_threads(policy.num_interop_threads)
        except RuntimeError:
            pass  # already started (or set): it only runs inter-op work, which we do not use
    if late:
        warnings.warn(
            "configure_threads ran after torch was imported: OMP_WAIT_POLICY=PASSIVE applies to "
            "the processes this one starts, not to this one (set it in the environment before "
            "Python starts, or call configure_threads before importing torch)",
            RuntimeWarning,
            stacklevel=2,
        )
    return policy


def child_env(num_siblings: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment entries for a child process that runs beside ``num_siblings`` - 1 others
    like it at once (e.g. the cells of ``megatron-sat sweep --jobs``), so that its
    :func:`configure_threads` takes its share of the cores: ``MEGATRON_SAT_LOCAL_PROCESSES``
    = this process's own share times ``num_siblings``.

    Args:
        num_siblings: processes started to compute at the same time, >= 1.
        environ: this process's environment (default ``os.environ``).

    Raises:
        ValueError: on ``num_siblings`` < 1 or a malformed inherited value (named).
    """
    env = os.environ if environ is None else environ
    share = _positive_int(num_siblings, "num_siblings")
    if env.get(LOCAL_PROCESSES_ENV, "").strip():
        share *= _positive_int(env[LOCAL_PROCESSES_ENV], LOCAL_PROCESSES_ENV)
    return {LOCAL_PROCESSES_ENV: str(share)}
