#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build the CUDA back end of atom_sched, run the GPU tests
# (kernels against their CPU references, the builder on the GPU driving a real scheduler) and
# time the kernels for 64 to 4,096 decode rows (median over many replays, prepare captured in a
# CUDA graph), printing a table and writing it to $OUT (else bench_out/).
#
#   bash scripts/gpu_check.sh            # or: make gpu-check
#
# Needs nvcc, CMake, ninja and a Python with pybind11, numpy, pytest, hypothesis and a CUDA build
# of torch (PYTHON=..., default: the first of .venv/bin/python and python3 whose torch sees a GPU).
# Without a GPU it says so and exits 2, having measured nothing. After a run on a GPU, copy the
# table into docs/perf.md with the date and the device.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-bench_out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
exec > >(tee "$LOG") 2>&1

pick_python() {
  for py in ${PYTHON:-} .venv/bin/python python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
    then
      echo "$py"
      return 0
    fi
  done
  return 1
}

echo "== gpu_check $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname)"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
if ! PY=$(pick_python); then
  echo "NO GPU: no Python here has a torch that sees a GPU; nothing was built or measured."
  echo "no GPU was available to run the GPU checks" > "$OUT_DIR/device_bench.md"
  exit 2
fi
PY=$(command -v "$PY")
echo "python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'))"

NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
ARCH="${CUDA_ARCH:-$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")')}"
BUILD=build/gpu-check
PYBIND_DIR=$("$PY" -m pybind11 --cmakedir)
echo "== build: CUDA back end for sm_$ARCH with $NVCC"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DATOM_SCHED_GPU=CUDA \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DATOM_SCHED_BUILD_PYTHON=ON -DATOM_SCHED_BUILD_TESTS=OFF \
  -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$PYBIND_DIR" >/dev/null
cmake --build "$BUILD" --target _core -j "${JOBS:-8}"

# A package directory: the sources plus the CUDA-built module.
PKG="$BUILD/pkg"
rm -rf "$PKG" && mkdir -p "$PKG"
cp -r atom_sched "$PKG/"
rm -f "$PKG"/atom_sched/*.so
cp "$BUILD"/_core*.so "$PKG/atom_sched/"
export PYTHONPATH="$PWD/$PKG${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'from atom_sched import _core; print("module:", _core.__file__, "backend", _core.device_backend(), "devices", _core.device_count())'

echo "== GPU tests (kernels vs CPU references, builder on the GPU) and the CPU-reference suites"
(cd tests/python && "$PY" -m pytest -q -rs -p no:cacheprovider \
  test_device_gpu.py test_device_builder.py test_device_properties.py)

echo "== kernel timings"
"$PY" benchmarks/bench_device.py --device cuda --rows 64,256,1024,4096 --k 0,3 --out "$OUT_DIR" \
  --check
echo "== done: table in $OUT_DIR/device_bench.md, log in $LOG"
