"""The HAL op ``decode_inputs`` (backends/cpu/step_inputs.py), which the worker's decode path goes through: its
positions / cache slots / cu_seqlens / token rows equal ``build_device_metadata``'s (the prefill path keeps that
function, so the two must not drift), its input ids and next drafts follow the slot state, every backend's kernel
set reports it, and the engine counts the host's time blocked on the device (``host_wait_ms``)."""

import torch
from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.backends.cpu.step_inputs import decode_inputs

from deepinfer_npu.hal.kernel_set import KernelSet
from deepinfer_npu.model_executor.device_metadata import build_device_metadata


def _problem(seed: int, rows: int = 7, k: int = 4, bs: int = 16, width: int = 3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, k + 2, (rows,), generator=g)
    q[0] = max(int(q[0]), 1)
    kv = q + torch.randint(0, bs * width + 8, (rows,), generator=g)  # some positions past the tables
    slots_n = rows + 3
    args = (q.int(), kv.int(), torch.randint(1, 50, (rows, width), generator=g).int(),
            torch.randperm(slots_n, generator=g)[:rows], torch.where(torch.rand(rows, generator=g) < 0.5,
                                                                     torch.randint(5, 90, (rows,), generator=g), -1),
            torch.randint(100, 200, (slots_n,), generator=g), torch.randint(300, 400, (slots_n, max(k, 1)),
                                                                            generator=g))
    return args, bs, int(q.sum())


def test_decode_inputs_agrees_with_build_device_metadata():
    for seed in range(20):
        args, bs, t = _problem(seed)
        got = decode_inputs(*args, bs, t)
        attn, row, j = build_device_metadata(args[0], args[1], args[2], bs, t, 8, 64, False)
        assert torch.equal(got.positions, attn.positions) and torch.equal(got.slot_mapping, attn.slot_mapping)
        assert torch.equal(got.cu_seqlens_q, attn.cu_seqlens_q) and got.cu_seqlens_q.dtype == torch.int32
        assert torch.equal(got.row_of_token, row) and torch.equal(got.j_of_token, j)


def test_decode_inputs_ids_follow_the_slot_state():
    q = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
    kv = torch.tensor([10, 5, 4, 70], dtype=torch.int32)
    tables = torch.tensor([[7, 8], [9, 0], [0, 0], [3, 4]], dtype=torch.int32)
    slots = torch.tensor([2, 0, 1, 3])
    first = torch.tensor([11, -1, -1, 44])
    last = torch.tensor([100, 101, 102, 103])
    drafts = torch.tensor([[1000, 1001], [1010, 1011], [1020, 1021], [1030, 1031]])
    d = decode_inputs(q, kv, tables, slots, first, last, drafts, 64, 6)
    assert d.row_of_token.tolist() == [0, 0, 0, 1, 3, 3] and d.j_of_token.tolist() == [0, 1, 2, 0, 0, 1]
    assert d.positions.tolist() == [7, 8, 9, 4, 68, 69]
    assert d.slot_mapping.tolist() == [7 * 64 + 7, 7 * 64 + 8, 7 * 64 + 9, 9 * 64 + 4, 4 * 64 + 4, 4 * 64 + 5]
    assert d.cu_seqlens_q.tolist() == [0, 3, 4, 4, 6]
    # row 0 (slot 2): its known first token, then drafts 0 and 1; row 1 (slot 0): the slot's last token
    assert d.input_ids.tolist() == [11, 1020, 1021, 100, 44, 1030]
    assert d.draft_next.tolist() == [1020, 1021, -1, -1, 1030, -1]


def test_every_kernel_set_reports_decode_inputs():
    assert "decode_inputs" in KernelSet.OPS
    assert CpuKernelSet().op_report()["decode_inputs"] == "native"
    from deepinfer_npu.backends.ascend.kernels import AscendKernelSet

    assert AscendKernelSet().op_report()["decode_inputs"].startswith("fallback (the reference's aten ops")
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    ks = CudaKernelSet()
    assert ks.op_report()["decode_inputs"].startswith("pending (kernels_cuda.decode_inputs")
    args, bs, t = _problem(3)
    want = decode_inputs(*args, bs, t)
    got = ks.decode_inputs(*args, bs, t)  # host tensors: the reference, reported as such
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert ks.op_report()["decode_inputs"] == "fallback (reference (tensor not on a CUDA device))"


def test_engine_counts_host_wait(monkeypatch):
    """host_wait_ms is the time the host spends in the step's end-event wait: a wait made to take 3 ms a call
    (the CPU backend's events are otherwise instant) shows up once per step."""
    import time

    from deepinfer_npu.backends.cpu import stream

    from deepinfer_npu import LLM, SamplingParams

    llm = LLM()
    llm.generate(["warm"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    before = llm.get_stats()
    assert 0.0 <= before["host_wait_ms"] <= before["step_ms"]
    sync = stream.HostEvent.synchronize
    monkeypatch.setattr(stream.HostEvent, "synchronize", lambda self: (time.sleep(0.003), sync(self))[1])
    llm.generate(["hello there"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    after = llm.get_stats()
    steps = after["num_steps"] - before["num_steps"]
    assert steps >= 4 and after["host_wait_ms"] - before["host_wait_ms"] >= 3.0 * steps
