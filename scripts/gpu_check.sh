#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build the CUDA back end of atom_sched, run the device suites
# (kernels against their CPU references, the builder on the GPU driving a real scheduler, the
# builder's misuse cases) and time the kernels for 64 to 4,096 decode rows (median over many
# replays, prepare captured in a CUDA graph), printing a table and writing it to $OUT (else
# bench_out/). One command, no manual step: GPU time is scarce, so it must work the first time.
#
#   bash scripts/gpu_check.sh            # or: make gpu-check
#   bash scripts/gpu_check.sh hip-cpu    # rehearsal without a GPU (make gpu-check-rehearsal, in
#                                        # make test): every step the same, but the back end is
#                                        # HIP_CPU, so the kernels run on the host on CPU tensors,
#                                        # and fewer sizes are timed (host times, not GPU times)
#
# Needs CMake, ninja, a Python with pybind11, numpy, pytest, hypothesis and torch (PYTHON=...,
# default: the first of .venv/bin/python and python3 whose torch sees a GPU, any torch for the
# rehearsal) and, for CUDA, nvcc (NVCC=..., CUDA_ARCH=... default: the GPU's); JOBS=... (nproc). Without a GPU it
# says so and exits 2, having measured nothing. Exit status: 0 when the suites passed and the
# timings ran, 1 otherwise (both always run). After a run on a GPU, copy the table into
# docs/perf.md with the date and the device.
set -euo pipefail
cd "$(dirname "$0")/.."

BACKEND="${1:-cuda}"
case "$BACKEND" in
  cuda | hip-cpu) ;;
  *) echo "usage: $0 [cuda|hip-cpu]" >&2; exit 2 ;;
esac

OUT_DIR="${OUT:-bench_out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
exec > >(tee "$LOG") 2>&1

# The Python to use: its torch must see a GPU for the CUDA check.
pick_python() {
  local need='import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'
  [ "$BACKEND" = hip-cpu ] && need='import torch'
  for py in ${PYTHON:-} .venv/bin/python python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c "$need" 2>/dev/null; then
      echo "$py"
      return 0
    fi
  done
  return 1
}

echo "== gpu_check ($BACKEND) $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname)"
[ "$BACKEND" = cuda ] && { nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"; }
if ! PY=$(pick_python); then
  echo "NO GPU: no Python here has a torch that sees a GPU; nothing was built or measured."
  echo "no GPU was available to run the GPU checks" > "$OUT_DIR/device_bench.md"
  exit 2
fi
PY=$(command -v "$PY")
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute (the steps change directory)
echo "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"

BUILD="${GPU_CHECK_BUILD:-build/gpu-check-$BACKEND}"  # make gpu-check-rehearsal reuses build/hip_cpu_py
CMAKE_ARGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DATOM_SCHED_BUILD_PYTHON=ON
            -DATOM_SCHED_BUILD_TESTS=OFF -DPython_EXECUTABLE="$PY"
            -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)")
if [ "$BACKEND" = cuda ]; then
  echo "device: $("$PY" -c 'import torch; print(torch.cuda.get_device_name())')"
  NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
  ARCH="${CUDA_ARCH:-$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")')}"
  CMAKE_ARGS+=(-DATOM_SCHED_GPU=CUDA -DCMAKE_CUDA_COMPILER="$NVCC"
               -DCMAKE_CUDA_ARCHITECTURES="$ARCH")
  echo "== build: CUDA back end for sm_$ARCH with $NVCC"
  MODULE_BACKEND=cuda TORCH_DEVICE=cuda ROWS=64,256,1024,4096 STEPS=30
else
  CMAKE_ARGS+=(-DATOM_SCHED_GPU=HIP_CPU)
  echo "== build: HIP_CPU back end (rehearsal: the kernels run on the host)"
  MODULE_BACKEND=hip-cpu TORCH_DEVICE=cpu ROWS=64,1024 STEPS=5
fi
cmake -S . -B "$BUILD" "${CMAKE_ARGS[@]}" >/dev/null
cmake --build "$BUILD" --target _core -j "${JOBS:-$(nproc)}"

# A package directory: the sources plus the module just built.
PKG="$BUILD/pkg"
rm -rf "$PKG" && mkdir -p "$PKG"
cp -r atom_sched "$PKG/"
rm -f "$PKG"/atom_sched/*.so
cp "$BUILD"/_core*.so "$PKG/atom_sched/"
export PYTHONPATH="$PWD/$PKG${PYTHONPATH:+:$PYTHONPATH}"
# Python run from the repository root would import the in-tree atom_sched/ (no module): not here.
(cd "$PKG" && "$PY" - "$MODULE_BACKEND") <<'EOF'
import sys
from atom_sched import _core
print("module:", _core.__file__, "backend", _core.device_backend(), "devices", _core.device_count())
assert _core.device_backend() == sys.argv[1], "the module was not built for " + sys.argv[1]
assert _core.device_count() >= 1, "the module sees no device"
EOF

status=0
echo "== device suites (kernels vs CPU references, builder driving a scheduler, misuse)"
# ATOM_SCHED_REQUIRE_DEVICE=1: a suite that would skip for want of a device fails instead.
(cd tests/python && ATOM_SCHED_REQUIRE_DEVICE=1 "$PY" -m pytest -q -rs -p no:cacheprovider \
  test_device_gpu.py test_device_builder.py test_device_properties.py test_device_misuse.py) ||
  status=1

echo "== kernel timings"
"$PY" benchmarks/bench_device.py --device "$TORCH_DEVICE" --rows "$ROWS" --k 0,3 \
  --steps "$STEPS" --out "$OUT_DIR" --check || status=1
echo "== done ($BACKEND): $([ $status = 0 ] && echo PASSED || echo FAILED); table in" \
  "$OUT_DIR/device_bench.md, log in $LOG"
exit $status
