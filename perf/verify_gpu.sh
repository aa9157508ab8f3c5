#!/usr/bin/env bash
# Everything the kernels must pass on a GPU, in one device call (logs under $OUT, or ./out).
#
# Here (CPU), first:
#   bash ../shared/device/stage.sh          # STAGE_PEERS=1 to add the FFPA column to the sweep
#   python -m ffpa_cute.precompile --arch sm_90 --head-dims 320,512,1024 --dtypes bf16 \
#       --cache-dir .precache               # (.precache is git-ignored via .git/info/exclude)
# Then the device call: carry [".device", ".precache"], command (the device copy has no .git)
#   source .device/setup.sh && PERF_COMMIT=<git rev-parse --short HEAD> bash perf/verify_gpu.sh
# Sections: precompiled cache (0 compiles), default GPU tier, slow grid, forward sweep vs SDPA at
# every head dim of the FFPA grid and the padded-chunk dims. About 6-7 minutes on an H200.
set -uo pipefail
out="${OUT:-./out}"
mkdir -p "$out"
step() { echo "=== $1"; }
step "precompiled cache"
FFPA_CUTE_PRECOMPILED_DIR="$PWD/.precache" timeout 120 python -m pytest -m gpu -q \
    tests/test_precompiled_gpu.py 2>&1 | tail -2
step "GPU tests, default tier"
timeout 240 python -m pytest -m "gpu and not slow" -q tests/ 2>&1 | tee "$out/gpu_fast.log" | tail -3
step "GPU tests, slow grid"
timeout 300 python -m pytest -m "gpu and slow" -q -x tests/ 2>&1 | tee "$out/gpu_slow.log" | tail -3
step "forward sweep vs SDPA"
timeout 300 python -m perf.sweep --cases self,causal --head-dims 264,320,328,384,448,512,576,640,768,1024 \
    --seqlens 8192 --fwd --baselines "${SWEEP_BASELINES:-sdpa}" --no-progress --out "$out/sweep" \
    --commit "${PERF_COMMIT:-unknown}" > "$out/sweep.log" 2>&1
grep -E "^\| (self|causal) " "$out/sweep/fwd.md" | cut -d'|' -f2,7,8,10,11,13,16
