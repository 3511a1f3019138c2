#!/usr/bin/env bash
# `flashsplit bench` against a local cluster of the Qwen3.5-4B shape (random weights) on one GPU:
# router + 1 prefill + 1 decode worker, both workers on the same device (`--mem-fraction` split
# by `up`), then the same sweep through the gRPC API.
#
#   bash benchmarks/serving_gpu.sh OUT_DIR [CONCURRENCIES] [NUM_PROMPTS] [INPUT_LEN] [OUTPUT_LEN]
#
# Writes OUT_DIR/bench_4b_h200.json and .png and the cluster's log; prints the table last.
# PYTHON picks the interpreter (default: python).
set -euo pipefail
OUT=${1:?usage: bash benchmarks/serving_gpu.sh OUT_DIR [CONC] [N] [IN] [OUT]}
CONC=${2:-1,4,16,64}
N=${3:-64}
IN=${4:-1024}
NEW=${5:-128}
PY=${PYTHON:-python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

MODEL=$("$PY" -c "from pathlib import Path; from benchmarks.ttft import random_checkpoint; \
print(random_checkpoint(Path('/tmp/flashsplit-bench')))")
PORT=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$PY" -m router.cli up --model "$MODEL" --port "$PORT" --device cuda --kernels gpu \
    --max-prefill-tokens 8192 > "$OUT/cluster.log" 2>&1 &
UP=$!
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    grep -q "router listening on" "$OUT/cluster.log" && break
    kill -0 $UP 2>/dev/null || { tail -40 "$OUT/cluster.log"; exit 1; }
    sleep 0.5
done
grep "listening on\| on 127" "$OUT/cluster.log" || true
"$PY" -m router.cli bench --url "127.0.0.1:$PORT" --concurrency "$CONC" --num-prompts "$N" \
    --input-len "$IN" --output-len "$NEW" --warmup 4 --no-progress \
    --json "$OUT/bench_4b_h200.json" --plot "$OUT/bench_4b_h200.png"
