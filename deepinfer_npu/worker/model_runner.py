"""ModelRunner: owns the model, the paged KV caches and every device tensor of a step.

It turns a ``StepPlan`` (plain host data from the scheduler) into device inputs and ``AttentionMetadata``, launches
the forward, and returns the logits of the rows that are sampled. It never decides *what* to run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from deepinfer_npu.config import EngineConfig
from deepinfer_npu.model_executor.loader import load_weights
from deepinfer_npu.model_executor.model_config import DeepseekModelConfig
from deepinfer_npu.model_executor.models import build_model
from deepinfer_npu.model_executor.quantization.kv_fp8 import latent_bytes_per_token, latent_cache_layout
from deepinfer_npu.worker.step_io import StepPlan

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(requested: str, backend, model_config: DeepseekModelConfig) -> torch.dtype:
    """``auto``: float32 on the CPU reference backend (exactness), the checkpoint's dtype (bf16) on devices."""
    if requested != "auto":
        return _DTYPES[requested]
    if backend.device_type == "cpu":
        return torch.float32
    ckpt = str(getattr(model_config, "torch_dtype", "bfloat16") or "bfloat16").replace("torch.", "")
    return torch.float32 if ckpt == "float32" else torch.bfloat16


class ModelRunner:
    """Builds the model on ``backend`` and runs forwards over the paged latent KV cache."""

    def __init__(self, config: EngineConfig, backend, model_config: DeepseekModelConfig,
                 on_model_built: Callable[[ModelRunner], None] | None = None) -> None:
        """``on_model_built(runner)``: called once the model's modules and parameters exist, before the weights are
        loaded into them (the engine starts the kernel builds there, to overlap the load)."""
        self.config = config
        self.backend = backend
        self.device = backend.device
        self.model_config = model_config
        self.dtype = resolve_dtype(config.dtype, backend, model_config)
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings

        t0 = time.perf_counter()
        self.model = build_model(model_config, backend, self.dtype, quantization=config.quantization)
        if on_model_built is not None:
            on_model_built(self)
        if config.load_format in ("dummy", "dummy_portable"):
            self.model.init_dummy_weights(seed=config.seed, portable=config.load_format == "dummy_portable")
        else:
            load_weights(self.model, config.model_dir)
        self.model.eval()
        self.load_seconds = time.perf_counter() - t0

        if config.kv_cache_dtype == "fp8" and backend.fp8_kv_cache_unsupported:
            raise ValueError(f"kv_cache_dtype='fp8' is not supported on the {backend.name} backend: "
                             f"{backend.fp8_kv_cache_unsupported}")
        # the cache row: L + R values of the model dtype, or a packed FP8 row of bytes (kv_cache_dtype="fp8")
        self.kv_dim, self.kv_cache_dtype = latent_cache_layout(
            model_config.kv_lora_rank, model_config.qk_rope_head_dim, config.kv_cache_dtype, self.dtype)
        self.num_cache_layers = self.model.num_kv_cache_layers
        self.num_kv_blocks = self._decide_num_kv_blocks()
        self.num_state_slots = 0  # set by the engine from the scheduler config
        self.kv_caches = [
            torch.zeros(self.num_kv_blocks, self.block_size, self.kv_dim, dtype=self.kv_cache_dtype,
                        device=self.device)
            for _ in range(self.num_cache_layers)
        ]
        if config.kv_cache_dtype == "fp8":
            logger.info("%s", self.kv_cache_report())

    # ---------------------------------------------------------------- memory
    def kv_cache_report(self) -> str | None:
        """With ``kv_cache_dtype="fp8"``: a sentence on the packed rows and the tokens per GiB they gain."""
        if self.config.kv_cache_dtype != "fp8":
            return None
        cfg = self.model_config
        plain = latent_bytes_per_token(cfg.kv_lora_rank, cfg.qk_rope_head_dim, "auto", self.dtype)
        fp8 = latent_bytes_per_token(cfg.kv_lora_rank, cfg.qk_rope_head_dim, "fp8", self.dtype)
        layers = self.num_cache_layers + (cfg.num_nextn_predict_layers
                                          if self.config.speculative_method == "mtp" else 0)
        return (f"KV cache fp8: {fp8} bytes a token and layer instead of {plain} ({str(self.dtype).split('.')[-1]}), "
                f"{2**30 / (fp8 * layers):.0f} tokens per GiB instead of {2**30 / (plain * layers):.0f} "
                f"({plain / fp8:.2f}x); {self.num_kv_blocks} blocks of {self.block_size} tokens")

    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        layers = self.num_cache_layers
        if self.config.speculative_method == "mtp":
            layers += self.model_config.num_nextn_predict_layers  # the MTP drafter's caches share the pool size
        return layers * self.block_size * self.kv_dim * itemsize

    def _decide_num_kv_blocks(self) -> int:
        blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.backend.device_type == "cpu":
            budget = self.config.kv_cache_memory_bytes
        else:
            free, _total = self.backend.memory_info()
            budget = int(free * self.config.gpu_memory_utilization)
        wanted = self.config.max_num_seqs * blocks_per_seq + 1
        fits = budget // self.bytes_per_block()
        if fits < blocks_per_seq + 1:
            raise ValueError(
                f"KV cache budget of {budget / 2**20:.1f} MiB holds {fits} blocks of {self.block_size} tokens, "
                f"fewer than one sequence of max_model_len={self.max_model_len} needs ({blocks_per_seq} + 1 "
                f"reserved); lower max_model_len or raise the KV memory budget"
            )
        return int(min(wanted, fits))

    # ---------------------------------------------------------------- step
    def apply_block_ops(self, plan: StepPlan, extra_caches: list[torch.Tensor] | None = None) -> None:
        """Copy-on-write of forked sequences' last blocks (main and drafter caches), before any forward."""
        if plan.clone_blocks.size:
            src = torch.from_numpy(plan.clone_blocks[:, 0].astype(np.int64)).to(self.device)
            dst = torch.from_numpy(plan.clone_blocks[:, 1].astype(np.int64)).to(self.device)
            # The backend copies in its own cache layout (Ascend reinterprets the storage as split caches).
            self.backend.kernels.copy_kv_blocks([*self.kv_caches, *(extra_caches or [])], src, dst)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attn, capture_layer_ids=None):
        """Run the main model: final-normed hidden ``[T, D]`` (and the captured layer outputs when asked)."""
        if capture_layer_ids:
            return self.model(input_ids, attn.positions, attn, self.kv_caches, capture_layer_ids=capture_layer_ids)
        return self.model(input_ids, attn.positions, attn, self.kv_caches), None

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """fp32 logits ``[len(rows), vocab]`` (all rows when ``rows`` is None)."""
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        return self.model.compute_logits(hidden)
