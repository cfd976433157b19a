"""Cross-backend parity: the CPU backend against every golden trace in parity_tests/golden/.

fp32 goldens: tokens identical. bf16 goldens: vLLM's logprobs-close rule. With no goldens recorded yet, the
rules themselves are checked on synthetic traces, including negative controls that must fail, and the recorder
is exercised end to end on the CPU.

CPU recordings are deterministic (greedy decoding, fixed prompts, seeded or stored weights), so the module records
each (dtype, model, max_tokens, load format) once and hands out copies: the real-dims model takes about half a
minute to build on a CI core, and the round trip replays the same recording as the real-dims bf16 golden. The
bf16 and fp32 real-dims models draw the same float64 values: the module keeps each draw once, as float32
(:func:`_shared_portable_draws`).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch

from deepinfer_npu.config import REFERENCE_MODEL_DIR
from deepinfer_npu.model_executor import dummy_weights
from deepinfer_npu.parity import prompts as P
from deepinfer_npu.parity import recorder, rules
from deepinfer_npu.parity.__main__ import compare_docs
from tests.reference_assets import needs_reference_model

GOLDENS = sorted((Path(__file__).resolve().parent / "golden").glob("*.json"))


_CPU_RECORDINGS: dict[tuple, dict] = {}

#: one pytest-xdist worker runs the module, so each recording above is made once
pytestmark = pytest.mark.xdist_group("cpu_recordings")


@pytest.fixture(scope="module", autouse=True)
def _shared_portable_draws():
    """``dummy_portable`` chunks drawn once per (tensor, generator state) in this module, kept as float32 until
    their second use: the same generator state gives the same float64 values, and torch converts float64 to bf16
    through float32 (so float32 copies give both dtypes' bits, checked in
    :func:`test_bf16_from_float64_goes_through_float32`). The draw is most of the real-dims model's build; the bf16
    and fp32 recordings share it."""
    draws: dict[tuple, tuple[list, torch.Tensor]] = {}
    original = dummy_weights._portable_chunks

    def chunks(name, param, gen):
        state = gen.get_state()
        key = (name, tuple(param.shape), repr(getattr(param, "dummy_rows", None)),
               hashlib.sha256(state.numpy().tobytes()).hexdigest())
        if key not in draws:  # the first recording: drawn, kept for the second
            parts = []
            for r0, part, rows in original(name, param, gen):
                parts.append((r0, part.float(), rows))
                yield parts[-1]
            draws[key] = (parts, gen.get_state())
            return
        parts, after = draws.pop(key)  # the second: replayed, then let go (2.7 GB for the real-dims model)
        gen.set_state(after)
        yield from parts

    dummy_weights._portable_chunks = chunks
    try:
        yield
    finally:
        dummy_weights._portable_chunks = original


def test_bf16_from_float64_goes_through_float32():
    """What :func:`_shared_portable_draws` relies on, at bf16 rounding midpoints and a hair either side."""
    gen = torch.Generator().manual_seed(0)
    b = torch.randn(200_000, generator=gen).to(torch.bfloat16).double()
    half_ulp = torch.ldexp(torch.ones_like(b), torch.frexp(b).exponent - 9)  # half a bf16 ulp of each value
    x = torch.cat([torch.randn(200_000, generator=gen, dtype=torch.float64) * 0.02, b + half_ulp,
                   b + half_ulp * (1 + 1e-12), b + half_ulp * (1 - 1e-12)])
    assert torch.equal(x.to(torch.bfloat16).view(torch.int16), x.float().to(torch.bfloat16).view(torch.int16))


def record_cpu(dtype: str, model_dir: Path, max_tokens: int, load_format: str = "auto") -> dict:
    """``recorder.record("cpu", ...)``, recorded once per argument set in this process; a deep copy each time
    (callers edit their document)."""
    key = (dtype, str(Path(model_dir).resolve()), max_tokens, load_format)
    if key not in _CPU_RECORDINGS:
        _CPU_RECORDINGS[key] = recorder.record("cpu", dtype, model_dir, max_tokens, load_format=load_format)
    return copy.deepcopy(_CPU_RECORDINGS[key])


@pytest.mark.parametrize("path", GOLDENS, ids=[p.name for p in GOLDENS])
def test_cpu_backend_against_golden(path):
    check_cpu_against(path)


def check_cpu_against(path: Path) -> None:
    golden = json.loads(path.read_text())
    model = golden["model"]
    load_format = model.get("load_format", "auto")
    model_dir = recorder.REPO_ROOT / model["repo_dir"] if model.get("repo_dir") else Path(model["dir"])
    if not (model_dir / "config.json").exists():
        model_dir = REFERENCE_MODEL_DIR
    fp = recorder.model_fingerprint(model_dir, load_format)
    assert (
        fp["config_sha256"] == model["config_sha256"]
        and fp["weights"] == model["weights"]
    ), f"{path.name} was recorded on a different model; re-record it on the current reference model"
    cand = record_cpu(golden["dtype"], model_dir, golden["max_tokens"], load_format=load_format)
    verdicts = compare_docs(golden, cand)
    assert all(v.ok for v in verdicts), [v.message for v in verdicts if not v.ok]


def _trace(tokens, tops):
    return {"tokens": tokens, "top": tops}


def test_fp32_rule_identical_passes_and_one_token_off_fails():
    a = _trace([5, 6, 7, 8], [[5, 1], [6, 2], [7, 3], [8, 4]])
    assert rules.compare_trace("float32", a, a).ok
    b = _trace([5, 6, 9, 8], a["top"])
    v = rules.compare_trace("float32", a, b)
    assert not v.ok and "position 2" in v.message


def test_bf16_rule_accepts_a_swap_within_top5_then_ignores_divergence():
    a = _trace([5, 6, 7, 1, 1], [[5], [6], [7, 9, 2, 3, 4], [1], [1]])
    b = _trace([5, 6, 9, 2, 3], [[5], [6], [9, 7, 2, 3, 4], [2], [3]])
    assert rules.compare_trace("bfloat16", a, b).ok


def test_bf16_rule_negative_control_fails_outside_top5():
    a = _trace([5, 6, 7], [[5], [6], [7, 2, 3, 4, 10]])
    b = _trace([5, 6, 9], [[5], [6], [9, 7, 2, 3, 4]])  # 9 is not in a's top-5 at position 2
    v = rules.compare_trace("bfloat16", a, b)
    assert not v.ok and "position 2" in v.message


@needs_reference_model
def test_recorder_end_to_end_on_cpu_with_negative_control(tmp_path):
    doc = recorder.record("cpu", "float32", REFERENCE_MODEL_DIR, max_tokens=8)
    path = recorder.write(doc, tmp_path / "cpu-float32.json")
    again = json.loads(path.read_text())
    assert again["environment"]["backend"] == "cpu" and len(again["traces"]) == len(doc["traces"])
    assert all(len(t["tokens"]) == 8 and all(len(p) == 5 for p in t["top5"]) for t in again["traces"])
    assert all(v.ok for v in compare_docs(again, doc))
    bad = json.loads(path.read_text())
    bad["traces"][0]["tokens"][3] = (bad["traces"][0]["tokens"][3] + 1) % 4096
    assert not all(v.ok for v in compare_docs(bad, doc))  # the rule catches a changed token


@needs_reference_model
def test_two_ranks_give_the_goldens_of_one():
    """The parity job on two rank processes (gloo, expert-parallel MoE across them): the fp32 goldens' tokens, and
    the same tokens and top-5 logprobs as the one-process recording within the fp32 rule."""
    fp32 = [p for p in GOLDENS if json.loads(p.read_text())["dtype"] == "float32"
            and not json.loads(p.read_text())["model"].get("repo_dir")]
    one = record_cpu("float32", REFERENCE_MODEL_DIR, P.MAX_TOKENS)
    two = recorder.record("cpu", "float32", REFERENCE_MODEL_DIR, P.MAX_TOKENS, data_parallel_size=2,
                          distributed_timeout_s=120)
    assert two["environment"]["data_parallel_size"] == 2
    assert [t["tokens"] for t in two["traces"]] == [t["tokens"] for t in one["traces"]]
    assert all(v.ok for v in compare_docs(one, two))
    for path in fp32:
        verdicts = compare_docs(json.loads(path.read_text()), two)
        assert all(v.ok for v in verdicts), (path.name, [v.message for v in verdicts if not v.ok])


REAL_DIMS_MODEL = Path(__file__).resolve().parent / "models" / "deepseek-v2-lite-dims-2l"


def test_real_dims_parity_model_is_v2_lite_shaped():
    """The real-dims parity model: DeepSeek-V2-Lite's attention and expert dims (the ones the CUDA kernels are built
    for), two layers (one dense, one MoE), the reference tokenizer's vocabulary; config.json only (seeded
    ``dummy_portable`` weights, identical on every backend)."""
    cfg = json.loads((REAL_DIMS_MODEL / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"],
            cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["moe_intermediate_size"], cfg["n_routed_experts"],
            cfg["num_experts_per_tok"]) == (2048, 16, 512, 64, 128, 128, 1408, 64, 6)
    assert cfg["num_hidden_layers"] == 2 and cfg["first_k_dense_replace"] == 1
    assert not list(REAL_DIMS_MODEL.glob("*.safetensors"))


def test_real_dims_golden_round_trip_on_cpu(tmp_path):
    """A golden recorded on the real-dims model with portable random weights replays through the CI check (the
    model found through its repository-relative path, the load format kept); a changed token fails it. The
    goldens' token count, so the recording is the one the real-dims bf16 golden replays against."""
    doc = record_cpu("bfloat16", REAL_DIMS_MODEL, max_tokens=P.MAX_TOKENS, load_format="dummy_portable")
    assert doc["model"]["load_format"] == "dummy_portable" and doc["model"]["weights"] == {}
    assert doc["model"]["repo_dir"] == "parity_tests/models/deepseek-v2-lite-dims-2l"
    doc["model"]["dir"] = "/elsewhere/on/the/recording/machine"
    path = recorder.write(doc, tmp_path / "cuda-bfloat16-real-dims.json")
    check_cpu_against(path)
    doc["traces"][0]["tokens"][0] = (doc["traces"][0]["tokens"][0] + 1) % 4096
    doc["traces"][0]["top5"][0] = [[t, -1.0] for t in range(4090, 4095) if t != doc["traces"][0]["tokens"][0]][:5]
    recorder.write(doc, path)
    with pytest.raises(AssertionError):
        check_cpu_against(path)


def test_dummy_portable_weights_do_not_depend_on_the_cpu_code_path():
    """``dummy_portable`` draws in float64: the same values under torch's default and AVX2/AVX512 CPU kernels (its
    float32 sampler differs between them), so a golden's weights are rebuilt exactly on any machine."""
    import os
    import subprocess
    import sys

    code = (
        "import hashlib, torch\n"
        "from deepinfer_npu.model_executor.loader import init_dummy_weights\n"
        "m = torch.nn.Module(); m.w = torch.nn.Parameter(torch.empty(3, 70000)); m.b = torch.nn.Parameter("
        "torch.empty(5)); m.e_score_correction_bias = torch.nn.Parameter(torch.empty(64))\n"
        "init_dummy_weights(m, seed=7, portable=True)\n"
        "print(hashlib.sha256(b''.join(p.detach().to(torch.bfloat16).view(torch.int16).numpy().tobytes() "
        "for _n, p in sorted(m.named_parameters()))).hexdigest())\n"
    )
    digests = set()
    for capability in ("default", None):
        env = dict(os.environ)
        env.pop("ATEN_CPU_CAPABILITY", None)
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        digests.add(out.stdout.strip().splitlines()[-1])
    assert len(digests) == 1, digests


def test_parity_cli_refuses_a_bad_rank_count(capsys):
    from deepinfer_npu.parity.__main__ import main

    assert main(["record", "--backend", "cpu", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1, got 0" in capsys.readouterr().err
