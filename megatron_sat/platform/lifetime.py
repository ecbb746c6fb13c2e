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
  i.e. once the trainer and its children are gone.

Only Linux has the signal; elsewhere the helpers do nothing and say so (``False``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
    import os

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
