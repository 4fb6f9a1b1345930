"""Checks a GPU-built atom_sched._core on a machine without a GPU (CI), or with one.

    python scripts/check_gpu_module.py BUILD_DIR BACKEND     # BACKEND: cuda | hip

Copies the package sources and BUILD_DIR's compiled module into a temporary package, then, in a
fresh interpreter: the module imports; it names BACKEND; without a device it reports 0 devices and
a launch fails with DeviceError (not a crash); the CPU reference path of DeviceBatchBuilder runs a
few scheduler steps and matches the host batch arrays; finally the GPU test suite runs and, without
a device, skips with its reason (printed).
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
print(f"CPU reference path: {steps} scheduler steps match the host batch arrays")
"""


def main() -> int:
    build, backend = Path(sys.argv[1]), sys.argv[2]
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
        rc = subprocess.call([sys.executable, "-c", CHECK, backend], cwd=tmp, env=env)
        if rc != 0:
            return rc
        # The GPU suite against this module: runs on a GPU, skips with a reason without one.
        return subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
             str(ROOT / "tests" / "python" / "test_device_gpu.py")],
            cwd=ROOT / "tests" / "python", env=env)


if __name__ == "__main__":
    sys.exit(main())
