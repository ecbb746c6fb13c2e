#!/usr/bin/env bash
# Stop the daemons that examples/local_cluster/slurm_up.sh STATE_DIR started, by their recorded
# pids (never by name), munged included (slurm_up.sh runs its own, under STATE_DIR).
set -euo pipefail
state="${1:?usage: slurm_down.sh STATE_DIR}"
for pidfile in "$state/slurmd.pid" "$state/slurmctld.pid" "$state/munge/munged.pid"; do
  if [[ -f "$pidfile" ]]; then
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$pidfile"
  fi
done
