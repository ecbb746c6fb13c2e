"""``python -m megatron_sat.platform.torchrun <torchrun arguments>``: torch's
``torch.distributed.run`` with two changes in the agent process, applied by explicit calls:

- its static rendezvous store listens on ``--master-addr`` only
  (``platform.stores.patch_static_rendezvous``);
- SIGUSR1 is passed on to its workers (the trainer ranks), which stop after their step with a
  run checkpoint (``training.stop``), and the agent then ends with their status. torchrun's
  agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT itself (``TORCHELASTIC_SIGNALS_TO_HANDLE``)
  by sending the signal to the workers and SIGKILL 30 s later, and dies of SIGUSR1 (its default
  action), so a stop that needs more than 30 s comes through SIGUSR1 (the rendered sbatch
  script asks SLURM for it ahead of the time limit).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def worker_pids(parent: int) -> list[int]:
    """The live processes whose parent is ``parent`` (torchrun's workers run in sessions of
    their own, so a process group signal does not reach them). Linux's /proc."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:  # field 4, after "(comm)"
            pids.append(int(entry))
    return pids


def forward_to_workers(signum: int, frame: object = None) -> None:
    """Signal handler of the agent: ``signum`` to each of its workers."""
    for pid in worker_pids(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def main() -> None:
    from torch.distributed.run import main as torchrun_main

    from megatron_sat.platform.stores import patch_static_rendezvous

    patch_static_rendezvous()
    signal.signal(signal.SIGUSR1, forward_to_workers)
    torchrun_main()


if __name__ == "__main__":
    main()
