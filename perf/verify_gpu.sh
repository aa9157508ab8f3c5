#!/usr/bin/env bash
# GPU verification of the kernels, in sections that each fit one device call (docs/verification.md).
#
# Here (CPU), first:
#   STAGE_PEERS=1 bash ../shared/device/stage.sh        # STAGE_PEERS=1: apache-tvm-ffi and
#                                                       # torch-c-dlpack-ext (dependencies of the
#                                                       # package) and the FFPA peer for the sweep
#   mkdir -p .pc   # (.pc: .git/info/exclude)
#   CUTE_DSL_ARCH=sm_90a python -m tests.gpu_jobs --precompile .precache --workers 2 \
#       --sections sanitize --pack .pc/san.tar.xz      # and one pack per call group, e.g.
#       --sections fused,fused_perf --pack .pc/fused.tar.xz
#       --sections fwd_perf --pack .pc/fwd.tar.xz
# (--pack keeps only the named sections' kernels: what travels is limited to 64 MiB, the
# staged toolchain takes ~59, and a few hundred kernels fit beside it, not all ~1300; pick
# the sections of the call, and pack after the last edit of a kernel source. Kernels not
# packed compile on the device on first use.)
# Then one device call per section group, carrying [".device", ".pc/<its pack>"] (every
# .pc/*.tar.xz carried is unpacked into one cache):
#   source .device/setup.sh && bash perf/verify_gpu.sh
# SECTIONS (default "san gpu"):
#   san   compute-sanitizer memcheck / racecheck / synccheck / initcheck over every kernel the
#         device runs (tests/sanitize.py; ~1 min); beside `gpu` when both are asked (the GPU
#         has room for both: ~1 min together); SANITIZE_CASES=fused (substrings of the case
#         labels, comma-separated) runs only those cases
#   gpu   `pytest -m gpu -n 6` on the device's own family (sm90 on an H100 / H200)
#   gpu80 the forward tests and the Split-D backward on the sm80 family (FFPA_CUTE_ARCH=sm80)
#   slow  the slow grids (`-m "gpu and slow"`), device family then sm80
#   perf  perf.smoke: first-call compile, host overhead, backward kernel times
#   sweep perf.sweep forward and backward vs SDPA (SWEEP_BASELINES=sdpa,ffpa adds FFPA)
#   serving perf.sweep --cases serving: window, varlen, paged decode on bf16 and e4m3 caches
#         (perf/serving.py; SERVING_CASES picks a subset, e.g. "kvdecode,kvdecode-fp8")
#   fused the fused backward (the default at D 320-512 in steps of 64; deterministic=True
#         keeps the atomic-free kernels): its GPU tests and the default route's, then
#         perf.bwd_fused beside the atomic-free backward and `--variation` (its run-to-run
#         differences) (precompile: gpu_jobs' sections fused and fused_perf)
#   scatter the fused backward with D over C CTAs (`scatter`; first run 2026-12-05): its GPU tests
#         (test_fused_scatter), its sanitizer cases, then perf.bwd_fused --scatter (D=576 /
#         768 / 1024 beside the routed backward, C = 2 at 320 / 512 beside the pair)
#         (precompile: gpu_jobs' section fused, and `python -m perf.bwd_fused --scatter
#         --precompile DIR`, packed together)
#   lines the shares from 128-byte lines as planned (the forward's hi share, the CTA pair's
#         `cta_align`, the gradient kernels' `line_shares_bwd`) with lazy rescaling at its new
#         head dims and the k, v-only row copy: the GPU tests they touch (the forward file,
#         test_line_shares and the backward's above-512 and fp16 tests, the lazy forward
#         tests) (precompile: `python -m tests.gpu_jobs --sections lines`, packed; the
#         curve section measures the routes, perf.cta_align / perf.split_align_bwd time them
#         against even shares)
#   widened the forward at D % 16 == 8 with long rows on q, k zero-padded to D + 8
#         (`launch.widened_fwd`): its GPU tests (the same bits as the D kernel, float64) and
#         its sanitizer case (precompile: `python -m tests.gpu_jobs --sections widened`, and
#         with SANITIZE_CASES=zero-padded `--sections sanitize`, packed)
#   cta   perf.cta_align: the CTA pair's second CTA from a line (routed) against even shares and
#         a 64-byte half line (`cta_align` 32) at the D % 64 == 8 sizes above 512
#         (precompile: `python -m perf.cta_align --precompile DIR`, packed)
#   cta32 the CTA pair's second CTA on a 64-byte half line at D % 128 == 8 (`cta_align` 32,
#         planned): test_kv_pair_forward (its 648 / 776 / 904 cases among them) and the
#         sanitizer case "D648 kv_pair" (precompile: `python -m tests.gpu_jobs --sections cta`
#         and, with SANITIZE_CASES="D648 kv_pair", `--sections sanitize`, packed)
#   pair  perf.cta_align --pair: the CTA pair against no pair (both CTAs compute S) above 512
#         (precompile: `python -m perf.cta_align --pair --precompile DIR`, packed)
#   fill  perf.fill_limits: TMA's fill rate per SM from L2 against the bytes in flight, alone
#         and multicast over a CTA pair, each variant in its own process (a hang stops only
#         it) (precompile: `python -m perf.fill_limits --precompile DIR`, packed)
#   one   perf.one_cta --time: the routed forward at D 520-576 with O in one CTA (`wide_o`)
#         against the CTA pair it replaced (precompile: `python -m perf.one_cta --precompile
#         DIR`, packed)
#   wide  `wide_o`'s GPU tests (test_forward_wide_o, the pair's tests above 576, the fast
#         grid's D=576; test_wide_gradient_kernels: the gradient kernels in one CTA, not
#         routed), its sanitizer cases, then perf.one_cta and perf.one_cta --bwd (precompile:
#         with SANITIZE_CASES="D576 wide,D536 wide,D520 wide" `python -m tests.gpu_jobs
#         --sections wide,sanitize`, `python -m perf.one_cta --precompile DIR` and `python -m
#         perf.one_cta --bwd --precompile DIR`, packed)
#   producer  perf.producer_regs --time: the forward with m64n128 PV WGMMAs, and with an idle
#         fourth warpgroup (precompile: `python -m perf.producer_regs --precompile DIR`)
#   trace perf.bwd_fused --trace: the fused backward's phase trace with its variants (one
#         device call alone; precompile: fused_perf)
#   lazy  lazy rescaling (`lazy_rescale`): its GPU tests, then perf.lazy_rescale and
#         perf.fp8_limits (precompile: gpu_jobs' section lazy)
#   fp8   issue 15's acceptance in one call: tests/test_fp8_gpu.py, perf.sweep FP8 beside bf16
#         (D 320 / 512 / 1024, N 8K / 16K, causal, GQA 32/4, MQA 64/1: the whole call), the FP8
#         cache decode in GB/s (precompile: gpu_jobs' section fp8, and
#         `python -m ffpa_cute.precompile --arch sm_90 --head-dims 320,512,1024 --dtypes bf16,fp8
#         --causal both --decode none,64 --cache-dir DIR`, packed)
#   curve the bf16 forward at every D in [264, 1024] (step 8, N=8K, B=1, H=32) with the cliffs
#         flagged (issue 20's "no cliffs in D"), then (unless CURVE_DECODE=0) the MLA decode
#         (B 128, Hq 128 on one KV head, 576 / 512) (precompile: `python -m ffpa_cute.precompile
#         --arch sm_90 --head-dims all --dtypes bf16 --causal no --cache-dir DIR`, packed:
#         ~0.45 MB)
#   limits perf.reduce_limits (fp32 adds into L2 by TMA / red.global, with loads beside
#         them) and perf.dsmem_limits (st.async between the CTAs of 2- and 4-CTA clusters)
#         (precompile: each `python -m perf.<name> --precompile DIR`, packed together)
#   bwd17 issue 17's acceptance table: perf.sweep --bwd at D 320 / 512 / 576 / 1024, N 8K /
#         16K, causal, GQA 32/4 causal (gemma4) and MQA 64/1 causal, with SWEEP_BASELINES
#         (default sdpa,ffpa); BWD17_DIMS / BWD17_SEQLENS / BWD17_CASES narrow it (FFPA
#         compiles its kernels in-process at every first call, so the whole table with FFPA
#         takes more than one call: e.g. D=512 8K / 16K in one, 320,576,1024 at 8K in the
#         next) (precompile: `python -m ffpa_cute.precompile --arch sm_90 --head-dims
#         320,512,576,1024 --dtypes bf16 --causal both --backward --cache-dir DIR`, packed;
#         the FFPA peer as .device_peers/peers.tar.xz, below)
#   padded the fused backward at D % 64 != 0 on zero-padded operands (`FUSED_PAD`, routed):
#         test_fused_padded (float64), then perf.bwd_fused --padded beside the atomic-free
#         backward (precompile: `python -m perf.bwd_fused --padded --precompile DIR`, packed)
#   l2    Nsight Compute on the fused backward (perf.bwd_fused --l2-probe: D=512 MQA 64/1
#         causal by four walks (key tiles, blocks outer, rotated, row units), MHA causal, MQA
#         not causal, one launch each): DRAM bytes read / written and the L2 hit rate
#         (precompile: `python -m perf.bwd_fused --l2-probe --precompile DIR`, packed)
#   rows  the fused backward by (query block row, key tile) units (`row_units`, planned for
#         causal groups of 16+): its GPU tests and the default route's, its sanitizer cases,
#         then perf.bwd_fused --row-units (by key tiles against row units, G 8-64, D 320-576,
#         gradients compared) and --variation (precompile: with SANITIZE_CASES="row units"
#         `python -m tests.gpu_jobs --sections rows,sanitize`, `python -m perf.bwd_fused
#         --row-units --precompile DIR` and `--variation --precompile DIR`, packed)
#   masks dense masks as kernel calls (ffpa_cute/dense_mask.py): tests/test_dense_mask.py's GPU
#         tests, then perf.sweep --cases masks (key padding and Gemma-style image blocks, B=4,
#         H=32, D=512, N 4K / 8K, fwd and bwd) beside ${SWEEP_BASELINES:-sdpa,ffpa-triton}
#         (FFPA's CuTe backend takes no attn_mask; its Triton one does) (precompile:
#         `python -m ffpa_cute.precompile --arch sm_90 --head-dims 512 --dtypes bf16 --causal
#         both --backward --cache-dir DIR`, packed; the FFPA peer as .device_peers)
#   fwd   the forward with V read from K's ring (`shared_kv`): its GPU tests, then
#         perf.shared_kv (MLA prefill 576 / 512 and D=512 with v = k's prefix, against the
#         planned forward) (precompile: fwd_perf)
#
# The FFPA peer beside a pack: STAGE_PEERS=1 adds its two wheels (1.25 MB) to .device, and with
# the tracked tree and a pack that passes the 64 MiB that travels. Instead unzip both wheels
# into one xz tarball (~0.8 MB), .device_peers/peers.tar.xz (.device_peers in
# .git/info/exclude), and carry .device_peers in the calls that time FFPA:
#   mkdir -p /tmp/peers .device_peers && for w in <stage cache>/peers/*.whl; do
#     unzip -q -o "$w" -d /tmp/peers; done && tar cJf .device_peers/peers.tar.xz -C /tmp/peers .
set -uo pipefail
if [ -f .device_peers/peers.tar.xz ] && ! python3 -c "import ffpa_attn" 2>/dev/null; then
  tar xJf .device_peers/peers.tar.xz -C /tmp/site
fi
out="${OUT:-./out}"
mkdir -p "$out"
for pack in .pc/*.tar.xz; do
  [ -f "$pack" ] && mkdir -p /tmp/pc && tar xJf "$pack" -C /tmp/pc
done
[ -d /tmp/pc/.precache ] && export FFPA_CUTE_CACHE_DIR=/tmp/pc/.precache
step() { echo "=== $1"; }
sections="${SECTIONS:-san gpu}"
has() { [[ " $sections " == *" $1 "* ]]; }
if has san; then
  step "compute-sanitizer sweep"
  if has gpu; then  # in the background, beside the GPU tests
    timeout 500 python -m tests.sanitize --out "$out" --timeout 480 > "$out/sanitize.log" 2>&1 &
    san_pid=$!
  else
    timeout 500 python -m tests.sanitize --out "$out" --timeout 480
  fi
fi
if has gpu; then
  step "pytest -m gpu, the device's own family"
  timeout 480 pytest -m "gpu and not slow" -q -p no:cacheprovider -n 6 2>&1 \
      | tee "$out/gpu.log" | grep -E "FAIL|ERROR|passed|failed" | tail -25
fi
if [ -n "${san_pid:-}" ]; then
  wait "$san_pid"; cat "$out/sanitize.log"
fi
if has gpu80; then
  step "pytest -m gpu, the Split-D family (FFPA_CUTE_ARCH=sm80)"
  FFPA_CUTE_ARCH=sm80 timeout 300 pytest -m "gpu and not slow" -q -p no:cacheprovider \
      tests/test_attention_gpu.py tests/test_backward_sm80_gpu.py 2>&1 \
      | tee "$out/gpu_sm80.log" | grep -E "FAIL|ERROR|passed|failed" | tail -25
fi
if has slow; then
  step "slow grids"
  timeout 300 pytest -m "gpu and slow" -q -x -p no:cacheprovider tests/test_attention_gpu.py \
      2>&1 | tee "$out/gpu_slow.log" | tail -2
  FFPA_CUTE_ARCH=sm80 timeout 280 pytest -m "gpu and slow" -q -x -p no:cacheprovider tests/ \
      2>&1 | tee "$out/gpu_slow_sm80.log" | tail -2
fi
if has perf; then
  step "first call, host overhead, backward kernel times"
  timeout 200 python -m perf.smoke --first-call 512,320 --overhead 512 --timeout 90
  timeout 200 python -m perf.smoke --timeout 90 \
      --bench-bwd "512:8192:0,512:8192:1,512:8192:1:4,320:8192:0,1024:8192:0"
fi
if has sweep; then
  step "perf.sweep vs ${SWEEP_BASELINES:-sdpa}"
  timeout 500 python -m perf.sweep --quick --baselines "${SWEEP_BASELINES:-sdpa}" --no-progress \
      --out "$out/sweep" --commit "${PERF_COMMIT:-unknown}" > "$out/sweep.log" 2>&1
  tail -30 "$out/sweep.log"
fi
if has bwd17; then
  step "issue 17: the backward beside ${SWEEP_BASELINES:-sdpa,ffpa}"
  timeout 580 python -m perf.sweep --cases "${BWD17_CASES:-self,causal,gemma4,mqa}" \
      --head-dims "${BWD17_DIMS:-320,512,576,1024}" --seqlens "${BWD17_SEQLENS:-8k,16k}" --bwd \
      --baselines "${SWEEP_BASELINES:-sdpa,ffpa}" --no-progress \
      --out "$out/sweep_bwd17" --commit "${PERF_COMMIT:-unknown}" > "$out/sweep_bwd17.log" 2>&1
  grep "^| [a-z]" "$out/sweep_bwd17/bwd.md" | cut -c1-200
fi
if has masks; then
  step "dense masks: GPU tests, then perf.sweep --cases masks beside ${SWEEP_BASELINES:-sdpa,ffpa-triton}"
  timeout 200 pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_dense_mask.py 2>&1 \
      | tee "$out/gpu_masks.log" | grep -E "FAIL|ERROR|passed|failed" | tail -8
  timeout 380 python -m perf.sweep --cases masks --baselines "${SWEEP_BASELINES:-sdpa,ffpa-triton}" \
      --no-progress --out "$out/sweep_masks" --commit "${PERF_COMMIT:-unknown}" \
      > "$out/sweep_masks.log" 2>&1
  grep "^| [a-z]" "$out/sweep_masks/fwd.md" "$out/sweep_masks/bwd.md" | cut -c1-220
fi
if has padded; then
  step "the fused backward on zero-padded operands: GPU tests, perf.bwd_fused --padded"
  timeout 200 pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_backward_sm90_gpu.py \
      -k padded 2>&1 | tee "$out/gpu_padded.log" | grep -E "FAIL|ERROR|passed|failed" | tail -8
  timeout 300 python -m perf.bwd_fused --padded --out "$out/bwd_padded.json"
fi
if has l2; then
  step "the fused backward under Nsight Compute: DRAM bytes and L2 hit rate (MQA / MHA causal)"
  timeout 400 ncu --clock-control none --kernel-name regex:Fused --metrics \
      dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \
      python -m perf.bwd_fused --l2-probe > "$out/l2.log" 2>&1
  grep -E "launched|dram__|lts__|gpu__time|Fused|==ERR|==WARN" "$out/l2.log" | cut -c1-160
fi
if has rows; then
  step "the fused backward by row units: GPU tests, sanitizers, against key tiles, variation"
  timeout 200 pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_backward_sm90_gpu.py \
      -k "row_units or default_route" 2>&1 | tee "$out/gpu_rows.log" \
      | grep -E "FAIL|ERROR|passed|failed" | tail -12
  SANITIZE_CASES="row units" timeout 200 python -m tests.sanitize --out "$out/san_rows" \
      --timeout 190 2>&1 | tail -6
  timeout 300 python -m perf.bwd_fused --row-units --out "$out/row_units.json"
  timeout 100 python -m perf.bwd_fused --variation --out "$out/bwd_variation.json"
fi
if has fused; then
  step "the fused backward: GPU tests, then perf.bwd_fused and its run-to-run variation"
  timeout 200 pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_backward_sm90_gpu.py \
      tests/test_features_gpu.py -k "fused or default_route" 2>&1 | tee "$out/gpu_fused.log" \
      | grep -E "FAIL|ERROR|passed|failed" | tail -15
  timeout 300 python -m perf.bwd_fused --out "$out/bwd_fused.json"
  timeout 60 python -m perf.bwd_fused --variation --out "$out/bwd_variation.json"
fi
if has scatter; then
  step "the fused backward over C CTAs: GPU tests, sanitizers, perf.bwd_fused --scatter"
  timeout 200 pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_backward_sm90_gpu.py \
      -k scatter 2>&1 | tee "$out/gpu_scatter.log" | grep -E "FAIL|ERROR|passed|failed" | tail -15
  SANITIZE_CASES=scatter timeout 200 python -m tests.sanitize --out "$out/san_scatter" \
      --timeout 190 2>&1 | tail -6
  timeout 300 python -m perf.bwd_fused --scatter --out "$out/bwd_scatter.json"
fi
if has lines; then
  step "shares from 128-byte lines as planned: GPU tests, then against even shares"
  timeout 420 pytest -m "gpu and not slow" -q -p no:cacheprovider -n 6 \
      tests/test_attention_gpu.py tests/test_lazy_rescale_gpu.py \
      "tests/test_backward_sm90_gpu.py::test_line_shares" \
      "tests/test_backward_sm90_gpu.py::test_fp16" 2>&1 | tee "$out/gpu_lines.log" \
      | grep -E "FAIL|ERROR|passed|failed" | tail -20
fi
if has widened; then
  step "D % 16 == 8 widened to D + 8: GPU tests, sanitizer case"
  timeout 200 pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_attention_gpu.py \
      -k "widened or row_repack" 2>&1 | tee "$out/gpu_widened.log" \
      | grep -E "FAIL|ERROR|passed|failed" | tail -10
  SANITIZE_CASES=zero-padded timeout 300 python -m tests.sanitize --out "$out/san_widened" \
      --timeout 280 2>&1 | tail -6
fi
if has cta; then
  step "perf.cta_align: the CTA pair's shares"
  timeout 150 python -m perf.cta_align --out "$out/cta_align.json"
fi
if has cta32; then
  step "cta_align 32 at D % 128 == 8: the CTA pair's forward tests, sanitizer case"
  timeout 250 pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_attention_gpu.py \
      -k "kv_pair_forward" 2>&1 | tee "$out/gpu_cta32.log" | grep -E "FAIL|passed|failed" | tail -8
  SANITIZE_CASES="D648 kv_pair" timeout 250 python -m tests.sanitize --out "$out/san_cta32" \
      --timeout 230 2>&1 | tail -6
fi
if has pair; then
  step "perf.cta_align --pair: the CTA pair against no pair above 512"
  timeout 200 python -m perf.cta_align --pair --out "$out/cta_pair.json"
fi
if has one; then
  step "perf.one_cta: O in one CTA above D=512 (wide_o) against the CTA pair"
  timeout 300 python -m perf.one_cta --time --out "$out/one_cta.json"
fi
if has wide; then
  step "wide_o: its GPU tests and sanitizer cases, then perf.one_cta"
  timeout 200 pytest -m gpu -q -p no:cacheprovider -n 6 tests/test_attention_gpu.py \
      tests/test_backward_sm90_gpu.py \
      -k "wide_o or kv_pair_forward or split_o or (fast and d576) or wide_gradient" 2>&1 \
      | tee "$out/gpu_wide.log" | grep -E "FAIL|passed|failed" | tail -8
  SANITIZE_CASES="D576 wide,D536 wide,D520 wide" timeout 150 python -m tests.sanitize \
      --out "$out/san_wide" --timeout 140 2>&1 | tail -5
  timeout 120 python -m perf.one_cta --time --out "$out/one_cta.json"
  timeout 150 python -m perf.one_cta --bwd --time --out "$out/one_cta_bwd.json"
fi
if has fill; then
  step "perf.fill_limits: TMA fill rate per SM, alone and multicast"
  python -c "import perf.fill_limits as f; print('\n'.join(f.variants()))" | while read -r v; do
    FILL_ONLY="$v" timeout 30 python -m perf.fill_limits < /dev/null 2>&1 | tail -1
    [ "${PIPESTATUS[0]}" = 0 ] || echo "$v: did not finish in 30 s"
  done
fi
if has producer; then
  step "perf.producer_regs --time: split PV, idle producer warpgroup"
  timeout 200 python -m perf.producer_regs --time --out "$out/producer_regs.json"
fi
if has trace; then
  step "the fused backward's phase trace and variants"
  timeout 500 python -m perf.bwd_fused --trace --out "$out/bwd_fused_trace.json"
fi
if has fwd; then
  step "forward experiments: V from K's ring (shared_kv), its GPU tests first"
  timeout 200 pytest -m gpu -q -p no:cacheprovider tests/test_shared_kv.py 2>&1 \
      | tee "$out/gpu_shared_kv.log" | grep -E "FAIL|ERROR|passed|failed" | tail -15
  timeout 300 python -m perf.shared_kv --out "$out/shared_kv.json"
fi
if has lazy; then
  step "lazy rescaling: GPU tests, perf.lazy_rescale, perf.fp8_limits"
  timeout 200 pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_lazy_rescale_gpu.py 2>&1 \
      | tee "$out/gpu_lazy.log" | grep -E "FAIL|ERROR|passed|failed" | tail -15
  timeout 200 python -m perf.lazy_rescale --out "$out/lazy_rescale.json"
  timeout 250 python -m perf.fp8_limits --out "$out/fp8_limits.json"
fi
if has fp8; then
  step "issue 15's acceptance: FP8 GPU tests, then perf.sweep FP8 beside bf16 and the FP8 cache"
  timeout 200 pytest -m gpu -q -p no:cacheprovider -n 4 tests/test_fp8_gpu.py 2>&1 \
      | tee "$out/gpu_fp8.log" | grep -E "FAIL|ERROR|passed|failed" | tail -15
  timeout 300 python -m perf.sweep --cases self,causal,gemma4,mqa --dtypes bf16,fp8 --fwd \
      --head-dims 320,512,1024 --baselines none --no-progress --no-charts \
      --out "$out/sweep_fp8" --commit "${PERF_COMMIT:-unknown}" > "$out/sweep_fp8.log" 2>&1
  grep "^| [a-z]" "$out/sweep_fp8/fwd.md" | cut -c1-160
  timeout 120 python -m perf.sweep --cases kvdecode-fp8 --seqlens 32768 --baselines none \
      --no-progress --no-charts --out "$out/kvdecode_fp8" --commit "${PERF_COMMIT:-unknown}" \
      > "$out/kvdecode_fp8.log" 2>&1
  cat "$out/kvdecode_fp8/serving.md"
fi
if has curve; then
  step "the forward across D (every multiple of 8 in [264, 1024]) and the MLA decode"
  timeout 400 python -m perf.sweep --cases self --head-dims all --seqlens 8k --fwd \
      --baselines none --rep-ms 50 --err-heads 1 --no-progress --no-charts \
      --out "$out/curve" --commit "${PERF_COMMIT:-unknown}" > "$out/curve.log" 2>&1
  sed -n '/^Curve across D/,$p' "$out/curve/fwd.md"
  [ "${CURVE_DECODE:-1}" = 0 ] || timeout 150 python -m perf.sweep --cases mla-decode --fwd --baselines none --no-progress \
      --no-charts --out "$out/mla_decode" --commit "${PERF_COMMIT:-unknown}" \
      > "$out/mla_decode.log" 2>&1
  [ "${CURVE_DECODE:-1}" = 0 ] || grep "^| [a-z]" "$out/mla_decode/fwd.md" | cut -c1-160
fi
if has limits; then
  step "perf.reduce_limits, perf.dsmem_limits"
  timeout 200 python -m perf.reduce_limits --out "$out/reduce_limits.json"
  timeout 200 python -m perf.dsmem_limits --out "$out/dsmem_limits.json"
fi
if has serving; then
  step "perf.sweep --cases serving"
  timeout 500 python -m perf.sweep --cases "${SERVING_CASES:-serving}" --baselines sdpa \
      --no-progress --no-charts \
      --out "$out/serving" --commit "${PERF_COMMIT:-unknown}" > "$out/serving.log" 2>&1
  cat "$out/serving/serving.md"
fi
