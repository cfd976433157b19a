"""The shipped reference model through deepinfer_npu itself: our loader + engine agree with transformers (fp32
logits and greedy tokens), its held-out loss through our model matches the model card, and the default run works."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.config import REFERENCE_MODEL_DIR as REF
from deepinfer_npu.hal import get_backend
from deepinfer_npu.model_executor import DeepseekModelConfig, build_attention_metadata, build_model, load_weights
from deepinfer_npu.model_executor.kv_cache import allocate_kv_caches


@pytest.fixture(scope="module")
def check():
    return json.loads((REF / "heldout_check.json").read_text())


@pytest.fixture(scope="module")
def ours():
    cfg = DeepseekModelConfig.from_pretrained(REF)
    model = build_model(cfg, get_backend("cpu"), torch.float32)
    load_weights(model, REF)
    return model


def _our_logits(model, rows: list[list[int]]) -> torch.Tensor:
    """Prefill every row in one batched step through the paged cache; logits [sum(len), V]."""
    block = 64
    lens = [len(r) for r in rows]
    blocks = [-(-n // block) for n in lens]
    tables, nxt = [], 1
    for b in blocks:
        tables.append(list(range(nxt, nxt + b)) + [0] * (max(blocks) - b))
        nxt += b
    caches = allocate_kv_caches(model.config, nxt, block, torch.float32)
    attn = build_attention_metadata(lens, lens, tables, block)
    ids = torch.tensor([t for r in rows for t in r])
    with torch.no_grad():
        return model.compute_logits(model(ids, attn.positions, attn, caches))


def test_logits_match_transformers_fp32(ours, check):
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(REF, torch_dtype=torch.float32).eval()
    rows = [r[:128] for r in check["token_ids"][:2]]
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([r])).logits[0] for r in rows])
    got = _our_logits(ours, rows)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, rel


def test_heldout_loss_through_our_model_matches_card(ours, check):
    rows = check["token_ids"]
    logits = _our_logits(ours, rows)
    targets, offset, losses = [], 0, []
    for r in rows:
        lg = logits[offset : offset + len(r) - 1]
        losses.append(torch.nn.functional.cross_entropy(lg, torch.tensor(r[1:]), reduction="sum"))
        targets.append(len(r) - 1)
        offset += len(r)
    loss = (sum(losses) / sum(targets)).item()
    assert abs(loss - check["expected_loss"]) / check["expected_loss"] <= check["rel_tolerance"], loss


def test_engine_greedy_equals_transformers(check):
    g = check["greedy"]
    out = LLM().generate({"prompt_token_ids": g["prompt_ids"]},
                         SamplingParams(max_tokens=len(g["expected_new_ids"]), temperature=0.0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == g["expected_new_ids"]


def test_default_run_exits_zero_with_completions():
    proc = subprocess.run([sys.executable, "-m", "deepinfer_npu.run", "--json", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines()]
    completions = [x for x in lines if "text" in x]
    assert len(completions) >= 3 and all(c["text"].strip() for c in completions)
    assert lines[-1]["summary"]["backend"] == "cpu"
