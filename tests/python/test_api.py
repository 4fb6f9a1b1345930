"""The Python API of docs/api.md: construction, defaults, attributes, arrays, outputs, queries."""

from __future__ import annotations

import numpy as np
import pytest
from support import (
    EOS,
    BatchRecord,
    FakeModel,
    cdiv,
    drive,
    event_kind,
    make_config,
    make_driver,
    prompt,
    sp,
)

import atom_sched
from atom_sched import SamplingParams, Scheduler, SchedulerConfig  # noqa: E402

STATS_KEYS = {
    "num_steps",
    "num_preemptions",
    "num_prefix_queries",
    "prefix_query_tokens",
    "prefix_hit_tokens",
    "prefix_hit_rate",
    "num_spec_steps",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
    "acceptance_rate",
    "acceptance_counts",
    "num_finished",
    "num_aborted",
    "num_rejected",
}


# ---------------------------------------------------------------------------------------------
# Configuration and sampling parameters
# ---------------------------------------------------------------------------------------------


def test_public_names() -> None:
    for name in ("Scheduler", "SchedulerConfig", "SamplingParams", "block_hash"):
        assert hasattr(atom_sched, name), name


def test_scheduler_config_defaults() -> None:
    c = SchedulerConfig(num_blocks=8)
    assert c.num_blocks == 8
    assert c.block_size == 16
    assert c.max_num_seqs == 256
    assert c.max_num_batched_tokens == 8192
    assert c.max_model_len == 8192
    assert c.enable_prefix_caching is True
    assert c.enable_chunked_prefill is True
    assert c.num_speculative_tokens == 0
    assert c.eos_token_id == -1
    assert list(c.stop_token_ids) == []
    assert c.scheduler_delay_factor == 0.0
    assert c.enable_kv_events is False
    assert c.num_state_slots == 0


def test_scheduler_config_positional_num_blocks() -> None:
    assert SchedulerConfig(5).num_blocks == 5


def test_scheduler_config_keywords_and_writable_attributes() -> None:
    c = SchedulerConfig(
        num_blocks=10,
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=32,
        max_model_len=40,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        num_speculative_tokens=2,
        eos_token_id=7,
        stop_token_ids=[3, 4],
        scheduler_delay_factor=0.5,
        enable_kv_events=True,
        num_state_slots=2,
    )
    assert (c.num_blocks, c.block_size, c.max_num_seqs) == (10, 4, 3)
    assert (c.max_num_batched_tokens, c.max_model_len) == (32, 40)
    assert c.enable_prefix_caching is False and c.enable_chunked_prefill is False
    assert c.num_speculative_tokens == 2 and c.eos_token_id == 7
    assert list(c.stop_token_ids) == [3, 4]
    assert c.scheduler_delay_factor == 0.5
    assert c.enable_kv_events is True and c.num_state_slots == 2
    c.block_size = 8
    c.max_num_seqs = 5
    c.stop_token_ids = [9]
    c.enable_prefix_caching = True
    c.scheduler_delay_factor = 1.25
    assert c.block_size == 8 and c.max_num_seqs == 5
    assert list(c.stop_token_ids) == [9]
    assert c.enable_prefix_caching is True and c.scheduler_delay_factor == 1.25
    Scheduler(c)  # still valid


def test_sampling_params_defaults() -> None:
    p = SamplingParams()
    assert p.temperature == 1.0
    assert p.top_k == -1
    assert p.top_p == 1.0
    assert p.max_tokens == 64
    assert p.ignore_eos is False
    assert p.n == 1
    assert p.logprobs is False
    assert list(p.stop_token_ids) == []
    assert [list(s) for s in p.stop_token_sequences] == []


def test_sampling_params_attributes() -> None:
    p = SamplingParams(
        temperature=0.0,
        top_k=5,
        top_p=0.5,
        max_tokens=3,
        ignore_eos=True,
        n=2,
        logprobs=True,
        stop_token_ids=[4],
        stop_token_sequences=[[1, 2], [3]],
    )
    assert p.temperature == 0.0 and p.top_k == 5 and p.top_p == 0.5
    assert p.max_tokens == 3 and p.ignore_eos is True and p.n == 2 and p.logprobs is True
    assert list(p.stop_token_ids) == [4]
    assert [list(s) for s in p.stop_token_sequences] == [[1, 2], [3]]
    p.max_tokens = 9
    p.top_k = -1
    assert p.max_tokens == 9 and p.top_k == -1


# ---------------------------------------------------------------------------------------------
# A whole run
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 2])
def test_full_run_to_completion(mode: str, k: int) -> None:
    d = make_driver(mode, num_blocks=64, block_size=4, num_speculative_tokens=k)
    d.add(0, prompt(5), sp(max_tokens=7))
    d.add(1, prompt(9, 300), sp(max_tokens=3))
    d.add(2, np.arange(20, 33, dtype=np.int32), sp(max_tokens=1))
    assert d.sched.num_waiting == 3 and d.sched.num_running == 0
    assert d.sched.has_unfinished_requests()
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    assert d.reasons == {0: "max_tokens", 1: "max_tokens", 2: "max_tokens"}
    assert [len(d.tokens[r]) for r in range(3)] == [7, 3, 1]
    st = d.sched.stats()
    assert st["num_finished"] == 3
    assert st["num_steps"] == len(d.batches)
    assert d.sched.schedule() is None


def test_prompt_as_numpy_int64_and_tuple() -> None:
    d = make_driver(num_blocks=16, block_size=4)
    d.add(0, np.array([5, 6, 7], dtype=np.int64), sp(max_tokens=2))
    d.add(1, (8, 9, 10), sp(max_tokens=2))
    d.run()
    d.check_against_oracle()


def test_schedule_with_nothing_returns_none() -> None:
    s = Scheduler(make_config(num_blocks=4))
    assert s.schedule() is None
    assert tuple(s.get_next_batch_info()) == (False, 0, 0)
    assert s.num_outstanding_batches == 0
    assert not s.has_unfinished_requests()


def test_request_ids_may_be_reused_after_finish() -> None:
    d = make_driver(num_blocks=16, block_size=4)
    d.add(0, prompt(3), sp(max_tokens=1))
    d.run()
    assert d.reasons[0] == "max_tokens"
    d.add(0, prompt(4, 500), sp(max_tokens=2))
    d.run()
    assert d.reasons[0] == "max_tokens" and len(d.tokens[0]) == 2


def test_request_id_zero_is_a_real_id() -> None:
    """ATOM replaced an explicit id 0 by a counter value (bug 8.25); here 0 is just an id."""
    d = make_driver(num_blocks=16, block_size=4)
    d.add(0, prompt(3), sp(max_tokens=2))
    rec = d.schedule()
    assert rec is not None and rec.req_ids == [0]
    d.update()
    d.run()
    assert d.reasons == {0: "max_tokens"}


# ---------------------------------------------------------------------------------------------
# Batch arrays
# ---------------------------------------------------------------------------------------------

ROW_DTYPES = {
    "req_ids": np.int64,
    "request_slots": np.int32,
    "num_scheduled_tokens": np.int32,
    "num_cached_tokens": np.int32,
    "context_lens": np.int32,
    "last_block_num_tokens": np.int32,
    "top_ks": np.int32,
    "state_slots": np.int32,
    "temperatures": np.float32,
    "top_ps": np.float32,
    "emits_token": np.bool_,
    "row_exact": np.bool_,
}
TOKEN_DTYPES = {"scheduled_tokens": np.int32, "positions": np.int64, "slot_mapping": np.int64}
ALL_ARRAYS = (
    list(ROW_DTYPES)
    + list(TOKEN_DTYPES)
    + ["block_tables", "spec_draft_tokens", "cu_seqlens_q", "cu_seqlens_k"]
)


def _two_row_batch(k: int = 0, is_prefill: bool = True):
    s = Scheduler(make_config(num_blocks=32, block_size=4, num_speculative_tokens=k))
    s.add_request(0, prompt(6), sp(temperature=0.5, top_k=3, top_p=0.75))
    s.add_request(1, prompt(3, 200), sp())
    b = s.schedule()
    assert b is not None and b.is_prefill
    if is_prefill:
        return s, b
    model = FakeModel(k)
    s.update(b, **model.run(BatchRecord.of(b)))
    b = s.schedule()
    assert b is not None and not b.is_prefill
    return s, b


@pytest.mark.parametrize("is_prefill", [True, False])
def test_batch_dtypes_and_shapes(is_prefill: bool) -> None:
    k = 2
    _, b = _two_row_batch(k, is_prefill)
    n = b.num_rows
    assert n == 2
    for name, dt in ROW_DTYPES.items():
        a = getattr(b, name)
        assert isinstance(a, np.ndarray), name
        assert a.dtype == dt, (name, a.dtype)
        assert a.shape == (n,), (name, a.shape)
    for name, dt in TOKEN_DTYPES.items():
        a = getattr(b, name)
        assert isinstance(a, np.ndarray) and a.dtype == dt and a.shape == (b.num_tokens,), name
    assert b.block_tables.dtype == np.int32
    assert b.block_tables.shape == (n, b.block_table_width)
    assert b.cu_seqlens_q.dtype == np.int32 and b.cu_seqlens_q.shape == (n + 1,)
    assert b.cu_seqlens_k.dtype == np.int32 and b.cu_seqlens_k.shape == (n + 1,)
    assert b.spec_draft_tokens.dtype == np.int32
    assert b.spec_draft_tokens.ndim == 2 and b.spec_draft_tokens.shape[0] == n
    if is_prefill:
        assert b.num_spec_tokens == 0
    else:
        assert b.num_spec_tokens == k
        assert b.spec_draft_tokens.shape == (n, k)
    assert b.total_tokens_num == b.num_tokens == int(b.num_scheduled_tokens.sum())
    assert b.max_seqlen_q == int(b.num_scheduled_tokens.max())
    assert b.max_seqlen_k == int(b.context_lens.max())
    assert isinstance(b.id, int) and isinstance(b.is_prefill, bool)


def test_batch_scalars_and_rows_of_a_prefill() -> None:
    _, b = _two_row_batch(0, True)
    assert list(b.req_ids) == [0, 1]
    assert list(b.num_scheduled_tokens) == [6, 3]
    assert list(b.num_cached_tokens) == [0, 0]
    assert list(b.context_lens) == [6, 3]
    assert list(b.cu_seqlens_q) == [0, 6, 9]
    assert list(b.cu_seqlens_k) == [0, 6, 9]
    assert list(b.positions) == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert list(b.scheduled_tokens) == prompt(6) + prompt(3, 200)
    assert list(b.last_block_num_tokens) == [2, 3]
    assert list(b.emits_token) == [True, True]
    assert list(b.row_exact) == [True, True]
    assert list(b.state_slots) == [-1, -1]
    assert list(b.top_ks) == [3, -1]
    assert np.allclose(b.temperatures, [0.5, 1.0]) and np.allclose(b.top_ps, [0.75, 1.0])
    assert b.block_table_width >= cdiv(8192, 4)
    bt = b.block_tables
    assert len({int(bt[0, 0]), int(bt[0, 1]), int(bt[1, 0])}) == 3
    sm = [int(x) for x in b.slot_mapping]
    assert sm[:4] == [int(bt[0, 0]) * 4 + j for j in range(4)]
    assert sm[4:6] == [int(bt[0, 1]) * 4 + j for j in range(2)]
    assert sm[6:] == [int(bt[1, 0]) * 4 + j for j in range(3)]
    # Padding of the block table rows is 0.
    assert (bt[0, 2:] == 0).all() and (bt[1, 1:] == 0).all()
    assert b.num_rows == 2 and b.num_tokens == 9 and b.is_prefill is True


@pytest.mark.parametrize("name", ALL_ARRAYS)
def test_batch_arrays_are_read_only(name: str) -> None:
    _, b = _two_row_batch(2, False)
    a = getattr(b, name)
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a.flat[0] = a.flat[0]
    with pytest.raises(ValueError):
        a[...] = 0


@pytest.mark.parametrize("name", ALL_ARRAYS)
def test_batch_arrays_are_views_without_copies(name: str) -> None:
    _, b = _two_row_batch(2, False)
    a1 = getattr(b, name)
    a2 = getattr(b, name)
    assert a1.base is not None, f"{name} owns its data: a copy"
    if a1.size:
        assert np.shares_memory(a1, a2), f"two accesses of {name} do not share memory"
        assert a1.__array_interface__["data"][0] == a2.__array_interface__["data"][0]


def test_batch_view_keeps_data_alive_after_scheduler_is_dropped() -> None:
    s, b = _two_row_batch(0, True)
    pos = b.positions
    del s, b
    import gc

    gc.collect()
    assert list(pos) == [0, 1, 2, 3, 4, 5, 0, 1, 2]


def test_batch_ids_increase() -> None:
    d = make_driver(num_blocks=16, block_size=4)
    d.add(0, prompt(3), sp(max_tokens=4))
    d.run()
    ids = [r.id for r in d.batches]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_decode_batch_rows_sync() -> None:
    d = make_driver(num_blocks=16, block_size=4, num_speculative_tokens=2)
    d.add(0, prompt(5), sp(max_tokens=20))
    d.schedule()
    d.update()
    drafts = list(d.model.last_drafts[0])  # given with the prefill's output
    rec = d.schedule()
    assert rec is not None and not rec.is_prefill
    # Row = [last real token, 2 drafts]; KV positions 5..7 computed this step.
    assert rec.num_scheduled_tokens == [3]
    assert rec.num_cached_tokens == [5]
    assert rec.context_lens == [8]
    assert rec.row_positions(0) == [5, 6, 7]
    assert rec.row_tokens(0) == [d.tokens[0][0]] + drafts
    assert list(rec.spec_draft_tokens[0]) == drafts
    d.update()


def test_async_k0_positions_exact_and_in_flight_token_unknown() -> None:
    d = make_driver("async", num_blocks=16, block_size=4)
    d.add(0, prompt(5), sp(max_tokens=20))
    b1 = d.schedule()  # prefill, in flight
    b2 = d.schedule()  # decode of the token b1 produces
    assert b1 is not None and b1.is_prefill
    assert b2 is not None and not b2.is_prefill
    assert b2.row_positions(0) == [5]
    assert b2.row_tokens(0) == [-1]
    assert b2.context_lens == [6]
    assert d.sched.num_outstanding_batches == 2
    d.update()
    d.update()
    d.run()
    d.check_against_oracle()


def test_async_with_drafts_upper_bounds() -> None:
    """One step ahead with K > 0: the host knows only upper bounds for rows in flight."""
    k = 3
    d = make_driver("async", num_blocks=32, block_size=4, num_speculative_tokens=k)
    d.model.accept = 1
    d.add(0, prompt(5), sp(max_tokens=40))
    d.schedule()  # prefill
    d.schedule()  # decode 1 (input in flight)
    d.update()  # prefill output
    rec = d.schedule()  # decode 2 while decode 1 is in flight
    assert rec is not None and not rec.is_prefill
    # True context after decode 1 with a = 1: computed positions 0..5, so decode 2 computes
    # from position 6. The host only knows an upper bound.
    true_context = 5 + 1 + (k + 1)
    assert rec.context_lens[0] >= true_context
    d.update()
    d.update()
    d.run()
    d.check_against_oracle()


def test_sampled_tokens_as_column_when_k0() -> None:
    d = make_driver(num_blocks=16, block_size=4, model=FakeModel(0, two_d=True))
    d.add(0, prompt(5), sp(max_tokens=4))
    d.run()
    d.check_against_oracle()


def test_sampled_tokens_int64_accepted() -> None:
    s = Scheduler(make_config(num_blocks=16, block_size=4))
    s.add_request(0, prompt(3), sp(max_tokens=2))
    b = s.schedule()
    out = s.update(b, np.array([42], dtype=np.int64))
    assert [o.output_tokens for o in out] == [[42]]


@pytest.mark.parametrize("dtype", [">i4", "<i4", ">i8", "uint16"])
@pytest.mark.parametrize("rows", [3, 100])  # within update()'s inline copy, and past it
def test_sampled_tokens_of_any_byte_order_and_width_keep_their_values(dtype: str,
                                                                      rows: int) -> None:
    s = Scheduler(make_config(num_blocks=4 * rows, block_size=4, max_num_seqs=rows))
    for i in range(rows):
        s.add_request(i, prompt(3), sp(max_tokens=2))
    b = s.schedule()
    assert b.num_rows == rows
    tokens = np.arange(1000, 1000 + rows).astype(dtype)
    out = s.update(b, tokens)
    assert {o.request_id: o.output_tokens for o in out} == {i: [1000 + i] for i in range(rows)}


def test_prefill_num_accepted_all_ones_is_allowed() -> None:
    k = 2
    s = Scheduler(make_config(num_blocks=16, block_size=4, num_speculative_tokens=k))
    s.add_request(0, prompt(3), sp(max_tokens=5))
    b = s.schedule()
    out = s.update(
        b,
        np.array([[42, -1, -1]], dtype=np.int32),
        num_accepted=np.array([1], dtype=np.int32),
        draft_token_ids=np.array([[50, 51]], dtype=np.int32),
    )
    assert [o.output_tokens for o in out] == [[42]]
    b = s.schedule()
    assert list(b.scheduled_tokens) == [42, 50, 51]


def test_rejected_positions_may_hold_minus_one() -> None:
    """ATOM's rejection sampler writes -1 after the first rejection: only accepted tokens count."""
    k = 3
    s = Scheduler(make_config(num_blocks=16, block_size=4, num_speculative_tokens=k))
    s.add_request(0, prompt(3), sp(max_tokens=10))
    b = s.schedule()
    s.update(b, np.array([[42, -1, -1, -1]], np.int32),
             draft_token_ids=np.full((1, 3), 7, np.int32))
    b = s.schedule()
    out = s.update(
        b,
        np.array([[43, 44, -1, -1]], np.int32),
        num_accepted=np.array([2], np.int32),
        draft_token_ids=np.full((1, 3), 8, np.int32),
    )
    assert [o.output_tokens for o in out] == [[43, 44]]
    s.check_invariants()


def test_non_emitting_prefill_rows_are_ignored() -> None:
    s = Scheduler(make_config(num_blocks=16, block_size=4, max_num_batched_tokens=4))
    s.add_request(0, prompt(10), sp(max_tokens=2))
    b = s.schedule()
    assert list(b.emits_token) == [False]
    out = s.update(b, np.array([-1], dtype=np.int32))
    assert len(out) == 0
    s.check_invariants()


# ---------------------------------------------------------------------------------------------
# StepOutput / RequestOutput
# ---------------------------------------------------------------------------------------------


def test_step_output_fields() -> None:
    s = Scheduler(make_config(num_blocks=16, block_size=4, eos_token_id=EOS))
    s.add_request(3, prompt(3), sp(max_tokens=5))
    s.add_request(7, prompt(2, 50), sp(max_tokens=1))
    b = s.schedule()
    out = s.update(b, np.array([11, 12], dtype=np.int32))
    assert len(out) == 2
    assert out.request_ids.dtype == np.int64 and list(out.request_ids) == [3, 7]
    assert out.token_offsets.dtype == np.int32 and list(out.token_offsets) == [0, 1, 2]
    assert out.new_tokens.dtype == np.int32 and list(out.new_tokens) == [11, 12]
    assert out.finished.dtype == np.bool_ and list(out.finished) == [False, True]
    outs = out.outputs()
    assert isinstance(outs, list) and len(outs) == 2
    assert [o.request_id for o in out] == [3, 7]
    o3, o7 = outs
    assert o3.request_id == 3 and list(o3.output_tokens) == [11]
    assert o3.finished is False and o3.finish_reason is None
    assert o3.num_cached_tokens == 0 and o3.logprobs is None
    assert o7.finished is True and o7.finish_reason == "max_tokens"
    assert list(o7.output_tokens) == [12]
    b = s.schedule()
    out = s.update(b, np.array([EOS], dtype=np.int32))
    (o,) = out.outputs()
    assert o.request_id == 3 and list(o.output_tokens) == [EOS]
    assert o.finished and o.finish_reason == "eos"
    assert not s.has_unfinished_requests()


def test_step_output_omits_requests_without_news() -> None:
    s = Scheduler(make_config(num_blocks=16, block_size=4, max_num_batched_tokens=6))
    s.add_request(0, prompt(3), sp(max_tokens=5))
    s.add_request(1, prompt(8, 30), sp(max_tokens=5))
    b = s.schedule()  # 0: 3 tokens, 1: chunk of 3 (does not emit)
    assert list(b.emits_token) == [True, False]
    out = s.update(b, np.array([11, 12], dtype=np.int32))
    assert [o.request_id for o in out] == [0]


def test_logprobs_streamed_only_when_asked() -> None:
    s = Scheduler(make_config(num_blocks=16, block_size=4))
    s.add_request(0, prompt(3), sp(max_tokens=5, logprobs=True))
    s.add_request(1, prompt(3, 30), sp(max_tokens=5))
    b = s.schedule()
    out = s.update(b, np.array([11, 12], np.int32), logprobs=np.array([-0.5, -0.25], np.float32))
    o0, o1 = out.outputs()
    assert o0.logprobs is not None and list(o0.logprobs) == [-0.5]
    assert o1.logprobs is None


# ---------------------------------------------------------------------------------------------
# Events, stats, queries
# ---------------------------------------------------------------------------------------------


def test_take_events_disabled_is_empty() -> None:
    d = make_driver(num_blocks=8, block_size=4)
    d.add(0, prompt(9), sp(max_tokens=2))
    d.run()
    assert list(d.sched.take_events()) == []


def test_take_events_kinds_and_fields() -> None:
    bs = 4
    d = make_driver(num_blocks=3 + 1, block_size=bs, enable_kv_events=True)
    p = prompt(9)
    d.add(0, p, sp(max_tokens=1))
    d.schedule()
    assert list(d.sched.take_events()) == [], "nothing is published at allocation"
    d.update()
    evs = list(d.sched.take_events())
    assert [event_kind(e) for e in evs] == ["BlockStored"]
    (ev,) = evs
    h0 = atom_sched.block_hash(p[:4])
    h1 = atom_sched.block_hash(p[4:8], h0)
    assert [int(h) for h in ev.block_hashes] == [h0, h1]
    assert ev.parent_block_hash is None
    assert [int(t) for t in ev.token_ids] == p[:8]
    assert ev.block_size == bs
    assert list(d.sched.take_events()) == [], "take_events drains"
    # A prompt needing all 3 blocks evicts both cached hashes when its blocks are handed out.
    d.add(1, prompt(12, 500), sp(max_tokens=1))
    d.schedule()
    evs = list(d.sched.take_events())
    assert [event_kind(e) for e in evs] and set(event_kind(e) for e in evs) == {"BlockRemoved"}
    removed = sorted(int(h) for e in evs for h in e.block_hashes)
    assert removed == sorted([h0, h1])
    d.update()
    d.sched.reset_prefix_cache()
    evs = list(d.sched.take_events())
    assert event_kind(evs[-1]) == "AllBlocksCleared"


def test_stats_keys_and_values() -> None:
    d = make_driver(num_blocks=32, block_size=4, num_speculative_tokens=1)
    d.model.accept = 2
    d.add(0, prompt(8), sp(max_tokens=5))
    d.add(1, prompt(8), sp(max_tokens=5))
    d.run()
    st = d.sched.stats()
    assert isinstance(st, dict)
    assert STATS_KEYS <= set(st), STATS_KEYS - set(st)
    assert st["num_steps"] == len(d.batches)
    assert st["num_finished"] == 2 and st["num_aborted"] == 0 and st["num_rejected"] == 0
    assert st["num_preemptions"] == 0
    assert st["num_prefix_queries"] == 2
    assert st["prefix_query_tokens"] == 16
    assert st["prefix_hit_tokens"] == 0  # same step: hashes are not published yet
    assert st["prefix_hit_rate"] == 0.0
    assert len(st["acceptance_counts"]) == 2
    assert st["acceptance_counts"][0] == 0
    assert st["acceptance_counts"][1] == st["num_spec_steps"] > 0
    assert st["num_draft_tokens"] == st["num_spec_steps"]
    assert st["num_accepted_draft_tokens"] == st["num_spec_steps"]
    assert st["acceptance_rate"] == pytest.approx(1.0)


def test_stats_counts_aborted_and_rejected() -> None:
    d = make_driver(num_blocks=8 + 1, block_size=4, max_model_len=16)
    d.add(0, prompt(4), sp(max_tokens=50))
    d.add(1, prompt(17), sp())
    d.schedule()
    d.update()
    d.abort(0)
    st = d.sched.stats()
    assert st["num_aborted"] == 1 and st["num_rejected"] == 1
    assert not d.sched.has_unfinished_requests()
    assert d.sched.num_free_blocks == 8


def test_abort_waiting_and_running_requests() -> None:
    d = make_driver(num_blocks=4 + 1, block_size=4)
    d.add(0, prompt(12), sp(max_tokens=5))
    d.add(1, prompt(8, 40), sp(max_tokens=5))  # blocked behind 0 (1 block left)
    d.schedule()
    assert d.sched.num_waiting == 1 and d.sched.num_running == 1
    d.abort(1)
    assert d.sched.num_waiting == 0
    d.update()
    d.abort(0)
    assert d.sched.num_running == 0 and d.sched.num_free_blocks == 4
    with pytest.raises(KeyError):
        d.sched.abort_request(0)
    assert d.sched.schedule() is None


def test_abort_with_batch_in_flight_discards_its_row() -> None:
    d = make_driver("async", num_blocks=16, block_size=4)
    d.add(0, prompt(4), sp(max_tokens=50))
    d.add(1, prompt(4, 40), sp(max_tokens=3))
    d.schedule()
    d.schedule()
    d.abort(0)
    d.run()
    assert d.reasons == {1: "max_tokens"}
    assert 0 not in d.reasons
    d.check_all_done()


def test_request_state_of_unknown_id_is_key_error() -> None:
    s = Scheduler(make_config(num_blocks=4))
    s.add_request(5, prompt(3))
    s.request_state(5)
    with pytest.raises(KeyError):
        s.request_state(6)


def test_num_free_blocks_tracks_allocation() -> None:
    # Block 0 is the null block: 10 ids, 9 blocks for requests (docs/design.md).
    s = Scheduler(make_config(num_blocks=10, block_size=4))
    assert (s.num_blocks, s.num_usable_blocks, s.num_free_blocks) == (10, 9, 9)
    s.add_request(0, prompt(9))
    b = s.schedule()
    assert s.num_free_blocks == 6
    assert atom_sched.NULL_BLOCK == 0
    assert list(b.block_tables[0, :3]) == [1, 2, 3] and not b.block_tables[0, 3:].any()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 1])
def test_get_next_batch_info_matches_schedule(mode: str, k: int) -> None:
    # The driver compares get_next_batch_info() with every schedule() call.
    d = make_driver(
        mode,
        num_blocks=12,
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=10,
        num_speculative_tokens=k,
        max_model_len=40,
    )
    base = prompt(8, 900)
    for r in range(6):
        d.add(r, base[: 4 + r % 3] + prompt(3 + r, 100 * r), sp(max_tokens=3 + 2 * r))
    d.add(6, prompt(41), sp())
    d.run()
    d.check_all_done()
    d.check_against_oracle()


def test_check_invariants_passes_on_fresh_scheduler() -> None:
    s = Scheduler(make_config(num_blocks=2))
    s.check_invariants()


def test_drive_helper_runs_requests() -> None:
    cfg = make_config(num_blocks=16, block_size=4)
    d = drive(
        Scheduler(cfg),
        FakeModel(0),
        "async",
        cfg=cfg,
        prompts={0: (prompt(5), sp(max_tokens=3)), 1: (prompt(2), sp(max_tokens=4))},
    )
    d.check_all_done()
    d.check_against_oracle()


def test_reused_id_does_not_receive_the_old_requests_in_flight_output() -> None:
    """One step ahead: request 0 finishes in batch 1 while batch 2 (holding it) is in flight; the
    id is reused at once. Batch 2's row belongs to the old request and must be discarded, not
    applied to the new one."""
    # EOS as the first token: nothing on the host predicts it, so batch 2 holds request 0 (a
    # request that reaches max_tokens by a token in flight gets no such row at all).
    d = make_driver("async", FakeModel(overrides={(0, 0): EOS}), num_blocks=16, block_size=4,
                    eos_token_id=EOS)
    d.add(0, prompt(4), sp(max_tokens=5))
    d.schedule()
    b2 = d.schedule()
    assert b2 is not None and b2.req_ids == [0]
    d.update()
    assert d.reasons == {0: "eos"}
    d.add(0, prompt(6, 300), sp(max_tokens=3, ignore_eos=True))  # same (rid, g): EOS first
    so = d.update()  # batch 2
    assert len(so) == 0
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    assert len(d.tokens[0]) == 3


def test_abort_and_reuse_id_with_batches_in_flight() -> None:
    d = make_driver("async", num_blocks=16, block_size=4)
    d.add(0, prompt(4), sp(max_tokens=10))
    d.schedule()
    d.schedule()
    d.abort(0)
    d.add(0, prompt(5, 200), sp(max_tokens=2))
    d.update()
    d.update()
    d.run()
    d.check_all_done()
    d.check_against_oracle()


def test_seed_travels_with_the_request_and_block_size_with_the_batch():
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    s.add_request(0, [1, 2, 3], SamplingParams(seed=7))
    s.add_request(1, [4, 5, 6])
    b = s.schedule()
    assert b.seeds.tolist() == [7, -1] and b.seeds.dtype == np.int64
    assert b.block_size == 4
    with pytest.raises(ValueError):
        SamplingParams(seed=-2)


def test_a_schedule_that_returns_none_keeps_the_previous_batch_readable():
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    s.add_request(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=2))
    b1 = s.schedule()
    s.update(b1, np.array([7], np.int32))
    b2 = s.schedule()
    s.update(b2, np.array([8], np.int32))  # request 0 finishes
    s.add_request(1, [9, 9, 9])
    assert s.schedule(allow_prefill=False) is None  # fills b1's buffer, finds no row
    assert (b1.num_rows, b1.is_prefill, b1.positions.tolist()) == (1, True, [0, 1, 2, 3, 4])


def test_num_lookahead_tokens_reserves_a_drafters_slots_and_is_validated():
    """A draft model writes KV past each row's tokens (vLLM's num_lookahead_tokens): the
    batch's block table already holds those slots' blocks."""
    cfg = SchedulerConfig(num_blocks=32, block_size=4, num_speculative_tokens=3,
                          num_lookahead_tokens=3, max_model_len=64)
    assert cfg.num_lookahead_tokens == 3
    s = Scheduler(cfg)
    s.add_request(0, list(range(10, 18)), SamplingParams(max_tokens=4))
    b = s.schedule()
    assert (b.block_tables[0] != 0).sum() == 3  # 8 tokens + 3 slots ahead: 11, three blocks
    for bad, words in [(dict(num_speculative_tokens=0, num_lookahead_tokens=1), "needs"),
                       (dict(num_speculative_tokens=2, num_lookahead_tokens=4), "0..num_spec"),
                       (dict(num_speculative_tokens=2, num_lookahead_tokens=-1), "0..num_spec")]:
        with pytest.raises(ValueError, match=f"num_lookahead_tokens.*{words}"):
            Scheduler(SchedulerConfig(num_blocks=32, **bad))


def test_draft_slots_per_row_take_budget_and_are_validated():
    """A drafter that reads a token more than each row schedules (vLLM's draft models): every
    row takes that much of max_num_batched_tokens too."""
    cfg = SchedulerConfig(num_blocks=64, block_size=4, num_speculative_tokens=2,
                          draft_slots_per_row=1, max_num_batched_tokens=16)
    s = Scheduler(cfg)
    s.add_request(0, list(range(10, 50)), SamplingParams(max_tokens=2))
    b = s.schedule()
    assert b.num_tokens == 15  # 16 less the row's input slot
    for bad, words in [(dict(num_speculative_tokens=0, draft_slots_per_row=1), "0..num_spec"),
                       (dict(num_speculative_tokens=2, max_num_batched_tokens=3,
                             draft_slots_per_row=1), "max_num_batched_tokens must be")]:
        with pytest.raises(ValueError, match=words):
            Scheduler(SchedulerConfig(num_blocks=32, **bad))


def test_recompute_last_hit_block_gives_back_a_prefix_hits_last_block():
    """An EAGLE-family drafter needs the target's hidden states just before the first computed
    token (vLLM's EAGLE block drop): a prefix hit gives its last block back, computed again."""
    prompt = list(range(10, 22)) + [7, 7, 7, 7]  # four blocks of 4: three can hit
    cached = {}
    for drop in (False, True):
        cfg = SchedulerConfig(num_blocks=32, block_size=4, recompute_last_hit_block=drop)
        assert cfg.recompute_last_hit_block is drop
        s = Scheduler(cfg)
        s.add_request(0, prompt[:12], SamplingParams(max_tokens=1))
        s.update(s.schedule(), np.array([5], np.int32))  # computed and cached, then finished
        s.add_request(1, prompt, SamplingParams(max_tokens=1))
        b = s.schedule()
        cached[drop] = (int(b.num_cached_tokens[0]), int(b.num_scheduled_tokens[0]))
    assert cached == {False: (12, 4), True: (8, 8)}
