"""Incremental detokenization equals a full decode, for byte-level BPE and random token streams."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_npu.engine.detokenizer import IncrementalDetokenizer
from deepinfer_npu.engine.tokenizer import Tokenizer

from .conftest import CORPUS


def run_stream(tok: Tokenizer, prompt: list[int], out: list[int], skip: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add_token(t) for t in out]
    tail = detok.flush()
    assert detok.output_text == "".join(deltas) + tail
    return deltas, tail


@settings(max_examples=150, deadline=None)
@given(
    out=st.lists(st.integers(min_value=0, max_value=299), min_size=0, max_size=40),
    prompt_idx=st.integers(min_value=0, max_value=len(CORPUS) - 1),
    prompt_cut=st.integers(min_value=0, max_value=30),
    skip=st.booleans(),
)
def test_random_streams_match_full_decode(
    bpe_tokenizer: Tokenizer, out, prompt_idx, prompt_cut, skip
) -> None:
    # Prompt = a valid text's tokens (clean character boundary at its end), any length including empty.
    prompt = bpe_tokenizer.encode(CORPUS[prompt_idx][:prompt_cut], add_special_tokens=True)
    deltas, tail = run_stream(bpe_tokenizer, prompt, out, skip)
    full = bpe_tokenizer.decode(out, skip_special_tokens=skip)
    assert "".join(deltas) + tail == full
    # Decoding in the prompt's context gives the same text after the prompt.
    ctx = bpe_tokenizer.decode(prompt + out, skip_special_tokens=skip)
    prompt_text = bpe_tokenizer.decode(prompt, skip_special_tokens=skip)
    assert ctx == prompt_text + full


@pytest.mark.parametrize("seed", range(20))
def test_valid_text_streams_emit_complete_characters(bpe_tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(CORPUS)[rng.randrange(0, 20) :] for _ in range(3))
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    assert bpe_tokenizer.decode(ids) == text
    deltas, tail = run_stream(bpe_tokenizer, bpe_tokenizer.encode("Hi ", add_special_tokens=True), ids, True)
    assert tail == ""  # valid UTF-8: nothing is held back at the end
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # never a half character
    # Multi-byte characters split over tokens: some step must emit nothing, then the whole character.
    if any(len(c.encode()) > 1 for c in text):
        assert any(d == "" for d in deltas)


def test_incomplete_character_is_held_back_and_flushed(bpe_tokenizer: Tokenizer) -> None:
    emoji_bytes = "😀".encode()
    # The byte-level vocabulary has one token per byte; find them through the tokenizer itself.
    byte_ids = bpe_tokenizer.encode("😀", add_special_tokens=False)
    assert bpe_tokenizer.decode(byte_ids) == "😀" and len(emoji_bytes) == 4
    detok = IncrementalDetokenizer(bpe_tokenizer, [], skip_special_tokens=True)
    if len(byte_ids) > 1:
        assert detok.add_token(byte_ids[0]) == ""
    for t in byte_ids[1:-1]:
        assert detok.add_token(t) == ""
    assert detok.add_token(byte_ids[-1]) == "😀"
    # A truncated character at the end comes out as U+FFFD only on flush (like a full decode).
    detok2 = IncrementalDetokenizer(bpe_tokenizer, [], skip_special_tokens=True)
    partial = bpe_tokenizer.encode("a😀", add_special_tokens=False)[:-1]
    text = detok2.add_tokens(partial)
    assert "\ufffd" not in text
    assert text + detok2.flush() == bpe_tokenizer.decode(partial)
    assert detok2.flush() == ""


def test_special_tokens_skipped_or_kept(bpe_tokenizer: Tokenizer) -> None:
    eos = bpe_tokenizer.eos_token_id
    ids = bpe_tokenizer.encode("ok", add_special_tokens=False) + [eos]
    for skip, expected in ((True, "ok"), (False, "ok<eos>")):
        detok = IncrementalDetokenizer(bpe_tokenizer, [], skip_special_tokens=skip)
        assert detok.add_tokens(ids) + detok.flush() == expected
        assert detok.token_text(eos) == ("" if skip else "<eos>")


def test_sentencepiece_style_leading_space_kept_in_context() -> None:
    """Metaspace decoders drop the leading space of a decode's first token; the prefix window keeps it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "!": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    assert tok.decode([1]) == "world"  # decoding a token alone loses its space
    detok = IncrementalDetokenizer(tok, [0])
    assert [detok.add_token(t) for t in (1, 2, 1)] == [" world", "!", " world"]
    assert tok.decode([0, 1, 2, 1]) == "Hello" + detok.output_text
