"""``python -m deepinfer_npu.parity record|compare`` (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import recorder, rules


def compare_docs(golden: dict, candidate: dict) -> list[rules.Verdict]:
    """One verdict per prompt, by the golden's dtype rule; prompts must match."""
    verdicts = []
    for g, c in zip(golden["traces"], candidate["traces"]):
        if g["prompt_token_ids"] != c["prompt_token_ids"]:
            verdicts.append(
                rules.Verdict(False, "prompt token ids differ (different tokenizer or prompt set)")
            )
            continue
        verdicts.append(
            rules.compare_trace(golden["dtype"], recorder.as_rule_input(g), recorder.as_rule_input(c))
        )
    if len(golden["traces"]) != len(candidate["traces"]):
        verdicts.append(rules.Verdict(False, "different number of prompts"))
    return verdicts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepinfer_npu.parity")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record a golden trace on a backend")
    r.add_argument("--backend", required=True, help="cpu | cuda | ascend | any registered name")
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    r.add_argument("--model", default=None, help="model directory (default: the shipped reference model)")
    r.add_argument("--max-tokens", type=int, default=recorder.P.MAX_TOKENS)
    r.add_argument("--load-format", default="auto", choices=["auto", "dummy_portable"],
                   help="dummy_portable: seeded random weights, the same on every backend (real-dims parity models)")
    r.add_argument(
        "--out", default=None, help="output file (default parity_tests/golden/<backend>-<dtype>.json)"
    )
    c = sub.add_parser("compare", help="run a backend on a golden's prompts and apply the dtype's rule")
    c.add_argument("--golden", required=True)
    c.add_argument("--backend", default="cpu")
    c.add_argument("--model", default=None)
    for sp in (r, c):
        sp.add_argument("--data-parallel-size", type=int, default=1,
                        help="rank processes (expert-parallel MoE across them): the goldens hold for any number")
    args = p.parse_args(argv)

    try:
        return _run(args)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _ranks(args) -> dict:
    """Engine options for ``--data-parallel-size`` (1: one process, the default)."""
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    return {"data_parallel_size": args.data_parallel_size} if args.data_parallel_size > 1 else {}


def _run(args) -> int:
    if args.cmd == "record":
        doc = recorder.record(args.backend, args.dtype, args.model, args.max_tokens, load_format=args.load_format,
                              **_ranks(args))
        out = Path(args.out) if args.out else recorder.golden_path(args.backend, args.dtype)
        recorder.write(doc, out)
        print(f"wrote {out} ({len(doc['traces'])} prompts, {doc['seconds']} s)")
        return 0
    path = Path(args.golden)
    if not path.is_file():
        raise FileNotFoundError(f"golden file {path} does not exist")
    golden = json.loads(path.read_text())
    model = args.model
    recorded = golden.get("model") or {}
    if model is None and recorded.get("repo_dir") and (recorder.REPO_ROOT / recorded["repo_dir"]).is_dir():
        model = str(recorder.REPO_ROOT / recorded["repo_dir"])  # a model shipped in this repository
    elif model is None and recorded.get("dir") and Path(recorded["dir"]).is_dir():
        model = recorded["dir"]  # replay on the model the golden was recorded on
    cand = recorder.record(args.backend, golden["dtype"], model, golden["max_tokens"],
                           load_format=recorded.get("load_format", "auto"), **_ranks(args))
    if recorded.get("config_sha256") and (cand.get("model") or {}).get("config_sha256") != recorded["config_sha256"]:
        print(f"FAIL: the golden was recorded on model {recorded.get('dir')} (config sha256 "
              f"{recorded['config_sha256'][:12]}), not on {(cand.get('model') or {}).get('dir')}; pass --model")
        return 1
    verdicts = compare_docs(golden, cand)
    for i, v in enumerate(verdicts):
        print(f"prompt {i}: {'OK ' if v.ok else 'FAIL'} {v.message}")
    ok = all(v.ok for v in verdicts)
    print(
        f"{'PASS' if ok else 'FAIL'}: {args.backend} ({args.data_parallel_size} rank(s)) vs "
        f"{golden['backend']}-{golden['dtype']} "
        f"({'tokens identical' if golden['dtype'] == 'float32' else 'logprobs-close'} rule)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
