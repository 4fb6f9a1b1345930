"""Per-rank programs for test_dp_prefill_delayer.py, run in separate processes that form a real
torch.distributed gloo group on 127.0.0.1 (a module of its own so spawned children import it)."""

from __future__ import annotations

import os
import traceback

import numpy as np


class StepClock:
    """A clock the scenario advances by hand: `now` seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def decisions(rank, steps, delayer_kwargs, clock_step=0.0):
    """Feeds (prefillable, usage, ready) per step to a PrefillDelayer; returns its decisions."""
    from atom_sched.dp import PrefillDelayer

    clock = StepClock()
    delayer = PrefillDelayer(clock=clock, **delayer_kwargs)
    out = []
    for prefillable, usage, ready in steps[rank]:
        allowed = delayer.should_allow_prefill(prefillable, usage, ready)
        out.append((allowed, delayer.last_decision))
        clock.now += clock_step
    return out


def veto_keeps_partial_prefills(rank):
    """Rank 0 holds a partial prefill and an admittable waiting prompt, rank 1 only decodes: the
    mixed state vetoes prefill on rank 0, whose batch must then hold decode rows only."""
    from atom_sched import SamplingParams, Scheduler, SchedulerConfig
    from atom_sched.dp import PrefillDelayer, schedule_dp

    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=8,
                                      max_num_batched_tokens=16, enable_chunked_prefill=True))
    delayer = PrefillDelayer()
    params = SamplingParams(max_tokens=50)
    sched.add_request(1, [11, 12, 13, 14], params)
    if rank == 0:
        sched.add_request(2, list(range(20, 60)), params)  # 40 tokens: partial after 12
        sched.add_request(3, list(range(60, 68)), params)  # waits: rank 0 stays prefillable
    log = []
    for _ in range(3):
        batch = schedule_dp(sched, delayer)
        sched.check_invariants()
        rows = [] if batch is None else batch.req_ids.tolist()
        log.append((delayer.last_decision, None if batch is None else batch.is_prefill, rows))
        if batch is not None:
            sched.update(batch, np.full(batch.num_rows, 7, dtype=np.int32))
            sched.check_invariants()
    state = sched.request_state(2) if rank == 0 else None
    return {"log": log, "partial": None if state is None else
            (state["num_computed_tokens"], state["prefill_target"])}


def compat_veto_keeps_partial_prefills(rank):
    """veto_keeps_partial_prefills through ATOM's names (compat.atom): the delayer attached with
    set_prefill_delayer and asked by schedule(), as ATOM's EngineCore runs it."""
    from atom_sched.compat.atom import ScheduledBatchOutput, Scheduler
    from atom_sched.dp import PrefillDelayer
    from support.atom_standins import AtomSamplingParams, Config, Sequence

    sched = Scheduler(Config(num_kvcache_blocks=65, kv_cache_block_size=4, max_num_seqs=8,
                             max_num_batched_tokens=16))
    delayer = PrefillDelayer()
    sched.set_prefill_delayer(delayer)
    prompts = {1: [11, 12, 13, 14]}
    if rank == 0:
        prompts |= {2: list(range(20, 60)), 3: list(range(60, 68))}
    seqs = {rid: Sequence(p, 4, AtomSamplingParams(max_tokens=50), id=rid)
            for rid, p in prompts.items()}
    sched.extend(seqs.values())
    log = []
    for _ in range(3):
        batch, _ = sched.schedule()
        sched._core.check_invariants()
        log.append((delayer.last_decision, batch.total_seqs_num_prefill > 0, batch.req_ids,
                    [seqs[rid].type.name for rid in batch.req_ids]))
        if batch.req_ids:
            n = len(batch.req_ids)
            sched.postprocess([], ScheduledBatchOutput(batch.req_ids, [(7,)] * n, None, None,
                                                        None), None)
    return {"log": log, "partial": None if rank else seqs[2].num_cached_tokens}


def run_rank(rank, world, store, scenario, args, results):
    import torch.distributed as dist

    # Loopback only: a file store (a TCP store listens on every interface) and gloo on lo.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
        try:
            results.put((rank, "ok", globals()[scenario](rank, *args)))
        finally:
            dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
