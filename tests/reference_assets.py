"""The shipped reference model and DFlash drafter (deepinfer_npu/assets/reference): whether they are installed,
the markers that skip a test without them, and the code prompts the engine tests run on them."""

from __future__ import annotations

import pytest

from deepinfer_npu.config import REFERENCE_MODEL_DIR

HAS_REFERENCE_MODEL = all((REFERENCE_MODEL_DIR / name).exists() for name in ("config.json", "model.safetensors"))
HAS_DFLASH = HAS_REFERENCE_MODEL and (REFERENCE_MODEL_DIR / "dflash" / "dflash_config.json").exists()

NO_REFERENCE_MODEL = f"the reference model is not installed in {REFERENCE_MODEL_DIR}"
needs_reference_model = pytest.mark.skipif(not HAS_REFERENCE_MODEL, reason=NO_REFERENCE_MODEL)
needs_dflash = pytest.mark.skipif(
    not HAS_DFLASH, reason=f"the reference model's DFlash drafter is not installed in {REFERENCE_MODEL_DIR / 'dflash'}")

# Speculative methods the reference model supports here: DFlash only with its drafter installed.
SPEC_METHODS = [None, "mtp"] + (["dflash"] if HAS_DFLASH else [])

# Five rows of Python source: a decode step of 5 tokens pads up to a graph size of 8.
CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    "# Copyright 2001 Python Software Foundation\n\"\"\"Utilities for",
]
