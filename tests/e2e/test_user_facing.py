"""User-facing behaviour of the CLI, the parity CLI, the checkpoint loader and the model config: clean errors
instead of tracebacks, advertised options that work, and messages that name the problem."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_npu.config import REFERENCE_MODEL_DIR
from tests.reference_assets import needs_reference_model

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEEPINFER_CPU_THREADS="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def _copy_reference(dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(REFERENCE_MODEL_DIR / name, dst / name)
    return dst


# ---- CLI ------------------------------------------------------------------------------------------------------
def test_cli_bad_prompt_token_ids_is_a_clean_error():
    r = _run("-m", "deepinfer_npu.run", "--prompt-token-ids", "1,x,3", "--no-progress")
    assert r.returncode == 2, r.stderr[-400:]
    assert "Traceback" not in r.stderr


def test_cli_advertised_dtype_float16_is_usable_or_not_offered():
    from deepinfer_npu.engine_args import build_parser

    choices = next(a.choices for a in build_parser()._actions if a.dest == "dtype")
    if "float16" not in choices:
        return  # not offered: fine
    r = _run("-m", "deepinfer_npu.run", "--dtype", "float16", "--max-tokens", "2", "--prompt", "a", "--no-progress")
    assert r.returncode == 0, r.stderr[-400:]


@needs_reference_model
def test_cli_json_keeps_finish_message():
    r = _run(
        "-m", "deepinfer_npu.run", "--json", "--max-model-len", "3", "--prompt", "def fibonacci(n):", "--no-progress"
    )
    assert r.returncode == 1, r.stderr[-400:]  # every prompt was ignored: nothing generated
    first = json.loads(r.stdout.splitlines()[0])
    assert first["finish_reason"] == "ignored"
    assert first.get("finish_message"), first


@needs_reference_model
def test_cli_list_ops_ascend_decides_model_dependent_ops():
    code = (
        "import sys\n"
        "from parity_tests import npu_emulation; npu_emulation.install()\n"
        "from deepinfer_npu.run import main\n"
        "sys.exit(main(['--backend', 'ascend', '--list-ops', '--json']))\n"
    )
    env_profile = {"DEEPINFER_ASCEND_PROFILE": "a2_a3"}
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=dict(os.environ, **env_profile),
    )
    assert r.returncode == 0, r.stderr[-600:]
    ops = json.loads(r.stdout.strip().splitlines()[-1])["ops"]
    assert not ops["mla_attention"].startswith("pending"), ops["mla_attention"]


# ---- parity CLI -----------------------------------------------------------------------------------------------
def test_parity_compare_missing_golden_is_a_clean_error(tmp_path):
    r = _run("-m", "deepinfer_npu.parity", "compare", "--golden", str(tmp_path / "nope.json"))
    assert r.returncode == 2, r.stderr[-400:]
    assert "Traceback" not in r.stderr


def test_parity_record_unavailable_backend_is_a_clean_error(tmp_path):
    from deepinfer_npu.hal import registry
    from deepinfer_npu.hal.registry import registered_backends

    unavailable = [n for n in registered_backends() if n != "cpu" and not _available(registry, n)]
    if not unavailable:
        pytest.skip("every registered backend is available here")
    r = _run("-m", "deepinfer_npu.parity", "record", "--backend", unavailable[0], "--out", str(tmp_path / "g.json"))
    assert r.returncode == 2, r.stderr[-400:]
    assert "Traceback" not in r.stderr


def _available(registry, name: str) -> bool:
    try:
        registry.get_backend(name)
        return True
    except (RuntimeError, ValueError):
        return False


@needs_reference_model
def test_parity_compare_names_a_model_mismatch(tmp_path, capsys):
    from deepinfer_npu.parity.__main__ import main

    other = _copy_reference(tmp_path / "no_tokenizer")  # same weights, no tokenizer -> token-id prompts
    golden = tmp_path / "g.json"
    assert main(["record", "--backend", "cpu", "--model", str(other), "--max-tokens", "2", "--out", str(golden)]) == 0
    capsys.readouterr()
    # Without --model, compare replays on the model the golden names.
    assert main(["compare", "--golden", str(golden)]) == 0
    assert "PASS" in capsys.readouterr().out
    # On a different model, it says so (naming the golden's model) instead of blaming the prompts.
    changed = _copy_reference(tmp_path / "changed")
    cfg = json.loads((changed / "config.json").read_text())
    cfg["rms_norm_eps"] = 2e-6
    (changed / "config.json").write_text(json.dumps(cfg))
    assert main(["compare", "--golden", str(golden), "--model", str(changed)]) == 1
    out = capsys.readouterr().out
    assert "recorded on model" in out and str(other) in out, out


# ---- loader / config ------------------------------------------------------------------------------------------
def _reference_with(tmp_path: Path, **replace) -> Path:
    from safetensors.torch import load_file, save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(REFERENCE_MODEL_DIR / "config.json", d / "config.json")
    sd = load_file(str(REFERENCE_MODEL_DIR / "model.safetensors"))
    sd.update(replace)
    save_file(sd, str(d / "model.safetensors"))
    return d


def _load(model_dir: Path):
    from deepinfer_npu.hal.registry import get_backend
    from deepinfer_npu.model_executor.loader import load_weights
    from deepinfer_npu.model_executor.model_config import DeepseekModelConfig
    from deepinfer_npu.model_executor.models import build_model

    cfg = DeepseekModelConfig.from_pretrained(model_dir)
    model = build_model(cfg, get_backend("cpu"), torch.float32)
    load_weights(model, model_dir)


@needs_reference_model
def test_loader_rejects_integer_weights(tmp_path):
    from deepinfer_npu.model_executor.loader import CheckpointError

    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    from safetensors import safe_open

    with safe_open(str(REFERENCE_MODEL_DIR / "model.safetensors"), "pt") as f:
        w = f.get_tensor(name)
    d = _reference_with(tmp_path, **{name: (w.float() * 100).to(torch.int32)})
    with pytest.raises(CheckpointError, match="kv_a_proj_with_mqa"):
        _load(d)


@needs_reference_model
def test_loader_fp8_non_matrix_is_a_checkpoint_error(tmp_path):
    from safetensors import safe_open

    from deepinfer_npu.model_executor.loader import CheckpointError

    with safe_open(str(REFERENCE_MODEL_DIR / "model.safetensors"), "pt") as f:
        norm = f.get_tensor("model.norm.weight")
    d = _reference_with(
        tmp_path,
        **{"model.norm.weight": norm.float().to(torch.float8_e4m3fn), "model.norm.weight_scale_inv": torch.ones(1)},
    )
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        _load(d)


def test_config_rejects_bool_rms_norm_eps():
    from deepinfer_npu.model_executor.model_config import ConfigError, DeepseekModelConfig

    raw = json.loads((REFERENCE_MODEL_DIR / "config.json").read_text())
    raw["rms_norm_eps"] = True
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        DeepseekModelConfig.from_dict(raw)
