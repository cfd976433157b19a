"""CpuKernelSet: binds every KernelSet op to its plain-torch reference implementation (all native)."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_npu.hal.kernel_set import KernelSet

from . import cache_ops as _cache_ops
from . import linear as _linear
from . import mla as _mla
from . import moe as _moe
from . import norm as _norm
from . import rope as _rope
from . import spec_verify as _spec_verify
from . import step_inputs as _step_inputs
from . import zos as _zos


class CpuKernelSet(KernelSet):
    """The oracle: each op is the readable reference in this folder (norm.py, linear.py, rope.py, mla.py,
    moe.py, cache_ops.py)."""

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

    def sample(self, logits: torch.Tensor, sampling_tensors: Any) -> Any:
        """Delegates to ``backends/cpu/sampling.py: sample`` (imported lazily: a separate module)."""
        from .sampling import sample

        return sample(logits, sampling_tensors)
