#!/usr/bin/env bash
# Everything the kernels must pass on a GPU, in one device call (logs under $OUT, or ./out).
#
# Here (CPU), first:
#   bash ../shared/device/stage.sh          # STAGE_PEERS=1 to add the FFPA column to the sweep
#   python -m ffpa_cute.precompile --arch sm_90 --head-dims 320,512,1024 --dtypes bf16 --backward \
#       --cache-dir .precache               # (.precache is git-ignored via .git/info/exclude)
# Then the device call: carry [".device", ".precache"], command (the device copy has no .git)
#   source .device/setup.sh && PERF_COMMIT=<git rev-parse --short HEAD> bash perf/verify_gpu.sh
# Sections (SECTIONS="..."): 1 precompiled cache (0 compiles); 2 default GPU tier (forward) for
# the Split-D family (FFPA_CUTE_ARCH=sm80) and the sm90 family; bwd the sm90 backward kernels;
# bwd2 autograd / torch.compile through the backward kernels, the fused Delta and the Split-D
# backward; 3 / 4 slow grids (sm90 / sm80); 5 first-call compile, host overhead, kv_pair, benches,
# decode; 6 forward sweep vs SDPA (SWEEP_BASELINES=sdpa,ffpa adds FFPA if staged with
# STAGE_PEERS=1). Each call must stay under the 10-minute limit: "1 2", "bwd", "bwd2", "5" are
# one call each (docs/perf-log.md, "Next device session").
set -uo pipefail
out="${OUT:-./out}"
mkdir -p "$out"
step() { echo "=== $1"; }
sections="${SECTIONS:-1 2 bwd bwd2 3 4 5 6}"
has() { [[ " $sections " == *" $1 "* ]]; }
if has 1; then
  step "precompiled cache"
  FFPA_CUTE_PRECOMPILED_DIR="$PWD/.precache" timeout 120 python -m pytest -m gpu -q \
      tests/test_precompiled_gpu.py 2>&1 | tail -2
fi
if has 2; then
  for fam in sm80 sm90; do
    step "GPU tests, default tier (forward), FFPA_CUTE_ARCH=$fam"
    FFPA_CUTE_ARCH=$fam timeout 200 python -m pytest -m "gpu and not slow" -q tests/ \
        --ignore=tests/test_backward_sm90_gpu.py --ignore=tests/test_backward_sm80_gpu.py \
        -k "not backward" 2>&1 \
        | tee "$out/gpu_fast_$fam.log" | tail -2
  done
fi
if has bwd; then
  # Own section and timeouts: a hang here must not cost the forward results.
  step "GPU tests, sm90 backward kernels (dV, dQ, dK vs float64; autograd through them)"
  FFPA_CUTE_ARCH=sm90 timeout 240 python -m pytest -m gpu -v tests/test_backward_sm90_gpu.py \
      2>&1 | tee "$out/gpu_bwd_sm90.log" | grep -E "FAIL|ERROR|passed|failed|Error" | tail -30
fi
if has bwd2; then
  step "GPU tests, autograd through the backward kernels (eager, torch.compile, both families)"
  FFPA_CUTE_ARCH=sm90 timeout 200 python -m pytest -m gpu -v tests/test_attention_gpu.py \
      -k "backward or fused_delta" 2>&1 | tee "$out/gpu_bwd_autograd.log" \
      | grep -E "FAIL|ERROR|passed|failed|Error" | tail -30
  step "GPU tests, Split-D backward kernels (FFPA_CUTE_ARCH=sm80, default tier)"
  FFPA_CUTE_ARCH=sm80 timeout 300 python -m pytest -m "gpu and not slow" -v \
      tests/test_backward_sm80_gpu.py 2>&1 \
      | tee "$out/gpu_bwd_sm80.log" | grep -E "PASS|FAIL|ERROR|passed|failed|Error" | tail -40
fi
if has 3; then
  step "GPU tests, slow grid, FFPA_CUTE_ARCH=sm90 (-k ${SLOW_K:-all})"
  FFPA_CUTE_ARCH=sm90 timeout 300 python -m pytest -m "gpu and slow" -q -x \
      tests/test_attention_gpu.py ${SLOW_K:+-k "$SLOW_K"} 2>&1 \
      | tee "$out/gpu_slow_sm90.log" | tail -2
fi
if has 4; then
  step "GPU tests, slow grid, FFPA_CUTE_ARCH=sm80"
  FFPA_CUTE_ARCH=sm80 timeout 300 python -m pytest -m "gpu and slow" -q -x tests/ 2>&1 \
      | tee "$out/gpu_slow_sm80.log" | tail -2
fi
if has 5; then
  step "WGMMA kernel: first-call compile (empty caches) and host overhead of a cached call"
  timeout 200 python -m perf.smoke --family sm90 --first-call 512,320 --overhead 512 --timeout 90
  step "WGMMA kernel with O split over two CTAs (D > 512)"
  timeout 200 python -m perf.smoke --family sm90 --wgmma-max-d 1024 --timeout 60 \
      --cases "1024:1000:1000:0,768:129:1000:1:4,576:1000:129:1,1024:4097:4097:1:16" \
      --bench "1024:8192:0,1024:8192:1,768:8192:0,576:8192:0"
  step "kv_pair (D > 512: the CTA pair splits the KV blocks, P exchanged over DSMEM; the default)"
  timeout 200 python -m pytest -m gpu -q tests/test_attention_gpu.py -k kv_pair 2>&1 | tail -2
  timeout 200 python -m perf.smoke --family sm90 --timeout 90 \
      --bench "1024:8192:0,1024:8192:0:kv_pair=1;v_stages=2,1024:8192:1:kv_pair=1;v_stages=2,768:8192:0,768:8192:0:kv_pair=1;v_stages=2"
  step "sm90 backward kernels (dQ + dK + dV + Delta), counted TFLOPS = 2.5 x forward FLOPs"
  timeout 200 python -m perf.smoke --family sm90 --timeout 90 \
      --bench-bwd "512:8192:0,512:8192:0:32:noseq,512:8192:1,512:8192:0:8,320:8192:0,1024:8192:0"
  step "decode: one head per tile vs GQA rows packed; MLA 576/512 (Dv != D) prefill and decode"
  timeout 200 python -m perf.smoke --family sm90 --timeout 90 \
      --decode "512:8192:32:8:8,512:8192:64:1:4,576:4096:128:1:4:512,576:8192:128:1:1:512:1024,512:32768:32:16:1"
  step "WGMMA kernel D <= 512: Q streamed with K, the smem it frees given to the V rings"
  timeout 200 python -m perf.smoke --family sm90 --timeout 60 \
      --cases "512:1000:1000:1:1:0:stream_q=1;v_stages=3" \
      --bench "512:8192:0,512:8192:0:stream_q=1;v_stages=3,448:8192:0,448:8192:0:stream_q=1;k_stages=4;v_stages=3,384:8192:0,384:8192:0:stream_q=1;k_stages=4;v_stages=4"
fi
if has 6; then
  step "forward sweep vs ${SWEEP_BASELINES:-sdpa}"
  timeout 300 python -m perf.sweep --cases self,causal --head-dims 264,320,384,448,512,576,1024 \
      --seqlens 8192 --fwd --baselines "${SWEEP_BASELINES:-sdpa}" --no-progress --out "$out/sweep" \
      --commit "${PERF_COMMIT:-unknown}" > "$out/sweep.log" 2>&1
  grep -E "^\| (self|causal) " "$out/sweep/fwd.md" | cut -d'|' -f2,7,8,10,11,13,16
fi
