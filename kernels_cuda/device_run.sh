#!/usr/bin/env bash
# One device call for the CUDA kernel set: unpack tilelang, compile-cache, checks, benchmarks, GPU tests.
# Run from the repository root on the GPU machine with .carry/ carried (tilelang site tarball + TileLang cache).
# Outputs under $OUT (or ./device_out).
set -u
OUT=${OUT:-device_out}; mkdir -p "$OUT"
mkdir -p /tmp/site && tar -xJf .carry/tilelang-0.1.15-cp312-site.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=$PWD/.carry/tlcache
filt() { grep -v "TileLang:tilelang.jit.kernel:INFO"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
for f in .carry/tlcache/0.1.15/cuda-binaries/*/kernel.cubin; do
  cuobjdump --dump-resource-usage "$f" 2>&1 | grep -E "Function|REG" ; done > "$OUT/resources.txt" 2>&1
t0=$(date +%s)
python3 kernels_cuda/mla_decode.py --check 2>&1 | filt | tee "$OUT/check.log"
t1=$(date +%s); echo "check: $((t1-t0))s"
python3 benchmarks/bench_mla_decode.py --out "$OUT/h200_mla_decode.jsonl" 2>&1 | filt | tee "$OUT/bench.log"
python3 benchmarks/bench_mla_decode.py --batch 64 --heads 16 --splits 1 4 --out "$OUT/h200_mla_decode_variants.jsonl" 2>&1 | filt | tail -8
python3 benchmarks/bench_mla_decode.py --batch 64 --heads 16 128 --seqlen-k 4096 --q-len 2 4 --out "$OUT/h200_mla_decode_variants.jsonl" 2>&1 | filt | tail -6
t2=$(date +%s); echo "bench: $((t2-t1))s"
python3 kernels_cuda/rms_norm.py --check --bench 2>&1 | filt | tee "$OUT/rms_norm.log"
python3 -m pytest tests/kernels_cuda -q -k gpu -p no:cacheprovider 2>&1 | filt | tail -4
echo "total: $(( $(date +%s)-t0 ))s"
