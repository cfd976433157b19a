"""FP8 MoE layers captured in one CUDA graph and replayed many times with changing routing must finish: a decode
graph's FP8 chain (``fp8_linear`` at the step's rows, then ``fp8_grouped_mlp`` over V2-Lite's 64 experts, top-6)
for 26 layers, each replay with new tokens-per-expert counts (random and skewed: experts with more rows than one
row tile of the grouped GEMM). Runs in a child process with a time limit, so a kernel that never ends fails the
test instead of hanging the run; the child prints its progress. Rows 64 and 256 (the decode batches where a
V2-Lite-shape FP8 engine hung on an H200, in the grouped GEMM's producer wait: kernels_cuda/_producer_wait.py), with
the engine's programmatic-dependent-launch setting (``DEEPINFER_PDL_OFF``, default: every kernel with it). Other
settings, one case alone (what docs/kernels/pdl.md records):
``DEEPINFER_PDL_OFF=all python tests/cuda/test_fp8_graph_replay.py 64 1000``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

LAYERS = 26
EXPERTS, TOP_K, D, INTER = 64, 6, 2048, 1408
REPLAYS = 1000
TIME_LIMIT_S = 300  # 49-66 s with four to six such children at once on an H200, most of it kernel builds


def main(tokens: int, replays: int) -> None:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(TIME_LIMIT_S - 10, exit=False)  # where it waits, before the parent kills it

    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.model_executor.quantization.fp8 import quantize_fp8_block

    torch.manual_seed(0)
    dev = "cuda"
    ks = CudaKernelSet()
    wq, sq = quantize_fp8_block(torch.randn(D, D, device=dev) * D**-0.5)
    w13, s13 = quantize_fp8_block(torch.randn(EXPERTS, 2 * INTER, D, device=dev) * D**-0.5)
    w2, s2 = quantize_fp8_block(torch.randn(EXPERTS, D, INTER, device=dev) * INTER**-0.5)
    rows = tokens * TOP_K
    bank = []  # tokens-per-expert vectors summing to rows: random picks and skewed ones
    for i in range(64):
        if i % 2:
            ids = torch.stack([torch.randperm(EXPERTS, device=dev)[:TOP_K] for _ in range(tokens)]).flatten()
        else:
            hot = torch.randint(0, 8, (rows,), device=dev)
            ids = torch.where(torch.rand(rows, device=dev) < 0.5, hot, torch.randint(0, EXPERTS, (rows,), device=dev))
        bank.append(torch.bincount(ids, minlength=EXPERTS))
    counts = bank[0].clone()
    x0 = torch.randn(tokens, D, device=dev, dtype=torch.bfloat16)

    def step():
        x = x0
        for _ in range(LAYERS):
            y = ks.fp8_linear(x, wq, sq)
            h = ks.fp8_grouped_mlp(y.repeat_interleave(TOP_K, 0), counts, w13, s13, w2, s2)
            x = (h.view(tokens, TOP_K, D).float().sum(1) * 0.1).to(torch.bfloat16)
        return x

    step()  # eager: builds the kernels, checks cuBLASLt's shapes
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    print(f"captured: pid {os.getpid()}", flush=True)  # from here a stall is a replay that never ends
    t0 = time.time()
    for i in range(replays):
        counts.copy_(bank[i % len(bank)])
        graph.replay()
        if i % 50 == 49:
            torch.cuda.synchronize()
            print(f"replay {i + 1}/{replays} at {time.time() - t0:.1f}s", flush=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    print(f"done: {replays} replays of {LAYERS} layers at {tokens} rows in {time.time() - t0:.1f}s "
          f"(fp8_linear: {ks.op_report().get('fp8_linear')})", flush=True)


@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("tokens", [64, 256])
def test_fp8_moe_graph_replays_finish_gpu(tokens):
    pdl_off = os.environ.get("DEEPINFER_PDL_OFF", "")
    try:
        proc = subprocess.run([sys.executable, __file__, str(tokens), str(REPLAYS)], capture_output=True, text=True,
                              timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired as e:
        out, err = ((b or b"").decode() if isinstance(b, bytes) else (b or "") for b in (e.stdout, e.stderr))
        where = ("the replays never finished (a kernel that never ends)" if "captured" in out
                 else "it never reached the replays (still building or capturing)")
        pytest.fail(f"{REPLAYS} graph replays at {tokens} rows (DEEPINFER_PDL_OFF={pdl_off!r}) did not finish in "
                    f"{TIME_LIMIT_S} s: {where}; progress:\n{out[-2000:]}\nstderr:\n{err[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "done:" in proc.stdout, proc.stdout[-2000:]
    print(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
