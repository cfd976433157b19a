#!/usr/bin/env python3
"""Train the embedded reference model (deepinfer_npu/assets/reference/) from a clean checkout.

Stages (``--stage``):
  corpus  stdlib corpus -> byte-level BPE tokenizer -> token ids (``<data>/train.npy``, ``heldout.npy``,
          tokenizer files, corpus_meta.json)
  train   token ids -> DeepSeek-V3-architecture model with one MTP module -> ``<out>/`` in Hugging Face layout
          (config.json, model.safetensors, generation_config.json, tokenizer files, train_log.jsonl)
  eval    ``<out>/`` -> held-out loss, MTP acceptance, transformers parity, samples (``<out>/eval.json``,
          ``<out>/heldout_check.json``); CPU is fine
  all     the three in order (default)

The corpus depends on the interpreter's standard library, so build it with the Python the card names
(3.11.7 for the shipped model) and carry ``<data>`` to the training machine. Example (the shipped model)::

    python -m examples.train_reference_model --stage corpus --data .carry_ref/data
    python -m examples.train_reference_model --stage train --data .carry_ref/data --out OUT --device cuda
    python -m examples.train_reference_model --stage eval --data .carry_ref/data --out OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from examples.reference_model.corpus import build_corpus
from examples.reference_model.model import DeepseekV3Ref, RefConfig, count_params, export_state_dict


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=["all", "corpus", "train", "eval"], default="all")
    ap.add_argument("--out", type=Path, default=Path("runs/reference_model"), help="model output directory")
    ap.add_argument("--data", type=Path, default=None, help="corpus directory (default: <out>/data)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.3, help="residual dropout (training only)")
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of the MTP loss")
    ap.add_argument("--aux-alpha", type=float, default=1e-4, help="sequence-wise balance loss weight")
    ap.add_argument("--bias-gamma", type=float, default=1e-3, help="e_score_correction_bias update speed")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--max-minutes", type=float, default=0.0, help="stop early after this wall time (0 = off)")
    ap.add_argument("--config-override", default="", help="JSON merged into RefConfig, e.g. '{\"hidden_size\":128}'")
    ap.add_argument("--compile", action="store_true", help="torch.compile the training loss")
    return ap.parse_args(argv)


def lr_at(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def evaluate_windows(model: DeepseekV3Ref, windows: torch.Tensor, amp: bool, batch: int = 32) -> tuple[float, float]:
    model.eval()
    main = mtp = 0.0
    n = 0
    for i in range(0, len(windows), batch):
        b = windows[i : i + batch]
        with torch.autocast(device_type=b.device.type, dtype=torch.bfloat16, enabled=amp):
            _, m, t, _ = model.training_loss(b, 0.0, 0.0)
        main += m.item() * len(b)
        mtp += t.item() * len(b)
        n += len(b)
    model.train()
    return main / n, mtp / n


def save_hf_dir(model: DeepseekV3Ref, out: Path, data: Path | None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    save_file(export_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.hf_config(), indent=2) + "\n")
    gen = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        # the defaults the shipped model is served with: the only setting tried that reads without loops
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if data is not None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (data / f).exists():
                shutil.copyfile(data / f, out / f)


def train(a) -> dict:
    data = a.data
    dev = torch.device(a.device)
    amp = dev.type == "cuda"
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    cfg = RefConfig(**json.loads(a.config_override)) if a.config_override else RefConfig()
    train_ids = torch.from_numpy(np.load(data / "train.npy").astype(np.int64)).to(dev)
    held = np.load(data / "heldout.npy").astype(np.int64)
    t = a.seq_len
    nwin = (len(held) - 2) // t
    held_windows = torch.from_numpy(np.stack([held[i * t : i * t + t + 2] for i in range(nwin)])).to(dev)

    model = DeepseekV3Ref(cfg)
    model.init_weights(a.seed)
    model.set_dropout(a.dropout)
    model.to(dev).train()
    params = count_params(model)
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=dev.type == "cuda",
    )
    loss_fn = model.training_loss
    if a.compile:
        loss_fn = torch.compile(model.training_loss)
    gen = torch.Generator().manual_seed(a.seed)
    offs = torch.arange(t + 2, device=dev)
    a.out.mkdir(parents=True, exist_ok=True)
    logf = open(a.out / "train_log.jsonl", "w")

    def log(rec):
        logf.write(json.dumps(rec) + "\n")
        logf.flush()
        print(json.dumps(rec), flush=True)

    log(
        {
            "event": "start",
            "args": {k: str(v) for k, v in vars(a).items()},
            "params": params,
            "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "torch": torch.__version__,
            "train_tokens": int(train_ids.numel()),
            "heldout_windows": nwin,
        }
    )
    best = (float("inf"), -1, None)
    t0 = time.time()
    tok_seen = 0
    stopped_early = False
    step = 0
    for step in range(a.steps):
        lr = lr_at(step, a)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - t - 2, (a.batch_size,), generator=gen).to(dev)
        batch = train_ids[starts[:, None] + offs]
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=amp):
            total, main, mtp, aux = loss_fn(batch, a.mtp_weight, a.aux_alpha)
        total.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        moes = model.moe_layers()
        if step % a.log_every == 0 or step == a.steps - 1:
            loads = torch.stack([m.load_counts for m in moes])
            imb = (loads.max(1).values / loads.mean(1).clamp_min(1)).mean().item()
        for m in moes:
            m.update_bias(a.bias_gamma)
        tok_seen += batch.shape[0] * t
        el = time.time() - t0
        if step % a.log_every == 0 or step == a.steps - 1:
            log(
                {
                    "step": step,
                    "lr": lr,
                    "loss": total.item(),
                    "main": main.item(),
                    "mtp": mtp.item(),
                    "aux": aux.item(),
                    "grad_norm": gnorm.item(),
                    "max_load_over_mean": imb,
                    "tok_per_s": tok_seen / el,
                    "elapsed_s": el,
                    "epochs": tok_seen / train_ids.numel(),
                }
            )
        last = step == a.steps - 1
        over = a.max_minutes > 0 and el > a.max_minutes * 60
        if (step + 1) % a.eval_every == 0 or last or over:
            hm, ht = evaluate_windows(model, held_windows, amp)
            log({"step": step, "eval_main": hm, "eval_mtp": ht, "elapsed_s": time.time() - t0})
            if hm < best[0]:
                best = (hm, step, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        if over:
            stopped_early = True
            break
    wall = time.time() - t0
    model.load_state_dict(best[2])
    model.cpu()
    save_hf_dir(model, a.out, data)
    summary = {
        "best_eval_main": best[0],
        "best_step": best[1],
        "steps_run": step + 1,
        "wall_s": wall,
        "stopped_early": stopped_early,
        "params": params,
        "tokens_seen": tok_seen,
    }
    log({"event": "done", **summary})
    (a.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    logf.close()
    return summary


def main(argv=None):
    a = parse_args(argv)
    if a.data is None:
        a.data = a.out / "data"
    if a.stage in ("all", "corpus"):
        build_corpus(a.data)
    if a.stage in ("all", "train"):
        train(a)
    if a.stage in ("all", "eval"):
        from examples.reference_model.evaluate import run_eval

        res = run_eval(a.out, a.data)
        check = res.pop("heldout_check")
        (a.out / "heldout_check.json").write_text(json.dumps(check) + "\n")
        (a.out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
