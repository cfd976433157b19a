"""The reference ``sample`` op: greedy, seeded Gumbel-max sampling, top-k/top-p, bans, logprobs.

The statistical tests compare the empirical distribution of 20k draws (one request, offsets 0..N-1) with the
filtered ``softmax(logits / T)`` computed independently in float64, and check that deliberately wrong samplers
fail the same test.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from deepinfer_npu.backends.cpu.sampling import sample

from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.sampling import SamplingTensors, hash_uniform, min_tokens_banned_ids

V = 8
N = 20_000
LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.0, -3.0, 1.5, 0.0, -0.5])


def tensors(params: list[SamplingParams], seeds=None, offsets=None, **kw) -> SamplingTensors:
    b = len(params)
    seeds = list(range(b)) if seeds is None else seeds
    offsets = [0] * b if offsets is None else offsets
    return SamplingTensors.from_params(params, seeds, offsets, **kw)


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[float]:
    """Filtered softmax(logits / T) in float64, written independently of the sampler."""
    z = [float(x) / temperature for x in logits.double()]
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    kept = order[:top_k] if top_k > 0 else order
    m = max(z[i] for i in kept)
    w = {i: pow(2.718281828459045, z[i] - m) for i in kept}
    total = sum(w.values())
    if top_p < 1.0:
        mass, nucleus = 0.0, []
        for i in kept:
            if mass >= top_p:
                break
            assert abs(mass - top_p) > 1e-3, "test case too close to a top-p boundary"
            nucleus.append(i)
            mass += w[i] / total
        kept = nucleus
        total = sum(w[i] for i in kept)
    return [w[i] / total if i in kept else 0.0 for i in range(len(z))]


def chi2_pvalue(counts: torch.Tensor, probs: list[float]) -> float:
    """Pearson chi-square goodness-of-fit p-value (0 if an impossible token was drawn)."""
    p = torch.tensor(probs, dtype=torch.float64)
    counts = counts.double()
    if bool((counts[p == 0] > 0).any()):
        return 0.0
    exp = counts.sum() * p[p > 0]
    stat = ((counts[p > 0] - exp) ** 2 / exp).sum()
    df = torch.tensor((int((p > 0).sum()) - 1) / 2, dtype=torch.float64)
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(df, stat / 2))


Sampler = Callable[[torch.Tensor, SamplingTensors], torch.Tensor]


def draw(sampler: Sampler, temperature: float, top_k: int, top_p: float, seed: int = 2024) -> torch.Tensor:
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * N
    t = tensors(params, seeds=[seed] * N, offsets=list(range(N)), vocab_size=V)
    ids = sampler(LOGITS.expand(N, V).clone(), t)
    return torch.bincount(ids, minlength=V)


def reference(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    return sample(logits, t).token_ids


def uniform_noise_sampler(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Wrong: uniform instead of Gumbel noise."""
    u = hash_uniform(t.seeds, t.offsets, logits.shape[1])
    return (logits / t.temperature[:, None] + u).argmax(-1)


def no_temperature_sampler(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Wrong: forgets the temperature."""
    t1 = SamplingTensors(**{**t.__dict__, "temperature": torch.ones_like(t.temperature)})
    return sample(logits, t1).token_ids


def top_p_off_by_one_sampler(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Wrong: drops the token that crosses the top-p mass (keeps cumsum < p instead of mass-before < p)."""
    scaled = logits / t.temperature[:, None]
    vals, idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
    cum = torch.softmax(vals, -1).cumsum(-1)
    keep = cum < t.top_p[:, None]
    keep[:, 0] = True
    mask = torch.zeros_like(keep).scatter_(1, idx, keep)
    g = -torch.log(-torch.log(hash_uniform(t.seeds, t.offsets, logits.shape[1])))
    return (scaled.masked_fill(~mask, float("-inf")) + g).argmax(-1)


CASES = [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 3, 1.0), (1.0, 0, 0.8), (0.7, 5, 0.9), (1.3, 4, 0.6)]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), CASES)
def test_distribution_matches_filtered_softmax(temperature: float, top_k: int, top_p: float) -> None:
    counts = draw(reference, temperature, top_k, top_p)
    expected = expected_distribution(LOGITS, temperature, top_k, top_p)
    assert chi2_pvalue(counts, expected) > 1e-3, (counts.tolist(), expected)


@pytest.mark.parametrize(
    ("sampler", "case"),
    [
        (uniform_noise_sampler, (1.0, 0, 1.0)),
        (no_temperature_sampler, (0.5, 0, 1.0)),
        (top_p_off_by_one_sampler, (1.0, 0, 0.8)),
    ],
    ids=["uniform-noise", "no-temperature", "top-p-off-by-one"],
)
def test_biased_samplers_fail_the_same_test(sampler: Sampler, case: tuple[float, int, float]) -> None:
    counts = draw(sampler, *case)
    assert chi2_pvalue(counts, expected_distribution(LOGITS, *case)) < 1e-6


def test_greedy_is_argmax_lowest_index_on_ties() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    logits[3, [7, 30]] = 10.0  # a tie: index 7 wins
    out = sample(logits, tensors([SamplingParams(temperature=0)] * 16))
    assert torch.equal(out.token_ids, logits.argmax(-1)) and int(out.token_ids[3]) == 7
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None


def test_top_k_1_equals_greedy_and_mixed_batches() -> None:
    torch.manual_seed(1)
    logits = torch.randn(32, 100) * 3
    params = [
        SamplingParams(temperature=0.9, top_k=1) if i % 2 else SamplingParams(temperature=0)
        for i in range(32)
    ]
    out = sample(logits, tensors(params, vocab_size=100))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    # A tiny top_p also reduces to greedy.
    out = sample(logits, tensors([SamplingParams(temperature=1.0, top_p=1e-6)] * 32))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_ties_keep_lower_ids() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0]]).expand(2000, 4).clone()
    t = tensors(
        [SamplingParams(temperature=1.0, top_k=2)] * 2000, seeds=[3] * 2000, offsets=list(range(2000))
    )
    counts = torch.bincount(sample(logits, t).token_ids, minlength=4)
    assert counts[2] == 0 and counts[3] == 0 and counts[0] > 800 and counts[1] > 800


def test_seeds_reproducible_and_batch_invariant() -> None:
    torch.manual_seed(2)
    b, v = 64, 1000
    logits = torch.randn(b, v)
    params = [SamplingParams(temperature=1.0, top_p=0.95, top_k=50 if i % 3 == 0 else 0) for i in range(b)]
    seeds, offsets = [1000 + i for i in range(b)], [i % 7 for i in range(b)]
    a = sample(logits, tensors(params, seeds, offsets, vocab_size=v)).token_ids
    assert torch.equal(a, sample(logits, tensors(params, seeds, offsets, vocab_size=v)).token_ids)
    # The same row sampled alone (or in another batch order) gives the same token.
    for i in (0, 5, 63):
        alone = sample(logits[i : i + 1], tensors([params[i]], [seeds[i]], [offsets[i]], vocab_size=v))
        assert int(alone.token_ids[0]) == int(a[i])
    perm = torch.randperm(b)
    shuffled = sample(
        logits[perm],
        tensors(
            [params[i] for i in perm], [seeds[i] for i in perm], [offsets[i] for i in perm], vocab_size=v
        ),
    ).token_ids
    assert torch.equal(shuffled, a[perm])
    # Other seeds (or other offsets) give other tokens.
    other = sample(logits, tensors(params, [s + 1 for s in seeds], offsets, vocab_size=v)).token_ids
    assert float((other == a).float().mean()) < 0.3
    later = sample(logits, tensors(params, seeds, [o + 1 for o in offsets], vocab_size=v)).token_ids
    assert float((later == a).float().mean()) < 0.3


def test_min_tokens_bans() -> None:
    eos = 1
    p = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[5])
    assert min_tokens_banned_ids(p, 0, [eos]) == [1, 5]
    assert min_tokens_banned_ids(p, 3, [eos]) == []
    assert min_tokens_banned_ids(SamplingParams(min_tokens=2, ignore_eos=True), 0, [eos]) == []
    n = 3000
    logits = LOGITS.expand(n, V).clone()
    logits[:, eos] = 5.0  # EOS is by far the most likely
    params = [p] * (n - 1) + [SamplingParams(temperature=0, min_tokens=3)]
    banned = [min_tokens_banned_ids(q, 0, [eos]) for q in params]
    t = tensors(params, seeds=[9] * n, offsets=list(range(n)), vocab_size=V, banned_token_ids=banned)
    out = sample(logits, t).token_ids
    assert not bool(((out[:-1] == eos) | (out[:-1] == 5)).any())
    assert int(out[-1]) == 5  # greedy: the next best after the banned EOS


def test_logprobs_are_raw_distribution() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, 40) * 2
    logits[0, [4, 9]] = 8.0  # tie at the top: lower id first
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.5, logprobs=2),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.5, logprobs=1),
    ]
    t = tensors(params, vocab_size=40)
    assert t.max_num_logprobs == 5
    out = sample(logits, t)
    lp = out.logprobs
    assert lp is not None
    raw = torch.log_softmax(logits, -1)
    assert lp.top_ids.shape == (6, 5) and lp.top_logprobs.shape == (6, 5)
    assert lp.top_ids[0, :2].tolist() == [4, 9]
    assert torch.allclose(lp.top_logprobs, raw.gather(1, lp.top_ids))
    assert torch.equal(lp.top_ids[1:], raw[1:].topk(5).indices)
    assert torch.allclose(lp.sampled_logprob, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert torch.equal(lp.sampled_rank, (raw >= lp.sampled_logprob[:, None]).sum(-1))
    assert int(lp.sampled_rank[1]) == 1  # greedy row samples the top token
    # logprobs=0 only: the sampled token's logprob, no top list.
    out0 = sample(logits, tensors([SamplingParams(logprobs=0)] * 6))
    assert out0.logprobs is not None and out0.logprobs.top_ids.shape == (6, 0)


def test_sampling_tensors_building() -> None:
    params = [SamplingParams(temperature=0, top_k=5), SamplingParams(temperature=0.7, top_k=500, top_p=0.9)]
    t = SamplingTensors.from_params(params, seeds=[2**64 - 1, 7], offsets=[0, 3], vocab_size=100)
    assert t.temperature.tolist() == pytest.approx([1.0, 0.7])
    assert t.top_k.tolist() == [0, 0]  # greedy row disabled; top_k >= vocab disabled
    assert (
        t.is_greedy.tolist() == [True, False] and t.seeds.tolist() == [-1, 7] and t.offsets.tolist() == [0, 3]
    )
    assert (t.all_greedy, t.all_random, t.need_top_k, t.need_top_p) == (False, False, False, True)
    assert t.max_num_logprobs is None and t.num_rows == 2
    assert t.to("cpu").seeds.tolist() == [-1, 7]
    with pytest.raises(ValueError, match="seed"):
        SamplingTensors.from_params(params, seeds=[1], offsets=[0, 0])
    with pytest.raises(ValueError, match="B = 2"):
        sample(torch.zeros(3, 100), t)
