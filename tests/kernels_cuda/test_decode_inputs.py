"""kernels_cuda.decode_inputs (a decode step's per-token inputs in one launch).

Everywhere: the operand checks (``reason`` / ValueError, no GPU needed), and a NumPy mirror of the kernel's steps
(the per-thread scan into ``cu[0..MAX_ROWS]``, the fixed-step binary search for a token's row, floor division and
modulo, the clamps) against the CPU reference op on the GPU test's cases; the mirror checks the algorithm, not the
TileLang code (tests/kernels_cuda/test_compile.py compiles that). On a CUDA device: every output equal to the
reference op on the same CUDA tensors, CUDA-graph replay included, and a hand-made case.
"""

import numpy as np
import pytest
import torch

from deepinfer_npu.backends.cpu.step_inputs import decode_inputs as decode_inputs_ref
from deepinfer_npu.kernels_cuda import decode_inputs as di
from deepinfer_npu.kernels_cuda._testing import decode_step

# (name, rows, q_lo, q_hi, k, block_size, short_tables, neg_first, zero_rows)
CASES = [
    ("batch-1 decode, no drafts", 1, 1, 1, 1, 64, False, 0.0, 0.0),
    ("batch-1, first unknown", 1, 1, 1, 1, 64, False, 1.0, 0.0),
    ("batch-1 verify q=4", 1, 4, 4, 3, 64, False, 0.5, 0.0),
    ("B=64 q=1", 64, 1, 1, 3, 64, False, 0.3, 0.0),
    ("B=64 q 1..6 K=5", 64, 1, 6, 5, 64, False, 0.3, 0.0),
    ("B=64 q 0..6 K=5 bs16", 64, 1, 6, 5, 16, False, 0.3, 0.3),
    ("B=37 short tables bs16", 37, 1, 6, 5, 16, True, 0.5, 0.1),
    ("B=50 short tables bs64", 50, 1, 4, 3, 64, True, 0.0, 0.0),
    ("K=1 with q up to 4", 8, 1, 4, 1, 64, False, 0.3, 0.0),
    ("mostly empty rows", 300, 1, 3, 2, 64, False, 0.3, 0.95),
    ("B=MAX_ROWS q 1..4", di.MAX_ROWS, 1, 4, 3, 64, False, 0.3, 0.0),
    ("B=MAX_ROWS q 0..16 bs16", di.MAX_ROWS, 0, 16, 15, 16, True, 0.3, 0.2),
    ("B=MAX_ROWS T=MAX_TOKENS", di.MAX_ROWS, 16, 16, 15, 64, False, 0.3, 0.0),
]


def assert_equal_outputs(got, ref):
    for name, a, b in zip(di.DecodeInputs._fields, got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name


# ---- NumPy mirror of the kernel ----------------------------------------------------------------------------------
def kernel_mirror(sq, sk, tables, slots, first, last, drafts, block_size, num_tokens, threads=di.THREADS):
    b, w = tables.shape
    k = drafts.shape[1]
    rpt = di.MAX_ROWS // threads
    log = (di.MAX_ROWS - 1).bit_length()
    # 1. scan: rows tid*rpt.. per thread (0 past B), exclusive over threads, then within the thread's rows
    q_pad = np.zeros(di.MAX_ROWS, dtype=np.int64)
    q_pad[:b] = sq
    per_thread = q_pad.reshape(threads, rpt)
    before = np.concatenate([[0], np.cumsum(per_thread.sum(axis=1))[:-1]])
    s_cu = np.zeros(di.MAX_ROWS + 1, dtype=np.int64)
    s_cu[:-1] = (before[:, None] + np.cumsum(per_thread, axis=1) - per_thread).reshape(-1)
    s_cu[-1] = q_pad.sum()
    # 2. per token: the largest r < B with cu[r] <= t, in LOG fixed steps
    t = np.arange(num_tokens, dtype=np.int64)
    r = np.zeros(num_tokens, dtype=np.int64)
    for s in range(log):
        cand = r + (1 << (log - 1 - s))
        take = cand < b
        take[take] = s_cu[cand[take]] <= t[take]
        r = np.where(take, cand, r)
    j = t - s_cu[r]
    q = sq.astype(np.int64)[r]
    pos = sk.astype(np.int64)[r] - q + j
    blk = pos // block_size  # numpy: floor, as TIR floordiv
    block = np.where(blk < w, tables.astype(np.int64)[r, np.minimum(blk, w - 1)], 0)
    slot = slots[r]
    f = first[r]
    ids = np.where(j == 0, np.where(f >= 0, f, last[slot]), drafts[slot, np.clip(j - 1, 0, k - 1)])
    nxt = np.where(j + 1 < q, drafts[slot, np.minimum(j, k - 1)], -1)
    return (pos, block * block_size + pos % block_size, s_cu[: b + 1].astype(np.int32), r, j, ids, nxt)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].replace(" ", "_"))
@pytest.mark.parametrize("seed", [0, 1])
def test_mirror_matches_reference_cpu(case, seed):
    args, bs, t = decode_step(*case[1:], seed=seed, device="cpu")
    ref = decode_inputs_ref(*args, bs, t)
    got = kernel_mirror(*[a.numpy() for a in args], bs, t)
    for name, a, b in zip(di.DecodeInputs._fields, got, ref):
        assert np.array_equal(a, b.numpy()) and a.dtype == b.numpy().dtype, name


def _hand_case() -> tuple[torch.Tensor, ...]:
    """(seqlens_q, seqlens_k, tables, slots, first_ids, last_token, drafts): rows with q = 0 first, middle and last,
    a position past the table, a first id of -1, draft columns to clamp (page 64, 5 tokens)."""
    sq = torch.tensor([0, 3, 0, 2, 0], dtype=torch.int32)
    sk = torch.tensor([5, 130, 7, 4, 9], dtype=torch.int32)
    tables = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], dtype=torch.int32)
    slots = torch.tensor([4, 0, 3, 2, 1])
    first = torch.tensor([11, -1, 12, 13, 14])
    last = torch.tensor([100, 101, 102, 103, 104])
    drafts = torch.tensor([[200, 201], [210, 211], [220, 221], [230, 231], [240, 241]])
    return sq, sk, tables, slots, first, last, drafts


def test_mirror_hand_case_cpu():
    """Rows with q = 0 (first, middle, last) are skipped; positions past the table map to block 0; first_ids -1
    reads last_token; the draft columns clamp to K - 1."""
    case = _hand_case()
    ref = decode_inputs_ref(*case, 64, 5)
    assert ref.row_of_token.tolist() == [1, 1, 1, 3, 3] and ref.j_of_token.tolist() == [0, 1, 2, 0, 1]
    assert ref.positions.tolist() == [127, 128, 129, 2, 3]
    assert ref.slot_mapping.tolist() == [4 * 64 + 63, 0 * 64 + 0, 0 * 64 + 1, 7 * 64 + 2, 7 * 64 + 3]
    assert ref.input_ids.tolist() == [100, 200, 201, 13, 220]
    assert ref.draft_next.tolist() == [200, 201, -1, 220, -1]
    assert ref.cu_seqlens_q.tolist() == [0, 0, 3, 3, 5, 5]
    got = kernel_mirror(*[a.numpy() for a in case], 64, 5)
    for a, b in zip(got, ref):
        assert np.array_equal(a, b.numpy())


# ---- operand checks (no GPU) -------------------------------------------------------------------------------------
def _valid(rows=4):
    args, bs, t = decode_step(rows, 1, 3, 2, seed=0, device="cpu")
    return args, bs, t


def test_reason_valid_operands_only_lack_a_device():
    args, bs, t = _valid()
    assert di.reason(*args, bs, t) == "tensor not on a CUDA device"
    assert di.reason(*args, np.int64(bs), np.int64(t)) == "tensor not on a CUDA device"  # numpy ints from a plan


def _mutate(which, args, bs, t):
    a = list(args)
    if which == "seqlens_q dtype":
        a[0] = a[0].long()
    elif which == "seqlens_k rows":
        a[1] = a[1][:-1]
    elif which == "tables dims":
        a[2] = a[2].reshape(-1)
    elif which == "tables strided":
        a[2] = a[2].t().contiguous().t()
    elif which == "slots dtype":
        a[3] = a[3].int()
    elif which == "first dtype":
        a[4] = a[4].float()
    elif which == "last not a tensor":
        a[5] = a[5].tolist()
    elif which == "drafts no columns":
        a[6] = a[6][:, :0].contiguous()
    elif which == "drafts rows":
        a[6] = a[6][:-1]
    elif which == "no rows":
        a = [x[:0] if i < 5 else x for i, x in enumerate(a)]
    elif which == "too many rows":
        a, bs, t = decode_step(di.MAX_ROWS + 1, 1, 1, 1, device="cpu")
    elif which == "too many tokens":
        t = di.MAX_TOKENS + 1
    elif which == "no tokens":
        t = 0
    elif which == "block size":
        bs = 0
    return a, bs, t


REJECTS = [
    ("seqlens_q dtype", "seqlens_q: dtype torch.int64, expected torch.int32"),
    ("seqlens_k rows", "seqlens_k: 3 rows, seqlens_q has 4"),
    ("tables dims", "block_tables: shape"),
    ("tables strided", "block_tables: not contiguous"),
    ("slots dtype", "state_slots: dtype torch.int32, expected torch.int64"),
    ("first dtype", "first_ids: dtype torch.float32"),
    ("last not a tensor", "last_token: list, not a tensor"),
    ("drafts no columns", "drafts: 0 columns"),
    ("drafts rows", "drafts: 10 slots, last_token has 11"),
    ("no rows", "seqlens_q: no rows"),
    ("too many rows", f"> MAX_ROWS {di.MAX_ROWS}"),
    ("too many tokens", f"num_tokens {di.MAX_TOKENS + 1}"),
    ("no tokens", "num_tokens 0"),
    ("block size", "block_size 0"),
]


@pytest.mark.parametrize("which,msg", REJECTS, ids=[r[0].replace(" ", "_") for r in REJECTS])
def test_reason_and_value_error(which, msg):
    args, bs, t = _mutate(which, *_valid())
    why = di.reason(*args, bs, t)
    assert why is not None and msg in why, why
    with pytest.raises(ValueError, match="decode_inputs: ") as e:
        di.decode_inputs(*args, bs, t)  # refused on the host, before any launch (no GPU here)
    assert msg in str(e.value)


def test_ci_configs_cover_engine_block_sizes():
    assert {bs for bs, _t in di.CI_CONFIGS} == {16, 64} and hasattr(di, "ci_compile")


# ---- GPU ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.tilelang
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].replace(" ", "_"))
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_gpu(case, seed):
    """Every output equal (values and dtypes) to the CPU reference op on the same CUDA tensors."""
    args, bs, t = decode_step(*case[1:], seed=100 + seed)
    assert_equal_outputs(di.decode_inputs(*args, bs, t), decode_inputs_ref(*args, bs, t))


@pytest.mark.gpu
@pytest.mark.tilelang
def test_graph_replay_gpu():
    """Captured in a CUDA graph, replayed on new lengths / slot state (same T)."""
    args, bs, t = decode_step(64, 1, 6, 5, seed=9)
    di.decode_inputs(*args, bs, t)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = di.decode_inputs(*args, bs, t)
    new, _, _ = decode_step(64, 1, 6, 5, seed=10)
    q = args[0][torch.randperm(64, device=args[0].device)]  # same total (T is baked in): a re-split
    args[1].copy_(q + new[1] - new[0])  # context lengths >= query lengths
    args[0].copy_(q)
    for i in (3, 4, 5, 6):  # slots, first ids, slot state
        args[i].copy_(new[i])
    gr.replay()
    assert_equal_outputs(out, decode_inputs_ref(*args, bs, t))


@pytest.mark.gpu
@pytest.mark.tilelang
def test_hand_case_gpu():
    args = [x.cuda() for x in _hand_case()]
    got = di.decode_inputs(*args, 64, 5)
    assert_equal_outputs(got, decode_inputs_ref(*args, 64, 5))
    assert got.input_ids.tolist() == [100, 200, 201, 13, 220]
