#!/usr/bin/env python3
"""``atom-sched bench`` from a checkout, whatever the current directory.

    .venv/bin/python benchmarks/run_bench.py --quick        # same options as `atom-sched bench`

The in-tree ``atom_sched/`` has no compiled ``_core``; when the current directory (or a
``sys.path`` entry) is the repository root it would shadow the installed package and the import
would fail. This wrapper drops such entries from ``sys.path`` before importing, and points the
C++ marginal-cost row at this checkout's ``build/cpp/atom_sched_cpp_bench`` when it exists.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _shadows(entry: str) -> bool:
    pkg = Path(entry or os.getcwd()).resolve() / "atom_sched"
    if not (pkg / "__init__.py").is_file():
        return False
    return not any(pkg.glob("_core*.so")) and not any(pkg.glob("_core*.pyd"))


def main() -> int:
    sys.path[:] = [e for e in sys.path if not _shadows(e)]
    try:
        from atom_sched.cli import main as cli_main
    except ImportError as e:
        print(f"run_bench: cannot import the compiled atom_sched ({e}).\n"
              "Run `make install` and use .venv/bin/python.", file=sys.stderr)
        return 2
    cpp = REPO / "build" / "cpp" / "atom_sched_cpp_bench"
    if "ATOM_SCHED_CPP_BENCH" not in os.environ and cpp.is_file():
        os.environ["ATOM_SCHED_CPP_BENCH"] = str(cpp)
    return cli_main(["bench", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
