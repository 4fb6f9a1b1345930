#!/usr/bin/env bash
# vLLM 0.32.0's own scheduler tests (tests/v1/core: test_scheduler.py, test_async_scheduler.py,
# test_prefix_caching.py) against atom_sched.vllm.AtomScheduler (docs/vllm.md "vLLM's own
# scheduler tests"), in the venv of scripts/vllm_venv.sh.
#
#   scripts/vllm_upstream_tests.sh [pytest args]            # against AtomScheduler
#   scripts/vllm_upstream_tests.sh --control [pytest args]  # the same on vLLM's own scheduler
#
# The test files are not in this repository: they are extracted from vLLM's sdist on PyPI (its
# sha256 checked against PyPI's), once, into build/vllm-tests (idempotent; offline after that).
# The tests build vLLM's ModelConfig for facebook/opt-125m, which reads only the model's HF
# config: tests/vllm/upstream/opt-125m/config.json, served from a local HF cache, offline.
# tests/vllm/upstream/atom_upstream.py (a pytest plugin) swaps the scheduler class and holds the
# list of the tests expected not to pass, each with its reason.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
PY="$VENV/bin/python"
VLLM_VERSION=0.32.0
DEST=$ROOT/build/vllm-tests
SRC=$DEST/vllm-$VLLM_VERSION
FILES=(tests/__init__.py tests/v1/__init__.py tests/v1/core/__init__.py tests/v1/core/utils.py
       tests/v1/core/test_scheduler.py tests/v1/core/test_async_scheduler.py
       tests/v1/core/test_prefix_caching.py
       tests/v1/kv_connector/__init__.py tests/v1/kv_connector/unit/__init__.py
       tests/v1/kv_connector/unit/utils.py)

mode=atom
if [ "${1:-}" = "--control" ]; then
  mode=vllm
  shift
fi

if [ ! -f "$SRC/.extracted" ]; then
  mkdir -p "$DEST"
  "$PY" - "$VLLM_VERSION" "$DEST" "${FILES[@]}" <<'PYEOF'
import hashlib, json, sys, tarfile, tempfile, urllib.parse, urllib.request
from pathlib import Path

version, dest, files = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
index = "https://pypi.org/pypi/vllm/json"
with urllib.request.urlopen(index, timeout=60) as r:
    meta = json.load(r)
(sdist,) = [u for u in meta["releases"][version] if u["packagetype"] == "sdist"]
url = urllib.parse.urljoin(index, sdist["url"])
want = sdist["digests"]["sha256"]
prefix = f"vllm-{version}/"
with tempfile.TemporaryFile() as tmp:
    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as r:
        while chunk := r.read(1 << 20):
            h.update(chunk)
            tmp.write(chunk)
    if h.hexdigest() != want:
        sys.exit(f"{sdist['filename']}: sha256 {h.hexdigest()}, PyPI says {want}")
    tmp.seek(0)
    with tarfile.open(fileobj=tmp, mode="r:gz") as tar:
        members = [tar.getmember(prefix + f) for f in files]
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **safe)
(dest / prefix / ".extracted").write_text(f"{sdist['filename']} sha256 {want}\n")
print(f"extracted {len(files)} files of {sdist['filename']} (sha256 {want}) into {dest / prefix}")
PYEOF
fi

# A local Hugging Face cache holding only OPT-125m's config.
HF_CACHE=$DEST/hf-cache
REV=0000000000000000000000000000000000000000
MODEL_DIR=$HF_CACHE/models--facebook--opt-125m
mkdir -p "$MODEL_DIR/refs" "$MODEL_DIR/snapshots/$REV"
printf %s "$REV" > "$MODEL_DIR/refs/main"
cp "$ROOT/tests/vllm/upstream/opt-125m/config.json" "$MODEL_DIR/snapshots/$REV/config.json"

cd "$SRC"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_CACHE=$HF_CACHE VLLM_CPU_KVCACHE_SPACE=1
export ATOM_UPSTREAM_SCHEDULER=$mode PYTHONPATH=$ROOT/tests/vllm/upstream
exec "$PY" -m pytest -q -c /dev/null --rootdir "$SRC" -p no:cacheprovider -p atom_upstream \
  -rfEX tests/v1/core/test_scheduler.py tests/v1/core/test_async_scheduler.py \
  tests/v1/core/test_prefix_caching.py "$@"
