#!/usr/bin/env bash
# The GPU tests (`-m gpu`), one pytest run per file, each under its own time limit, so that a
# slow file (FlashInfer compiles its kernels on a fresh machine's first use: minutes) cannot
# hide the results of the others; then a table of each file's outcome, last.
#
#   bash benchmarks/gpu_tests.sh OUT_DIR [SECONDS_PER_FILE] [FILE ...]
#
# Default files: every tests/**/*_gpu.py and the files holding `@pytest.mark.gpu` tests.
# PER_CASE=1 runs each of their test cases under its own limit instead.
# Each file's log (warnings off, short tracebacks) is OUT_DIR/<file>.log, and the table is also
# OUT_DIR/summary.txt. PYTHON picks the interpreter (default: python). Exits 1 if any failed.
# A failure's traceback goes into the log as it happens (FLASHSPLIT_INSTANT_FAILURES, see
# tests/conftest.py), so a file its time limit kills still says what failed.
set -uo pipefail

OUT=${1:?usage: bash benchmarks/gpu_tests.sh OUT_DIR [SECONDS_PER_FILE] [FILE ...]}
LIMIT=${2:-300}
shift $(( $# >= 2 ? 2 : $# ))
PY=${PYTHON:-python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

if [ $# -gt 0 ]; then
    FILES=("$@")
else
    mapfile -t FILES < <(grep -rl --include='*.py' -e '@pytest.mark.gpu' -e 'pytestmark = pytest.mark.gpu' tests \
                         | sort -u)
fi

# PER_CASE=1: each collected test case (node id) of the files runs under its own limit instead
# of each file (a file of several cluster tests takes longer than one limit)
if [ "${PER_CASE:-0}" = 1 ]; then
    mapfile -t FILES < <("$PY" -m pytest -q --collect-only -m gpu -p no:cacheprovider "${FILES[@]}" \
                         2>/dev/null | grep '::')
fi

status=0
: > "$OUT/summary.txt"
for file in "${FILES[@]}"; do
    log="$OUT/$(echo "$file" | tr '/[]:' '____').log"
    start=$(date +%s)
    FLASHSPLIT_INSTANT_FAILURES=1 timeout "$LIMIT" "$PY" -m pytest -q -m gpu -W ignore -p no:warnings -p no:cacheprovider \
        --tb=short "$file" > "$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    counts=$(grep -Eo '[0-9]+ (passed|failed|skipped|error|errors|deselected)' "$log" | tail -4 \
             | paste -sd, -)
    case $rc in
        0) outcome=ok ;;
        124) outcome="timed out after ${LIMIT} s"; status=1 ;;
        5) outcome="no gpu test selected" ;;
        *) outcome=failed; status=1 ;;
    esac
    printf '%-60s %-24s %5ss  %s\n' "$file" "$outcome" "$took" "${counts:-}" \
        | tee -a "$OUT/summary.txt"
done
echo
cat "$OUT/summary.txt"
exit $status
