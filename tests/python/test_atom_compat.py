"""Issue 9: ATOM's scheduler API (``atom_sched.compat.atom``) driven by an EngineCore-shaped loop
and a ModelRunner that consumes ``ScheduledBatch`` as ATOM's does (support/atom_standins.py), in
ATOM's two output modes (non-deferred, and deferred as in production) with K = 0..3: chunked
prefill, prefix caching, preemption, rejection and stops; the outputs equal the native API's on
the same stream, and every row's KV context is checked where the runner reads it."""

from __future__ import annotations

import math
import pickle
import queue
import time
from collections import deque
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
from support import Driver, FakeModel, expected_output
from support.atom_standins import (
    AtomSamplingParams,
    Config,
    FakeRunner,
    Sequence,
    SequenceStatus,
    SequenceType,
    SpeculativeConfig,
    engine_loop,
)
from support.fake_model import EOS
from support.oracle import req_info

from atom_sched import SamplingParams, SchedulerConfig
from atom_sched import Scheduler as NativeScheduler
from atom_sched.compat.atom import (
    CacheStats,
    RequestOutput,
    ScheduledBatchOutput,
    Scheduler,
    SpecStats,
)

BS = 4


def config(k=0, **kw):
    base = dict(num_kvcache_blocks=26, kv_cache_block_size=BS, max_num_seqs=6,
                max_num_batched_tokens=32, max_model_len=96, eos_token_id=EOS,
                speculative_config=SpeculativeConfig(k) if k else None)
    return Config(**{**base, **kw})


def stream(seed=0, n=14):
    """Requests with shared prefixes, prompts of 3-30 tokens, some ending by EOS, a stop
    sequence, or max_tokens: ``[(id, prompt, params, stop sequences)]``."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(20, 900, 13).tolist()
    out = []
    for i in range(n):
        rid = i + 1  # ATOM replaces an id of 0 by its counter
        body = rng.integers(20, 900, int(rng.integers(3, 18))).tolist()
        prompt = (shared[: int(rng.integers(4, 14))] if i % 3 else []) + body
        sp = AtomSamplingParams(max_tokens=int(rng.integers(1, 24)), temperature=0.0,
                                ignore_eos=i % 5 == 4)
        out.append((rid, prompt, sp))
    return out


def model_for(k, reqs):
    m = FakeModel(k)
    overrides = {}
    for rid, _, _ in reqs:
        if rid % 4 == 0:
            overrides[(rid, 5)] = EOS  # an EOS at the 6th token (ignored when ignore_eos)
    m.overrides = overrides
    return m


def stop_sequences(model, rid):
    return [[model.token(rid, 6), model.token(rid, 7)]] if rid % 7 == 3 else []


def run_compat(k, deferred, reqs, cfg):
    model = model_for(k, reqs)
    sched = Scheduler(cfg)
    seqs = [Sequence(p, BS, sp, stop_sequences(model, rid), id=rid) for rid, p, sp in reqs]
    runner = FakeRunner(model, k, {rid: p for rid, p, _ in reqs}, BS, deferred,
                        ScheduledBatchOutput)
    sched.extend(seqs)
    return sched, seqs, runner, engine_loop(sched, runner), model


def native_results(k, reqs, cfg_core, model):
    d = Driver(NativeScheduler(cfg_core), FakeModel(k, overrides=model.overrides), cfg=cfg_core)
    for rid, p, sp in reqs:
        d.add(rid, p, core_params(sp, stop_sequences(model, rid)))
    d.run()
    return d.results()


def core_params(sp, stops):
    return SamplingParams(max_tokens=sp.max_tokens, ignore_eos=sp.ignore_eos,
                          temperature=sp.temperature, stop_token_sequences=stops)


MODES = [(k, deferred) for deferred in (False, True) for k in (0, 1, 2, 3)]


@pytest.mark.parametrize("k,deferred", MODES,
                         ids=[f"{'deferred' if d else 'sync'}-K{k}" for k, d in MODES])
def test_engine_loop_equals_the_native_api(k, deferred):
    reqs = stream(seed=k)
    cfg = config(k)
    sched, seqs, runner, res, model = run_compat(k, deferred, reqs, cfg)
    native = native_results(k, reqs, sched.config, model)
    stats = sched._core.stats()
    assert stats["num_preemptions"] > 0, "the small pool should preempt"
    assert stats["prefix_hit_tokens"] > 0, "shared prefixes should hit the cache"
    assert runner.rows_checked > 0
    done = {s.id for s in res["finished"]}
    assert done == {rid for rid, _, _ in reqs}
    for seq in seqs:
        tokens, reason = native[seq.id]
        info = req_info(seq.token_ids[: seq.num_prompt_tokens],
                        core_params(seq, seq.stop_token_sequences))
        assert (tokens, reason) == expected_output(model, seq.id, info, sched.config)
        assert seq.completion_token_ids == tokens, seq.id
        assert seq.leave_reason == reason and seq.status == SequenceStatus.FINISHED
        outs = res["streamed"][seq.id]
        assert sum((o.output_tokens for o in outs), []) == tokens
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == reason
        if k and not deferred:  # the last output's speculative state, as the runner left it
            last, drafts, rejected = runner.gpu[seq.id]
            assert seq.spec_token_ids.tolist() == drafts and seq.num_rejected == rejected
            # (a decode output: K+1-r accepted, K-r bonus; a prefill output: 0 and 0)
            assert seq.num_bonus_tokens in ({k - rejected} if rejected else {0, k})
    assert {s.leave_reason for s in seqs} >= {"max_tokens", "eos"}
    if k:
        assert sched.spec_stats.total_steps > 0 and 0 < sched.spec_stats.acceptance_rate <= 1
    assert sched.cache_stats.hit_rate > 0
    assert sched.is_finished() and not sched.has_unfinished_requests()
    sched._core.check_invariants()


@pytest.mark.parametrize("deferred", [False, True])
def test_a_request_ending_with_its_first_token(deferred):
    """Deferred: the core has nothing to run while the prefill's output is in the runner; ATOM's
    dummy batch brings it back (an EngineCore skips the forward of an empty batch)."""
    reqs = [(1, list(range(30, 39)), AtomSamplingParams(max_tokens=1, temperature=0.0))]
    sched, seqs, runner, res, _ = run_compat(0, deferred, reqs, config())
    assert seqs[0].leave_reason == "max_tokens" and len(seqs[0].completion_token_ids) == 1
    assert runner.forwards == (2 if deferred else 1)
    assert runner.dummies == (1 if deferred else 0)


def test_scheduled_batch_has_atoms_names_dtypes_and_live_block_tables():
    sched = Scheduler(config(2))
    seq = Sequence(list(range(40, 50)), BS, AtomSamplingParams(max_tokens=8, top_k=5,
                                                               top_p=0.5), id=3)
    sched.add(seq)
    batch, seqs = sched.schedule()
    assert batch.req_ids == [3] and seqs == {3: seq}
    assert seq.status == SequenceStatus.RUNNING and seq.type == SequenceType.PREFILL
    assert batch.num_scheduled_tokens.dtype == np.int32 and batch.num_scheduled_tokens[0] == 10
    assert batch.context_lens.tolist() == [10] and batch.num_cached_tokens == [0]
    assert batch.temperatures.dtype == np.float32 and batch.top_ks.tolist() == [5]
    assert batch.scheduled_tokens.tolist() == list(range(40, 50))
    assert batch.block_tables[0] is seq.block_table and seq.block_table == [1, 2, 3]
    assert batch.last_block_num_tokens == [2] and batch.num_spec_step == 0
    assert batch.total_seqs_num_prefill == 1 and batch.total_tokens_num == 10
    assert not hasattr(batch, "scheduled_spec_decode_tokens")
    # Deferred: the decode batch is scheduled while the prefill's output is in flight.
    batch2, _ = sched.schedule()
    assert batch2.num_spec_step == 2 and batch2.num_scheduled_tokens.tolist() == [3]
    assert batch2.context_lens.tolist() == [13]  # 10 + K + 1: ATOM's host count
    assert batch2.scheduled_tokens.tolist() == [EOS] * 3  # placeholders
    assert seq.type == SequenceType.DECODE and batch2.block_tables[0] == [1, 2, 3, 4]
    assert batch2.scheduled_spec_decode_tokens.shape == (0, 2)


def test_rejections_are_reported_once_with_atoms_reason():
    sched = Scheduler(config())
    seq = Sequence(list(range(100)), BS, AtomSamplingParams(), id=9)
    sched.add(seq)
    batch, _ = sched.schedule()
    assert batch.req_ids == []
    (r,) = sched.take_rejected()
    assert r is seq and seq.status == SequenceStatus.FINISHED
    assert seq.leave_reason.startswith("unschedulable: input tokens=100 > max_model_len=96")
    assert sched.take_rejected() == [] and sched.is_finished()


def test_bad_outputs_raise_and_change_nothing():
    sched = Scheduler(config())
    sched.add(Sequence(list(range(40, 45)), BS, AtomSamplingParams(max_tokens=3), id=1))
    sched.add(Sequence(list(range(50, 55)), BS, AtomSamplingParams(max_tokens=3), id=2))
    batch, seqs = sched.schedule()
    with pytest.raises(ValueError, match="req_ids"):
        sched.postprocess(seqs.values(), ScheduledBatchOutput([2, 1], [(5,), (6,)], None, None,
                                                              None), None)
    with pytest.raises(ValueError, match="got 2 tokens"):
        sched.postprocess(seqs.values(), ScheduledBatchOutput([1, 2], [(5, 6), (6,)], None,
                                                              None, None), None)
    with pytest.raises(ValueError, match="token rows"):
        sched.postprocess(seqs.values(), ScheduledBatchOutput([1, 2], [(5,)], None, None, None),
                          None)
    q: queue.Queue = queue.Queue()
    assert sched.postprocess(seqs.values(), ScheduledBatchOutput([1, 2], [(5,), (6,)], None,
                                                                 None, None), q) == []
    assert [(sid, o.output_tokens) for sid, o in q.get_nowait()] == [(1, [5]), (2, [6])]
    with pytest.raises(ValueError, match="already queued"):
        sched.add(Sequence([1, 2], BS, id=1))
    with pytest.raises(ValueError):
        sched.add(Sequence([1, 2], BS, AtomSamplingParams(top_p=0.0), id=7))
    assert sched.get_request_counts() == (2, 0)
    assert sched.get_num_unfinished_requests() == 2 and sched.has_requests()


def test_prefill_delayer_is_asked_every_step_and_its_veto_holds_prefill():
    class Delayer:
        def __init__(self):
            self.calls = []

        def should_allow_prefill(self, local_prefillable, token_usage, local_alignment_ready):
            self.calls.append((local_prefillable, token_usage, local_alignment_ready))
            return len(self.calls) > 2

    sched = Scheduler(config())
    d = Delayer()
    sched.set_prefill_delayer(d)
    assert sched.schedule() is None and len(d.calls) == 1  # asked even with nothing to do
    sched.add(Sequence(list(range(40, 45)), BS, AtomSamplingParams(max_tokens=3), id=1))
    batch, _ = sched.schedule()
    assert batch.req_ids == [] and d.calls[-1] == (True, 0.0, True)
    batch, _ = sched.schedule()
    assert batch.req_ids == [1]


def test_stats_classes_count_as_atoms():
    s = SpecStats(2)
    for a in (1, 3, 3, 2):
        s.update(a)
    assert s.total_draft_tokens == 8 and s.total_accepted == 0 * 1 + 2 * 2 + 1 * 1
    assert s.get_statistics()["distribution"] == {0: 1, 1: 1, 2: 2}
    with pytest.raises(KeyError):
        s.update(4)
    s.reset()
    assert s.acceptance_rate == 0.0
    c = CacheStats()
    c.update(8, 16)
    c.update(0, 16)
    assert c.hit_rate == 0.25


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [0, 2])
def test_random_streams_in_production_mode(seed, k):
    """Deferred outputs (ATOM's production mode), other streams and pool sizes: preemptions at
    other moments, dummy batches, re-prefills of preempted requests."""
    reqs = stream(seed=100 + seed, n=20)
    cfg = config(k, num_kvcache_blocks=22 + 3 * seed, max_num_seqs=4 + seed % 3)
    sched, seqs, runner, res, model = run_compat(k, True, reqs, cfg)
    native = native_results(k, reqs, sched.config, model)
    for seq in seqs:
        assert (seq.completion_token_ids, seq.leave_reason) == native[seq.id], seq.id
    assert len(res["finished"]) == len(reqs) and sched.is_finished()


# ---- prefill/decode disaggregation through ATOM's connector names ------------------------------
class StandInConnector:
    """ATOM's scheduler-side connector as spec 5.6 describes it (Mooncake's semantics: no tag on
    the probe): requests with ``do_remote_prefill`` load their prompt KV asynchronously; the
    producer records ``kv_transfer_params_output`` at the finish."""

    def __init__(self, is_producer: bool) -> None:
        self.is_producer = is_producer
        self.reqs_need_recv: dict[int, tuple] = {}
        self.calls: list[tuple[str, int]] = []

    def get_num_new_matched_tokens(self, seq):
        self.calls.append(("match", seq.id))
        params = seq.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            return seq.num_prompt_tokens, True
        return 0, False

    def update_state_after_alloc(self, seq):
        self.calls.append(("alloc", seq.id))
        params = seq.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            self.reqs_need_recv[seq.id] = (seq, list(seq.block_table))
            params["do_remote_prefill"] = False

    def build_connector_meta(self):
        meta = {"reqs_to_recv": {sid: {"local_block_ids": blocks,
                                       "remote_block_ids": seq.kv_transfer_params[
                                           "remote_block_ids"]}
                                 for sid, (seq, blocks) in self.reqs_need_recv.items()}}
        self.reqs_need_recv = {}
        return meta

    def request_finished(self, seq):
        self.calls.append(("finished", seq.id))
        if self.is_producer:
            seq.kv_transfer_params_output = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(seq.block_table), "transfer_id": seq.id,
                "first_token_id": seq.output_tokens[0] if seq.output_tokens else None,
                "draft_token_ids": [int(t) for t in seq.spec_token_ids]}


class XferOutput:
    def __init__(self, finished_sending=(), finished_recving=()):
        self.finished_sending, self.finished_recving = set(finished_sending), set(
            finished_recving)


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("deferred", [False, True])
def test_prefill_decode_disaggregation_through_atoms_connector(deferred, k):
    """ATOM's connector calls (probe, alloc, meta, finish) and ``_update_from_kv_xfer_finished``
    through the compat layer: the decode engine starts from the producer's first token (and
    drafts), reads the transferred KV, and streams what one engine would."""
    reqs = stream(seed=7, n=4)
    model = model_for(k, reqs)
    prompts = {rid: p for rid, p, _ in reqs}
    prod = Scheduler(config(k), kv_connector=StandInConnector(True))
    cons = Scheduler(config(k), kv_connector=StandInConnector(False))
    runner_p = FakeRunner(model, k, prompts, BS, deferred, ScheduledBatchOutput)
    runner_c = FakeRunner(model, k, prompts, BS, deferred, ScheduledBatchOutput)
    # 1. The prefill engine: max_tokens=1, do_remote_decode.
    for rid, p, _ in reqs:
        seq = Sequence(p, BS, AtomSamplingParams(max_tokens=1, temperature=0.0), id=rid)
        seq.kv_transfer_params = {"do_remote_decode": True}
        prod.add(seq)
    pre = {s.id: s for s in engine_loop(prod, runner_p)["finished"]}
    held = prod._core.num_free_blocks
    assert held < prod.config.num_blocks - 1, "the producer keeps the blocks until sent"
    # 2. The decode engine: the same prompts with the producer's kv_transfer_params_output.
    seqs = {}
    for rid, p, sp in reqs:
        out = pre[rid].kv_transfer_params_output
        assert out["first_token_id"] == model.token(rid, 0)
        assert len(out["draft_token_ids"]) == k
        seq = Sequence(p, BS, sp, id=rid)
        seq.kv_transfer_params = dict(out)
        seqs[rid] = seq
        cons.add(seq)
    stream_q: queue.Queue = queue.Queue()
    finished = []
    for _ in range(2000):
        if cons.is_finished():
            break
        result = cons.schedule()
        assert cons.take_rejected() == []
        batch, smap = result
        for sid, recv in batch.connector_meta_output["reqs_to_recv"].items():
            assert seqs[sid].status == SequenceStatus.WAITING_FOR_REMOTE_KVS
            # The transfer: the producer's KV of those blocks into the consumer's blocks.
            for rb, lb in zip(recv["remote_block_ids"], recv["local_block_ids"], strict=False):
                for off in range(BS):
                    if rb * BS + off in runner_p.kv:
                        runner_c.kv[lb * BS + off] = runner_p.kv[rb * BS + off]
            cons._update_from_kv_xfer_finished(XferOutput(finished_recving=[sid]))
            prod._update_from_kv_xfer_finished(XferOutput(finished_sending=[sid]))
        if batch.req_ids:
            finished += cons.postprocess(smap.values(), runner_c.forward(batch), stream_q)
    assert prod._core.num_free_blocks == prod.config.num_blocks - 1
    assert {s.id for s in finished} == set(prompts)
    for rid, p, sp in reqs:
        info = req_info(p, core_params(sp, []))
        assert (seqs[rid].completion_token_ids, seqs[rid].leave_reason) == expected_output(
            model, rid, info, cons.config)
    assert cons._core.stats()["num_remote_prefills"] == len(reqs)
    kinds = [c[0] for c in cons.kv_connector.calls]
    assert kinds.count("alloc") == len(reqs) and kinds.count("finished") == len(reqs)


# ---- ATOM's documented behaviours (spec sections 3-5) through the compat API ------------------
def test_stop_token_ids_of_the_config_end_a_request():
    """Spec 3.1/4.3: the config's stop_token_ids end a request with "stop_<id>" (not with
    ignore_eos); the stop token is kept."""
    model = FakeModel(0)
    stop = model.token(1, 2)
    sched = Scheduler(config(stop_token_ids=[stop]))
    seq = Sequence(list(range(40, 49)), BS, AtomSamplingParams(max_tokens=10, temperature=0.0,
                                                               ignore_eos=True), id=1)
    sched.add(seq)
    engine_loop(sched, FakeRunner(model, 0, {1: seq.token_ids[:9]}, BS, True,
                                  ScheduledBatchOutput))
    assert seq.leave_reason == f"stop_{stop}"
    assert seq.completion_token_ids == [model.token(1, g) for g in range(3)]


def test_static_rejections_have_atoms_texts():
    """Spec 3.2: the three unschedulable reasons, in ATOM's words, without using the budget."""
    sched = Scheduler(config(enable_chunked_prefill=False, max_num_batched_tokens=8,
                             num_kvcache_blocks=6))
    long_prompt = Sequence(list(range(40, 140)), BS, id=1)  # > max_model_len
    over_budget = Sequence(list(range(40, 50)), BS, id=2)  # > budget, chunking off
    ok = Sequence(list(range(40, 45)), BS, AtomSamplingParams(max_tokens=2), id=3)
    sched.extend([long_prompt, over_budget, ok])
    batch, _ = sched.schedule()
    assert batch.req_ids == [3]
    reasons = {s.id: s.leave_reason for s in sched.take_rejected()}
    assert reasons[1].startswith("unschedulable: input tokens=100 > max_model_len=96.")
    assert reasons[2].startswith("unschedulable: input tokens=10 > max_num_batched_tokens=8.")
    big = Scheduler(config(num_kvcache_blocks=4))
    big.add(Sequence(list(range(40, 60)), BS, id=4))  # 5 blocks > 3 usable
    big.schedule()
    (r,) = big.take_rejected()
    assert r.leave_reason.startswith("unschedulable: needs 5 KV blocks for 20 input tokens")


def test_queries_follow_the_queues():
    """Spec 5.5: request counts, unfinished, next batch info, is_finished."""
    sched = Scheduler(config(max_num_batched_tokens=8))
    assert sched.is_finished() and not sched.has_requests()
    assert sched.get_next_batch_info() == (False, 0, 0)
    sched.add(Sequence(list(range(40, 52)), BS, AtomSamplingParams(max_tokens=3), id=1))
    sched.add(Sequence(list(range(60, 63)), BS, AtomSamplingParams(max_tokens=3), id=2))
    assert sched.get_request_counts() == (0, 2) and sched.get_num_unfinished_requests() == 2
    assert sched.get_next_batch_info()[0] is True
    batch, _ = sched.schedule()  # a chunk of request 1 (8 of 12 tokens)
    assert batch.req_ids == [1] and batch.num_scheduled_tokens.tolist() == [8]
    assert sched.get_request_counts() == (1, 1) and not sched.is_finished()


def test_preemption_sends_a_sequence_back_to_waiting_without_blocks():
    """Spec 3.6/3.7: when the pool runs short the tail of running is preempted: WAITING, no
    blocks, re-prefilled later with its generated tokens (which it keeps)."""
    k = 0
    reqs = [(rid, list(range(100 * rid, 100 * rid + 14)),
             AtomSamplingParams(max_tokens=30, temperature=0.0)) for rid in (1, 2, 3)]
    model = model_for(k, reqs)
    sched = Scheduler(config(num_kvcache_blocks=14, max_num_seqs=3))
    seqs = {rid: Sequence(p, BS, sp, id=rid) for rid, p, sp in reqs}
    sched.extend(seqs.values())
    runner = FakeRunner(model, k, {rid: p for rid, p, _ in reqs}, BS, False,
                        ScheduledBatchOutput)
    seen_waiting = False
    for _ in range(500):
        if sched.is_finished():
            break
        batch, smap = sched.schedule()
        for seq in seqs.values():
            if seq.status == SequenceStatus.WAITING and seq.output_tokens:
                seen_waiting = True  # preempted after generating: no blocks, tokens kept
                assert seq.block_table == [] and seq.num_tokens > seq.num_prompt_tokens
        if batch.req_ids:
            sched.postprocess(smap.values(), runner.forward(batch), None)
    assert seen_waiting and sched._core.stats()["num_preemptions"] > 0
    for rid, seq in seqs.items():
        assert seq.completion_token_ids == [model.token(rid, g) for g in range(30)]


LIMIT_MODES = [(2, True), (3, True), (3, False)]  # K=1 reaches the limit exactly


@pytest.mark.parametrize("k,deferred", LIMIT_MODES,
                         ids=[f"{'deferred' if d else 'sync'}-K{k}" for k, d in LIMIT_MODES])
def test_decode_rows_at_max_model_len_are_k_plus_1_wide(k, deferred):
    """ATOM's runner verifies every decode row as K+1 tokens. At the position limit the core
    schedules fewer (no position past max_model_len); the layer pads that row with placeholders
    whose KV goes to the null block, and drops what is accepted past the limit. Every request
    ends at max_model_len with the true tokens (the runner checks each KV position it reads)."""
    reqs = [(rid, list(range(50 * rid, 50 * rid + 9 + rid)),
             AtomSamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0))
            for rid in (1, 2, 3, 4)]
    cfg = config(k, max_model_len=31, num_kvcache_blocks=40)
    sched, seqs, runner, _, model = run_compat(k, deferred, [], cfg)
    model = model_for(k, reqs)
    runner = FakeRunner(model, k, {rid: p for rid, p, _ in reqs}, BS, deferred,
                        ScheduledBatchOutput)
    padded = []
    forward = runner.forward

    def forward_and_look(batch):
        if not batch.is_dummy_run and batch.total_seqs_num_decode:
            # A padded row reaches past the limit (ATOM's context counts every input).
            padded.extend(rid for rid, c in zip(batch.req_ids, batch.context_lens.tolist(),
                                                strict=True) if c > 31)
        return forward(batch)

    runner.forward = forward_and_look
    seqs = [Sequence(p, BS, sp, id=rid) for rid, p, sp in reqs]
    sched.extend(seqs)
    engine_loop(sched, runner)
    assert padded, "no row reached the limit with fewer than K+1 positions"
    for seq in seqs:
        assert seq.leave_reason == "max_model_len" and seq.num_tokens == 31
        assert seq.completion_token_ids == [model.token(seq.id, g)
                                            for g in range(31 - seq.num_prompt_tokens)]
    sched._core.check_invariants()


def test_delay_factor_holds_admission_back_on_atoms_clock(monkeypatch):
    """Spec 5.4 through ATOM's names: with ``scheduler_delay_factor`` a waiting prompt is held
    while it has waited no longer than factor x the last prompt's latency and something runs;
    waiting times are on ATOM's clock, ``time.time()`` (``arrive_time``)."""
    from atom_sched.compat import atom as compat

    clock = [1.7e9]  # epoch seconds, as ATOM's IO processor stamps arrive_time
    monkeypatch.setattr(compat.time, "time", lambda: clock[0])
    prompts = {1: list(range(100, 104)), 2: list(range(200, 204)), 3: list(range(300, 304))}
    sched = Scheduler(config(scheduler_delay_factor=0.5))
    runner = FakeRunner(FakeModel(0), 0, prompts, BS, False, ScheduledBatchOutput)

    def step():
        batch, seqs = sched.schedule()
        sched.postprocess(seqs.values(), runner.forward(batch), None)
        return batch.total_seqs_num_prefill > 0, batch.req_ids

    first = Sequence(prompts[1], BS, AtomSamplingParams(max_tokens=10), id=1)
    first.arrive_time = clock[0]
    sched.add(first)
    assert step() == (True, [1])  # nothing runs: no delay
    clock[0] += 0.6
    late = Sequence(prompts[2], BS, AtomSamplingParams(max_tokens=3), id=2)
    late.arrive_time = clock[0]
    sched.add(late)
    clock[0] += 0.4  # the last prompt's latency is 1.0 s; request 2 waited 0.4 s <= 0.5 s
    assert step() == (False, [1])
    clock[0] += 0.2  # waited 0.6 s > 0.5 x 0.2 s (the latency since the last prefill)
    assert step() == (True, [2])
    sched.add(Sequence(prompts[3], BS, AtomSamplingParams(max_tokens=3), id=3))  # stamped now
    assert step() == (False, [1, 2])  # waited 0 s
    clock[0] += 5.0
    assert step() == (True, [3])


PREEMPT_MODES = [(0, False), (2, False), (0, True), (3, True)]


@pytest.mark.parametrize("k,deferred", PREEMPT_MODES,
                         ids=[f"{'deferred' if d else 'sync'}-K{k}" for k, d in PREEMPT_MODES])
def test_preempt_a_sequence_the_engine_chose_while_its_batch_is_in_flight(k, deferred):
    """Spec 3.7 through ATOM's ``preempt(seq)``: between a forward and its postprocess the engine
    preempts a running sequence; it is WAITING without blocks, keeps its tokens, resumes first,
    and ends with the output it would have had (the runner checks every KV position read)."""
    reqs = stream(seed=10 + k)
    cfg = config(k, num_kvcache_blocks=80)  # room for all: every preemption is the engine's
    sched, seqs, runner, _, model = run_compat(k, deferred, [], cfg)
    seqs = [Sequence(p, BS, sp, stop_sequences(model, rid), id=rid) for rid, p, sp in reqs]
    model = model_for(k, reqs)
    runner = FakeRunner(model, k, {rid: p for rid, p, _ in reqs}, BS, deferred,
                        ScheduledBatchOutput)
    sched.extend(seqs)
    expected = {s.id: expected_output(model, s.id, req_info(
        s.token_ids[: s.num_prompt_tokens], core_params(s, s.stop_token_sequences)),
        sched.config) for s in seqs}
    preempted = []

    def preempt_one(step, batch):
        running = [s for s in seqs if s.status == SequenceStatus.RUNNING]
        if step % 3 or not running:
            return
        victim = running[step % len(running)]
        sched.preempt(victim)
        assert victim.status == SequenceStatus.WAITING and victim.block_table == []
        assert victim.num_cached_tokens == 0 and victim.num_rejected == 0
        tokens = expected[victim.id][0]
        assert victim.completion_token_ids == tokens[: len(victim.completion_token_ids)]
        assert sched._core.waiting_ids()[0] == victim.id, "a preempted sequence resumes first"
        sched._core.check_invariants()
        preempted.append(victim.id)

    res = engine_loop(sched, runner, on_forward=preempt_one)
    assert len(preempted) >= 3
    if deferred:  # a victim alone in flight: nothing runs until a dummy forward brings its token
        assert runner.dummies > 0
    assert sched._core.stats()["num_preemptions"] == len(preempted), "no pressure preemption"
    for seq in seqs:
        tokens, reason = expected[seq.id]
        assert seq.completion_token_ids == tokens and seq.leave_reason == reason, seq.id
        assert sum((o.output_tokens for o in res["streamed"][seq.id]), []) == tokens
    assert sched.is_finished()
    sched._core.check_invariants()


def test_preempt_refuses_a_sequence_that_is_not_running_and_changes_nothing():
    sched = Scheduler(config())
    queued = Sequence(list(range(40, 50)), BS, AtomSamplingParams(max_tokens=3), id=1)
    stranger = Sequence(list(range(40, 50)), BS, AtomSamplingParams(max_tokens=3), id=2)
    sched.add(queued)
    with pytest.raises(ValueError, match="sequence 1 is not running"):
        sched.preempt(queued)  # waiting
    with pytest.raises(ValueError, match="sequence 2 is not queued"):
        sched.preempt(stranger)
    batch, _ = sched.schedule()
    assert batch.req_ids == [1] and queued.status == SequenceStatus.RUNNING
    twin = Sequence(list(range(40, 50)), BS, AtomSamplingParams(max_tokens=3), id=1)
    with pytest.raises(ValueError, match="sequence 1 is not queued"):
        sched.preempt(twin)  # another object with a live id
    with pytest.raises(ValueError, match="is not queued"):
        sched.preempt(object())
    assert queued.status == SequenceStatus.RUNNING and len(queued.block_table) == 3
    assert sched.get_request_counts() == (1, 0)
    assert sched._core.stats()["num_preemptions"] == 0
    sched._core.check_invariants()


def test_kv_events_through_atoms_config_and_calls():
    """Spec 5.5's publish_kv_events()/shutdown_kv_events() with ATOM's kv_events_config: the
    engine publishes after each step; ATOM's wildcard endpoints bind loopback; a router replaying
    the numbered batches ends with the scheduler's cached set."""
    from test_kv_events import free_port_run, replay_dealer

    port = free_port_run(2)
    events = SimpleNamespace(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                             replay_endpoint=f"tcp://*:{port + 1}", topic="kv")
    sched = Scheduler(config(kv_events_config=events))
    assert sched._publisher.endpoint == f"tcp://127.0.0.1:{port}"
    reqs = stream(seed=5, n=10)
    model = model_for(0, reqs)
    runner = FakeRunner(model, 0, {rid: p for rid, p, _ in reqs}, BS, False,
                        ScheduledBatchOutput)
    sched.extend(Sequence(p, BS, sp, id=rid) for rid, p, sp in reqs)
    while not sched.is_finished():
        batch, seqs = sched.schedule()
        if batch.req_ids:
            sched.postprocess(seqs.values(), runner.forward(batch), None)
        sched.publish_kv_events()
    try:
        deadline = time.time() + 5
        stats = sched._publisher.stats
        while stats()["sent"] < stats()["next_seq"] and time.time() < deadline:
            time.sleep(0.01)
        batches = replay_dealer(f"tcp://127.0.0.1:{port + 1}", 0)
    finally:
        sched.shutdown_kv_events()
    sched.shutdown_kv_events()  # twice: ATOM swallows shutdown errors
    index: set[int] = set()
    for _, payload in batches:
        for e in msgpack.unpackb(payload)[1]:
            kind, hashes = e["type"], e.get("block_hashes", [])
            if kind == "BlockStored":
                index |= set(hashes)
            elif kind == "BlockRemoved":
                index -= set(hashes)
    assert index and index == set(sched._core.cached_block_hashes())


@pytest.mark.parametrize("k,deferred", [(0, False), (2, True)])
def test_logprobs_land_in_the_sequence_one_per_output_token(k, deferred):
    """ATOM's runner returns one logprob per sequence per step (``{id: float}``, its last
    token's); a sequence that asked for them (``return_logprobs``) has, at its finish, one per
    output token: the step's value on its last token, NaN on the step's other tokens (accepted
    drafts), and NaN throughout a step a stop cut short (its last token was dropped)."""
    reqs = stream(seed=8, n=6)
    model = model_for(k, reqs)
    sched = Scheduler(config(k, num_kvcache_blocks=200, max_num_batched_tokens=256))  # every
    # row emits (no chunks, no preemption): one runner row per streamed step
    runner = FakeRunner(model, k, {rid: p for rid, p, _ in reqs}, BS, deferred,
                        ScheduledBatchOutput)
    forward = runner.forward
    rows: dict[int, list[tuple]] = {}  # what the runner returned for each sequence, in order

    def with_logprobs(batch):
        out = forward(batch)
        out.logprobs = {rid: -float(toks[-1]) for rid, toks in zip(out.req_ids, out.token_ids,
                                                                  strict=True)}
        for rid, toks in zip(out.req_ids, out.token_ids, strict=True):
            rows.setdefault(rid, []).append(tuple(toks))
        return out

    runner.forward = with_logprobs
    seqs = []
    for rid, p, sp in reqs:
        sp.logprobs = rid % 2 == 1
        seqs.append(Sequence(p, BS, sp, id=rid))
    sched.extend(seqs)
    res = engine_loop(sched, runner)
    for seq in seqs:
        if not seq.return_logprobs:
            assert seq.logprobs == []
            continue
        assert len(seq.logprobs) == len(seq.completion_token_ids) > 0
        want = []
        # One runner row per streamed step (a deferred runner may run one more, dropped).
        for o, toks in zip(res["streamed"][seq.id], rows[seq.id], strict=False):
            kept = o.output_tokens
            whole = tuple(kept) == toks
            want += [math.nan] * (len(kept) - whole) + [-float(toks[-1])] * whole
        assert np.array_equal(seq.logprobs, want, equal_nan=True)
        assert any(not math.isnan(x) for x in seq.logprobs)


def test_streamed_outputs_are_atoms_request_outputs_and_pickle():
    """The stream's RequestOutputs are built in C for a whole step: real instances of the
    NamedTuple, equal to ones built in Python, picklable for the engine's output socket."""
    sched, seqs, runner, res, _ = run_compat(0, True, stream(seed=3, n=5), config())
    outs = [o for v in res["streamed"].values() for o in v]
    assert outs and all(type(o) is RequestOutput for o in outs)
    assert pickle.loads(pickle.dumps(outs)) == outs
    last = res["streamed"][seqs[0].id][-1]
    assert last == RequestOutput(*last) and last.finished and last.finish_reason
    assert last.output_tokens == [seqs[0].completion_token_ids[-1]]


def test_stream_items_refuse_a_type_they_cannot_fill():
    core = NativeScheduler(SchedulerConfig(num_blocks=8, block_size=4))
    core.add_request(1, [1, 2, 3])
    out = core.update(core.schedule(), np.array([5], np.int32))

    class WithDict(tuple):
        pass

    for bad in (int, WithDict, list, "RequestOutput"):
        with pytest.raises(TypeError):
            out._atom_stream_items(bad)
    assert out._atom_stream_items(RequestOutput) == [
        (1, RequestOutput(1, [5], False, None, None, 0))]


def test_hostile_runner_outputs_are_refused_and_change_nothing():
    """Outputs a broken runner could send (K=2): drafts of the wrong shape, negative or huge
    tokens, a token row wider than the row; each is a ValueError, and the right outputs still
    apply afterwards."""
    sched = Scheduler(config(2))
    sched.add(Sequence(list(range(40, 46)), BS, AtomSamplingParams(max_tokens=5), id=1))
    batch, seqs = sched.schedule()

    def out(tokens, drafts):
        return ScheduledBatchOutput([1], tokens, None, None, drafts)

    ok = np.zeros((1, 2), np.int32)
    bad = [out([(5,)], np.zeros((1, 3), np.int32)), out([(-5,)], ok), out([(2**40,)], ok),
           out([(5, 6)], ok), out([(5,)], np.full((1, 2), -7, np.int32)), out([()], ok),
           out([(5.0,)], ok), out([(None,)], ok), out([5], ok), out(["ab"], ok), out(None, ok),
           out([(2**70,)], ok), out([(5,)], np.array([[2**32 + 5, 1]])),  # no wrap to 5
           out([(5,)], np.array([[2.7, 1.0]])), out([(5,)], [[2**70, 1]])]
    for o in bad:
        with pytest.raises(ValueError):
            sched.postprocess(seqs.values(), o, None)
        sched._core.check_invariants()
    q: queue.Queue = queue.Queue()
    sched.postprocess(seqs.values(), out([(5,)], np.array([[6, 7]], np.int32)), q)
    assert [(sid, o.output_tokens) for sid, o in q.get_nowait()] == [(1, [5])]


def test_running_and_waiting_are_atoms_queues_read_only():
    """ATOM's own tests read ``Scheduler.running`` (``postprocess(list(sched.running), out)``)
    and an engine may read ``waiting``: both hold the engine's Sequence objects, running in
    admission order, waiting first in, first out, a sequence the engine preempts at its head.
    They are snapshots the core's queues are read into when the attribute is read; a deque's
    mutators are refused (the core owns the queues)."""
    sched = Scheduler(config(enable_chunked_prefill=False, max_num_batched_tokens=12))
    seqs = [Sequence(list(range(100 * i, 100 * i + 6)), BS,
                     AtomSamplingParams(max_tokens=20, temperature=0.0), id=i) for i in (1, 2, 3)]
    s1, s2, s3 = seqs
    runner = FakeRunner(FakeModel(0), 0, {s.id: s.token_ids[:] for s in seqs}, BS, False,
                        ScheduledBatchOutput)
    assert len(sched.running) == 0 and len(sched.waiting) == 0 and not sched.running
    sched.extend(seqs)
    assert list(sched.waiting) == seqs and all(a is b for a, b in zip(sched.waiting, seqs,
                                                                     strict=True))
    batch, _ = sched.schedule()  # 6 + 6 tokens fill the budget: s3 waits
    assert batch.req_ids == [1, 2]
    assert list(sched.running) == [s1, s2] and list(sched.waiting) == [s3]
    assert sched.running[0] is s1 and sched.running[-1] is s2 and s3 in sched.waiting
    assert s3 not in sched.running and (len(sched.running), len(sched.waiting)) == (
        sched.get_request_counts())
    # ATOM's tests hand postprocess the running sequences.
    assert sched.postprocess(list(sched.running), runner.forward(batch)) == []
    batch, _ = sched.schedule()
    assert batch.req_ids == [3] and list(sched.running) == [s1, s2, s3] and not sched.waiting
    sched.postprocess(list(sched.running), runner.forward(batch))
    batch, _ = sched.schedule()  # a decode step: its rows are the running set, in order
    assert batch.req_ids == [s.id for s in sched.running] == [1, 2, 3]
    sched.postprocess(list(sched.running), runner.forward(batch))
    sched.preempt(s2)
    assert list(sched.running) == [s1, s3] and list(sched.waiting) == [s2]
    assert s2.status == SequenceStatus.WAITING and s2 in sched.waiting
    late = Sequence(list(range(900, 905)), BS, AtomSamplingParams(max_tokens=2), id=4)
    runner.prompts[4] = late.token_ids[:]
    sched.add(late)
    assert list(sched.waiting) == [s2, late]  # the preempted sequence first, then FIFO
    snapshot = sched.running
    for mutate in (lambda q: q.append(s2), lambda q: q.appendleft(s2), lambda q: q.popleft(),
                   lambda q: q.pop(), lambda q: q.remove(s1), lambda q: q.clear(),
                   lambda q: q.extend([s2]), lambda q: q.rotate(1)):
        with pytest.raises(TypeError, match="read-only"):
            mutate(snapshot)
    with pytest.raises(AttributeError):
        sched.running = deque([s2])  # type: ignore[misc]
    with pytest.raises(AttributeError):
        sched.waiting = deque()  # type: ignore[misc]
    assert list(sched.running) == [s1, s3] and list(sched.waiting) == [s2, late]
    engine_loop(sched, runner)
    assert not sched.running and not sched.waiting
    assert all(s.status == SequenceStatus.FINISHED for s in [*seqs, late])


@pytest.mark.parametrize("k,deferred", [(0, False), (2, True)])
def test_running_and_waiting_follow_atoms_preemption_order(k, deferred):
    """Under KV pressure the core preempts from the tail of ``running`` and each victim goes to
    the head of ``waiting``: after a step with p preemptions, waiting starts with the last p
    sequences that were running, in their running order (ATOM's pop() + appendleft())."""
    reqs = [(rid, list(range(100 * rid, 100 * rid + 14)),
             AtomSamplingParams(max_tokens=30, temperature=0.0)) for rid in (1, 2, 3, 5)]
    model = model_for(k, reqs)
    sched = Scheduler(config(k, num_kvcache_blocks=16, max_num_seqs=4))
    seqs = {rid: Sequence(p, BS, sp, id=rid) for rid, p, sp in reqs}
    sched.extend(seqs.values())
    runner = FakeRunner(model, k, {rid: p for rid, p, _ in reqs}, BS, deferred,
                        ScheduledBatchOutput)
    checked = 0
    for _ in range(2000):
        if sched.is_finished():
            break
        before, preemptions = list(sched.running), sched._core.stats()["num_preemptions"]
        batch, smap = sched.schedule()
        running, waiting = list(sched.running), list(sched.waiting)
        assert (len(running), len(waiting)) == sched.get_request_counts()
        assert all(s.status == SequenceStatus.RUNNING for s in running)
        assert all(s.status == SequenceStatus.WAITING for s in waiting)
        p = sched._core.stats()["num_preemptions"] - preemptions
        if p:
            assert waiting[:p] == before[-p:] and running == before[:-p]
            checked += 1
        if batch.req_ids:
            sched.postprocess(smap.values(), runner.forward(batch), None)
    assert sched.is_finished() and checked > 0
    for rid, seq in seqs.items():
        assert seq.completion_token_ids == [model.token(rid, g) for g in range(30)]


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("opt_in", [False, True])
def test_a_second_chat_turn_hits_the_prompt_blocks_as_atom(deferred, opt_in):
    """ATOM hashes prompt blocks only (spec 2.6: decode-generated blocks are never hashed), so a
    follow-up turn resending the conversation hits the previous prompt's full blocks. The drop-in
    does the same unless the config opts in to ``cache_decode_blocks``, which also hits the
    blocks the previous turn filled while decoding (docs/atom.md)."""
    prompt1 = list(range(100, 110))  # 10 tokens: 2 full blocks of 4
    cfg = config(num_kvcache_blocks=40)
    if opt_in:
        cfg.cache_decode_blocks = True  # type: ignore[attr-defined]
    sched = Scheduler(cfg)
    model = FakeModel(0)
    turn1 = Sequence(prompt1, BS, AtomSamplingParams(max_tokens=9, ignore_eos=True), id=1)
    runner = FakeRunner(model, 0, {1: prompt1}, BS, deferred, ScheduledBatchOutput)
    sched.add(turn1)
    engine_loop(sched, runner)
    assert turn1.leave_reason == "max_tokens" and turn1.num_tokens == 19
    prompt2 = turn1.token_ids[:19] + list(range(500, 505))  # 24 tokens: 6 blocks
    turn2 = Sequence(prompt2, BS, AtomSamplingParams(max_tokens=2, ignore_eos=True), id=2)
    runner.prompts[2] = prompt2  # the same runner and KV cache: it checks every position read
    rows = runner.rows_checked
    sched.add(turn2)
    res = engine_loop(sched, runner)
    # ATOM: floor(10 / 4) = 2 prompt blocks. Decode blocks: the 18 tokens whose KV turn 1
    # computed fill 4 blocks.
    hit = 16 if opt_in else (len(prompt1) // BS) * BS
    assert turn2.prefix_cache_hit_tokens == hit
    assert res["streamed"][2][0].num_cached_tokens == hit
    assert sched.cache_stats.total_cached_tokens == hit
    assert turn2.leave_reason == "max_tokens" and runner.rows_checked > rows
    assert sched.config.cache_decode_blocks is opt_in


def test_publish_kv_events_raises_an_encode_error_and_counts_it():
    """ATOM's publisher counts an encode error (``encode_errors``), logs the first and goes on;
    ours counts it too but raises, from ``publish()`` and so from ``publish_kv_events()``
    (docs/atom.md): what was not published takes no sequence number, and the next step is
    published as usual."""
    from test_kv_events import free_port_run

    port = free_port_run(1)
    events = SimpleNamespace(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
    sched = Scheduler(config(kv_events_config=events))
    try:
        core = sched._core
        bad = SimpleNamespace(kind="BlockRemoved", block_hashes=[2**64], medium="GPU")
        sched._core = SimpleNamespace(take_events=lambda: [bad])  # a hash msgpack cannot encode
        with pytest.raises((OverflowError, ValueError)):
            sched.publish_kv_events()
        sched._core = core
        stats = sched._publisher.stats()
        assert stats["encode_errors"] == 1 and stats["next_seq"] == 0
        with pytest.raises(ValueError, match="unknown KV event kind"):
            sched._publisher.publish([SimpleNamespace(kind="Bogus")])
        assert sched._publisher.stats()["encode_errors"] == 2
        sched.add(Sequence(list(range(40, 49)), BS, AtomSamplingParams(max_tokens=2), id=1))
        runner = FakeRunner(FakeModel(0), 0, {1: list(range(40, 49))}, BS, False,
                            ScheduledBatchOutput)
        batch, seqs = sched.schedule()
        sched.postprocess(seqs.values(), runner.forward(batch), None)
        sched.publish_kv_events()  # the prompt's two blocks: numbered 0, no gap
        assert sched._publisher.stats()["next_seq"] == 1
    finally:
        sched.shutdown_kv_events()
