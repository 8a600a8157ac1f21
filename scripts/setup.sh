#!/usr/bin/env bash
# Prepares a fresh Debian machine: OpenMPI, a virtualenv at .venv with the CPU
# builds of torch and jax, mpi4py and pytest, then builds and installs symheap
# into it. Safe to run again: finished steps are quick no-ops.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup] %s\n' "$*"; }

if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
  say "installing OpenMPI (openmpi-bin, libopenmpi-dev)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python

say "installing Python dependencies (torch CPU, jax CPU, mpi4py, pytest, matplotlib)"
$VPY -m pip install -q --upgrade pip >/dev/null
$VPY -m pip install -q "torch==2.13.0" jax jaxlib numpy mpi4py pytest pytest-timeout \
  scikit-build-core pybind11 cmake ninja matplotlib

# CUTLASS's headers (CuTe) for the Hopper attention kernel; only the headers are used,
# so none of the wheel's Python dependencies (docs/attention.md says why this version).
$VPY -m pip install -q --no-deps "nvidia-cutlass==4.2.0.0"

say "building and installing symheap (CUDA sources too when nvcc is found)"
$VPY -m pip install -q --no-build-isolation --no-deps . 
$VPY -c "import symheap; print('[setup] symheap', symheap.__version__, 'backend:', symheap.backend())"
