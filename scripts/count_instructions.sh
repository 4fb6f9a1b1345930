#!/usr/bin/env bash
# Instructions of the core's step path, counted by callgrind (machine-independent, unlike the
# timings): per decode row at several sizes and K, and for the admission workload.
#   usage: bash scripts/count_instructions.sh [path/to/atom_sched_count]
# Needs valgrind, and the counter built with the C++ benchmarks (make build-cpp).
set -euo pipefail
bin=${1:-build/cpp/atom_sched_count}
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
[ -x "$bin" ] || { echo "$bin not found: run make build-cpp" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
count() {  # args of the counter -> "instructions counted"
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out/cg" "$bin" "$@" \
    >"$out/stdout" 2>"$out/stderr"
  grep -oP 'Collected : \K[0-9]+' "$out/stderr"
}
for args in "1024 0" "4096 0" "16384 0" "256 3" "1024 3"; do
  set -- $args
  ir=$(count decode "$1" "$2" 32)
  rows=$(grep -oP 'rows \K[0-9]+' "$out/stdout")
  echo "decode, $1 running, K=$2: $((ir / rows)) instructions per row"
done
ir=$(count admission)
tokens=$(grep -oP 'tokens \K[0-9]+' "$out/stdout")
echo "admission, 256 x 1,024-token prompts: $ir instructions ($(awk "BEGIN{printf \"%.1f\", $ir/$tokens}") per computed token)"
