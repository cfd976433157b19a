"""DFlash drafter (deepinfer_npu/spec/dflash.py): format, ring semantics, capture/propose, training script.

A tiny random reference-architecture target (examples/reference_model, exported in the checkpoint layout the engine
loads) stands in for the shipped model; the trained-weights smoke test uses the shipped files when present."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer_npu.config import REFERENCE_MODEL_DIR
from deepinfer_npu.hal import get_backend
from deepinfer_npu.model_executor import DeepseekModelConfig, build_model, load_weights
from deepinfer_npu.spec.dflash import DFlashDrafter, save_dflash
from deepinfer_npu.spec.dflash_config import DFlashConfig
from deepinfer_npu.spec.dflash_model import DFlashModel
from examples import train_dflash
from examples.reference_model.model import DeepseekV3Ref, RefConfig, export_state_dict
from tests.reference_assets import needs_dflash

SHIPPED_TARGET = REFERENCE_MODEL_DIR
SHIPPED_DFLASH = SHIPPED_TARGET / "dflash"

K = 5
W = 8
LAYER_IDS = [0, 2]


# ---- fixtures ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    cfg = RefConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        max_position_embeddings=512,
        initializer_range=0.2,
    )
    model = DeepseekV3Ref(cfg)
    model.init_weights(0)
    d = tmp_path_factory.mktemp("tiny_target")
    save_file(export_state_dict(model), str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg.hf_config()))
    return d


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    cfg = DeepseekModelConfig.from_pretrained(str(tiny_target_dir))
    model = build_model(cfg, get_backend("cpu"), torch.float32)
    load_weights(model, str(tiny_target_dir))
    return model


def _dflash_cfg(target, **kw) -> DFlashConfig:
    tc = target.config
    args = dict(
        target_layer_ids=LAYER_IDS,
        hidden_size=tc.hidden_size,
        vocab_size=tc.vocab_size,
        num_layers=2,
        num_heads=2,
        head_dim=16,
        intermediate_size=48,
        window=W,
        num_speculative_tokens=K,
        noise_token_id=2,
        markov_rank=8,
        rope_theta=10000.0,
    )
    args.update(kw)
    return DFlashConfig.make(**args)


def _random_weights(cfg: DFlashConfig, target, seed: int = 0) -> dict[str, torch.Tensor]:
    m = DFlashModel(cfg, target.model.embed_tokens.weight, target.lm_head.weight)
    m.init_weights(seed, std=0.3)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-trivial Markov / confidence / norms so every piece shows in the outputs
        m.markov_w2.copy_(torch.randn(m.markov_w2.shape, generator=g) * 0.3)
        m.confidence.weight.copy_(torch.randn(m.confidence.weight.shape, generator=g) * 0.3)
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _drafter(target, slots: int = 6, seed: int = 0, **kw) -> DFlashDrafter:
    cfg = _dflash_cfg(target, **kw)
    return DFlashDrafter(
        cfg,
        _random_weights(cfg, target, seed),
        target.model.embed_tokens.weight,
        target.lm_head.weight,
        slots,
        rms_norm=target.backend.kernels.rms_norm,
    )


def _hidden(target, n: int, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(n, target.config.hidden_size, generator=g) for i in LAYER_IDS}


def _capture_range(dr: DFlashDrafter, slot: int, lo: int, hi: int, seed: int, scale: float = 1.0):
    n = hi - lo
    hid = {i: h * scale for i, h in _hidden_target_free(dr, n, seed).items()}
    dr.capture(hid, torch.arange(lo, hi), torch.full((n,), slot))
    return hid


def _hidden_target_free(dr: DFlashDrafter, n: int, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(n, dr.cfg.hidden_size, generator=g) for i in dr.target_layer_ids}


# ---- config / format ---------------------------------------------------------------------------------------------
def test_config_rules_and_roundtrip(tmp_path, tiny_target):
    cfg = _dflash_cfg(tiny_target)
    assert cfg.max_backtrack == K + 1 and cfg.ring_size == W + K + 1
    cfg.save(tmp_path)
    again = DFlashConfig.from_pretrained(tmp_path)
    assert again.to_dict() == cfg.to_dict()
    with pytest.raises(ValueError, match="max_backtrack"):
        _dflash_cfg(tiny_target, max_backtrack=K)
    with pytest.raises(ValueError, match="ring_size"):
        _dflash_cfg(tiny_target, max_backtrack=K + 1, ring_size=W + K)
    with pytest.raises(ValueError, match="noise_token_id"):
        _dflash_cfg(tiny_target, noise_token_id=10_000)
    with pytest.raises(FileNotFoundError):
        DFlashConfig.from_pretrained(tmp_path / "nope")


def test_save_load_roundtrip(tmp_path, tiny_target):
    cfg = _dflash_cfg(tiny_target)
    m = DFlashModel(cfg, tiny_target.model.embed_tokens.weight, tiny_target.lm_head.weight)
    m.init_weights(3)
    save_dflash(tmp_path, cfg, m)
    dr = DFlashDrafter.from_pretrained(tmp_path, tiny_target, num_state_slots=3)
    assert set(dr.model.state_dict()) == set(m.state_dict())
    assert "embed_weight" not in dr.model.state_dict()
    for k, v in m.state_dict().items():
        torch.testing.assert_close(dr.model.state_dict()[k], v.to(torch.bfloat16).float())
    bad = _dflash_cfg(tiny_target, target_layer_ids=[0, 7])
    bad.save(tmp_path)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashDrafter.from_pretrained(tmp_path, tiny_target, num_state_slots=3)


# ---- capture / propose -------------------------------------------------------------------------------------------
def test_shapes_dtypes(tiny_target):
    dr = _drafter(tiny_target, slots=5)
    assert tuple(dr.ring.shape) == (5, W + K + 1, 2, 2, 2, 16)
    _capture_range(dr, 1, 0, 20, seed=0)
    _capture_range(dr, 3, 0, 4, seed=1)
    drafts, conf = dr.propose(torch.tensor([5, 9]), torch.tensor([20, 4]), torch.tensor([1, 3]))
    assert drafts.shape == (2, K) and drafts.dtype == torch.int64
    assert conf.shape == (2, K) and conf.dtype == torch.float32
    assert bool(((drafts >= 0) & (drafts < tiny_target.config.vocab_size)).all())
    assert bool(((conf > 0) & (conf < 1)).all())


def test_batched_equals_single_rows(tiny_target):
    dr = _drafter(tiny_target, slots=5)
    for s, n in ((1, 30), (2, 3), (4, 11)):
        _capture_range(dr, s, 0, n, seed=s)
    gold, pos, slots = torch.tensor([7, 8, 9]), torch.tensor([30, 3, 11]), torch.tensor([1, 2, 4])
    d_all, c_all = dr.propose(gold, pos, slots)
    for r in range(3):
        d, c = dr.propose(gold[r : r + 1], pos[r : r + 1], slots[r : r + 1])
        assert torch.equal(d[0], d_all[r])
        torch.testing.assert_close(c[0], c_all[r])


def test_markov_chain_uses_previous_draft(tiny_target):
    """draft_{j+1} = argmax(base_j + markov(prev_j)) with prev_0 = golden and prev_j = draft_j."""
    dr = _drafter(tiny_target)
    _capture_range(dr, 1, 0, 12, seed=4)
    golden, pos, slot = torch.tensor([17]), torch.tensor([12]), torch.tensor([1])
    drafts, conf = dr.propose(golden, pos, slot)
    m = dr.model
    tokens, bpos = m.block_inputs(golden, pos, K, dr.cfg.noise_token_id)
    h = m.block_hidden(tokens, bpos, dr.ring[slot], dr.context_mask(pos))
    prev = torch.cat([golden, drafts[0, :-1]])
    e = m.markov_embed(prev)
    expect = (m.base_logits(h[0]) + m.markov_correction(e)).argmax(-1)
    assert torch.equal(expect, drafts[0])
    torch.testing.assert_close(torch.sigmoid(m.confidence_logit(h[0], e)), conf[0])


def test_ring_index_interpretation():
    """context_mask marks exactly the ring cells holding positions max(0, P-W)..P-1."""
    cfg = DFlashConfig.make(
        target_layer_ids=[0], hidden_size=8, vocab_size=16, num_heads=1, head_dim=4, window=W, num_speculative_tokens=K
    )
    dr = DFlashDrafter(
        cfg,
        {k: v for k, v in DFlashModel(cfg, torch.zeros(16, 8), torch.zeros(16, 8)).state_dict().items()},
        torch.zeros(16, 8),
        torch.zeros(16, 8),
        2,
    )
    r = cfg.ring_size
    for p in range(0, 3 * r):
        mask = dr.context_mask(torch.tensor([p]))[0]
        want = torch.zeros(r, dtype=torch.bool)
        for q in range(max(0, p - W), p):
            want[q % r] = True
        assert torch.equal(mask, want), p


@pytest.mark.parametrize("accepted", list(range(K + 1)))
def test_rejected_writes_never_clobber_the_window(tiny_target, accepted):
    """Adversarial: a verify step writes golden + K drafts at P0..P0+K (the rejected ones with huge garbage
    hiddens); after `accepted` drafts the next read is at P = P0 + accepted + 1 and must equal a read from a ring
    that only ever saw the accepted prefix. Repeated for several consecutive steps so the ring wraps."""
    clean = _drafter(tiny_target, slots=3)
    dirty = _drafter(tiny_target, slots=3)
    n0 = 3 * W + 1
    for dr in (clean, dirty):
        _capture_range(dr, 2, 0, n0, seed=7)
    p0 = n0  # golden position of the first verify step
    for step in range(4 * (W + K + 1) // (accepted + 1) + 2):
        hid = _hidden_target_free(dirty, K + 1, seed=100 + step)
        good = accepted + 1  # golden + accepted drafts are real positions
        garbage = {i: h.clone() for i, h in hid.items()}
        for i in garbage:
            garbage[i][good:] = 1e3 * torch.randn_like(garbage[i][good:])
        dirty.capture(garbage, torch.arange(p0, p0 + K + 1), torch.full((K + 1,), 2))
        # same batch shape (so the same GEMM arithmetic per row); the rejected rows go to dummy slot 0 instead
        slots = torch.tensor([2] * good + [0] * (K + 1 - good))
        clean.capture(garbage, torch.arange(p0, p0 + K + 1), slots)
        p = p0 + good
        dc, cc = clean.propose(torch.tensor([5]), torch.tensor([p]), torch.tensor([2]))
        dd, cd = dirty.propose(torch.tensor([5]), torch.tensor([p]), torch.tensor([2]))
        assert torch.equal(dc, dd), (step, p)
        torch.testing.assert_close(cc, cd, rtol=0, atol=0)
        p0 = p


def test_too_small_ring_would_clobber(tiny_target):
    """The same scenario with ring_size = W + K - 1 (bypassing the config rule) does change the read: the
    previous test has the power to fail."""
    clean = _drafter(tiny_target, slots=3)
    dirty = _drafter(tiny_target, slots=3)
    for dr in (clean, dirty):  # shrink the ring behind the config's back
        dr.cfg.ring_size = W + K - 1
        dr.ring = torch.zeros(3, W + K - 1, *dr.ring.shape[2:])
        dr._ring_offsets = torch.arange(W + K - 1)
    for dr in (clean, dirty):
        _capture_range(dr, 1, 0, 20, seed=7)
    hid = _hidden_target_free(dirty, K + 1, seed=5)
    garbage = {i: torch.cat([h[:1], 1e3 * torch.randn_like(h[1:])]) for i, h in hid.items()}
    dirty.capture(garbage, torch.arange(20, 20 + K + 1), torch.full((K + 1,), 1))
    clean.capture({i: h[:1] for i, h in hid.items()}, torch.arange(20, 21), torch.full((1,), 1))
    _, cc = clean.propose(torch.tensor([5]), torch.tensor([21]), torch.tensor([1]))
    _, cd = dirty.propose(torch.tensor([5]), torch.tensor([21]), torch.tensor([1]))
    assert not torch.allclose(cc, cd)


def test_reads_only_positions_below_P(tiny_target):
    dr = _drafter(tiny_target, slots=3)
    p = 2 * W + 5
    _capture_range(dr, 1, 0, p, seed=3)
    ref = dr.propose(torch.tensor([9]), torch.tensor([p]), torch.tensor([1]))
    # 1) captures at positions >= P (as a verify step with rejected drafts would write), as many as fit
    r = dr.cfg.ring_size
    _capture_range(dr, 1, p, p + (r - W), seed=11, scale=50.0)
    got = dr.propose(torch.tensor([9]), torch.tensor([p]), torch.tensor([1]))
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    # 2) any ring cell outside the window holds garbage; other slots too
    mask = dr.context_mask(torch.tensor([p]))[0]
    dr.ring[1, ~mask] = 1e4
    dr.ring[0] = -1e4
    dr.ring[2] = 1e4
    got = dr.propose(torch.tensor([9]), torch.tensor([p]), torch.tensor([1]))
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    # 3) but the window itself matters
    dr.ring[1, mask] += 1.0
    got = dr.propose(torch.tensor([9]), torch.tensor([p]), torch.tensor([1]))
    assert not torch.equal(ref[1], got[1])


def test_long_capture_keeps_newest_positions(tiny_target):
    """A prefill chunk longer than the ring: each cell ends with its newest position whatever the write order."""
    a = _drafter(tiny_target, slots=3)
    b = _drafter(tiny_target, slots=3)
    n = 3 * a.cfg.ring_size + 4
    hid = _hidden_target_free(a, n, seed=2)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    a.capture({i: h[perm] for i, h in hid.items()}, torch.arange(n)[perm], torch.full((n,), 1))
    last = n - a.cfg.ring_size
    b.capture({i: h[last:] for i, h in hid.items()}, torch.arange(last, n), torch.full((n - last,), 1))
    assert torch.equal(a.ring, b.ring)


def test_zero_and_clone_slots(tiny_target):
    dr = _drafter(tiny_target, slots=4)
    _capture_range(dr, 1, 0, 30, seed=1)
    _capture_range(dr, 2, 0, 30, seed=2)
    before = dr.propose(torch.tensor([3]), torch.tensor([30]), torch.tensor([1]))
    dr.clone_slots(torch.tensor([[1, 3]]))
    assert torch.equal(dr.ring[3], dr.ring[1])
    after = dr.propose(torch.tensor([3]), torch.tensor([30]), torch.tensor([3]))
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    dr.zero_slots(torch.tensor([1, 3]))
    assert not dr.ring[1].any() and not dr.ring[3].any() and dr.ring[2].any()


# ---- training path == inference path -----------------------------------------------------------------------------
def test_training_forward_matches_inference(tiny_target_dir, tiny_target):
    """The training script's dense forward (context gathered from one full target pass) equals the inference
    path (paged target forward in two chunks with capture into the ring, then propose)."""

    dr = _drafter(tiny_target, slots=3)
    ft = train_dflash.FrozenTarget(tiny_target_dir, torch.device("cpu"), LAYER_IDS)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    caps, _, _ = ft.full(ids)
    p = 31
    anchors = torch.tensor([[p, 5]])
    prev = torch.cat([ids[:, [p, 5]].T, torch.randint(3, 128, (2, K - 1))], 1)
    h_dense, _, _ = train_dflash.drafter_outputs(dr.model, dr.cfg, caps, ids, anchors, prev)
    pt = train_dflash.PagedTarget(tiny_target, 16)
    toks = ids[0].tolist()
    for lo, hi in ((0, 20), (20, p)):
        _, c, pos = pt.forward([(0, toks[lo:hi], lo)], LAYER_IDS)
        dr.capture(c, pos, torch.full((hi - lo,), 2))
    pos = torch.tensor([p])
    tokens, bpos = dr.model.block_inputs(ids[0, [p]], pos, K, dr.cfg.noise_token_id)
    h_ring = dr.model.block_hidden(tokens, bpos, dr.ring[torch.tensor([2])], dr.context_mask(pos))
    torch.testing.assert_close(h_ring[0], h_dense[0], rtol=1e-4, atol=1e-4)


def test_greedy_continuation_labels(tiny_target_dir):
    """The batched continuation (prefix K/V + per-anchor blocks) equals plain greedy decoding from x_0..x_P."""

    ft = train_dflash.FrozenTarget(tiny_target_dir, torch.device("cpu"), LAYER_IDS)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    _, logits, kvs = ft.full(ids)
    rows, anc = torch.tensor([0, 1, 1]), torch.tensor([3, 10, 22])
    toks, _ = ft.continue_greedy(kvs, rows, anc, logits[rows, anc].argmax(-1), K)
    for r in range(3):
        seq = ids[rows[r], : anc[r] + 1].tolist()
        for _ in range(K):
            h, _, _ = ft.ref.forward_main(torch.tensor([seq]))
            seq.append(int(ft.ref.logits(h[0, -1]).argmax()))
        assert toks[r].tolist() == seq[-K:]


# ---- training script ---------------------------------------------------------------------------------------------
def test_training_script_runs(tmp_path, tiny_target_dir):

    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train.npy", 4000), ("heldout.npy", 1200)):
        arr = rng.integers(3, 128, n).astype(np.uint16)
        arr[::200] = 0  # document starts
        np.save(data / name, arr)
    out = tmp_path / "out"
    argv = [
        "--stage",
        "all",
        "--target",
        str(tiny_target_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--steps",
        "3",
        "--batch-rows",
        "2",
        "--seq-len",
        "48",
        "--anchors",
        "3",
        "--self-gen-seqs",
        "2",
        "--self-gen-prompt",
        "16",
        "--eval-every",
        "3",
        "--log-every",
        "1",
        "--target-layer-ids",
        "0,2",
        "--num-layers",
        "1",
        "--num-heads",
        "2",
        "--head-dim",
        "16",
        "--intermediate-size",
        "32",
        "--window",
        "8",
        "--markov-rank",
        "4",
        "--eval-prompts",
        "2",
        "--eval-prompt-len",
        "20",
        "--eval-new-tokens",
        "12",
    ]
    assert train_dflash.main(argv) == 0
    cfg = json.loads((out / "dflash_config.json").read_text())
    assert cfg["window"] == 8 and cfg["target_layer_ids"] == [0, 2] and cfg["training"]["steps_run"] == 3
    ev = json.loads((out / "eval.json").read_text())
    assert ev["verify_steps"] > 0 and 1.0 <= ev["mean_accepted_length"] <= K + 1
    assert all(ev["lossless_check"]["identical_to_plain_greedy"])
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["event"] == "done" and log[-1]["steps_run"] == 3


# ---- shipped weights ---------------------------------------------------------------------------------------------
PROMPT = '''import os


def walk_files(root, suffix=".py"):
    """Yield the paths of the files under root whose name ends with suffix."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            if name.endswith(suffix):
'''


@needs_dflash
def test_shipped_weights_accept(tmp_path):
    from tokenizers import Tokenizer

    target = train_dflash.load_engine_target(SHIPPED_TARGET)
    dr = DFlashDrafter.from_pretrained(SHIPPED_DFLASH, target, num_state_slots=2)
    tok = Tokenizer.from_file(str(SHIPPED_TARGET / "tokenizer.json"))
    ids = tok.encode(PROMPT).ids
    res = train_dflash.simulate(target, dr, [ids], new_tokens=48, eos=target.config.eos_token_id, with_baseline=1)
    assert all(res["lossless_check"]["identical_to_plain_greedy"])
    assert res["mean_accepted_length"] >= 1.5, res
    assert res["per_position_acceptance"][0] >= 0.4, res


def test_no_host_reads_in_capture_and_propose(tiny_target, monkeypatch):
    """capture / propose never read device values on the host (no .item() / .tolist() / bool() / int() / numpy),
    so they stay sync-free on device backends and capturable in graphs."""
    dr = _drafter(tiny_target, slots=4)
    hid = _hidden_target_free(dr, 12, seed=0)
    pos, slots = torch.arange(12), torch.full((12,), 1)

    def boom(*_a, **_k):
        raise AssertionError("host read of a tensor value")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    dr.capture(hid, pos, slots)
    drafts, conf = dr.propose(torch.tensor([3, 4]), torch.tensor([12, 12]), torch.tensor([1, 1]))
    dr.zero_slots(torch.tensor([2]))
    dr.clone_slots(torch.tensor([[1, 3]]))
    monkeypatch.undo()
    assert drafts.shape == (2, K)


def test_drafter_contract_adapters(tmp_path, tiny_target):
    """The spec/drafter.py contract spellings: load(), on_main_forward(), propose(DraftContext),
    clone_slots(src, dst), capture_layer_ids, and a k below the trained block length."""
    from deepinfer_npu.model_executor import build_attention_metadata
    from deepinfer_npu.spec.drafter import DraftContext, Drafter

    cfg = _dflash_cfg(tiny_target)
    m = DFlashModel(cfg, tiny_target.model.embed_tokens.weight, tiny_target.lm_head.weight)
    m.load_state_dict(_random_weights(cfg, tiny_target))
    save_dflash(tmp_path, cfg, m)
    full = DFlashDrafter.load(tmp_path, tiny_target, tiny_target.backend, num_state_slots=4)
    short = DFlashDrafter.load(tmp_path, tiny_target, tiny_target.backend, num_state_slots=4, num_speculative_tokens=3)
    assert isinstance(full, Drafter) and full.capture_layer_ids == tuple(LAYER_IDS)
    assert full.num_speculative_tokens == K and short.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        DFlashDrafter.load(tmp_path, tiny_target, num_state_slots=4, num_speculative_tokens=K + 1)
    attn = build_attention_metadata([7, 4], [7, 4], [[1], [2]], 16)
    hid = _hidden_target_free(full, 11, seed=3)
    slots_per_token = torch.tensor([1] * 7 + [2] * 4)
    for dr in (full, short):
        dr.on_main_forward(attn, hid, slots_per_token)
    ctx = DraftContext(
        attn=attn,
        hidden=torch.zeros(11, 32),
        target_tokens=torch.zeros(11, dtype=torch.int64),
        anchor_rows=torch.tensor([6, 10]),
        bonus_tokens=torch.tensor([9, 4]),
        bonus_positions=torch.tensor([7, 4]),
        slots=torch.tensor([1, 2]),
    )
    d_full, c_full = full.propose(ctx)
    d_short, c_short = short.propose(ctx)
    d_expl, _ = full.propose(torch.tensor([9, 4]), torch.tensor([7, 4]), torch.tensor([1, 2]))
    assert torch.equal(d_full, d_expl)
    assert d_short.shape == (2, 3) and torch.equal(d_short, d_full[:, :3])
    torch.testing.assert_close(c_short, c_full[:, :3])
    full.clone_slots(torch.tensor([1]), torch.tensor([3]))
    assert torch.equal(full.ring[3], full.ring[1])
