"""MLA decode kernel benchmark (issue 6, measurement 1): achieved bytes/s vs device-to-device copy
bandwidth measured in the same run, at batch 64 / 128, context 4K / 8K, 16 heads (V2-Lite) and 128 heads (V3),
one query token.

One JSON line per shape:
  {"bench": "mla_decode", "hardware": ..., "batch": B, "seqlen_k": S, "heads": H, "q_len": q, "us": t,
   "bytes": n, "GBps": x, "copy_GBps": c, "frac_of_copy": f, ...}
Bytes = the latent cache read once (batch * seqlen_k * 576 * 2, FlashMLA's count) + q + out + lse + block
table.

    python benchmarks/bench_mla_decode.py [--out benchmarks/results/h200_mla_decode.jsonl] [--q-len 1 2 4]
        [--warp-specialized]   (also kernels_cuda/mla_decode_ws.py's kernel where the tile has 64 rows, checked)
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kernels_cuda import mla_decode as mla  # noqa: E402
from kernels_cuda import mla_decode_ws as ws  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="append JSON lines here as well as to stdout")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlen-k", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--q-len", type=int, nargs="+", default=[1])
    ap.add_argument(
        "--splits",
        type=int,
        nargs="*",
        default=None,
        help="also time these fixed split counts (default: the heuristic only)",
    )
    ap.add_argument(
        "--block-m",
        type=int,
        nargs="*",
        default=None,
        help="also time these CTA row tiles (16: mma.sync tile of 16 rows at 128 threads; 64: wgmma tile at 256)",
    )
    ap.add_argument("--warp-specialized", action="store_true",
                    help="also time mla_decode_ws's kernel where the tile has 64 rows (checked vs the fp32 reference)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(B, H, S, q) for H in args.heads for B in args.batch for S in args.seqlen_k for q in args.q_len]
    cfgs = []
    for B, H, S, q in shapes:
        bq = mla.bucket_q(q)
        cfgs.append(mla.decode_config(H, bq, mla.default_num_splits(B, H, bq, S // mla.PAGE, num_sms)))
        cfgs += [mla.decode_config(H, bq, s) for s in (args.splits or [])]
        if args.warp_specialized and ws.applies(H, bq):
            cfgs.append(mla.decode_config(H, bq, mla.default_num_splits(B, H, bq, S // mla.PAGE, num_sms), True))
    mla.precompile(cfgs)
    copy_gbps = mla.copy_bandwidth()
    rows = [{"bench": "copy_d2d", "hardware": torch.cuda.get_device_name(), "GBps": round(copy_gbps, 1)}]
    print(json.dumps(rows[0]), flush=True)
    for B, H, S, q in shapes:
        for s in [None] + list(args.splits or []):
            row = mla.bench_case(B, H, S, q, num_splits=s, copy_gbps=copy_gbps)
            rows.append(row)
            print(json.dumps(row), flush=True)
        for bm in args.block_m or []:  # tile variants at the engine's split count (compiled at first use)
            if bm == mla.decode_block_m(H, mla.bucket_q(q)) or bm < mla.SMALL_BLOCK_M or H * q > 8 * bm:
                continue
            row = mla.bench_case(B, H, S, q, copy_gbps=copy_gbps, block_m=bm, check=True)
            rows.append(dict(row, variant=f"block_m={bm}"))
            print(json.dumps(rows[-1]), flush=True)
        if args.warp_specialized and ws.applies(H, mla.bucket_q(q)):
            rows.append(mla.bench_case(B, H, S, q, copy_gbps=copy_gbps, warp_specialized=True, check=True))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"{'H':>4} {'B':>4} {'S':>5} {'q':>2} {'bm':>3} {'spl':>3} {'kernel':>16} {'us':>8} {'GB/s':>7} {'frac':>5} "
          f"{'TFLOP/s':>7}")
    for r in rows[1:]:
        print(
            f"{r['heads']:>4} {r['batch']:>4} {r['seqlen_k']:>5} {r['q_len']:>2} {r['block_m']:>3} "
            f"{r['num_splits']:>3} {r['kernel']:>16} "
            f"{r['us']:>8.1f} {r['GBps']:>7.0f} {r['frac_of_copy']:>5.2f} {r['TFLOPs']:>7.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
