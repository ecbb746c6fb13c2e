#!/usr/bin/env bash
# The test command: set-up (idempotent), lint, then the whole suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/bootstrap.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
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
