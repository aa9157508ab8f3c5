#!/usr/bin/env bash
# One verification call on the lent GPU (docs/verification.md): the sanitizer sweep and the GPU
# tests side by side, logs under $OUT. Expects `source .device/setup.sh` done and, for a run that
# compiles nothing, FFPA_CUTE_CACHE_DIR pointing at kernels precompiled on the CPU box.
#   bash tests/gpu_session.sh [sanitize-seconds] [pytest-seconds]
set -u
OUT="${OUT:-gpu-session}"; mkdir -p "$OUT"
python -m tests.sanitize --out "$OUT/sanitize" --timeout "${1:-380}" > "$OUT/sanitize.txt" 2>&1 &
san=$!
timeout "${2:-400}" python -m pytest -m "gpu and not slow" -q -p no:cacheprovider -n 6 \
  > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; tail -25 "$OUT/pytest.txt"
wait $san; echo "sanitize rc=$?"; cat "$OUT/sanitize.txt"
