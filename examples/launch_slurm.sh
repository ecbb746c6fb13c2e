#!/usr/bin/env bash
# Validate a run config and start it with slurm: `megatron-sat launch` resolves the plan (the
# same checks as --dry-run; it stops here with a message naming the bad field), writes the
# resolved config and the sbatch script into <run_dir>/launch/, and this script submits it.
# Usage: bash examples/launch_slurm.sh CONFIG [section.field=value ...]
#   SBATCH_ARGS="--wait" blocks until the job ends (or export SBATCH_WAIT=1); logs: <run_dir>/logs.
#   PYTHON: interpreter with megatron-sat installed (default: this checkout's .venv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$root/.venv/bin/python}"
config="${1:?usage: launch_slurm.sh CONFIG [section.field=value ...]}"
shift
script="$("$PY" -m megatron_sat.cli launch --config "$config" --launcher slurm "$@")"
exec sbatch ${SBATCH_ARGS:-} "$script"  # SBATCH_ARGS unquoted: several flags
