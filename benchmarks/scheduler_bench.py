"""The atom_sched benchmark suite: the host-cost budgets of DESIGN.md section 8, measured through
the Python API with the batch arrays included.

Each workload runs a real scheduler and times, with ``time.perf_counter_ns``, what an engine's
step costs on the host: ``schedule()``, reading the numpy views a model runner uses
(``positions``, ``slot_mapping``, ``block_tables``, ``scheduled_tokens``, ``context_lens``,
``cu_seqlens_q``) and ``update(batch, sampled)`` with preallocated output arrays. Repetitions
follow a warm-up; the result is the median with the 10th and 90th percentiles. The garbage
collector is off while timing (as ``timeit`` does).

Every workload always verifies, outside the timed region, that it did what it claims (each
decode step had N rows, the prefix-sharing run got cache hits, the preemption run preempted...);
``check=True`` adds a full per-step verification of the batch arrays and outputs plus the
scheduler's invariants. A failed verification raises :class:`BenchCheckError`.

It lives in the repository, not in the wheel. Run it with ``atom-sched bench [options]`` from
anywhere in a checkout (the command finds this file from the current directory up, or through
$ATOM_SCHED_BENCHMARKS), with ``python benchmarks/scheduler_bench.py [options]``, or from Python
with ``benchmarks/`` on ``sys.path``::

    import scheduler_bench as bench
    results = bench.run_suite(quick=True)
    print(bench.format_table(results))
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from atom_sched import SamplingParams, Scheduler, SchedulerConfig, __version__

BLOCK_SIZE = 16
DECODE_SIZES = (64, 256, 1024, 4096)

# DESIGN.md section 8 budgets, superseded by issue 10's where it gives one, in the unit of the
# workload's result.
BUDGETS: dict[str, float] = {
    "decode_1024": 60.0,  # µs per step (any policy: decode_1024_mixed too)
    "decode_1024_mixed": 60.0,
    "decode_4096": 200.0,  # µs per step
    "admission": 400.0,  # µs, all schedule() + update() calls (issue 10; DESIGN.md: 2 ms)
    "preempt_256": 5.0,  # µs per step under preemption pressure (issue 10)
    "mtp3_256": 30.0,  # µs per step
    "cpp_row_1024": 8.0,  # ns per decode row, C++ core, K=0 (issue 10)
    "cpp_mtp3_row_1024": 15.0,  # ns per decode row, C++ core, K=3 (issue 10)
    "marginal_py": 20.0,  # ns per running request per step (the budget is set for the C++ core)
    "marginal_cpp": 20.0,  # ns per running request per step, C++ core
    "fixed_py": 1.2,  # µs per step at 1 running: schedule + views() + update (issue 10)
    "engine_1024": 40.0,  # µs per step: the step plus what an engine streams (issue 10)
    "compat_atom_1024": 400.0,  # ns per running request per step through compat.atom (issue 9)
}


class BenchCheckError(AssertionError):
    """A workload did not do the work it claims to measure."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise BenchCheckError(what)


@dataclass
class Result:
    key: str
    name: str
    unit: str  # "µs/step", "µs total", "ns/request"
    median: float
    p10: float | None = None
    p90: float | None = None
    reps: int = 0
    budget: float | None = None
    checked: bool = False  # the full per-step verification ran (check=True)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return None if self.budget is None else self.median / self.budget

    @property
    def status(self) -> str:
        if self.budget is None:
            return "info"
        return "PASS" if self.median <= self.budget else "OVER"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ratio=self.ratio, status=self.status)
        return d


@dataclass(frozen=True)
class Reps:
    """Repetition counts of one suite run."""

    decode: dict[int, int]
    warmup: int
    admission: int
    admission_warmup: int
    preemption: int
    mtp: int
    pairs: int
    pair_chunk: int

    @staticmethod
    def full() -> Reps:
        return Reps(decode={64: 5000, 256: 4000, 1024: 3000, 4096: 2000}, warmup=200,
                    admission=30, admission_warmup=3, preemption=4000, mtp=4000,
                    pairs=40, pair_chunk=50)

    @staticmethod
    def quick() -> Reps:
        return Reps(decode={64: 2000, 256: 2000, 1024: 1000, 4096: 500}, warmup=50,
                    admission=10, admission_warmup=1, preemption=1500, mtp=2000,
                    pairs=15, pair_chunk=40)


def _summary(samples_ns: np.ndarray) -> tuple[float, float, float]:
    us = samples_ns.astype(np.float64) / 1e3
    p10, med, p90 = np.percentile(us, [10, 50, 90])
    return float(med), float(p10), float(p90)


def _busy_cpu_ns() -> int | None:
    """Busy CPU time of the whole machine, all CPUs (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:]]
    busy = sum(v[:8]) - v[3] - (v[4] if len(v) > 4 else 0)  # all but idle and iowait
    return busy * (1_000_000_000 // (os.sysconf("SC_CLK_TCK") or 100))


class _NoGC:
    """GC off while timing, plus two noise gauges over the timed region:

    * cpu_share: this process's CPU time / wall time. Well below 1: other work took the CPU away.
    * other_busy: CPU time other processes used meanwhile, as a fraction of the wall time
      (from /proc/stat, 10 ms resolution). On this 2-CPU machine another busy process shares
      caches and memory bandwidth (and, on the host, maybe a physical core) with the benchmark
      even when it does not take its CPU, and slows it down measurably.
    """

    wall_ns = 0
    cpu_ns = 0
    machine_ns = 0
    machine_ok = True

    def __enter__(self) -> _NoGC:
        self.was = gc.isenabled()
        gc.collect()
        gc.disable()
        self._m = _busy_cpu_ns()
        self._w = time.perf_counter_ns()
        self._c = time.process_time_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_ns += time.process_time_ns() - self._c
        self.wall_ns += time.perf_counter_ns() - self._w
        m = _busy_cpu_ns()
        if m is None or self._m is None:
            self.machine_ok = False
        else:
            self.machine_ns += m - self._m
        if self.was:
            gc.enable()

    # CPU-time clocks tick coarsely (/proc/stat in 10 ms steps): shorter windows give no gauge.
    MIN_WALL_NS = 200_000_000

    @property
    def cpu_share(self) -> float | None:
        if self.wall_ns < self.MIN_WALL_NS:
            return None
        return min(1.0, self.cpu_ns / self.wall_ns)

    @property
    def other_busy(self) -> float | None:
        if not self.machine_ok or self.wall_ns < self.MIN_WALL_NS:
            return None
        return max(0.0, (self.machine_ns - self.cpu_ns) / self.wall_ns)


def _stream_flat(out: Any) -> int:
    """What an engine needs to stream a step's tokens, as flat arrays (no object per request):
    the request ids, token offsets, new tokens and finished flags (docs/api.md)."""
    return (int(out.request_ids[-1]) + int(out.token_offsets[-1]) + int(out.new_tokens[-1])
            + int(out.finished[-1]))


def _stream_objects(out: Any) -> int:
    """The same through StepOutput.outputs(): one RequestOutput per request."""
    outs = out.outputs()
    return outs[-1].request_id + len(outs[-1].output_tokens)


def _touch(b: Any) -> int:
    """What a model runner reads every step: the views it hands to attention and the sampler,
    through ``Batch.views()`` (one call; the views object is reused while the buffer's shape
    holds). Reading each array's last element makes sure it points at real data. (Copying into
    staging buffers is measured separately: decode_1024_staged.)
    """
    v = b.views()
    tables = v.block_tables  # None without host tables (a runner reads the slot plan then)
    return (int(v.positions[-1]) + int(v.slot_mapping[-1])
            + (int(tables[-1, 0]) if tables is not None else 0)
            + int(v.scheduled_tokens[-1]) + int(v.context_lens[-1]) + int(v.cu_seqlens_q[-1]))


class _Staging:
    """Preallocated host buffers a runner copies the batch into before the device transfer."""

    def __init__(self, rows: int, tokens: int, width: int) -> None:
        self.positions = np.zeros(tokens, np.int64)
        self.slot_mapping = np.zeros(tokens, np.int64)
        self.tokens = np.zeros(tokens, np.int32)
        self.context_lens = np.zeros(rows, np.int32)
        self.cu_q = np.zeros(rows + 1, np.int32)
        self.block_tables = np.zeros((rows, width), np.int32)

    def copy(self, b: Any) -> int:
        n, r = b.num_tokens, b.num_rows
        np.copyto(self.positions[:n], b.positions)
        np.copyto(self.slot_mapping[:n], b.slot_mapping)
        np.copyto(self.tokens[:n], b.scheduled_tokens)
        np.copyto(self.context_lens[:r], b.context_lens)
        np.copyto(self.cu_q[: r + 1], b.cu_seqlens_q)
        w = -(-b.max_seqlen_k // BLOCK_SIZE)  # only the columns in use
        np.copyto(self.block_tables[:r, :w], b.block_tables[:, :w])
        return n


def _table_width(cfg: SchedulerConfig) -> int:
    try:
        return int(cfg.max_blocks_per_request)
    except AttributeError:  # older builds: the same formula as config.cc
        k = cfg.num_speculative_tokens
        return -(-(cfg.max_model_len + 2 * (k + 1)) // cfg.block_size)


def _request_tables(s: Any, b: Any) -> np.ndarray:
    """The block tables of a batch's rows as its requests hold them, for a batch without host
    tables: after its update, so a row whose request no longer runs (its blocks freed) is all -1
    (not checked); a running request's table has only grown since."""
    tables = np.full((b.num_rows, b.block_table_width), -1, np.int32)
    for i, rid in enumerate(b.req_ids.tolist()):
        if rid in s and s.request_state(rid)["status"] == "running":
            bt = s.request_state(rid)["block_table"]
            tables[i] = 0
            tables[i, : len(bt)] = bt
    return tables


def _verify_rows(b: Any, prompts: np.ndarray | None = None,
                 tables: np.ndarray | None = None) -> None:
    """Full consistency check of one batch's arrays (check mode). ``tables``: the rows' block
    tables, for a batch that carries none."""
    r, t = b.num_rows, b.num_tokens
    nst = np.asarray(b.num_scheduled_tokens, np.int64)
    cached = np.asarray(b.num_cached_tokens, np.int64)
    cu = np.asarray(b.cu_seqlens_q, np.int64)
    _require(len(b.req_ids) == r and len(b.positions) == t, "array lengths disagree with the batch")
    _require(cu[0] == 0 and np.array_equal(np.diff(cu), nst) and cu[-1] == t, "cu_seqlens_q is off")
    _require(np.array_equal(np.asarray(b.context_lens), cached + nst), "context_lens is off")
    rows = np.repeat(np.arange(r), nst)
    pos = np.asarray(b.positions)
    _require(np.array_equal(pos, cached[rows] + (np.arange(t) - cu[rows])), "positions are off")
    bt = np.asarray(b.block_tables) if tables is None else tables
    expect_slots = bt[rows, pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    known = bt[rows, 0] >= 0
    _require(np.array_equal(np.asarray(b.slot_mapping)[known], expect_slots[known]),
             "slot_mapping disagrees with block_tables")
    if prompts is not None:
        ids = np.asarray(b.req_ids)
        _require(np.array_equal(np.asarray(b.scheduled_tokens), prompts[ids[rows], pos]),
                 "scheduled_tokens are not the prompt tokens")


# ---------------------------------------------------------------------------------------------
# Workloads


def _prefill_all(s: Scheduler, rows_max: int, k: int, drafts: np.ndarray | None) -> None:
    """Runs prefill (or mixed) batches until the first batch of decode rows only has been
    scheduled and updated."""
    ones = np.full(max(rows_max, 1), 7, np.int32)
    while True:
        b = s.schedule()
        _require(b is not None, "setup: schedule() returned None while prefilling")
        if not np.asarray(b.row_is_prefill).any():
            n = b.num_rows
            if k == 0:
                s.update(b, ones[:n])
            else:
                acc = np.ones(n, np.int32)
                s.update(b, np.full((n, k + 1), 7, np.int32), acc, drafts[:n])
            return
        n = b.num_rows
        if k == 0:
            s.update(b, ones[:n])
        else:  # (rows, K+1) for prefill batches too; only column 0 counts
            s.update(b, np.full((n, k + 1), 7, np.int32), None, drafts[:n])


def _max_opt(*xs: float | None) -> float | None:
    vals = [x for x in xs if x is not None]
    return max(vals) if vals else None


def _min_opt(*xs: float | None) -> float | None:
    vals = [x for x in xs if x is not None]
    return min(vals) if vals else None


class _DecodeRig:
    """A scheduler in steady-state decode with `n` running requests and K = `k` speculative tokens
    per row, sized for `steps` decode steps: 64-token prompts all prefilled first; max_tokens and
    the pool large enough that nothing finishes or is preempted.

    One step = schedule() + reading the runner's views (or, with `staged`, copying them into
    preallocated buffers) + update() with preallocated sampled (and, for K > 0, num_accepted
    uniform in 1..K+1 and drafts) arrays.

    `policy` is the SchedulerConfig's. With `prefill_chunk` > 0 (K = 0, policy "mixed") every
    step also prefills `prefill_chunk` tokens of a stream of prompts (4 chunks each, max_tokens
    1: each finishes as its prefill does and the next one is admitted in the same step), so
    every step is a mixed batch of n decode rows and one prefill row.
    """

    def __init__(self, n: int, steps: int, *, k: int = 0, check: bool = False,
                 staged: bool = False, prompt_len: int = 64, seed: int = 0,
                 policy: str = "atom", prefill_chunk: int = 0,
                 stream: Callable[[Any], int] | None = None) -> None:
        rng = self.rng = np.random.default_rng(seed)
        _require(stream is None or k == 0, "the engine-path rows run with K = 0")
        self.stream = stream  # what an engine reads of each step's outputs (timed; K = 0)
        _require(prefill_chunk == 0 or (k == 0 and policy == "mixed"),
                 "a prefill stream needs K = 0 and policy 'mixed'")
        self.n, self.k, self.check, self.capacity = n, k, check, steps
        self.chunk = prefill_chunk
        self.rows = n + (1 if prefill_chunk else 0)
        w = k + 1
        budget = n * w + prefill_chunk if prefill_chunk else max(n * w, 8192)
        # Under the mixed policy requests already decode while the others are prefilled: the
        # setup's steps (at least budget - n * w prompt tokens each) count too.
        setup = n * prompt_len // max(budget - n * w, 1) + 2 if policy == "mixed" else 0
        max_len = max(prompt_len + (steps + setup + 4) * w + 2 * BLOCK_SIZE,
                      4 * prefill_chunk + 1)
        max_len = -(-max_len // BLOCK_SIZE) * BLOCK_SIZE
        cfg = SchedulerConfig(num_blocks=1, block_size=BLOCK_SIZE, max_num_seqs=self.rows,
                              max_num_batched_tokens=budget, max_model_len=max_len,
                              num_speculative_tokens=k, policy=policy)
        width = _table_width(cfg)
        cfg.num_blocks = (n + 2) * (width + 1)
        s = self.s = Scheduler(cfg)
        sp = SamplingParams(max_tokens=max_len - prompt_len, ignore_eos=True)
        for i in range(n):
            s.add_request(i, rng.integers(3, 32000, prompt_len, dtype=np.int32), sp)
        self.drafts = rng.integers(3, 32000, (n, k), dtype=np.int32) if k else None
        _prefill_all(s, n, k, self.drafts)
        _require(s.num_running == n and s.num_waiting == 0, "setup: not every request is running")
        self.sampled = rng.integers(3, 32000, (n, w) if k else self.rows, dtype=np.int32)
        self.next_prompt_id = n
        self.acc_ring = [rng.integers(1, w + 1, n, dtype=np.int32) for _ in range(64)] if k else []
        self.stage = _Staging(n, n * w, width) if staged else None
        self.steps_done = 0
        self.steps0 = s.stats()["num_steps"]
        self.tokens0 = s.request_state(0)["num_tokens"]
        self.prev: dict[str, np.ndarray] | None = None
        self.expected_growth = 0
        self.sink = 0
        self.ng = _NoGC()

    def run(self, count: int, times: np.ndarray | None = None) -> None:
        """Runs `count` decode steps, storing each step's ns in `times` (if given)."""
        _require(self.steps_done + count <= self.capacity, "rig: more steps than it was sized for")
        s, n, k, check = self.s, self.n, self.k, self.check
        sampled, drafts, ring, stage = self.sampled, self.drafts, self.acc_ring, self.stage
        touch = stage.copy if stage else _touch
        stream = self.stream
        clock = time.perf_counter_ns
        acc = None
        sink = 0
        with self.ng:
            for i in range(count):
                if self.chunk and s.num_waiting == 0:  # the next prompt of the stream
                    s.add_request(self.next_prompt_id,
                                  self.rng.integers(3, 32000, 4 * self.chunk, dtype=np.int32),
                                  SamplingParams(max_tokens=1))
                    self.next_prompt_id += 1
                if k == 0:
                    t0 = clock()
                    b = s.schedule()
                    sink += touch(b)
                    out = s.update(b, sampled)
                    if stream is not None:
                        sink += stream(out)
                    t1 = clock()
                else:
                    acc = ring[(self.steps_done + i) & 63]
                    t0 = clock()
                    b = s.schedule()
                    sink += touch(b)
                    out = s.update(b, sampled, acc, drafts)
                    t1 = clock()
                if times is not None:
                    times[i] = t1 - t0
                # Always on, outside the timer: the step really was a decode step over n rows
                # (and, with a prefill stream, one prefill row of `chunk` tokens).
                if b.num_rows != self.rows or b.is_prefill or (
                        self.chunk and b.num_tokens != n + self.chunk):
                    raise BenchCheckError(f"decode step {self.steps_done + i} had {b.num_rows} "
                                          f"rows (prefill={b.is_prefill}), expected {self.rows}")
                if check and self.chunk:
                    s.check_invariants()
                elif check:
                    self.prev = _check_decode_step(s, b, out, n, k, acc, drafts, self.prev)
                    if k:
                        row0 = np.flatnonzero(self.prev["ids"] == 0)[0]
                        self.expected_growth += int(acc[row0])
        self.steps_done += count
        self.sink += sink

    def verify(self) -> int:
        """End-of-run checks; returns the tokens request 0 gained."""
        s, steps, w = self.s, self.steps_done, self.k + 1
        _require(s.stats()["num_steps"] - self.steps0 == steps, "scheduler step count is off")
        # Every decode request is still running (with a prefill stream, one prompt runs or
        # waits beside them).
        _require(set(range(self.n)) <= set(s.running_ids())
                 and (self.chunk or (s.num_running == self.n and s.num_waiting == 0)),
                 "requests left the running set")
        grown = s.request_state(0)["num_tokens"] - self.tokens0
        if self.k == 0:
            _require(grown == steps, f"request 0 gained {grown} tokens over {steps} steps")
        else:
            _require(steps <= grown <= steps * w,
                     f"request 0 gained {grown} tokens over {steps} steps")
            if self.check:
                _require(grown == self.expected_growth,
                         "request 0's tokens disagree with num_accepted")
        if self.check:
            s.check_invariants()
        return grown


def decode_step(n: int, reps: int, warmup: int, *, k: int = 0, check: bool = False,
                staged: bool = False, prompt_len: int = 64, seed: int = 0,
                policy: str = "atom", prefill_chunk: int = 0,
                stream: Callable[[Any], int] | None = None) -> Result:
    """Steady-state decode with `n` running requests (see _DecodeRig): `warmup` untimed steps,
    then `reps` timed ones."""
    rig = _DecodeRig(n, warmup + reps, k=k, check=check, staged=staged, prompt_len=prompt_len,
                     seed=seed, policy=policy, prefill_chunk=prefill_chunk, stream=stream)
    rig.run(warmup)
    times = np.zeros(reps, np.int64)
    rig.run(reps, times)
    grown = rig.verify()
    med, p10, p90 = _summary(times)
    key = f"mtp{k}_{n}" if k else (f"decode_{n}_staged" if staged else f"decode_{n}")
    if k:
        name = f"decode step, MTP K={k}, {n:,} running"
    elif staged:
        name = f"decode step, {n:,} running + staging copies"
    else:
        name = f"decode step, {n:,} running"
    budget = None if staged else BUDGETS.get(key)
    if stream is not None:  # the engine path: the step plus what streaming needs
        flat = stream is _stream_flat
        key = f"engine_{n}" if flat else f"engine_{n}_objects"
        budget = BUDGETS.get(key)
        name = (f"engine path, {n:,} running (step + flat outputs)" if flat
                else f"engine path, {n:,} running (step + outputs() objects)")
    elif prefill_chunk:  # reported, no budget: what a mixed step adds to a decode step
        key, budget = f"mixed_{n}_{prefill_chunk}", None
        name = f"mixed step, {n:,} decode rows + a {prefill_chunk}-token prefill chunk"
    elif policy != "atom":  # the decode step's budget holds whatever the policy
        key, name = f"{key}_{policy}", f"{name}, policy {policy}"
    return Result(key=key, name=name, unit="µs/step", median=med, p10=p10, p90=p90, reps=reps,
                  budget=budget, checked=check,
                  info={"rows": rig.rows, "tokens_per_step": n * (k + 1) + prefill_chunk,
                        "policy": policy,
                        "tokens_gained_by_request_0": grown,
                        "touch": "staging copies" if staged else "views + last element",
                        "cpu_share": rig.ng.cpu_share, "other_busy": rig.ng.other_busy})


def fixed_cost_steps(s: Scheduler, sampled: np.ndarray, steps: int) -> None:
    """`steps` decode steps as the fixed-cost row times them: schedule(), views() and the six
    arrays a runner hands to attention, update(). (benchmarks/count/count_python_step.py counts
    the same loop's instructions.)"""
    for _ in range(steps):
        b = s.schedule()
        v = b.views()
        v.positions, v.slot_mapping, v.block_tables  # noqa: B018 (what a runner reads)
        v.scheduled_tokens, v.context_lens, v.cu_seqlens_q  # noqa: B018
        s.update(b, sampled)


def fixed_cost(reps: int, warmup: int, *, check: bool = False) -> Result:
    """The Python fixed cost of a step: a decode step with 1 running request, timed in blocks of
    100 steps (so the clock's own cost is amortized): schedule(), views() and the six arrays a
    runner hands to attention, update(). The core's own row work is tens of ns of it."""
    rig = _DecodeRig(1, warmup + reps * 100, check=check)
    rig.run(warmup)
    s, sampled, block = rig.s, rig.sampled, 100
    times = np.zeros(reps, np.int64)
    clock = time.perf_counter_ns
    with rig.ng:
        for i in range(reps):
            t0 = clock()
            fixed_cost_steps(s, sampled, block)
            times[i] = (clock() - t0) // block
    rig.steps_done += reps * block
    grown = rig.verify()
    med, p10, p90 = _summary(times)
    return Result(key="fixed_py", name="fixed cost per step (1 running: schedule + views + "
                  "update)", unit="µs/step", median=med, p10=p10, p90=p90, reps=reps,
                  budget=BUDGETS["fixed_py"], checked=check,
                  info={"rows": 1, "steps_per_sample": block, "tokens_gained": grown})


def marginal_paired(pairs: int, chunk: int, warmup: int, *, check: bool = False,
                    lo: int = 1024, hi: int = 4096) -> Result:
    """ns per running request per decode step, measured in pairs: `chunk` steps at `lo` running,
    then `chunk` at `hi`, `pairs` times over; each pair gives a slope (median step time at `hi`
    minus at `lo`, over hi - lo). Both sides of a pair see the same machine conditions, so a
    burst of other work moves both instead of skewing the difference. Reports the median pair
    slope and its 10th/90th percentiles."""
    steps = warmup + pairs * chunk
    a = _DecodeRig(lo, steps, check=check, seed=10)
    b = _DecodeRig(hi, steps, check=check, seed=11)
    a.run(warmup)
    b.run(warmup)
    ta = np.zeros(chunk, np.int64)
    tb = np.zeros(chunk, np.int64)
    slopes = np.zeros(pairs)
    for p in range(pairs):
        a.run(chunk, ta)
        b.run(chunk, tb)
        slopes[p] = (np.median(tb) - np.median(ta)) / (hi - lo)
    a.verify()
    b.verify()
    p10, med, p90 = (float(x) for x in np.percentile(slopes, [10, 50, 90]))
    return Result(key="marginal_py", name=f"marginal cost per running request (Python, "
                  f"{lo // 1024}k->{hi // 1024}k paired)", unit="ns/request", median=med, p10=p10,
                  p90=p90, reps=pairs, budget=BUDGETS["marginal_py"],
                  checked=check,
                  info={"pairs": pairs, "steps_per_side": chunk,
                        "cpu_share": _min_opt(a.ng.cpu_share, b.ng.cpu_share),
                        "other_busy": _max_opt(a.ng.other_busy, b.ng.other_busy),
                        "note": "the budget is stated for the C++ core"})


def _check_decode_step(s: Scheduler, b: Any, out: Any, n: int, k: int, acc: np.ndarray | None,
                       drafts: np.ndarray | None, prev: dict[str, np.ndarray] | None
                       ) -> dict[str, np.ndarray]:
    _verify_rows(b)
    ids = np.array(b.req_ids)
    cached = np.asarray(b.num_cached_tokens)
    # K+1 tokens a row, fewer where a position would reach min(max_model_len, pool positions).
    cfg = s.config
    # Positions a request may reach: every block but the null one (docs/design.md).
    limit = min(int(cfg.max_model_len), (int(cfg.num_blocks) - 1) * int(cfg.block_size))
    widths = np.minimum(k + 1, limit - cached.astype(np.int64))
    _require(bool(np.all(widths >= 1)), "a decode row at the position limit")
    _require(b.num_tokens == int(widths.sum()),
             f"decode batch has {b.num_tokens} tokens, expected {int(widths.sum())}")
    _require(np.array_equal(np.asarray(b.num_scheduled_tokens), widths),
             "a decode row is not K+1 tokens (fewer only near the position limit)")
    starts = np.asarray(b.cu_seqlens_q)[:-1]
    _require(np.array_equal(np.asarray(out.request_ids), ids), "update() did not emit every row")
    gained = np.diff(np.asarray(out.token_offsets))
    _require(np.array_equal(gained, acc if k else np.ones(n)), "tokens gained != num_accepted")
    new = np.asarray(out.new_tokens)
    last = new[np.asarray(out.token_offsets)[1:] - 1]
    if prev is not None:
        _require(np.array_equal(prev["ids"], ids), "the row order changed in steady state")
        _require(np.array_equal(np.asarray(b.scheduled_tokens)[starts], prev["last"]),
                 "a row's input token is not its last sampled token")
        # Rejected drafts are rolled back: the KV length grows by the accepted count only.
        _require(np.array_equal(cached, prev["cached"] + prev["acc"]),
                 "num_cached_tokens did not advance by num_accepted")
        if k:
            # The drafts a row schedules are the ones passed to update(); the rest read -1.
            scheduled = np.arange(k)[None, :] < (widths - 1)[:, None]
            _require(np.array_equal(np.asarray(b.spec_draft_tokens),
                                    np.where(scheduled, drafts, -1)),
                     "spec_draft_tokens are not the drafts passed to update()")
    return {"ids": ids, "last": last.copy(), "cached": cached.copy(),
            "acc": (acc.astype(np.int64) if k else np.ones(n, np.int64))}


def admission(reps: int, warmup: int, *, check: bool = False, num_prompts: int = 256,
              prompt_len: int = 1024, shared_len: int = 768, budget_tokens: int = 16384,
              seed: int = 1) -> Result:
    """Admits `num_prompts` prompts of `prompt_len` tokens, every other one sharing a
    `shared_len`-token prefix, with chunked prefill under a `budget_tokens` token budget.

    Timed: the sum of every schedule() + view reads + update() until each prompt has been fully
    prefilled (emitted its first token). add_request() is timed separately (info only).

    Each repetition makes a new scheduler and runs the admission twice: once as its first work,
    then again after aborting every request and resetting the prefix cache, which leaves the
    state of a new scheduler (nothing cached, every block free) in memory the scheduler has
    already touched. The second round is the figure: a serving engine admits into a scheduler
    that has been running. The first round is given beside it (info): its first touch of
    memory the kernel has just zeroed costs more than the work itself on this machine.
    Prefix-cache hits start once a round's first batch's outputs are in.
    """
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 32000, shared_len, dtype=np.int32)
    prompts = rng.integers(3, 32000, (num_prompts, prompt_len), dtype=np.int32)
    sharing = np.arange(num_prompts) % 2 == 0
    prompts[sharing, :shared_len] = prefix
    cfg = SchedulerConfig(num_blocks=num_prompts * (prompt_len // BLOCK_SIZE + 1) + 1024,
                          block_size=BLOCK_SIZE, max_num_seqs=num_prompts,
                          max_num_batched_tokens=budget_tokens, max_model_len=2 * prompt_len,
                          enable_prefix_caching=True, enable_chunked_prefill=True)
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    sampled = np.full(num_prompts, 7, np.int32)
    clock = time.perf_counter_ns
    shared_blocks = shared_len // BLOCK_SIZE

    def admit_all(s: Any) -> tuple[int, int, int, int]:
        """One round: add every prompt (timed apart), schedule and update until each has been
        prefilled, check it, then abort them all and reset the prefix cache. Returns (timed ns,
        add_request ns, schedule() calls, prefix-hit tokens)."""
        hits0 = s.stats()["prefix_hit_tokens"]
        ta = clock()
        for i in range(num_prompts):
            s.add_request(i, prompts[i], sp)
        add_ns = clock() - ta
        total = 0
        calls = 0
        emitted = 0
        first_batch_ids: set[int] = set()
        cached_by_req: dict[int, int] = {}
        while emitted < num_prompts:
            t0 = clock()
            b = s.schedule()
            if b is None:
                raise BenchCheckError("admission: schedule() returned None")
            _touch(b)
            out = s.update(b, sampled[: b.num_rows])
            total += clock() - t0
            calls += 1
            if not b.is_prefill:
                raise BenchCheckError("admission: a decode batch ran before every prompt "
                                      "was prefilled")
            emitted += len(out)
            if check:
                _require(b.num_tokens <= budget_tokens, "batch over the token budget")
                _verify_rows(b, prompts)
                if calls == 1:
                    first_batch_ids = {int(x) for x in b.req_ids}
                for o in out.outputs():
                    _require(o.request_id not in cached_by_req, "a prompt emitted twice")
                    _require(len(o.output_tokens) == 1, "a prefill emitted != 1 token")
                    cached_by_req[o.request_id] = o.num_cached_tokens
        hits = s.stats()["prefix_hit_tokens"] - hits0
        # Always on: every prompt was prefilled and the shared prefix was served from the cache.
        _require(emitted == num_prompts, "admission: not every prompt was prefilled")
        _require(hits > 0, "admission: the prefix-sharing run got no cache hits")
        _require(hits % (shared_blocks * BLOCK_SIZE) == 0, f"admission: odd hit count {hits}")
        if check:
            _require(len(cached_by_req) == num_prompts, "admission: missing outputs")
            for i, c in cached_by_req.items():
                if not sharing[i]:
                    _require(c == 0, f"prompt {i} (no shared prefix) got {c} cached tokens")
                elif i in first_batch_ids:
                    _require(c == 0, f"prompt {i} hit before any output was published")
                else:
                    _require(c == shared_len, f"sharing prompt {i} got {c} cached tokens, "
                             f"expected {shared_len}")
            s.check_invariants()
        for i in range(num_prompts):
            s.abort_request(i)
        s.reset_prefix_cache()
        return total, add_ns, calls, hits

    totals, firsts, adds, calls_list, hits_list = [], [], [], [], []
    ng = _NoGC()
    for rep in range(warmup + reps):
        s = Scheduler(cfg)
        with ng:
            first, _, _, _ = admit_all(s)
            total, add_ns, calls, hits = admit_all(s)
        if rep >= warmup:
            totals.append(total)
            firsts.append(first)
            adds.append(add_ns)
            calls_list.append(calls)
            hits_list.append(hits)
    med, p10, p90 = _summary(np.array(totals))
    computed = num_prompts * prompt_len - int(np.median(hits_list))
    return Result(key="admission", name=f"admit {num_prompts} x {prompt_len}-token prompts, "
                  f"half sharing {shared_len}", unit="µs total", median=med, p10=p10, p90=p90,
                  reps=reps, budget=BUDGETS["admission"], checked=check,
                  info={"schedule_calls": int(np.median(calls_list)),
                        "max_num_batched_tokens": budget_tokens,
                        "prefix_hit_tokens": int(np.median(hits_list)),
                        "prefix_hit_prompts": int(np.median(hits_list)) // shared_len,
                        "tokens_computed": computed,
                        "ns_per_computed_token": med * 1e3 / computed,
                        "first_round_median_us": float(np.median(firsts)) / 1e3,
                        "add_request_total_us": float(np.median(adds)) / 1e3,
                        "cpu_share": ng.cpu_share, "other_busy": ng.other_busy})


def preemption(reps: int, warmup: int, *, check: bool = False, n: int = 256,
               prompt_len: int = 128, num_blocks: int = 2304, seed: int = 2,
               host_block_tables: bool = True) -> Result:
    """Preemption pressure: `n` live requests (a finished one is replaced at once) against a KV
    pool of `num_blocks` blocks, too small for all of them at their full length, so decode steps
    preempt (recompute, LIFO) and preempted requests are re-prefilled. `host_block_tables`:
    False for a runner that keeps its tables per device slot (DeviceBatchBuilder), so a row that
    a finish shifted has no table row to rewrite.

    Timed per step (prefill or decode): schedule() + view reads + update(). add_request() of the
    replacements happens between steps, untimed.
    """
    rng = np.random.default_rng(seed)
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=n,
                          max_num_batched_tokens=8192, max_model_len=4096,
                          host_block_tables=host_block_tables)
    s = Scheduler(cfg)
    pool = [rng.integers(3, 32000, prompt_len, dtype=np.int32) for _ in range(64)]
    max_tokens = rng.integers(64, 257, 4096)
    next_id = 0

    def add(count: int) -> None:
        nonlocal next_id
        for _ in range(count):
            s.add_request(next_id, pool[next_id % 64],
                          SamplingParams(max_tokens=int(max_tokens[next_id % 4096]),
                                         ignore_eos=True))
            next_id += 1

    add(n)
    sampled = np.full(n, 7, np.int32)
    steps = warmup + reps
    times = np.zeros(reps, np.int64)
    kinds = np.zeros(reps, np.int8)  # 1 = decode
    rows = np.zeros(reps, np.int32)
    preempt0 = 0
    none_steps = 0
    clock = time.perf_counter_ns
    ng = _NoGC()
    with ng:
        for i in range(steps):
            if i == warmup:
                preempt0 = s.stats()["num_preemptions"]
            t0 = clock()
            b = s.schedule()
            if b is None:
                t1 = clock()
                none_steps += 1
                continue
            _touch(b)
            out = s.update(b, sampled[: b.num_rows])
            t1 = clock()
            if i >= warmup:
                j = i - warmup
                times[j] = t1 - t0
                kinds[j] = not b.is_prefill
                rows[j] = b.num_rows
            if check:
                _verify_rows(b, tables=None if host_block_tables else _request_tables(s, b))
                s.check_invariants()
            finished = int(np.count_nonzero(out.finished))
            if finished:
                add(finished)
    stats = s.stats()
    preemptions = stats["num_preemptions"] - preempt0
    # Always on: the run really was under preemption pressure and kept doing decode work.
    _require(preemptions > 0, "preemption: no request was preempted while timing")
    _require(np.count_nonzero(kinds) > 0, "preemption: no decode step ran")
    _require(none_steps == 0, f"preemption: schedule() returned None {none_steps} times")
    med, p10, p90 = _summary(times)
    dec = kinds == 1
    mean_rows = float(rows.mean())
    key, name = "preempt_256", f"preemption pressure, {n} live requests"
    if not host_block_tables:
        key, name = key + "_no_host_tables", name + ", no host block tables"
    return Result(key=key, name=name, unit="µs/step",
                  median=med, p10=p10, p90=p90, reps=reps, budget=BUDGETS["preempt_256"],
                  checked=check,
                  info={"preemptions_per_step": preemptions / reps,
                        "decode_step_fraction": float(dec.mean()),
                        "mean_rows_per_step": mean_rows,
                        "mean_rows_per_decode_step": float(rows[dec].mean()),
                        "median_decode_step_us": float(np.median(times[dec])) / 1e3,
                        "median_prefill_step_us": (float(np.median(times[~dec])) / 1e3
                                                   if (~dec).any() else None),
                        "num_blocks": num_blocks, "requests_finished": stats["num_finished"],
                        "cpu_share": ng.cpu_share, "other_busy": ng.other_busy})


def compat_atom(n: int, reps: int, warmup: int, *, check: bool = False, k: int = 0) -> Result:
    """ATOM's engine step through ``atom_sched.compat.atom`` with ``n`` running requests in
    ATOM's production (deferred-output) mode: timed ``schedule()`` + ``postprocess()`` with a
    stream queue, per running request. The runner's part (building ``ScheduledBatchOutput``,
    draining the queue) is outside the timing. With ``k`` > 0 (MTP) every decode row accepts 2
    of its K+1 tokens. The Sequence stand-in is the tests' own
    (tests/python/support/atom_standins.py: no ATOM code in this repository)."""
    import queue

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
    from support.atom_standins import AtomSamplingParams, Config, Sequence, SpeculativeConfig

    from atom_sched.compat.atom import ScheduledBatchOutput
    from atom_sched.compat.atom import Scheduler as AtomScheduler

    cfg = Config(num_kvcache_blocks=n * (32 if k == 0 else 64) + 64,
                 kv_cache_block_size=BLOCK_SIZE, max_num_seqs=n,
                 max_num_batched_tokens=n * 64, max_model_len=4096, eos_token_id=2,
                 speculative_config=SpeculativeConfig(k) if k else None)
    sched = AtomScheduler(cfg)
    prompt = list(range(100, 164))
    for i in range(n):
        sched.add(Sequence(prompt, BLOCK_SIZE, AtomSamplingParams(max_tokens=1 << 20,
                                                                 ignore_eos=True), id=i + 1))
    stream: queue.Queue = queue.Queue()
    prev: list[int] = []
    prev_prefill = True
    drafts = np.full((n, k), 9, np.int32) if k else None
    times = np.zeros(reps, np.int64)
    rows = 0
    clock = time.perf_counter_ns
    ng = _NoGC()
    with ng:
        for i in range(warmup + reps):
            row = (7,) if k == 0 or prev_prefill else (7, 8)
            out = ScheduledBatchOutput(prev, [row] * len(prev), None, None,
                                       None if drafts is None else drafts[:len(prev)],
                                       is_deferred_out=True)
            t0 = clock()
            batch, seqs = sched.schedule()
            sched.postprocess(seqs.values(), out, stream)
            t1 = clock()
            prev, prev_prefill = batch.req_ids, batch.total_seqs_num_prefill > 0
            while not stream.empty():
                stream.get_nowait()
            if i >= warmup:
                times[i - warmup] = t1 - t0
                rows += len(prev)
            if check:
                sched._core.check_invariants()
    _require(rows == reps * n, "compat: not every request decoded in every timed step")
    med, p10, p90 = _summary(times)
    key = f"compat_atom_{n}" if k == 0 else f"compat_atom_mtp{k}_{n}"
    name = f"ATOM engine step via compat.atom, {n} running" + (f", MTP K={k}" if k else "")
    return Result(key=key, name=name,
                  unit="ns/request", median=med * 1e3 / n, p10=p10 * 1e3 / n,
                  p90=p90 * 1e3 / n, reps=reps, budget=BUDGETS.get(key),
                  checked=check, info={"median_step_us": med, "cpu_share": ng.cpu_share,
                                       "other_busy": ng.other_busy})


def split_slope(results: dict[str, Result]) -> float | None:
    """ns per running request per step from the separate decode_1024 and decode_4096 medians
    (measured at different times, so more exposed to machine noise than marginal_paired)."""
    a, b = results.get("decode_1024"), results.get("decode_4096")
    if a is None or b is None:
        return None
    return (b.median - a.median) * 1e3 / (4096 - 1024)


# ---------------------------------------------------------------------------------------------
# C++ benchmark (Google Benchmark) integration


def find_cpp_bench(explicit: str | None = None) -> Path | None:
    """The atom_sched_cpp_bench binary: `explicit`, $ATOM_SCHED_CPP_BENCH, or build/cpp/ of this
    checkout (the one this file is in), else under the current directory or its parents."""
    cands: list[Path] = []
    if explicit:
        cands.append(Path(explicit))
    if os.environ.get("ATOM_SCHED_CPP_BENCH"):
        cands.append(Path(os.environ["ATOM_SCHED_CPP_BENCH"]))
    here = Path.cwd().resolve()
    for d in (Path(__file__).resolve().parent.parent, here, *here.parents):
        cands.append(d / "build" / "cpp" / "atom_sched_cpp_bench")
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


def run_cpp_decode(binary: Path, quick: bool, timeout: float = 120.0) -> dict[str, Any]:
    """Runs BM_DecodeStep of the C++ bench and returns {"per_step_us": {N: µs}, "ns_per_request":
    {N: ns}, "allocs_per_step": {N: n}, "slope_ns": ns}, from CPU time per step. The slope is the
    marginal cost between 1,024 and 4,096 requests."""
    cmd = [str(binary), "--benchmark_filter=^BM_DecodeStep", "--benchmark_format=json",
           f"--benchmark_min_time={0.05 if quick else 0.2}",
           f"--benchmark_repetitions={1 if quick else 5}",
           # Repetitions of the four sizes run in random order, so machine noise spreads over
           # all of them instead of skewing the 1,024 vs 4,096 difference.
           "--benchmark_enable_random_interleaving=" + ("false" if quick else "true"),
           "--benchmark_report_aggregates_only=" + ("false" if quick else "true")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    data = json.loads(proc.stdout)
    per_step: dict[int, float] = {}
    per_req: dict[int, float] = {}
    allocs: dict[int, float] = {}
    mtp3_per_req: dict[int, float] = {}
    for bm in data["benchmarks"]:
        if bm.get("error_occurred"):
            raise BenchCheckError(f"C++ {bm['name']}: {bm.get('error_message')}")
        if bm.get("run_type") == "aggregate" and bm.get("aggregate_name") != "median":
            continue
        name, n = bm["run_name"].split("/")[0], int(bm["run_name"].split("/")[1])
        scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}[bm.get("time_unit", "ns")]
        # CPU time: single-threaded, so equal to wall time on an idle machine, and unaffected by
        # other jobs taking the CPU away (which wall time is not).
        us = float(bm["cpu_time"]) * scale
        if name == "BM_DecodeStepMTP3":
            mtp3_per_req[n] = us * 1e3 / n
            continue
        per_step[n] = us
        per_req[n] = per_step[n] * 1e3 / n
        allocs[n] = float(bm.get("allocs_per_step", 0.0))
    slope = None
    if 1024 in per_step and 4096 in per_step:
        slope = (per_step[4096] - per_step[1024]) * 1e3 / 3072
    return {"binary": str(binary), "per_step_us": per_step, "ns_per_request": per_req,
            "allocs_per_step": allocs, "slope_ns": slope, "mtp3_ns_per_request": mtp3_per_req,
            "context": data.get("context", {})}


# ---------------------------------------------------------------------------------------------
# Suite


@dataclass
class Workload:
    key: str
    label: str
    run: Callable[[], Result]


def workloads(quick: bool = False, check: bool = False) -> list[Workload]:
    r = Reps.quick() if quick else Reps.full()
    out: list[Workload] = []
    for n in DECODE_SIZES:
        out.append(Workload(f"decode_{n}", f"decode {n}",
                            lambda n=n: decode_step(n, r.decode[n], r.warmup, check=check)))
    out.append(Workload("fixed_py", "fixed cost (1 running)",
                        lambda: fixed_cost(r.decode[64], r.warmup, check=check)))
    out.append(Workload("engine_1024", "engine path 1024",
                        lambda: decode_step(1024, r.decode[1024], r.warmup, check=check,
                                            stream=_stream_flat)))
    out.append(Workload("engine_1024_objects", "engine path 1024 (objects)",
                        lambda: decode_step(1024, r.decode[1024] // 4, r.warmup, check=check,
                                            stream=_stream_objects)))
    out.append(Workload("decode_1024_mixed", "decode 1024, policy mixed",
                        lambda: decode_step(1024, r.decode[1024], r.warmup, check=check,
                                            policy="mixed")))
    out.append(Workload("mixed_1024_512", "mixed 1024 + 512-token chunk",
                        lambda: decode_step(1024, r.decode[1024], r.warmup, check=check,
                                            policy="mixed", prefill_chunk=512)))
    out.append(Workload("decode_1024_staged", "decode 1024 + staging",
                        lambda: decode_step(1024, r.decode[1024], r.warmup, check=check,
                                            staged=True)))
    out.append(Workload("admission", "admission 256x1024",
                        lambda: admission(r.admission, r.admission_warmup, check=check)))
    out.append(Workload("preempt_256", "preemption 256",
                        lambda: preemption(r.preemption, r.warmup, check=check)))
    out.append(Workload("preempt_256_no_host_tables", "preemption 256, no host tables",
                        lambda: preemption(r.preemption, r.warmup, check=check,
                                           host_block_tables=False)))
    out.append(Workload("mtp3_256", "MTP K=3 256",
                        lambda: decode_step(256, r.mtp, r.warmup, k=3, check=check)))
    out.append(Workload("compat_atom_1024", "ATOM compat 1024",
                        lambda: compat_atom(1024, r.decode[1024] // 10, r.warmup // 4,
                                            check=check)))
    out.append(Workload("compat_atom_mtp2_1024", "ATOM compat 1024, MTP K=2",
                        lambda: compat_atom(1024, r.decode[1024] // 10, r.warmup // 4,
                                            check=check, k=2)))
    out.append(Workload("marginal_py", "marginal 1k->4k (paired)",
                        lambda: marginal_paired(r.pairs, r.pair_chunk, r.warmup, check=check)))
    return out


def run_suite(quick: bool = False, check: bool = False, only: str | None = None,
              cpp_bench: Path | None = None,
              progress: Callable[[Iterable[Workload]], Iterable[Workload]] | None = None,
              ) -> list[Result]:
    """Runs the workloads (those whose key contains `only`, if given) and derives the marginal
    cost rows. `progress` wraps the workload iterable (e.g. tqdm)."""
    wl = [w for w in workloads(quick, check) if only is None or only in w.key]
    it = progress(wl) if progress else wl
    results: dict[str, Result] = {}
    for w in it:
        if hasattr(it, "set_description"):
            it.set_description(w.label)
        res = w.run()
        results[res.key] = res
    if cpp_bench is not None and (only is None or "decode" in only or "marginal" in only):
        cpp = run_cpp_decode(cpp_bench, quick)
        if cpp["slope_ns"] is not None:
            results["marginal_cpp"] = Result(
                key="marginal_cpp", name="marginal cost per running request (C++ core, 1k->4k)",
                unit="ns/request", median=cpp["slope_ns"], reps=0, budget=BUDGETS["marginal_cpp"],
                info={"per_step_us": cpp["per_step_us"], "ns_per_request": cpp["ns_per_request"],
                      "allocs_per_step": cpp["allocs_per_step"], "binary": cpp["binary"]})
        for key, name, per_req in (
                ("cpp_row_1024", "C++ core decode row, 1,024 running", cpp["ns_per_request"]),
                ("cpp_mtp3_row_1024", "C++ core decode row, MTP K=3, 1,024 running",
                 cpp["mtp3_ns_per_request"])):
            if 1024 in per_req:
                results[key] = Result(key=key, name=name, unit="ns/request",
                                      median=per_req[1024], reps=0, budget=BUDGETS[key])
    return list(results.values())


# ---------------------------------------------------------------------------------------------
# Reporting


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def format_table(results: list[Result]) -> str:
    head = ["workload", "unit", "median", "p10", "p90", "budget", "ratio", "status"]
    rows = []
    for r in results:
        rows.append([
            r.name, r.unit, _fmt(r.median), _fmt(r.p10), _fmt(r.p90),
            _fmt(r.budget, 0 if (r.budget or 0) >= 10 else 1),
            "-" if r.ratio is None else f"{r.ratio:.2f}", r.status,
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    left = {0, 1, 7}

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(w) if i in left else c.rjust(w)
                          for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    out = [line(head), "-+-".join("-" * w for w in widths)]
    out += [line(row) for row in rows]
    return "\n".join(out)


def format_notes(results: list[Result]) -> str:
    lines = []
    for r in results:
        i = r.info
        if r.key == "admission":
            lines.append(f"admission: {i['schedule_calls']} schedule() calls "
                         f"(max_num_batched_tokens={i['max_num_batched_tokens']}), "
                         f"{i['prefix_hit_tokens']:,} prefix-hit tokens "
                         f"({i['prefix_hit_prompts']} prompts), {i['tokens_computed']:,} tokens "
                         f"computed ({i['ns_per_computed_token']:.1f} ns/token); a new "
                         f"scheduler's first admission (fresh memory): "
                         f"{i['first_round_median_us']:,.0f} µs; add_request x256 "
                         f"(untimed): {i['add_request_total_us']:,.0f} µs")
        elif r.key.startswith("preempt_256"):
            pre = i["median_prefill_step_us"]
            lines.append(f"preemption: {i['preemptions_per_step']:.2f} preemptions/step, "
                         f"{100 * i['decode_step_fraction']:.0f}% decode steps, "
                         f"{i['mean_rows_per_decode_step']:.0f} rows/decode step; median decode "
                         f"step {i['median_decode_step_us']:.1f} µs, prefill step "
                         f"{_fmt(pre)} µs; pool {i['num_blocks']} blocks")
        elif r.key == "marginal_cpp":
            per = ", ".join(f"{n}: {v:.1f} ns" for n, v in sorted(i["ns_per_request"].items()))
            allocs = ", ".join(f"{n}: {v:g}" for n, v in sorted(i["allocs_per_step"].items()))
            lines.append(f"C++ BM_DecodeStep ns/request: {per}; heap allocations/step: {allocs}")
    contended = [f"{r.key} ({100 * r.info['cpu_share']:.0f}%)" for r in results
                 if (r.info.get("cpu_share") or 1.0) < 0.9]
    if contended:
        lines.append("CONTENDED (share of wall time on a CPU < 90%, timings pessimistic): "
                     + ", ".join(contended))
    noisy = [f"{r.key} ({100 * r.info['other_busy']:.0f}%)" for r in results
             if (r.info.get("other_busy") or 0.0) > 0.25]
    if noisy:
        lines.append("NOISY (other processes busy > 25% of the time meanwhile, timings may be "
                     "inflated): " + ", ".join(noisy))
    by = {r.key: r for r in results}
    dec = [by[f"decode_{n}"] for n in DECODE_SIZES if f"decode_{n}" in by]
    sl = split_slope(by)
    if sl is not None:
        lines.append("Python slope from the separate decode_1024/decode_4096 rows: "
                     f"{sl:.1f} ns/request")
    if dec:
        lines.append("Python decode ns/request (median step / N): " + ", ".join(
            f"{r.info['rows']}: {r.median * 1e3 / r.info['rows']:.1f}" for r in dec))
    return "\n".join(lines)


def metadata(quick: bool, check: bool) -> dict[str, Any]:
    import numpy

    return {
        "atom_sched_version": __version__, "python": sys.version.split()[0],
        "numpy": numpy.__version__, "platform": platform.platform(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "quick": quick, "check": check, "timer": "time.perf_counter_ns",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: Path, results: list[Result], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [r.to_dict() for r in results]},
                               indent=2, default=str) + "\n")


def plot_decode(path: Path, results: list[Result]) -> bool:
    """µs per decode step against running requests (log-log), budgets marked.
    Returns False (writing nothing) if matplotlib is missing or no decode result exists."""
    by = {r.key: r for r in results}
    dec = [by[f"decode_{n}"] for n in DECODE_SIZES if f"decode_{n}" in by]
    if not dec:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ns = np.array([r.info["rows"] for r in dec], float)
    med = np.array([r.median for r in dec])
    lo = med - np.array([r.p10 for r in dec])
    hi = np.array([r.p90 for r in dec]) - med
    fig, ax = plt.subplots(figsize=(7.5, 5.0), dpi=120)
    ax.errorbar(ns, med, yerr=[lo, hi], marker="o", capsize=4, lw=2, color="tab:blue",
                label="atom_sched, Python API (median, p10-p90)")
    for x, y in zip(ns, med, strict=True):
        ax.annotate(f"{y:.1f} µs", (x, y), textcoords="offset points", xytext=(6, -14),
                    fontsize=8, color="tab:blue")
    cpp = by.get("marginal_cpp")
    if cpp is not None:
        pts = sorted((int(n), v) for n, v in cpp.info["per_step_us"].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", ls="--", color="tab:green",
                label="C++ core (Google Benchmark)")
    bud = [(n, BUDGETS[f"decode_{n}"]) for n in DECODE_SIZES if f"decode_{n}" in BUDGETS]
    ax.scatter([b[0] for b in bud], [b[1] for b in bud], marker="v", s=90, color="tab:red",
               zorder=5, label="budget (DESIGN.md §8)")
    for n, v in bud:
        ax.annotate(f"budget {v:.0f} µs", (n, v), textcoords="offset points", xytext=(-30, 8),
                    fontsize=8, color="tab:red")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(DECODE_SIZES)
    ax.set_xticklabels([f"{n:,}" for n in DECODE_SIZES])
    ax.set_xlim(48, 5500)
    ax.set_xlabel("running requests (decode rows per step)")
    ax.set_ylabel("µs per decode step (schedule + arrays + update)")
    ax.set_title("atom_sched decode step host cost")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def which_tqdm() -> Any:
    """tqdm's class, or None if tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


# ---------------------------------------------------------------------------------------------
# Command line (`atom-sched bench`, `python benchmarks/scheduler_bench.py`)
# ---------------------------------------------------------------------------------------------


def _progress(total: int) -> Any:
    """A wrapper for the workload iterable: tqdm if installed, else a plain counter on stderr."""
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


def build_parser() -> argparse.ArgumentParser:
    b = argparse.ArgumentParser(
        prog="atom-sched bench",
        description="Times the scheduler's hot paths through the Python API, batch arrays "
                    "included, and compares them with the budgets (DESIGN.md section 8).")
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
    return b


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the suite, prints the table and notes, writes bench.json and the plot. Exit status:
    0, 1 (a check failed), 2 (bad arguments), 3 (--strict and a budget is over)."""
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    problem = _writable_dir(out)
    if problem is not None:
        print(f"atom-sched bench: {problem}", file=sys.stderr)
        return 2
    cpp = None
    if not args.no_cpp:
        cpp = find_cpp_bench(args.cpp_bench)
        if cpp is None and args.cpp_bench:
            print(f"atom-sched bench: {args.cpp_bench} is not an executable", file=sys.stderr)
            return 2
    total = len([w for w in workloads(args.quick, args.check)
                 if args.only is None or args.only in w.key])
    if total == 0:
        print(f"atom-sched bench: no workload key contains {args.only!r}", file=sys.stderr)
        return 2
    meta = metadata(args.quick, args.check)
    try:
        results = run_suite(quick=args.quick, check=args.check, only=args.only, cpp_bench=cpp,
                            progress=None if args.no_progress else _progress(total))
    except BenchCheckError as e:
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
    print(format_table(results))
    notes = format_notes(results)
    if notes:
        print()
        print(notes)
    if cpp is None and not args.no_cpp:
        print("(C++ core slope not measured: build it with `make build-cpp` or pass --cpp-bench)")
    json_path = out / "bench.json"
    write_json(json_path, results, meta)
    print(f"\nwrote {json_path}")
    png = out / "decode_us_per_step.png"
    if plot_decode(png, results):
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


__all__ = [
    "BUDGETS", "BenchCheckError", "Result", "Reps", "Workload",
    "admission", "decode_step", "find_cpp_bench", "format_notes", "format_table",
    "marginal_paired", "split_slope",
    "metadata", "plot_decode", "preemption", "run_cpp_decode", "run_suite", "which_tqdm",
    "workloads", "write_json", "build_parser", "main",
]


if __name__ == "__main__":
    sys.exit(main())
