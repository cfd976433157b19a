"""Stop handling: EOS, stop ids, stop strings across tokens, min/max tokens, max_model_len, multi-token
steps."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from deepinfer_npu.engine.detokenizer import IncrementalDetokenizer
from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.engine.stop_checker import StopChecker, find_stop_string
from deepinfer_npu.engine.tokenizer import Tokenizer

EOS = 0


class PieceTokenizer:
    """Each id decodes to a fixed piece of text; id 0 is the special EOS token ``</s>``."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = ["</s>", *pieces]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == EOS))

    def ids(self, *pieces: str) -> list[int]:
        return [self.pieces.index(p) for p in pieces]


TOK = PieceTokenizer(["he", "ll", "o", " wor", "ld", "!", "\n", "x"])


def make(
    params: SamplingParams,
    *,
    prompt_len: int = 3,
    max_model_len: int | None = None,
    skip_special: bool | None = None,
) -> StopChecker:
    skip = params.skip_special_tokens if skip_special is None else skip_special
    return StopChecker(
        params,
        num_prompt_tokens=prompt_len,
        eos_token_ids=[EOS],
        max_model_len=max_model_len,
        detokenizer=IncrementalDetokenizer(TOK, [5, 6, 7], skip_special_tokens=skip),
    )


def test_running_request_keeps_everything() -> None:
    sc = make(SamplingParams(max_tokens=100))
    assert sc.process(TOK.ids("he", "ll")) == (2, None, None)
    assert sc.process(TOK.ids("o")) == (1, None, None)
    assert sc.output_text == "hello" and sc.output_token_ids == TOK.ids("he", "ll", "o")
    assert not sc.finished


def test_eos_in_a_multi_token_step_drops_later_tokens() -> None:
    sc = make(SamplingParams(max_tokens=100))
    step = TOK.ids("he", "ll") + [EOS] + TOK.ids("o", "!")
    assert sc.process(step) == (3, "stop", None)
    assert sc.output_token_ids == [*TOK.ids("he", "ll"), EOS]  # the EOS id is kept, as in vLLM
    assert sc.output_text == "hell"
    # A step that was in flight when the request finished is dropped entirely.
    assert sc.process(TOK.ids("x")) == (0, "stop", None)
    assert sc.output_text == "hell"


def test_eos_text_removed_unless_include_stop_str() -> None:
    sc = make(SamplingParams(skip_special_tokens=False))
    sc.process(TOK.ids("he") + [EOS])
    assert sc.output_text == "he"
    sc = make(SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True))
    sc.process(TOK.ids("he") + [EOS])
    assert sc.output_text == "he</s>"


def test_ignore_eos() -> None:
    sc = make(SamplingParams(ignore_eos=True, max_tokens=4))
    assert sc.process([EOS, EOS]) == (2, None, None)
    assert sc.process([EOS, EOS, EOS]) == (2, "length", None)
    assert len(sc.output_token_ids) == 4


def test_stop_token_ids() -> None:
    nl = TOK.ids("\n")[0]
    sc = make(SamplingParams(stop_token_ids=[nl]))
    assert sc.process(TOK.ids("he", "\n", "ll")) == (2, "stop", nl)
    assert sc.output_text == "he"
    sc = make(SamplingParams(stop_token_ids=[nl], include_stop_str_in_output=True))
    sc.process(TOK.ids("he", "\n", "ll"))
    assert sc.output_text == "he\n"
    # Stop ids still stop with ignore_eos; and EOS listed in stop_token_ids reports its id.
    sc = make(SamplingParams(stop_token_ids=[EOS], ignore_eos=True))
    assert sc.process([EOS]) == (1, "stop", EOS)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(include: bool) -> None:
    sc = make(SamplingParams(stop=["llo w"], include_stop_str_in_output=include, max_tokens=50))
    # one token per step: the string completes only on " wor"
    assert sc.process(TOK.ids("he")) == (1, None, None)
    assert sc.process(TOK.ids("ll")) == (1, None, None)
    assert sc.process(TOK.ids("o")) == (1, None, None)
    assert sc.process(TOK.ids(" wor", "ld")) == (1, "stop", "llo w")
    assert sc.output_text == ("hello w" if include else "he")
    assert sc.output_token_ids == TOK.ids("he", "ll", "o", " wor")


def test_stop_string_in_multi_token_step() -> None:
    sc = make(SamplingParams(stop="o w"))
    assert sc.process(TOK.ids("he", "ll", "o", " wor", "ld", "!")) == (4, "stop", "o w")
    assert sc.output_text == "hell"


def test_earliest_stop_string_wins() -> None:
    sc = make(SamplingParams(stop=["world", "lo"]))
    sc.process(TOK.ids("he", "ll", "o", " wor", "ld"))
    assert sc.stop_reason == "lo" and sc.output_text == "hel"
    assert find_stop_string("abcabc", 3, ["c", "bc"], False) == ("bc", 4)
    assert find_stop_string("abcabc", 3, ["c", "bc"], True) == ("bc", 6)
    assert find_stop_string("abcabc", 0, ["c"], False) is None


def test_min_tokens_blocks_eos_stop_ids_and_strings() -> None:
    nl = TOK.ids("\n")[0]
    sc = make(SamplingParams(min_tokens=4, stop=["ll"], stop_token_ids=[nl], max_tokens=20))
    # EOS at output 1, stop id at 2, stop string completes at 3: all ignored (fewer than 4 tokens).
    assert sc.process([EOS, nl, *TOK.ids("ll")]) == (3, None, None)
    # The 4th token may stop: the stop string occurs again.
    assert sc.process(TOK.ids("ll", "o")) == (1, "stop", "ll")
    assert sc.output_token_ids == [EOS, nl, *TOK.ids("ll", "ll")]
    # "\nllll": the first occurrence completed by a token at or after min_tokens starts at index 2.
    assert sc.output_text == "\nl"
    # At exactly min_tokens EOS is honoured.
    sc = make(SamplingParams(min_tokens=2))
    assert sc.process([EOS, EOS, EOS]) == (2, "stop", None)


def test_max_tokens_and_max_model_len() -> None:
    sc = make(SamplingParams(max_tokens=3))
    assert sc.process(TOK.ids("he", "ll")) == (2, None, None)
    assert sc.process(TOK.ids("o", "!", "x")) == (1, "length", None)
    assert sc.output_text == "hello" and "max_tokens" in (sc.finish_message or "")
    sc = make(SamplingParams(max_tokens=None), prompt_len=3, max_model_len=5)
    assert sc.process(TOK.ids("he", "ll", "o")) == (2, "length", None)
    assert "max_model_len" in (sc.finish_message or "")
    # A stop and the length limit on the same token: the stop wins.
    sc = make(SamplingParams(max_tokens=2, stop=["ll"]))
    assert sc.process(TOK.ids("he", "ll")) == (2, "stop", "ll")


def test_no_tokenizer() -> None:
    sc = StopChecker(SamplingParams(stop_token_ids=[7]), num_prompt_tokens=1, eos_token_ids=[2])
    assert sc.process([5, 6, 7, 8]) == (3, "stop", 7)
    assert sc.output_text == ""
    with pytest.raises(ValueError, match="stop strings"):
        StopChecker(SamplingParams(stop="x"), num_prompt_tokens=1).process([1])


def test_positional_form_and_append_with_detokenizer() -> None:
    # StopChecker(params, eos_token_ids, max_model_len, num_prompt_tokens); detokenizer given to append().
    sc = StopChecker(SamplingParams(stop="ll", max_tokens=None), [EOS], 100, 3)
    detok = IncrementalDetokenizer(TOK, [5, 6, 7])
    assert sc.append(TOK.ids("he", "ll", "o"), detok) == (2, "stop", "ll")
    assert sc.text == sc.output_text == "he"
    with pytest.raises(ValueError, match="different detokenizer"):
        StopChecker(SamplingParams(), [EOS], detokenizer=detok).append([1], IncrementalDetokenizer(TOK))


def test_external_finish() -> None:
    sc = make(SamplingParams())
    sc.process(TOK.ids("he"))
    sc.finish_external("abort", "aborted by user")
    assert (sc.finish_reason, sc.finish_message) == ("abort", "aborted by user")
    assert sc.process(TOK.ids("ll")) == (0, "abort", None)
    with pytest.raises(ValueError):
        make(SamplingParams()).finish_external("bogus")


def test_stop_string_with_byte_level_bpe(bpe_tokenizer: Tokenizer) -> None:
    text = "Grüße aus Köln, 深度求索的推理引擎 und mehr Text danach."
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    for stop, include in (("求索", False), ("求索", True), ("ße a", False), ("Text", True)):
        sc = StopChecker(
            SamplingParams(stop=[stop], include_stop_str_in_output=include, max_tokens=1000),
            num_prompt_tokens=1,
            eos_token_ids=bpe_tokenizer.eos_token_ids,
            detokenizer=IncrementalDetokenizer(bpe_tokenizer, [bpe_tokenizer.bos_token_id]),
        )
        kept = 0
        for i in range(0, len(ids), 3):  # steps of 3 tokens, as with speculative decoding
            n, reason, stop_reason = sc.process(ids[i : i + 3])
            kept += n
            if reason is not None:
                break
        assert (reason, stop_reason) == ("stop", stop)
        cut = text.index(stop) + (len(stop) if include else 0)
        assert sc.output_text == text[:cut]
        # The finishing token is the one that completed the stop string.
        assert stop in bpe_tokenizer.decode(ids[:kept]) and stop not in bpe_tokenizer.decode(ids[: kept - 1])
