"""The xgrammar layer on its own: random-logit sampling under the token bitmask always yields outputs that match
(50 random JSON schemas validated with ``jsonschema``, regexes, choices), bad constraints are ``ValueError``s
naming the field, draft masks, and the bitmask unpacking against xgrammar's own ``apply_token_bitmask_inplace``."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from deepinfer_npu.config import REFERENCE_MODEL_DIR
from deepinfer_npu.engine.tokenizer import load_tokenizer
from deepinfer_npu.structured_output import StructuredOutputsParams
from deepinfer_npu.structured_output.grammar import GrammarCompilerPool
from deepinfer_npu.structured_output.matcher import RequestGrammar, allowed_mask, fill_rows, new_bitmask

pytestmark = pytest.mark.skipif(not (REFERENCE_MODEL_DIR / "tokenizer.json").exists(), reason="no tokenizer")
VOCAB = 4096


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(REFERENCE_MODEL_DIR))


@pytest.fixture(scope="module")
def pool(tok):
    p = GrammarCompilerPool(tok, VOCAB, tok.eos_token_ids)
    yield p
    p.shutdown()


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Nested objects, arrays, enums, bounded integers and numbers, short strings, booleans."""
    kinds = ["integer", "number", "string", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 20)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, None, True], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    names = rng.sample(["id", "name", "size", "tags", "meta", "ok", "x", "y"], rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def sample_constrained(tok, pool, params: StructuredOutputsParams, seed: int, max_steps: int = 400) -> str:
    """Random logits, masked by the grammar, sampled until EOS: the constrained output text."""
    grammar = RequestGrammar(pool.compile(params).result(timeout=60), VOCAB)
    bitmask = new_bitmask(1, VOCAB)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_steps):
        grammar.fill(bitmask, 0)
        logits = torch.randn(VOCAB, generator=gen) * 3
        logits[~allowed_mask(bitmask, VOCAB)[0]] = -float("inf")
        t = int(torch.multinomial(torch.softmax(logits, 0), 1, generator=gen))
        if t in tok.eos_token_ids:
            assert grammar.matcher.is_completed() or grammar.is_terminated
            return tok.decode(out)
        out.append(t)
        grammar.accept([t])
        assert not grammar.failed
    raise AssertionError(f"no EOS within {max_steps} steps: {tok.decode(out)!r}")


@pytest.mark.parametrize("seed", range(50))
def test_random_json_schemas_always_validate(tok, pool, seed):
    rng = random.Random(seed)
    schema = random_schema(rng) if seed % 5 else {"type": "object", "properties": {"v": random_schema(rng)},
                                                  "required": ["v"], "additionalProperties": False}
    text = sample_constrained(tok, pool, StructuredOutputsParams(json=schema, disable_any_whitespace=True), seed)
    jsonschema.validate(json.loads(text, strict=False), schema)  # raw control characters inside strings are allowed


@pytest.mark.parametrize("pattern", [r"[a-z]{3}-\d{2}", r"(yes|no) \d+", r"\w{1,8}@example\.com"])
def test_regex_outputs_fullmatch(tok, pool, pattern):
    for seed in range(3):
        text = sample_constrained(tok, pool, StructuredOutputsParams(regex=pattern), seed)
        assert re.fullmatch(pattern, text), text


def test_choice_and_json_object(tok, pool):
    choices = ["positive", "negative", "neutral"]
    seen = {sample_constrained(tok, pool, StructuredOutputsParams(choice=choices), s) for s in range(6)}
    assert seen <= set(choices) and seen
    obj = json.loads(sample_constrained(tok, pool, StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                                         3, max_steps=2000), strict=False)
    assert isinstance(obj, dict)


@pytest.mark.parametrize("kwargs, words", [
    (dict(json={"type": "object"}, regex="a"), "exactly one of"),
    (dict(), "exactly one of"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1, 2]), "must be a JSON schema object"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(regex=""), "regex must be a non-empty string"),
])
def test_bad_constraints_name_the_field(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("params, field", [
    (StructuredOutputsParams(regex="(a"), "structured_outputs.regex is invalid"),
    (StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json is invalid"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar is invalid"),
])
def test_unparsable_constraints_fail_check(pool, params, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        pool.check(params)


def test_equal_constraints_share_one_compilation(pool):
    a = pool.compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = pool.compile(StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}'))
    assert a is b


def test_draft_masks_follow_the_drafts(tok, pool):
    grammar = RequestGrammar(pool.compile(StructuredOutputsParams(choice=["yes", "no"])).result(), VOCAB)
    yes = tok.encode("yes", add_special_tokens=False)
    no = tok.encode("no", add_special_tokens=False)
    bitmask = new_bitmask(3, VOCAB)
    grammar.fill(bitmask, 0, [yes[0], 7])  # a draft the grammar accepts, then one it rejects
    allowed = allowed_mask(bitmask, VOCAB)
    assert allowed[0, yes[0]] and allowed[0, no[0]] and not allowed[0, 7]
    assert set(allowed[1].nonzero().flatten().tolist()) <= set(tok.eos_token_ids) and allowed[1].any()
    assert not allowed[2].any()  # past the rejected draft
    grammar.fill(bitmask, 0)  # the drafts were rolled back: the first position again
    assert torch.equal(allowed_mask(bitmask, VOCAB)[0], allowed[0])


def test_bitmask_unpacking_matches_xgrammar(pool):
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (VOCAB + 31) // 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, VOCAB, generator=gen)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    ours = logits.masked_fill(~allowed_mask(bitmask, VOCAB), -float("inf"))
    assert torch.equal(ours, expected)


def _valid_tokens(grammar: RequestGrammar, n: int, gen: torch.Generator) -> list[int]:
    """Up to ``n`` tokens the grammar accepts in a row (sampled from its masks; the grammar is left unchanged)."""
    bitmask, out = new_bitmask(1, VOCAB), []
    for _ in range(n):
        if grammar.is_terminated:
            break
        grammar.fill(bitmask, 0)
        allowed = allowed_mask(bitmask, VOCAB)[0].nonzero().flatten()
        t = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        if not grammar.matcher.accept_token(t):
            break
        out.append(t)
    if out:
        grammar.matcher.rollback(len(out))
    return out


def _fill_one_by_one(grammar: RequestGrammar, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
    """The mask rows of one request, written out with xgrammar's single-matcher calls (the oracle of fill_rows):
    the next position, then after each draft the grammar accepts; all-false past a rejected draft; only the stop
    tokens once the grammar has ended; the matcher rolled back to where it was."""
    accepted = 0
    for k in range(len(drafts) + 1):
        if grammar.matcher.is_terminated():
            bitmask[row + k].zero_()
            for t in grammar.matcher.stop_token_ids:
                bit = 1 << (t % 32)
                bitmask[row + k, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit
        else:
            grammar.matcher.fill_next_token_bitmask(bitmask, row + k)
        if k == len(drafts):
            break
        if grammar.matcher.is_terminated() or not grammar.matcher.accept_token(int(drafts[k])):
            bitmask[row + k + 1: row + len(drafts) + 1].zero_()
            break
        accepted += 1
    if accepted:
        grammar.matcher.rollback(accepted)


def test_batched_fill_equals_the_per_request_fill(tok, pool):
    """fill_rows over many requests (threaded xgrammar calls, one per draft depth) writes exactly the rows that
    single-matcher calls write request by request, for drafts accepted in full, rejected part-way, past a grammar's end and absent, and
    leaves every matcher where it was."""
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    constraints = [StructuredOutputsParams(json=random_schema(random.Random(s))) for s in range(6)]
    constraints += [StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{2}"), StructuredOutputsParams(choice=["yes", "no"])]
    pairs, drafts = [], []
    for i in range(24):
        compiled = pool.compile(constraints[i % len(constraints)]).result(timeout=60)
        a, b = RequestGrammar(compiled, VOCAB), RequestGrammar(compiled, VOCAB)
        history = _valid_tokens(a, rng.randint(0, 12), gen)
        for g in (a, b):
            g.accept(history)
        d = _valid_tokens(a, rng.randint(0, 4), gen)
        if d and rng.random() < 0.4:
            d[rng.randrange(len(d))] = rng.randrange(VOCAB)  # a draft the grammar (likely) rejects
        pairs.append((a, b))
        drafts.append(d)
    width = 5
    expected = new_bitmask(len(pairs) * width, VOCAB).fill_(0x5A5A5A5A)  # rows no request writes keep this
    got = expected.clone()
    for i, (a, _) in enumerate(pairs):
        _fill_one_by_one(a, expected, i * width, drafts[i])
    fill_rows([b for _, b in pairs], got, [i * width for i in range(len(pairs))], drafts)
    assert torch.equal(got, expected)
    again_a, again_b = new_bitmask(len(pairs), VOCAB), new_bitmask(len(pairs), VOCAB)
    for i, (a, b) in enumerate(pairs):
        a.fill(again_a, i)
        b.fill(again_b, i)
    assert torch.equal(again_a, again_b)
