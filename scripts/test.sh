#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole CPU test suite in two pytest-xdist workers.
# Most tests run on one thread (DEEPINFER_CPU_THREADS=1), so two workers keep a 2-core CI machine busy.
# `--dist loadgroup` keeps each `xdist_group` on one worker (tests sharing a compile pool or recordings).
# Extra arguments go to pytest after these, so `bash scripts/test.sh -n 0` runs in one process and
# `bash scripts/test.sh -n 4` uses four workers; `pytest tests/foo.py` alone stays in one process.
# The 15 slowest tests are listed at the end (where the suite's time goes, in every CI log).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -n 2 --dist loadgroup --durations 15 "$@"
