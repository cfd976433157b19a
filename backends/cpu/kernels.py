"""CpuKernelSet: the HAL's reference kernel set, every KernelSet op bound to its plain-torch module in this folder.

Device backends subclass it and override the ops they have native kernels for; the ops they inherit run this
reference on their tensors and ``op_report`` lists them as fallbacks.
"""

from __future__ import annotations

from deepinfer_npu.hal.kernel_set import KernelSet

import torch

from deepinfer_npu.distributed.ep_decode_path import FixedCapacityAtDecode
from deepinfer_npu.hal.types import EPDispatched

from . import cache_ops as _cache_ops
from . import ep_comm as _ep_comm
from . import linear as _linear
from . import mla as _mla
from . import moe as _moe
from . import norm as _norm
from . import quant as _quant
from . import rope as _rope
from . import spec_verify as _spec_verify
from . import step_inputs as _step_inputs
from . import zos as _zos


class VariableSplitEP:
    """Expert parallelism's reference: all_to_all_single with variable splits (ep_comm.py; one allowed host sync a
    layer), then this rank's own routing ops."""

    def ep_dispatch(self, hidden, slots, placement, group, weights=None) -> EPDispatched:
        rows, local_slot, handle = _ep_comm.ep_dispatch(hidden, slots, placement, group)
        sorted_rows, counts, state = self.moe_dispatch(rows, local_slot.view(-1, 1).to(torch.int32),
                                                       placement.slots_per_rank)
        return EPDispatched(sorted_rows, counts, (handle, state, rows.shape[0]))

    def ep_combine(self, expert_out, dispatched: EPDispatched, weights, group) -> torch.Tensor:
        handle, state, num_rows = dispatched.state
        # back to receive order; a weight of 1.0 in fp32 leaves every value as the expert produced it
        out = self.moe_combine(expert_out, state, torch.ones(num_rows, 1, device=expert_out.device))
        return _ep_comm.ep_combine(out, handle, weights, group)


class CpuKernelSet(FixedCapacityAtDecode, VariableSplitEP, KernelSet):
    """The oracle: each op is the readable reference in norm.py, linear.py, rope.py, mla.py, moe.py,
    spec_verify.py, zos.py, step_inputs.py,
    cache_ops.py and quant.py (FP8 / INT8 weights). Expert parallelism: the fixed-capacity all-to-all for decode
    steps whose agreed size the engine declares (distributed/ep_decode_path.py; what the device backends run, so
    the engine tests cover it), variable splits otherwise."""

    IS_REFERENCE = True

    rms_norm = staticmethod(_norm.rms_norm)
    add_rms_norm = staticmethod(_norm.add_rms_norm)
    linear = staticmethod(_linear.linear)
    silu_and_mul = staticmethod(_linear.silu_and_mul)
    rope = staticmethod(_rope.rope)
    mla_prolog = staticmethod(_mla.mla_prolog)
    mla_attention = staticmethod(_mla.mla_attention)
    mla_epilogue = staticmethod(_mla.mla_epilogue)
    moe_gating_topk = staticmethod(_moe.moe_gating_topk)
    moe_dispatch = staticmethod(_moe.moe_dispatch)
    grouped_mlp = staticmethod(_moe.grouped_mlp)
    moe_combine = staticmethod(_moe.moe_combine)
    spec_verify = staticmethod(_spec_verify.spec_verify)
    zos_fixup = staticmethod(_zos.zos_fixup)
    decode_inputs = staticmethod(_step_inputs.decode_inputs)
    copy_kv_blocks = staticmethod(_cache_ops.copy_kv_blocks)
    fp8_linear = staticmethod(_quant.fp8_linear)
    fp8_grouped_mlp = staticmethod(_quant.fp8_grouped_mlp)
    w8a8_linear = staticmethod(_quant.w8a8_linear)
    w8a8_grouped_mlp = staticmethod(_quant.w8a8_grouped_mlp)
    mla_prolog_quant = staticmethod(_quant.mla_prolog_quant)
    mla_epilogue_quant = staticmethod(_quant.mla_epilogue_quant)

