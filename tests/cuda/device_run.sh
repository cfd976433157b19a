#!/usr/bin/env bash
# One H200 call for the CUDA backend: tilelang + the C++ core, GPU tests, parity goldens (fp32, bf16), the
# end-to-end decode benchmark. Run from the repository root with .carry/ carried; outputs under $OUT (8 files).
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=$PWD/.carry/tlcache
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
(mkdir -p /tmp/site && tar -xJf .carry/tilelang-0.1.15-cp312-site.tar.xz -C /tmp/site) &
python3 setup.py build_ext --inplace -q -j 16 > "$OUT/build.log" 2>&1 || echo "BUILD FAILED" >> "$OUT/build.log" &
wait
for d in backends kernels_cuda kernels_ascend; do [ -e deepinfer_npu/$d ] || ln -s ../$d deepinfer_npu/$d; done
export PYTHONPATH=$PWD:/tmp/site
el "setup done"; tail -3 "$OUT/build.log"
timeout 75 python3 -m pytest tests/cuda tests/model/test_registry.py -q -rs -p no:cacheprovider 2>&1 \
  | grep -v "tilelang.jit.kernel:INFO" > "$OUT/tests.log"; tail -15 "$OUT/tests.log"; el "tests done"
for dt in float32 bfloat16; do
  timeout 55 python3 -m deepinfer_npu.parity record --backend cuda --dtype $dt --out "$OUT/cuda-$dt.json" 2>&1 \
    | grep -v "INFO" | tail -5 >> "$OUT/golden.log"
done; cat "$OUT/golden.log"; el "goldens done"
timeout 185 python3 benchmarks/bench_decode_e2e.py --backend cuda --batch 1 16 64 --prompt-len 512 --gen 32 \
  --out "$OUT/h200_decode_e2e.jsonl" 2>&1 | grep -v "tilelang.jit.kernel:INFO" > "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | tail -25; grep '^{"bench": "decode_e2e"' "$OUT/bench.log"; el "all done"
