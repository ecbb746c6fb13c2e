#!/usr/bin/env bash
# Creates the separate SGLang environment (.cache/sglang-env, or $MEGATRON_SAT_SGLANG_ENV) that
# the launch scripts start SGLang servers from (launch.sglang_env). CUDA machines only: sglang
# 0.5.23 pins its own torch (2.14.1), transformers (5.19.0) and a CUDA 13 flashinfer, which must
# never be resolved together with the trainer's torch and transformer-engine build.
# Idempotent: a stamp holding the hash of this script skips all work when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGATRON_SAT_SGLANG_ENV:-$root/.cache/sglang-env}"
stamp="$venv/.megatron_sat_sglang_stamp"
want="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[sglang_env] no CUDA device here: SGLang servers run on GPUs (the CPU job uses the" \
    "embedded server, launch.rollout_engine=embedded)" >&2
  exit 1
fi
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
echo "[sglang_env] installing sglang 0.5.23 into $venv (its own torch and CUDA kernels)" >&2
"$venv/bin/python" -m pip install --disable-pip-version-check -q "sglang==0.5.23"
"$venv/bin/python" - <<'PY' || { echo "[sglang_env] installation failed (see pip output above)" >&2; exit 1; }
import importlib.metadata as md
assert md.version("sglang") == "0.5.23", md.version("sglang")
import sglang.launch_server  # noqa: F401  the module the launch scripts run
PY
echo "$want" > "$stamp"
echo "[sglang_env] done: launch.sglang_env=$venv" >&2
