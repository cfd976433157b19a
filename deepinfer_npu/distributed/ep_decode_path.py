"""Which expert-parallel dispatch a kernel set takes: fixed capacity at decode sizes, variable splits otherwise.

The fixed-capacity all-to-all (``ep_fixed_capacity.py``) needs a capacity that every rank of the EP group knows on
the host before the step and that bounds every rank's rows; a rank's own token count is no such value (ranks run
different batch sizes). The engine therefore declares the step's AGREED token count with :func:`agreed_ep_tokens`:
the largest token count of any MoE forward of the step on any rank (the step vote's MAX; main model and drafter
forwards alike), entered around a decode step's launch and around each decode graph's capture with the graph's
size. Inside, :class:`FixedCapacityAtDecode` takes the fixed path when that count is at most
``ep_fixed_max_tokens`` (capacity = count * k); outside, or above the bound (prefill), the inherited
variable-split path. The choice depends only on host values that are the same on every rank, so the ranks' paths
(and their collectives) always pair up. A captured decode graph bakes its capacity in: every rank must replay the
graph of the same size, never the one for its own batch, so with graphs the step declares the agreed count rounded up
to a graph size (``worker/decode_graphs.ep_decode_tokens``) and every rank replays that graph or runs eagerly inside
the same declaration.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from deepinfer_npu.hal.types import EPDispatched

from .ep_fixed_capacity import FixedCapacityHandle, ep_combine_fixed, ep_dispatch_fixed

#: the largest agreed step (tokens) that takes the fixed path by default: the decode-graph maximum at the default
#: ``max_num_seqs=64`` with 3 speculative tokens (64 x 4); every capturable decode step must be at most this
FIXED_CAPACITY_MAX_TOKENS = 256

_state = threading.local()


@contextlib.contextmanager
def agreed_ep_tokens(num_tokens: int | None) -> Iterator[None]:
    """Declare, for the block, the step's token count agreed by every rank of the EP group (a host int, the same on
    every rank, >= every MoE forward's T in the step on every rank); None: no declaration (prefill steps).
    Re-entrant: the innermost declaration holds."""
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                                   or num_tokens < 0):
        raise ValueError(f"agreed_ep_tokens: num_tokens must be a non-negative host int or None, got {num_tokens!r}")
    previous = getattr(_state, "tokens", None)
    _state.tokens = num_tokens
    try:
        yield
    finally:
        _state.tokens = previous


def current_agreed_ep_tokens() -> int | None:
    """The innermost :func:`agreed_ep_tokens` declaration on this thread, or None."""
    return getattr(_state, "tokens", None)


class FixedCapacityAtDecode:
    """Kernel-set mixin (before the kernel set in the bases): ``ep_dispatch`` / ``ep_combine`` take the
    fixed-capacity path inside an :func:`agreed_ep_tokens` declaration of at most :attr:`ep_fixed_max_tokens`, else
    the base class's (variable splits). ``EPDispatched.state`` is a ``FixedCapacityHandle`` exactly when the fixed
    path was taken; ``ep_combine`` follows it."""

    ep_fixed_max_tokens: int = FIXED_CAPACITY_MAX_TOKENS

    def ep_capacity(self, top_k: int) -> int | None:
        """Rows per destination rank for the declared step, or None where the variable-split path applies."""
        agreed = current_agreed_ep_tokens()
        if agreed is None or agreed > self.ep_fixed_max_tokens:
            return None
        return agreed * top_k

    def ep_dispatch(self, hidden, slots, placement, group, weights=None) -> EPDispatched:
        capacity = self.ep_capacity(slots.shape[1])
        if capacity is None:
            return super().ep_dispatch(hidden, slots, placement, group, weights)
        rows, tokens_per_slot, handle = ep_dispatch_fixed(hidden, slots, placement, group, capacity)
        return EPDispatched(rows, tokens_per_slot, handle)

    def ep_combine(self, expert_out, dispatched: EPDispatched, weights, group):
        if isinstance(dispatched.state, FixedCapacityHandle):
            return ep_combine_fixed(expert_out, dispatched.state, weights, group)
        return super().ep_combine(expert_out, dispatched, weights, group)
