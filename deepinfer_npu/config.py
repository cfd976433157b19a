"""Engine configuration: the user-facing knobs of ``LLM(...)`` / ``LLMEngine``, validated once.

Every invalid value raises ``ValueError`` naming the parameter, the value and the allowed range, before any model
or device work starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

REFERENCE_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "reference"

_DTYPES = ("auto", "float32", "bfloat16")
# drafts + 1 <= 16: the Ascend fused attention takes at most 16 query tokens per request.
MAX_SPECULATIVE_TOKENS = 15
WEIGHTS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class EPLBConfig:
    """The expert-parallel load balancer (``deepinfer_npu/eplb``, docs/eplb.md).

    ``redundant_experts_per_rank``: extra expert slots per rank for replicas of hot experts; the deployment holds
    the smallest number of redundant experts not below ``redundant_experts_per_rank * ranks`` that makes the
    physical expert count divisible by the ranks. The placement is recomputed every ``rebalance_interval`` model
    steps from the tokens each expert received over the last ``window_size`` steps (``window_size <=
    rebalance_interval``). Defaults: DeepSeek's online decode setting; ``EPLBConfig.prefill()`` gives its prefill
    one (4 redundant per rank, window 100, every 1000 steps).
    """

    redundant_experts_per_rank: int = 1
    window_size: int = 1000
    rebalance_interval: int = 10000

    @classmethod
    def decode(cls) -> EPLBConfig:
        return cls(redundant_experts_per_rank=1, window_size=1000, rebalance_interval=10000)

    @classmethod
    def prefill(cls) -> EPLBConfig:
        return cls(redundant_experts_per_rank=4, window_size=100, rebalance_interval=1000)

    def __post_init__(self) -> None:
        for name, low in (("redundant_experts_per_rank", 0), ("window_size", 1), ("rebalance_interval", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"EPLBConfig.{name} must be an integer >= {low}, got {value!r}")
        if self.window_size > self.rebalance_interval:
            raise ValueError(f"EPLBConfig.window_size={self.window_size} exceeds rebalance_interval="
                             f"{self.rebalance_interval}: the load window is counted inside one placement period")


@dataclass
class EngineConfig:
    """Arguments of the offline engine (vLLM-style names where vLLM has one).

    ``model=None`` selects the reference model shipped in the package. ``max_model_len=None`` takes the model's
    ``max_position_embeddings``. ``num_kv_blocks=None`` sizes the paged KV pool from ``kv_cache_memory_bytes`` (CPU)
    or the device's free memory times ``gpu_memory_utilization`` (device backends). ``enable_graphs``: decode steps
    replay captured graphs (``worker/decode_graphs.py``) on backends whose ``graph_runner()`` gives a
    ``hal.graph_runner.GraphRunner``; ``None`` takes the backend's default (``Backend.graphs_by_default``: on for
    CUDA), ``False`` forces eager decode. ``kernel_warmup``: compile every kernel variant the steps can reach at
    start-up (``KernelSet.warmup``), not at its first use. ``max_num_batched_tokens=None`` takes the backend's
    default (``Backend.default_max_num_batched_tokens``: 16384 on CUDA, where 4096-token prefill steps were bound
    by the host's launches, 4096 elsewhere); the engine writes the value it took back here.
    """

    model: str | os.PathLike | None = None
    backend: str = "auto"
    dtype: str = "auto"
    # "auto" (safetensors) | "dummy" (random weights from config.json, drawn on the device: fast) | "dummy_portable"
    # (the same random weights on every backend: drawn on the CPU, then copied; parity runs at real dims)
    load_format: str = "auto"
    # None: the checkpoint's precision (FP8 checkpoints dequantised at load); "fp8": FP8 block-scaled weights
    # (kept from an FP8 checkpoint, or quantised at load); "w8a8": INT8 per-channel weights quantised at load
    # (model_executor/quantization)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto": the model dtype
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: the backend's (Backend.default_max_num_batched_tokens)
    max_num_prompts: int = 0  # 0: same as max_num_seqs
    prefill_max_sum_seqlen_k: int = 0  # 0: unlimited
    block_size: int = 64
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.85
    state_slot_ratio: float = 1.2
    seed: int = 0
    enable_chunked_prefill: bool = True
    stop_preempted_request: bool = True
    prefill_attempt_interval: int = 70
    prefill_any_attempt_interval: int = 100
    zero_overhead_scheduling: bool = True
    speculative_method: str | None = None
    speculative_model: str | os.PathLike | None = None  # DFlash drafter dir (default: <model>/dflash)
    num_speculative_tokens: int = 5
    varlen_verification: bool = True
    # Decode steps replayed from captured graphs (one per total_q size, worker/decode_graphs.py) on backends with
    # a graph runner; None (default): the backend's choice (on for CUDA, off elsewhere); False: always eager.
    # graph_capture: "auto" (all at start-up when there are at most STARTUP_CAPTURE_MAX_GRAPHS sizes, else lazy) |
    # "lazy" (at a size's first step) | "startup" (all).
    enable_graphs: bool | None = None
    graph_capture: str = "auto"
    # Compile every kernel variant the engine can reach at start-up (KernelSet.warmup: CUDA's TileLang kernels),
    # after the model is loaded and before graphs are captured; False: each compiles at its first use.
    kernel_warmup: bool = True
    # Data-parallel ranks on this host: one process and one device each (deepinfer_npu/distributed/dp_engine.py);
    # every wait across processes gives up after distributed_timeout_s with an error naming the rank.
    data_parallel_size: int = 1
    distributed_timeout_s: float = 300.0
    # With data_parallel_size > 1: the routed experts are sharded over the ranks (expert parallelism, the ranks
    # step in lockstep); False: every rank holds every expert and steps on its own.
    enable_expert_parallel: bool = True
    # Several nodes, torchrun's conventions: each node runs data_parallel_size / nnodes ranks (global rank =
    # node_rank * ranks_per_node + local rank, device = local rank); node 0 hosts the front-end and the rendezvous
    # at master_addr:master_port (None: 29500, torchrun's default), the other nodes serve headless
    # (deepinfer_npu/distributed/node_server.py). One node: master_addr None = 127.0.0.1, master_port None = a free
    # port.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    # Expert-parallel load balancing (needs expert parallelism): replicas of hot experts and periodic re-placement;
    # eplb_config None with enable_eplb: EPLBConfig() (the decode setting).
    enable_eplb: bool = False
    eplb_config: EPLBConfig | None = None
    # Test and benchmark hook, expert parallelism only: router logit of expert e lowered by
    # moe_routing_skew * ln(1 + e) (Zipf-like load on the low-numbered experts). Changes the model's outputs.
    moe_routing_skew: float = 0.0

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        def non_negative(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")

        for name in ("max_num_seqs", "block_size", "prefill_attempt_interval",
                     "prefill_any_attempt_interval", "kv_cache_memory_bytes", "data_parallel_size"):
            positive(name)
        if self.max_num_batched_tokens is not None:
            positive("max_num_batched_tokens")
        for name in ("max_num_prompts", "prefill_max_sum_seqlen_k", "seed"):
            non_negative(name)
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks")
            if self.num_kv_blocks < 2:
                raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy", "dummy_portable"):
            raise ValueError(f"load_format must be 'auto', 'dummy' or 'dummy_portable', got {self.load_format!r}")
        if self.quantization not in (None, "fp8", "w8a8"):
            raise ValueError(f"quantization must be None, 'fp8' or 'w8a8', got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' (the model dtype) or 'fp8' (packed e4m3 latent rows "
                             f"with per-128 scales), got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.state_slot_ratio >= 1.0:
            raise ValueError(f"state_slot_ratio must be >= 1.0, got {self.state_slot_ratio}")
        if self.speculative_method not in (None, "mtp", "dflash"):
            raise ValueError(f"speculative_method must be None, 'mtp' or 'dflash', got {self.speculative_method!r}")
        if self.speculative_model is not None and self.speculative_method != "dflash":
            raise ValueError(f"speculative_model={str(self.speculative_model)!r} is only used by "
                             f"speculative_method='dflash', got speculative_method={self.speculative_method!r}")
        limit, why = self.speculative_token_limit()
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= limit:
            raise ValueError(f"num_speculative_tokens must be in [1, {limit}] ({why}), got {k!r}")
        if self.enable_graphs is not None and not isinstance(self.enable_graphs, bool):
            raise ValueError(f"enable_graphs must be True, False or None (the backend's default), "
                             f"got {self.enable_graphs!r}")
        if not isinstance(self.kernel_warmup, bool):
            raise ValueError(f"kernel_warmup must be True or False, got {self.kernel_warmup!r}")
        if self.graph_capture not in ("auto", "lazy", "startup"):
            raise ValueError(f"graph_capture must be 'auto', 'lazy' or 'startup', got {self.graph_capture!r}")
        if not isinstance(self.distributed_timeout_s, (int, float)) or not self.distributed_timeout_s > 1:
            raise ValueError(f"distributed_timeout_s must be a number of seconds > 1, got {self.distributed_timeout_s!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}")
        self._check_nodes()
        self._check_eplb()
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend must be a non-empty string, got {self.backend!r}")

    def _check_nodes(self) -> None:
        for name in ("nnodes", "node_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "nnodes" else 0):
                kind = "a positive" if name == "nnodes" else "a non-negative"
                raise ValueError(f"{name} must be {kind} integer, got {value!r}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} is out of range for nnodes={self.nnodes} "
                             f"(node ranks are 0..{self.nnodes - 1})")
        if self.data_parallel_size % self.nnodes:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} is not divisible by nnodes={self.nnodes} "
                             "(every node runs data_parallel_size / nnodes ranks)")
        if self.master_addr is not None and (not isinstance(self.master_addr, str) or not self.master_addr):
            raise ValueError(f"master_addr must be a host name or address, got {self.master_addr!r}")
        if self.nnodes > 1 and self.master_addr is None:
            raise ValueError(f"nnodes={self.nnodes} needs master_addr: the address of node 0, which hosts the "
                             "front-end and the rendezvous (every node passes the same one)")
        port = self.master_port
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
            raise ValueError(f"master_port must be a TCP port in [1, 65535], got {port!r}")

    def _check_eplb(self) -> None:
        if not isinstance(self.enable_eplb, bool):
            raise ValueError(f"enable_eplb must be True or False, got {self.enable_eplb!r}")
        if self.eplb_config is not None and not isinstance(self.eplb_config, EPLBConfig):
            raise ValueError(f"eplb_config must be a deepinfer_npu.config.EPLBConfig, got {self.eplb_config!r}")
        if self.eplb_config is not None and not self.enable_eplb:
            raise ValueError("eplb_config is set but enable_eplb is False; pass enable_eplb=True")
        expert_parallel = self.data_parallel_size > 1 and self.enable_expert_parallel
        if self.enable_eplb and not expert_parallel:
            raise ValueError("enable_eplb needs expert parallelism: data_parallel_size > 1 (got "
                             f"{self.data_parallel_size}) with enable_expert_parallel=True (got "
                             f"{self.enable_expert_parallel})")
        skew = self.moe_routing_skew
        if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not 0 <= skew < 1e3:
            raise ValueError(f"moe_routing_skew must be a number in [0, 1000), got {skew!r}")
        if skew and not expert_parallel:
            raise ValueError(f"moe_routing_skew={skew} acts on the expert-parallel MoE path only: it needs "
                             "data_parallel_size > 1 with enable_expert_parallel=True")

    @property
    def eplb(self) -> EPLBConfig | None:
        """The load balancer's settings, None when it is off."""
        return (self.eplb_config or EPLBConfig()) if self.enable_eplb else None

    @property
    def ranks_per_node(self) -> int:
        return self.data_parallel_size // self.nnodes

    def speculative_token_limit(self) -> tuple[int, str]:
        """The most drafts per step this configuration allows, and why (one statement of every limit)."""
        why = "drafts + 1 <= 16 query tokens per request; the limit of the Ascend fused attention"
        if self.speculative_method != "dflash":
            return MAX_SPECULATIVE_TOKENS, why
        drafter_config = self.drafter_dir / "dflash_config.json"
        try:
            trained = int(json.loads(drafter_config.read_text(encoding="utf-8"))["num_speculative_tokens"])
        except (OSError, ValueError, KeyError, TypeError):
            return MAX_SPECULATIVE_TOKENS, why  # a missing/broken drafter is reported when it is loaded
        if trained < MAX_SPECULATIVE_TOKENS:
            return trained, f"the DFlash drafter's trained block, {drafter_config}"
        return MAX_SPECULATIVE_TOKENS, why

    @property
    def drafter_dir(self) -> Path:
        return Path(self.speculative_model) if self.speculative_model else self.model_dir / "dflash"

    def check_model_dir(self) -> None:
        """The model directory exists and holds ``config.json``; raises ``FileNotFoundError`` otherwise."""
        path = self.model_dir
        if path.is_file():
            raise FileNotFoundError(f"model {path} is a file, expected a directory (HF layout: config.json, "
                                    "*.safetensors, tokenizer.json)")
        if not path.is_dir():
            raise FileNotFoundError(f"model directory not found: {path}")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")

    def check_weights(self) -> None:
        """With ``load_format="auto"`` the model directory holds the weights (every shard its index lists);
        raises ``FileNotFoundError`` naming the missing files, before anything is allocated."""
        path = self.model_dir
        if self.load_format != "auto":
            return  # random weights: nothing to read
        index = path / WEIGHTS_INDEX
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return  # a malformed index is reported by the loader, with its details
            missing = [f for f in shards if not (path / f).is_file()]
            if missing:
                raise FileNotFoundError(f"model directory {path} lacks {len(missing)} weight shard(s) listed in "
                                        f"{WEIGHTS_INDEX}: {', '.join(missing[:5])}")
        elif not any(path.glob("*.safetensors")):
            raise FileNotFoundError(
                f"model directory {path} has no weights: expected model.safetensors (or *.safetensors shards with "
                f"{WEIGHTS_INDEX}); found {', '.join(sorted(p.name for p in path.iterdir())) or 'nothing'}. "
                "load_format='dummy' runs with random weights")

    @property
    def model_dir(self) -> Path:
        return Path(self.model) if self.model is not None else REFERENCE_MODEL_DIR

    @property
    def nextn(self) -> int:
        return self.num_speculative_tokens if self.speculative_method else 0
