"""kernels_cuda.spec_verify (greedy draft verification; temperature rows without drafts) and its use by the CUDA
kernel set.

Everywhere: the argument checks (what is routed to the reference) and NumPy
mirrors of the two kernels' logic against the CPU reference op: the 64-bit arg-max key (torch's order: NaN largest,
ties and +-0 to the lowest index) and the accept kernel's per-row bit words (accepted = trailing ones,
``popc(x & ~(x + 1))``). The mirrors check the algorithm, not the TileLang code.
On a CUDA device: emitted, num_emitted, accepted, target_tokens equal to the reference op on the same CUDA tensors
(int64; the sampled rows' hash-RNG Gumbel noise bit for bit), a CUDA-graph replay.
"""

import numpy as np
import pytest
import torch

from deepinfer_npu.backends.cpu.spec_verify import spec_verify as cpu_spec_verify
from deepinfer_npu.kernels_cuda import spec_verify as sv
from deepinfer_npu.kernels_cuda._testing import sampling, verify_logits, verify_step

FIELDS = ("emitted", "num_emitted", "accepted", "target_tokens")
CASES = [  # (rows, max_q, V, logits kind, layout, greedy fraction)
    (1, 1, 129280, "randn", "prefill", 1.0),
    (1, 4, 129280, "randn", "worker", 1.0),
    (7, 2, 4096, "randn", "worker", 1.0),
    (64, 4, 102400, "randn", "worker", 1.0),
    (64, 4, 129280, "ties", "worker", 1.0),
    (64, 2, 129280, "special", "worker", 1.0),
    (256, 4, 129280, "randn", "worker", 1.0),
    (256, 1, 129280, "special", "prefill", 1.0),
    (1024, 1, 129280, "randn", "prefill", 1.0),  # T = 1024 logits rows: one split a row
    (256, 4, 102400, "randn", "worker", 1.0),  # T ~ 640
    (32, 16, 4096, "ties", "worker", 1.0),  # q up to 16 (bits 0..15)
    (16, 32, 4096, "randn", "worker", 1.0),  # q up to 32 (bit 31)
    (33, 3, 4096, "equal", "worker", 1.0),  # every logit equal: arg-max 0 everywhere
    (40, 4, 4096, "randn", "shuffled", 1.0),  # tokens in any order, rows without tokens
    (5, 3, 1001, "randn", "worker", 1.0),  # V % 4 != 0: scalar loads
    (3, 2, 7, "ties", "worker", 1.0),  # V smaller than a thread's vector
    # sampled rows (max_q == 1): Gumbel-max with the hash RNG (bit for bit), mixed with greedy rows
    (64, 1, 129280, "randn", "prefill", 0.0),
    (64, 1, 102400, "randn", "prefill", 0.5),
    (1024, 1, 129280, "randn", "prefill", 0.3),
    (16, 1, 4096, "special", "prefill", 0.5),
    (16, 1, 4096, "ties", "prefill", 0.0),
    (9, 1, 1001, "randn", "prefill", 0.0),
]


def spec_verify_ref(step, t):
    """The CPU reference op on the same tensors, as the kernel's four outputs."""
    vo = cpu_spec_verify(**step, t=t)
    return tuple(getattr(vo, f) for f in FIELDS)


def assert_same(out, ref):
    for name, a, b in zip(FIELDS, out, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name


# ---- mirrors -----------------------------------------------------------------------------------------------------
def argmax_by_key(x):
    """Row arg-max through the kernel's key: sortable(value) * 2**32 + (0xFFFFFFFF - index), int64 max."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = np.where(x == 0, np.int32(0), x.view(np.int32)).astype(np.int64)
    s = b ^ ((b >> 31) & 0x7FFFFFFF)
    s = np.where(np.isnan(x), 0x7FFFFFFF, s)
    idx = np.arange(x.shape[1], dtype=np.int64)
    key = s * (1 << 32) + (0xFFFFFFFF - idx)
    return 0xFFFFFFFF - (key.max(axis=1) & 0xFFFFFFFF)


def accept_mirror(greedy, draft, row, j, num_rows, max_q):
    bits = np.zeros(num_rows, dtype=np.uint64)
    for r in range(len(draft)):
        if draft[r] == greedy[r]:
            bits[row[r]] += np.uint64(1) << np.uint64(j[r])
    acc = np.array([bin(int(x) & ~(int(x) + 1)).count("1") for x in bits], dtype=np.int64)
    target = np.where(j < acc[row], draft, greedy)
    emitted = np.full((num_rows, max_q), -1, dtype=np.int64)
    live = j <= acc[row]
    emitted[row[live], j[live]] = target[live]
    return emitted, acc + 1, acc, target


@pytest.mark.parametrize("kind", ["randn", "ties", "special", "equal"])
def test_argmax_key_matches_torch_argmax(kind):
    g = torch.Generator().manual_seed(0)
    x = verify_logits(64, 1001, kind, g, device="cpu")
    assert np.array_equal(argmax_by_key(x.numpy()), x.argmax(-1).numpy())


@pytest.mark.parametrize("layout", ["worker", "prefill", "shuffled", "full"])
@pytest.mark.parametrize("max_q", [1, 3, 16, 32])
def test_accept_mirror_matches_reference_cpu(layout, max_q):
    if layout == "prefill" and max_q != 1:
        pytest.skip("prefill steps have one token a row")
    step = verify_step(37, max_q, 64, "ties", layout=layout, seed=max_q, device="cpu")
    n = step["logits"].shape[0]
    t = sampling(n, 1.0, device="cpu")
    assert sv.reason(**step, t=t) is None
    ref = spec_verify_ref(step, t)
    got = accept_mirror(step["logits"].argmax(-1).numpy(), step["draft_next"].numpy(), step["row_of_token"].numpy(),
                        step["j_of_token"].numpy(), step["num_rows"], max_q)
    for a, b in zip(got, ref):
        assert np.array_equal(a, b.numpy())


# ---- routing -----------------------------------------------------------------------------------------------------
def test_reason_routes_what_the_kernels_do_not_cover():
    step = verify_step(4, 3, 64, seed=0, device="cpu")
    n = step["logits"].shape[0]
    greedy = sampling(n, 1.0, device="cpu")
    mixed = sampling(n, 0.5, seed=1, device="cpu")
    assert sv.reason(**step, t=greedy) is None
    assert "drafts" in sv.reason(**step, t=mixed)
    assert "ban mask" in sv.reason(**step, t=greedy, ban_mask=torch.zeros(n, 64, dtype=torch.bool))
    lp = sampling(n, 1.0, device="cpu")
    lp.max_num_logprobs = 2
    assert "logprobs" in sv.reason(**step, t=lp)
    one = verify_step(4, 1, 64, layout="prefill", device="cpu")
    t1 = sampling(4, 0.5, seed=2, device="cpu")
    assert sv.reason(**one, t=t1) is None  # temperature rows without drafts
    t1.need_top_p = True
    assert "top-k / top-p" in sv.reason(**one, t=t1)
    assert "fp32" in sv.reason(**{**step, "logits": step["logits"].half()}, t=greedy)
    assert "max_q" in sv.reason(**{**step, "max_q": 33}, t=greedy)
    assert "rows" in sv.reason(**{**step, "num_rows": sv.MAX_ROWS + 1}, t=greedy)
    empty = verify_step(1, 1, 64, layout="prefill", device="cpu")
    empty.update(logits=empty["logits"][:0], draft_next=empty["draft_next"][:0],
                 row_of_token=empty["row_of_token"][:0], j_of_token=empty["j_of_token"][:0])
    assert "empty" in sv.reason(**empty, t=sampling(0, 1.0, device="cpu"))


# ---- GPU ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-q{c[1]}-V{c[2]}-{c[3]}-{c[4]}-g{c[5]}")
def test_spec_verify_matches_reference_gpu(case):
    """emitted, num_emitted, accepted and target_tokens equal (int64) to the CPU reference op on the same CUDA
    tensors."""
    rows, max_q, v, kind, layout, greedy_frac = case
    step = verify_step(rows, max_q, v, kind, layout=layout, seed=rows + max_q)
    t = sampling(step["logits"].shape[0], greedy_frac, seed=rows + max_q)
    assert sv.reason(**step, t=t) is None, sv.reason(**step, t=t)
    assert_same(sv.spec_verify(**step, t=t), spec_verify_ref(step, t))


@pytest.mark.gpu
@pytest.mark.tilelang
def test_spec_verify_graph_replay_gpu():
    """Both kernels captured in a CUDA graph (no host reads) and replayed on new logits."""
    step = verify_step(48, 4, 102400, seed=5)
    t = sampling(step["logits"].shape[0])
    sv.spec_verify(**step, t=t)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = sv.spec_verify(**step, t=t)
    step["logits"].copy_(verify_step(48, 4, 102400, seed=6)["logits"])
    gr.replay()
    assert_same(out, spec_verify_ref(step, t))


@pytest.mark.gpu
@pytest.mark.tilelang
def test_kernel_set_runs_the_kernels_gpu():
    from deepinfer_npu.backends.cuda import kernels as ck

    ks = ck.CudaKernelSet()
    step = verify_step(16, 4, 102400, seed=8)
    n = step["logits"].shape[0]
    for t in (sampling(n, 1.0), sampling(n, 0.5, seed=3)):  # greedy: kernel; mixed: reference
        vo, rv = ks.spec_verify(**step, t=t), cpu_spec_verify(**step, t=t)
        for f in ("emitted", "num_emitted", "accepted", "target_tokens"):
            assert torch.equal(getattr(vo, f), getattr(rv, f)), f
    pre = verify_step(16, 1, 102400, layout="prefill", seed=9)
    t = sampling(16, 0.5, seed=4)
    vo, rv = ks.spec_verify(**pre, t=t), cpu_spec_verify(**pre, t=t)
    assert torch.equal(vo.emitted, rv.emitted) and torch.equal(vo.target_tokens, rv.target_tokens)
    rep = ks.op_report()["spec_verify"]
    assert rep.startswith("native (kernels_cuda.spec_verify (greedy)"), rep
    assert "temperature rows without drafts" in rep and "sampled rows with drafts" in rep, rep


@pytest.mark.gpu
@pytest.mark.tilelang
def test_kernel_set_masks_bans_in_and_keeps_the_kernels_gpu():
    """A ban mask (min_tokens, structured output) is masked into the logits before the kernels: the same tokens as
    the reference op with the mask (which differ from the unmasked ones), and the kernel path still taken."""
    from deepinfer_npu.backends.cuda import kernels as ck

    ks = ck.CudaKernelSet()
    gen = torch.Generator(device="cuda").manual_seed(11)
    decode, prefill = verify_step(16, 4, 102400, seed=12), verify_step(16, 1, 102400, layout="prefill", seed=13)
    for step, t in ((decode, None), (prefill, sampling(16, 0.5, seed=5))):
        n = step["logits"].shape[0]
        t = t if t is not None else sampling(n, 1.0)
        ban = torch.rand(n, 102400, device="cuda", generator=gen) < 0.5
        ban[:, step["logits"].argmax(-1)] = True  # the unmasked winners are banned: the mask must matter
        vo, rv = ks.spec_verify(**step, t=t, ban_mask=ban), cpu_spec_verify(**step, t=t, ban_mask=ban)
        for f in ("emitted", "num_emitted", "accepted", "target_tokens"):
            assert torch.equal(getattr(vo, f), getattr(rv, f)), f
        plain = cpu_spec_verify(**step, t=t)
        assert not torch.equal(plain.target_tokens, rv.target_tokens)  # the mask changed the tokens
    rep = ks.op_report()["spec_verify"]
    assert rep.startswith("native (kernels_cuda.spec_verify"), rep
    assert "ban mask" not in rep, rep
