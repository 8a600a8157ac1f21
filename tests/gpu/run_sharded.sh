#!/usr/bin/env bash
# Runs the single-GPU tests of one file in N pytest processes at once, spread
# over the GPUs present. For files whose time goes to compilation on the host
# (XLA, cuDNN plans) rather than to the GPU: the full grid in minutes.
#   bash tests/gpu/run_sharded.sh N FILE [pytest -k expression]
# Logs: $OUT/sharded_<file>.log (every shard's, one after another); the last
# line sums every shard.
# SHARD_ALL_GPUS=1 lets every shard see every GPU (files of multi-GPU tests);
# SHARD_TIMEOUT=SECONDS stops every shard that many seconds after this script
# started (collection included), so the summary still comes; a shard that
# ends before its own summary (stopped so, or crashed) is counted from its
# progress lines (its tests run so far).
set -uo pipefail
start=$(date +%s)
n=$1 file=$2 expr=${3:-}
# Several processes share each GPU: JAX must not claim most of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
name=$(basename "$file" .py)
rm -f "$OUT"/sharded_"${name}"_*.log
ids=$(mktemp)
args=(-q -p no:cacheprovider)
[ -n "$expr" ] && args+=(-k "$expr")
$PY -m pytest "${args[@]}" --collect-only "$file" 2>/dev/null | grep '::' > "$ids"
total=$(wc -l < "$ids")
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 1 ] || gpus=1
echo "[sharded] $file: $total tests in $n shards over $gpus GPU(s)"
pids=()
for ((i = 0; i < n; i++)); do
  awk -v n="$n" -v i="$i" 'NR % n == i' "$ids" > "$ids.$i"
  [ -s "$ids.$i" ] || continue
  mapfile -t shard < "$ids.$i"
  visible=$((i % gpus))
  [ -n "${SHARD_ALL_GPUS:-}" ] && visible=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus - 1)))}
  budget=$(( ${SHARD_TIMEOUT:-3600} - ($(date +%s) - start) ))
  [ "$budget" -gt 1 ] || budget=1
  CUDA_VISIBLE_DEVICES=$visible timeout $budget $PY -m pytest -q -p no:cacheprovider --timeout=${SYMHEAP_TEST_TIMEOUT:-150} \
    "${shard[@]}" > "$OUT/sharded_${name}_$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
passed=0 failed=0 skipped=0 errors=0 cut=0
for f in "$OUT"/sharded_"${name}"_*.log; do
  [ -e "$f" ] || continue  # no shard ran (nothing collected)
  last=$(tail -1 "$f")
  if ! echo "$last" | grep -qE " in [0-9.]+s"; then
    # Stopped before its summary: count its progress characters (. passed, F failed,
    # E error, s skipped) from pytest's -q progress lines.
    cut=$((cut + 1))
    marks=$(grep -E '^[.FEsxX]+( +\[ *[0-9]+%\])?$' "$f" | sed -E 's/ +\[ *[0-9]+%\]$//' | tr -d '\n')
    last="$(echo -n "$marks" | tr -cd . | wc -c) passed, $(echo -n "$marks" | tr -cd F | wc -c) failed, $(echo -n "$marks" | tr -cd E | wc -c) error, $(echo -n "$marks" | tr -cd s | wc -c) skipped"
  fi
  for kind in passed failed skipped error; do
    c=$(echo "$last" | grep -oE "[0-9]+ $kind" | grep -oE '[0-9]+' || true)
    c=${c:-0}
    case $kind in passed) passed=$((passed + c));; failed) failed=$((failed + c));;
      skipped) skipped=$((skipped + c));; error) errors=$((errors + c));; esac
  done
  grep -E '^(FAILED|ERROR)' "$f" | head -5
done
rm -f "$ids" "$ids".*
cat "$OUT"/sharded_"${name}"_*.log > "$OUT/sharded_${name}.log" 2>/dev/null && rm -f "$OUT"/sharded_"${name}"_*.log
cut_note=""
[ "$cut" -gt 0 ] && cut_note=", $cut shard(s) ended before their summary (SHARD_TIMEOUT or a crash): counted from their progress"
echo "[sharded] $file: $passed passed, $failed failed, $errors errors, $skipped skipped of $total (rc $rc$cut_note)"
exit $rc
