"""What a vendor adapter found: the library by its import name, its version, and why it is (not) usable.

Probing imports the library by name inside ``try``: nothing is installed or downloaded, and a library that is
missing, fails to import or lacks the entry points an adapter calls is reported with the reason.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class VendorStatus:
    name: str
    available: bool
    version: str | None
    reason: str  # "found ..." or why not

    def describe(self, fallback: str) -> str:
        """One ``--list-ops`` line: ``found (version 1.0.0)`` or ``not found (...); fallback: <fallback>``."""
        if self.available:
            return f"found (version {self.version or 'unknown'}): {self.reason}"
        return f"not found ({self.reason}); fallback: {fallback}"


def require(status: VendorStatus, module: str) -> ModuleType:
    """The library for a call wrapper; a caller that did not check ``probe()`` gets the probe's reason."""
    if not status.available:
        raise RuntimeError(f"{status.name} is not usable: {status.reason}")
    return importlib.import_module(module)


def probe_module(name: str, module: str, entry_points: tuple[str, ...], distributions: tuple[str, ...] = ()
                 ) -> VendorStatus:
    """Import ``module`` and check that it has every name of ``entry_points`` (alternatives as ``"a|b"``)."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return VendorStatus(name, False, None, f"{module} is not installed: {e}")
    except Exception as e:  # noqa: BLE001 - e.g. a CUDA extension built for another torch
        return VendorStatus(name, False, None, f"{module} failed to import: {type(e).__name__}: {e}")
    missing = [entry for entry in entry_points if not any(hasattr(mod, alt) for alt in entry.split("|"))]
    version = _version(mod, distributions)
    if missing:
        return VendorStatus(name, False, version, f"{module} lacks {', '.join(missing)} (an unsupported version)")
    return VendorStatus(name, True, version, f"{module} provides {', '.join(entry_points)}")


def _version(mod: ModuleType, distributions: tuple[str, ...]) -> str | None:
    version = getattr(mod, "__version__", None)
    if isinstance(version, str):
        return version
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
