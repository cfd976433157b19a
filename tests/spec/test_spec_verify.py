"""The spec_verify op (backends/cpu/spec_verify.py): greedy prefix acceptance, seeded reproducibility and
losslessness of rejection sampling (chi-square against the target distribution, with a wrong sampler as the
negative control)."""

from __future__ import annotations

import torch
from deepinfer_npu.backends.cpu.sampling import sample
from deepinfer_npu.backends.cpu.spec_verify import spec_verify

from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.sampling import SamplingTensors

CHI2_DF7_P1E4 = 29.88  # chi-square critical value, 7 degrees of freedom, p = 1e-4


def _tensors(n, temperature=1.0, seed=5, offsets=None, top_k=0):
    params = [SamplingParams(temperature=temperature, top_k=top_k)] * n
    offs = list(range(n)) if offsets is None else offsets
    return SamplingTensors.from_params(params, [seed] * n, offs)


def _layout(q_lens):
    rows, js = [], []
    for i, q in enumerate(q_lens):
        rows += [i] * q
        js += list(range(q))
    return torch.tensor(rows), torch.tensor(js)


def test_greedy_accepts_longest_matching_prefix_plus_bonus():
    torch.manual_seed(0)
    q_lens = [4, 1, 3]
    rows, js = _layout(q_lens)
    logits = torch.randn(len(rows), 11)
    argmax = logits.argmax(-1)
    # Row 0: drafts match argmax at j=0,1 then differ; row 2: all match.
    draft_next = torch.full((len(rows),), -1)
    draft_next[0], draft_next[1], draft_next[2] = argmax[0], argmax[1], (argmax[2] + 1) % 11
    draft_next[5], draft_next[6] = argmax[5], argmax[6]
    out = spec_verify(logits, draft_next, rows, js, 3, 4, _tensors(len(rows), temperature=0.0))
    assert out.accepted.tolist() == [2, 0, 2]
    assert out.emitted[0, :3].tolist() == argmax[:3].tolist() and out.emitted[0, 3] == -1
    assert out.emitted[1, :1].tolist() == [argmax[4].item()]
    assert out.emitted[2, :3].tolist() == argmax[5:8].tolist()
    assert out.num_emitted.tolist() == [3, 1, 3]


def test_no_drafts_equals_the_sample_op():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    t = _tensors(6, temperature=0.9, top_k=10)
    rows, js = _layout([1] * 6)
    out = spec_verify(logits, torch.full((6,), -1), rows, js, 6, 1, t)
    assert out.emitted[:, 0].tolist() == sample(logits, t).token_ids.tolist()


def _first_token_counts(verify, n=20000, draft=3):
    """Emit with a one-hot draft of token ``draft`` after a fixed target distribution; histogram of the first
    emitted token over ``n`` independent draws (distinct offsets)."""
    vocab = 8
    base = torch.tensor([1.2, 0.3, -0.5, 0.9, 0.0, -1.0, 0.4, 0.1])
    logits = base.repeat(2 * n, 1)  # two tokens per row: [last, draft]
    rows = torch.arange(n).repeat_interleave(2)
    js = torch.tensor([0, 1]).repeat(n)
    draft_next = torch.tensor([draft, -1]).repeat(n)
    offsets = (torch.arange(n) * 2).repeat_interleave(2) + js
    t = _tensors(2 * n, offsets=offsets.tolist())
    out = verify(logits, draft_next, rows, js, n, 2, t)
    return torch.bincount(out.emitted[:, 0], minlength=vocab).double(), torch.softmax(base.double(), -1)


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _wrong_verify(logits, draft_next, rows, js, n, max_q, t):
    # A classic bug: after a rejection, resample from the full target distribution (draft not removed).
    out = spec_verify(logits, draft_next, rows, js, n, max_q, t)
    plain = sample(logits, t).token_ids
    first_rows = torch.nonzero(js == 0).squeeze(1)
    rejected = out.accepted == 0
    out.emitted[rejected, 0] = plain[first_rows][rejected]
    return out


def test_rejection_sampling_is_lossless_chi_square():
    counts, probs = _first_token_counts(spec_verify)
    assert _chi2(counts, probs) < CHI2_DF7_P1E4
    wrong_counts, _ = _first_token_counts(_wrong_verify)
    assert _chi2(wrong_counts, probs) > CHI2_DF7_P1E4  # the negative control must fail the same test


def test_seeded_verification_is_reproducible():
    torch.manual_seed(2)
    rows, js = _layout([3, 3])
    logits = torch.randn(6, 20)
    draft_next = torch.tensor([4, 7, -1, 1, 2, -1])
    a = spec_verify(logits, draft_next, rows, js, 2, 3, _tensors(6, temperature=1.0, seed=9))
    b = spec_verify(logits, draft_next, rows, js, 2, 3, _tensors(6, temperature=1.0, seed=9))
    assert torch.equal(a.emitted, b.emitted) and torch.equal(a.accepted, b.accepted)
