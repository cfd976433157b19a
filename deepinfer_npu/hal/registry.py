"""Backend registry: names -> dotted class paths, imported lazily; ``auto`` detection ascend -> cuda -> cpu.

Only backends whose package exists are registered (the cuda / ascend folders register themselves here when
they land); importing a backend never happens until it is asked for or probed, so e.g. ``torch_npu`` is never
imported on a machine that does not use it.
"""

from __future__ import annotations

import importlib

from .backend import Backend

#: name -> "module.path:ClassName"
_REGISTRY: dict[str, str] = {
    "cpu": "deepinfer_npu.backends.cpu.backend:CpuBackend",
    "ascend": "deepinfer_npu.backends.ascend.backend:AscendBackend",
    "cuda": "deepinfer_npu.backends.cuda.backend:CudaBackend",
}
#: ``auto`` tries these in order, skipping names that are not registered.
DETECTION_ORDER: tuple[str, ...] = ("ascend", "cuda", "cpu")

_instances: dict[str, Backend] = {}


def register_backend(name: str, dotted_path: str) -> None:
    """Register (or replace) a backend class by ``"module.path:ClassName"``; clears its cached instance."""
    _REGISTRY[name] = dotted_path
    _instances.pop(name, None)
    _instances.pop("auto", None)


def registered_backends() -> list[str]:
    """Registered names, in detection order first."""
    ordered = [n for n in DETECTION_ORDER if n in _REGISTRY]
    return ordered + sorted(n for n in _REGISTRY if n not in ordered)


def _load_class(name: str) -> type[Backend]:
    module_path, _, cls_name = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module_path), cls_name)


def _resolve(name: str) -> str:
    """The registered name ``name`` stands for (``"auto"``: the first available of the detection order). Raises
    ``ValueError`` for an unknown name (listing the registered ones), ``RuntimeError`` when ``auto`` finds none
    (naming every backend's reason)."""
    if name == "auto":
        reasons = []
        for candidate in registered_backends():
            reason = _load_class(candidate).unavailable_reason()
            if reason is None:
                return candidate
            reasons.append(f"{candidate}: {reason}")
        raise RuntimeError("no backend is available: " + "; ".join(reasons))
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown backend {name!r}; registered backends: {', '.join(registered_backends())} (or 'auto')"
        )
    return name


def backend_class(name: str = "auto") -> type[Backend]:
    """The class ``get_backend(name)`` would build (``"auto"`` detected the same way), without building it."""
    if name in _instances:
        return type(_instances[name])
    return _load_class(_resolve(name))


def get_backend(name: str = "auto") -> Backend:
    """The backend instance for ``name`` (resolved once, then cached).

    ``"auto"`` picks the first available of ascend -> cuda -> cpu. Raises ``ValueError`` for an unknown name
    (listing the registered ones) and ``RuntimeError`` with the backend's own reason when it is registered but
    unavailable here.
    """
    if name in _instances:
        return _instances[name]
    if name == "auto":
        _instances["auto"] = get_backend(_resolve("auto"))
        return _instances["auto"]
    cls = _load_class(_resolve(name))
    reason = cls.unavailable_reason()
    if reason is not None:
        available = [n for n in registered_backends() if n != name and _load_class(n).is_available()]
        raise RuntimeError(
            f"backend {name!r} is not available: {reason} (available: {', '.join(available) or 'none'})"
        )
    _instances[name] = cls()
    return _instances[name]


def clear_cache() -> None:
    """Forget resolved backends (tests)."""
    _instances.clear()
