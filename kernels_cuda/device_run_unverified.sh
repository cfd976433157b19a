#!/usr/bin/env bash
# Session 3's device call for the CUDA kernels then gated as unverified (backends/cuda/kernels.py UNVERIFIED_KERNELS:
# kernels_cuda/zos_fixup.py, spec_verify.py, sampling.py; verified there and on since): their --check and --bench, their GPU tests, then the
# engine-level test with DEEPINFER_CUDA_UNVERIFIED_KERNELS=1 (tests/cuda/test_kernels_vs_reference_engine.py).
# Run from the repository root on the GPU machine with .carry/ carried (tilelang site tarball, optional TileLang
# cache). Outputs under $OUT (or ./device_out). Expected: "CHECK PASS" three times, every test passed.
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
(mkdir -p /tmp/site && tar -xJf .carry/tilelang-0.1.15-cp312-site.tar.xz -C /tmp/site) &
python3 setup.py build_ext --inplace -q -j 16 > "$OUT/build.log" 2>&1 || echo "BUILD FAILED" >> "$OUT/build.log" &
wait
for d in backends kernels_cuda kernels_ascend; do [ -e deepinfer_npu/$d ] || ln -s ../$d deepinfer_npu/$d; done
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=$PWD/.carry/tlcache
filt() { grep -v "TileLang:tilelang.jit.kernel:INFO"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
el "setup done"
timeout 240 python3 kernels_cuda/mla_decode.py --check-prefill 2>&1 | filt > "$OUT/mla_prefill.log"
grep -E "FAIL|CHECK|Error" "$OUT/mla_prefill.log" | head -20; el "mla_prefill done"
for m in zos_fixup spec_verify sampling; do
  timeout 240 python3 kernels_cuda/$m.py --check --bench 2>&1 | filt > "$OUT/$m.log"
  grep -E "FAIL|CHECK|Error|error" "$OUT/$m.log" | head -20; el "$m done"
done
grep -h '^{' "$OUT"/zos_fixup.log "$OUT"/spec_verify.log "$OUT"/sampling.log > "$OUT/h200_sampling_kernels.jsonl"
timeout 240 python3 -m pytest tests/kernels_cuda/test_cuda_kernel_zos_fixup.py tests/kernels_cuda/test_cuda_kernel_spec_verify.py \
  tests/kernels_cuda/test_cuda_kernel_sampling.py tests/kernels_cuda/test_mla_prefill.py -q -rs -p no:cacheprovider -k "not check_script" 2>&1 | filt | tail -12
el "kernel tests done"
timeout 420 python3 -m pytest tests/cuda/test_kernels_vs_reference_engine.py -q -rs -p no:cacheprovider 2>&1 | filt | tail -12
el "all done"
