"""Device-side metadata benchmark (DESIGN.md section 8: 1,024 decode rows in <= 15 us of device
time, <= 2 launches, 0 host syncs; <= 16 bytes uploaded per decode row).

    python benchmarks/bench_device.py                       # CPU reference path, cost per row
    python benchmarks/bench_device.py --device cuda         # GPU: kernel times, launches, syncs
    python benchmarks/bench_device.py --rows 64,1024 --k 0,3 --steps 30 --out DIR --check

A real Scheduler runs R requests into steady decode; each measured step runs
``DeviceBatchBuilder.prepare`` and ``accept`` as an engine would (the scheduler's own cost is not
counted). Reported per row count R and K:

* CPU: median host time of prepare (plan packing + the C++ references) and accept, and the cost
  per row of both together.
* GPU: median device time of one prepare replayed from a captured CUDA graph (its two kernels;
  the plan upload is separate and counted in bytes) and of the accept kernel (a graph too), the
  kernel launches of one prepare (torch profiler), the host waits of the whole loop (must be 0;
  torch's sync debug mode is set to raise on any synchronizing call inside prepare/accept), the
  host time of prepare and, of it, the plan packing alone.

Writes ``device_bench.md`` and ``device_bench.json`` under --out ($OUT, else bench_out/).
``--check`` exits non-zero when the 1,024-row budgets are missed (GPU) or the results are
inconsistent (CPU: every step's tensors are compared with the host batch arrays).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import atom_sched
from atom_sched import DeviceBatchBuilder, SamplingParams, Scheduler, SchedulerConfig, _core

BLOCK_SIZE = 16
PROMPT = 32
BUDGET_US_1024 = 15.0
BUDGET_LAUNCHES = 2
BUDGET_BYTES_PER_ROW = 16


def setup(rows: int, k: int, steps: int, device: str) -> tuple[Any, Any, Any]:
    per_req = -(-(PROMPT + (steps + 8) * (k + 1) + k + 1) // BLOCK_SIZE) + 1
    cfg = SchedulerConfig(
        num_blocks=rows * per_req + 16, block_size=BLOCK_SIZE, max_num_seqs=rows,
        max_num_batched_tokens=max(8192, rows * (k + 1)), max_model_len=4096,
        num_speculative_tokens=k, enable_prefix_caching=False,
    )
    sched = Scheduler(cfg)
    rng = np.random.default_rng(rows + k)
    for rid in range(rows):
        sched.add_request(rid, rng.integers(10, 30000, size=PROMPT).astype(np.int32),
                          SamplingParams(max_tokens=100000, ignore_eos=True))
    builder = DeviceBatchBuilder(cfg, device=device)
    return cfg, sched, builder


def outputs(b: Any, k: int, builder: Any, rng: np.random.Generator) -> dict[str, Any]:
    import torch

    n = int(b.num_rows)
    tgt = torch.from_numpy(rng.integers(10, 30000, size=(n, k + 1)).astype(np.int32))
    out: dict[str, Any] = {"target_token_ids": tgt.to(builder.device)}
    if k:
        d = torch.from_numpy(rng.integers(10, 30000, size=(n, k)).astype(np.int32))
        out["next_draft_token_ids"] = d.to(builder.device)
    return out


def check_step(b: Any, x: Any) -> None:
    m, n = int(b.num_tokens), int(b.num_rows)
    ok = (
        (x.input_ids[:m].cpu().numpy() == b.scheduled_tokens).all()
        and (x.positions[:m].cpu().numpy() == b.positions).all()
        and (x.slot_mapping[:m].cpu().numpy() == b.slot_mapping).all()
        and (x.block_table[:n].cpu().numpy() == b.block_tables).all()
    )
    if not ok:
        raise SystemExit(f"batch {b.id}: device tensors differ from the host batch arrays")


def run_one(rows: int, k: int, steps: int, device: str, check: bool) -> dict[str, Any]:
    import torch

    cfg, sched, builder = setup(rows, k, steps, device)
    rng = np.random.default_rng(0)
    on_gpu = device != "cpu"
    prep_ns: list[int] = []
    acc_ns: list[int] = []
    bytes_per_row: list[float] = []
    decode = 0
    gc.disable()
    try:
        while decode < steps + 3:
            b = sched.schedule()
            strict = on_gpu and not b.is_prefill
            if strict:
                torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
            t0 = time.perf_counter_ns()
            x = builder.prepare(b)
            t1 = time.perf_counter_ns()
            if strict:
                torch.cuda.set_sync_debug_mode(0)
            out = outputs(b, k, builder, rng)  # the "model" (not timed; its copies may sync)
            if strict:
                torch.cuda.set_sync_debug_mode("error")
            t2 = time.perf_counter_ns()
            res = builder.accept(b, **out)
            t3 = time.perf_counter_ns()
            if strict:
                torch.cuda.set_sync_debug_mode(0)
            if check:
                check_step(b, x)
            sched.update(b, **res.update_kwargs())
            if not b.is_prefill:
                decode += 1
                if decode > 3:  # warm-up steps excluded
                    prep_ns.append(t1 - t0)
                    acc_ns.append(t3 - t2)
                    bytes_per_row.append(builder.last_plan_bytes / int(b.num_rows))
                assert int(b.num_rows) == rows, "every request decodes every step"
    finally:
        gc.enable()
    r: dict[str, Any] = {
        "rows": rows,
        "k": k,
        "host_prepare_us": statistics.median(prep_ns) / 1e3,
        "host_accept_us": statistics.median(acc_ns) / 1e3,
        "upload_bytes_per_row": statistics.median(bytes_per_row),
        "host_waits": builder.host_waits,
    }
    r["host_ns_per_row"] = (r["host_prepare_us"] + r["host_accept_us"]) * 1e3 / rows
    if on_gpu:
        r.update(gpu_times(builder, b, rows, k))
    return r


def pack_time(builder: Any, b: Any, reps: int = 200) -> float:
    """Median host µs of packing `b`'s plan alone (the C++ part of prepare; the rest of the host
    time is torch and the CUDA runtime: the upload, an event, the graph launch)."""
    scratch = builder._plan_host_ptr[builder._step & 1]  # the buffer the next prepare would use
    args = (b.request_slots, b.num_scheduled_tokens, b.num_cached_tokens, b.row_is_prefill,
            b.slot_reset, b.emits_token, b.new_block_starts, b.new_block_offsets, b.new_block_ids,
            b.scheduled_tokens, b.cu_seqlens_q)
    ns = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        _core.device_pack_plan(scratch, builder.plan_capacity, *args)
        ns.append(time.perf_counter_ns() - t0)
    return statistics.median(ns) / 1e3


def replay_times(launch: Any, reset: Any, reps: int = 30, per: int = 20) -> list[float]:
    """Device µs of one `launch(stream)`: `per` launches captured in one CUDA graph, replayed
    between two events, `reps` samples. One launch per replay would time the host's launch rate
    instead wherever it is slower than the kernels (it was, at about 10 µs, on the H200 here).
    `reset()` (outside the graph) before each sample keeps the slots' positions in range."""
    import torch

    reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per):
            launch(int(torch.cuda.current_stream().cuda_stream))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        reset()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / per)
    return samples


def gpu_times(builder: Any, b: Any, rows: int, k: int) -> dict[str, Any]:
    """Device time of prepare from a captured graph, accept, and launches per prepare, for the
    last decode batch (its plan is still in the builder's device buffer)."""
    import torch

    torch.cuda.synchronize()
    plan = int(builder._plan_dev.data_ptr())
    tokens = int(b.num_tokens)
    saved = builder._computed.clone()

    def prepare(stream: int) -> None:
        _core.device_prepare(plan, builder._state, builder._outputs, rows, tokens, stream, True)

    # Launches of one prepare, by the profiler.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prepare(int(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA" and
               "kernel" in e.name]
    builder._computed.copy_(saved)

    # accept: the kernel alone, on the same plan. Both are timed from graphs (replay_times):
    # launched one by one from Python, accept measured the launch rate (about 20 µs on any row
    # count, H200, 2026-12-04), not the kernel.
    tgt = torch.randint(10, 30000, (rows, k + 1), dtype=torch.int32, device=builder.device)
    res = builder._result_dev[0]

    def accept(stream: int) -> None:
        _core.device_accept(plan, builder._state, int(res.data_ptr()), rows, int(tgt.data_ptr()),
                            0, 0, 0, 0, stream, True)

    samples = replay_times(prepare, lambda: builder._computed.copy_(saved))
    acc = replay_times(accept, lambda: builder._computed.copy_(saved))
    builder._computed.copy_(saved)
    return {
        "host_pack_us": pack_time(builder, b),
        "device_prepare_us": statistics.median(samples),
        "device_prepare_p10_us": sorted(samples)[len(samples) // 10],
        "device_accept_us": statistics.median(acc),
        "launches_per_prepare": len(kernels),
        "kernels": sorted(set(kernels)),
    }


def table(results: list[dict[str, Any]], gpu: bool) -> str:
    if gpu:
        head = ("| rows | K | prepare device µs (graph replay, median) | accept device µs | "
                "launches / prepare | upload B/row | host waits | host prepare µs | of which plan "
                "packing µs |")
        sep = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        lines = [head, sep] + [
            f"| {r['rows']} | {r['k']} | {r['device_prepare_us']:.2f} | "
            f"{r['device_accept_us']:.2f} | {r['launches_per_prepare']} | "
            f"{r['upload_bytes_per_row']:.2f} | {r['host_waits']} | {r['host_prepare_us']:.1f} | "
            f"{r['host_pack_us']:.1f} |"
            for r in results
        ]
    else:
        path = "HIP-CPU kernels" if _core.device_backend() == "hip-cpu" else "CPU reference"
        head = (f"| rows | K | prepare µs (host, {path}) | accept µs | ns per row "
                "(prepare + accept) | upload B/row |")
        sep = "|---:|---:|---:|---:|---:|---:|"
        lines = [head, sep] + [
            f"| {r['rows']} | {r['k']} | {r['host_prepare_us']:.1f} | {r['host_accept_us']:.1f}"
            f" | {r['host_ns_per_row']:.0f} | {r['upload_bytes_per_row']:.2f} |"
            for r in results
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", default="64,256,1024,4096")
    ap.add_argument("--k", default="0,3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    import torch

    gpu = args.device != "cpu"
    if gpu and not torch.cuda.is_available():
        print(f"no GPU available to torch ({torch.__version__}): nothing measured on a device")
        return 2
    dev_name = torch.cuda.get_device_name() if gpu else platform.processor() or platform.machine()
    results = []
    for k in (int(x) for x in args.k.split(",")):
        for rows in (int(x) for x in args.rows.split(",")):
            r = run_one(rows, k, args.steps, args.device, args.check)
            results.append(r)
            print(json.dumps(r), flush=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = (f"Device metadata benchmark, {when}, {'GPU ' + dev_name if gpu else 'CPU ' + dev_name}"
             f", atom_sched {atom_sched.__version__}, backend {_core.device_backend()}, "
             f"torch {torch.__version__}, {args.steps} decode steps per size")
    md = f"{title}\n\n{table(results, gpu)}\n"
    failures = []
    for r in results:
        if r["upload_bytes_per_row"] > BUDGET_BYTES_PER_ROW + 1:  # + amortised block ids
            failures.append(f"{r['rows']} rows K={r['k']}: {r['upload_bytes_per_row']:.1f} B/row")
        if r["host_waits"]:
            failures.append(f"{r['rows']} rows K={r['k']}: {r['host_waits']} host waits")
        if gpu and r["rows"] == 1024:
            if r["device_prepare_us"] > BUDGET_US_1024:
                failures.append(f"1024 rows K={r['k']}: {r['device_prepare_us']:.2f} us > 15")
            if r["launches_per_prepare"] > BUDGET_LAUNCHES:
                failures.append(f"1024 rows: {r['launches_per_prepare']} launches > 2")
    md += "\nBudgets (DESIGN.md section 8): " + ("all met" if not failures else
                                                   "MISSED: " + "; ".join(failures)) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_bench.md").write_text(md)
    (out / "device_bench.json").write_text(json.dumps(
        {"title": title, "device": dev_name, "results": results, "failures": failures}, indent=1))
    print()
    print(md)
    print(f"written to {out / 'device_bench.md'}")
    return 1 if (args.check and failures) else 0


if __name__ == "__main__":
    sys.exit(main())
