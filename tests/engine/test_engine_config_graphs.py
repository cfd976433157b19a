"""``EngineConfig.enable_graphs`` is tri-state (None / True / False) and validated like every other parameter.

A truthy non-bool would be taken by ``Worker._build_graphs`` as an explicit True: ``enable_graphs="auto"`` (the word
the docs use for None) or ``"false"`` (a string from a config file) would force graphs on, also on backends whose
graphs are opt-in (Ascend: ``graphs_by_default = False``)."""

from __future__ import annotations

import pytest

from deepinfer_npu.config import EngineConfig


@pytest.mark.parametrize("value", ["auto", "false", "no"])
def test_enable_graphs_rejects_non_tristate_values(value):
    with pytest.raises(ValueError, match="enable_graphs"):
        EngineConfig(enable_graphs=value)

