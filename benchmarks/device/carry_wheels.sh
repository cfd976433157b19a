#!/usr/bin/env bash
# Download the wheels that h200_run.sh's `wheels` phase installs on the GPU host (Python 3.12, no registry there)
# into .carry/wheels (git-ignored; name it in the device call's carry). Run here, from the repository root.
# openai stays below 2 (newer ones need httpx2); fastapi needs opentelemetry-api; the structured-output GPU tests
# validate with jsonschema.
set -euo pipefail
mkdir -p .carry/wheels
pip download -q --no-deps -d .carry/wheels --python-version 3.12 --implementation cp --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  xgrammar fastapi uvicorn starlette pydantic pydantic-core anyio sniffio h11 click prometheus-client \
  pytest-xdist execnet typing-inspection annotated-types annotated-doc opentelemetry-api importlib-metadata zipp \
  "openai<2" httpx httpcore distro jiter idna certifi tqdm \
  jsonschema jsonschema-specifications referencing rpds-py attrs 2>&1 | grep -v "is ignored: it is neither" || true
ls .carry/wheels | wc -l; du -sh .carry/wheels
