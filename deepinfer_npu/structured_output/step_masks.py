"""Structured output inside a step: the tokens each constrained row may not sample, as a ban mask for
``spec_verify``.

The engine advances every request's grammar with the tokens of step N-1 before step N's sampling is launched (the
worker post-processes N-1 between N's forward and N's sampling, so under ZOS the bitmask is filled on the CPU while
the device runs N's forward). A decode row verifies drafts: position ``j`` is masked by the grammar state after the
row's first ``j`` drafts, which the host knows from the proposals copied with step N-1's results. Should a row's
actual draft differ from the one its next mask assumed (a fork's first step), that draft is banned at its position,
so it is rejected there and the mask after it is never used: masks can cost acceptance, never validity.

The host's work per step is one batched xgrammar fill per draft depth into one host buffer (every row's mask words,
all-allowed for unconstrained rows, and with drafts the draft each position assumed), one copy of that buffer to
the device and a few device ops: pick each token's words, unpack the bits. A batch without grammars builds nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from deepinfer_npu.structured_output.matcher import fill_rows

__all__ = ["banned_tokens", "decode_banned", "merge", "prefill_banned"]

ToDevice = Callable[..., torch.Tensor]
_UNCONSTRAINED = -2  # the assumed draft at an unconstrained row's positions: never a mismatch
_bit_values: dict[torch.device, torch.Tensor] = {}
_NO_DRAFTS = np.zeros(0, dtype=np.int64)


def merge(ban: torch.Tensor | None, extra: torch.Tensor | None) -> torch.Tensor | None:
    if extra is None:
        return ban
    return extra if ban is None else ban | extra


def _bits(device: torch.device, to_device: ToDevice) -> torch.Tensor:
    """int32 ``[32]``: the word with only bit ``b`` set (bit 31 is the sign), copied once per device."""
    bits = _bit_values.get(device)
    if bits is None:
        bits = _bit_values[device] = to_device((np.uint32(1) << np.arange(32, dtype=np.uint32)).view(np.int32),
                                               torch.int32)
    return bits


def banned_tokens(words: torch.Tensor, vocab: int, to_device: ToDevice) -> torch.Tensor:
    """Bool ``[rows, vocab]``, True where the token's bit is clear in int32 ``words [rows, ceil(vocab / 32)]``
    (xgrammar's layout; any device; two ops)."""
    clear = (words.unsqueeze(-1) & _bits(words.device, to_device)) == 0
    return clear.reshape(words.shape[0], -1)[:, :vocab]


def _host_buffer(rows: int, vocab: int, extra: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A fresh int32 buffer: ``rows`` mask rows, every token allowed, then ``extra`` words. -> (the buffer, its
    mask rows as a ``[rows, words]`` view). Fresh each step: on the CPU backend the device tensor aliases it."""
    width = -(-vocab // 32)
    buf = np.empty(rows * width + extra, dtype=np.int32)
    words = buf[: rows * width].reshape(rows, width)
    words.fill(-1)
    return buf, words


def prefill_banned(grammars: list, sample_rows: np.ndarray, vocab: int, to_device: ToDevice) -> torch.Tensor | None:
    """``[m, vocab]`` banned tokens of the prompt-end samples (``sample_rows[s]``: the plan row of sample ``s``)."""
    constrained = [s for s, i in enumerate(sample_rows.tolist()) if grammars[i] is not None]
    if not constrained:
        return None
    _buf, words = _host_buffer(len(sample_rows), vocab)
    fill_rows([grammars[int(sample_rows[s])] for s in constrained], torch.from_numpy(words), constrained)
    return banned_tokens(to_device(words, torch.int32), vocab, to_device)


def decode_banned(grammars: list, num_rows: int, max_q: int, row: torch.Tensor, j: torch.Tensor,
                  draft_next: torch.Tensor, vocab: int, to_device: ToDevice) -> torch.Tensor | None:
    """``[T, vocab]`` banned tokens of a decode step's token rows (``row`` / ``j``: each token's plan row and
    position in it; ``draft_next``: the draft each token is checked against, -1 for none)."""
    constrained = [i for i in range(num_rows) if grammars[i] is not None]
    if not constrained:
        return None
    if max_q == 1 and row.shape[0] == num_rows:  # no drafts: token i is row i's only token
        _buf, words = _host_buffer(num_rows, vocab)
        fill_rows([grammars[i] for i in constrained], torch.from_numpy(words), constrained)
        return banned_tokens(to_device(words, torch.int32), vocab, to_device)
    size = num_rows * max_q  # mask row i * max_q + p: row i's position p
    buf, words = _host_buffer(size, vocab, extra=size)
    assumed = buf[words.size:].reshape(num_rows, max_q)  # the draft at each position the masks assume
    assumed.fill(_UNCONSTRAINED)
    sub = [grammars[i] for i in constrained]
    drafts = [_NO_DRAFTS if g.drafts is None else g.drafts[: max_q - 1] for g in sub]
    rows, lens, pos = np.asarray(constrained), np.fromiter(map(len, drafts), np.int64, len(sub)), np.arange(max_q)
    c, p = np.nonzero(pos > lens[:, None])
    words.reshape(num_rows, max_q, -1)[rows[c], p] = 0  # past the known drafts: never reached
    assumed[rows] = -1
    c, p = np.nonzero(pos < lens[:, None])
    assumed[rows[c], p] = np.concatenate(drafts)
    fill_rows(sub, torch.from_numpy(words), (rows * max_q).tolist(), drafts)
    dev = to_device(buf, torch.int32)
    flat = row * max_q + j
    banned = banned_tokens(dev[: words.size].view(size, -1).index_select(0, flat), vocab, to_device)
    assumed_next = dev[words.size:].index_select(0, flat)
    mismatch = (assumed_next != _UNCONSTRAINED) & (draft_next >= 0) & (draft_next != assumed_next)
    at = draft_next.clamp(min=0)[:, None]
    return banned.scatter_(1, at, banned.gather(1, at) | mismatch[:, None])
