"""A preemption-safe stop: SIGTERM, SIGUSR1 or SIGINT asks the run to stop after its step.

The first signal only sets a flag (``StopRequest.signal_name``) and prints one line. The RL
loop reads the flag where a step decides whether it saves (``training.rl``: just before the
schedule's push and pool export), so the step in progress finishes, a run checkpoint of it is
written (also when ``train.save_every`` would not have saved it), the servers are stopped and
the process exits 0 with a line saying how to resume. A rollout batch of several optimizer
steps (``train.global_batch_size``, ``train.num_epochs``) in ``rollout.mode=sync`` also reads
it after each of its optimizer steps but the last: a stop then takes effect after the current
optimizer step, with a run checkpoint ``step_N_mini_j`` holding every rank's share of the
pending batch (``training.saving.save_mid_batch``); the resumed run finishes that batch's
remaining steps and goes on as the uninterrupted run. (In the asynchronous modes the pool's
exported state is defined at a weight push, once per rollout batch, so a stop there waits for
the batch's end.) A signal that comes after that decision
point is honoured by the next step, which saves. A second signal stops at once: the handler
restores the system's default action and sends the signal again, so the process ends by that
signal (no traceback; children end with it, ``platform.lifetime``). The last committed run
checkpoint is then what a resume starts from.

Which signals: SIGTERM is what SLURM sends at preemption and at the time limit (after
``KillWait``, SIGKILL), and what torchrun's agent forwards to its workers when it is
terminated (it kills them 30 s later: ``torch.distributed.elastic``'s ``close`` timeout);
SIGUSR1 is the signal a batch script asks for ahead of the time limit
(``#SBATCH --signal=B:USR1@<s>``, see ``launch.render``); SIGINT is Ctrl-C.

Every trainer rank installs the handler; rank 0 decides (its followers only mirror rank 0's
commands, so a signal that reaches only a follower is noted there and has no effect until
rank 0 gets one too: the launchers deliver a job's signal to every rank).

Handlers can only be installed from the main thread (Python's rule); elsewhere ``install``
raises.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Whether a stop signal arrived, and which (``signal_name``: ``"SIGTERM"``, ...)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def handle(self, signum: int, frame: object = None) -> None:
        """The signal handler: the first signal asks for a stop, the second ends the process
        by that signal's default action."""
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            print(
                f"megatron-sat: {name}: finishing the current step, saving a run checkpoint "
                "and stopping (a second signal stops at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        print(f"megatron-sat: second signal ({name}): stopping now", file=sys.stderr, flush=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle ``STOP_SIGNALS`` with ``handle`` inside the block; the previous handlers
        come back after it.

        Raises:
            RuntimeError: outside the main thread (Python installs handlers only there).
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopRequest.installed needs the main thread (signal handlers)")
        previous = {sig: signal.signal(sig, self.handle) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def resume_hint(run_dir: object, step: int, signal_name: str, mini_step: int = 0) -> str:
    """The line printed when a run stopped on ``signal_name`` after ``step`` (and
    ``mini_step`` optimizer steps of the next rollout batch)."""
    where = f"step {step}"
    if mini_step:
        where += f" and optimizer step {mini_step} of step {step + 1}"
    return (
        f"megatron-sat: stopped by {signal_name} after {where}; its run checkpoint is in "
        f"{run_dir}/checkpoints. Resume with the same command and train.resume=true"
    )
