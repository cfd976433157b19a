"""Per-module cache of compiled TileLang kernels keyed by ``(kind, cfg)``, shared by the kernels_cuda modules whose
kernels come in several kinds or configurations (spec_verify, zos_fixup, moe_routing, skinny_gemm ...).

``builders[kind](*cfg)`` returns a PrimFunc; ``compile_fn(func, target=None)`` compiles it (each module keeps its
own target and nvcc flags). Builders run on the calling thread: TileLang parses a kernel's Python source with
``ast``, which is not thread-safe on CPython 3.11; only the compiles (nvcc subprocesses) run in threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._ast_guard import compile_pool


class KernelCache:
    def __init__(self, builders: Mapping[str, Callable[..., Any]], compile_fn: Callable[..., Any],
                 available: bool = True) -> None:
        self.builders = builders
        self.compile_fn = compile_fn
        self.available = available  # tilelang importable
        self.kernels: dict[tuple[str, tuple], Any] = {}

    def get(self, kind: str, cfg: tuple) -> Any:
        k = self.kernels.get((kind, cfg))
        if k is None:
            assert self.available, "tilelang is not installed"
            k = self.kernels[(kind, cfg)] = self.compile_fn(self.builders[kind](*cfg))
        return k

    def precompile(self, items: Iterable[tuple[str, tuple]]) -> None:
        """Compile the ``(kind, cfg)`` pairs not yet cached, nvcc in parallel threads."""
        todo = [it for it in dict.fromkeys(items) if it not in self.kernels]
        if not todo:
            return
        funcs = [self.builders[kind](*cfg) for kind, cfg in todo]
        with compile_pool(max(1, min(len(funcs), os.cpu_count() or 1))) as ex:
            for it, k in zip(todo, ex.map(self.compile_fn, funcs)):
                self.kernels[it] = k

    def ci_compile(self, configs: Iterable[tuple[str, tuple]], target=None) -> list:
        """Compile ``configs`` for ``target`` (no GPU needed, nothing cached); see tests/kernels_cuda."""
        funcs = [self.builders[kind](*cfg) for kind, cfg in configs]
        with compile_pool(max(1, len(funcs))) as ex:
            return list(ex.map(lambda f: self.compile_fn(f, target), funcs))
