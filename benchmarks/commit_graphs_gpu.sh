#!/usr/bin/env bash
# A greedy DFLASH step with the commit graphs against the same step with acceptance and commit
# launched one by one, for the built-in trained pair on one CUDA GPU, in one run:
#
#   bash benchmarks/commit_graphs_gpu.sh OUT_DIR [profile|speed|all]
#
# profile: benchmarks/profile_step.py at batch 1 and 8, each way (the step's wall time and its
#          phases, synchronised); speed: benchmarks/dflash_tau.py's in-process decode tokens/s
#          with and without the draft at batch 1, 8 and 32, each way (each with its own plain
#          baseline), on the held-out files of this interpreter's standard library.
# Writes OUT_DIR/*.json and *.txt, and prints a table of both last. PYTHON picks the
# interpreter (default: python).
set -euo pipefail
OUT=${1:?usage: bash benchmarks/commit_graphs_gpu.sh OUT_DIR [profile|speed|all]}
STAGE=${2:-all}
PY=${PYTHON:-python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

profile() {
    for batch in 1 8; do
        for mode in graphs alone; do
            local flag=()
            if [ "$mode" = alone ]; then flag=(--no-commit-graphs); fi
            "$PY" -m benchmarks.profile_step --model pycoder --draft pycoder --batch "$batch" \
                "${flag[@]}" --out "$OUT/profile_${mode}_b$batch.json" \
                > "$OUT/profile_${mode}_b$batch.txt" 2>&1
        done
    done
}

speed() {
    if [ ! -s "$OUT/corpus/eval.jsonl" ]; then
        "$PY" -m common.training.corpus --out "$OUT/corpus" > "$OUT/corpus.log" 2>&1
    fi
    for mode in graphs alone; do
        local flag=()
        if [ "$mode" = alone ]; then flag=(--no-commit-graphs); fi
        "$PY" -m benchmarks.dflash_tau --model pycoder --draft pycoder \
            --data "$OUT/corpus/eval.jsonl" --blocks 16 --temperatures 0 --num-prompts 32 \
            --prompt-tokens 128 --max-new-tokens 256 --speed-batches 1,8,32 --device cuda \
            "${flag[@]}" --json "$OUT/tau_$mode.json" > "$OUT/tau_$mode.txt" 2>&1
    done
}

case "$STAGE" in
    profile) profile ;;
    speed) speed ;;
    all) profile; speed ;;
    *) echo "unknown stage $STAGE (profile, speed or all)" >&2; exit 2 ;;
esac

OUT="$OUT" "$PY" - <<'EOF'
import json, os
from pathlib import Path

out = Path(os.environ["OUT"])
rows = []
for batch in (1, 8):
    cells = {}
    for mode in ("graphs", "alone"):
        f = out / f"profile_{mode}_b{batch}.json"
        if f.exists():
            d = json.loads(f.read_text())
            cells[mode] = (d["dflash_profile"]["wall_ms"], d["decode"]["wall_ms"],
                           d["dflash"].get("accept", 0) + d["dflash"].get("commit", 0))
    if cells:
        rows.append((batch, cells))
if rows:
    print("DFLASH step, pycoder pair (ms): unprofiled step wall | plain decode step in the "
          "same run | synchronised accept + commit")
    print(f"{'batch':>5} {'graphs step':>12} {'plain':>7} {'acc+com':>8} "
          f"{'alone step':>11} {'plain':>7} {'acc+com':>8}")
    for batch, c in rows:
        g, a = c.get("graphs", (0, 0, 0)), c.get("alone", (0, 0, 0))
        print(f"{batch:>5} {g[0]:>12.3f} {g[1]:>7.3f} {g[2]:>8.3f} {a[0]:>11.3f} {a[1]:>7.3f} "
              f"{a[2]:>8.3f}")
speeds = {m: json.loads((out / f"tau_{m}.json").read_text())
          for m in ("graphs", "alone") if (out / f"tau_{m}.json").exists()}
if speeds:
    print("\nin-process decode tokens/s, block 16, greedy (each with its own plain baseline)")
    print(f"{'batch':>5} {'mode':>7} {'plain':>9} {'dflash':>9} {'speedup':>8} {'tau':>5}")
    for m, d in speeds.items():
        for s in d["speed"]:
            print(f"{s['batch']:>5} {m:>7} {s['plain_tokens_per_s']:>9.1f} "
                  f"{s['dflash_tokens_per_s']:>9.1f} {s['speedup']:>7.2f}x {s['tau']:>5.2f}")
EOF
