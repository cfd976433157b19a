"""``xdist_group`` marks for ``--dist loadgroup`` (scripts/test.sh) on pytest >= 9.2 with pytest-xdist <= 3.8.

xdist tags a grouped test by appending ``@group`` to ``item._nodeid``, which pytest 9.2's structured node ids no
longer read, so a group was silently spread over the workers (pytest-xdist#1386). The conftests of tests/ and
parity_tests/ take this hook: it tags the id pytest does read, and leaves a test alone where xdist's own tag took.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "loadgroup", False):  # True on xdist workers under --dist loadgroup
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):
            item._id = coerce_node_id(item.nodeid + suffix)
