#!/usr/bin/env bash
# Single-node torchrun launch, rendered by `megatron-sat launch` from the resolved config
# runs/qwen3_30b_a3b_sat_gspo_r3/launch/config.yaml. Re-render rather than edit: the plan below is what was validated.
# launch plan for qwen3_30b_a3b_sat_gspo_r3: launcher torchrun, device cuda
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
# batch: 4096 samples per step; per DP rank 4096 = 1024 micro-batches
# memory per trainer GPU (bf16 params, distributed optimizer, no offload: as built): 7,642,626,048 parameters -> params 14.2 GiB + grads 28.5 GiB + optimizer 85.4 GiB = 128.1 GiB of 140 GiB (headroom 11.9 GiB for activations)
# memory per trainer GPU (alternative: train.optimizer_cpu_offload=true with the distributed optimizer): 7,642,626,048 parameters -> params 14.2 GiB + grads 28.5 GiB + optimizer 0.0 GiB = 42.7 GiB of 140 GiB (headroom 97.3 GiB for activations)
# memory per rollout device: bf16 weights 14.2 GiB (TP 4); the rest is the server's KV cache
# note: objective.kl_coef > 0: the reference policy waits in host memory, 28.5 GiB per trainer rank while it is swapped in (its weights and the policy's), none on the device
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

URLS=()
CUDA_VISIBLE_DEVICES=4,5,6,7 "$PY" -m sglang.launch_server --model-path checkpoints/Qwen3-30B-A3B-Base --host 127.0.0.1 --port 30000 --tp-size 4 --enable-return-routed-experts --weight-version 0 --enable-deterministic-inference --random-seed 1234 --mem-fraction-static 0.8 > "$LOG_DIR/server_0.log" 2>&1 &
SERVER_PIDS+=($!)
URLS+=("\"http://127.0.0.1:30000\"")
wait_healthy "http://127.0.0.1:30000" "${SERVER_PIDS[0]}" "$LOG_DIR/server_0.log"
SERVER_URLS="[$(IFS=,; echo "${URLS[*]}")]"
echo "rollout servers: $SERVER_URLS" >&2
MASTER_PORT=29500
set +e
CUDA_VISIBLE_DEVICES=0,1,2,3 "$PY" -m megatron_sat.platform.torchrun --nnodes=1 --node-rank=0 --nproc-per-node=4 --master-addr=127.0.0.1 --master-port="$MASTER_PORT" -m megatron_sat.cli train --config runs/qwen3_30b_a3b_sat_gspo_r3/launch/config.yaml ${SERVER_URLS:+"rollout.server_urls=$SERVER_URLS"} 2>&1 | tee "$LOG_DIR/trainer_node0.log"
status=${PIPESTATUS[0]}
set -e
echo "trainer exited with status $status" >&2
exit "$status"
