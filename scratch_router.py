import json, torch
from deepinfer_npu.kernels_cuda.bench import time_us
from deepinfer_npu.kernels_cuda import skinny_gemm as sk
w = torch.randn(64, 2048, device="cuda") * 0.02
for t in (16, 64, 256):
    h = torch.randn(t, 2048, device="cuda").to(torch.bfloat16)
    ref = h.float() @ w.t()
    us_a, _ = time_us(lambda: torch.nn.functional.linear(h.float(), w))
    sk.precompile([sk.config_for(2048, t, False, False, torch.bfloat16, torch.float32, torch.float32)]) if hasattr(sk, "precompile") else None
    try:
        out = sk.skinny_gemm(h, w)
        err = (out - ref).abs().max().item()
        us_b, _ = time_us(lambda: sk.skinny_gemm(h, w))
    except Exception as e:
        us_b, err = str(e)[:200], None
    def split():
        p = torch.bmm(h.float().view(t, 16, 128).transpose(0, 1), w.view(64, 16, 128).permute(1, 2, 0))
        return p.sum(0)
    us_c, _ = time_us(split)
    print(json.dumps({"rows": t, "torch_fp32_linear_us": round(us_a, 2), "skinny_us": us_b, "skinny_maxerr": err,
                      "ksplit_bmm_us": round(us_c, 2), "ksplit_err": (split() - ref).abs().max().item()}))
