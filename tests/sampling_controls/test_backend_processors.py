"""The Ascend kernel set's spec_verify (its TileLang programs built for the host C target, as tests/ascend does)
applies the penalties, logit bias and min-p exactly as the CPU reference, drafts and seeded rows included."""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu import SamplingParams
from deepinfer_npu.backends.cpu import spec_verify as ref_verify
from deepinfer_npu.sampling import SamplingTensors


@pytest.fixture(scope="module")
def host_c_kernels():
    pytest.importorskip("tilelang", reason="tilelang is not installed")
    from deepinfer_npu.backends.ascend import tilelang_ascend

    return tilelang_ascend.TileLangAscendKernels("c")


def _case(seed: int, temps: list[float]):
    g = torch.Generator().manual_seed(seed)
    vocab, rows = 60, len(temps)
    q = torch.randint(1, 6, (rows,), generator=g)
    row = torch.repeat_interleave(torch.arange(rows), q)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)])
    j = torch.arange(row.numel()) - cu[row]
    logits = torch.randn(row.numel(), vocab, generator=g) * 3
    draft = torch.where(torch.rand(row.numel(), generator=g) < 0.6, logits.argmax(-1),
                        torch.randint(0, vocab, (row.numel(),), generator=g))
    draft[cu[1:] - 1] = -1
    params = [SamplingParams(temperature=t, seed=5 + i, frequency_penalty=0.5 * (i % 3), presence_penalty=0.3,
                             repetition_penalty=1.0 + 0.2 * (i % 2), min_p=0.05 * (i % 4),
                             logit_bias={3: 2.0, 11 + i: -1.5}) for i, t in enumerate(temps)]
    t = SamplingTensors.from_params(params, [5 + i for i in range(rows)], [0] * rows, vocab_size=vocab)
    t = t.select_rows(row)
    t.offsets, t.max_num_logprobs = j + 3, 2
    t.output_counts = torch.randint(0, 3, (row.numel(), vocab), generator=g, dtype=torch.int32)
    t.prompt_mask = torch.rand(row.numel(), vocab, generator=g) < 0.2
    return logits, draft, row, j, rows, 6, t, None


@pytest.mark.parametrize("temps", [[0.0] * 4, [0.0, 0.8, 1.0, 1.3]])
def test_ascend_spec_verify_applies_the_processors_as_the_reference(host_c_kernels, temps):
    for seed in range(2):
        args = _case(seed, temps)
        got, want = host_c_kernels.spec_verify(*args), ref_verify.spec_verify(*args)
        row, j = args[2], args[3]
        live = j <= want.accepted[row]
        assert torch.equal(got.emitted, want.emitted) and torch.equal(got.accepted, want.accepted)
        assert torch.equal(got.target_tokens[live], want.target_tokens[live])
        assert torch.equal(got.logprobs.sampled_logprob[live], want.logprobs.sampled_logprob[live])
    # the processors change the outcome of these cases (so the comparison above can fail)
    args = _case(0, temps)
    plain = SamplingTensors.from_params([SamplingParams(temperature=x, seed=5 + i) for i, x in enumerate(temps)],
                                        [5 + i for i in range(len(temps))], [0] * len(temps),
                                        vocab_size=60).select_rows(args[2])
    plain.offsets = args[6].offsets
    assert not torch.equal(ref_verify.spec_verify(*args[:6], plain).target_tokens,
                           ref_verify.spec_verify(*args).target_tokens)
