#!/usr/bin/env bash
# One shot on a GPU machine (no network needed): build and install symheap,
# run the GPU tests, then every benchmark in bench/, with logs in $OUT
# (default ./gpu-logs). A short summary comes last.
#   bash tests/gpu/run_all.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
summary=()
note() { summary+=("$1"); echo "[run_all] $1"; }
elapsed() { echo $(( $(date +%s) - $1 ))s; }

t=$(date +%s)
nvidia-smi -L > "$OUT/gpus.txt" 2>&1; nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1
# Wheels this machine cannot download (scripts/fetch_gpu_wheels.sh puts them in .whl/).
for w in .whl/*.whl; do
  [ -e "$w" ] || continue
  if $PY -m pip install -q --no-deps --no-index "$w" >> "$OUT/wheels.log" 2>&1; then
    note "installed $(basename "$w")"
  else
    note "installing $(basename "$w") FAILED, see wheels.log"
  fi
done
if [ -n "${SYMHEAP_SKIP_BUILD:-}" ]; then
  note "build: skipped (SYMHEAP_SKIP_BUILD set; using the installed symheap)"
elif SYMHEAP_CUDA=ON $PY -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; then
  note "build: ok ($(elapsed $t))"
else
  tail -30 "$OUT/build.log"
  note "build: FAILED ($(elapsed $t)), see build.log"
  printf '%s\n' "${summary[@]}"; exit 1
fi
# Import the installed package, not the source tree's python/ folder.
$PY -c "import torch, symheap, symheap.attention as a; print('symheap', symheap.__version__, symheap.backend(), symheap.device_count(), 'GPUs', a.backends())" \
  2>&1 | tee -a "$OUT/build.log"

t=$(date +%s)
$PY -m pytest tests/gpu -q -ra --timeout=${SYMHEAP_TEST_TIMEOUT:-150} -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest_gpu.log"
rc=${PIPESTATUS[0]}
note "pytest tests/gpu: $(tail -1 "$OUT/pytest_gpu.log") (rc $rc, $(elapsed $t))"

n_gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
benches=("bench/shmem_bw.py" "bench/remote_bw.py" "bench/ep_remote_bench.py" "bench/ep_bench.py" "bench/attn_bench.py" "bench/attn_bench.py --decode" "bench/attn_feature_bench.py --backend own --hdim 64" "bench/attn_feature_bench.py --backend own --hdim 128" "bench/attn_feature_bench.py --backend own --hdim 256 --compare-backward pipelined_dq_separate" "bench/jax_ep_bench.py --parts" "bench/jax_attn_bench.py" "bench/host_overhead.py --iters 300 --gil")
if [ "$n_gpus" -gt 2 ]; then  # every GPU: all pairs, and EP over all of them
  benches+=("bench/shmem_bw.py --all-pairs 256M" "bench/ep_bench.py --gpus $n_gpus")
fi
for b in "${benches[@]}"; do
  name=$(echo "$b" | sed 's|bench/||; s|\.py||; s|[^A-Za-z0-9]\+|_|g')
  t=$(date +%s)
  if timeout "${SYMHEAP_BENCH_TIMEOUT:-240}" $PY $b > "$OUT/$name.log" 2>&1; then status=ok; else status="FAILED rc $?"; fi
  note "$b: $status ($(elapsed $t)); $(grep -E '^summary|latency' "$OUT/$name.log" | tr '\n' ' ' | cut -c1-400)"
done

# What the decode kernel's copies alone draw from DRAM (a standalone probe, sm_90).
t=$(date +%s)
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
if nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/decode_stream_probe bench/decode_stream_probe.cu > "$OUT/decode_stream_probe.log" 2>&1 &&
    timeout "${SYMHEAP_BENCH_TIMEOUT:-240}" /tmp/decode_stream_probe >> "$OUT/decode_stream_probe.log" 2>&1; then status=ok; else status="FAILED rc $?"; fi
note "bench/decode_stream_probe.cu: $status ($(elapsed $t))"

# The demo at the large preset: every launch model (JAX's two included) and the
# torch.distributed baseline, in one run.
t=$(date +%s)
if timeout "${SYMHEAP_DEMO_TIMEOUT:-1500}" $PY examples/moe_block.py --backend cuda --size large \
    --steps 6 --launch threads,processes,mixed,torchrun,mpirun,jax --jax-mode threads,shard_map \
    --baseline --plot "$OUT/moe_block_large.png" > "$OUT/moe_block_large.log" 2>&1; then status=ok; else status="FAILED rc $?"; fi
note "examples/moe_block.py --size large: $status ($(elapsed $t)); $(grep -E 'tokens/s,|checks|FAILED' "$OUT/moe_block_large.log" | tr '\n' ' ' | cut -c1-900)"

echo "================ summary"
printf '%s\n' "${summary[@]}"
