"""Child processes that end with the trainer, also when it is killed with SIGKILL.

A SIGKILLed process runs no handler, atexit or finaliser, so its children can only be ended
by the kernel: Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, see
``prctl(2)``) is delivered to a child when the thread that created it exits. It is set in the
child, so it must be set between ``fork`` and the child's own code:

- ``install_fork_pdeathsig`` registers an ``os.register_at_fork`` hook: every child this
  process forks from now on (multiprocessing's ``fork`` context: megatron-core's checkpoint
  writer workers) gets the signal set before it runs anything;
- ``fork_manager_for_dist_checkpointing`` gives megatron-core's checkpoint writer a results
  queue served by a *forked* manager (megatron-core 0.19 starts a ``spawn`` ``Manager``, a
  fresh interpreter the hook cannot reach, which outlived a killed trainer);
- multiprocessing's resource tracker reads a pipe every child inherits and exits at its EOF,
  i.e. once the trainer and its children are gone;
- a child that runs another program (``subprocess.Popen``: the embedded rollout servers) gets
  ``parent_env()`` in its environment and calls ``end_with_parent()`` first thing: it sets the
  signal itself (it survives ``execve``, but ``preexec_fn`` is unsafe in a threaded trainer)
  and then checks that its parent is still the process that started it, since a parent killed
  before the ``prctl`` (e.g. while the child imports torch) would never send it. The signal
  follows the parent *thread*, so it is set only for a child started from the main thread
  (a worker thread may end long before the trainer); the others, and every child, also poll
  their parent (the backstop, within ``poll_s``).

Only Linux has the signal; elsewhere the helpers do nothing and say so (``False``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_PID_ENV = "MEGATRON_SAT_PARENT_PID"  # the pid the child must see as its parent
PDEATHSIG_ENV = "MEGATRON_SAT_PDEATHSIG"  # "1": the child sets the parent-death signal


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits.

    Returns:
        True when set; False off Linux.

    Raises:
        OSError: when ``prctl`` fails (errno named).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG, {int(sig)}) failed")
    return True


@functools.cache
def install_fork_pdeathsig() -> bool:
    """Every child forked by this process from now on dies with it (SIGKILL). Idempotent.

    Returns:
        True when installed; False off Linux.
    """
    if not sys.platform.startswith("linux"):
        return False
    os.register_at_fork(after_in_child=set_pdeathsig)
    return True


@functools.cache
def fork_manager_for_dist_checkpointing() -> bool:
    """Make megatron-core's checkpoint writer create its results queue in a forked manager
    (which, after ``install_fork_pdeathsig``, dies with the trainer) instead of the spawned
    one it would start. Idempotent; the manager starts at the first save, as before.

    megatron-core 0.19's ``strategies/filesystem_async.get_write_results_queue`` keeps the
    queue in the module global ``_results_queue``; the writer looks the function up in that
    module's namespace at every save, so replacing it there is enough.

    Returns:
        True when installed; False off Linux.
    """
    if not install_fork_pdeathsig():
        return False
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def get_write_results_queue(mp_mode: str = "spawn"):
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()
        return filesystem_async._results_queue

    filesystem_async.get_write_results_queue = get_write_results_queue
    return True


def parent_env() -> dict[str, str]:
    """Environment entries for a child process (``subprocess.Popen(env=...)``) that calls
    ``end_with_parent``: this process's pid, and whether the child may set the parent-death
    signal (only when started from the main thread, which lives as long as the process)."""
    main = threading.current_thread() is threading.main_thread()
    return {PARENT_PID_ENV: str(os.getpid()), PDEATHSIG_ENV: "1" if main else "0"}


def end_with_parent(poll_s: float = 2.0, on_exit=None) -> int:
    """In a child started with ``parent_env()``: end this process when its parent ends, also
    when the parent is SIGKILLed. Call it before any slow start-up work.

    Sets ``PR_SET_PDEATHSIG`` (SIGKILL) when allowed, then exits at once (``os._exit(0)``)
    if the parent is already gone, then starts a daemon thread that polls ``os.getppid()``
    every ``poll_s`` seconds and exits when it changes. Without ``parent_env()`` the parent
    is whatever ``os.getppid()`` is now, and only the poll runs.

    Args:
        poll_s: seconds between two looks at the parent pid.
        on_exit: called with the parent pid just before a polled exit (e.g. a log line).

    Returns:
        The parent pid watched.
    """
    expected = os.environ.get(PARENT_PID_ENV)
    parent = int(expected) if expected else os.getppid()
    if expected and os.environ.get(PDEATHSIG_ENV) == "1":
        set_pdeathsig()
    if os.getppid() != parent:  # it died before the signal was set: nobody will send it
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        if on_exit is not None:
            on_exit(parent)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return parent
