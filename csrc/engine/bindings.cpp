// Placeholder module so the package builds before the engine core lands; replaced by the core.
#include <pybind11/pybind11.h>
PYBIND11_MODULE(_core, m) { m.doc() = "deepinfer_npu engine core (placeholder)"; }
