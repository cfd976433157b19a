"""CpuKernelSet: the HAL's reference kernel set, every KernelSet op bound to its plain-torch module in this folder.

Device backends subclass it and override the ops they have native kernels for; the ops they inherit run this
reference on their tensors and ``op_report`` lists them as fallbacks.
"""

from __future__ import annotations

from deepinfer_npu.hal.kernel_set import KernelSet

from . import cache_ops as _cache_ops
from . import linear as _linear
from . import mla as _mla
from . import moe as _moe
from . import norm as _norm
from . import quant as _quant
from . import rope as _rope
from . import spec_verify as _spec_verify
from . import step_inputs as _step_inputs
from . import zos as _zos


class CpuKernelSet(KernelSet):
    """The oracle: each op is the readable reference in norm.py, linear.py, rope.py, mla.py, moe.py,
    spec_verify.py, zos.py, step_inputs.py,
    cache_ops.py and quant.py (FP8 / INT8 weights)."""

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
