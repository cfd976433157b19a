"""MoE routing for Hopper, in TileLang: gating top-k, permute (dispatch) and unpermute (combine); this module holds
their compile cache, argument checks and launchers, the kernels live in ``_moe_gating.py`` (1) and ``_moe_permute.py``
(2-4).

Op contracts: docs/interfaces.md ``moe_gating_topk`` / ``moe_dispatch`` / ``moe_combine``; semantics follow the CPU
reference (backends/cpu/moe.py) as it runs on CUDA tensors, where it replaces ~20 small torch kernels per MoE layer
(softmax/sigmoid, topk, radix argsort, index_select, zeros + scatter_add, the 6-7 kernel combine) by three.

1. ``gating_topk``: router logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int32). One warp (one CTA) per
   token, expert ``e`` in lane ``e % 32``, slot ``e // 32`` (E % 32 == 0, E <= 256): the layout of torch's warp
   softmax (``softmax_warp_forward``: max, ``expf(x - max)`` summed per lane in slot order, then a xor-butterfly
   add, then ``x / sum``), so the scores are bit-identical to ``logits.softmax(-1)`` on CUDA; sigmoid is
   ``1 / (1 + expf(-x))`` as torch's. Groups (``group_limited_greedy``: max per group; ``noaux_tc``: sum of the top-2
   bias-corrected scores per group) go through shared memory, one lane per group. Top-k: k rounds of a warp
   arg-max over a 64-bit key (radix-converted float << 32 | (0x7fffffff - index)), i.e. value descending, ties to
   the lowest index, values compared in torch's radix order (``TopKTypeConfig<float>::convert``). The k picks are
   then written in torch.topk(sorted=False)'s CUDA order: first every pick strictly greater than the k-th value,
   by index, then the picks equal to it, by index (``gatherTopK``: a ``>`` pass then a ``==`` pass). The
   normalisation sum follows torch's reduction tree for a [T, k] last-dim sum (``norm_order="torch_last"``).
2. ``permute``: ids [T, k] -> (sorted rows [T*k, D], counts [E] int64, order [T*k] int64) by counting sort: the
   row of assignment a = t*k + j goes to ``#{b: id_b < id_a} + #{b < a: id_b == id_a}``, exactly the stable
   argsort's position. One CTA per token scans all T*k ids (O((T*k)^2) work: decode sizes only, T*k <= MAX_ASSIGN),
   counts experts with shared-memory atomics, writes the token's k order entries and k copies of its row.
   No host reads: CUDA-graph capturable.
3. ``unpermute``: expert_out [T*k, D], order, weights [T, k] fp32 -> [T, D]: the CTA of token t finds its k rows by
   scanning ``order`` (its inverse is not stored in DispatchState; above MAX_ASSIGN the ``by_position`` variant
   reads the inverse, one scatter computes it), then per element ``sum_j w[t, j] *
   float(expert_out[pos_j])`` with products rounded to fp32 (``--fmad=false``: no FMA contraction) and summed in
   torch's reduction order for ``(x * w).sum(dim=1)`` over [T, k, D] (four interleaved accumulators,
   ``sum_order="torch_strided"``), then one cast: bit-exact with the reference on CUDA.
4. ``route`` (decode batches, T <= MAX_ROUTE_TOKENS): ``gating_topk`` + ``permute(with_scan=True)`` in one launch,
   every output bit-identical to the two kernels'. One CTA a token, as permute; warp w of every CTA first gates
   tokens w, w + NW, ... with the standalone kernel's own code (``_gating_macro``, the gating kernel's generated
   source unchanged by it, byte for byte) into shared memory, then the permute body reads the ids from there.
   Checked on an H200 (weights 0 ulp from the reference, graph replay; tests/kernels_cuda/test_moe_routing.py).

Measured on one H200 (torch 2.11 + cu130, TileLang 0.1.15; 2026-11-29), against the reference ops on the same CUDA
tensors: gating ids identical (order included) in 24/24 cases (V2-Lite, V2, V3, T = 1..1000, tie-
heavy integer logits, all-equal rows) and the weights bit-exact in 24/24; permute order / counts / rows identical
(11 cases, bf16 and fp32, up to T*k = 8192); unpermute 0 ulp in 9/9; the three kernels captured in a CUDA graph and
replayed: bit-exact. Control: the sequential sum instead of torch's orders is 3 ulp off (normalisation) and 3-16
bf16 ulp off (combine). CUDA-graph replay timings (``bench.py moe_routing``)
(median, first run), kernel vs the torch path it replaces (us):

| shape | T | gating | permute (dispatch) | unpermute (combine) |
|---|---|---|---|---|
| V2-Lite (E 64, k 6, D 2048) | 1 | 2.2 vs 7.7 | 2.1 vs 21.5 | 2.1 vs 11.6 |
| V2-Lite | 64 | 2.7 vs 11.0 | 2.8 vs 42.1 | 2.7 vs 16.6 |
| V2-Lite | 256 | 2.8 vs 11.8 | 6.0 vs 48.3 | 5.3 vs 37.3 |
| V2-Lite | 1024 | 3.2 vs 12.6 | 20.4 vs 97.2 | 18.8 vs 144.9 |
| V3 (E 256, k 8, D 7168) | 1 | 5.5 vs 42.4 | 3.6 vs 22.8 | 3.8 vs 12.1 |
| V3 | 64 | 5.8 vs 53.1 | 4.9 vs 44.8 | 4.9 vs 42.1 |
| V3 | 256 | 5.8 vs 59.8 | 12.5 vs 55.5 | 9.7 vs 163.2 |
| V3 | 1024 | 6.9 vs 83.3 | 58.6 vs 135.6 | 63.8 vs 607.8 |
"""

import torch

from ._kernel_cache import KernelCache
from ._tilelang import tilelang
from ._moe_gating import MAX_EXPERTS, MAX_TOP_K, METHODS, SCORINGS, build_gating_topk
from ._moe_permute import MAX_ASSIGN, MAX_ROUTE_TOKENS, MAX_SCAN_EXPERTS, build_permute, build_route, build_unpermute

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
# Products must round to fp32 before the sums, as in torch's separate multiply and sum kernels.
COMPILE_FLAGS = ["--fmad=false"]

DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


# ---- compile / launch ------------------------------------------------------------------------------------------
def _compile(func, target=None):
    return tilelang.compile(
        func, out_idx=None, target=dict(target or SM90_TARGET), compile_flags=list(COMPILE_FLAGS)
    )


_CACHE = KernelCache({"gating": build_gating_topk, "permute": build_permute, "unpermute": build_unpermute,
                      "route": build_route}, _compile, available=tilelang is not None)
_KERNELS = _CACHE.kernels  # (kind, cfg) -> compiled kernel


def _get_kernel(kind, cfg):
    return _CACHE.get(kind, cfg)


def precompile(items):
    """Compile (kind, cfg) pairs in parallel threads (nvcc runs in subprocesses) and keep them for the launchers."""
    _CACHE.precompile(items)


def _gating_cfg(params, norm_order="torch_last", has_bias=True):
    return (
        int(params.num_experts),
        int(params.top_k),
        str(params.scoring_func),
        str(params.topk_method),
        int(params.n_group),
        int(params.topk_group),
        bool(params.norm_topk_prob),
        float(params.routed_scaling_factor),
        norm_order,
        bool(has_bias and params.topk_method == "noaux_tc"),
    )


def get_gating_kernel(*cfg):
    return _get_kernel("gating", tuple(cfg))


def get_permute_kernel(hidden_size, top_k, num_experts, dtype, with_scan=False):
    if with_scan:  # the 6-item key: (..., threads, with_scan); the plain kernel keeps its 4-item key
        return _get_kernel("permute", (hidden_size, top_k, num_experts, dtype, 128, True))
    return _get_kernel("permute", (hidden_size, top_k, num_experts, dtype))


def _route_cfg(params, hidden_size, dtype, has_bias=True):
    """The ("route", cfg) key: (D, k, E, the gating cfg's scoring ... has_bias, dtype), torch_last normalisation."""
    g = _gating_cfg(params, "torch_last", has_bias)
    return (int(hidden_size), g[1], g[0], *g[2:], dtype)


def get_route_kernel(hidden_size, top_k, num_experts, scoring_func, topk_method, n_group, topk_group, norm_topk_prob,
                     routed_scaling_factor, norm_order, has_bias, dtype):
    return _get_kernel("route", (hidden_size, top_k, num_experts, scoring_func, topk_method, n_group, topk_group,
                                 norm_topk_prob, routed_scaling_factor, norm_order, has_bias, dtype))


def get_unpermute_kernel(hidden_size, top_k, dtype, sum_order="torch_strided", with_addend=False, by_position=False):
    return _get_kernel("unpermute", unpermute_cfg(hidden_size, top_k, dtype, sum_order, with_addend, by_position))


def unpermute_cfg(hidden_size, top_k, dtype, sum_order="torch_strided", with_addend=False, by_position=False):
    """The ("unpermute", cfg) key: 4 items for the plain kernel, 6 with the addend, 7 by position."""
    if by_position:
        return (int(hidden_size), int(top_k), dtype, sum_order, 128, bool(with_addend), True)
    if with_addend:
        return (int(hidden_size), int(top_k), dtype, sum_order, 128, True)
    return (int(hidden_size), int(top_k), dtype, sum_order)


def gating_reason(router_logits, bias, params) -> str | None:
    """None when ``gating_topk`` handles these arguments (host facts only), else why not."""
    e, k, g, tg = int(params.num_experts), int(params.top_k), int(params.n_group), int(params.topk_group)
    if router_logits.dim() != 2 or router_logits.shape[1] != e:
        return f"logits shape {tuple(router_logits.shape)} is not [T, {e}]"
    if router_logits.shape[0] == 0:
        return "no tokens"
    if params.scoring_func not in SCORINGS or params.topk_method not in METHODS:
        return f"{params.scoring_func}/{params.topk_method}: not implemented in the kernel"
    if e % 32 or e > MAX_EXPERTS:
        return f"{e} experts: kernel needs a multiple of 32, at most {MAX_EXPERTS}"
    if not 1 <= k <= min(e, MAX_TOP_K):
        return f"top_k {k}: kernel handles 1..{MAX_TOP_K}"
    if params.topk_method != "greedy":
        if g < 1 or e % g or g > 32 or not 1 <= tg <= g:
            return f"n_group {g}, topk_group {tg}: kernel needs E % n_group == 0, n_group <= 32"
        if params.topk_method == "noaux_tc" and e // g < 2:
            return "noaux_tc with fewer than 2 experts a group"
    if bias is not None and (bias.numel() != e or not bias.is_cuda):
        return "correction bias is not a CUDA tensor of E values"
    return None


def gating_topk(router_logits, bias, params, norm_order="torch_last"):
    """(weights [T, k] fp32, ids [T, k] int32) like ``backends.cpu.moe.moe_gating_topk`` on CUDA tensors."""
    logits = router_logits.float().contiguous()
    t, k = logits.shape[0], int(params.top_k)
    # Without a bias the kernel is built not to read it; any [E] fp32 tensor fills the argument (no allocation, so
    # nothing uninitialised when the first call happens inside a CUDA-graph capture).
    b = logits[0] if bias is None else bias.float().reshape(-1).contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    get_gating_kernel(*_gating_cfg(params, norm_order, bias is not None))(logits, b, weights, ids)
    return weights, ids


def _rows_reason(x, what) -> str | None:
    if x.dtype not in DTYPES:
        return f"{what} {x.dtype}: kernel handles bf16 / fp32"
    vec = 16 // x.element_size()
    if x.dim() != 2 or x.shape[1] % vec:
        return f"{what} shape {tuple(x.shape)}: rows must be a multiple of {vec} elements"
    if not x.is_contiguous() or x.data_ptr() % 16:
        return f"{what} is not contiguous / 16-byte aligned"
    return None


def permute_reason(hidden, ids, num_experts) -> str | None:
    if ids.dim() != 2 or hidden.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        return "shapes"
    n = ids.numel()
    if n == 0:
        return "no tokens"
    if n > MAX_ASSIGN:
        return f"{n} assignments > {MAX_ASSIGN} (the kernel is O((T*k)^2): decode sizes)"
    if ids.dtype not in (torch.int32, torch.int64):
        return f"ids {ids.dtype}"
    if ids.shape[1] > MAX_TOP_K:
        return f"top_k {ids.shape[1]} > {MAX_TOP_K}"
    if num_experts > 4096:
        return f"{num_experts} experts > 4096"
    return _rows_reason(hidden, "hidden")


def permute(hidden, ids, num_experts, with_scan=False):
    """(sorted_hidden [T*k, D], counts [E] int64, order [T*k] int64) like ``backends.cpu.moe.moe_dispatch``;
    ``with_scan`` (E <= MAX_SCAN_EXPERTS): also ``moe_gemm.expert_starts(counts)`` [2E + 1] int32, from the same
    launch."""
    t, k = ids.shape
    n, d = t * k, hidden.shape[1]
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    sorted_hidden = torch.empty(n, d, dtype=hidden.dtype, device=hidden.device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=hidden.device)
    order = torch.empty(n, dtype=torch.int64, device=hidden.device)
    if with_scan and num_experts > MAX_SCAN_EXPERTS:
        raise ValueError(f"permute: {num_experts} experts; the fused scan handles 1..{MAX_SCAN_EXPERTS}")
    kern = get_permute_kernel(d, k, int(num_experts), DTYPES[hidden.dtype], with_scan)
    if not with_scan:
        kern(hidden, flat, sorted_hidden, counts, order)
        return sorted_hidden, counts, order
    scan = torch.empty(2 * num_experts + 1, dtype=torch.int32, device=hidden.device)
    kern(hidden, flat, sorted_hidden, counts, order, scan)
    return sorted_hidden, counts, order, scan


def route_reason(router_logits, bias, params, hidden, num_experts) -> str | None:
    """None when ``route`` (gating + permute(with_scan=True) in one launch) handles these arguments (host facts
    only), else why not: the gating's and the permute's own limits, T <= MAX_ROUTE_TOKENS, E <= MAX_SCAN_EXPERTS."""
    if router_logits.dim() != 2:
        return f"logits shape {tuple(router_logits.shape)} is not [T, E]"
    t = int(router_logits.shape[0])
    if t > MAX_ROUTE_TOKENS:
        return f"{t} tokens > MAX_ROUTE_TOKENS {MAX_ROUTE_TOKENS} (route gates every token in every CTA: decode only)"
    if int(num_experts) > MAX_SCAN_EXPERTS:
        return f"{num_experts} experts > MAX_SCAN_EXPERTS {MAX_SCAN_EXPERTS} (the fused expert scan)"
    if int(num_experts) != int(params.num_experts):
        return f"num_experts {num_experts} != the gating's {params.num_experts}"
    if not router_logits.is_floating_point():
        return f"logits {router_logits.dtype}: not a floating-point tensor"
    if hidden.dim() != 2 or int(hidden.shape[0]) != t:
        return f"hidden {tuple(hidden.shape)} is not [T={t}, D] (the logits' tokens)"
    if hidden.dtype not in DTYPES:
        return f"hidden {hidden.dtype}: kernel handles bf16 / fp32"
    if not (router_logits.is_cuda and hidden.is_cuda) or router_logits.device != hidden.device:
        return "tensor not on a CUDA device (logits and hidden on one CUDA device)"
    why = gating_reason(router_logits, bias, params)
    if why is not None:
        return why
    ids = torch.empty((t, int(params.top_k)), dtype=torch.int32, device="meta")  # the shape gating_topk gives
    return permute_reason(hidden, ids, int(num_experts))


def route(router_logits, bias, params, hidden, num_experts):
    """(weights [T, k] fp32, ids [T, k] int32, sorted_hidden [T*k, D], counts [E] int64, order [T*k] int64,
    scan [2E + 1] int32) in one launch, bit-identical to ``gating_topk(router_logits, bias, params)`` followed by
    ``permute(hidden, ids, num_experts, with_scan=True)``; ``route_reason`` says when it applies (T <= 16)."""
    logits = router_logits.float().contiguous()
    t, k, e, d = logits.shape[0], int(params.top_k), int(num_experts), hidden.shape[1]
    if t > MAX_ROUTE_TOKENS:  # the shared ids buffer holds MAX_ROUTE_TOKENS * k (route_reason says so too)
        raise ValueError(f"route: {t} tokens > MAX_ROUTE_TOKENS {MAX_ROUTE_TOKENS}")
    b = logits[0] if bias is None else bias.float().reshape(-1).contiguous()  # as gating_topk: no allocation
    dev = logits.device
    weights = torch.empty(t, k, dtype=torch.float32, device=dev)
    ids = torch.empty(t, k, dtype=torch.int32, device=dev)
    sorted_hidden = torch.empty(t * k, d, dtype=hidden.dtype, device=dev)
    counts = torch.empty(e, dtype=torch.int64, device=dev)
    order = torch.empty(t * k, dtype=torch.int64, device=dev)
    scan = torch.empty(2 * e + 1, dtype=torch.int32, device=dev)
    kern = get_route_kernel(*_route_cfg(params, d, DTYPES[hidden.dtype], bias is not None))
    kern(logits, b, hidden, weights, ids, sorted_hidden, counts, order, scan)
    return weights, ids, sorted_hidden, counts, order, scan


def unpermute_reason(expert_out, order, weights, num_tokens, top_k, by_position=False) -> str | None:
    """None when ``unpermute`` takes these arguments (host facts only); ``by_position``: the variant that reads the
    order's inverse (no MAX_ASSIGN limit)."""
    n = order.numel()
    if n == 0 or num_tokens == 0:
        return "no tokens"
    if n != num_tokens * top_k or expert_out.shape[0] != n or tuple(weights.shape) != (num_tokens, top_k):
        return "shapes"
    if by_position and n >= 2**31:
        return f"{n} assignments: int32 positions"
    if not by_position and n > MAX_ASSIGN:
        return f"{n} assignments > {MAX_ASSIGN} (every CTA scans the order: decode sizes)"
    if top_k > MAX_TOP_K:
        return f"top_k {top_k} > {MAX_TOP_K}"
    if order.dtype != torch.int64:
        return f"order {order.dtype}"
    return _rows_reason(expert_out, "expert_out")


def addend_reason(expert_out, addend, num_tokens) -> str | None:
    """None when ``unpermute(..., addend=addend)`` takes ``addend`` (shape [T, D], expert_out's dtype, contiguous)."""
    want = (int(num_tokens), int(expert_out.shape[1]))
    if tuple(addend.shape) != want or addend.dtype != expert_out.dtype or addend.device != expert_out.device:
        return f"addend {addend.dtype} {list(addend.shape)} on {addend.device}, want {expert_out.dtype} {list(want)}"
    if not addend.is_contiguous():
        return "addend not contiguous"
    return None


def positions_of(order):
    """The inverse of a dispatch order as int32: ``positions[order[i]] = i`` (one scatter; no host read)."""
    n = order.numel()
    positions = torch.empty(n, dtype=torch.int32, device=order.device)
    positions.scatter_(0, order, torch.arange(n, dtype=torch.int32, device=order.device))
    return positions


def unpermute(expert_out, order, weights, num_tokens, top_k, sum_order="torch_strided", addend=None,
              by_position=False):
    """[T, D] = sum_j weights[t, j] * expert_out[row of t*k+j], like ``backends.cpu.moe.moe_combine``; with
    ``addend`` [T, D] (``addend_reason``): that sum rounded to the dtype, plus ``addend`` as torch adds them.
    ``by_position``: invert ``order`` first (``positions_of``) and take the O(T*k) kernel (prefill sizes)."""
    d = expert_out.shape[1]
    out = torch.empty(num_tokens, d, dtype=expert_out.dtype, device=expert_out.device)
    w = weights.float().contiguous()
    index = positions_of(order) if by_position else order.contiguous()
    kern = get_unpermute_kernel(d, int(top_k), DTYPES[expert_out.dtype], sum_order, addend is not None, by_position)
    if addend is None:
        kern(expert_out, index, w, out)
    else:
        kern(expert_out, index, w, addend, out)
    return out


# ---- CI compile --------------------------------------------------------------------------------------------------
CI_CONFIGS = [
    ("gating", (64, 6, "softmax", "greedy", 1, 1, False, 1.0, "torch_last", False)),  # V2-Lite
    ("gating", (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, "torch_last", True)),  # V3
    ("permute", (2048, 6, 64, "bfloat16")),
    ("permute", (2048, 6, 64, "bfloat16", 128, True)),  # + moe_gemm's expert scan
    ("unpermute", (2048, 6, "bfloat16", "torch_strided")),
    ("unpermute", (2048, 6, "bfloat16", "torch_strided", 128, True)),  # + the shared experts' output
    ("unpermute", (2048, 6, "bfloat16", "torch_strided", 128, True, True)),  # by position (prefill sizes)
    ("route", (2048, 6, 64, "softmax", "greedy", 1, 1, False, 1.0, "torch_last", False, "bfloat16")),  # V2-Lite
    ("route", (7168, 8, 256, "sigmoid", "noaux_tc", 8, 4, True, 2.5, "torch_last", True, "bfloat16")),  # V3
]


def ci_compile(configs=None, target=None):
    """Compile representative configurations for sm_90a (or ``target``; no GPU, no cache); see tests/kernels_cuda."""
    return _CACHE.ci_compile(configs or CI_CONFIGS, target)
