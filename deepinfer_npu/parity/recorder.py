"""Run the fixed prompts on a backend and produce a trace document (tokens + top-5 logprobs + provenance)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

from deepinfer_npu.config import REFERENCE_MODEL_DIR

from . import prompts as P

FORMAT_VERSION = 1
GOLDEN_DIR = Path(__file__).resolve().parents[2] / "parity_tests" / "golden"


def default_model_dir() -> Path:
    return REFERENCE_MODEL_DIR


REPO_ROOT = GOLDEN_DIR.parents[1]


def model_fingerprint(model_dir: Path, load_format: str = "auto") -> dict:
    """Config hash and weight file sizes (none for seeded random weights): a golden is only comparable on the same
    model. ``repo_dir``: the directory relative to the repository when it lies inside it (parity models at real
    dims ship as config.json only, with ``load_format="dummy_portable"``)."""
    cfg = (model_dir / "config.json").read_bytes()
    weights = [] if load_format.startswith("dummy") else sorted(p.name for p in model_dir.glob("*.safetensors"))
    sizes = {w: (model_dir / w).stat().st_size for w in weights}
    doc = {"dir": str(model_dir), "config_sha256": hashlib.sha256(cfg).hexdigest(), "weights": sizes,
           "load_format": load_format}
    try:
        doc["repo_dir"] = str(Path(model_dir).resolve().relative_to(REPO_ROOT))
    except ValueError:
        pass
    return doc


def environment(backend) -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "backend": backend.name,
        "device": str(backend.device),
        "cpu_count": os.cpu_count(),
    }
    if backend.name == "ascend":
        from deepinfer_npu.backends.ascend import runtime

        info.update(runtime.version_info())
        info["ascend_profile"] = backend.kernels.op_report().get("profile")
    elif backend.device_type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(backend.device_index)
        info["cuda"] = torch.version.cuda
    return info


def record(
    backend: str,
    dtype: str,
    model_dir: Path | None = None,
    max_tokens: int = P.MAX_TOKENS,
    block_size: int = 64,
    **engine_kwargs,
) -> dict:
    """Greedy ``max_tokens`` per prompt with top-5 logprobs on ``backend``; returns the trace document."""
    from deepinfer_npu import LLM, SamplingParams

    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"no model at {model_dir} (config.json missing); pass --model DIR")
    t0 = time.time()
    llm = LLM(str(model_dir), backend=backend, dtype=dtype, block_size=block_size, **engine_kwargs)
    engine = llm.llm_engine
    if engine.tokenizer is not None:
        inputs: list = list(P.TEXT_PROMPTS)
        shown = list(P.TEXT_PROMPTS)
    else:
        ids = P.token_prompts(engine.vocab_size)
        inputs = [{"prompt_token_ids": p} for p in ids]
        shown = ids
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=P.TOP_LOGPROBS, ignore_eos=True)
    outputs = llm.generate(inputs, params, use_tqdm=False)
    shutdown = getattr(llm.llm_engine, "shutdown", None)
    if shutdown is not None:  # data-parallel ranks stop now rather than at exit
        shutdown()
    traces = []
    for prompt, out in zip(shown, outputs):
        comp = out.outputs[0]
        top = []
        for pos in comp.logprobs or []:
            ranked = sorted(
                ((lp.rank, tok, lp.logprob) for tok, lp in pos.items() if lp.rank <= P.TOP_LOGPROBS)
            )
            top.append([[tok, lp] for _rank, tok, lp in ranked])
        traces.append(
            {
                "prompt": prompt,
                "prompt_token_ids": list(out.prompt_token_ids),
                "tokens": list(comp.token_ids),
                "top5": top,
            }
        )
    return {
        "format": FORMAT_VERSION,
        "backend": backend,
        "dtype": dtype,
        "max_tokens": max_tokens,
        "model": model_fingerprint(model_dir, engine_kwargs.get("load_format", "auto")),
        "environment": {**environment(engine.backend),
                        "data_parallel_size": int(engine_kwargs.get("data_parallel_size", 1))},
        "op_report": engine.backend.op_report(),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - t0, 2),
        "traces": traces,
    }


def golden_path(backend: str, dtype: str) -> Path:
    return GOLDEN_DIR / f"{backend}-{dtype}.json"


def write(doc: dict, path: Path) -> Path:
    """The golden as JSON: the header indented, each trace on one line (a prompt's change is one line of a diff,
    and the file half the size of an indented one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not doc.get("traces"):
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return path
    head = json.dumps({k: v for k, v in doc.items() if k != "traces"}, indent=1)
    traces = ",\n  ".join(json.dumps(t) for t in doc["traces"])
    path.write_text(head[: -len("\n}")] + f',\n "traces": [\n  {traces}\n ]\n}}\n')
    return path


def as_rule_input(trace: dict) -> dict:
    """``{"tokens", "top"}`` for :func:`.rules.compare_trace` (ids only, most likely first)."""
    return {"tokens": trace["tokens"], "top": [[tok for tok, _lp in pos] for pos in trace["top5"]]}
