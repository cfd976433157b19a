"""Varlen on device backends: the worker feeds the estimators event-timed forward / sampling times."""


def test_varlen_feeds_device_timed_steps(monkeypatch):
    """On a device backend the worker times the forward and the sampling phase with timing events (host clocks
    only see launches) and the varlen estimators receive those times. Exercised on the CPU backend posing as a
    device (its host events time real work): every decode result carries the event-timed values."""
    from deepinfer_npu import LLM, SamplingParams

    llm = LLM(speculative_method="mtp", num_speculative_tokens=3, varlen_verification=True, max_num_seqs=4)
    engine = llm.llm_engine
    monkeypatch.setattr(engine.backend, "device_type", "emulated-device")
    seen = []
    orig = engine.varlen.observe

    def observe(res):
        seen.append(res)
        return orig(res)

    monkeypatch.setattr(engine.varlen, "observe", observe)
    timed = []
    orig_post = engine.worker._post_process

    def post(step):
        timed.append(step.fwd_events is not None)
        return orig_post(step)

    monkeypatch.setattr(engine.worker, "_post_process", post)
    llm.generate(["def f(x):\n"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert timed and all(timed)
    decode = [r for r in seen if not r.is_prefill]
    assert decode and all(r.model_ms > 0 and r.sample_ms > 0 for r in decode)
