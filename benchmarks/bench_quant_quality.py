"""Quality of FP8 weights quantised at load (128 x 128 block scales, 1 x 128 activation groups) and of INT8 W8A8
(per-channel weights, per-token activations), through the CPU reference ops, on the shipped reference model, next to
the unquantised model in fp32 and bf16:

* held-out loss over the model card's 105 windows x 512 predictions, top-1 agreement and mean KL(fp32 || variant) of
  the next-token distributions, max |delta logprob| of the fp32 model's top token;
* MTP greedy acceptance on each variant's own greedy continuations (the card's definition: 16 held-out prompts of
  64 tokens, 64 greedy tokens each, generated positions only);
* DFlash greedy speculative decoding (k = 5, the drafter in ``dflash/``) through the paged target, mean accepted
  length, on held-out prompts.

Prints one JSON line per variant (``--out`` appends them with ``row_meta``). CPU only; about a minute per variant.
    python -m benchmarks.bench_quant_quality --out benchmarks/results/cpu_quant_quality.jsonl
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer_npu.benchmark_meta import row_meta
from deepinfer_npu.config import REFERENCE_MODEL_DIR as REF
from deepinfer_npu.hal import get_backend
from deepinfer_npu.model_executor import (
    DeepseekModelConfig,
    allocate_kv_caches,
    build_attention_metadata,
    build_model,
    load_weights,
)

VARIANTS = {  # name -> (compute dtype, quantization)
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "fp8": (torch.float32, "fp8"),
    "fp8-bf16": (torch.bfloat16, "fp8"),
    "w8a8": (torch.float32, "w8a8"),
}
WINDOW = 512
WEIGHTS = {None: "unquantised", "fp8": "fp8 e4m3, 128x128 block scales (quantised at load)",
           "w8a8": "int8, per-output-channel scales (quantised at load)"}
ACTIVATIONS = {None: "model dtype", "fp8": "fp8 e4m3, 1x128 per-token groups", "w8a8": "int8, per-token scales"}


class Paged:
    """Per-request block tables over the model's paged latent caches (plus one MTP layer's)."""

    def __init__(self, model, num_blocks: int, block_size: int = 64) -> None:
        cfg = model.config
        self.model, self.bs = model, block_size
        self.kv = allocate_kv_caches(cfg, num_blocks, block_size, model.dtype)
        self.mtp_kv = allocate_kv_caches(cfg, num_blocks, block_size, model.dtype, num_layers=1)[0]
        self.free = list(range(num_blocks - 1, 0, -1))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _attn(self, rows: dict[int, list[int]]):
        q = [len(t) for t in rows.values()]
        k = [self.lens.get(r, 0) + len(t) for r, t in rows.items()]
        for r, kk in zip(rows, k):
            tab = self.tables.setdefault(r, [])
            while len(tab) * self.bs < kk:
                tab.append(self.free.pop())
            self.lens[r] = kk
        width = max(len(self.tables[r]) for r in rows)
        return build_attention_metadata(q, k, [self.tables[r] + [0] * (width - len(self.tables[r])) for r in rows],
                                        self.bs)

    @torch.no_grad()
    def step(self, rows: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``{request: new tokens}`` -> (final-normed hidden [T, D], fp32 logits [T, V])."""
        attn = self._attn(rows)
        ids = torch.tensor([x for t in rows.values() for x in t], dtype=torch.int32)
        hidden = self.model(ids, attn.positions, attn, self.kv)
        return hidden, self.model.compute_logits(hidden)

    @torch.no_grad()
    def mtp_logits(self, rows: dict[int, list[int]], hidden: torch.Tensor) -> torch.Tensor:
        """MTP over fresh requests: row j of each gets (token j+1, hidden j) -> fp32 logits predicting token j+2.
        Uses its own block tables (``rows`` must be new request ids)."""
        attn = self._attn(rows)
        ids = torch.tensor([x for t in rows.values() for x in t], dtype=torch.int32)
        mh = self.model.mtp(ids, hidden, attn.positions, attn, self.mtp_kv)
        return self.model.mtp.compute_logits(mh)


def load(variant: str):
    dtype, quant = VARIANTS[variant]
    model = build_model(DeepseekModelConfig.from_pretrained(REF), get_backend("cpu"), dtype, quantization=quant)
    load_weights(model, REF)
    return model


def heldout_stream() -> np.ndarray:
    """The card's held-out token stream: the 13 held-out stdlib files, ``<|bos|>`` + tokens + ``<|eos|>`` each."""
    from tokenizers import Tokenizer

    from examples.reference_model.corpus import encode_docs, is_heldout, list_stdlib_files, read_texts, stdlib_root

    root = stdlib_root()
    files = [f for f in list_stdlib_files(root) if is_heldout(f)]
    _kept, texts, _skipped = read_texts(root, files)
    return encode_docs(Tokenizer.from_file(str(REF / "tokenizer.json")), texts).astype(np.int64)


def heldout_quality(models: dict, held: np.ndarray, num_windows: int, batch: int = 8) -> dict[str, dict]:
    """Loss, top-1 accuracy, and agreement / KL / |delta logprob| against the first variant, per variant."""
    n = min(num_windows, (len(held) - 2) // WINDOW)
    windows = [held[i * WINDOW : i * WINDOW + WINDOW + 1].tolist() for i in range(n)]
    names = list(models)
    acc = {v: dict(loss=0.0, correct=0, agree=0, kl=0.0, max_dlogp=0.0) for v in names}
    count = 0
    for b0 in range(0, n, batch):
        rows = windows[b0 : b0 + batch]
        targets = torch.tensor([t for r in rows for t in r[1:]])
        ref_logp = None
        for v in names:
            runner = Paged(models[v], num_blocks=batch * (WINDOW // 64 + 1) + 2)
            _h, logits = runner.step({i: r[:-1] for i, r in enumerate(rows)})
            logp = F.log_softmax(logits.float(), -1)
            a = acc[v]
            a["loss"] += F.nll_loss(logp, targets, reduction="sum").item()
            a["correct"] += (logp.argmax(-1) == targets).sum().item()
            if ref_logp is None:
                ref_logp = logp
            top = ref_logp.argmax(-1, keepdim=True)
            a["agree"] += (logp.argmax(-1) == top[:, 0]).sum().item()
            a["kl"] += (ref_logp.exp() * (ref_logp - logp)).sum().item()
            a["max_dlogp"] = max(a["max_dlogp"], (logp.gather(1, top) - ref_logp.gather(1, top)).abs().max().item())
        count += targets.numel()
    return {v: {"heldout_loss": a["loss"] / count, "heldout_top1": a["correct"] / count,
                f"top1_agreement_vs_{names[0]}": a["agree"] / count, f"mean_kl_vs_{names[0]}": a["kl"] / count,
                f"max_abs_dlogprob_top_token_vs_{names[0]}": a["max_dlogp"], "heldout_tokens": count}
            for v, a in acc.items()}


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    runner = Paged(model, num_blocks=len(prompts) * ((max(map(len, prompts)) + new_tokens) // 64 + 2) + 2)
    _h, logits = runner.step(dict(enumerate(prompts)))
    ends = np.cumsum([len(p) for p in prompts]) - 1
    out = [[int(t)] for t in logits[torch.as_tensor(ends)].argmax(-1)]
    for _ in range(new_tokens - 1):
        _h, logits = runner.step({i: [o[-1]] for i, o in enumerate(out)})
        for i, t in enumerate(logits.argmax(-1).tolist()):
            out[i].append(t)
    return out


def mtp_acceptance(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, list[list[int]]]:
    """Greedy MTP (nextn = 1) first-draft acceptance on the model's own continuations, generated positions only."""
    gens = greedy(model, prompts, new_tokens)
    seqs = [p + g for p, g in zip(prompts, gens)]
    runner = Paged(model, num_blocks=2 * len(seqs) * (max(map(len, seqs)) // 64 + 2) + 2)
    hidden, _ = runner.step(dict(enumerate(seqs)))
    offs = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    rows = {len(seqs) + i: s[1:] for i, s in enumerate(seqs)}  # MTP row j: token j+1 with hidden j
    keep = torch.cat([torch.arange(offs[i], offs[i + 1] - 1) for i in range(len(seqs))])
    drafts = runner.mtp_logits(rows, hidden[keep]).argmax(-1).tolist()
    hit = tot = 0
    pos = 0
    for p, s in zip(prompts, seqs):
        for j in range(len(s) - 1):
            if len(p) <= j + 2 < len(s):
                hit += drafts[pos + j] == s[j + 2]
                tot += 1
        pos += len(s) - 1
    return hit / tot, tot, gens


def dflash_acceptance(model, prompts: list[list[int]], new_tokens: int) -> dict:
    from deepinfer_npu.spec.dflash import DFlashDrafter
    from examples.train_dflash import simulate

    drafter = DFlashDrafter.from_pretrained(REF / "dflash", model, num_state_slots=len(prompts) + 1)
    res = simulate(model, drafter, prompts, new_tokens, eos=1)
    return {k: res[k] for k in ("verify_steps", "mean_accepted_length", "per_position_acceptance")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="first one is the reference of the comparisons")
    ap.add_argument("--windows", type=int, default=105, help="held-out windows of 512 predictions (card: 105)")
    ap.add_argument("--mtp-prompts", type=int, default=16)
    ap.add_argument("--dflash-prompts", type=int, default=32)
    ap.add_argument("--dflash-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=None, help="append the rows (with row_meta) to this JSONL file")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    meta = row_meta("cpu")  # the checkout as the run starts
    from examples.train_dflash import heldout_prompts

    names = args.variants.split(",")
    models = {v: load(v) for v in names}
    held = heldout_stream()
    t0 = time.perf_counter()
    rows = heldout_quality(models, held, args.windows)
    mtp_prompts = heldout_prompts(held, args.mtp_prompts, 64, seed=0)
    dflash_prompts = heldout_prompts(held, args.dflash_prompts, 96, seed=0)
    ref_gens = None
    for v in names:
        acc, positions, gens = mtp_acceptance(models[v], mtp_prompts, 64)
        ref_gens = gens if ref_gens is None else ref_gens
        same = sum(a == b for g, r in zip(gens, ref_gens) for a, b in zip(g, r)) / sum(map(len, gens))
        dtype, quant = VARIANTS[v]
        row = {"bench": "quant_quality", "model": "deepinfer_npu/assets/reference", "variant": v,
               "dtype": str(dtype).replace("torch.", ""), "quantization": quant,
               "weights": WEIGHTS[quant], "activations": ACTIVATIONS[quant],
               **rows[v], "mtp_acceptance_own_greedy": acc, "mtp_positions": positions,
               f"greedy_tokens_identical_to_{names[0]}": same,
               "dflash": dflash_acceptance(models[v], dflash_prompts, args.dflash_new_tokens),
               "dflash_prompts": len(dflash_prompts), "dflash_new_tokens": args.dflash_new_tokens,
               "elapsed_s": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps({**row, **meta}) + "\n")


if __name__ == "__main__":
    main()
