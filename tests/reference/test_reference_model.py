"""The shipped reference model (deepinfer_npu/assets/reference/): files, HF layout, MTP tensors, and
held-out loss recomputed by Hugging Face transformers (test-only dependency) on a small fixed slice."""

from __future__ import annotations

import json

import pytest

from deepinfer_npu.config import REFERENCE_MODEL_DIR as REF
REQUIRED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "MODEL_CARD.md",
    "heldout_check.json",
)


def _config() -> dict:
    return json.loads((REF / "config.json").read_text())


def _check() -> dict:
    return json.loads((REF / "heldout_check.json").read_text())


def test_files_present_and_small():
    for f in REQUIRED:
        assert (REF / f).is_file(), f
    total = sum(p.stat().st_size for p in REF.rglob("*") if p.is_file())
    assert total < 10_000_000, f"reference assets are {total} bytes"


def test_config_is_deepseek_v3_with_one_mtp_layer():
    cfg = _config()
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert cfg["q_lora_rank"] and cfg["n_shared_experts"] >= 1 and cfg["first_k_dense_replace"] >= 1
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0
    assert cfg["tie_word_embeddings"] is False
    gen = json.loads((REF / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"] and gen["bos_token_id"] == cfg["bos_token_id"]


def test_safetensors_hold_main_and_mtp_tensors():
    from safetensors import safe_open

    cfg = _config()
    n, e = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    with safe_open(str(REF / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor(f"model.layers.{n - 1}.mlp.gate.e_score_correction_bias")
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # dense first layer
    mtp = f"model.layers.{n}."
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "self_attn.q_a_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.down_proj.weight",
    ):
        assert mtp + name in keys, mtp + name
    for i in range(e):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"{mtp}mlp.experts.{i}.{proj}.weight" in keys
    # embedding and output head are shared with the main model, not stored again for the MTP layer
    assert mtp + "embed_tokens.weight" not in keys and mtp + "shared_head.head.weight" not in keys
    assert not any(k.startswith(f"model.layers.{n + 1}.") for k in keys)
    assert bias.abs().sum() > 0  # the aux-loss-free balancing bias was trained


def test_tokenizer_round_trip_and_special_ids():
    from tokenizers import Tokenizer

    cfg = _config()
    tok = Tokenizer.from_file(str(REF / "tokenizer.json"))
    tcfg = json.loads((REF / "tokenizer_config.json").read_text())
    assert tok.token_to_id(tcfg["bos_token"]) == cfg["bos_token_id"]
    assert tok.token_to_id(tcfg["eos_token"]) == cfg["eos_token_id"]
    assert tok.get_vocab_size() == cfg["vocab_size"]
    text = "def f(x):\n    return {'a': x ** 2}  # ünïcode\n"
    ids = tok.encode(text).ids
    assert ids[0] == cfg["bos_token_id"]
    assert tok.decode(ids, skip_special_tokens=True) == text


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("transformers without DeepseekV3ForCausalLM")
    transformers.logging.set_verbosity_error()
    return transformers.DeepseekV3ForCausalLM.from_pretrained(str(REF), dtype=torch.float32).eval()


def test_transformers_heldout_loss_matches_model_card(hf_model):
    import torch
    import torch.nn.functional as F

    chk = _check()
    ids = torch.tensor(chk["token_ids"])
    with torch.no_grad():
        logits = hf_model(ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].reshape(-1)).item()
    assert abs(loss - chk["expected_loss"]) <= chk["rel_tolerance"] * chk["expected_loss"], (loss, chk)
    card = (REF / "MODEL_CARD.md").read_text()
    assert f"{chk['expected_loss']:.4f}" in card and f"{chk['model_card_heldout_loss']:.4f}" in card


def test_transformers_greedy_matches_training_module(hf_model):
    import torch

    g = _check()["greedy"]
    expected = g["expected_new_ids"]
    eos = _config()["eos_token_id"]
    if eos in expected:
        expected = expected[: expected.index(eos) + 1]
    ids = torch.tensor([g["prompt_ids"]])
    out = hf_model.generate(ids, max_new_tokens=len(expected), do_sample=False)
    assert out[0, ids.shape[1] :].tolist() == expected


def _hf_mtp(hf_model):
    """transformers' generic MtpModel with the checkpoint's layer num_hidden_layers mapped in."""
    try:
        from transformers.modeling_layers import MtpModel  # noqa: F401
    except ImportError:
        pytest.skip("transformers without MtpModel")
    from examples.reference_model.evaluate import load_hf_mtp

    return load_hf_mtp(hf_model, REF)


def test_mtp_layer_loss_through_transformers_mtp_model(hf_model):
    """The MTP module (h_i after model.norm, token i+1 -> token i+2) computed by transformers' MtpModel."""
    import torch
    import torch.nn.functional as F

    chk = _check()
    mtp = _hf_mtp(hf_model)
    ids = torch.tensor(chk["token_ids"])
    with torch.no_grad():
        hidden = hf_model(ids[:, :-2], output_hidden_states=True).hidden_states[-1]
        pos = torch.arange(ids.shape[1] - 2).unsqueeze(0).expand(ids.shape[0], -1)
        h = mtp.forward_layer(0, hidden, pos, None, input_ids=ids[:, 1:-1])
        logits = mtp._project_to_logits(h)
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 2:].reshape(-1)).item()
    assert abs(loss - chk["expected_mtp_loss"]) <= 1e-3 * chk["expected_mtp_loss"], (
        loss,
        chk["expected_mtp_loss"],
    )
