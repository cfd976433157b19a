"""RequestOutput / CompletionOutput / Logprob structures."""

from __future__ import annotations

from deepinfer_npu.engine.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
    make_logprobs_dict,
)


def test_fields_and_repr() -> None:
    c = CompletionOutput(
        index=0,
        text="Hello",
        token_ids=[1, 2, 3],
        cumulative_logprob=-1.5,
        logprobs=[{1: Logprob(-0.5, 1, "H")}],
        finish_reason="stop",
        stop_reason="\n",
    )
    r = RequestOutput(
        request_id="0",
        prompt="Hi",
        prompt_token_ids=[7, 8],
        outputs=[c],
        finished=True,
        metrics=RequestMetrics(arrival_time=1.0),
    )
    assert c.finished() and r.finished and r.outputs[0].text == "Hello"
    text = repr(r)
    assert "request_id='0'" in text and "text='Hello'" in text and "finish_reason=stop" in text
    assert "<1 positions>" in text and "stop_reason='\\n'" in text
    long = CompletionOutput(index=0, text="", token_ids=list(range(1000)), finish_reason=None)
    assert "1000 total" in repr(long) and len(repr(long)) < 300 and not long.finished()


def test_finish_reasons_and_message() -> None:
    assert FinishReason.ALL == {"stop", "length", "abort", "preempted", "ignored"}
    c = CompletionOutput(
        0,
        "",
        [],
        finish_reason=FinishReason.IGNORED,
        finish_message="prompt of 5000 tokens exceeds max_model_len=4096",
    )
    assert c.finish_reason == "ignored" and "max_model_len" in repr(c)


def test_make_logprobs_dict() -> None:
    d = make_logprobs_dict(
        [5, 9, 2],
        [-0.1, -2.0, -3.0],
        sampled_id=9,
        sampled_logprob=-2.0,
        sampled_rank=2,
        decode=lambda t: f"<{t}>",
    )
    assert list(d) == [9, 5, 2]
    assert d[9] == Logprob(-2.0, 2, "<9>") and d[5] == Logprob(-0.1, 1, "<5>") and d[2].rank == 3
    d = make_logprobs_dict([5], [-0.1], sampled_id=7, sampled_logprob=-4.0, sampled_rank=11)
    assert d == {7: Logprob(-4.0, 11, None), 5: Logprob(-0.1, 1, None)}
