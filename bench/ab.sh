#!/usr/bin/env bash
# Builds variants of this tree side by side and runs a benchmark over them in
# turn, so that every figure has its reference from the same machine and run.
#
#   bash bench/ab.sh [-r ROUNDS] [-j JOBS] "SCRIPT ARGS" [PATCH ...]
#
# Variant "head" is the tree itself. Each PATCH, made with `git diff REV HEAD`
# (REV: the variant wanted, e.g. main), is applied in reverse to a copy of the
# tree; the variant is named after the file (diag/main.patch -> main). Every
# variant is built from a clean build directory into /tmp/ab-NAME (CUDA on,
# in parallel, JOBS compile jobs each); then each round runs
# `python3 SCRIPT ARGS` once per variant, in the order given (head last), with
# PYTHONPATH=/tmp/ab-NAME, and prints its "summary" lines prefixed by the name.
# Build logs go to $OUT (default ./ab-logs). With -s, each variant runs its own copy
# of SCRIPT (for variants whose bench script or API differ); lines matching
# $AB_GREP (default "summary") are reported. AB_REUSE=1 keeps builds already in /tmp/ab-*.
#
# Example: bash bench/ab.sh -r 2 "bench/ep_bench.py --cases 1 --iters 200" diag/main.patch
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=1
jobs=6
own_script=0
while getopts "r:j:s" opt; do
  case $opt in
    r) rounds=$OPTARG ;;
    j) jobs=$OPTARG ;;
    s) own_script=1 ;;
    *) echo "usage: bash bench/ab.sh [-s] [-r ROUNDS] [-j JOBS] \"SCRIPT ARGS\" [PATCH ...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [ $# -lt 1 ]; then
  echo "usage: bash bench/ab.sh [-r ROUNDS] [-j JOBS] \"SCRIPT ARGS\" [PATCH ...]" >&2
  exit 2
fi
bench=$1
shift
OUT=${OUT:-$PWD/ab-logs}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
tree=$PWD

names=()
for patch in "$@"; do
  [ -f "$patch" ] || { echo "ab.sh: no patch file $patch" >&2; exit 2; }
  patch_file=$(realpath "$patch")
  name=$(basename "$patch" .patch)
  [ "$name" != head ] || { echo "ab.sh: \"head\" names the tree itself; rename $patch" >&2; exit 2; }
  src=/tmp/ab-src-$name
  rm -rf "$src" && cp -r "$tree" "$src"
  if ! (cd "$src" && patch -s -R -p1 < "$patch_file"); then
    echo "ab.sh: $patch does not apply in reverse to this tree" >&2
    exit 1
  fi
  names+=("$name")
done
names+=(head)

build() {  # name, source
  if [ -n "${AB_REUSE:-}" ] && [ -d "/tmp/ab-$1/symheap" ]; then
    echo "[ab] reusing the build of $1 (AB_REUSE)"; return 0
  fi
  rm -rf "/tmp/ab-$1" "$2/build"
  if (cd "$2" && SYMHEAP_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip install -q \
        --no-build-isolation --no-deps --target "/tmp/ab-$1" .) > "$OUT/build-$1.log" 2>&1; then
    echo "[ab] built $1"
  else
    echo "[ab] build of $1 FAILED (see $OUT/build-$1.log):"; tail -20 "$OUT/build-$1.log"
    return 1
  fi
}
start=$(date +%s)
pids=()
for name in "${names[@]}"; do
  src=/tmp/ab-src-$name
  [ "$name" = head ] && src=$tree
  build "$name" "$src" &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
[ $failed = 0 ] || exit 1
echo "[ab] builds done in $(( $(date +%s) - start )) s"

for ((r = 1; r <= rounds; r++)); do
  for name in "${names[@]}"; do
    log="$OUT/run-$name-$r.log"
    dir=$tree
    [ $own_script = 1 ] && [ "$name" != head ] && dir=/tmp/ab-src-$name
    # shellcheck disable=SC2086  # the script and its arguments, split on purpose
    (cd "$dir" && PYTHONPATH=/tmp/ab-$name timeout "${AB_TIMEOUT:-300}" python3 $bench) > "$log" 2>&1
    rc=$?
    lines=$(grep -E "${AB_GREP:-summary}" "$log")
    if [ -n "$lines" ]; then
      echo "$lines" | sed "s/^/$name (round $r): /"
    else
      echo "$name (round $r): no summary (rc $rc); last lines:"; tail -5 "$log"
    fi
  done
done
