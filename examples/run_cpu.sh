#!/usr/bin/env bash
# The main job on a CPU machine, from a fresh clone: set-up, data, warm start, RL.
# Extra arguments are config overrides, e.g. `objective.name=gspo train.use_r3=false`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/bootstrap.sh
# shellcheck disable=SC1091
source .venv/bin/activate
# Two cores: the trainer and the rollout server take turns, each may use both.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# Idle OpenMP workers sleep instead of spinning on cores other processes need (the count
# above is unchanged, so are the numbers): megatron_sat/platform/threads.py, bench/cpu_contention.py.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
if [[ ! -f data/arith/test.jsonl ]]; then
  python tools/make_arith_dataset.py --out-dir data/arith --seed 0 \
    --num-train 15000 --num-test 500 --max-digits 2 --ops +,-
fi
if [[ ! -f checkpoints/warm_start/model.safetensors ]]; then
  megatron-sat warm-start --out-dir checkpoints/warm_start --num-steps 1500 --lr 2e-3
fi
megatron-sat train --config examples/configs/tiny_cpu_sat_gspo_r3.yaml "$@"
