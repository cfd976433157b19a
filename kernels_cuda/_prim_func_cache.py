"""Built TileLang PrimFuncs kept on disk, so that a restart with warm caches does not build them again.

With TileLang's disk cache warm, a kernel configuration's start-up cost is no longer nvcc but building its PrimFunc:
TileLang re-parses the factory's Python source (``ast``) and traces it, 0.1-0.6 s a configuration and serial (the
parser is not thread-safe), about 15 of the 17 s a V2-Lite engine took to start with warm caches on an H200. The
factories are pure functions of their arguments, so :func:`cached_prim_func` stores each result as TVM's JSON
(``tvm.ir.save_json``, ~0.01 s) and loads it back (~0.02 s); ``tilelang.compile`` then finds the same kernel in
its own cache (the reloaded function prints the same script, which is TileLang's cache key).

Entries live under ``$DEEPINFER_CACHE_DIR/prim_funcs/<fingerprint>/``: the fingerprint hashes every source file of
``kernels_cuda/`` and the TileLang and TVM versions, so a change to any kernel file starts a new directory (the
process that starts one removes all but the ``KEEP_DIRS`` most recently used others). A missing, unreadable or
corrupt entry is rebuilt (and rewritten); a cache that cannot be written is skipped.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepinfer_npu import envs

from ._pdl import apply_setting as apply_pdl_setting
from ._producer_wait import mark as mark_producer_wait

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
KEEP_DIRS = 3  # fingerprint directories kept besides the current one (other checkouts or versions in use)


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """Hash of the kernel sources and the compiler's versions (what a stored PrimFunc depends on)."""
    h = hashlib.sha256()
    for path in sorted(_HERE.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    try:
        import tilelang
        import tvm

        h.update(f"tilelang {tilelang.__version__} tvm {getattr(tvm, '__version__', '?')}".encode())
    except Exception:  # pragma: no cover - no tilelang: nothing is built anyway
        pass
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return envs.CACHE_DIR / "prim_funcs" / fingerprint()


def entry_path(build: Callable, args: tuple, kwargs: dict) -> Path:
    """Where ``build(*args, **kwargs)``'s PrimFunc is stored (arguments by ``repr``: ints, floats, bools, strings)."""
    key = repr((build.__module__, build.__qualname__, args, sorted(kwargs.items())))
    return cache_root() / f"{build.__qualname__}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _load(path: Path):
    import tvm

    try:
        return tvm.ir.load_json(path.read_text())
    except FileNotFoundError:
        return None
    except Exception as e:  # corrupt or from an incompatible build: rebuild
        logger.debug("stored PrimFunc %s unreadable (%s): rebuilding", path, e)
        return None


def prune_old_dirs(root: Path) -> None:
    """Remove the fingerprint directories beside ``root`` but the ``KEEP_DIRS`` most recently modified."""
    import shutil

    try:
        others = [d for d in root.parent.iterdir() if d.is_dir() and d.name != root.name]
        others.sort(key=lambda d: d.stat().st_mtime, reverse=True)
        for stale in others[KEEP_DIRS:]:
            shutil.rmtree(stale, ignore_errors=True)
    except OSError as e:
        logger.debug("could not prune %s (%s)", root.parent, e)


def _store(path: Path, func: Any) -> None:
    import tvm

    tmp = None
    try:
        text = tvm.ir.save_json(func)
        if not path.parent.exists():  # a new fingerprint: the kernel sources changed
            path.parent.mkdir(parents=True, exist_ok=True)
            prune_old_dirs(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic: concurrent builders of one configuration write the same text
    except Exception as e:  # unwritable directory, or a result TVM cannot serialise: built next time again
        logger.debug("could not store PrimFunc %s (%s)", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def cached_prim_func(build: Callable) -> Callable:
    """Decorate a PrimFunc factory (a pure function of its arguments) so that its results persist across
    processes."""

    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        path = entry_path(build, args, kwargs)
        func = _load(path)
        if func is None:
            func = build(*args, **kwargs)
            _store(path, func)
        # stored as built; DEEPINFER_PDL_OFF applies to what is returned, and the producer-wait mark (a cache key)
        return mark_producer_wait(apply_pdl_setting(func))

    wrapper.uncached = build
    return wrapper
