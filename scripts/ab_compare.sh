#!/usr/bin/env bash
# Compares the core's speed at another commit with the working tree's, the way docs/perf.md's
# "alternated" figures are taken: this machine's speed swings up to 3x within minutes, so two
# builds timed apart say little. Builds both (Release, C++ benchmarks only), then alternates them
# ROUNDS times, each round one atom_sched_cpp_bench run per build (medians of 3 repetitions),
# and prints every round's medians side by side. The instruction counts of both follow
# (scripts/count_instructions.sh's decode and preemption workloads), which do not swing.
#   usage: bash scripts/ab_compare.sh REV [ROUNDS] [BENCH_FILTER]
#   e.g.   bash scripts/ab_compare.sh HEAD~3 4 'BM_DecodeStep/1024$'
# Needs what `make build-cpp` needs (Google Benchmark), and valgrind for the counts.
set -euo pipefail
rev=${1:?usage: ab_compare.sh REV [ROUNDS] [BENCH_FILTER]}
rounds=${2:-4}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2; }
git rev-parse --verify -q "$rev^{commit}" >/dev/null || { echo "not a commit: '$rev'" >&2; exit 2; }
filter=${3:-'BM_DecodeStep/(1024|16384)$|BM_DecodeStepMTP3/(256|1024)'}
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
old_src="$work/src"
cleanup() {
  git -C "$root" worktree remove --force "$old_src" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
git -C "$root" worktree add --detach -q "$old_src" "$rev"
build() {  # source dir, build dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DATOM_SCHED_BUILD_PYTHON=OFF \
    -DATOM_SCHED_BUILD_BENCHMARKS=ON >/dev/null
  cmake --build "$2" --target atom_sched_cpp_bench atom_sched_count >/dev/null
}
build "$old_src" "$work/old"
build "$root" "$work/new"
echo "A/B: $rev ($(git -C "$root" rev-parse --short "$rev")) against the working tree" \
  "($(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet || echo ', modified')),"\
  "$rounds rounds, filter '$filter'"
for ((r = 1; r <= rounds; ++r)); do
  for side in old new; do
    printf '%-3s %s load %s ' "$side" "$(date -u +%T)" "$(cut -d' ' -f1 /proc/loadavg)"
    "$work/$side/atom_sched_cpp_bench" --benchmark_filter="$filter" --benchmark_repetitions=3 \
      --benchmark_report_aggregates_only=true 2>/dev/null |
      awk '/_median/ {sub("_median", "", $1); printf "%s %s %s  ", $1, $2, $3} END {print ""}'
  done
done
if command -v valgrind >/dev/null; then
  echo "instructions (callgrind; per row, or per step for preemption):"
  count() {  # build dir, args of the counter
    local dir=$1
    shift
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/dev/null \
      "$dir/atom_sched_count" "$@" 2>&1 >"$work/stdout" | grep -oP 'Collected : \K[0-9]+'
  }
  for args in "decode 1024 0 32" "decode-spread 1024 0 32" "decode 1024 3 32" "preemption 2000"; do
    line="  $args:"
    for side in old new; do
      # shellcheck disable=SC2086  # the counter's arguments, split on purpose
      ir=$(count "$work/$side" $args)
      if [[ $args == preemption* ]]; then per=$((ir / 2000)); else
        per=$((ir / $(grep -oP 'rows \K[0-9]+' "$work/stdout"))); fi
      line+=" $side $per"
    done
    echo "$line"
  done
fi
