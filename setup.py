"""Build script: compiles the C++ engine core (csrc/engine) into ``deepinfer_npu._core`` with pybind11.

The device folders (backends/, kernels_cuda/, kernels_ascend/) and the optional-library adapters (vendor/) are mapped
into the package namespace (``deepinfer_npu.backends``, ``deepinfer_npu.vendor`` ...) so the repository layout shows
the engine/device seam while users import one package.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

from setuptools import find_namespace_packages, find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError:  # pragma: no cover - build isolation normally provides pybind11
    sys.exit("deepinfer_npu: pybind11 is required to build the C++ core: pip install pybind11")


def _check_compiler() -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        sys.exit(
            "deepinfer_npu: no C++17 compiler found (looked for $CXX, c++, g++, clang++). "
            "Install one, e.g. `apt-get install g++` or `conda install gxx_linux-64`, then retry."
        )


_check_compiler()

ROOT = os.path.dirname(os.path.abspath(__file__))
sources = sorted(glob.glob("csrc/engine/*.cpp"))

ext_modules = [
    Pybind11Extension(
        "deepinfer_npu._core",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc", "engine")],
        cxx_std=17,
        extra_compile_args=["-O3", "-Wall", "-Wextra"],
    )
]

DEVICE_DIRS = {"backends": "backends", "kernels_cuda": "kernels_cuda", "kernels_ascend": "kernels_ascend",
               "vendor": "vendor"}
packages = find_packages(include=["deepinfer_npu", "deepinfer_npu.*"])
# Data-only folders (the shipped reference model and its drafter) are namespace packages carrying package data.
ASSET_PACKAGES = [p for p in find_namespace_packages(include=["deepinfer_npu.assets", "deepinfer_npu.assets.*"])
                  if "__pycache__" not in p]
packages += [p for p in ASSET_PACKAGES if p not in packages]
package_dir = {"deepinfer_npu": "deepinfer_npu"}
for ns, folder in DEVICE_DIRS.items():
    if os.path.isdir(folder):
        for sub in find_packages(where=folder):
            packages.append(f"deepinfer_npu.{ns}.{sub}")
            package_dir[f"deepinfer_npu.{ns}.{sub}"] = os.path.join(folder, *sub.split("."))
        if os.path.exists(os.path.join(folder, "__init__.py")):
            packages.append(f"deepinfer_npu.{ns}")
            package_dir[f"deepinfer_npu.{ns}"] = folder

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={p: ["*"] for p in ASSET_PACKAGES},
    include_package_data=True,
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
