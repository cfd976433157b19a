#!/usr/bin/env bash
# One short H200 call for captured decode graphs: tilelang + the C++ core, the CUDA graph/backend tests, then the
# end-to-end decode benchmark with --graphs (eager numbers: benchmarks/results/h200_decode_e2e.jsonl). Run from the
# repository root with .carry/ carried; outputs under $OUT. About 2 minutes.
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=$PWD/.carry/tlcache
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
(mkdir -p /tmp/site && tar -xJf .carry/tilelang-0.1.15-cp312-site.tar.xz -C /tmp/site) &
python3 setup.py build_ext --inplace -q -j 16 > "$OUT/build.log" 2>&1 || echo "BUILD FAILED" >> "$OUT/build.log" &
wait
for d in backends kernels_cuda kernels_ascend; do [ -e deepinfer_npu/$d ] || ln -s ../$d deepinfer_npu/$d; done
export PYTHONPATH=$PWD:/tmp/site
el "setup done"; tail -3 "$OUT/build.log"
timeout 60 python3 -m pytest tests/cuda -q -rs -p no:cacheprovider 2>&1 \
  | grep -v "tilelang.jit.kernel:INFO" > "$OUT/tests.log"; tail -25 "$OUT/tests.log"; el "tests done"
timeout 75 python3 benchmarks/bench_decode_e2e.py --backend cuda --batch 1 16 --prompt-len 512 --gen 32 --no-hf \
  --graphs --out "$OUT/h200_decode_e2e_graphs.jsonl" 2>&1 | grep -v "tilelang.jit.kernel:INFO" > "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | tail -12; grep '^{"bench": "decode_e2e"' "$OUT/bench.log"; el "all done"
