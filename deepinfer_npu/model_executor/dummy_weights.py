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
            num_rows, keep = _rows(param)
            flat = data.view(-1, *data.shape[1:]) if data.dim() else data.view(1)
            rows_of: dict[int, list[int]] = {}
            for local, full_row in enumerate(keep or ()):
                rows_of.setdefault(full_row, []).append(local)
            row = max(1, flat[0].numel())
            step = max(1, PORTABLE_CHUNK // row)
            for r0 in range(0, num_rows, step):  # every logical row is drawn; a sharded tensor keeps its own
                n = min(step, num_rows - r0)
                part = torch.randn((n, *flat.shape[1:]), generator=gen, dtype=torch.float64).mul_(scale)
                if keep is None:
                    flat[r0 : r0 + n].copy_(part)
                    continue
                for i in range(n):
                    for local in rows_of.get(r0 + i, ()):
                        flat[local].copy_(part[i])
        return
    gen = torch.Generator(device=model.backend.device).manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        data = param.data
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            data.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            data.copy_(torch.randn(data.shape, generator=gen, device=data.device).mul_(0.01))
        else:
            num_rows, keep = _rows(param)
            full = torch.randn((num_rows, *data.shape[1:]) if data.dim() else (), generator=gen, device=data.device,
                               dtype=torch.float32).mul_(0.02)
            data.copy_(full if keep is None else full[torch.tensor(keep, device=data.device)])


def _rows(param: torch.Tensor) -> tuple[int, list[int] | None]:
    """(rows drawn, rows kept or None for all): a tensor sharded by expert parallelism (``dummy_rows``) draws the
    single-device tensor and keeps its placement's rows, so the weights do not depend on the placement."""
    if hasattr(param, "dummy_rows"):
        return param.dummy_rows
    return (param.shape[0] if param.dim() else 1), None
