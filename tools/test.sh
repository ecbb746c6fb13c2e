#!/usr/bin/env bash
# The test command: set-up (idempotent), lint, the house checks, then the suite in two tiers:
# the fast tests (not marked slow) first, and the slow ones only when those pass.
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
# The house: imports only point down the README's layers, no cycle, functions in budget.
python tools/check_layers.py
python tools/check_sizes.py

# pytest exits 5 when it collected no test.
run_pytest() {
  set +e
  python -m pytest "$@"
  status=$?
  set -e
}
for arg in "$@"; do
  if [[ $arg == -m || $arg == -m* ]]; then
    # The caller chose the markers: one run, as asked (a second -m would replace ours).
    run_pytest "$@"
    if [[ $status -eq 5 ]]; then
      echo "pytest collected no tests" >&2
      exit 1
    fi
    exit $status
  fi
done
# Fast tier first, so a broken unit fails in minutes; then the slow tier. Either may select
# nothing (a file of slow tests only, or none), but not both: collecting no test at all is a
# failure of the suite, not a pass.
run_pytest -m "not slow" "$@"
fast=$status
if [[ $fast -ne 0 && $fast -ne 5 ]]; then
  exit $fast
fi
run_pytest -m slow "$@"
if [[ $status -eq 5 ]]; then
  if [[ $fast -eq 5 ]]; then
    echo "pytest collected no tests" >&2
    exit 1
  fi
  exit 0
fi
exit $status
