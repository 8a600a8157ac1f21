#!/usr/bin/env bash
# Sets everything up, then runs the demo (cpu backend unless a GPU is present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
