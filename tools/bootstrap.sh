#!/usr/bin/env bash
# Creates .venv with the pinned CPU environment and installs megatron_sat editable.
# Idempotent: a stamp holding the hash of the requirements and setup.py skips all work when
# nothing changed, so a second run costs well under a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
req="$root/tools/requirements-cpu.txt"
stamp="$venv/.megatron_sat_stamp"
want="$(cat "$req" "$root/setup.py" | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# The local mirrors print one "is ignored" warning per package; they are harmless.
export PIP_NO_WARN_SCRIPT_LOCATION=1
echo "[bootstrap] installing the pinned CPU environment into $venv (first run only)" >&2
# torch alone first, pinned, so no later resolve can swap in a CUDA build.
{
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -r "$req"
  "${pip[@]}" --no-deps --ignore-requires-python "megatron-core==0.19.2"
  "${pip[@]}" --no-deps -e "$root"
} 2>&1 | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
# The pipe hides pip's exit status: check the result instead of trusting it.
"$venv/bin/python" -c "import torch, megatron.core, transformers, megatron_sat" \
  || { echo "[bootstrap] installation failed (see pip output above)" >&2; exit 1; }
echo "$want" > "$stamp"
echo "[bootstrap] done" >&2
