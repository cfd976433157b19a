"""Weight loading: sharded checkpoints, FP8 block dequantisation, MTP layers, dummy weights, bf16, and
errors."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_npu.hal import get_backend
from deepinfer_npu.model_executor import (
    CheckpointError,
    DeepseekModelConfig,
    allocate_kv_caches,
    build_attention_metadata,
    build_model,
    load_weights,
)
from deepinfer_npu.model_executor.loader import dequantize_fp8_block

from .tiny_models import PagedRunner, hf_logits, load_ours, make_hf_model, max_rel_err, save_hf

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84]


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory):
    hf = make_hf_model("v2", q_lora_rank=24, num_hidden_layers=2, first_k_dense_replace=1)
    return hf, save_hf(hf, tmp_path_factory.mktemp("v2"))


@pytest.fixture
def v2_copy(v2_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(v2_dir[1], dst)
    return str(dst)


def _prefill_logits(model, tokens=PROMPT):
    return PagedRunner(model).step({0: tokens})


# ---- formats -----------------------------------------------------------------------------------------------
def test_sharded_checkpoint_with_index(v2_dir, tmp_path):
    hf, single = v2_dir
    sharded = save_hf(hf, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ours = load_ours(sharded)
    assert torch.equal(_prefill_logits(ours), _prefill_logits(load_ours(single)))
    assert max_rel_err(_prefill_logits(ours), hf_logits(hf, PROMPT)) <= 1e-4
    # An index naming a shard that is not there is reported with the shard's name.
    os.remove(os.path.join(sharded, sorted(set(index["weight_map"].values()))[-1]))
    with pytest.raises(CheckpointError, match=r"lists shard model-\d+-of-\d+\.safetensors, which is missing"):
        load_ours(sharded)


def _reference_dequant(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Tile-by-tile loop: the obviously-correct version of block dequantisation."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


def _quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = math.ceil(w.shape[0] / block), math.ceil(w.shape[1] / block)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).to(q.dtype)
    return q, scale


def test_dequantize_fp8_block_128():
    torch.manual_seed(0)
    q, scale = _quantize_fp8(torch.randn(300, 260), 128)
    assert scale.shape == (3, 3)
    torch.testing.assert_close(dequantize_fp8_block(q, scale, (128, 128)), _reference_dequant(q, scale, 128))


def test_fp8_checkpoint_dequantised_at_load(v2_copy, tmp_path):
    block = 16
    path = os.path.join(v2_copy, "model.safetensors")
    tensors = load_file(path)
    plain = dict(tensors)
    for name, w in list(tensors.items()):
        # Quantise every projection like DeepSeek-V3's FP8 release (norms, router, embedding and head stay).
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            q, scale = _quantize_fp8(w, block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            plain[name] = _reference_dequant(q, scale, block)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.loads(open(os.path.join(v2_copy, "config.json")).read())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    open(os.path.join(v2_copy, "config.json"), "w").write(json.dumps(cfg))
    ref_dir = tmp_path / "dequantised"
    shutil.copytree(v2_copy, ref_dir)
    save_file(plain, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})

    fp8_model, ref_model = load_ours(v2_copy), load_ours(str(ref_dir))
    assert fp8_model.model.layers[1].mlp.experts.w13.dtype == torch.float32
    ref_params = dict(ref_model.named_parameters())
    for name, p in fp8_model.named_parameters():
        assert torch.equal(p, ref_params[name]), name
    # A scale of the wrong tile count is reported.
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"o_proj\.weight_scale_inv.*shape \[1, 1\], expected \[4, 4\]"):
        load_ours(v2_copy)


# ---- MTP ---------------------------------------------------------------------------------------------------
def _mtp_tensors(hf, with_embed_and_head: bool, seed: int = 5):
    """Checkpoint tensors for MTP layer ``num_hidden_layers`` (a perturbed copy of HF's last layer plus the
    MTP extras), and that HF layer for the reference computation."""
    torch.manual_seed(seed)
    cfg = hf.config
    n, d, v = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    layer = copy.deepcopy(hf.model.layers[n - 1])
    sd = {}
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, t in layer.state_dict().items():
            if name == "mlp.experts.gate_up_proj":
                for e in range(t.shape[0]):
                    gate, up = t[e].chunk(2)
                    sd[f"mlp.experts.{e}.gate_proj.weight"], sd[f"mlp.experts.{e}.up_proj.weight"] = gate, up
            elif name == "mlp.experts.down_proj":
                for e in range(t.shape[0]):
                    sd[f"mlp.experts.{e}.down_proj.weight"] = t[e]
            else:
                sd[name] = t
    sd["enorm.weight"], sd["hnorm.weight"] = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    sd["eh_proj.weight"] = torch.randn(d, 2 * d) * 0.1
    sd["shared_head.norm.weight"] = torch.rand(d) + 0.5
    if with_embed_and_head:
        sd["embed_tokens.weight"] = torch.randn(v, d) * 0.2
        sd["shared_head.head.weight"] = torch.randn(v, d) * 0.2
    return {f"model.layers.{n}.{k}": t.contiguous().clone() for k, t in sd.items()}, layer


@pytest.fixture(scope="module")
def v3_hf():
    return make_hf_model(
        "v3", q_lora_rank=16, num_hidden_layers=2, first_k_dense_replace=1, n_group=2, topk_group=1
    )


@pytest.mark.parametrize("with_embed_and_head", [True, False])
def test_mtp_layer_loads_and_predicts(v3_hf, tmp_path, with_embed_and_head):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    hf = v3_hf
    path = save_hf(hf, tmp_path)
    mtp_sd, hf_layer = _mtp_tensors(hf, with_embed_and_head)
    save_file(mtp_sd, os.path.join(path, "mtp.safetensors"), metadata={"format": "pt"})
    ours = load_ours(path)
    n = hf.config.num_hidden_layers
    mtp = ours.mtp
    assert mtp is not None and mtp.num_layers == 1
    layer = ours.model.layers[n]
    assert torch.equal(layer.eh_proj.weight, mtp_sd[f"model.layers.{n}.eh_proj.weight"])
    if with_embed_and_head:
        assert torch.equal(layer.embed_tokens.weight, mtp_sd[f"model.layers.{n}.embed_tokens.weight"])
    else:  # small checkpoints omit them: the main model's embedding and head are shared
        assert layer.embed_tokens.weight is ours.model.embed_tokens.weight
        assert layer.shared_head.head.weight is ours.lm_head.weight

    # Reference: the MTP recipe written out with HF modules (decoder layer = perturbed HF layer).
    torch.manual_seed(1)
    t, d = 21, hf.config.hidden_size
    ids = torch.randint(0, hf.config.vocab_size, (t,))
    prev = torch.randn(t, d)
    pos = torch.arange(t)
    get = lambda k: mtp_sd.get(f"model.layers.{n}.{k}")  # noqa: E731
    embed_w = get("embed_tokens.weight") if with_embed_and_head else hf.model.embed_tokens.weight
    head_w = get("shared_head.head.weight") if with_embed_and_head else hf.lm_head.weight

    def norm(w):
        m = DeepseekV3RMSNorm(d, eps=hf.config.rms_norm_eps)
        m.weight.data.copy_(w)
        return m

    with torch.no_grad():
        x = torch.cat((norm(get("enorm.weight"))(embed_w[ids]), norm(get("hnorm.weight"))(prev)), -1)
        x = (x @ get("eh_proj.weight").T)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        h = hf_layer(x, attention_mask=mask, position_embeddings=hf.model.rotary_emb(x, pos[None]))[0]
        ref_logits = norm(get("shared_head.norm.weight"))(h) @ head_w.T

        cache = allocate_kv_caches(ours.config, 8, 16, torch.float32, num_layers=1)[0]
        attn = build_attention_metadata([t], [t], [[3, 5]], 16)
        hidden = mtp(ids, prev, attn.positions, attn, cache)
        logits = mtp.compute_logits(hidden)
    assert max_rel_err(hidden, h) <= 1e-4
    assert max_rel_err(logits, ref_logits) <= 1e-4


def test_partial_mtp_layer_is_a_missing_tensor(v3_hf, tmp_path):
    path = save_hf(v3_hf, tmp_path)
    mtp_sd, _ = _mtp_tensors(v3_hf, True)
    del mtp_sd["model.layers.2.eh_proj.weight"]
    save_file(mtp_sd, os.path.join(path, "mtp.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.eh_proj\.weight'"):
        load_ours(path)


def test_hf_saved_v3_without_mtp_weights_runs_without_mtp(v3_hf, tmp_path):
    ours = load_ours(save_hf(v3_hf, tmp_path))
    assert ours.mtp is None and len(ours.model.layers) == v3_hf.config.num_hidden_layers


# ---- dummy weights and bf16 --------------------------------------------------------------------------------
def test_dummy_weights_are_seeded(v2_dir):
    cfg = DeepseekModelConfig.from_pretrained(v2_dir[1])
    models = []
    for seed in (3, 3, 4):
        m = build_model(cfg, get_backend("cpu"), torch.float32)
        if seed == 3 and models:
            m.init_dummy_weights(seed=3)  # the model's shortcut gives the same weights
        else:
            load_weights(m, load_format="dummy", seed=seed)
        models.append(m)
    a, b, c = (dict(m.named_parameters()) for m in models)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.self_attn.o_proj.weight"], c["model.layers.0.self_attn.o_proj.weight"]
    )
    assert torch.isfinite(_prefill_logits(models[0])).all()


def test_dummy_router_weights_are_bf16_values_like_a_checkpoints(v2_dir):
    """The router is fp32 in the model; its dummy values are bf16-representable, as a checkpoint's (portable draws
    keep their float64 values)."""
    cfg = DeepseekModelConfig.from_pretrained(v2_dir[1])
    for load_format, bf16_valued in (("dummy", True), ("dummy_portable", False)):
        m = build_model(cfg, get_backend("cpu"), torch.float32)
        load_weights(m, load_format=load_format, seed=1)
        gate = m.model.layers[1].mlp.gate.weight
        assert gate.dtype == torch.float32 and gate.abs().max() > 0
        assert torch.equal(gate, gate.to(torch.bfloat16).float()) is bf16_valued
        attn = m.model.layers[1].self_attn.o_proj.weight  # every other matrix as drawn
        assert not torch.equal(attn, attn.to(torch.bfloat16).float())


def test_bfloat16_close_to_hf_fp32(v2_dir):
    hf, path = v2_dir
    ours = load_ours(path, dtype=torch.bfloat16)
    assert ours.model.layers[0].self_attn.w_uk.dtype == torch.bfloat16
    assert ours.model.layers[1].mlp.gate.weight.dtype == torch.float32  # router stays fp32
    runner = PagedRunner(ours)
    logits = runner.step({0: PROMPT})
    assert logits.dtype == torch.float32 and runner.kv_caches[0].dtype == torch.bfloat16
    assert max_rel_err(logits, hf_logits(hf, PROMPT)) <= 5e-2
    for _ in range(3):
        assert torch.isfinite(runner.step({0: [int(logits[-1].argmax())]})).all()


# ---- errors ------------------------------------------------------------------------------------------------
def _rewrite(model_dir: str, edit) -> str:
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def test_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_ours(str(tmp_path / "absent"))
    model = build_model(
        DeepseekModelConfig.from_dict(
            {
                "model_type": "deepseek_v2",
                "num_experts_per_tok": 2,
                "num_hidden_layers": 1,
                "hidden_size": 64,
                "num_attention_heads": 2,
                "n_routed_experts": 4,
                "vocab_size": 32,
                "intermediate_size": 32,
            }
        ),
        get_backend("cpu"),
    )
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_weights(model, tmp_path / "absent")


def test_missing_tensor_names_tensor_and_file(v2_copy):
    _rewrite(v2_copy, lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor 'model\.layers\.1\.self_attn\.o_proj\.weight' "
        r"\(expected in model\.safetensors",
    ):
        load_ours(v2_copy)


def test_unexpected_tensor_names_tensor_and_file(v2_copy):
    _rewrite(v2_copy, lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.zeros(2)}))
    with pytest.raises(
        CheckpointError,
        match=r"unexpected tensor 'model\.layers\.0\.self_attn\.bogus\.weight' "
        r"in .*model\.safetensors",
    ):
        load_ours(v2_copy)


def test_misshaped_tensor_names_tensor_file_and_shapes(v2_copy):
    _rewrite(v2_copy, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.norm\.weight' in .*model\.safetensors has shape \[63\], "
        r"expected \[64\]",
    ):
        load_ours(v2_copy)
    # Remapped tensors are checked too (kv_b_proj is split into W_UK / W_UV at load).
    _rewrite(
        v2_copy,
        lambda t: t.update(
            {
                "model.norm.weight": torch.ones(64),
                "model.layers.0.self_attn.kv_b_proj.weight": torch.ones(5, 32),
            }
        ),
    )
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight' .*shape \[5, 32\], expected \[128, 32\]"):
        load_ours(v2_copy)


def test_truncated_safetensors_names_file(v2_copy):
    path = os.path.join(v2_copy, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=r"model\.safetensors \(truncated or corrupt\?\)"):
        load_ours(v2_copy)
