#!/usr/bin/env bash
# What the handoff costs on one GPU host, in one command: the byte rates of whole handoffs
# (stream, stream+process, tcp) against raw TCP loopback (benchmarks/handoff.py), then time
# to first token and 16 concurrent prompts in process against the split, both workers on the
# one GPU under an MPS daemon of the run's own (benchmarks/ttft.py --mps); both tables last.
#
#   bash benchmarks/handoff_gpu.sh OUT_DIR [TRANSPORTS] [LENGTHS]
#
# TRANSPORTS (auto,tcp,stream+process,stream+thread: every path a cross-host pair can take,
# the one-host default, and the byte stream written by the prefill worker's send process and
# by its own threads) are the TTFT run's --transports, LENGTHS (2048,8192,32768) the
# prompt lengths of both. Writes OUT_DIR/handoff.json, ttft.json and each run's log.
# PYTHON picks the interpreter (default: python). Needs the `gpu` extra and a CUDA device;
# the first run on a machine compiles FlashInfer's kernels (minutes).
# SMOKE=1 runs the same steps on the CPU with the tiny model at short prompts, without MPS (a
# check of the script, a minute or two; its figures mean nothing for a GPU host).
set -euo pipefail
OUT=${1:?usage: bash benchmarks/handoff_gpu.sh OUT_DIR [TRANSPORTS] [LENGTHS]}
TRANSPORTS=${2:-auto,tcp,stream+process,stream+thread}
LENGTHS=${3:-2048,8192,32768}
PY=${PYTHON:-python}
SHAPE=qwen3.5-4b TTFT_ARGS=(--device cuda --mps)
if [ "${SMOKE:-0}" = 1 ]; then
    LENGTHS=64,256 SHAPE=tiny
    TTFT_ARGS=(--device cpu --model tiny --concurrent 4 --concurrent-len 64 --concurrent-new 16
               --num-pages 512 --max-prefill-tokens 256)
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

"$PY" -m benchmarks.handoff --shapes "$SHAPE" --lengths "$LENGTHS" --repeats 3 \
    --transports stream,stream+process,tcp --tcp-connections 1 --raw-tcp-only \
    --out "$OUT/handoff.json" \
    > "$OUT/handoff.log" 2>&1
"$PY" -m benchmarks.ttft "${TTFT_ARGS[@]}" --repeats 2 --lengths "$LENGTHS" \
    --transports "$TRANSPORTS" --out "$OUT/ttft.json" > "$OUT/ttft.log" 2>&1
echo "== byte rates (benchmarks/handoff.py)"
sed -n '/^whole handoffs/,$p' "$OUT/handoff.log"
echo "== time to first token (benchmarks/ttft.py ${TTFT_ARGS[*]})"
sed -n '/^case/,$p' "$OUT/ttft.log"
