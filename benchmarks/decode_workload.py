"""The synthetic decode workload the decode benchmarks share: DeepSeek-V2-Lite-shaped configs with random weights
(``load_format="dummy"``), deterministic prompts, and the device synchronisation their timers need."""

from __future__ import annotations

import json
import os
import tempfile
import time

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "n_shared_experts": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": False, "topk_method": "greedy", "scoring_func": "softmax",
    "moe_layer_freq": 1, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16", "initializer_range": 0.02,
}
# DeepSeek-V3's dims (hidden 7168, 128 heads, q-LoRA 1536, 256 routed experts, 8 active, 1 shared, sigmoid scores
# with grouped noaux_tc routing) at 4 layers: 1 dense + 3 MoE (the real model: 3 dense + 58 MoE), so that most of the
# measured step is the MoE path. MTP layers are left out (num_nextn_predict_layers 0): plain decode.
V3_4L = dict(V2_LITE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
             hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4,
             num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, n_routed_experts=256,
             num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=1,
             routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
             max_position_embeddings=16384, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1)
# Same structure, tiny sizes: the CPU rehearsal of every code path (engine, transformers, roofline).
TINY = dict(V2_LITE, vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1)
#: the shapes a benchmark's --shape chooses from, and the name its rows give the model
SHAPES = {"v2-lite": (V2_LITE, "deepseek-v2-lite-shape-dummy"), "v3-4l": (V3_4L, "deepseek-v3-shape-4l-dummy"),
          "tiny": (TINY, "tiny-v2-dummy")}


def write_model_dir(cfg: dict, prefix: str) -> str:
    """A temporary model directory holding only ``config.json`` (the engine's dummy load needs nothing else)."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    return tmp


def prompts_for(batch: int, prompt_len: int, vocab: int, salt: int = 0) -> list[list[int]]:
    return [[(7 * i + 13 * b + 101 * salt) % (vocab - 3) + 3 for i in range(prompt_len)] for b in range(batch)]


def sync(device_type: str) -> None:
    import torch

    if device_type == "cuda":
        torch.cuda.synchronize()


def release_device_memory(device_type: str) -> None:
    """After a benchmark dropped its engine or model: collect it and return the device's cached blocks, so the
    next engine of the run starts from the same free memory."""
    import gc

    gc.collect()
    if device_type == "cuda":
        import torch

        torch.cuda.empty_cache()


def append_jsonl(path: str | None, rows: list[dict]) -> None:
    """Append the rows to ``path`` as JSON lines (``--out``); nothing without a path."""
    if path:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def warmup_summary(engine) -> str:
    """The engine's start-up kernel warm-up (``EngineConfig.kernel_warmup``, ``KernelSet.warmup``), for the logs."""
    summary = getattr(engine.worker, "kernel_warmup", None)
    return f"engine warm-up: {summary}" if summary is not None else "engine warm-up off (kernel_warmup=False)"


def pdl_enabled() -> bool:
    """kernels_cuda/_pdl.py's switch (its default included), for the result rows."""
    from deepinfer_npu.kernels_cuda._pdl import pdl_enabled as enabled

    return enabled()


def pdl_off() -> list[str]:
    """The kernel-name prefixes built without PDL (``DEEPINFER_PDL_OFF``, its default included; ``[""]``: all), for
    the result rows."""
    from deepinfer_npu.kernels_cuda._pdl import off_prefixes

    return list(off_prefixes())


def stamped_logger():
    """-> log(msg): prints msg after the seconds since this call, flushed (the benchmarks' progress lines)."""
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    return log


def mla_projection_params(cfg: dict) -> dict[str, int]:
    """Weights a layer's MLA projections hold, by part: ``q`` (q_proj, or q_a_proj + q_b_proj with a q-LoRA),
    ``kv_a``, ``kv_b`` (W_UK and W_UV) and ``o``."""
    d, h = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v, lrank = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    if cfg.get("q_lora_rank"):
        q = cfg["q_lora_rank"] * d + h * (nope + rope) * cfg["q_lora_rank"]
    else:
        q = h * (nope + rope) * d
    return {"q": q, "kv_a": (lrank + rope) * d, "kv_b": h * (nope + v) * lrank, "o": d * h * v}
