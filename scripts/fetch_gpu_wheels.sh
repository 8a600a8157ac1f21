#!/usr/bin/env bash
# Downloads the wheels the GPU machine needs but cannot fetch itself (it has no
# network) into .whl/ (ignored by git). Today: the header-only cudnn-frontend
# for the cuDNN attention path and CUTLASS's headers (nvidia-cutlass) for the
# Hopper attention kernel (docs/attention.md says why these versions).
# On the GPU machine: pip install --no-deps --no-index .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
FRONTEND_VERSION=1.18.0
CUTLASS_VERSION=4.2.0.0
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "nvidia-cudnn-frontend==${FRONTEND_VERSION}"
python3 -m pip download --no-deps --only-binary=:all: -d .whl "nvidia-cutlass==${CUTLASS_VERSION}"
ls -l .whl
