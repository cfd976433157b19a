"""The shipped reference model (real trained weights) quantised to FP8 at load runs end to end, with its held-out
slice loss within 1 % of the unquantised model's (the model card's quality goal)."""

from __future__ import annotations

import json

import torch

from deepinfer_npu.config import REFERENCE_MODEL_DIR as REF
from deepinfer_npu.hal import get_backend
from deepinfer_npu.model_executor import DeepseekModelConfig, build_model, load_weights
from deepinfer_npu.model_executor.quantization import FP8_DTYPE
from tests.model.tiny_models import PagedRunner


def _slice_loss(model, rows: list[list[int]]) -> float:
    runner = PagedRunner(model, num_blocks=80)
    logits = runner.step({i: r for i, r in enumerate(rows)})
    total, count, offset = 0.0, 0, 0
    for r in rows:
        lg = logits[offset : offset + len(r) - 1]
        total += torch.nn.functional.cross_entropy(lg, torch.tensor(r[1:]), reduction="sum").item()
        count, offset = count + len(r) - 1, offset + len(r)
    return total / count


def test_reference_model_fp8_at_load_keeps_heldout_loss_within_1_percent():
    check = json.loads((REF / "heldout_check.json").read_text())
    model = build_model(DeepseekModelConfig.from_pretrained(REF), get_backend("cpu"), torch.float32,
                        quantization="fp8")
    load_weights(model, REF)
    assert model.model.layers[2].mlp.experts.w13.dtype == FP8_DTYPE
    assert model.mtp.layers[0].mlp.experts.w2.dtype == FP8_DTYPE  # the MTP layer's block is quantised too
    loss = _slice_loss(model, check["token_ids"])
    # expected_loss: transformers fp32 on the same slice (2.9965); measured FP8: 3.0010 (+0.15 %)
    assert abs(loss - check["expected_loss"]) / check["expected_loss"] < 0.01, loss
