"""worker/packed_inputs.py: a step's host inputs through one buffer (DEEPINFER_PACK_STEP_INPUTS=1) give the same
tensors as one copy each, and the engine's greedy tokens do not change with it, with speculation, ZOS and the
varlen re-split (whose draft caps are the optional seventh input)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.config import REFERENCE_MODEL_DIR
from deepinfer_npu.hal.sync_guard import HostReadDetector
from deepinfer_npu.worker import packed_inputs

CPU = torch.device("cpu")


def test_views_keep_values_dtypes_shapes_and_aligned_offsets():
    arrays = [
        (np.array([3, 1, 4], dtype=np.int64), torch.int32),
        (np.arange(6).reshape(2, 3), torch.int32),
        (np.array([True, False, True]), torch.bool),
        (np.array([-1, 7], dtype=np.int32), torch.int64),
        (np.zeros((2, 0), dtype=np.int64), torch.int32),  # a batch without block-table columns
        (np.array([], dtype=np.int64), torch.int64),
    ]
    out = packed_inputs.to_device(arrays, CPU)
    assert len(out) == len(arrays)
    for (a, dtype), t in zip(arrays, out):
        assert t.dtype == dtype and tuple(t.shape) == a.shape
        assert t.tolist() == a.astype(t.numpy().dtype).tolist()
        assert (t.storage_offset() * t.element_size()) % packed_inputs.ALIGN == 0
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1  # one buffer, one copy


def test_unsupported_dtype_and_bad_switch_are_named(monkeypatch):
    with pytest.raises(TypeError, match="dtype torch.float32"):
        packed_inputs.to_device([(np.zeros(2), torch.float32)], CPU)
    monkeypatch.setenv("DEEPINFER_PACK_STEP_INPUTS", "yes")
    with pytest.raises(ValueError, match="DEEPINFER_PACK_STEP_INPUTS='yes': 0 or 1"):
        packed_inputs.enabled()
    monkeypatch.setenv("DEEPINFER_PACK_STEP_INPUTS", "1")
    assert packed_inputs.enabled()
    monkeypatch.delenv("DEEPINFER_PACK_STEP_INPUTS")
    assert not packed_inputs.enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the pinned-memory branch)")
def test_device_views_match_one_copy_each():
    """The device branch: pinned buffer, one non-blocking copy, typed views of the device buffer."""
    dev = torch.device("cuda")
    arrays = [(np.array([5, 2, 9]), torch.int32), (np.arange(8).reshape(2, 4), torch.int32),
              (np.array([False, True]), torch.bool), (np.array([-1, 3]), torch.int64)]
    out = packed_inputs.to_device(arrays, dev)
    for (a, dtype), t in zip(arrays, out):
        want = torch.from_numpy(np.ascontiguousarray(a)).to(dtype).to(dev)
        assert t.device.type == "cuda" and t.dtype == dtype and torch.equal(t, want)
        assert t.data_ptr() % packed_inputs.ALIGN == 0


PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    "# Copyright 2001 Python Software Foundation\n\"\"\"Utilities for",
]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
HAS_DFLASH = (REFERENCE_MODEL_DIR / "dflash" / "dflash_config.json").exists()


@pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "config.json").exists(), reason="the reference model is not installed")
@pytest.mark.parametrize("method", [None, "mtp"] + (["dflash"] if HAS_DFLASH else []))
def test_packed_inputs_give_the_same_greedy_tokens(monkeypatch, method):
    def run():
        spec = dict(speculative_method=method, num_speculative_tokens=4, varlen_verification=True) if method else {}
        llm = LLM(zero_overhead_scheduling=True, **spec)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outs]

    monkeypatch.delenv("DEEPINFER_PACK_STEP_INPUTS", raising=False)
    plain_llm, plain = run()
    assert not plain_llm.llm_engine.worker.pack_step_inputs
    calls = []
    real = packed_inputs.to_device
    monkeypatch.setattr(packed_inputs, "to_device", lambda arrays, dev: calls.append(len(arrays)) or real(arrays, dev))
    monkeypatch.setenv("DEEPINFER_PACK_STEP_INPUTS", "1")
    llm, packed = run()
    assert llm.llm_engine.worker.pack_step_inputs and packed == plain
    assert 5 in calls and 6 in calls  # prefill (5 inputs) and decode (6) steps took the packed path
    if method:
        assert llm.get_stats()["varlen_resplit_rows"] > 0 and 7 in calls  # re-split steps carry the draft caps


@pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "config.json").exists(), reason="the reference model is not installed")
def test_packed_launch_path_reads_nothing_from_the_device(monkeypatch):
    """With packing on, the launch path still reads no tensor on the host (the packing fills numpy memory)."""
    monkeypatch.setenv("DEEPINFER_PACK_STEP_INPUTS", "1")
    llm = LLM(speculative_method="mtp", num_speculative_tokens=4)
    assert llm.llm_engine.worker.pack_step_inputs
    with HostReadDetector() as detector:
        llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.8, seed=3), use_tqdm=False)
    assert detector.reads == []
