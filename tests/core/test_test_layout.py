"""The suite's own layout: test folders have no __init__.py, so pytest imports test modules by basename and two
files with the same name in different folders break collection of the whole run (seen twice). Fail early, with
the names."""

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_test_module_basenames_are_unique():
    seen: dict[str, list[str]] = defaultdict(list)
    for folder in ("tests", "parity_tests"):
        for path in (ROOT / folder).rglob("test_*.py"):
            seen[path.name].append(str(path.relative_to(ROOT)))
    dupes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not dupes, f"test modules sharing a basename (rename one): {dupes}"
