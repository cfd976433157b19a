"""Seeded random weights from the config alone (``load_format="dummy"`` / ``"dummy_portable"``): benchmarks and
the real-dims parity goldens run without a checkpoint."""

from __future__ import annotations

import torch

from .quantization.params import scheme_of

PORTABLE_CHUNK = 1 << 24  # values a float64 draw of dummy_portable holds at once (128 MB)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, portable: bool = False) -> None:
    """Seeded random weights from the config alone (benchmarks): norms 1, correction biases small, matrices
    ~N(0, 0.02) so activations stay in range at any depth; the MoE router's values bf16-representable (as in the
    checkpoints) except with ``portable`` (the parity goldens' weights: float64 draws, kept as drawn). Same seed,
    same device type -> same weights.
    ``portable`` (``load_format="dummy_portable"``, the real-dims parity goldens): the same weights on every
    backend, drawn by a CPU generator in float64 (torch's vectorized float32 CPU sampler gives different values
    under different CPU capabilities, e.g. AVX2 vs the default path; float64 does not), in chunks of at most
    ``PORTABLE_CHUNK`` values along dim 0 (bounded host memory for big expert tensors), then copied to the
    device.

    Quantised weights (``quantization="fp8"`` / ``"w8a8"``) draw the values the unquantised model draws, then are
    quantised into the weight and its scales (``<name>_scale_inv`` / ``<name>_scale``, not drawn): a quantised
    dummy model is the quantised dummy model. Their draw is staged per dim-0 row (one expert) for stacked experts,
    whole for matrices."""
    params = dict(model.named_parameters())
    schemes = {name: scheme_of(p) for name, p in params.items() if scheme_of(p) is not None}
    scales = {name + s.scale_suffix: name for name, s in schemes.items()}
    gen = torch.Generator(device="cpu" if portable else model.backend.device).manual_seed(seed)
    draw = _draw_portable if portable else _draw
    for name, param in sorted(params.items()):
        if name in scales:
            continue  # filled with its weight
        scheme = schemes.get(name)
        if scheme is None:
            draw(name, param, param.data, gen)
            continue
        scale = params[name + scheme.scale_suffix].data
        if param.dim() == 3:  # stacked experts: quantise one expert's matrix at a time
            staged = torch.empty(param.shape[1:], dtype=torch.float32, device=param.device)
            for row, value in _draw_rows(name, param, staged, gen, portable):
                q, s = scheme.quantize(value)
                param.data[row].copy_(q)
                scale[row].copy_(s)
        else:
            staged = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            draw(name, param, staged, gen)
            q, s = scheme.quantize(staged)
            param.data.copy_(q)
            scale.copy_(s)


def is_router_weight(name: str) -> bool:
    """The MoE router's weight (``...mlp.gate.weight``, fp32 [E, D] here; checkpoints ship it in bf16)."""
    return name.endswith("mlp.gate.weight")


def _scale_of(name: str) -> float:
    return 0.01 if name.endswith("e_score_correction_bias") else 0.02


def _draw(name: str, param: torch.Tensor, data: torch.Tensor, gen: torch.Generator) -> None:
    """Device-generator draw into ``data`` (``param``'s values or a staging tensor of its shape)."""
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        data.fill_(1.0)
    elif name.endswith("e_score_correction_bias"):
        data.copy_(torch.randn(data.shape, generator=gen, device=data.device).mul_(0.01))
    else:
        num_rows, keep = _rows(param)
        full = torch.randn((num_rows, *data.shape[1:]) if data.dim() else (), generator=gen, device=data.device,
                           dtype=torch.float32).mul_(0.02)
        if is_router_weight(name):
            # bf16 values, as a checkpoint's router (DeepSeek ships it in bf16): the engine's paths then are a real
            # checkpoint's (on CUDA the router's tensor-core GEMM has one bf16 part, no sum of three)
            full = full.to(torch.bfloat16).float()
        data.copy_(full if keep is None else full[torch.tensor(keep, device=data.device)])


def _draw_portable(name: str, param: torch.Tensor, data: torch.Tensor, gen: torch.Generator) -> None:
    """CPU float64 draw, in chunks along dim 0, into ``data``."""
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        data.fill_(1.0)
        return
    flat = data.view(-1, *data.shape[1:]) if data.dim() else data.view(1)
    for r0, part, rows in _portable_chunks(name, param, gen):
        if rows is None:
            flat[r0 : r0 + part.shape[0]].copy_(part)
            continue
        for i, locals_ in rows:
            for local in locals_:
                flat[local].copy_(part[i])


def _portable_chunks(name: str, param: torch.Tensor, gen: torch.Generator):
    """``(first row, float64 chunk, None | [(row in chunk, local rows)])`` over every logical row of ``param``; a
    sharded tensor keeps its own rows."""
    scale = _scale_of(name)
    num_rows, keep = _rows(param)
    rows_of: dict[int, list[int]] = {}
    for local, full_row in enumerate(keep or ()):
        rows_of.setdefault(full_row, []).append(local)
    row = max(1, param[0].numel()) if param.dim() else 1
    step = max(1, PORTABLE_CHUNK // row)
    for r0 in range(0, num_rows, step):  # every logical row is drawn; a sharded tensor keeps its own
        n = min(step, num_rows - r0)
        part = torch.randn((n, *param.shape[1:]), generator=gen, dtype=torch.float64).mul_(scale)
        if keep is None:
            yield r0, part, None
        else:
            yield r0, part, [(i, rows_of[r0 + i]) for i in range(n) if r0 + i in rows_of]


def _draw_rows(name: str, param: torch.Tensor, staged: torch.Tensor, gen: torch.Generator, portable: bool):
    """``(local row, fp32 [*param.shape[1:]])`` for each local dim-0 row of a stacked parameter, drawn as
    :func:`_draw` / :func:`_draw_portable` would draw the whole tensor."""
    if not portable:
        full = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        _draw(name, param, full, gen)
        for row in range(param.shape[0]):
            yield row, full[row]
        return
    for r0, part, rows in _portable_chunks(name, param, gen):
        for i in range(part.shape[0]):
            locals_ = [r0 + i] if rows is None else next((loc for j, loc in rows if j == i), [])
            for local in locals_:
                staged.copy_(part[i])
                yield local, staged


def _rows(param: torch.Tensor) -> tuple[int, list[int] | None]:
    """(rows drawn, rows kept or None for all): a tensor sharded by expert parallelism (``dummy_rows``) draws the
    single-device tensor and keeps its placement's rows, so the weights do not depend on the placement."""
    if hasattr(param, "dummy_rows"):
        return param.dummy_rows
    return (param.shape[0] if param.dim() else 1), None
