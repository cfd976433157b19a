"""Seeded random weights from the config alone (``load_format="dummy"`` / ``"dummy_portable"``): benchmarks and
the real-dims parity goldens run without a checkpoint."""

from __future__ import annotations

import torch

PORTABLE_CHUNK = 1 << 24  # values a float64 draw of dummy_portable holds at once (128 MB)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, portable: bool = False) -> None:
    """Seeded random weights from the config alone (benchmarks): norms 1, correction biases small, matrices
    ~N(0, 0.02) so activations stay in range at any depth. Same seed, same device type -> same weights.
    ``portable`` (``load_format="dummy_portable"``, the real-dims parity goldens): the same weights on every
    backend, drawn by a CPU generator in float64 (torch's vectorized float32 CPU sampler gives different values
    under different CPU capabilities, e.g. AVX2 vs the default path; float64 does not), in chunks of at most
    ``PORTABLE_CHUNK`` values along dim 0 (bounded host memory for big expert tensors), then copied to the
    device."""
    if portable:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in sorted(model.named_parameters()):
            data = param.data
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                data.fill_(1.0)
                continue
            scale = 0.01 if name.endswith("e_score_correction_bias") else 0.02
            flat = data.view(-1, *data.shape[1:]) if data.dim() else data.view(1)
            row = max(1, flat[0].numel())
            step = max(1, PORTABLE_CHUNK // row)
            for r0 in range(0, flat.shape[0], step):
                part = flat[r0 : r0 + step]
                part.copy_(torch.randn(part.shape, generator=gen, dtype=torch.float64).mul_(scale))
        return
    gen = torch.Generator(device=model.backend.device).manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        data = param.data
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            data.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            data.copy_(torch.randn(data.shape, generator=gen, device=data.device).mul_(0.01))
        else:
            data.copy_(torch.randn(data.shape, generator=gen, device=data.device, dtype=torch.float32).mul_(0.02))
