"""hal/host_to_device.py: a step's host arrays reach the device in one copy, each with its dtype, shape and values,
never as views of the caller's memory; the worker's transfers and the sampling tensors go through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_npu.hal.host_to_device import to_device
from deepinfer_npu.sampling import SamplingTensors

# a decode step's arrays as the worker sends them: odd sizes so that every view needs the alignment padding
STEP_ARRAYS = [
    (np.array([1, 3, 2], dtype=np.int32), torch.int32),  # seqlens_q
    (np.array([513, 70, 9], dtype=np.int32), torch.int32),  # seqlens_k
    (np.arange(21, dtype=np.int32).reshape(3, 7), torch.int32),  # block tables
    (np.array([5, 0, 2], dtype=np.int32), torch.int64),  # state slots, widened
    (np.array([True, False, True]), torch.bool),  # optimistic rows
    (np.array([-1, 17, -1], dtype=np.int64), torch.int64),  # first tokens
    (np.zeros((0, 2), dtype=np.int32), torch.int64),  # no clone pairs
    (np.array([0.5, 1.0, 0.25]), torch.float32),  # a float64 array narrowed
]


def _check(out: list[torch.Tensor], device: str) -> None:
    assert len(out) == len(STEP_ARRAYS)
    for t, (a, dtype) in zip(out, STEP_ARRAYS):
        assert t.dtype == dtype and tuple(t.shape) == a.shape and t.device.type == device
        assert t.is_contiguous() and t.data_ptr() % 16 == 0
        assert torch.equal(t.cpu(), torch.from_numpy(a).to(dtype)), (a, t)


def test_arrays_arrive_with_dtype_shape_and_values_on_cpu():
    out = to_device(STEP_ARRAYS, "cpu")
    _check(out, "cpu")
    # the results are copies: changing the caller's arrays (the next step's plan reuses them) changes nothing
    STEP_ARRAYS[0][0][:] = 99
    try:
        assert out[0].tolist() == [1, 3, 2]
    finally:
        STEP_ARRAYS[0][0][:] = [1, 3, 2]
    # and the views do not overlap: writing one leaves its neighbours alone
    out[1].fill_(-7)
    assert out[0].tolist() == [1, 3, 2] and out[2].flatten().tolist() == list(range(21))


def test_scalars_lists_and_nothing():
    one, listed = to_device([(np.int64(7), torch.int64), ([1, 2, 3], torch.int16)], "cpu")
    assert one.shape == () and int(one) == 7 and listed.dtype == torch.int16 and listed.tolist() == [1, 2, 3]
    assert to_device([], "cpu") == []


def test_an_unsupported_dtype_is_named():
    with pytest.raises(TypeError, match="bfloat16"):
        to_device([(np.zeros(2), torch.bfloat16)], "cpu")


def test_sampling_tensors_from_params_keep_their_values():
    from deepinfer_npu import SamplingParams

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1,
                                                              presence_penalty=0.5, logit_bias={3: 2.0, 99: -1.0})]
    t = SamplingTensors.from_params(params, [1, 2**63 + 5], [0, 4], vocab_size=50,
                                    banned_token_ids=[[1], [2, 70]])
    assert t.temperature.tolist() == [1.0, pytest.approx(0.7)] and t.top_k.tolist() == [0, 5]
    assert t.is_greedy.tolist() == [True, False] and t.offsets.tolist() == [0, 4]
    assert t.seeds.dtype == torch.int64 and t.seeds.tolist()[1] == 2**63 + 5 - 2**64
    assert t.banned_rows.tolist() == [0, 1] and t.banned_token_ids.tolist() == [1, 2]  # 70 is out of the vocab
    assert t.min_p.tolist() == [0.0, pytest.approx(0.1)] and t.presence_penalty.tolist() == [0.0, 0.5]
    assert t.logit_bias.shape == (2, 50) and t.logit_bias[1, 3] == 2.0 and t.logit_bias.abs().sum() == 2.0
    assert not t.all_greedy and not t.all_random and t.need_top_k and t.need_top_p


@pytest.mark.gpu
def test_arrays_arrive_on_cuda_in_one_copy():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = to_device(STEP_ARRAYS, "cuda")
        torch.cuda.synchronize()
    _check(out, "cuda")
    copies = [e for e in prof.events() if e.name == "cudaMemcpyAsync"]
    assert len(copies) == 1, [e.name for e in prof.events()]
