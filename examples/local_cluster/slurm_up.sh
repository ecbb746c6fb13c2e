#!/usr/bin/env bash
# Start a single-node SLURM (munged + slurmctld + slurmd, Debian's packages) on this machine,
# to try the sbatch path without a cluster. This is what tests/test_launch_cluster.py uses.
#
# Usage: bash examples/local_cluster/slurm_up.sh STATE_DIR [NUM_CPUS]
#   Installs the packages with apt-get when missing (needs root), writes STATE_DIR/slurm.conf
#   (its own ports, munge socket and key, spool and pid files under STATE_DIR; /etc/slurm and
#   /etc/munge are not touched), starts the daemons and waits until the node is idle.
#   Then: export SLURM_CONF=STATE_DIR/slurm.conf.
#   NUM_CPUS (default 8) is the node's CPU count as SLURM sees it (config_overrides lets it
#   exceed the real cores, so that trainer and server job steps fit on a 2-core machine).
# Stop with examples/local_cluster/slurm_down.sh STATE_DIR (kills by the recorded pids only).
# Exit status 3: packages missing and apt-get unavailable.
set -euo pipefail
state="$(mkdir -p "${1:?usage: slurm_up.sh STATE_DIR [NUM_CPUS]}" && cd "$1" && pwd)"
num_cpus="${2:-8}"
missing=0
for tool in slurmctld slurmd sbatch munged; do
  command -v "$tool" >/dev/null || missing=1
done
if [[ $missing == 1 ]]; then
  command -v apt-get >/dev/null || { echo "slurm_up: SLURM missing and no apt-get" >&2; exit 3; }
  echo "slurm_up: installing slurmctld slurmd slurm-client munge" >&2
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    slurmctld slurmd slurm-client munge >&2
fi

# munge: a daemon of our own (key, socket, pid and log under STATE_DIR), so that this cluster
# neither depends on nor disturbs a system munged or another test's cluster on the machine.
munge_dir="$state/munge"
mkdir -p "$munge_dir"
chmod 755 "$munge_dir"
if [[ ! -s "$munge_dir/munge.key" ]]; then
  dd if=/dev/urandom of="$munge_dir/munge.key" bs=1024 count=1 status=none
  chmod 400 "$munge_dir/munge.key"
fi
socket="$munge_dir/munge.socket"
if ! munge -n -S "$socket" </dev/null >/dev/null 2>&1; then
  # --force: run as root (the daemon's files are root's, in STATE_DIR).
  /usr/sbin/munged --force --socket="$socket" --key-file="$munge_dir/munge.key" \
    --pid-file="$munge_dir/munged.pid" --log-file="$munge_dir/munged.log" \
    --seed-file="$munge_dir/munged.seed"
  for _ in $(seq 50); do munge -n -S "$socket" </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n -S "$socket" </dev/null >/dev/null \
    || { echo "slurm_up: munged did not start; $munge_dir/munged.log" >&2; exit 1; }
fi

host="$(hostname -s)"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
mkdir -p "$state/ctld" "$state/d" "$state/log"
if [[ ! -f "$state/slurm.conf" ]]; then
  cat > "$state/slurm.conf" <<CONF
ClusterName=megatron-sat-local
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$socket
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${num_cpus} State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
fi
export SLURM_CONF="$state/slurm.conf"
alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
alive "$state/slurmctld.pid" || slurmctld -f "$SLURM_CONF"
alive "$state/slurmd.pid" || slurmd -f "$SLURM_CONF"
for _ in $(seq 150); do
  if sinfo -h -N -o '%t' 2>/dev/null | grep -qx 'idle'; then
    echo "slurm_up: node ${host} idle; export SLURM_CONF=$SLURM_CONF" >&2
    exit 0
  fi
  sleep 0.2
done
echo "slurm_up: node not idle after 30 s; logs in $state/log" >&2
sinfo -N >&2 || true
tail -n 20 "$state/log/"*.log >&2 || true
exit 1
