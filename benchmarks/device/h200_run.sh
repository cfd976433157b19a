#!/usr/bin/env bash
# One H200 call, phases chosen by arguments (run from the repository root with .carry/tilelang-*.tar.xz carried):
#   tests     GPU tests (TESTS, default tests/cuda)
#   profile   benchmarks/profile_decode.py, graphs and eager, batch PROFILE_BATCH (default "1 64"), PDL off unless
#             PROFILE_PDL=1 (with PDL a kernel's span includes its wait: no kernel breakdown)
#   zos       benchmarks/bench_zos.py with graphs, batch 1 and 64
#   spec      benchmarks/bench_spec.py on the reference model: no-spec vs DFlash fixed/varlen, concurrency 1, 32
#   e2e       benchmarks/bench_decode_e2e.py with graphs and transformers, batch 1 16 64 (E2E_REPEAT timed windows
#             a batch, default 5, the median reported; e2e-nohf, e2e-nopdl and ab too)
#   e2e-nohf  the same without transformers
#   e2e-nopdl batch(es) E2E_BATCH (default 1) without transformers, DEEPINFER_PDL=0 (PDL is on by default since
#             session 7; e2e and e2e-nohf follow the caller's DEEPINFER_PDL)
#   ab        e2e without transformers (batch AB_BATCH, default "1 16 64") once per environment in AB_ENVS
#             (";"-separated, "-" = none; default: none; PDL off; PDL off with the gated kernels), each row records
#             its DEEPINFER_* switches
#   goldens   parity goldens (fp32, bf16) on the reference model
#   goldens-real  bf16 / fp32 goldens on parity_tests/models/deepseek-v2-lite-dims-2l (dummy_portable weights)
#   mla       benchmarks/bench_mla_decode.py (MLA_ARGS: extra arguments, e.g. --warp-specialized)
#   ws        kernels_cuda/mla_decode_ws.py --check --bench (the hand warp-specialized decode against the pipelined one;
#             WS_SCHEDULE=seesaw: that schedule is the default of the run, checked, and the ws one a variant;
#             WS_ARGS: the arguments instead of --check --bench, e.g. "--check")
#   wsdiag    kernels_cuda/mla_decode_ws.py --diagnose (compute vs memory split of its schedules at B=64 H=128 4K)
#   mla1      kernels_cuda/mla_decode.py --sweep-batch1 (batch-1 latency: splits x stages x threads)
#   kernels   every new kernels_cuda file's --check --bench (moe_gemm, silu_mul, mla_rope_cache, moe_routing)
#   skinny    kernels_cuda/skinny_gemm.py --check --bench
#   routing   kernels_cuda/moe_routing.py --check
#   decodein  kernels_cuda/decode_inputs.py --check --bench
#   absorb    kernels_cuda/mla_absorb.py --check --bench (unverified; gate: DEEPINFER_CUDA_UNVERIFIED_KERNELS=mla_absorb)
#   swap      kernels_cuda/moe_gemm_swap.py --check --bench (unverified; the engine takes it with
#             DEEPINFER_CUDA_UNVERIFIED_KERNELS=1 in the caller's environment, e.g. for tests / e2e-nohf after it)
#   unverified  kernels_cuda/device_run_unverified.sh (the gated sampling / spec_verify / zos_fixup kernels)
#   savecache tar the TileLang kernel cache to $OUT/tlcache.tar.xz; copied to .carry/ and carried, the next call's
#             setup unpacks it (a fresh machine then skips the compiles it already did)
# DEADLINE (seconds from start, default unset) caps PHASE_LIMIT for the phases that use it (not goldens, goldens-real,
# routing, kernels, unverified, savecache: they keep their own timeouts) and skips phases once it has passed.
# Outputs under $OUT; each phase has its own time limit (PHASE_LIMIT seconds, default 150).
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
LIM=${PHASE_LIMIT:-150}
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=/tmp/tlcache DEEPINFER_CACHE_DIR=/tmp/dicache
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
rm -f /tmp/swap.log /tmp/profile.log /tmp/e2e.log /tmp/e2e_nopdl.log /tmp/spec.log /tmp/mla.log  # a warm machine keeps /tmp
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv > "$OUT/setup.log" 2>&1
(mkdir -p /tmp/site && tar -xJf .carry/tilelang-0.1.15-cp312-site.tar.xz -C /tmp/site) &
[ -f .carry/tlcache.tar.xz ] && (mkdir -p /tmp/tlcache && tar -xJf .carry/tlcache.tar.xz -C /tmp/tlcache) &
python3 setup.py build_ext --inplace -q -j 16 > /tmp/build.log 2>&1 || echo "BUILD FAILED" >> /tmp/build.log &
wait
for d in backends kernels_cuda kernels_ascend; do [ -e deepinfer_npu/$d ] || ln -s ../$d deepinfer_npu/$d; done
export PYTHONPATH=$PWD:/tmp/site
tail -3 /tmp/build.log >> "$OUT/setup.log"; el "setup done"; tail -2 /tmp/build.log
filt() { grep -v "tilelang.jit.kernel:INFO\|USDT:\|^INFO" ; }
for phase in "$@"; do
  el "phase $phase"
  if [ -n "${DEADLINE:-}" ]; then left=$(( DEADLINE - ($(date +%s) - T0) )); LIM=$(( left < ${PHASE_LIMIT:-150} ? left : ${PHASE_LIMIT:-150} ))
    [ $LIM -lt 10 ] && { echo "skip $phase: deadline"; continue; }; fi
  case $phase in
    tests) timeout $LIM python3 -m pytest ${TESTS:-tests/cuda} -q -rs -p no:cacheprovider 2>&1 | filt \
             > "$OUT/tests.log"; tail -30 "$OUT/tests.log" ;;
    profile) DEEPINFER_PDL=${PROFILE_PDL:-0} timeout $LIM python3 benchmarks/profile_decode.py --backend cuda --batch ${PROFILE_BATCH:-1 64} --graphs --sequence 200 \
             2>&1 | filt >> /tmp/profile.log; grep -v '^{' /tmp/profile.log | tail -5
             grep '^{' /tmp/profile.log > "$OUT/profile.jsonl"
             python3 -c "
import json
for l in open('$OUT/profile.jsonl'):
    r = json.loads(l); print('batch', r['batch'], 'graphs', r['graphs'], 'wall', r['wall_ms_per_step'], 'kernel', r['kernel_ms_per_step'], 'n', r['kernels_per_step'])
    for t in r['top'][:18]: print('   ', t)
    for t in r['cpu_self_top'][:6]: print('   cpu', t)
" ;;
    zos) timeout $LIM python3 benchmarks/bench_zos.py --backend cuda --batch 1 64 --graphs \
             --out "$OUT/h200_zos.jsonl" 2>&1 | filt > "$OUT/zos.log"; grep -v '^{' "$OUT/zos.log" | tail -8 ;;
    spec) timeout $LIM python3 benchmarks/bench_spec.py --backend cuda --methods ${SPEC_METHODS:-mtp dflash} \
             --concurrency 1 32 --graphs --max-tokens 128 --repeat ${SPEC_REPEAT:-3} --out "$OUT/h200_spec.jsonl" 2>&1 \
             | filt > /tmp/spec.log; grep -v '^{' /tmp/spec.log | tail -14 ;;
    e2e|e2e-nohf) x=""; [ $phase = e2e-nohf ] && x=--no-hf
             timeout $LIM python3 benchmarks/bench_decode_e2e.py --backend cuda --batch 1 16 64 --prompt-len 512 \
             --gen 32 --repeat ${E2E_REPEAT:-5} --gpu-state --graphs $x --out "$OUT/h200_decode_e2e_graphs.jsonl" 2>&1 | filt > /tmp/e2e.log
             grep -v '^{' /tmp/e2e.log | grep -v "kernel_cache" | tail -12 ;;
    e2e-nopdl) DEEPINFER_PDL=0 timeout $LIM python3 benchmarks/bench_decode_e2e.py --backend cuda --batch ${E2E_BATCH:-1} \
             --prompt-len 512 --gen 32 --repeat ${E2E_REPEAT:-5} --gpu-state --graphs --no-hf --out "$OUT/h200_decode_e2e_graphs.jsonl" 2>&1 | filt \
             > /tmp/e2e_nopdl.log; grep -v '^{' /tmp/e2e_nopdl.log | grep -v kernel_cache | tail -6 ;;
    ab) IFS=';' read -ra envs <<< "${AB_ENVS:--;DEEPINFER_PDL=0;DEEPINFER_PDL=0 DEEPINFER_CUDA_UNVERIFIED_KERNELS=1}"
             for e in "${envs[@]}"; do [ "$e" = "-" ] && e=""; echo "== ab: ${e:-baseline}"
               env $e timeout $LIM python3 benchmarks/bench_decode_e2e.py --backend cuda --batch ${AB_BATCH:-1 16 64} \
                 --prompt-len 512 --gen 32 --repeat ${E2E_REPEAT:-5} --gpu-state --graphs --no-hf --out "$OUT/h200_decode_e2e_graphs.jsonl" 2>&1 | filt \
                 | grep -E "engine batch=|warm-up" | sed 's/, [0-9]* steps after.*//'
             done ;;
    goldens) for dt in float32 bfloat16; do timeout 60 python3 -m deepinfer_npu.parity record --backend cuda \
             --dtype $dt --out "$OUT/cuda-$dt.json" 2>&1 | filt | tail -3; done ;;
    goldens-real) for dt in bfloat16 float32; do timeout 120 python3 -m deepinfer_npu.parity record --backend cuda \
             --dtype $dt --model parity_tests/models/deepseek-v2-lite-dims-2l --load-format dummy_portable \
             --out "$OUT/cuda-$dt-v2-lite-dims.json" 2>&1 | filt | tail -3; done ;;
    unverified) OUT=$OUT bash kernels_cuda/device_run_unverified.sh ;;
    skinny) timeout $LIM python3 kernels_cuda/skinny_gemm.py --check --bench --out "$OUT/h200_skinny_gemm.jsonl" 2>&1 \
             | filt > "$OUT/skinny.log"; grep -v '^{' "$OUT/skinny.log" | tail -20 ;;
    swap) timeout $LIM python3 kernels_cuda/moe_gemm_swap.py --check --bench --out "$OUT/h200_moe_gemm_swap.jsonl" 2>&1 \
             | filt > /tmp/swap.log; echo "swap rc=${PIPESTATUS[0]}"; grep -E "PASS|FAIL|Error" /tmp/swap.log ;;
    routing) timeout 90 python3 kernels_cuda/moe_routing.py --check 2>&1 | filt | tail -8 ;;
    decodein) timeout $LIM python3 kernels_cuda/decode_inputs.py --check --bench --out "$OUT/h200_decode_inputs.jsonl" \
             2>&1 | filt | grep -v '^{' | tail -20 ;;
    absorb) timeout $LIM python3 kernels_cuda/mla_absorb.py --check --bench --out "$OUT/h200_mla_absorb.jsonl" 2>&1 \
             | filt | grep -v '^{' | tail -12 ;;
    kernels) for f in moe_gemm silu_mul mla_rope_cache moe_routing; do [ -f kernels_cuda/$f.py ] || continue
             echo "== $f"; timeout 120 python3 kernels_cuda/$f.py --check --bench --out "$OUT/h200_$f.jsonl" 2>&1 \
             | filt | grep -v '^{' | tail -25; done ;;
    mla1) timeout $LIM python3 kernels_cuda/mla_decode.py --sweep-batch1 2>&1 | filt > "$OUT/mla1.log"
             grep '^{' "$OUT/mla1.log" > "$OUT/h200_mla_decode_batch1.jsonl"; tail -25 "$OUT/mla1.log" ;;
    ws) timeout $LIM python3 kernels_cuda/mla_decode_ws.py ${WS_SCHEDULE:+--schedule $WS_SCHEDULE} ${WS_ARGS:---check --bench} --out "$OUT/h200_mla_decode_ws.jsonl" 2>&1 \
             | filt > "$OUT/ws.log"; echo "ws rc=${PIPESTATUS[0]}"; grep -v '^{' "$OUT/ws.log" | tail -40
             python3 -c "
import json
for l in open('$OUT/h200_mla_decode_ws.jsonl'):
    r = json.loads(l); print(r.get('schedule'), r['heads'], r['batch'], r['seqlen_k'], r['q_len'], r['num_splits'], r['us'], r['pipelined_us'], r['speedup'], r.get('frac_of_copy'), r['TFLOPs'], r.get('check'))
" ;;
    wsdiag) timeout $LIM python3 kernels_cuda/mla_decode_ws.py ${WS_SCHEDULE:+--schedule $WS_SCHEDULE} --diagnose 2>&1 | filt > "$OUT/wsdiag.log"
             grep '^{' "$OUT/wsdiag.log" > "$OUT/h200_mla_decode_ws_diagnose.jsonl"; grep -v '^{' "$OUT/wsdiag.log" | tail -5
             python3 -c "
import json
for l in open('$OUT/h200_mla_decode_ws_diagnose.jsonl'):
    r = json.loads(l); print(r.get('schedule'), r['overlap_softmax'], r['prefetch_tiles'], r.get('evict_first'), r.get('early_left'), r.get('multicast'), r.get('chunked'), r.get('early_pv'), r['kv'], r['us'], r['us_per_64_keys'], r['TFLOPs'], r['frac_of_copy'], r.get('check'))
" ;;
    mla) timeout $LIM python3 benchmarks/bench_mla_decode.py --block-m 16 64 ${MLA_ARGS:-} --out "$OUT/h200_mla_decode.jsonl" \
             2>&1 | filt > /tmp/mla.log; tail -20 /tmp/mla.log ;;
    savecache) (set -o pipefail; tar -cf - -C /tmp/tlcache . | xz -9e > "$OUT/tlcache.tar.xz") \
             || { echo "savecache FAILED"; rm -f "$OUT/tlcache.tar.xz"; }; du -sh /tmp/tlcache "$OUT/tlcache.tar.xz" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
el "all done"
