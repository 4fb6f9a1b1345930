"""Checks a GPU-built atom_sched._core on a machine without a GPU (CI), or with one.

    python scripts/check_gpu_module.py BUILD_DIR BACKEND [SUITE ...]   # cuda | hip | hip-cpu

Copies the package sources and BUILD_DIR's compiled module into a temporary package, then, in a
fresh interpreter: the module imports; it names BACKEND; without a device it reports 0 devices and
a launch fails with DeviceError (not a crash); the CPU reference path of DeviceBatchBuilder runs a
few scheduler steps and matches the host batch arrays; finally the GPU test suite runs and, without
a device, skips with its reason (printed).

BACKEND hip-cpu (ATOM_SCHED_GPU=HIP_CPU, make test-hip-cpu-python): the kernels run on the host, so
the builder on CPU tensors launches them (runs_kernels) and the suites run instead of skipping:
SUITEs (default test_device_gpu.py) run with ATOM_SCHED_REQUIRE_DEVICE=1, a skip of the GPU suite
is an error.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHECK = r"""
import sys
import numpy as np
import atom_sched
from atom_sched import _core, DeviceBatchBuilder, Scheduler, SchedulerConfig
backend = sys.argv[1]
assert _core.device_backend() == backend, (_core.device_backend(), backend)
n = _core.device_count()
print(f"atom_sched._core from {_core.__file__}: backend={backend} devices={n} "
      f"warp_size={_core.device_warp_size()}")
cfg = SchedulerConfig(64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                      max_model_len=64, num_speculative_tokens=2)
sched = Scheduler(cfg)
builder = DeviceBatchBuilder(cfg, device="cpu")
# Only the hip-cpu build runs the kernels themselves on CPU tensors; the others the references.
assert builder.runs_kernels == (backend == "hip-cpu"), builder.runs_kernels
if n == 0:
    # A launch must fail cleanly: DeviceError naming the reason, no abort.
    try:
        _core.device_prepare(1, builder._state, builder._outputs, 1, 1, 0, True)
    except _core.DeviceError as e:
        print(f"launch without a device: DeviceError: {e}")
    else:
        raise SystemExit("a launch without a device did not raise DeviceError")
for rid, p in enumerate([list(range(10, 21)), list(range(30, 35))]):
    sched.add_request(rid, p)
steps = 0
while sched.has_unfinished_requests() and steps < 12:
    b = sched.schedule()
    x = builder.prepare(b)
    m = b.num_tokens
    assert (x.input_ids.numpy()[:m] == b.scheduled_tokens).all()
    assert (x.positions.numpy()[:m] == b.positions).all()
    assert (x.slot_mapping.numpy()[:m] == b.slot_mapping).all()
    assert (x.block_table.numpy()[: b.num_rows] == b.block_tables).all()
    tgt = np.full((b.num_rows, 3), 50 + steps, np.int32)
    r = builder.accept(b, tgt, np.full((b.num_rows, 2), 60 + steps, np.int32))
    sched.update(b, **r.update_kwargs())
    steps += 1
path = "kernels (hip-cpu)" if builder.runs_kernels else "reference"
print(f"CPU {path} path: {steps} scheduler steps match the host batch arrays")
"""


def main() -> int:
    build, backend = Path(sys.argv[1]), sys.argv[2]
    suites = sys.argv[3:] or ["test_device_gpu.py"]
    mods = glob.glob(str(build / "_core*.so"))
    if len(mods) != 1:
        print(f"expected one _core module in {build}, found {mods}")
        return 1
    with tempfile.TemporaryDirectory(prefix="atom_sched_gpu_") as tmp:
        pkg = Path(tmp) / "atom_sched"
        shutil.copytree(ROOT / "atom_sched", pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        shutil.copy(mods[0], pkg)
        env = dict(os.environ, PYTHONPATH=tmp)
        if backend == "hip-cpu":
            env["ATOM_SCHED_REQUIRE_DEVICE"] = "1"
        rc = subprocess.call([sys.executable, "-c", CHECK, backend], cwd=tmp, env=env)
        if rc != 0:
            return rc
        # The suites against this module: on a GPU (or hip-cpu) they run; without a device the
        # GPU suite skips with its reason.
        return subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
             *(str(ROOT / "tests" / "python" / s) for s in suites)],
            cwd=ROOT / "tests" / "python", env=env)


if __name__ == "__main__":
    sys.exit(main())
