"""The sampling controls at the logits level: penalties, min-p and logit bias against plain torch / HF references,
rows without controls untouched bit for bit, the device token counts of a speculative step, and SamplingParams
validation."""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu.backends.cpu.logits_processors import apply_min_p, apply_penalties
from deepinfer_npu.backends.cpu.sampling import sample
from deepinfer_npu.backends.cpu.spec_verify import spec_verify
from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.sampling import SamplingTensors
from deepinfer_npu.worker import penalty_state
from deepinfer_npu.worker.slot_state import SlotState

V = 40


def _penalties_by_loop(logits, counts, prompt_mask, presence, frequency, repetition):
    """Element by element, as the definitions read (vLLM's apply_penalties / OpenAI's formula)."""
    out = logits.clone()
    for b in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            x = float(logits[b, v])
            if counts[b, v] > 0 or prompt_mask[b, v]:
                x = x / float(repetition[b]) if x > 0 else x * float(repetition[b])
            x -= float(frequency[b]) * int(counts[b, v])
            x -= float(presence[b]) * (1.0 if counts[b, v] > 0 else 0.0)
            out[b, v] = x
    return out


def test_penalties_match_the_definition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    counts = torch.randint(0, 3, (4, V), generator=g, dtype=torch.int32) * (torch.rand(4, V, generator=g) < 0.3)
    prompt = torch.rand(4, V, generator=g) < 0.2
    presence = torch.tensor([0.0, 1.5, -0.5, 2.0])
    frequency = torch.tensor([0.0, 0.5, 2.0, -1.0])
    repetition = torch.tensor([1.0, 1.3, 0.7, 2.0])
    got = apply_penalties(logits, counts.to(torch.int32), prompt, presence, frequency, repetition)
    ref = _penalties_by_loop(logits, counts, prompt, presence, frequency, repetition)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], logits[0])  # neutral values: the row is unchanged bit for bit


def test_repetition_penalty_is_hf_repetition_penalty_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, V, generator=g) * 4
    prompt_ids = torch.tensor([[3, 7, 7, 11], [0, 1, 2, 39]])
    output_ids = torch.tensor([[5, 3, 20], [21, 21, 22]])
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.cat([prompt_ids, output_ids], dim=1), logits.clone())
    counts = torch.zeros(2, V, dtype=torch.int32).scatter_add_(1, output_ids, torch.ones_like(output_ids,
                                                                                             dtype=torch.int32))
    mask = torch.zeros(2, V, dtype=torch.bool).scatter_(1, prompt_ids, True)
    zero = torch.zeros(2)
    got = apply_penalties(logits, counts, mask, zero, zero, torch.full((2,), 1.7))
    torch.testing.assert_close(got, hf, rtol=0, atol=0)


def test_min_p_keeps_tokens_above_the_scaled_threshold():
    g = torch.Generator().manual_seed(2)
    scaled = torch.randn(3, V, generator=g) * 2
    min_p = torch.tensor([0.0, 0.1, 1.0])
    got = apply_min_p(scaled, min_p)
    probs = torch.softmax(scaled, dim=-1)
    for b in range(3):
        keep = probs[b] >= min_p[b] * probs[b].max()
        assert torch.equal(torch.isfinite(got[b]), keep)
        assert torch.equal(got[b][keep], scaled[b][keep])
    assert int(torch.isfinite(got[2]).sum()) == 1  # min_p = 1: only the most likely token


def _tensors(params, seeds, offsets=None):
    return SamplingTensors.from_params(params, seeds, offsets or [0] * len(params), vocab_size=V)


def test_rows_without_controls_sample_bit_identically_in_a_mixed_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=g)
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8),
             SamplingParams(temperature=1.2, top_k=5)]
    controlled = [SamplingParams(temperature=0.0, frequency_penalty=1.0, logit_bias={4: 5.0}),
                  SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.5),
                  SamplingParams(temperature=0.7, presence_penalty=-1.0)]
    mixed = [plain[0], controlled[0], plain[1], controlled[1], plain[2], controlled[2]]
    seeds = [11, 12, 13, 14, 15, 16]
    t = _tensors(mixed, seeds, [2] * 6)
    t.output_counts = torch.randint(0, 3, (6, V), generator=g, dtype=torch.int32)
    t.prompt_mask = torch.rand(6, V, generator=g) < 0.3
    t.max_num_logprobs = 3
    got = sample(logits, t)
    rows = [0, 2, 4]
    alone = sample(logits[rows], _tensors([mixed[i] for i in rows], [seeds[i] for i in rows], [2] * 3))
    assert torch.equal(got.token_ids[rows], alone.token_ids)
    # logprobs are those of the raw model distribution for every row, controlled or not
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(got.logprobs.sampled_logprob, raw.gather(1, got.token_ids[:, None]).squeeze(1))


def test_logit_bias_and_penalties_move_the_greedy_choice():
    logits = torch.zeros(3, V)
    logits[:, 7] = 2.0
    t = _tensors([SamplingParams(temperature=0.0, logit_bias={9: 3.0}),
                  SamplingParams(temperature=0.0, frequency_penalty=2.0),
                  SamplingParams(temperature=0.0, logit_bias={7: -100.0})], [0, 0, 0])
    t.output_counts = torch.zeros(3, V, dtype=torch.int32)
    t.output_counts[1, 7] = 2  # 2 - 2 * 2 < 0: token 7 loses to the zeros (lowest id wins ties)
    t.prompt_mask = torch.zeros(3, V, dtype=torch.bool)
    assert sample(logits, t).token_ids.tolist() == [9, 0, 0]


def test_min_p_one_is_greedy_and_greedy_ignores_min_p():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, V, generator=g)
    t = _tensors([SamplingParams(temperature=1.0, min_p=1.0)] * 4, [1, 2, 3, 4])
    assert torch.equal(sample(logits, t).token_ids, logits.argmax(dim=-1))
    assert SamplingParams(temperature=0.0, min_p=0.5).min_p == 0.0  # as vLLM: greedy resets the filters


def test_decode_counts_include_the_drafts_before_each_position():
    s = SlotState(num_slots=4, num_drafts=3, device=torch.device("cpu"))
    s.enable_penalties(V)
    s.output_counts[2, 5] = 1  # slot 2 generated token 5 before its last token
    # one row on slot 2: inputs [last=8, d1=5, d2=8]; one row on slot 3: [last=1]
    input_ids = torch.tensor([8, 5, 8, 1])
    row = torch.tensor([0, 0, 0, 1])
    j = torch.tensor([0, 1, 2, 0])
    slot_of_token = torch.tensor([2, 2, 2, 3])
    counts, _ = penalty_state.decode_counts(s, slot_of_token, row, j, input_ids, num_rows=2, max_q=3)
    assert counts[:, [1, 5, 8]].tolist() == [[0, 1, 1], [0, 2, 1], [0, 2, 2], [1, 0, 0]]
    # one draft accepted on row 0: inputs 0..1 (8, 5) are counted; the new last token waits for the next step
    penalty_state.record_decode(s, slot_of_token, j, torch.tensor([1, 1, 1, 0]), input_ids)
    assert s.output_counts[2, [5, 8]].tolist() == [2, 1] and s.output_counts[3, 1] == 1


def test_spec_verify_with_penalties_judges_each_draft_with_the_counts_before_it():
    # Every position's raw argmax is token 3 (logit 3 vs 1.5 for token 4); a frequency penalty of 2 on one earlier 3
    # drops it to 1 < 1.5.
    logits = torch.zeros(3, V)
    logits[:, 3], logits[:, 4] = 3.0, 1.5
    t = _tensors([SamplingParams(temperature=0.0, frequency_penalty=2.0)] * 3, [0, 0, 0])
    # inputs [last=9, d1=3, d2=3]: position 0 has no 3 before it -> 3 accepts d1; position 1 counts d1 -> 4
    # rejects d2: emitted [3, 4]
    t.output_counts = torch.zeros(3, V, dtype=torch.int32)
    t.output_counts[1:, 3] = torch.tensor([1, 2], dtype=torch.int32)
    t.prompt_mask = torch.zeros(3, V, dtype=torch.bool)
    out = spec_verify(logits, torch.tensor([3, 3, -1]), torch.zeros(3, dtype=torch.int64), torch.arange(3), 1, 3, t)
    assert out.accepted.tolist() == [1] and out.emitted[0, :2].tolist() == [3, 4]


@pytest.mark.parametrize("kwargs,match", [
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be greater than zero, got 0.0"),
    ({"repetition_penalty": float("nan")}, r"repetition_penalty must be finite"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
    ({"prompt_logprobs": 21}, r"prompt_logprobs must be None or in 0..20, got 21"),
    ({"prompt_logprobs": -1}, r"prompt_logprobs must be None or in 0..20"),
    ({"logit_bias": {5: 101}}, r"logit_bias\[5\] must be in \[-100, 100\], got 101"),
    ({"logit_bias": {"x": 1}}, r"logit_bias keys must be token ids"),
    ({"logit_bias": {-1: 1}}, r"logit_bias keys must be non-negative token ids, got -1"),
    ({"logit_bias": [1, 2]}, r"logit_bias must be a dict"),
    ({"n": 0}, r"n must be at least 1"),
])
def test_validation_names_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_accepts_json_string_keys_and_defaults_are_off():
    assert SamplingParams(logit_bias={"12": 1}).logit_bias == {12: 1.0}
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.0, 0.0, 1.0, 0.0)
    assert p.logit_bias is None and p.prompt_logprobs is None and not p.uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
