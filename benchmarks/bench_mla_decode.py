"""MLA decode kernel benchmark: achieved bytes/s against the device-to-device copy bandwidth measured in the same
run, at batch 64 / 128, context 4K / 8K, 16 heads (V2-Lite) and 128 heads (V3), one query token. The harness is
``deepinfer_npu.kernels_cuda.bench`` (its options: --batch --seqlen-k --heads --q-len --splits --block-m
--warp-specialized --sweep-batch1 --out); this is its ``mla_decode`` benchmark:

    python benchmarks/bench_mla_decode.py [--out benchmarks/results/h200_mla_decode.jsonl] [--q-len 1 2 4]
"""

import sys

from deepinfer_npu.kernels_cuda import bench

if __name__ == "__main__":
    sys.exit(bench.main(["mla_decode", *sys.argv[1:]]))
