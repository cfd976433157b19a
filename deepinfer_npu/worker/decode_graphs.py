"""Decode forwards replayed from captured graphs, one per total_q size (seed §7.2), with static input buffers.

What is graphed: the main model's decode forward, embedding -> layers -> final norm -> logits of every row (and
DFlash's ``capture_layer_ids`` hidden states), then the drafter's main-forward hook when it offers a device-only one
(``Drafter.main_forward_hook_in_graph``: DFlash's ring write). Metadata corrections (``zos_fixup``), verification,
drafting and sampling stay eager, on the real (unpadded) ``AttentionMetadata``.

A step of ``T`` tokens in ``B`` rows runs in the graph of the smallest size ``S >= T``, which has ``S`` rows and
``S`` tokens. Its static buffers hold the step's device tensors in their first rows/tokens; the rest is padding:

* ``P = S - T`` padding rows of one token each: ``seqlens_q = seqlens_k = 1``, an all-zero block-table row (block
  0, the reserved padding block no sequence owns), position 0, token id 0, and slot ``-1`` (negative = not
  written: the CPU reference skips it, the CUDA sync-free write rewrites slot 0 with its own contents). A padding
  token therefore reads block 0 only and writes nothing outside block 0.
* the remaining ``S - B - P`` rows are empty (``seqlens_q = seqlens_k = 0``): they own no tokens and read nothing.
* the drafter hook's state slot of a padding token is 0 (the dummy slot, which no sequence owns).

Host lengths are fixed per graph (kernels may bake them in): ``max_seqlen_q = k + 1`` and ``max_seqlen_k`` the
block-table capacity; ``AttentionMetadata.host`` carries only these bounds (per-row host lists are empty), so a
backend whose kernels need exact host lists per row (Ascend's FIA) gets the step's real ``HostLengths`` through
``GraphRunner.set_step_host_lengths`` before every capture and replay and patches them in itself.
The CUDA MLA decode kernel bakes in the row count, the table width and the query-length bucket of
``max_seqlen_q`` and reads every length from the device, so any step with ``max q <= k + 1`` is safe to replay.
State slots are not used by the main forward; the drafter hooks receive the real rows only (slot of each row).

Outputs (hidden, captured layers, logits) are views into the graph's static outputs: valid until the next replay,
i.e. through this step's sampling and drafting, which is all the worker needs.

Under expert parallelism a captured graph bakes in the fixed-capacity all-to-all's capacity, so every rank must
replay the graph of the SAME size in a step: the step loop declares ``ep_decode_tokens(agreed, sizes)`` (the graph
size for the group's agreed token count, :func:`ep_decode_tokens`) and every rank pads its own step (a one-row dummy
step included) up to that size. Each graph is captured inside a declaration of its own size.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from deepinfer_npu.distributed.ep_decode_path import agreed_ep_tokens
from deepinfer_npu.distributed.parallel_state import get_expert_parallel
from deepinfer_npu.hal.graph_runner import GraphRunner
from deepinfer_npu.hal.graph_sizes import graph_sizes
from deepinfer_npu.model_executor.attention_metadata import AttentionMetadata, HostLengths

logger = logging.getLogger(__name__)


def ep_decode_tokens(agreed_tokens: int, sizes: list[int] | None) -> int:
    """The token count an expert-parallel decode step declares (``agreed_ep_tokens``): the smallest graph size
    ``>= agreed_tokens`` (every rank replays that graph, or runs eagerly inside the same declaration), or
    ``agreed_tokens`` itself when graphs are off (``sizes`` None) or it exceeds the largest size (eager on every
    rank). Depends only on the group's agreed count and the configured sizes, so every rank computes the same."""
    if isinstance(agreed_tokens, bool) or not isinstance(agreed_tokens, int) or agreed_tokens < 0:
        raise ValueError(f"ep_decode_tokens: agreed_tokens must be a non-negative int, got {agreed_tokens!r}")
    if not sizes or agreed_tokens == 0 or agreed_tokens > sizes[-1]:
        return agreed_tokens
    return next(s for s in sizes if s >= agreed_tokens)


def _main_ep_layers(model) -> int:
    """Expert-parallel MoE layers of the main decode forward (the MTP layers past ``num_hidden_layers`` are not)."""
    layers = list(model.model.layers)[: model.config.num_hidden_layers]
    return sum(getattr(m, "ep_layer", None) is not None for layer in layers for m in layer.modules())


def decode_graph_max_tokens(cfg, k: int) -> int:
    """The largest decode graph of an engine with ``k`` drafts a request: its tokens a step at most."""
    return min(cfg.max_num_batched_tokens, cfg.max_num_seqs * (k + 1))


def graph_table_width(max_model_len: int, block_size: int, extra_width: int = 0) -> int:
    """Block-table width of the decode graphs: room for every key a decode step can hold, ``max_model_len`` plus
    the ``extra_width`` drafts a re-split may add."""
    return math.ceil((max_model_len + extra_width) / block_size) + 1


class DecodeGraphs:
    """Pads a decode step into static buffers and replays (capturing at first use, or all at start-up).

    A lazy capture costs about as much host time as several decode steps (on an H200, ~85 ms a V2-Lite graph against
    12-20 ms steps), and a shrinking batch (the tail of an offline run) asks for a new size every few steps. So a
    step whose size is not captured yet replays a captured graph up to ``MAX_PAD_FRACTION`` larger (padding rows
    cost far less than a capture: the step reads the same weights) until its own size has been asked for
    ``CAPTURE_AFTER`` times; a size the engine keeps coming back to is then captured. Under expert parallelism every
    rank must replay the declared size: no substitution there (ranks capture every size at start-up anyway).
    """

    MAX_PAD_FRACTION = 0.25  # padding rows at most this share of the step's tokens
    CAPTURE_AFTER = 16  # requests for an uncaptured size before it is captured

    def __init__(self, runner, graph_runner: GraphRunner, k: int, max_tokens: int,
                 capture_layer_ids: tuple[int, ...] | None = None, extra_width: int = 0,
                 drafter_hook=None) -> None:
        self.runner = runner
        self.graphs = graph_runner
        self.k = k
        self.sizes = graph_sizes(max_tokens)
        self.disabled: str | None = None  # why graphs were turned off (a failed capture)
        self.capture_s = 0.0  # host seconds spent capturing (the warm-up run included), at start-up or lazily
        self.substituted = 0  # steps that replayed a larger captured graph than their own size
        self._misses: dict[int, int] = {}  # uncaptured size -> steps that asked for it
        self._ep_layers = 0  # expert-parallel MoE layers a replay runs (counted for the group's model steps)
        if get_expert_parallel() is not None:
            self._ep_layers = _main_ep_layers(runner.model)
            # a graph's expert all-to-all must be the fixed-capacity one: larger steps run eagerly on every rank
            limit = getattr(runner.backend.kernels, "ep_fixed_max_tokens", 0)
            fitting = [s for s in self.sizes if s <= limit]
            if not fitting:
                self.disabled = f"no decode graph size within the fixed-capacity dispatch's {limit} tokens"
            self.sizes = fitting or [1]
        self.capture_layer_ids = tuple(capture_layer_ids) if capture_layer_ids else None
        # (captured, positions, slots_per_token) -> None, captured after the forward; needs the captured layers
        self.drafter_hook = drafter_hook if self.capture_layer_ids else None
        bs = runner.block_size
        self.width = graph_table_width(runner.max_model_len, bs, extra_width)
        self.max_seqlen_q = k + 1
        self.max_seqlen_k = self.width * bs
        s, dev = self.sizes[-1], runner.device
        i32, i64 = torch.int32, torch.int64
        with torch.inference_mode():
            self.buf = {
                "input_ids": torch.zeros(s, dtype=i64, device=dev),
                "positions": torch.zeros(s, dtype=i64, device=dev),
                "slot_mapping": torch.full((s,), -1, dtype=i64, device=dev),
                "seqlens_q": torch.ones(s, dtype=i32, device=dev),
                "seqlens_k": torch.ones(s, dtype=i32, device=dev),
                "cu_seqlens_q": torch.arange(s + 1, dtype=i32, device=dev),
                "block_tables": torch.zeros(s, self.width, dtype=i32, device=dev),
            }
            if self.drafter_hook is not None:
                self.buf["slots_per_token"] = torch.zeros(s, dtype=i64, device=dev)
            self._arange = torch.arange(s + 1, dtype=i32, device=dev)
        # What the last ``_fill`` left in the buffers: (size, tokens, rows, hook slots given, table width). The
        # padding a fill writes depends only on the first four, so a step like the last one (steady decode) rewrites
        # its real rows and leaves the padding in place: about a dozen fewer small launches a step. This holds
        # while only ``_fill`` and ``capture_all`` write the buffers (the captured forward and the replays read
        # them).
        self._filled: tuple[int, int, int, bool, int] | None = None

    # ---------------------------------------------------------------- selection
    def size_for(self, num_tokens: int, block_table_width: int) -> int | None:
        """The graph size of a decode step, or None (run eagerly): too many tokens or a too-wide table."""
        if self.disabled or num_tokens > self.sizes[-1] or block_table_width > self.width or num_tokens == 0:
            return None
        return next(s for s in self.sizes if s >= num_tokens)

    def pick(self, num_tokens: int, block_table_width: int) -> int | None:
        """The graph a decode step replays: its own size (``size_for``) when captured, else a captured one at most
        ``MAX_PAD_FRACTION`` larger while the own size has been asked for fewer than ``CAPTURE_AFTER`` times, else
        the own size (captured at this step). None: run eagerly."""
        size = self.size_for(num_tokens, block_table_width)
        if size is None or self.graphs.has(size) or self._ep_layers or get_expert_parallel() is not None:
            return size
        misses = self._misses.get(size, 0) + 1
        if misses < self.CAPTURE_AFTER:
            limit = num_tokens * (1 + self.MAX_PAD_FRACTION)
            larger = [s for s in self.sizes if size < s <= limit and self.graphs.has(s)]
            if larger:
                self._misses[size] = misses
                self.substituted += 1
                return larger[0]
        self._misses.pop(size, None)
        return size

    def _static(self, size: int) -> dict[str, torch.Tensor]:
        return {name: (t[: size + 1] if name == "cu_seqlens_q" else t[:size]) for name, t in self.buf.items()}

    # ---------------------------------------------------------------- the graphed function
    def _forward(self, input_ids, positions, slot_mapping, seqlens_q, seqlens_k, cu_seqlens_q, block_tables,
                 slots_per_token=None):
        host = HostLengths((), (), False, self.max_seqlen_q, self.max_seqlen_k, max_kv_shortfall=None)
        attn = AttentionMetadata(seqlens_q=seqlens_q, seqlens_k=seqlens_k, cu_seqlens_q=cu_seqlens_q,
                                 block_tables=block_tables, slot_mapping=slot_mapping, positions=positions,
                                 max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k, is_prefill=False,
                                 host=host)
        model = self.runner.model
        if self.capture_layer_ids:
            hidden, captured = model(input_ids, positions, attn, self.runner.kv_caches,
                                     capture_layer_ids=self.capture_layer_ids)
        else:
            hidden, captured = model(input_ids, positions, attn, self.runner.kv_caches), None
        if self.drafter_hook is not None and captured is not None:
            self.drafter_hook(captured, positions, slots_per_token)
        return {"hidden": hidden, "captured": captured, "logits": model.compute_logits(hidden)}

    # ---------------------------------------------------------------- step
    def _fill(self, size: int, ids: torch.Tensor, attn: AttentionMetadata,
              slots_per_token: torch.Tensor | None = None) -> None:
        """Write the step into the static buffers of ``size``; pad as the module docstring says (no host reads)."""
        st = self._static(size)
        t, b = attn.num_tokens, attn.num_seqs
        p = size - t
        width = attn.block_tables.shape[1]
        key = (size, t, b, slots_per_token is not None)
        last, self._filled = self._filled, None  # a fill that raises part-way leaves no state to trust
        pad = last is None or last[:4] != key  # the padding of this shape is not in the buffers yet
        st["input_ids"][:t].copy_(ids)
        st["positions"][:t].copy_(attn.positions)
        st["slot_mapping"][:t].copy_(attn.slot_mapping)
        for name, real in (("seqlens_q", attn.seqlens_q), ("seqlens_k", attn.seqlens_k)):
            st[name][:b].copy_(real)
        st["cu_seqlens_q"][: b + 1].copy_(attn.cu_seqlens_q)
        if pad:
            st["input_ids"][t:].zero_()
            st["positions"][t:].zero_()
            st["slot_mapping"][t:].fill_(-1)
            for name in ("seqlens_q", "seqlens_k"):
                st[name][b : b + p].fill_(1)
                st[name][b + p :].zero_()
            cu = st["cu_seqlens_q"]
            cu[b + 1 : b + 1 + p].copy_(self._arange[1 : p + 1] + t)
            cu[b + 1 + p :].fill_(size)
        bt = st["block_tables"]
        if last is None or last[0] != size or last[2] > b or last[4] > width:  # the last rows not all overwritten
            bt.zero_()
        bt[:b, :width].copy_(attn.block_tables)
        if "slots_per_token" in st:  # None (varlen's timing runs): every token writes the dummy slot 0
            if slots_per_token is None:
                if pad:
                    st["slots_per_token"].zero_()
            else:
                st["slots_per_token"][:t].copy_(slots_per_token)
                if pad:
                    st["slots_per_token"][t:].zero_()
        self._filled = (*key, width)

    def _capture(self, size: int, static: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        try:
            self.graphs.capture(size, self._forward, static)
        finally:
            self.capture_s += time.perf_counter() - t0

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size now (start-up), on all-padding inputs (they write nothing outside block 0), largest
        first: under expert parallelism every rank captures the same sizes in the same order, each inside a
        declaration of its size (the capacity its all-to-all bakes in)."""
        self._filled = None  # the buffers now hold all-padding inputs: the next step fills everything
        for size in reversed(self.sizes):  # largest first: later graphs reuse the pool
            if not self.disabled and not self.graphs.has(size):
                st = self._static(size)
                st["input_ids"].zero_()
                st["positions"].zero_()
                st["slot_mapping"].fill_(-1)
                st["seqlens_q"].fill_(1)
                st["seqlens_k"].fill_(1)
                st["cu_seqlens_q"].copy_(self._arange[: size + 1])
                st["block_tables"].zero_()
                if "slots_per_token" in st:
                    st["slots_per_token"].zero_()
                try:
                    self.graphs.set_step_host_lengths(size, None, self.k)
                    with agreed_ep_tokens(size):
                        self._capture(size, st)
                except Exception as e:  # noqa: BLE001 - as at a lazy capture: decode stays correct, only eager
                    self.disabled = f"graph of size {size} failed: {type(e).__name__}: {str(e)[:300]}"
                    logger.warning("decode graphs disabled: %s", self.disabled)

    @torch.inference_mode()
    def run(self, size: int, ids: torch.Tensor, attn: AttentionMetadata,
            slots_per_token: torch.Tensor | None = None):
        """-> ``(hidden [T, D], captured {layer: [T, D]} | None, logits [T, V])`` for the step's real tokens, or
        None when capturing ``size`` (or handing the runner this step's host lengths) failed (graphs are then off
        for good; the caller runs the step eagerly). With a drafter hook (``drafter_hook``), ``slots_per_token``
        [T] is the state slot of each token and the replay has already done the hook's work."""
        self._fill(size, ids, attn, slots_per_token)
        try:
            self.graphs.set_step_host_lengths(size, attn.host, self.k)
            if not self.graphs.has(size):
                logger.info("capturing the decode graph of %d tokens", size)
                with agreed_ep_tokens(size):  # under expert parallelism the step already declared this size
                    self._capture(size, self._static(size))
        except Exception as e:  # noqa: BLE001 - e.g. an op that syncs; decode stays correct, only eager
            self.disabled = f"graph of size {size} failed: {type(e).__name__}: {str(e)[:300]}"
            logger.warning("decode graphs disabled: %s", self.disabled)
            return None
        out = self.graphs.replay(size)
        ep = get_expert_parallel()
        if ep is not None:  # the replay ran the MoE layers, not their Python, which counts forwards for the
            ep.forwards += self._ep_layers  # group's model steps (ep_moe.EPGroup.step_boundary)
        t = attn.num_tokens
        captured = None if out["captured"] is None else {i: c[:t] for i, c in out["captured"].items()}
        return out["hidden"][:t], captured, out["logits"][:t]
