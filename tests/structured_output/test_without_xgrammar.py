"""Without xgrammar installed the engine imports and serves unconstrained requests; a constrained request is refused
with the missing package named (xgrammar hidden from the import system in a subprocess)."""

from __future__ import annotations

import subprocess
import sys

from tests.reference_assets import needs_reference_model

CODE = """
import sys
sys.modules["xgrammar"] = None  # as if it were not installed
from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.structured_output import StructuredOutputsParams
llm = LLM(backend="cpu", max_num_seqs=4, dtype="float32")
out = llm.generate(["def f(x):"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
try:
    constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    llm.generate(["def f(x):"], constrained, use_tqdm=False)
except ValueError as e:
    print("REFUSED:", e)
"""


@needs_reference_model
def test_engine_runs_without_xgrammar_and_names_it_for_constrained_requests():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED:" in proc.stdout and "needs the xgrammar package" in proc.stdout, proc.stdout


LAZY = """
import sys
from deepinfer_npu import LLM, SamplingParams
llm = LLM(backend="cpu", max_num_seqs=4, dtype="float32")
llm.generate(["def f(x):"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
print("IMPORTED:", sorted(m for m in ("xgrammar", "transformers") if m in sys.modules))
"""


@needs_reference_model
def test_unconstrained_requests_never_import_xgrammar():
    """xgrammar's import (transformers and TVM's FFI under it) takes seconds: an engine, or a rank process, that
    serves no constrained request must not pay it at start-up."""
    proc = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "IMPORTED: []" in proc.stdout, proc.stdout
