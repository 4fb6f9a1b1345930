#!/usr/bin/env bash
# Stress the HIP-CPU parity drivers under CPU contention: WORKERS drivers at once (more than the
# cores), each running RUNS seeds in turn, then one line: runs, failures (each failure's seed and
# first line are printed as it happens). Used to check timing-dependent mismatches
# (docs/device.md, "Executing the kernels on the CPU").
#
#   scripts/stress_device_parity.sh [BUILD_DIR] [RUNS] [WORKERS] [FIRST_SEED]
#   (defaults: build/hip_cpu 25 4 1; workers alternate warp 64 and warp 32)
set -u
build=${1:-build/hip_cpu}
runs=${2:-25}
workers=${3:-4}
first=${4:-1}
log=$(mktemp -d)
for w in $(seq 1 "$workers"); do
  if (( w % 2 == 1 )); then exe=$build/atom_sched_device_parity_w64; else exe=$build/atom_sched_device_parity_w32; fi
  (
    fails=0
    for i in $(seq 1 "$runs"); do
      seed=$((first + w * 1000000 + i))
      if ! out=$("$exe" --seed "$seed" 2>&1); then
        fails=$((fails + 1))
        echo "FAIL $(basename "$exe") seed $seed: $(echo "$out" | tail -1 | cut -c1-300)"
      fi
    done
    echo "$runs $fails" > "$log/$w"
  ) &
done
wait
total=0
failed=0
for f in "$log"/*; do
  read -r r fl < "$f"
  total=$((total + r))
  failed=$((failed + fl))
done
rm -rf "$log"
echo "stress: $total runs ($workers drivers at once on $(nproc) cores), $failed failed"
(( failed == 0 ))
