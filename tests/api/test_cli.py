"""``python -m deepinfer_npu.run`` as users run it: every engine option has a flag and ``--help`` shows defaults;
caps, ignored options and bad input are said (a warning naming the limit, or an error); the exit status says
when nothing was generated."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_npu.config import REFERENCE_MODEL_DIR, EngineConfig
from deepinfer_npu.engine_args import build_parser
from deepinfer_npu.run import main

from .conftest import needs_ref

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEEPINFER_CPU_THREADS="1")
    return subprocess.run([sys.executable, "-m", "deepinfer_npu.run", "--no-progress", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)


# options built from several flags: the option -> the flags' destinations
COMPOSITE = {"eplb_config": {"eplb_preset", "eplb_redundant_experts_per_rank", "eplb_window_size",
                             "eplb_rebalance_interval"}}


def test_every_engine_option_has_a_flag():
    dests = {a.dest for a in build_parser()._actions}
    missing = [f.name for f in dataclasses.fields(EngineConfig)
               if f.name not in dests and f.name != "model" and not COMPOSITE.get(f.name, {"-"}) <= dests]
    assert not missing, f"EngineConfig options without a CLI flag: {missing}"
    args = build_parser().parse_args([])
    for f in dataclasses.fields(EngineConfig):  # CLI defaults are the engine's defaults
        if f.name != "model" and f.name not in COMPOSITE:
            assert getattr(args, f.name) == f.default, f.name


def test_help_shows_defaults_and_preemption_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--stop-preempted", "--recompute-preempted", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--num-kv-blocks", "--seed", "--enable-chunked-prefill"):
        assert flag in text, flag
    assert "tokens to generate per prompt (default: 48)" in text
    assert "tokens per KV cache block (default: 64)" in text
    assert build_parser().parse_args(["--recompute-preempted"]).stop_preempted_request is False
    assert build_parser().parse_args([]).stop_preempted_request is True


@pytest.mark.parametrize("argv, message", [
    (["--speculative-model", "/tmp"], "speculative_model='/tmp' is only used by speculative_method='dflash'"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative"),
    (["--prompt-token-ids", "1,x,3"], "--prompt-token-ids #0 '1,x,3': 'x' is not an integer"),
    (["--model", str(REFERENCE_MODEL_DIR / "config.json")], "is a file, expected a directory"),
])
def test_ignored_or_malformed_options_are_errors(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@needs_ref
@pytest.mark.parametrize("method, k", [("dflash", 100), ("dflash", 15), ("mtp", 16)])
def test_num_speculative_tokens_limit_stated_once(capsys, method, k):
    assert main(["--speculative", method, "--num-speculative-tokens", str(k)]) == 2
    err = capsys.readouterr().err
    limit = 5 if method == "dflash" else 15
    assert f"num_speculative_tokens must be in [1, {limit}]" in err and f"got {k}" in err


@needs_ref
def test_max_model_len_cutting_max_tokens_short_is_said():
    r = _run("--max-model-len", "10", "--max-tokens", "20", "--prompt-token-ids", "1,2")
    assert r.returncode == 0, r.stderr[-600:]
    assert "max_model_len=10" in r.stderr and "max_tokens=20" in r.stderr  # the one-line warning
    assert "[length: max_model_len=10 reached (2 prompt + 8 generated tokens, before max_tokens=20)]" in r.stdout


@needs_ref
def test_every_prompt_ignored_exits_non_zero():
    r = _run("--json", "--max-model-len", "3", "--prompt", "def fibonacci(n):")
    assert r.returncode == 1, r.stderr[-600:]
    assert "every prompt (1) was ignored" in r.stderr and "Traceback" not in r.stderr
    first = json.loads(r.stdout.splitlines()[0])
    assert first["finish_reason"] == "ignored" and first["finish_message"]


@needs_ref
def test_graphs_on_a_backend_without_graphs_is_said(caplog):
    assert main(["--graphs", "--backend", "cpu", "--max-tokens", "2", "--prompt", "a", "--no-progress"]) == 0
    assert "no graph runner" in caplog.text


@needs_ref
def test_max_tokens_beyond_max_model_len_is_said(caplog):
    assert main(["--max-model-len", "12", "--max-tokens", "1000000", "--prompt-token-ids", "1,2",
                 "--no-progress"]) == 0
    line = next(r.getMessage() for r in caplog.records if "max_model_len=12" in r.getMessage())
    assert "max_tokens=1000000" in line and "finish_reason='length'" in line
