"""Evaluation of the exported reference model (CPU, fp32): held-out loss, MTP acceptance, transformers parity,
samples.

Definitions (also in MODEL_CARD.md):

* held-out loss: mean next-token cross entropy (nats) of the main model over the held-out token stream cut
  into non-overlapping windows of ``window + 2`` tokens (the model sees ``window`` tokens; MTP loss uses the
  extra one).
* MTP greedy acceptance (held-out text): for each window of held-out text and each position t with context
  x_0..x_t: g1 = main argmax at t (the token the main model would emit next); draft = argmax of
  lm_head(MTP(h_t, embed(g1))) where the MTP rows j < t use the true tokens x_{j+1}; g2 = main argmax at
  position t+1 given x_0..x_t, g1. The draft is accepted iff draft == g2. This is exactly the first-draft
  acceptance of greedy MTP speculative decoding (nextn = 1) at that point of the text.
* MTP greedy acceptance (self-generated): the same on the main model's own greedy continuation of held-out
  prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .model import DeepseekV3Ref, load_ref_model

SAMPLE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    'class Stack:\n    """A simple LIFO stack."""\n\n    def __init__(self):\n',
    "def read_lines(path):\n    with open(path",
    "    def __repr__(self):\n        return",
    "try:\n    import threading\nexcept ImportError:\n",
]


def heldout_windows(ids: np.ndarray, window: int) -> torch.Tensor:
    n = (len(ids) - 2) // window
    rows = [ids[i * window : i * window + window + 2] for i in range(n)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


@torch.no_grad()
def eval_loss(model: DeepseekV3Ref, windows: torch.Tensor, batch: int = 8) -> dict:
    main_sum = mtp_sum = 0.0
    correct = n = 0
    for i in range(0, len(windows), batch):
        b = windows[i : i + batch]
        t = b.shape[1] - 2
        hidden, cos, sin = model.forward_main(b[:, :t])
        logits = model.logits(hidden).float()
        main_sum += F.cross_entropy(logits.flatten(0, 1), b[:, 1 : t + 1].reshape(-1), reduction="sum").item()
        correct += (logits.argmax(-1) == b[:, 1 : t + 1]).sum().item()
        mh = model.forward_mtp(hidden, b[:, 1 : t + 1], cos, sin)
        ml = model.logits(mh).float()
        mtp_sum += F.cross_entropy(ml.flatten(0, 1), b[:, 2 : t + 2].reshape(-1), reduction="sum").item()
        n += b[:, 1 : t + 1].numel()
    return {"loss": main_sum / n, "mtp_loss": mtp_sum / n, "top1_acc": correct / n, "tokens": n}


@torch.no_grad()
def mtp_acceptance_on_text(model: DeepseekV3Ref, windows: torch.Tensor) -> dict:
    """windows [N, W]: acceptance over positions t = 0..W-2 of each window (see module docstring)."""
    acc = tot = tf_correct = 0
    for w in windows:
        w = w.unsqueeze(0)
        wl = w.shape[1]
        hidden, cos, sin = model.forward_main(w)
        g1 = model.logits(hidden)[0].argmax(-1)  # [W]
        pos = torch.arange(wl - 1)
        # main: row t = x with x_{t+1} replaced by g1[t]; read logits at t+1
        rows = w.repeat(wl - 1, 1)
        rows[pos, pos + 1] = g1[:-1]
        h2, _, _ = model.forward_main(rows)
        g2 = model.logits(h2[pos, pos + 1]).argmax(-1)  # [W-1]
        # MTP: rows j < t use true x_{j+1}; row t uses g1[t]
        nxt = w[:, 1:].repeat(wl - 1, 1)
        nxt[pos, pos] = g1[:-1]
        mh = model.forward_mtp(hidden[:, :-1].expand(wl - 1, -1, -1), nxt, cos[:-1], sin[:-1])
        draft = model.logits(mh[pos, pos]).argmax(-1)
        acc += (draft == g2).sum().item()
        tot += wl - 1
        # teacher forced MTP accuracy on the true text (predicting x_{t+2} from h_t, x_{t+1})
        mh_tf = model.forward_mtp(hidden[:, :-2], w[:, 1:-1], cos[:-2], sin[:-2])
        tf_correct += (model.logits(mh_tf)[0].argmax(-1) == w[0, 2:]).sum().item()
    return {
        "acceptance": acc / tot,
        "positions": tot,
        "mtp_teacher_forced_top1": tf_correct / (len(windows) * (windows.shape[1] - 2)),
    }


@torch.no_grad()
def greedy_generate(model: DeepseekV3Ref, prompt: torch.Tensor, max_new: int, eos: int | None = None):
    """prompt [B, P] -> [B, P + max_new] (no early stop for batches; single rows stop at eos)."""
    seq = prompt
    for _ in range(max_new):
        hidden, _, _ = model.forward_main(seq)
        nxt = model.logits(hidden[:, -1]).argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        if eos is not None and seq.shape[0] == 1 and nxt.item() == eos:
            break
    return seq


@torch.no_grad()
def mtp_acceptance_self_generated(model: DeepseekV3Ref, prompts: torch.Tensor, max_new: int) -> dict:
    seq = greedy_generate(model, prompts, max_new)
    p = prompts.shape[1]
    hidden, cos, sin = model.forward_main(seq)
    # on greedy text g1[t] = seq[t+1] and g2[t] = seq[t+2] for t >= p-1
    mh = model.forward_mtp(hidden[:, :-2], seq[:, 1:-1], cos[:-2], sin[:-2])
    draft = model.logits(mh).argmax(-1)  # predicts seq[:, 2:]
    ok = (draft == seq[:, 2:])[:, p - 1 :]
    return {"acceptance": ok.float().mean().item(), "positions": ok.numel()}


def load_hf(model_dir: Path, dtype=torch.float32):
    import transformers
    from transformers import DeepseekV3ForCausalLM

    transformers.logging.set_verbosity_error()
    return DeepseekV3ForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


def load_hf_mtp(hf_model, model_dir: Path):
    """transformers' generic MtpModel around hf_model, with the checkpoint's MTP layer (index
    num_hidden_layers) mapped in by hand (transformers' own MTP loading only knows layer 61 of the full-size
    checkpoint)."""
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    n = hf_model.config.num_hidden_layers
    mtp = MtpModel(hf_model, hf_model.config.num_mtp_layers).to(hf_model.dtype).eval()
    sd = load_file(str(Path(model_dir) / "model.safetensors"))
    pre = f"model.layers.{n}."
    new, experts = {}, {}
    for k, v in sd.items():
        if not k.startswith(pre):
            continue
        rest = k[len(pre) :]
        if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            new[f"layers.0.{rest}"] = v
        elif rest == "shared_head.norm.weight":
            new["layers.0.post_norm.weight"] = v
        elif rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault(proj, {})[int(e)] = v
        else:
            new[f"layers.0.mtp_block.{rest}"] = v
    ne = len(experts["gate_proj"])
    gate_up = [torch.cat([experts["gate_proj"][e], experts["up_proj"][e]], 0) for e in range(ne)]
    new["layers.0.mtp_block.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    new["layers.0.mtp_block.mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(ne)])
    target = mtp.state_dict()
    missing = [k for k in target if k not in new and not k.startswith(("embed_tokens", "shared_head"))]
    if missing:
        raise KeyError(f"MTP weights missing: {missing}")
    mtp.load_state_dict({k: v.to(target[k].dtype) for k, v in new.items()}, strict=False)
    return mtp


@torch.no_grad()
def hf_mtp_logits(mtp, hf_hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(next_ids.shape[1]).unsqueeze(0).expand(next_ids.shape[0], -1)
    h = mtp.forward_layer(0, hf_hidden, pos, None, input_ids=next_ids)
    return mtp._project_to_logits(h)


@torch.no_grad()
def check_hf_parity(model: DeepseekV3Ref, model_dir: Path, windows: torch.Tensor, tok, max_new: int) -> dict:
    hf = load_hf(model_dir)
    mtp = load_hf_mtp(hf, model_dir)
    t = windows.shape[1] - 2
    inp = windows[:, :t]
    out = hf(inp, output_hidden_states=True)
    hidden, cos, sin = model.forward_main(inp)
    ours = model.logits(hidden)
    main_diff = (out.logits - ours).abs().max().item()
    main_argmax = (out.logits.argmax(-1) == ours.argmax(-1)).float().mean().item()
    hf_mtp = hf_mtp_logits(mtp, out.hidden_states[-1], windows[:, 1 : t + 1])
    ours_mtp = model.logits(model.forward_mtp(hidden, windows[:, 1 : t + 1], cos, sin))
    mtp_diff = (hf_mtp - ours_mtp).abs().max().item()
    mtp_argmax = (hf_mtp.argmax(-1) == ours_mtp.argmax(-1)).float().mean().item()
    gen_equal = []
    for p in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(p).ids])
        a = greedy_generate(model, ids, max_new, eos=model.cfg.eos_token_id)[0].tolist()
        b = hf.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=model.cfg.eos_token_id)
        b = b[0].tolist()
        gen_equal.append(a == b[: len(a)] and len(b) >= len(a))
    return {
        "main_max_abs_logit_diff": main_diff,
        "main_argmax_agreement": main_argmax,
        "mtp_max_abs_logit_diff": mtp_diff,
        "mtp_argmax_agreement": mtp_argmax,
        "greedy_generation_identical": gen_equal,
        "positions": int(inp.numel()),
    }


@torch.no_grad()
def greedy_check(model: DeepseekV3Ref, tok, max_new: int = 32) -> dict:
    """Greedy continuation (training module, fp32) of the sample prompt whose path has the widest top-1/top-2
    logit margin, for a test that transformers reproduces it token for token."""
    best = None
    for p in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(p).ids])
        seq = greedy_generate(model, ids, max_new)
        hidden, _, _ = model.forward_main(seq[:, :-1])
        top2 = model.logits(hidden[0, ids.shape[1] - 1 :]).topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        if best is None or margin > best["min_logit_margin"]:
            best = {
                "prompt": p,
                "prompt_ids": ids[0].tolist(),
                "expected_new_ids": seq[0, ids.shape[1] :].tolist(),
                "min_logit_margin": margin,
            }
    return best


@torch.no_grad()
def mtp_slice_loss(model: DeepseekV3Ref, check: torch.Tensor) -> float:
    """MTP CE on rows [B, L]: position i uses main hidden h_i and token i+1, predicts token i+2."""
    hidden, cos, sin = model.forward_main(check)
    mh = model.forward_mtp(hidden[:, :-2], check[:, 1:-1], cos[:-2], sin[:-2])
    return F.cross_entropy(model.logits(mh).flatten(0, 1), check[:, 2:].reshape(-1)).item()


def run_eval(model_dir: Path, data_dir: Path, log=print, max_new: int = 96) -> dict:
    from tokenizers import Tokenizer

    torch.manual_seed(0)
    model_dir = Path(model_dir)
    model = load_ref_model(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    held = np.load(Path(data_dir) / "heldout.npy")
    meta = json.loads((Path(data_dir) / "corpus_meta.json").read_text())
    res: dict = {}
    full = eval_loss(model, heldout_windows(held, 512))
    full["perplexity"] = float(np.exp(full["loss"]))
    full["bits_per_byte"] = full["loss"] * meta["heldout_tokens"] / meta["heldout_bytes"] / np.log(2)
    res["heldout"] = full
    log(f"held-out: {full}")
    w128 = heldout_windows(held, 126)  # rows of 128 tokens
    sel = w128[torch.linspace(0, len(w128) - 1, 24).long()]
    res["mtp_acceptance_heldout_text"] = mtp_acceptance_on_text(model, sel)
    log(f"MTP acceptance on held-out text: {res['mtp_acceptance_heldout_text']}")
    prompts = w128[torch.linspace(0, len(w128) - 1, 16).long(), :64]
    res["mtp_acceptance_self_generated"] = mtp_acceptance_self_generated(model, prompts, 64)
    log(f"MTP acceptance on greedy continuations: {res['mtp_acceptance_self_generated']}")
    res["hf_parity"] = check_hf_parity(model, model_dir, heldout_windows(held, 254)[:4], tok, 48)
    log(f"transformers parity: {res['hf_parity']}")
    samples = []
    for p in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(p).ids])
        out = greedy_generate(model, ids, max_new, eos=model.cfg.eos_token_id)[0].tolist()
        samples.append({"prompt": p, "completion": tok.decode(out[ids.shape[1] :], skip_special_tokens=False)})
    res["samples"] = samples
    # small fixed held-out slice for the fast test (transformers recomputes its loss)
    check = heldout_windows(held, 255)[:4, :256]  # 4 rows x 256 tokens -> 4 x 255 predictions
    hf = load_hf(model_dir)
    with torch.no_grad():
        logits = hf(check).logits
    slice_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), check[:, 1:].reshape(-1)).item()
    res["heldout_check"] = {
        "description": "First 4 windows of the held-out token stream (rows of 256 tokens, consecutive, from "
        "offset i*255); loss = mean next-token CE of transformers' DeepseekV3ForCausalLM (fp32) over "
        "the 4 x 255 predicted positions.",
        "token_ids": check.tolist(),
        "expected_loss": slice_loss,
        "model_card_heldout_loss": full["loss"],
        "rel_tolerance": 0.05,
        "expected_mtp_loss": mtp_slice_loss(model, check),
        "greedy": greedy_check(model, tok),
    }
    log(f"held-out check slice loss (transformers): {slice_loss:.4f}")
    return res
