"""Device backends (one sub-package per target); installed as ``deepinfer_npu.backends``."""
