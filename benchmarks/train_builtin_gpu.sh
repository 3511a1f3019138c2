#!/usr/bin/env bash
# Rebuild the built-in model `pycoder` and its DFLASH draft on one CUDA GPU, then measure τ.
#
#   bash benchmarks/train_builtin_gpu.sh OUT_DIR [STAGE] [TARGET_SECONDS] [DRAFT_SECONDS]
#
# STAGE: target | regen | draft | tau | serve | all (default: target, regen, draft, tau). Each
# stage reads what the one before wrote under OUT_DIR, so they can run as separate commands:
#   target (~6 min): the corpus (this interpreter's standard library, PSF licence, or CORPUS),
#          the BPE tokenizer, and the target (train_target's PYCODER_ARCH, 19.9M parameters)
#          trained for TARGET_SECONDS (default 300) of wall clock. On a GPU it compiles the
#          serving kernels beside the training (JIT_WARMUP, below), so the next stage does not
#          spend minutes on it;
#   regen  (~4 min): the target's own continuations of corpus prompts (data regeneration);
#   draft  (~8 min): the draft trained on them for DRAFT_SECONDS (default 420); it runs
#          `regen` first when the regenerated data is missing or older than the target;
#   tau    (~2 min): mean accept length at blocks 8 and 16, greedy and at temperature 0.7, on
#          the held-out files, and in-process decode tokens/s with and without the draft;
#   serve  (~3 min): output tokens/s through router -> prefill -> decode with DFLASH against
#          without, at 1, 8 and 32 requests in flight (benchmarks/dflash_serving.py).
# The defaults make the shipped pair (docs/training.md, "The built-in pair rebuilt on the full
# library"), given CORPUS: the full Python 3.11.7 library the shipped pair learnt from.
# ARCH=FILE trains another target shape (a JSON of Qwen3_5TextConfig fields, e.g.
# benchmarks/large_target_arch.json: about 280M parameters; benchmarks/small_target_arch.json:
# the 7.2M shape of the pycoder shipped before 2026-12-06); DRAFT_LAYERS (default 3),
# DRAFT_MLP (default 768; "" takes the target's) and TARGET_LAYER_IDS (default 0,...,7, every
# layer of the default target; "" picks z-lab's rule) shape its draft.
# CORPUS=DIR trains on a corpus written earlier by `python -m common.training.corpus` (e.g. on
# a machine whose Python carries its whole standard library, tests included: a slim
# interpreter's is a third of that, and a target trained on it over-fits) instead of this
# interpreter's. RESUME=1 continues the draft's training from its last checkpoint (a stage cut
# short). JIT_WARMUP=0 turns the target stage's kernel compilation off.
# On a GPU, REGEN_PROMPTS (24576) and REGEN_TOKENS (384) size the draft's regenerated data,
# REGEN_RUNNING (1024) is how many of its requests run at once (more for a small target, whose
# steps are bound by kernel launches rather than by rows), REGEN_WAVES=1 admits them a wave
# of REGEN_RUNNING at a time (`regenerate --waves`), and
# TAU_PROMPTS (64) and TAU_TOKENS (256) the τ benchmark: fewer for a larger target whose stage
# must fit a time limit. TARGET_BATCH (64) and DRAFT_BATCH (32) are the training batches in
# windows of 512 tokens: the larger target at 64 needs more than an 80 GB H100 holds (32 fits,
# about 49 GB). MPS=1 runs the serve stage's two workers under a CUDA MPS daemon (--mps);
# SERVE_WORKER_ARGS (space-separated) are more flags for its workers, e.g.
# "--speculative-disable-by-batch-size 16".
# REGEN_TEMPERATURES (0,0,0.7) are the regeneration's temperatures, prompt
# i continued at the (i mod n)-th.
# TARGET_DIR=DIR: the regen, draft, tau and serve stages take this target (e.g. the shipped
# common/model/weights/pycoder, to train a new draft for it) instead of OUT_DIR/pycoder; the
# corpus is then CORPUS (or this interpreter's library), written to OUT_DIR/corpus once.
# BASELINE_DRAFT=DIR|NAME: the tau stage also measures that draft's τ on the same prompts (no
# speed), in OUT_DIR/tau_baseline.json and .txt: the draft it replaces, measured beside it.
# KERNELS (auto) is the kernel set of every stage's serving-side model (gpu-fla where
# FlashInfer's GDN kernels lack their CuTe-DSL libraries).
# Results: OUT_DIR/pycoder and OUT_DIR/pycoder-dflash (checkpoints with provenance.json and
# loss.png), OUT_DIR/ship/ (the two checkpoints as they go into common/model/weights/),
# OUT_DIR/tau.json and tau.txt, OUT_DIR/serve.json and serve.txt. Needs the runtime, `train` and `gpu` extras (transformers,
# fla-core for the GDN backward); PYTHON picks the interpreter (default: python).
#
# SMOKE=1 runs every stage on the CPU at toy sizes (a check of the pipeline, minutes; nothing
# worth shipping):  SMOKE=1 bash benchmarks/train_builtin_gpu.sh /tmp/builtin all 10 10
set -euo pipefail

USAGE="usage: bash benchmarks/train_builtin_gpu.sh OUT_DIR [STAGE] [TARGET_S] [DRAFT_S]"
OUT=${1:?$USAGE}
STAGE=${2:-all}
TARGET_SECONDS=${3:-300}
DRAFT_SECONDS=${4:-420}
PY=${PYTHON:-python}
if [ "${SMOKE:-0}" = 1 ]; then
    DEVICE=cpu TARGET_BATCH=2 DRAFT_BATCH=2 SEQ=64 REGEN_PROMPTS=4 REGEN_TOKENS=32
    TAU_PROMPTS=2 TAU_TOKENS=8 SPEED=1,2 SERVE_TOKENS=8
else
    DEVICE=cuda TARGET_BATCH=${TARGET_BATCH:-64} DRAFT_BATCH=${DRAFT_BATCH:-32} SEQ=512
    REGEN_PROMPTS=${REGEN_PROMPTS:-24576} REGEN_TOKENS=${REGEN_TOKENS:-384}
    TAU_PROMPTS=${TAU_PROMPTS:-64} TAU_TOKENS=${TAU_TOKENS:-256} SPEED=1,8,32 SERVE_TOKENS=256
fi
ARCH_ARGS=()
if [ -n "${ARCH:-}" ]; then ARCH_ARGS=(--arch "$(cd "$(dirname "$ARCH")" && pwd)/$(basename "$ARCH")"); fi
LAYER_ID_ARGS=()
TARGET_LAYER_IDS=${TARGET_LAYER_IDS-0,1,2,3,4,5,6,7}
if [ -n "$TARGET_LAYER_IDS" ]; then LAYER_ID_ARGS=(--target-layer-ids "$TARGET_LAYER_IDS"); fi
DRAFT_MLP_ARGS=()
DRAFT_MLP=${DRAFT_MLP-768}
if [ -n "$DRAFT_MLP" ]; then DRAFT_MLP_ARGS=(--intermediate-size "$DRAFT_MLP"); fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -n "${CORPUS:-}" ]; then CORPUS=$(cd "$CORPUS" && pwd); fi
cd "$(dirname "$0")/.."
TARGET=$OUT/pycoder
if [ -n "${TARGET_DIR:-}" ]; then
    if [ "$STAGE" = target ] || [ "$STAGE" = all ]; then
        echo "TARGET_DIR names a trained target: the $STAGE stage would train another" >&2; exit 2
    fi
    TARGET=$(cd "$TARGET_DIR" && pwd)
fi
KERNELS=${KERNELS:-auto}

preflight() {
    DEVICE=$DEVICE "$PY" - <<'EOF'
import importlib.util, os, sys
import torch
on_gpu = os.environ["DEVICE"] == "cuda"
if on_gpu and not torch.cuda.is_available():
    sys.exit("error: no CUDA device")
print(f"device: {torch.cuda.get_device_name() if on_gpu else 'cpu'}, torch {torch.__version__}")
if importlib.util.find_spec("transformers") is None:
    sys.exit("error: transformers is missing (pip install -e '.[train]')")
if on_gpu and importlib.util.find_spec("fla") is None:
    print("warning: fla-core is missing: transformers trains the GDN layers with its "
          "plain-torch recurrence, far slower (pip install -e '.[gpu]')")
EOF
}

write_corpus() {
    if [ -n "${CORPUS:-}" ]; then
        if [ "$CORPUS" != "$OUT/corpus" ]; then rm -rf "$OUT/corpus" && cp -r "$CORPUS" "$OUT/corpus"; fi
    else
        "$PY" -m common.training.corpus --out "$OUT/corpus"
    fi
}

stage_target() {
    write_corpus
    local warm=""
    if [ "$DEVICE" = cuda ] && [ "${JIT_WARMUP:-1}" = 1 ]; then
        # The first serving-kernel use on a fresh machine compiles FlashInfer's modules (about
        # 220 s on the H200, on the CPU). They depend on the head size and dtype, not on the
        # model's size, so a short regeneration with the shipped target (heads of 128, bf16)
        # compiles them while this stage's training keeps the GPU busy; stages that follow on
        # the same machine find them in the cache.
        "$PY" -m common.training.regenerate --model pycoder --data "$OUT/corpus" \
            --out "$OUT/jit_warmup.jsonl" --num-prompts 8 --prompt-tokens 128 \
            --max-new-tokens 16 --max-running 8 --device cuda > "$OUT/jit_warmup.log" 2>&1 &
        warm=$!
    fi
    "$PY" -m common.training.bpe --corpus "$OUT/corpus" --out "$OUT/tokenizer" --vocab-size 8192
    "$PY" -m common.training.train_target --corpus "$OUT/corpus" --tokenizer "$OUT/tokenizer" \
        --out "$OUT/pycoder" --seconds "$TARGET_SECONDS" --batch-size "$TARGET_BATCH" \
        --seq-len "$SEQ" --device "$DEVICE" "${ARCH_ARGS[@]}"
    if [ -n "$warm" ]; then
        if wait "$warm"; then echo "kernels compiled beside the training ($OUT/jit_warmup.log)"
        else echo "warning: the kernel warm-up failed (see $OUT/jit_warmup.log)" >&2; fi
    fi
}

stage_regen() {
    if [ ! -f "$OUT/corpus/train.jsonl" ]; then write_corpus; fi
    "$PY" -m common.training.regenerate --model "$TARGET" --data "$OUT/corpus" \
        --out "$OUT/regen.jsonl" --num-prompts "$REGEN_PROMPTS" --prompt-tokens 128 \
        --max-new-tokens "$REGEN_TOKENS" --temperatures "${REGEN_TEMPERATURES:-0,0,0.7}" \
        --max-running "${REGEN_RUNNING:-1024}" --device "$DEVICE" --kernels "$KERNELS" \
        $([ "${REGEN_WAVES:-0}" = 1 ] && echo --waves)
}

stage_draft() {
    if [ ! "$OUT/regen.jsonl" -nt "$TARGET/model.safetensors" ]; then stage_regen; fi
    local resume=()
    if [ "${RESUME:-0}" = 1 ]; then resume=(--resume); else rm -rf "$OUT/pycoder-dflash"; fi
    "$PY" -m router.cli train-draft --target "$TARGET" --data "$OUT/regen.jsonl" \
        --out "$OUT/pycoder-dflash" --block-size 16 --layers "${DRAFT_LAYERS:-3}" "${LAYER_ID_ARGS[@]}" "${DRAFT_MLP_ARGS[@]}" \
        --seconds "$DRAFT_SECONDS" --batch-size "$DRAFT_BATCH" --seq-len "$SEQ" --anchors 32 \
        --lr 1e-3 --checkpoint-every 500 --device "$DEVICE" --kernels "$KERNELS" "${resume[@]}"
    rm -rf "$OUT/ship"
    mkdir -p "$OUT/ship/pycoder" "$OUT/ship/pycoder-dflash"
    cp "$TARGET"/{config.json,generation_config.json,model.safetensors,tokenizer.json} \
       "$TARGET"/{tokenizer_config.json,provenance.json,loss.png} "$OUT/ship/pycoder/"
    cp "$OUT"/pycoder-dflash/{config.json,model.safetensors,provenance.json,loss.png} \
       "$OUT/ship/pycoder-dflash/"
    du -sh "$OUT/ship"/*
}

# tau DRAFT NAME [ARGS...]: τ of DRAFT on the held-out prompts, in OUT/NAME.json and .txt
tau() {
    local draft=$1 name=$2
    shift 2
    "$PY" -m benchmarks.dflash_tau --model "$TARGET" --draft "$draft" \
        --data "$OUT/corpus/eval.jsonl" --blocks 8,16 --temperatures 0,0.7 \
        --num-prompts "$TAU_PROMPTS" --prompt-tokens 128 --max-new-tokens "$TAU_TOKENS" \
        --device "$DEVICE" --kernels "$KERNELS" --json "$OUT/$name.json" "$@" \
        | tee "$OUT/$name.txt"
}

stage_tau() {
    if [ -n "${BASELINE_DRAFT:-}" ]; then tau "$BASELINE_DRAFT" tau_baseline; fi
    tau "$OUT/pycoder-dflash" tau --speed-batches "$SPEED"
}

stage_serve() {
    local kernels=()
    if [ "$DEVICE" = cuda ]; then kernels=(--worker-arg=--kernels "--worker-arg=$KERNELS"); fi
    local mps=()
    if [ "${MPS:-0}" = 1 ]; then mps=(--mps); fi
    local flag
    for flag in ${SERVE_WORKER_ARGS:-}; do kernels+=("--worker-arg=$flag"); done
    "$PY" -m benchmarks.dflash_serving --model "$TARGET" --draft "$OUT/pycoder-dflash" \
        --data "$OUT/corpus/eval.jsonl" --concurrency "$SPEED" --output-len "$SERVE_TOKENS" \
        --device "$DEVICE" "${kernels[@]}" "${mps[@]}" --out "$OUT/serve.json" \
        | tee "$OUT/serve.txt"
}

preflight
case "$STAGE" in
    target) stage_target ;;
    regen) stage_regen ;;
    draft) stage_draft ;;
    tau) stage_tau ;;
    serve) stage_serve ;;
    all) stage_target; stage_regen; stage_draft; stage_tau ;;
    *) echo "unknown stage $STAGE (target, regen, draft, tau, serve or all)" >&2; exit 2 ;;
esac
