#!/usr/bin/env bash
# Validate a run config and start it with torchrun: `megatron-sat launch` resolves the plan (the
# same checks as --dry-run; it stops here with a message naming the bad field), writes the
# resolved config and the single-node torchrun script into <run_dir>/launch/, and this script runs it.
# Usage: bash examples/launch_torchrun.sh CONFIG [section.field=value ...]
#   PYTHON: interpreter with megatron-sat installed (default: this checkout's .venv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$root/.venv/bin/python}"
config="${1:?usage: launch_torchrun.sh CONFIG [section.field=value ...]}"
shift
script="$("$PY" -m megatron_sat.cli launch --config "$config" --launcher torchrun "$@")"
exec bash "$script"
