#!/usr/bin/env python3
"""Train the DFlash parallel drafter (deepinfer_npu/spec/dflash.py) against a frozen target, and evaluate it.

Stages (``--stage``):
  train  frozen target (default: the embedded reference model) + its corpus train split -> ``<out>/dflash_config.json``
         + ``<out>/dflash.safetensors`` (bf16) + ``train_log.jsonl``; CPU or CUDA (bf16 autocast on CUDA)
  eval   ``<out>`` -> speculative-decoding simulation through the engine's paged target model (CPU backend) and
         ``DFlashDrafter`` (capture + propose) on held-out prompts: per-position greedy acceptance, mean accepted
         length (tokens per verify step, bonus included), confidence calibration -> ``<out>/eval.json``
  all    both

Training signal. Each step takes ``--batch-rows`` windows of ``--seq-len`` tokens (a ``--self-gen-frac`` share of
them from a pool of the target's own greedy continuations of training-text prompts, the distribution the drafter
sees while decoding; the rest plain training text) and runs the target once (captured layers, logits, per-layer
K/V). ``--anchors`` positions P per window are drawn; for each, the labels are the TARGET'S GREEDY continuation
y_1..y_k from x_0..x_P (y_1 = argmax at P from the full pass, y_2.. from k-1 incremental target steps over the
cached prefix keys, batched over all anchors) -- this directly optimises greedy acceptance. The drafter sees the
target hiddens of positions max(0, P-W)..P-1 and the block [x_P, noise x (k-1)] at positions P..P+k-1 (exactly
what ``DFlashDrafter.propose`` sees at inference), its Markov input is teacher-forced (prev_j = y_{j}, y_0 = x_P).
Loss = sum_j w_j CE(logits_j, y_{j+1}) (w_j = ``--pos-decay``^j) + ``--kl-weight`` * KL(target_j || draft_j)
+ ``--conf-weight`` * BCE(confidence_j, [argmax logits_j == y_{j+1}]) on detached features; with teacher forcing
the label is exactly "draft j correct given all previous drafts correct".

The target is read with ``examples/reference_model`` (the plain-torch twin of the reference checkpoint layout:
DeepSeek-V3 MLA/MoE in the exported per-expert naming); the corpus comes from
``examples/reference_model/corpus.py`` (``build_corpus``) when ``--data`` has no ``train.npy`` yet.

Run from the repository root. Example (the shipped drafter; the model card has the exact command and numbers)::

    python -m examples.train_dflash --stage train --target deepinfer_npu/assets/reference \\
        --data .carry_ref/data --out runs/dflash --device cuda --max-minutes 3
    python -m examples.train_dflash --stage eval --target deepinfer_npu/assets/reference \\
        --data .carry_ref/data --out runs/dflash
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer_npu.config import REFERENCE_MODEL_DIR as DEFAULT_TARGET
from deepinfer_npu.spec.dflash import save_dflash
from deepinfer_npu.spec.dflash_config import DFlashConfig
from deepinfer_npu.spec.dflash_model import DFlashModel
from examples.reference_model.model import load_ref_model, rope_cos_sin


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=["all", "train", "eval"], default="all")
    ap.add_argument("--target", type=Path, default=DEFAULT_TARGET, help="target model directory")
    ap.add_argument("--data", type=Path, default=None, help="corpus dir (train.npy, heldout.npy); built if absent")
    ap.add_argument("--out", type=Path, default=Path("runs/dflash"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    # drafter shape
    ap.add_argument("--target-layer-ids", default="1,2,3", help="comma-separated (negative = from the end)")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=48)
    ap.add_argument("--intermediate-size", type=int, default=512)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--markov-rank", type=int, default=32)
    ap.add_argument("--noise-token-id", type=int, default=None, help="default: the target's pad_token_id")
    # optimisation
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--max-minutes", type=float, default=0.0, help="stop after this wall time (0 = off)")
    ap.add_argument("--batch-rows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=16, help="anchor positions per window")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--pos-decay", type=float, default=0.8, help="CE weight of draft j is pos_decay**j")
    ap.add_argument("--kl-weight", type=float, default=0.5)
    ap.add_argument("--conf-weight", type=float, default=0.2)
    ap.add_argument("--self-gen-frac", type=float, default=0.5, help="share of windows from the self-generated pool")
    ap.add_argument("--self-gen-seqs", type=int, default=2048, help="pool size (0 = no self-generated data)")
    ap.add_argument("--self-gen-prompt", type=int, default=96, help="prompt tokens of each pool sequence")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=250)
    # eval
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--eval-prompt-len", type=int, default=96)
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    ap.add_argument("--eval-dtype", default="float32")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------------------------
def ensure_corpus(data: Path) -> None:
    if (data / "train.npy").exists() and (data / "heldout.npy").exists():
        return
    from examples.reference_model.corpus import build_corpus

    build_corpus(data)


# ----------------------------------------------------------------------------------------------------------------
# Frozen target (plain torch, batched): full pass with captures + per-layer K/V, and greedy continuation
# ----------------------------------------------------------------------------------------------------------------
class FrozenTarget:
    def __init__(self, model_dir: Path, device: torch.device, capture_ids: list[int]):
        self.ref = load_ref_model(model_dir).to(device).eval().requires_grad_(False)
        self.cfg = self.ref.cfg
        self.layers = list(self.ref.model.layers[: self.cfg.num_hidden_layers])
        self.capture_ids = capture_ids
        self.device = device

    @torch.no_grad()
    def full(self, ids: torch.Tensor):
        """ids [B, T] -> (captured {i: [B, T, D]}, logits [B, T, V] fp32, per-layer (K, V) [B, H, T, d])."""
        t = ids.shape[1]
        cos, sin = rope_cos_sin(self.cfg, torch.arange(t, device=ids.device))
        x = self.ref.model.embed_tokens(ids)
        caps, kvs = {}, []
        for i, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.self_attn.scaling)
            x = x + layer.self_attn.o_proj(o.transpose(1, 2).flatten(2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            kvs.append((k, v))
            if i in self.capture_ids:
                caps[i] = x
        return caps, self.ref.logits(self.ref.model.norm(x)).float(), kvs

    @torch.no_grad()
    def continue_greedy(self, kvs, rows: torch.Tensor, anchors: torch.Tensor, y1: torch.Tensor, n: int):
        """Greedy continuation after anchor P (prefix = row's positions 0..P, already in ``kvs``): y1 [N] is the
        token at P+1; returns (tokens [N, n] = y_1..y_n, logits [N, n-1, V] fp32 predicting y_2..y_n)."""
        cfg = self.cfg
        t = kvs[0][0].shape[2]
        prefix_ok = torch.arange(t, device=rows.device)[None, :] <= anchors[:, None]  # [N, T]
        pref = [(k[rows], v[rows]) for k, v in kvs]
        toks = y1[:, None]
        logits_out = []
        for j in range(1, n):
            pos = anchors[:, None] + 1 + torch.arange(j, device=rows.device)  # [N, j]
            cos, sin = rope_cos_sin(cfg, pos.reshape(-1))
            cos = cos.view(pos.shape[0], 1, j, -1)
            sin = sin.view(pos.shape[0], 1, j, -1)
            causal = torch.ones(j, j, dtype=torch.bool, device=rows.device).tril()
            mask = torch.cat(
                [prefix_ok[:, None, None, :].expand(-1, 1, j, t), causal[None, None].expand(pos.shape[0], 1, j, j)],
                dim=-1,
            )
            x = self.ref.model.embed_tokens(toks)
            for li, layer in enumerate(self.layers):
                q, kb, vb = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
                k = torch.cat([pref[li][0], kb], dim=2)
                v = torch.cat([pref[li][1], vb], dim=2)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.self_attn.scaling)
                x = x + layer.self_attn.o_proj(o.transpose(1, 2).flatten(2))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            lg = self.ref.logits(self.ref.model.norm(x[:, -1])).float()
            logits_out.append(lg)
            toks = torch.cat([toks, lg.argmax(-1, keepdim=True)], dim=1)
        lgs = torch.stack(logits_out, 1) if logits_out else torch.zeros(len(rows), 0, cfg.vocab_size)
        return toks, lgs

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, total_len: int, amp: bool) -> torch.Tensor:
        """Greedy continuation of prompts [B, p] to [B, total_len] (full recompute per token; tiny model)."""
        seq = prompts
        while seq.shape[1] < total_len:
            with torch.autocast(device_type=seq.device.type, dtype=torch.bfloat16, enabled=amp):
                h, _, _ = self.ref.forward_main(seq)
                nxt = self.ref.logits(h[:, -1]).float().argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        return seq


# ----------------------------------------------------------------------------------------------------------------
# Drafter training step
# ----------------------------------------------------------------------------------------------------------------
def drafter_outputs(
    model: DFlashModel, cfg: DFlashConfig, caps: dict, ids: torch.Tensor, anchors: torch.Tensor, prev: torch.Tensor
):
    """caps {i: [B, T, D]}, ids [B, T], anchors [B, M], prev [N, k] (Markov inputs, teacher-forced) ->
    (h [N, k, D], logits [N, k, V] fp32, markov embeddings [N, k, r])."""
    b, t = ids.shape
    w, k = cfg.window, cfg.num_speculative_tokens
    pos = torch.arange(t, device=ids.device)
    c = model.context([caps[i] for i in cfg.target_layer_ids])  # [B, T, D]
    kv = model.context_kv(c, pos.expand(b, t))  # [B, T, L, 2, H, hd]
    idx = anchors[..., None] - w + torch.arange(w, device=ids.device)  # [B, M, W]
    valid = idx >= 0
    bidx = torch.arange(b, device=ids.device)[:, None, None].expand_as(idx)
    ctx = kv[bidx, idx.clamp(min=0)].flatten(0, 1)  # [N, W, L, 2, H, hd]
    golden = ids.gather(1, anchors).reshape(-1)
    tokens, bpos = model.block_inputs(golden, anchors.reshape(-1), k, cfg.noise_token_id)
    h = model.block_hidden(tokens, bpos, ctx, valid.flatten(0, 1))
    e = model.markov_embed(prev)
    logits = model.base_logits(h) + model.markov_correction(e)
    return h, logits, e


def make_batch(target: FrozenTarget, ids: torch.Tensor, m: int, k: int, gen: torch.Generator):
    """ids [B, T] -> anchors [B, M], labels y [N, k], target logits [N, k, V], captures."""
    b, t = ids.shape
    caps, logits, kvs = target.full(ids)
    anchors = torch.stack([torch.randperm(t - 1, generator=gen)[:m] + 1 for _ in range(b)]).to(ids.device)
    rows = torch.arange(b, device=ids.device)[:, None].expand(b, m).reshape(-1)
    a = anchors.reshape(-1)
    lg1 = logits[rows, a]  # [N, V] predicts P+1
    y, lg_rest = target.continue_greedy(kvs, rows, a, lg1.argmax(-1), k)
    tlogits = torch.cat([lg1[:, None], lg_rest], dim=1)
    return caps, anchors, y, tlogits


def loss_terms(model, cfg, caps, ids, anchors, y, tlogits, a):
    k = cfg.num_speculative_tokens
    golden = ids.gather(1, anchors).reshape(-1, 1)
    prev = torch.cat([golden, y[:, : k - 1]], dim=1)
    h, logits, e = drafter_outputs(model, cfg, caps, ids, anchors, prev)
    v = logits.shape[-1]
    wpos = a.pos_decay ** torch.arange(k, device=ids.device, dtype=torch.float32)
    ce = F.cross_entropy(logits.reshape(-1, v), y.reshape(-1), reduction="none").view(-1, k).mean(0)
    logp = F.log_softmax(logits, -1)
    tp = F.softmax(tlogits, -1)
    kl = (tp * (torch.log(tp.clamp_min(1e-20)) - logp)).sum(-1).mean(0)
    correct = (logits.detach().argmax(-1) == y).float()
    conf_logit = model.confidence_logit(h.detach(), e.detach())
    bce = F.binary_cross_entropy_with_logits(conf_logit, correct, reduction="none").mean(0)
    total = (wpos * (ce + a.kl_weight * kl)).sum() / wpos.sum() + a.conf_weight * bce.sum()
    return total, ce, correct, torch.sigmoid(conf_logit)


@torch.no_grad()
def dense_eval(model, cfg, target, windows: torch.Tensor, a, amp: bool, batch: int = 16, anchors: int = 24) -> dict:
    """Teacher-forced greedy acceptance on held-out windows (the same anchors every time; monitoring only)."""
    model.eval()
    k = cfg.num_speculative_tokens
    gen = torch.Generator().manual_seed(1234)
    correct_all, conf_all = [], []
    for i in range(0, len(windows), batch):
        ids = windows[i : i + batch]
        with torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16, enabled=amp):
            caps, anc, y, tl = make_batch(target, ids, anchors, k, gen)
            _, _, correct, conf = loss_terms(model, cfg, caps, ids, anc, y, tl, a)
        correct_all.append(correct.float().cpu())
        conf_all.append(conf.float().cpu())
    model.train()
    c = torch.cat(correct_all)
    cp = torch.cumprod(c, dim=1)
    return {
        "tf_acc_per_pos": [round(float(x), 4) for x in c.mean(0)],
        "tf_cond_acc_per_pos": [
            round(float(cp[:, j].sum() / max(1.0, float(cp[:, j - 1].sum() if j else len(cp)))), 4) for j in range(k)
        ],
        "tf_mean_accepted_length": round(float(1 + cp.sum(1).mean()), 4),
        "tf_mean_conf_per_pos": [round(float(x), 4) for x in torch.cat(conf_all).mean(0)],
    }


def lr_at(step: int, progress: float, a) -> float:
    """Linear warmup over ``--warmup`` steps, then cosine to ``min_lr_ratio`` over ``progress`` in [0, 1] (the
    larger of step / steps and elapsed / time budget, so a ``--max-minutes`` run still anneals fully)."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _sha256(path: Path) -> str | None:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def build_config(a, tcfg: dict) -> DFlashConfig:
    n = tcfg["num_hidden_layers"]
    ids = [int(x) for x in a.target_layer_ids.split(",") if x.strip()]
    ids = sorted({i % n for i in ids})
    noise = a.noise_token_id
    if noise is None:
        noise = tcfg.get("pad_token_id")
        if noise is None:
            noise = tcfg.get("eos_token_id", 0)
    return DFlashConfig.make(
        target_layer_ids=ids,
        hidden_size=tcfg["hidden_size"],
        vocab_size=tcfg["vocab_size"],
        num_layers=a.num_layers,
        num_heads=a.num_heads,
        head_dim=a.head_dim,
        intermediate_size=a.intermediate_size,
        window=a.window,
        num_speculative_tokens=a.k,
        noise_token_id=int(noise),
        markov_rank=a.markov_rank,
        rope_theta=float(tcfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(tcfg.get("rms_norm_eps", 1e-6)),
    )


def train(a) -> dict:
    dev = torch.device(a.device)
    amp = dev.type == "cuda"
    torch.manual_seed(a.seed)
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
    tcfg = json.loads((a.target / "config.json").read_text())
    cfg = build_config(a, tcfg)
    target = FrozenTarget(a.target, dev, cfg.target_layer_ids)
    model = DFlashModel(cfg, target.ref.model.embed_tokens.weight, target.ref.lm_head.weight)
    model.init_weights(a.seed)
    model.to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())

    train_ids = torch.from_numpy(np.load(a.data / "train.npy").astype(np.int64))
    held = np.load(a.data / "heldout.npy").astype(np.int64)
    t = a.seq_len
    nwin = min(32, len(held) // t)
    held_windows = torch.from_numpy(np.stack([held[i * t : (i + 1) * t] for i in range(nwin)])).to(dev)
    gen = torch.Generator().manual_seed(a.seed)

    a.out.mkdir(parents=True, exist_ok=True)
    logf = open(a.out / "train_log.jsonl", "w")

    def log(rec):
        logf.write(json.dumps(rec) + "\n")
        logf.flush()
        print(json.dumps(rec), flush=True)

    t0 = time.time()
    pool = None
    if a.self_gen_seqs > 0 and a.self_gen_frac > 0:
        chunks = []
        bs = 512 if amp else 16
        for i in range(0, a.self_gen_seqs, bs):
            nb = min(bs, a.self_gen_seqs - i)
            starts = torch.randint(0, train_ids.numel() - a.self_gen_prompt, (nb,), generator=gen)
            prompts = train_ids[starts[:, None] + torch.arange(a.self_gen_prompt)].to(dev)
            chunks.append(target.generate(prompts, t, amp))
        pool = torch.cat(chunks)
    log(
        {
            "event": "start",
            "args": {k: str(v) for k, v in vars(a).items()},
            "config": cfg.to_dict(),
            "drafter_params": n_params,
            "device": str(dev),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(dev) if amp else None,
            "self_gen_pool": 0 if pool is None else int(pool.shape[0]),
            "pool_s": round(time.time() - t0, 2),
        }
    )

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        fused=amp,
    )
    offs = torch.arange(t)
    best = None
    step = 0
    t1 = time.time()
    budget_s = max(1.0, a.max_minutes * 60 - (t1 - t0) - 15.0) if a.max_minutes > 0 else 0.0
    for step in range(a.steps):
        progress = step / max(1, a.steps - 1)
        if budget_s:
            progress = max(progress, (time.time() - t1) / budget_s)
        lr = lr_at(step, progress, a)
        for g in opt.param_groups:
            g["lr"] = lr
        n_pool = int(round(a.batch_rows * a.self_gen_frac)) if pool is not None else 0
        starts = torch.randint(0, train_ids.numel() - t, (a.batch_rows - n_pool,), generator=gen)
        rows = [train_ids[starts[:, None] + offs].to(dev)]
        if n_pool:
            rows.append(pool[torch.randint(0, pool.shape[0], (n_pool,), generator=gen).to(dev)])
        ids = torch.cat(rows)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=amp):
            caps, anchors, y, tl = make_batch(target, ids, a.anchors, cfg.num_speculative_tokens, gen)
            total, ce, correct, conf = loss_terms(model, cfg, caps, ids, anchors, y, tl, a)
        total.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        el = time.time() - t1
        last = step == a.steps - 1
        over = bool(budget_s) and (time.time() - t1) >= budget_s
        if step % a.log_every == 0 or last or over:
            cp = torch.cumprod(correct, 1)
            log(
                {
                    "step": step,
                    "lr": round(lr, 6),
                    "loss": round(total.item(), 4),
                    "ce": [round(x, 3) for x in ce.tolist()],
                    "acc": [round(x, 3) for x in correct.mean(0).tolist()],
                    "conf": [round(x, 3) for x in conf.mean(0).tolist()],
                    "mal_tf": round(1 + cp.sum(1).mean().item(), 3),
                    "grad_norm": round(gn.item(), 3),
                    "elapsed_s": round(el, 1),
                    "s_per_step": round(el / (step + 1), 4),
                }
            )
        if (step + 1) % a.eval_every == 0 or last or over:
            ev = dense_eval(model, cfg, target, held_windows, a, amp)
            log({"step": step, "eval": ev})
            if best is None or ev["tf_mean_accepted_length"] > best[0]:
                best = (
                    ev["tf_mean_accepted_length"],
                    step,
                    {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                    ev,
                )
                save_dflash(a.out, cfg, model)  # keep the best so far on disk (a killed run still leaves weights)
        if over:
            break
    wall = time.time() - t0
    model.load_state_dict(best[2])
    cfg.extra = {
        "target": {
            "path": str(a.target),
            "num_hidden_layers": tcfg["num_hidden_layers"],
            "model_type": tcfg.get("model_type"),
            "model_sha256": _sha256(a.target / "model.safetensors"),
        },
        "training": {
            "steps_run": step + 1,
            "best_step": best[1],
            "wall_s": round(wall, 1),
            "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if amp else None,
            "batch_rows": a.batch_rows,
            "seq_len": t,
            "anchors_per_row": a.anchors,
            "self_gen_frac": a.self_gen_frac,
            "self_gen_seqs": a.self_gen_seqs,
            "lr": a.lr,
            "kl_weight": a.kl_weight,
            "conf_weight": a.conf_weight,
            "pos_decay": a.pos_decay,
            "seed": a.seed,
            "heldout_teacher_forced": best[3],
        },
    }
    save_dflash(a.out, cfg, model.cpu())
    summary = {
        "event": "done",
        "steps_run": step + 1,
        "best_step": best[1],
        "wall_s": round(wall, 1),
        "drafter_params": n_params,
        "dflash_bytes": (a.out / "dflash.safetensors").stat().st_size,
        "best_eval": best[3],
    }
    log(summary)
    logf.close()
    return summary


# ----------------------------------------------------------------------------------------------------------------
# Evaluation through the engine's paged target + DFlashDrafter (CPU)
# ----------------------------------------------------------------------------------------------------------------
class PagedTarget:
    """Minimal engine-like driver: per-request block tables over our paged target, forwards with capture."""

    def __init__(self, model, num_blocks: int, block_size: int = 16):
        from deepinfer_npu.model_executor import allocate_kv_caches

        self.model, self.bs = model, block_size
        self.kv = allocate_kv_caches(model.config, num_blocks, block_size, model.dtype)
        self.free = list(range(num_blocks - 1, 0, -1))
        self.tables: dict[int, list[int]] = {}

    def release(self, rid: int) -> None:
        self.free.extend(self.tables.pop(rid, []))

    def forward(self, rows: list[tuple[int, list[int], int]], capture_ids):
        """rows: (request id, tokens, start position) -> (logits [T, V], captured {i: [T, D]}, positions [T])."""
        from deepinfer_npu.model_executor import build_attention_metadata

        q = [len(toks) for _, toks, _ in rows]
        k = [start + len(toks) for _, toks, start in rows]
        for (rid, _, _), kk in zip(rows, k):
            tab = self.tables.setdefault(rid, [])
            while len(tab) * self.bs < kk:
                tab.append(self.free.pop())
        width = max(len(self.tables[r]) for r, _, _ in rows)
        tables = [self.tables[r] + [0] * (width - len(self.tables[r])) for r, _, _ in rows]
        attn = build_attention_metadata(q, k, tables, self.bs, is_prefill=False)
        ids = torch.tensor([x for _, toks, _ in rows for x in toks], dtype=torch.int32)
        with torch.no_grad():
            hidden, caps = self.model(ids, attn.positions, attn, self.kv, capture_layer_ids=tuple(capture_ids))
            logits = self.model.compute_logits(hidden)
        return logits, caps, attn.positions


def heldout_prompts(held: np.ndarray, n: int, plen: int, seed: int = 0) -> list[list[int]]:
    """Up to ``n`` held-out prompts of ``plen`` tokens: every held-out document start (BOS = 0) first (cut at the
    document's EOS when shorter), then windows at random offsets inside documents (no EOS inside), seeded."""
    bos, eos = 0, 1
    prompts = []
    for i in np.flatnonzero(held == bos):
        p = held[i : i + plen].tolist()
        if eos in p:
            p = p[: p.index(eos)]
        if len(p) >= 16:
            prompts.append(p)
    rng = np.random.default_rng(seed)
    tries = 0
    while len(prompts) < n and tries < 100 * n:
        tries += 1
        o = int(rng.integers(0, len(held) - plen))
        w = held[o : o + plen]
        if not (w == eos).any() and not (w[1:] == bos).any():
            prompts.append(w.tolist())
    return prompts[:n]


@torch.no_grad()
def simulate(
    target_model, drafter, prompts: list[list[int]], new_tokens: int, eos: int | None, with_baseline: int = 0
) -> dict:
    """Greedy speculative decoding (k drafts verified every step, bonus included), batched over prompts."""
    k = drafter.num_speculative_tokens
    ids = drafter.target_layer_ids
    n = len(prompts)
    max_len = max(len(p) for p in prompts) + new_tokens + k + 2
    pt = PagedTarget(target_model, num_blocks=n * (max_len // 16 + 2) + 2)
    slots = torch.arange(1, n + 1)
    drafter.zero_slots(slots)
    # prefill (capture every prompt token)
    logits, caps, pos = pt.forward([(i, p, 0) for i, p in enumerate(prompts)], ids)
    slot_tok = torch.repeat_interleave(slots, torch.tensor([len(p) for p in prompts]))
    drafter.capture(caps, pos, slot_tok)
    ends = np.cumsum([len(p) for p in prompts]) - 1
    golden = logits[torch.as_tensor(ends)].argmax(-1)
    out = [[int(golden[i])] for i in range(n)]
    ppos = torch.tensor([len(p) for p in prompts])
    active = [eos is None or out[i][-1] != eos for i in range(n)]
    acc_hist = []  # per verify step: accepted count a (0..k)
    conf_hist, okmask_hist = [], []
    while True:
        live = [i for i in range(n) if active[i] and len(out[i]) < new_tokens]
        if not live:
            break
        li = torch.tensor(live)
        drafts, conf = drafter.propose(golden[li], ppos[li], slots[li])
        rows = [(i, [int(golden[i])] + drafts[r].tolist(), int(ppos[i])) for r, i in enumerate(live)]
        logits, caps, pos = pt.forward(rows, ids)
        drafter.capture(caps, pos, torch.repeat_interleave(slots[li], k + 1))
        tgt = logits.argmax(-1).view(len(live), k + 1)
        match = (drafts == tgt[:, :k]).int()
        acc = torch.cumprod(match, 1).sum(1)  # accepted drafts a
        for r, i in enumerate(live):
            a = int(acc[r])
            emitted = tgt[r, : a + 1].tolist()
            if eos is not None and eos in emitted:
                emitted = emitted[: emitted.index(eos) + 1]
                active[i] = False
            out[i].extend(emitted)
            golden[i] = tgt[r, a]
            ppos[i] += a + 1
            acc_hist.append(a)
            conf_hist.append(conf[r].tolist())
            okmask_hist.append(match[r].tolist())
    acc_hist = np.array(acc_hist)
    conf_hist = np.array(conf_hist)
    ok = np.array(okmask_hist)
    res = {
        "verify_steps": int(len(acc_hist)),
        "prompts": n,
        "k": k,
        "mean_accepted_length": float((acc_hist + 1).mean()),
        "mean_accepted_drafts": float(acc_hist.mean()),
        "per_position_acceptance": [float((acc_hist >= j + 1).mean()) for j in range(k)],
        "per_position_conditional_acceptance": [
            float((acc_hist >= j + 1).sum() / max(1, (acc_hist >= j).sum())) for j in range(k)
        ],
        "accepted_count_histogram": np.bincount(acc_hist, minlength=k + 1).tolist(),
    }
    # calibration: confidence_j predicts "draft j accepted | drafts < j accepted"
    cal = []
    for j in range(k):
        reached = acc_hist >= j
        cal.append(
            {
                "position": j + 1,
                "n": int(reached.sum()),
                "mean_confidence": float(conf_hist[reached, j].mean()) if reached.any() else None,
                "empirical_acceptance": float(ok[reached, j].mean()) if reached.any() else None,
            }
        )
    res["calibration_per_position"] = cal
    reached = np.concatenate([(acc_hist >= j)[:, None] for j in range(k)], 1)
    c, y = conf_hist[reached], ok[reached].astype(float)
    bins = np.linspace(0, 1, 11)
    rel = []
    for lo, hi in zip(bins[:-1], bins[1:]):
        m = (c >= lo) & ((c < hi) if hi < 1 else (c <= hi))
        if m.any():
            rel.append(
                {
                    "bin": [round(lo, 1), round(hi, 1)],
                    "n": int(m.sum()),
                    "mean_confidence": float(c[m].mean()),
                    "empirical_acceptance": float(y[m].mean()),
                }
            )
    res["reliability"] = rel
    res["brier"] = float(((c - y) ** 2).mean())
    res["ece"] = float(
        sum(r["n"] * abs(r["mean_confidence"] - r["empirical_acceptance"]) for r in rel) / max(1, len(c))
    )
    # lossless check: speculative output == plain greedy decoding for the first prompts
    if with_baseline:
        pt2 = PagedTarget(target_model, num_blocks=with_baseline * (max_len // 16 + 2) + 2)
        sub = prompts[:with_baseline]
        logits, _, _ = pt2.forward([(i, p, 0) for i, p in enumerate(sub)], ids)
        ends = np.cumsum([len(p) for p in sub]) - 1
        cur = logits[torch.as_tensor(ends)].argmax(-1)
        base = [[int(cur[i])] for i in range(len(sub))]
        for s in range(new_tokens - 1):
            rows = [(i, [base[i][-1]], len(sub[i]) + s) for i in range(len(sub))]
            logits, _, _ = pt2.forward(rows, ids)
            for i, tkn in enumerate(logits.argmax(-1).tolist()):
                base[i].append(tkn)
        same = []
        for i in range(len(sub)):
            m = min(len(out[i]), new_tokens)
            b = base[i][:m]
            if eos is not None and eos in b:
                b = b[: b.index(eos) + 1]
            same.append(out[i][: len(b)] == b)
        res["lossless_check"] = {"prompts": len(sub), "identical_to_plain_greedy": same}
    res["outputs"] = out
    return res


def load_engine_target(model_dir: Path, dtype: str = "float32"):
    from deepinfer_npu.hal import get_backend
    from deepinfer_npu.model_executor import DeepseekModelConfig, build_model, load_weights

    cfg = DeepseekModelConfig.from_pretrained(str(model_dir))
    model = build_model(cfg, get_backend("cpu"), getattr(torch, dtype))
    load_weights(model, str(model_dir))
    return model


def evaluate(a) -> dict:
    from deepinfer_npu.spec.dflash import DFlashDrafter

    torch.set_grad_enabled(False)
    t0 = time.time()
    tmodel = load_engine_target(a.target, a.eval_dtype)
    drafter = DFlashDrafter.from_pretrained(a.out, tmodel, num_state_slots=a.eval_prompts + 1)
    held = np.load(a.data / "heldout.npy").astype(np.int64)
    prompts = heldout_prompts(held, a.eval_prompts, a.eval_prompt_len, seed=a.seed)
    tcfg = json.loads((a.target / "config.json").read_text())
    res = simulate(tmodel, drafter, prompts, a.eval_new_tokens, tcfg.get("eos_token_id"), with_baseline=4)
    res.pop("outputs")
    res.update(
        {
            "prompt_len": a.eval_prompt_len,
            "new_tokens": a.eval_new_tokens,
            "dtype": a.eval_dtype,
            "eval_wall_s": round(time.time() - t0, 1),
        }
    )
    (a.out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("reliability",)}, indent=1))
    return res


def main(argv=None):
    a = parse_args(argv)
    if a.data is None:
        a.data = a.out / "data"
    ensure_corpus(a.data)
    if a.stage in ("all", "train"):
        train(a)
    if a.stage in ("all", "eval"):
        evaluate(a)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
