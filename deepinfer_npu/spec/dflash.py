"""DFlash parallel drafter: one non-causal forward over ``[golden, noise x (k-1)]`` gives k drafts.

Design (seed §7.1, DESIGN.md §6). The target's main forward captures the residual stream after the decoder layers
``target_layer_ids``; for every token it processes (prefill and decode, accepted or not) the drafter concatenates
those hidden states, projects and normalises them (``fc`` then ``fc_norm``) into a context vector ``c_t`` and writes
each draft layer's key (with RoPE at the token's position) and value of ``c_t`` into a sliding-window **ring** held
in the sequence's state slot, at ring index ``position % ring_size``. To draft after a verify step whose bonus
("golden") token sits at position ``P``, the drafter embeds ``[golden, noise, ..., noise]`` (k tokens at positions
``P .. P+k-1``; ``noise_token_id`` fills the block) with the target's (frozen) embedding and runs ``num_layers``
pre-norm transformer layers whose attention sees the ring context positions ``max(0, P-W) .. P-1`` plus the block's
own keys (bidirectional inside the block). Block position ``j`` predicts the token at ``P+j+1``:

    logits_j = lm_head(norm(h_j)) + markov_w2 @ markov_w1[prev_j]          (prev_0 = golden, prev_j = draft_j)
    draft_{j+1} = argmax(logits_j)                                          (sequential over j: the Markov input)
    confidence_j = sigmoid(confidence([norm(h_j) ; markov_w1[prev_j]]))     (P(draft accepted | previous accepted))

``lm_head`` and the embedding are the target's own tensors (shared, never stored here).

Why no masking by acceptance is needed: a verify step writes keys for positions ``P0 .. P0+d`` before the result
is known; with ``a`` drafts accepted the next golden sits at ``P = P0+a+1`` and the rejected positions
``P .. P0+d <= P+k-1`` are overwritten by later steps before being read as such. A read at ``P`` interprets ring
index ``i`` as the position ``p_i = P-1 - ((P-1-i) mod R)`` (the newest position ``< P`` with that index) and
masks it unless ``P-W <= p_i``; a stale write of a rejected position ``p' >= P`` lands on index ``p' mod R`` whose
interpreted position ``p' - mR`` lies outside ``[P-W, P-1]`` whenever ``R >= W + k`` (``p' - p <= W+k-1``). The
config enforces ``ring_size = window + max_backtrack`` with ``max_backtrack >= k + 1`` (the seed's rule).

The module's on-disk format: ``dflash_config.py``; the drafter's layers: ``dflash_model.py``. Per-slot state:
``ring`` [num_state_slots, ring_size, num_layers, 2 (K, V), num_heads, head_dim] in the target's
dtype; zeroed with :meth:`DFlashDrafter.zero_slots` for new sequences, copied with :meth:`clone_slots` on forks.

Training: ``examples/train_dflash.py`` (labels are the target's greedy continuation; see its docstring).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .dflash_config import FORMAT, WEIGHTS_NAME, DFlashConfig
from .dflash_model import DFlashModel, RmsNormFn
from .drafter import Drafter


class DFlashDrafter(Drafter):
    """Inference-side DFlash drafter over a target model's embedding and head (see the module docstring).

    ``DFlashDrafter.from_pretrained(dflash_dir, target_model, num_state_slots)`` (or :meth:`load`, the factory's
    spelling); the engine then calls :meth:`capture` (or the contract's :meth:`on_main_forward`) after every main
    forward, :meth:`propose` after every verification (explicit tensors, or a ``DraftContext``), and
    :meth:`zero_slots` / :meth:`clone_slots` for ``zero_states`` / ``clone_states``.

    ``num_speculative_tokens`` may be set below the trained block length ``cfg.num_speculative_tokens``: the block
    is still the trained ``[golden, noise x (k-1)]`` and only the first drafts are returned.
    """

    name = "dflash"

    def __init__(
        self,
        cfg: DFlashConfig,
        weights: dict[str, torch.Tensor],
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        num_state_slots: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        rms_norm: RmsNormFn | None = None,
        num_speculative_tokens: int | None = None,
    ) -> None:
        k = cfg.num_speculative_tokens if num_speculative_tokens is None else int(num_speculative_tokens)
        if not 1 <= k <= cfg.num_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens {k} must be in [1, {cfg.num_speculative_tokens}] (the drafter's trained block)"
            )
        super().__init__(k)
        self.propose_graphs = None  # ProposeGraphs once the worker offers a graph runner (enable_graphs)
        self.cfg = cfg
        self.device = torch.device(device) if device is not None else embed_weight.device
        self.dtype = dtype or embed_weight.dtype
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.capture_layer_ids = self.target_layer_ids  # the contract's name: layers the main forward must capture
        model = DFlashModel(cfg, embed_weight.to(self.device), lm_head_weight.to(self.device))
        expected = model.state_dict()
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        if missing or unexpected:
            raise ValueError(f"dflash weights: missing {missing[:8]}, unexpected {unexpected[:8]}")
        for name, t in weights.items():
            if tuple(t.shape) != tuple(expected[name].shape):
                raise ValueError(
                    f"dflash weight {name!r} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}"
                )
        model.load_state_dict({k: v.to(torch.float32) for k, v in weights.items()})
        model.to(device=self.device, dtype=self.dtype)
        # the frozen target tensors keep their own dtype/device (model.to() does not touch plain attributes)
        model.embed_weight = embed_weight.detach().to(self.device)
        model.lm_head_weight = lm_head_weight.detach().to(self.device)
        if rms_norm is not None:
            model.set_rms_norm(rms_norm)
        model.eval().requires_grad_(False)
        self.model = model
        self.num_state_slots = int(num_state_slots)
        c = cfg
        self.ring = torch.zeros(
            self.num_state_slots,
            c.ring_size,
            c.num_layers,
            2,
            c.num_heads,
            c.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._ring_offsets = torch.arange(c.ring_size, device=self.device)
        self._block_offsets = torch.arange(c.num_speculative_tokens, device=self.device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        target_model,
        num_state_slots: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        num_speculative_tokens: int | None = None,
    ) -> DFlashDrafter:
        """Load ``dflash_config.json`` + ``dflash.safetensors`` from ``path`` for ``target_model`` (our
        ``DeepseekForCausalLM``: its embedding / lm_head / backend / dtype are used)."""
        from safetensors.torch import load_file

        cfg = DFlashConfig.from_pretrained(path)
        tcfg = target_model.config
        if cfg.hidden_size != tcfg.hidden_size or cfg.vocab_size != tcfg.vocab_size:
            raise ValueError(
                f"{path}: dflash hidden_size/vocab_size {cfg.hidden_size}/{cfg.vocab_size} do not match the target's "
                f"{tcfg.hidden_size}/{tcfg.vocab_size}"
            )
        if max(cfg.target_layer_ids) >= tcfg.num_hidden_layers:
            raise ValueError(
                f"{path}: target_layer_ids {cfg.target_layer_ids} exceed the target's {tcfg.num_hidden_layers} layers"
            )
        wpath = Path(path) / WEIGHTS_NAME
        if not wpath.is_file():
            raise FileNotFoundError(f"DFlash weights not found: {wpath}")
        backend = getattr(target_model, "backend", None)
        rms = backend.kernels.rms_norm if backend is not None else None
        return cls(
            cfg,
            load_file(str(wpath)),
            target_model.model.embed_tokens.weight,
            target_model.lm_head.weight,
            num_state_slots,
            device=device,
            dtype=dtype or getattr(target_model, "dtype", None),
            rms_norm=rms,
            num_speculative_tokens=num_speculative_tokens,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        target_model,
        backend=None,
        *,
        num_state_slots: int,
        num_speculative_tokens: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> DFlashDrafter:
        """:meth:`from_pretrained` with an explicit backend (its device; its ``rms_norm`` kernel is already taken
        from the target model's backend)."""
        device = backend.device if backend is not None else None
        return cls.from_pretrained(
            path,
            target_model,
            num_state_slots,
            device=device,
            dtype=dtype,
            num_speculative_tokens=num_speculative_tokens,
        )

    # ---- state slots ---------------------------------------------------------------------------------------
    def zero_slots(self, slots: torch.Tensor) -> None:
        """Zero the rings of ``slots`` [z] (new sequences)."""
        slots = torch.as_tensor(slots, device=self.device).to(torch.int64).reshape(-1)
        self.ring.index_fill_(0, slots, 0)

    def clone_slots(self, pairs: torch.Tensor, dst: torch.Tensor | None = None) -> None:
        """Copy ring ``src -> dst`` for each row of ``pairs`` [c, 2] (forks); or ``clone_slots(src [c], dst [c])``."""
        if dst is None:
            pairs = torch.as_tensor(pairs, device=self.device).to(torch.int64).reshape(-1, 2)
            src, dst = pairs[:, 0], pairs[:, 1]
        else:
            src = torch.as_tensor(pairs, device=self.device).to(torch.int64).reshape(-1)
            dst = torch.as_tensor(dst, device=self.device).to(torch.int64).reshape(-1)
        self.ring[dst] = self.ring[src]

    # ---- capture -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(
        self,
        captured_hidden: dict[int, torch.Tensor],
        positions: torch.Tensor,
        slots_per_token: torch.Tensor,
    ) -> None:
        """``captured_hidden[layer_id]`` [T, D] (the target forward's residual stream after that layer),
        ``positions`` [T], ``slots_per_token`` [T] -> K/V written at ``ring[slot, position % ring_size]``.

        When one call holds more than ``ring_size`` tokens of a slot (a long prefill chunk), every write to a ring
        cell carries the values of that cell's newest position, so the result does not depend on write order."""
        r = self.cfg.ring_size
        positions = positions.to(device=self.device, dtype=torch.int64)
        slots = slots_per_token.to(device=self.device, dtype=torch.int64)
        c = self.model.context([captured_hidden[i] for i in self.target_layer_ids])
        kv = self.model.context_kv(c, positions).to(self.dtype)  # [T, L, 2, H, hd]
        t = positions.shape[0]
        idx = positions % r
        # newest token per (slot, ring index): amax over key = position * T + token index
        cell = slots * r + idx
        key = positions * t + torch.arange(t, device=self.device)
        best = torch.full((self.num_state_slots * r,), -1, dtype=torch.int64, device=self.device)
        best.scatter_reduce_(0, cell, key, reduce="amax")
        src = best[cell] % max(t, 1)
        self.ring[slots, idx] = kv[src]

    def on_main_forward(self, attn, captured: dict[int, torch.Tensor] | None, slots_per_token: torch.Tensor) -> None:
        """The drafter contract's hook (``spec/drafter.py``): :meth:`capture` at ``attn.positions``."""
        if captured is not None:
            self.capture(captured, attn.positions, slots_per_token)

    def main_forward_hook_in_graph(self):
        """:meth:`capture` is device ops only (scatter-reduce, index writes into the ring): decode graphs capture it
        after the main forward, which takes its ~50 launches off the host at every decode step. Padding tokens
        write ring cell 0 of state slot 0, the dummy slot."""
        return self.capture

    # ---- propose -------------------------------------------------------------------------------------------
    def context_mask(self, golden_positions: torch.Tensor) -> torch.Tensor:
        """[B, ring_size] bool: ring index i holds (as read at P) position p_i = P-1 - ((P-1-i) mod R); valid iff
        0 <= p_i and P - p_i <= window."""
        r, w = self.cfg.ring_size, self.cfg.window
        pm1 = golden_positions.to(torch.int64).unsqueeze(1) - 1
        back = torch.remainder(pm1 - self._ring_offsets, r)  # P-1 - p_i
        return (back < w) & (pm1 - back >= 0)

    @torch.no_grad()
    def propose(
        self,
        golden_tokens,
        golden_positions: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """golden_tokens [B] (the bonus token), golden_positions [B] (its position P; context < P must have been
        captured), slots [B] -> (drafts [B, k] int64 for positions P+1..P+k, confidences [B, k] fp32).

        ``propose(ctx)`` with a ``DraftContext`` reads ``ctx.bonus_tokens / bonus_positions / slots``."""
        if golden_positions is None:
            ctx_in = golden_tokens
            golden_tokens, golden_positions, slots = ctx_in.bonus_tokens, ctx_in.bonus_positions, ctx_in.slots
        golden = golden_tokens.to(device=self.device, dtype=torch.int64)
        pos = golden_positions.to(device=self.device, dtype=torch.int64)
        slots = slots.to(device=self.device, dtype=torch.int64)
        if self.propose_graphs is not None:
            out = self.propose_graphs.run(golden, pos, slots)
            if out is not None:
                return out
        return self._propose(golden, pos, slots)

    def enable_graphs(self, runner, max_rows: int) -> bool:
        """Replay :meth:`propose` from graphs per padded row count (``spec/propose_graphs.py``): it is
        row-independent, sync-free and reads slot state only through the persistent ring buffer."""
        from .propose_graphs import ProposeGraphs

        self.propose_graphs = ProposeGraphs(self._propose, runner, max_rows, self.device)
        return True

    def _propose(self, golden: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor):
        """The propose computation on int64 device tensors (eager, or captured by :class:`ProposeGraphs`)."""
        cfg, m = self.cfg, self.model
        k = cfg.num_speculative_tokens
        ctx = self.ring[slots]  # [B, R, L, 2, H, hd]
        valid = self.context_mask(pos)
        tokens = torch.full((golden.shape[0], k), cfg.noise_token_id, dtype=torch.int64, device=self.device)
        tokens[:, 0] = golden
        h = m.block_hidden(tokens, pos.unsqueeze(1) + self._block_offsets, ctx, valid)  # [B, k, D]
        base = m.base_logits(h)  # [B, k, V] fp32
        drafts, confs = [], []
        prev = golden
        for j in range(self.num_speculative_tokens):
            e = m.markov_embed(prev)
            nxt = torch.argmax(base[:, j] + m.markov_correction(e), dim=-1)
            confs.append(torch.sigmoid(m.confidence_logit(h[:, j], e)))
            drafts.append(nxt)
            prev = nxt
        return torch.stack(drafts, dim=1), torch.stack(confs, dim=1)

    # ---- misc ----------------------------------------------------------------------------------------------
    def state_bytes_per_slot(self) -> int:
        return self.ring[0].numel() * self.ring.element_size()


def save_dflash(
    directory: str | os.PathLike, cfg: DFlashConfig, model: DFlashModel, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write ``dflash_config.json`` and ``dflash.safetensors`` (``dtype``) to ``directory``."""
    from safetensors.torch import save_file

    cfg.save(directory)
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(Path(directory) / WEIGHTS_NAME), metadata={"format": FORMAT})


