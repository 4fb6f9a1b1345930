#!/usr/bin/env bash
# Instructions of the core's step path, counted by callgrind (machine-independent, unlike the
# timings): per decode row at several sizes and K, for the admission workload and per step of the
# preemption workload (scheduler_bench's preempt_256, the steps alone, with host block tables and
# without); and the bytes a decode row moves from beyond a 1 MB cache (callgrind's cache
# simulator: a 32 KB L1 and a 1 MB last level, this machine's L2), at 16,384 running where the
# records outgrow it.
# With the package installed (make install), also the Python fixed cost of a step: the
# instructions of the whole process for 4,000 steps less those for 2,000, over 2,000.
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
for args in "1024 0" "1024 3"; do  # requests out of phase: a sixteenth reach a block's end a step
  set -- $args
  ir=$(count decode-spread "$1" "$2" 32)
  rows=$(grep -oP 'rows \K[0-9]+' "$out/stdout")
  echo "decode, $1 running, K=$2, prompts of 32..47 tokens: $((ir / rows)) instructions per row"
done
valgrind --tool=callgrind --instr-atstart=no --cache-sim=yes --D1=32768,8,64 --LL=1048576,16,64 \
  --callgrind-out-file="$out/cg" "$bin" decode 16384 0 32 >"$out/stdout" 2>"$out/stderr"
misses=$(grep -oP 'LL misses: +\K[0-9,]+' "$out/stderr" | tr -d ,)
rows=$(grep -oP 'rows \K[0-9]+' "$out/stdout")
echo "decode, 16384 running, K=0: $((misses * 64 / rows)) bytes per row from beyond a 1 MB cache"
ir=$(count admission)
tokens=$(grep -oP 'tokens \K[0-9]+' "$out/stdout")
echo "admission, 256 x 1,024-token prompts: $ir instructions ($(awk "BEGIN{printf \"%.1f\", $ir/$tokens}") per computed token)"
ir=$(count preemption 2000)
echo "preemption pressure, 256 live requests: $((ir / 2000)) instructions per step ($(grep -oP 'preemptions \K[0-9]+' "$out/stdout") preemptions in 2,000 steps)"
ir=$(count preemption-no-host-tables 2000)
echo "the same without host block tables: $((ir / 2000)) instructions per step"
py=${PYTHON:-$PWD/.venv/bin/python}
# (From /: here the source tree's atom_sched, without the compiled module, would shadow it.)
if (cd / && "$py" -c "import atom_sched._core") 2>/dev/null; then
  steps() {  # instructions of the whole process for $1 steps
    PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1 valgrind --tool=callgrind --callgrind-out-file=/dev/null \
      "$py" benchmarks/count/count_python_step.py "$1" 2>&1 | grep -oP 'Collected : \K[0-9]+'
  }
  a=$(steps 2000)
  b=$(steps 4000)
  echo "Python fixed cost (schedule + views + update, 1 running): $(((b - a) / 2000)) instructions per step"
fi
