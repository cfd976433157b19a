"""Review finding: ``EngineConfig.enable_graphs`` became tri-state (None / True / False) but is not validated.

config.py promises "Every invalid value raises ValueError naming the parameter". Any truthy non-bool is taken by
``Worker._build_graphs`` as an *explicit* True: ``enable_graphs="auto"`` (the word the code and the docs use for
None) or ``"false"`` (a string from a config file / env var) forces graphs on, including on backends whose
graphs are opt-in because they are unverified (Ascend: ``graphs_by_default = False``).
"""

from __future__ import annotations

import pytest

from deepinfer_npu.config import EngineConfig


@pytest.mark.parametrize("value", ["auto", "false", "no"])
def test_enable_graphs_rejects_non_tristate_values(value):
    with pytest.raises(ValueError, match="enable_graphs"):
        EngineConfig(enable_graphs=value)

