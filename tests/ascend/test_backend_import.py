"""The Ascend backend is importable everywhere and lazy: importing deepinfer_npu never imports torch_npu, and
asking for backend="ascend" without torch_npu/CANN/device gives an error naming what is missing."""

import subprocess
import sys

import pytest

from deepinfer_npu.hal import registry


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout


def test_importing_package_and_backend_module_never_imports_torch_npu():
    out = _run(
        "import sys, deepinfer_npu, deepinfer_npu.hal\n"
        "import deepinfer_npu.backends.ascend.backend, deepinfer_npu.backends.ascend.kernels\n"
        "from deepinfer_npu.hal import get_backend\n"
        "get_backend('auto')\n"
        "print('torch_npu' in sys.modules, hasattr(__import__('torch'), 'npu'))"
    )
    assert out.strip() == "False False"


@pytest.mark.skipif("torch_npu" in sys.modules, reason="a torch_npu is imported in this process")
def test_unavailable_reason_names_what_is_missing():
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    registry.clear_cache()
    with pytest.raises(
        RuntimeError, match=r"backend 'ascend' is not available: torch_npu is not installed.*CANN"
    ):
        registry.get_backend("ascend")
    assert registry.get_backend("auto").name == "cpu"  # detection falls through to cpu


def test_registered_with_hccl():
    from deepinfer_npu.backends.ascend.backend import AscendBackend

    assert "ascend" in registry.registered_backends()
    assert (AscendBackend.name, AscendBackend.device_type, AscendBackend.dist_backend) == (
        "ascend",
        "npu",
        "hccl",
    )
