#!/usr/bin/env bash
# Wheelhouse for the one-GPU device check (tests/gpu/check_policy_trainer.py).
#
#   bash tools/gpu_wheelhouse.sh [OUT_DIR]        (default: wheelhouse/, git-ignored)
#
# Downloads, with --no-deps, the exact wheels of tools/gpu_wheelhouse.txt for the device image
# (CUDA torch 2.11, no megatron-core / TE / SGLang): Linux x86_64, CPython $PY_VERSIONS
# (default "3.12", the Python megatron-core declares; e.g. PY_VERSIONS="3.11 3.12" for both).
# Pure-python and abi3 wheels are shared by every version; numpy, pydantic-core, pyyaml and
# regex are per version. Prints the folder's size and fails when it is not under the device
# call's carry limit (64 MiB), since the folder travels with `run(carry=["wheelhouse"])`.
# The check installs from it what the image lacks (`pip install --no-index --no-deps
# --find-links <this folder> --target <a folder of its own>`; no network there).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-wheelhouse}"
py_versions="${PY_VERSIONS:-3.12}"
limit=$((64 * 1024 * 1024))
pip="${PIP:-python -m pip}"
mkdir -p "$out"
for py in $py_versions; do
  abi="cp${py/./}"
  # manylinux tags from new to old: pip takes the first wheel whose tag matches any of them
  # --ignore-requires-python: megatron-core 0.19 declares >=3.12 but runs on 3.11 (as in .venv)
  $pip download --quiet --no-deps --only-binary=:all: --ignore-requires-python --dest "$out" \
    --implementation cp --python-version "$py" --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -r tools/gpu_wheelhouse.txt
done
bytes=$(du -sb "$out" | cut -f1)
count=$(find "$out" -name '*.whl' | wc -l)
printf '{"wheelhouse": "%s", "python_versions": "%s", "wheels": %d, "bytes": %d, "mib": %.1f, "limit_mib": 64}\n' \
  "$out" "$py_versions" "$count" "$bytes" "$(echo "$bytes / 1048576" | bc -l)"
if [ "$bytes" -ge "$limit" ]; then
  echo "wheelhouse $out is $bytes bytes, not under the 64 MiB carry limit" >&2
  exit 1
fi
