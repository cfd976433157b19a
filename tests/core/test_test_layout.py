"""The suite's own layout: pytest imports a test module in a folder without ``__init__.py`` by its basename, so two
files with the same name in such folders break collection of the whole run. Basenames stay unique across the suite,
so that any folder may be a package or not; this fails early, with the names."""

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
