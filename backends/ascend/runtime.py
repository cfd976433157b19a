"""Lazy access to ``torch_npu`` and the ``torch.npu`` device namespace — the only place that imports them.

Why lazy: installing torch_npu without CANN breaks ``import torch`` unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
(DESIGN §3), so nothing may import it before the user asks for the Ascend backend.

Contract emulation (parity_tests/ascend_emulation) installs a fake ``torch_npu`` module in ``sys.modules``
whose
device namespace maps to the CPU; it marks itself with ``__deepinfer_emulation__ = True`` and every device
decision below goes through :func:`device_type` so the same backend code runs on either.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

#: ``ASCEND_RT_VISIBLE_DEVICES`` is read by the CANN runtime itself (like CUDA_VISIBLE_DEVICES): device index
# 0
#: of this process is the first listed physical device. We only read it to name the device in messages.
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"

_torch_npu: ModuleType | None = None


def _cann_hint() -> str:
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    if home:
        return f"CANN at {home}"
    if os.path.isdir("/usr/local/Ascend/ascend-toolkit"):
        return (
            "CANN found at /usr/local/Ascend/ascend-toolkit but its environment is not sourced (set_env.sh)"
        )
    return "CANN toolkit not found (ASCEND_HOME_PATH unset, no /usr/local/Ascend/ascend-toolkit)"


def unavailable_reason() -> str | None:
    """None when torch_npu imports and at least one NPU is visible; else what is missing, in words.

    Probing never imports torch_npu when its package is absent (``find_spec`` only), so a CPU-only
    machine pays nothing; when it is present we must import it to ask the driver about devices.
    """
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        return (
            "torch_npu is not installed (pip install torch_npu matching your torch and CANN, see "
            "docs/ascend.md); "
            f"{_cann_hint()}"
        )
    try:
        npu = load()
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"; say why
        return f"torch_npu is installed but failed to import ({type(e).__name__}: {e}); {_cann_hint()}"
    try:
        ns = npu_namespace()
        available = bool(ns.is_available())
        count = int(ns.device_count()) if available else 0
    except Exception as e:  # noqa: BLE001
        return f"torch_npu imported but the NPU runtime failed ({type(e).__name__}: {e}); {_cann_hint()}"
    if not available or count == 0:
        visible = os.environ.get(VISIBLE_DEVICES_ENV)
        where = f" ({VISIBLE_DEVICES_ENV}={visible!r})" if visible is not None else ""
        return f"torch_npu {getattr(npu, '__version__', '?')} imported but no NPU device is visible{where}"
    return None


def load() -> ModuleType:
    """Import and return ``torch_npu`` (cached). Importing it also registers ``torch.npu``."""
    global _torch_npu
    if _torch_npu is None:
        _torch_npu = importlib.import_module("torch_npu")
    return _torch_npu


def reset() -> None:
    """Forget the cached module (tests swap the emulation in and out)."""
    global _torch_npu
    _torch_npu = None


def npu_namespace() -> Any:
    """``torch.npu`` (registered by importing torch_npu; the emulation provides its own)."""
    npu = load()
    ns = getattr(npu, "npu_namespace", None)  # emulation hook: its namespace object
    if ns is not None:
        return ns
    import torch

    return torch.npu


def emulated() -> bool:
    """True when the loaded torch_npu is the CPU contract emulation (parity_tests), never on real hardware."""
    return bool(getattr(load(), "__deepinfer_emulation__", False))


def device_type() -> str:
    """``"npu"`` on hardware; ``"cpu"`` under the emulation (its fake device is the host)."""
    return "cpu" if emulated() else "npu"


def version_info() -> dict[str, str]:
    """torch / torch_npu / CANN versions for reports (parity goldens record them)."""
    import torch

    info = {"torch": torch.__version__}
    try:
        npu = load()
        info["torch_npu"] = str(getattr(npu, "__version__", "?"))
        info["emulation"] = str(emulated())
        ns = npu_namespace()
        if ns.is_available():
            info["device_name"] = str(ns.get_device_name(0))
    except Exception as e:  # noqa: BLE001
        info["torch_npu"] = f"unavailable ({type(e).__name__})"
    info["cann"] = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME") or "unknown"
    info[VISIBLE_DEVICES_ENV] = os.environ.get(VISIBLE_DEVICES_ENV, "")
    return info
