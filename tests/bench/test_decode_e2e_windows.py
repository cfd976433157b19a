"""benchmarks/bench_decode_e2e.py's per-window diagnostics: the median of --repeat windows, the host's share of
each window blocked on the device, and (``--gpu-state``) the GPU's clocks after each window from nvidia-smi, read
defensively (no device, no nvidia-smi, an older driver without ``clocks_event_reasons``)."""

import subprocess
import types

from benchmarks import bench_decode_e2e as bench


def test_gpu_state_parses_and_falls_back(monkeypatch):
    import torch

    assert bench.gpu_state("cpu") is None
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        if "clocks_event_reasons.active" in cmd[1]:
            return types.SimpleNamespace(returncode=2, stdout="")  # an older driver
        return types.SimpleNamespace(returncode=0, stdout="1980, 3201, 412.5, 51\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    got = bench.gpu_state("cuda")
    assert got == {"clocks.sm": "1980", "clocks.mem": "3201", "power.draw": "412.5", "temperature.gpu": "51"}
    assert len(calls) == 2 and calls[0][-1] == "0"

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert bench.gpu_state("cuda") is None


def test_repeat_windows_and_host_wait_in_the_row(tmp_path):
    out = tmp_path / "rows.jsonl"
    rc = bench.main(["--backend", "cpu", "--tiny", "--batch", "1", "--prompt-len", "16", "--gen", "4", "--repeat",
                     "3", "--no-hf", "--gpu-state", "--out", str(out)])
    assert rc == 0
    import json

    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(row["engine_tok_s_windows"]) == 3
    assert abs(row["engine_tok_s"] - sorted(row["engine_tok_s_windows"])[1]) <= 0.06  # the median window
    assert len(row["host_wait_frac_windows"]) == 3 and all(0 <= f <= 1 for f in row["host_wait_frac_windows"])
    assert row["gpu_state_windows"] == [None, None, None]  # the CPU backend has no GPU to read


def test_every_shape_is_a_config_the_engine_accepts_and_v3_counts_its_q_lora():
    """--shape's configs parse as the engine's model config; the V3 shape's roofline bytes count the q-LoRA pair
    (q_a + q_b), 3 MoE layers of 8 active experts each, and its 129280-row lm_head."""
    from benchmarks.decode_workload import SHAPES, V3_4L
    from deepinfer_npu.model_executor.model_config import DeepseekModelConfig

    for name, (cfg, _model) in SHAPES.items():
        mc = DeepseekModelConfig.from_dict(cfg, source=name)
        assert mc.kv_cache_dim == cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    v3 = DeepseekModelConfig.from_dict(V3_4L)
    assert v3.num_attention_heads == 128 and v3.q_lora_rank == 1536
    assert [v3.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    by = bench.bytes_per_step(V3_4L, 1, 512.0)
    d, mi = 7168, 2048
    q = 1536 * d + 128 * 192 * 1536
    attn = q + 576 * d + d * 128 * 128 + 128 * 256 * 512
    experts_b1 = 3 * (3 * d * mi * (1 + 8) + 256 * d)  # shared + 8 hit experts + the router, per MoE layer
    want = 2 * (4 * attn + 3 * d * 18432 + experts_b1 + 129280 * d) + 4 * 512 * 576 * 2
    assert abs(by["total"] - want) / want < 1e-6, (by["total"], want)


def test_each_engines_rows_are_written_when_it_finishes(tmp_path, monkeypatch):
    """Without transformers in the run, the first engine's rows are in --out before the second engine starts: a run
    killed during a later engine (here: SystemExit, which the engine loop does not catch) keeps them."""
    import json

    import pytest

    out = tmp_path / "rows.jsonl"
    real = bench.run_engine

    def second_dies(args, tmp, cfg, log, eng, quantization=None, kv_cache_dtype="auto"):
        if quantization == "fp8":
            raise SystemExit("killed at the phase limit")
        return real(args, tmp, cfg, log, eng, quantization=quantization, kv_cache_dtype=kv_cache_dtype)

    monkeypatch.setattr(bench, "run_engine", second_dies)
    with pytest.raises(SystemExit):
        bench.main(["--backend", "cpu", "--tiny", "--batch", "1", "2", "--prompt-len", "16", "--gen", "4",
                    "--repeat", "1", "--no-hf", "--quantization", "none", "fp8", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["quantization"], r["batch"]) for r in rows] == [(None, 1), (None, 2)]
    assert all(r["engine_tok_s"] > 0 for r in rows)
