#!/usr/bin/env bash
# The test command: set-up (idempotent), lint, then the whole suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/bootstrap.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# Idle OpenMP workers sleep instead of spinning on cores other processes need (the count
# above is unchanged, so are the numbers): megatron_sat/platform/threads.py, bench/cpu_contention.py.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
ruff check .
ruff format --check .
set +e
python -m pytest "$@"
status=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
if [[ $status -eq 5 ]]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit $status
