#!/usr/bin/env bash
# Sets everything up, then runs the demo: a MoE transformer block trained over N PEs
# (examples/moe_block.py; cpu backend with 4 PEs unless a GPU is present). Arguments go
# to the demo, e.g. `bash scripts/demo.sh --launch threads,processes,torchrun --plot split.png`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # --launch mpirun as root
exec .venv/bin/python examples/moe_block.py "$@"
