#!/usr/bin/env bash
# Open MPI launch, rendered by `megatron-sat launch` from the resolved config
# runs/qwen3_30b_a3b_sat_gspo_r3/launch/config.yaml. Re-render rather than edit: the plan below is what was validated.
# launch plan for qwen3_30b_a3b_sat_gspo_r3: launcher mpirun, device cuda
# model: Qwen3MoeForCausalLM from examples/models/qwen3_30b_a3b.json: 30,532,122,624 parameters (29,909,792,768 without embeddings), 48 layers, 128 experts, top-8
# allocation: 1 node(s) x 8 GPUs = 8; trainer 4 (nodes 0, devices 0-3), rollout 4 (1 sglang server(s) x TP 4)
# trainer: world 4 = TP 4 x PP 1 x DP 1 (CP 1); experts: EP 4 x expert-TP 1 x expert-DP 1; sequence parallel on
#   rank node dev  tp pp dp  ep etp edp  holds
#   0    0    0    0  0  0   0  0   0    layers 0-47, attention shard 0/4, experts 0-31, embedding rows 0-37983, output layer shard
#   1    0    1    1  0  0   1  0   0    layers 0-47, attention shard 1/4, experts 32-63, embedding rows 37984-75967, output layer shard
#   2    0    2    2  0  0   2  0   0    layers 0-47, attention shard 2/4, experts 64-95, embedding rows 75968-113951, output layer shard
#   3    0    3    3  0  0   3  0   0    layers 0-47, attention shard 3/4, experts 96-127, embedding rows 113952-151935, output layer shard
# process groups (megatron-core order tp-cp-ep-dp-pp):
#   tensor parallel          [[0, 1, 2, 3]]
#   pipeline parallel        [[0], [1], [2], [3]]
#   data parallel            [[0], [1], [2], [3]]
#   model parallel (tp-pp)   [[0, 1, 2, 3]]
#   expert parallel          [[0, 1, 2, 3]]
#   expert tensor parallel   [[0], [1], [2], [3]]
#   expert data parallel     [[0], [1], [2], [3]]
# rollout servers (launcher):
#   server 0: node 0, devices 4,5,6,7, port 30000, sglang --tp-size 4 --enable-return-routed-experts; weight-sync ranks 1-4
# weight sync: one group of 5 ranks (trainer rank 0 = group rank 0, hosts the store; 4 server ranks), backend nccl
# batch: 4096 samples per step; per DP rank 4096 = token-budget micro-batches (count set by the lengths)
# memory per trainer GPU (bf16 params, distributed optimizer, optimizer offloaded to CPU: as built): 7,642,626,048 parameters -> params 14.2 GiB + grads 28.5 GiB + optimizer 0.0 GiB = 42.7 GiB of 139 GiB (headroom 96.3 GiB for activations)
# memory per trainer GPU (alternative: train.optimizer_cpu_offload=false): 7,642,626,048 parameters -> params 14.2 GiB + grads 28.5 GiB + optimizer 85.4 GiB = 128.1 GiB of 139 GiB (headroom 10.9 GiB for activations)
# memory per trainer GPU, one RL step (transformer_engine kernels; largest micro-batch 32,768 tokens, train.max_tokens_per_micro_batch=32768; train.recompute_granularity=none):
#   parameters                      14.24 GiB
#   gradients                       28.47 GiB
#   optimizer states                 0.00 GiB
#   activations                     45.08 GiB
#   recompute working set            0.00 GiB
#   logits and loss                  7.02 GiB
#   micro-batch and R3 routes        0.08 GiB
#   no-grad pass results             0.40 GiB
#   reference policy                 0.00 GiB
#   CUDA/NCCL/TE workspaces          3.00 GiB
#   allocator fragmentation          5.22 GiB
#   total                          103.51 GiB of 139 GiB: fits
# memory per rollout device: bf16 weights 14.2 GiB (TP 4); the rest is the server's KV cache
# rollout pool host memory (rank0_host): up to 1 batch(es) x 4096 samples x 8,704 tokens (launch.max_prompt_tokens + rollout.max_new_tokens, the longest sample) x (384 B compact routes + 80 B ids, log-probs, versions) per token = 15.4 GiB (routes 12.8 GiB)
# host memory of trainer node 0: 532.6 GiB = 4 rank(s) x (85.4 offloaded optimizer + 28.5 reference policy + 15.4 batch share) + 15.4 rollout pool (the rollout servers' own processes not counted)
# note: memory plan: transformer_engine kernels; largest micro-batch 32,768 tokens (train.max_tokens_per_micro_batch=32768); micro-batches moved to the device one at a time; routes assumed balanced over the expert-parallel ranks
# note: reference policy in host memory (28.5 GiB per trainer rank while it is swapped in for its pass: its weights and the policy's); on the device it would take 14.2 GiB, which fits
# note: optimizer offload: 85.4 GiB of host memory per trainer rank (fp32 main weights and Adam moments)
set -euo pipefail
cd /path/to/megatron-sat
PY=.venv/bin/python
LOG_DIR=/path/to/megatron-sat/runs/qwen3_30b_a3b_sat_gspo_r3/logs
mkdir -p "$LOG_DIR"
SERVER_STARTUP_TIMEOUT_S=1800
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=8
FREE_PORT_PY='import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
HEALTH_PY='import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=5)'
wait_healthy() {  # URL PID LOG: poll URL/health until it answers, the server dies or time is up
  local deadline=$((SECONDS + SERVER_STARTUP_TIMEOUT_S))
  until "$PY" -c "$HEALTH_PY" "$1" 2>/dev/null; do
    if ! kill -0 "$2" 2>/dev/null; then
      echo "rollout server $1 exited before /health answered; log: $3" >&2
      tail -n 30 "$3" >&2 || true
      return 1
    fi
    if (( SECONDS >= deadline )); then
      echo "rollout server $1 not healthy after ${SERVER_STARTUP_TIMEOUT_S} s; log: $3" >&2
      return 1
    fi
    sleep 0.5
  done
  echo "rollout server $1 is up" >&2
}
SERVER_PIDS=()
stop_servers() {  # only the processes this script started, by pid
  local pid
  for pid in "${SERVER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${SERVER_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [[ -n "${KEY_FILE:-}" ]]; then rm -f "$KEY_FILE"; fi
}
trap stop_servers EXIT

KEYGEN_PY='import secrets
for name in ("api-key", "admin-api-key"):
    print(name + ": sk-" + secrets.token_urlsafe(32))'
REDACT_PY='import sys
keys = [line.split(":", 1)[1].strip() for line in open(sys.argv[1]) if ":" in line]
for line in sys.stdin:
    for key in keys:
        line = line.replace(key, "<redacted>")
    sys.stdout.write(line)
    sys.stdout.flush()'
# This job's server keys: made now, readable by this user only, never printed.
KEY_FILE="$LOG_DIR/server_keys.${SLURM_JOB_ID:-$$}.yaml"
(umask 077 && "$PY" -c "$KEYGEN_PY" > "$KEY_FILE")

# SGLang servers run from their own environment (launch.sglang_env).
SGLANG_PY=/path/to/megatron-sat/.cache/sglang-env/bin/python
[[ -x "$SGLANG_PY" ]] || { echo "no SGLang interpreter at $SGLANG_PY (launch.sglang_env; bash tools/sglang_env.sh makes one on a CUDA machine)" >&2; exit 1; }
# Open MPI hands this environment to local ranks: stale torchrun variables would give
# every rank the same identity.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
MPI_FLAGS=(--bind-to none)
[[ "$(id -u)" == 0 ]] && MPI_FLAGS+=(--allow-run-as-root)
URLS=()
mpirun "${MPI_FLAGS[@]}" -np 1 --host node0:1 -x PYTHONUNBUFFERED -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=4,5,6,7 "$SGLANG_PY" -m sglang.launch_server --model-path checkpoints/Qwen3-30B-A3B-Base --host node0 --port 30000 --config "$KEY_FILE" --tp-size 4 --enable-return-routed-experts --weight-version 0 --enable-deterministic-inference --random-seed 1234 --mem-fraction-static 0.8 > >("$PY" -u -c "$REDACT_PY" "$KEY_FILE" > "$LOG_DIR/server_0.log") 2>&1 &
SERVER_PIDS+=($!)
URLS+=("\"http://node0:30000\"")
wait_healthy "http://node0:30000" "${SERVER_PIDS[0]}" "$LOG_DIR/server_0.log"
SERVER_URLS="[$(IFS=,; echo "${URLS[*]}")]"
echo "rollout servers: $SERVER_URLS" >&2
MASTER_PORT=29500
set +e
mpirun "${MPI_FLAGS[@]}" -np 4 --host node0:4 --map-by ppr:4:node -x PYTHONUNBUFFERED -x OMP_NUM_THREADS -x CUDA_VISIBLE_DEVICES=0,1,2,3 -x MASTER_ADDR=node0 -x MASTER_PORT="$MASTER_PORT" --output-filename "$LOG_DIR/trainer" "$PY" -m megatron_sat.cli train --config runs/qwen3_30b_a3b_sat_gspo_r3/launch/config.yaml ${SERVER_URLS:+"rollout.server_urls=$SERVER_URLS"} "rollout.server_key_file=$KEY_FILE"
status=$?
set -e
echo "trainer exited with status $status" >&2
exit "$status"
