#!/usr/bin/env bash
# Sets everything up, then runs the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec .venv/bin/python -m pytest -q -ra --timeout=600 tests "$@"
