"""quantization="fp8" at load: an FP8 checkpoint (``weight_scale_inv``) keeps its tensors; a bf16 / fp32 checkpoint
is quantised at load; dummy weights are FP8; errors name the setting or tensor."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_npu.hal import get_backend
from deepinfer_npu.model_executor import CheckpointError, ConfigError, DeepseekModelConfig, build_model, load_weights
from deepinfer_npu.model_executor.quantization import (
    FP8_DTYPE,
    QuantizationError,
    dequantize_fp8_block,
    quantize_fp8_block,
)
from tests.model.tiny_models import PagedRunner, make_hf_model, save_hf

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84]
# projections DeepSeek-V3's FP8 release stores with weight_scale_inv (embedding, norms, router, lm_head stay)
QUANTISED = ("proj.weight", "proj_with_mqa.weight")


def _load(model_dir: str, quantization: str | None, load_format: str = "auto"):
    cfg = DeepseekModelConfig.from_pretrained(model_dir)
    model = build_model(cfg, get_backend("cpu"), torch.float32, quantization=quantization)
    load_weights(model, model_dir, load_format=load_format)
    return model


def _write_fp8(src: str, dst: str, block=(128, 128)) -> dict[str, torch.Tensor]:
    """Copy the checkpoint in ``src`` to ``dst`` with every projection quantised (``quantization_config`` set)."""
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name, w in list(tensors.items()):
        if name.endswith(QUANTISED):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_block(w, block)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads(open(os.path.join(src, "config.json")).read())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    open(os.path.join(dst, "config.json"), "w").write(json.dumps(cfg))
    return tensors


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    # gate / up parts of 128 rows, as DeepSeek-V3's (their tiles are tiles of the stacked weight)
    hf = make_hf_model("v3", num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=128,
                       moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                       q_lora_rank=32, num_nextn_predict_layers=0,
                       initializer_range=0.02)
    root = tmp_path_factory.mktemp("fp8")
    plain = save_hf(hf, root / "plain")
    fp8 = str(root / "fp8")
    return plain, fp8, _write_fp8(plain, fp8)


def test_fp8_checkpoint_keeps_its_tensors_and_matches_the_dequantised_model(dirs):
    _plain, fp8_dir, tensors = dirs
    model = _load(fp8_dir, "fp8")
    attn = model.model.layers[0].self_attn
    assert attn.q_a_proj.weight.dtype == FP8_DTYPE
    assert torch.equal(attn.q_a_proj.weight.view(torch.uint8),
                       tensors["model.layers.0.self_attn.q_a_proj.weight"].view(torch.uint8))
    assert torch.equal(attn.o_proj.weight_scale_inv, tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"])
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(experts.w13[2, 128:].view(torch.uint8),
                       tensors["model.layers.1.mlp.experts.2.up_proj.weight"].view(torch.uint8))
    assert torch.equal(experts.w2_scale_inv[3], tensors["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"])
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays unquantised
    assert model.lm_head.weight.dtype == torch.float32

    dequantised = _load(fp8_dir, None)  # today's path: FP8 dequantised at load
    assert dequantised.model.layers[1].mlp.experts.w13.dtype == torch.float32
    got, want = PagedRunner(model).step({0: PROMPT}), PagedRunner(dequantised).step({0: PROMPT})
    # same weights; the difference is the 1 x 128 activation quantisation (e4m3): 2.0 % in norm measured
    assert ((got - want).norm() / want.norm()).item() < 0.04
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_quantise_at_load_equals_the_fp8_checkpoint_of_the_same_weights(dirs):
    plain, fp8_dir, _ = dirs
    online, offline = _load(plain, "fp8"), _load(fp8_dir, "fp8")
    assert online.config.quant.from_checkpoint is False and offline.config.quant.from_checkpoint is True
    ref = dict(offline.named_parameters())
    for name, p in online.named_parameters():
        a, b = (p.view(torch.uint8), ref[name].view(torch.uint8)) if p.dtype == FP8_DTYPE else (p, ref[name])
        assert torch.equal(a, b), name


def test_w8a8_on_an_fp8_checkpoint_dequantises_then_quantises_per_channel(dirs):
    _plain, fp8_dir, _ = dirs
    model, dequantised = _load(fp8_dir, "w8a8"), _load(fp8_dir, None)
    experts = model.model.layers[1].mlp.experts
    assert experts.w13.dtype == torch.int8 and experts.w13_scale.shape == (4, 256)
    got, want = PagedRunner(model).step({0: PROMPT}), PagedRunner(dequantised).step({0: PROMPT})
    # int8 rounding of the weights on top of the activations' (per-channel over 64 random inputs): 6.9 % measured
    assert ((got - want).norm() / want.norm()).item() < 0.1


def test_dummy_fp8_weights_are_the_quantised_dummy_weights(dirs):
    plain = dirs[0]
    for portable in ("dummy", "dummy_portable"):
        fp8, ref = _load(plain, "fp8", portable), _load(plain, None, portable)
        ref_params = dict(ref.named_parameters())
        w13 = fp8.model.layers[1].mlp.experts
        q, s = quantize_fp8_block(ref_params["model.layers.1.mlp.experts.w13"])
        assert torch.equal(w13.w13.view(torch.uint8), q.view(torch.uint8)) and torch.equal(w13.w13_scale_inv, s)
        o = fp8.model.layers[0].self_attn.o_proj
        want = ref_params["model.layers.0.self_attn.o_proj.weight"]
        torch.testing.assert_close(dequantize_fp8_block(o.weight, o.weight_scale_inv), want, rtol=0.07, atol=1e-3)
        assert torch.equal(fp8.lm_head.weight, ref.lm_head.weight)  # unquantised tensors draw the same values


# ---- errors ------------------------------------------------------------------------------------------------
def test_unaligned_fp8_parts_are_reported(tmp_path):
    hf = make_hf_model("v3", num_hidden_layers=1, first_k_dense_replace=1, intermediate_size=80, n_group=2,
                       topk_group=1, num_nextn_predict_layers=0)
    plain = save_hf(hf, tmp_path / "plain")
    _write_fp8(plain, str(tmp_path / "fp8"))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight.*not aligned to the 128-row weight blocks"):
        _load(str(tmp_path / "fp8"), "fp8")
    assert _load(str(tmp_path / "fp8"), None) is not None  # dequantising still works
    assert _load(plain, "fp8") is not None  # quantising the stacked weight at load has no alignment need


def test_bad_quantization_settings_are_reported(dirs, tmp_path):
    plain, fp8_dir, _ = dirs
    cfg = DeepseekModelConfig.from_pretrained(plain)
    with pytest.raises(QuantizationError, match=r"quantization='int4' is not supported"):
        build_model(cfg, get_backend("cpu"), torch.float32, quantization="int4")
    raw = json.loads(open(os.path.join(fp8_dir, "config.json")).read())
    raw["quantization_config"]["weight_block_size"] = [64, 64]
    with pytest.raises(QuantizationError, match=r"weight_block_size is \[64, 64\]; the FP8 ops take \[128, 128\]"):
        build_model(DeepseekModelConfig.from_dict(raw), get_backend("cpu"), torch.float32, quantization="fp8")
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ConfigError, match=r"quant_method` is 'gptq'; only 'fp8' is supported"):
        DeepseekModelConfig.from_dict(raw)
