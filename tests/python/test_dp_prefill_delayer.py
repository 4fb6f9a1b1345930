"""ATOM's PrefillDelayer protocol over a real torch.distributed gloo group: 2 to 4 processes on
127.0.0.1 (a file store, so nothing listens beyond gloo's loopback sockets), every decision path,
and the veto never decoding a partial prefill (8.3)."""

from __future__ import annotations

import multiprocessing as mp
import tempfile

import pytest

torch = pytest.importorskip("torch")

from support.dp_scenarios import run_rank  # noqa: E402


def run(world, scenario, *args, timeout=120):
    """Runs `scenario` on `world` ranks; returns the per-rank results, in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mktemp(prefix="atom-sched-dp-")  # the ranks' rendezvous file
    procs = [ctx.Process(target=run_rank, args=(r, world, store, scenario, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict()
        for _ in range(world):
            rank, status, value = results.get(timeout=timeout)
            assert status == "ok", f"rank {rank} failed:\n{value}"
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


def same_on_every_rank(per_rank):
    assert all(d == per_rank[0] for d in per_rank), per_rank
    return per_rank[0]


def test_none_all_and_first_pass():
    # Step 0 is always allowed (the first pass); then nobody / everybody prefillable.
    steps = {0: [(True, 0.5, False), (False, 0.5, None), (True, 0.5, None)],
             1: [(False, 0.5, False), (False, 0.5, None), (True, 0.5, None)]}
    got = same_on_every_rank(run(2, "decisions", steps, {}))
    assert got == [(True, "first"), (True, "none"), (True, "all")]


def test_mixed_is_delayed_until_max_passes():
    mixed = [(True, 0.5, True)] * 6
    idle = [(False, 0.5, False)] * 6
    got = same_on_every_rank(run(2, "decisions", {0: mixed, 1: idle}, {"max_delay_passes": 3}))
    assert got == [(True, "first"), (False, "delayed"), (False, "delayed"), (False, "delayed"),
                   (True, "max_passes"), (False, "delayed")]


def test_mixed_is_delayed_until_the_timeout():
    mixed = [(True, 0.5, True)] * 6
    idle = [(False, 0.5, False)] * 6
    got = same_on_every_rank(run(2, "decisions", {0: mixed, 1: idle},
                                 {"max_delay_ms": 250.0}, 0.1))
    # The delay starts at the first mixed step (t=0.1 s); at t=0.4 s 300 ms have passed.
    assert [d for _, d in got] == ["first", "delayed", "delayed", "delayed", "timeout", "delayed"]


def test_low_watermark_forces_prefill_on_every_rank():
    steps = {0: [(True, 0.9, True), (True, 0.9, True), (True, 0.1, True)],
             1: [(False, 0.9, False), (False, 0.9, False), (False, 0.9, False)]}
    got = same_on_every_rank(run(2, "decisions", steps, {"token_usage_low_watermark": 0.5}))
    assert got == [(True, "first"), (False, "delayed"), (True, "watermark")]


def test_four_ranks_wait_for_alignment():
    # Three ranks ready, one prefillable but not yet aligned (TBO needs two prompts): delay.
    ready = [(True, 0.5, True)] * 3
    steps = {0: ready, 1: ready, 2: ready, 3: [(True, 0.5, True), (True, 0.5, False),
                                               (True, 0.5, True)]}
    got = same_on_every_rank(run(4, "decisions", steps, {}))
    assert got == [(True, "first"), (False, "delayed"), (True, "all")]


def test_veto_never_decodes_a_partial_prefill():
    rank0, rank1 = run(2, "veto_keeps_partial_prefills")
    first, vetoed, vetoed_again = rank0["log"]
    assert first == ("first", True, [1, 2])  # request 2 admitted with a 12-token chunk
    # Rank 0 could prefill request 3 but rank 1 cannot: mixed, delayed. Rank 0 decodes request
    # 1 only: the partial prefill 2 is neither prefilled nor decoded (ATOM decoded it, 8.3).
    assert vetoed == ("delayed", False, [1])
    assert rank1["log"][1][0] == "delayed"
    assert vetoed_again == ("delayed", False, [1])
    # Its KV progress is exactly the one real chunk: vetoed steps did not advance it.
    assert rank0["partial"] == (12, 40)


def test_atoms_scheduler_asks_the_delayer_every_step_and_keeps_the_partial_prefill():
    """The same through ``atom_sched.compat.atom``: ATOM's ``set_prefill_delayer`` and the
    readiness ATOM's scheduler reports; the vetoed steps decode request 1 only (as DECODE), and
    the partial prefill stays at its one chunk."""
    rank0, rank1 = run(2, "compat_veto_keeps_partial_prefills")
    first, vetoed, vetoed_again = rank0["log"]
    assert first == ("first", True, [1, 2], ["PREFILL", "PREFILL"])
    assert vetoed == vetoed_again == ("delayed", False, [1], ["DECODE"])
    assert [d for d, *_ in rank1["log"]] == ["first", "delayed", "delayed"]
    assert rank0["partial"] == 12  # the sequence's prefill progress: the one real chunk
