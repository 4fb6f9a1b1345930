"""vLLM's own scheduler against ``atom_sched.vllm.AtomScheduler``, side by side, in one run.

Both classes are built from the same vLLM config objects (``VllmConfig`` with a real
``ModelConfig``, ``SchedulerConfig`` and ``CacheConfig``; a real ``KVCacheConfig`` with one
``FullAttentionSpec`` group), as vLLM's tests/v1/core/utils.py ``create_scheduler`` builds them,
and are fed real ``vllm.v1.request.Request``s with real ``SamplingParams`` (greedy, the EOS of
OPT's config, and the request block hasher vLLM's engine core gives each request when prefix
caching is on). For each N (running requests): ``max_num_seqs = N``, a KV pool large enough that
nothing is preempted, prefix caching on, blocks of 16 tokens, 64-token prompts (each distinct),
``max_tokens`` large enough that nothing finishes. The N prompts are prefilled, then the
schedulers run steady decode steps (N rows of one token each).

Each step: ``schedule()``, then the ``ModelRunnerOutput`` a model runner would return, built by
the stand-in runner of tests/vllm/stand_in.py (outside the scheduler's time: reported on its own),
then ``update_from_output()``. The two schedulers alternate in rounds (``--rounds``, each of
``--steps`` steps, who goes first alternating), after a warm-up; the garbage collector is off
within a round. Reported per N: median and p90 per step of schedule, update_from_output and
their sum, for each scheduler, and the ratio vLLM / atom_sched of the medians.

Then, for AtomScheduler only, a split pass (``--steps`` more steps) times the C++ core's calls
(``core.schedule`` and ``core.update``, through a thin timing wrapper around ``self.core``)
inside its ``schedule()`` and ``update_from_output()``: the rest is the Python translation into
and out of vLLM's objects. ``--profile`` adds a cProfile run of both schedulers at one size.

Every step is checked outside the timer: N rows of one token, nothing preempted or finished,
one output per request.

    .venv-vllm/bin/python benchmarks/vllm_scheduler_bench.py \
        [--sizes 256,1024,4096] [--steps 40] [--rounds 5] [--json out.json] [--profile 1024]

Needs the venv of scripts/vllm_venv.sh (``make bench-vllm`` runs it). Offline: the model config
is tests/vllm/upstream/opt-125m/config.json (nothing but the HF config is read).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import math
import os
import platform
import pstats
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))  # stand_in.py, shared with the tests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MODEL_DIR = ROOT / "tests" / "vllm" / "upstream" / "opt-125m"  # OPT-125m's HF config only
BLOCK_SIZE = 16
PROMPT_LEN = 64
EOS = 2  # OPT's; the stand-in runner samples token 7
KINDS = ("vllm", "atom")


def _load() -> str:
    try:
        out = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout
        return out.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def build(kind: str, n: int, tokens_per_request: int) -> Any:
    """vLLM's ``Scheduler`` or ``AtomScheduler`` for n running requests, from the same configs."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from atom_sched.vllm import AtomScheduler

    max_model_len = tokens_per_request + BLOCK_SIZE
    budget = max(8192, n)
    model_config = ModelConfig(model=str(MODEL_DIR), skip_tokenizer_init=True, dtype="float16",
                               seed=42, max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=n, max_num_batched_tokens=budget, max_model_len=max_model_len,
        enable_chunked_prefill=True, is_encoder_decoder=False, watermark=0.0, policy="fcfs")
    cache_config = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9,
                               cache_dtype="auto", enable_prefix_caching=True)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, parallel_config=ParallelConfig())
    # Every request's whole length in blocks, plus one each and the null block: no preemption.
    num_blocks = n * (math.ceil(tokens_per_request / BLOCK_SIZE) + 1) + 1
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(vllm_config)
    cls = Scheduler if kind == "vllm" else AtomScheduler
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=BLOCK_SIZE, log_stats=True)
    sched.use_v2_model_runner = False  # the V1 runner (vLLM's CPU platform here)
    return sched


def _block_hasher() -> Any:
    """What vLLM's engine core gives each request with prefix caching on (its default algo)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(BLOCK_SIZE, fn)


class Driver:
    """One scheduler with its stand-in runner, brought to steady decode with n requests."""

    def __init__(self, kind: str, n: int, total_steps: int) -> None:
        from stand_in import StandInRunner, make_request

        self.kind, self.n = kind, n
        max_tokens = total_steps + 64  # never finishes within the run
        self.sched = build(kind, n, PROMPT_LEN + max_tokens)
        self.runner = StandInRunner(BLOCK_SIZE)
        hasher = _block_hasher()
        for i in range(n):
            # Distinct prompts (no prefix hits): token ids from i, wrapped below OPT's vocab.
            prompt = [3 + (i * PROMPT_LEN + j) % 50000 for j in range(PROMPT_LEN)]
            self.sched.add_request(make_request(f"req-{i}", prompt, max_tokens,
                                                eos_token_id=EOS, block_hasher=hasher))
        for _ in range(10_000):
            out = self.sched.schedule()
            decode = (len(out.num_scheduled_tokens) == n and out.total_num_scheduled_tokens == n
                      and not out.scheduled_new_reqs)
            self.sched.update_from_output(out, self.runner.step(out))
            if decode:
                break
        else:
            raise RuntimeError(f"{kind}: no steady decode step with {n} requests")

    def step(self) -> tuple[int, int, int]:
        """One timed step: ns of schedule(), of building the runner output, of update."""
        t0 = time.perf_counter_ns()
        out = self.sched.schedule()
        t1 = time.perf_counter_ns()
        mro = self.runner.step(out)
        t2 = time.perf_counter_ns()
        result = self.sched.update_from_output(out, mro)
        t3 = time.perf_counter_ns()
        # Checked outside the timer: a steady decode step, nothing preempted or finished.
        n = self.n
        if (out.total_num_scheduled_tokens != n or len(out.num_scheduled_tokens) != n
                or out.preempted_req_ids or out.scheduled_new_reqs):
            raise RuntimeError(f"{self.kind}: not a steady decode step of {n} rows")
        outs = [o for eco in result.values() for o in eco.outputs]
        if len(outs) != n or any(o.finish_reason is not None or len(o.new_token_ids) != 1
                                 for o in outs):
            raise RuntimeError(f"{self.kind}: not one token for each of the {n} requests")
        return t1 - t0, t2 - t1, t3 - t2


class TimedCore:
    """Wraps AtomScheduler.core: times core.schedule and core.update, passes the rest on."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self.schedule_ns: list[int] = []
        self.update_ns: list[int] = []

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        batch = self._core.schedule(*args, **kwargs)
        self.schedule_ns.append(time.perf_counter_ns() - t0)
        return batch

    def update(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = self._core.update(*args, **kwargs)
        self.update_ns.append(time.perf_counter_ns() - t0)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


def _stats(ns: list[int]) -> dict[str, float]:
    ms = sorted(x / 1e6 for x in ns)
    p90 = ms[min(len(ms) - 1, math.ceil(0.9 * len(ms)) - 1)]
    return {"median_ms": statistics.median(ms), "p90_ms": p90, "n": len(ms)}


def _timed_steps(driver: Driver, steps: int) -> list[tuple[int, int, int]]:
    gc.collect()
    gc.disable()
    try:
        return [driver.step() for _ in range(steps)]
    finally:
        gc.enable()


def run_size(n: int, steps: int, rounds: int, warmup: int, profile: bool) -> dict[str, Any]:
    total = warmup + steps * (rounds + 1) + (steps if profile else 0)
    t_fill = {}
    drivers = {}
    for kind in KINDS:
        t0 = time.perf_counter()
        drivers[kind] = Driver(kind, n, total)
        t_fill[kind] = time.perf_counter() - t0
    for d in drivers.values():
        _timed_steps(d, warmup)
    samples: dict[str, list[tuple[int, int, int]]] = {k: [] for k in KINDS}
    for r in range(rounds):
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            samples[kind] += _timed_steps(drivers[kind], steps)
    res: dict[str, Any] = {"n": n, "fill_s": t_fill}
    for kind in KINDS:
        s = samples[kind]
        res[kind] = {"schedule": _stats([a for a, _, _ in s]),
                     "runner_output": _stats([b for _, b, _ in s]),
                     "update_from_output": _stats([c for _, _, c in s]),
                     "step": _stats([a + c for a, _, c in s])}
    res["ratio"] = res["vllm"]["step"]["median_ms"] / res["atom"]["step"]["median_ms"]

    # The split pass: how much of AtomScheduler's step is the C++ core.
    atom = drivers["atom"]
    timed = TimedCore(atom.sched.core)
    atom.sched.core = timed
    try:
        split = _timed_steps(atom, steps)
    finally:
        atom.sched.core = timed._core
    sched_ns, upd_ns = [a for a, _, _ in split], [c for _, _, c in split]
    core_s, core_u = timed.schedule_ns, timed.update_ns
    res["atom_split"] = {
        "schedule": _stats(sched_ns), "core_schedule": _stats(core_s),
        "py_schedule": _stats([a - b for a, b in zip(sched_ns, core_s, strict=True)]),
        "update_from_output": _stats(upd_ns), "core_update": _stats(core_u),
        "py_update": _stats([a - b for a, b in zip(upd_ns, core_u, strict=True)]),
        "step": _stats([a + c for a, c in zip(sched_ns, upd_ns, strict=True)]),
        "core_step": _stats([a + b for a, b in zip(core_s, core_u, strict=True)]),
    }
    if profile:
        res["profile"] = {}
        for kind in KINDS:
            prof = cProfile.Profile()
            d = drivers[kind]
            prof.enable()
            for _ in range(steps):
                out = d.sched.schedule()
                d.sched.update_from_output(out, d.runner.step(out))
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
            res["profile"][kind] = buf.getvalue()
    return res


def format_result(res: dict[str, Any]) -> str:
    n = res["n"]
    lines = [f"N = {n:,} running (fill: vLLM {res['fill_s']['vllm']:.1f} s, "
             f"atom_sched {res['fill_s']['atom']:.1f} s)"]
    lines.append(f"  {'ms per step':<24}{'schedule':>16}{'update_from_out':>18}"
                 f"{'sched+update':>16}{'runner output':>16}")
    for kind, label in (("vllm", "vLLM Scheduler"), ("atom", "AtomScheduler")):
        r = res[kind]
        cells = "".join(f"{r[k]['median_ms']:>9.3f} ({r[k]['p90_ms']:.3f})".rjust(w)
                        for k, w in (("schedule", 16), ("update_from_output", 18),
                                     ("step", 16), ("runner_output", 16)))
        lines.append(f"  {label:<24}{cells}")
    lines.append(f"  ratio vLLM / atom_sched (medians of schedule+update): {res['ratio']:.2f}x")
    s = res["atom_split"]
    lines.append(
        f"  AtomScheduler split (separate pass, medians): step {s['step']['median_ms']:.3f} ms ="
        f" core {s['core_step']['median_ms']:.3f} (schedule {s['core_schedule']['median_ms']:.3f}"
        f", update {s['core_update']['median_ms']:.3f}) + Python translation: schedule "
        f"{s['py_schedule']['median_ms']:.3f}, update_from_output "
        f"{s['py_update']['median_ms']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256,1024,4096", help="running requests, comma-separated")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per round and scheduler")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, the schedulers alternating")
    ap.add_argument("--warmup", type=int, default=10, help="untimed decode steps first")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also cProfile --steps steps of each scheduler at this size")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]

    import vllm

    import atom_sched

    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join([os.path.relpath(sys.executable)] + sys.argv),
            "uptime_start": _load(), "python": platform.python_version(),
            "vllm": vllm.__version__, "atom_sched": atom_sched.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
            "prompt_len": PROMPT_LEN, "block_size": BLOCK_SIZE}
    print(f"{meta['date']}  vLLM {meta['vllm']}, atom_sched {meta['atom_sched']}, "
          f"{args.rounds} rounds x {args.steps} steps per scheduler and size")
    print(f"uptime at start: {meta['uptime_start']}")
    print("medians (p90) in ms per step; schedule + update_from_output are the scheduler's "
          "cost, the runner output (stand-in) is not counted in it")
    results = []
    for n in sizes:
        res = run_size(n, args.steps, args.rounds, args.warmup, args.profile == n)
        results.append(res)
        print(format_result(res), flush=True)
        for kind, text in res.get("profile", {}).items():
            print(f"--- cProfile, {kind}, N = {n}, {args.steps} steps (runner output included)")
            print(text)
    meta["uptime_end"] = _load()
    print(f"uptime at end: {meta['uptime_end']}")
    print("\nN        vLLM ms/step  atom_sched ms/step   ratio  atom core ms  atom Python ms")
    for r in results:
        s = r["atom_split"]
        print(f"{r['n']:<8}{r['vllm']['step']['median_ms']:>13.3f}"
              f"{r['atom']['step']['median_ms']:>20.3f}{r['ratio']:>8.2f}x"
              f"{s['core_step']['median_ms']:>14.3f}"
              f"{s['py_schedule']['median_ms'] + s['py_update']['median_ms']:>16.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
