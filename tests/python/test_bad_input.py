"""Bad input: every documented error gets its exception type and leaves the scheduler unchanged.

docs/api.md: "Every error leaves the scheduler unchanged." Each test here checks the documented
exception type, that the externally visible state (queues, free blocks, outstanding batches,
stats) is the same before and after the failed call, and, where the call happens in the middle of a
run, that the run then produces exactly the outputs of a run without the bad call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from support import (
    EOS,
    BatchRecord,
    Driver,
    make_config,
    make_driver,
    prompt,
    sp,
    state_snapshot,
)

from atom_sched import SamplingParams, Scheduler, SchedulerConfig  # noqa: E402

BASE_CFG: dict[str, Any] = dict(
    num_blocks=24,
    block_size=4,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    max_model_len=64,
    eos_token_id=EOS,
)
REQUESTS = [
    (0, prompt(6), dict(max_tokens=6)),
    (1, prompt(10, 200), dict(max_tokens=4)),
    (2, prompt(3, 400), dict(max_tokens=8, logprobs=True)),
]


def new_driver(mode: str = "sync", k: int = 0) -> Driver:
    d = make_driver(mode, num_speculative_tokens=k, **BASE_CFG)
    d.model.logprobs = True
    for rid, p, kw in REQUESTS:
        d.add(rid, p, sp(**kw))
    return d


_REFERENCE: dict[tuple[str, int], Driver] = {}


def reference(mode: str, k: int) -> Driver:
    if (mode, k) not in _REFERENCE:
        _REFERENCE[(mode, k)] = new_driver(mode, k).run()
    return _REFERENCE[(mode, k)]


def assert_same_run(d: Driver, ref: Driver) -> None:
    d.check_all_done()
    assert d.results() == ref.results()
    assert dict(d.logprobs) == dict(ref.logprobs)
    assert state_snapshot(d.sched) == state_snapshot(ref.sched)
    assert [r.summary() for r in d.batches] == [r.summary() for r in ref.batches]


def expect_unchanged(sched: Scheduler, exc: type[BaseException], fn: Callable[[], Any]) -> None:
    before = state_snapshot(sched)
    with pytest.raises(exc):
        fn()
    assert state_snapshot(sched) == before, "a failed call changed the scheduler"
    sched.check_invariants()


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=1), "num_blocks"),  # block 0 is the null block: no block for requests
    (dict(num_blocks=-3), "num_blocks"),
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(num_speculative_tokens=9), "num_speculative_tokens"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(num_speculative_tokens=3, max_num_batched_tokens=3), "max_num_batched_tokens"),
    (dict(scheduler_delay_factor=-0.5), "scheduler_delay_factor"),
    (dict(num_state_slots=-1), "num_state_slots"),
    (dict(eos_token_id=-2), "eos_token_id"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids"),
]


@pytest.mark.parametrize(("kw", "field"), BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_invalid_config_is_value_error_naming_the_field(kw: dict, field: str) -> None:
    full = dict(num_blocks=8)
    full.update(kw)
    with pytest.raises(ValueError, match=field):
        Scheduler(SchedulerConfig(**full))


def test_config_limits_that_are_valid() -> None:
    Scheduler(SchedulerConfig(num_blocks=2, block_size=1, max_num_seqs=1,
                              max_num_batched_tokens=9, max_model_len=1,
                              num_speculative_tokens=8))
    Scheduler(SchedulerConfig(num_blocks=2, num_speculative_tokens=3, max_num_batched_tokens=4))
    Scheduler(SchedulerConfig(num_blocks=2, eos_token_id=0, stop_token_ids=[0]))


def test_config_wrong_type_is_type_error() -> None:
    with pytest.raises(TypeError):
        SchedulerConfig(num_blocks="8")
    c = SchedulerConfig(num_blocks=8)
    with pytest.raises(TypeError):
        c.block_size = "16"
    with pytest.raises(TypeError):
        Scheduler("not a config")


@pytest.mark.parametrize("field", ["recompute_last_hit_block",
                                   "long_prefill_token_threshold_adaptive",
                                   "pad_first_decode_rows", "publish_prompt_blocks_at_schedule",
                                   "schedule_ahead"])
@pytest.mark.parametrize("bad", ["yes", [True], {"on": 1}])
def test_config_flag_refuses_what_is_not_a_flag(field: str, bad: Any) -> None:
    with pytest.raises(TypeError):
        SchedulerConfig(num_blocks=8, **{field: bad})
    c = SchedulerConfig(num_blocks=8, **{field: True})
    with pytest.raises(TypeError):
        setattr(c, field, bad)
    assert getattr(c, field) is True, "a refused value changed the field"


@pytest.mark.parametrize("bad, error, words", [
    (-1, ValueError, "prefill_lookahead_tokens"),
    (64, ValueError, "max_num_batched_tokens"),  # the whole budget: a step could leave none
    ("3", TypeError, None),
    (2**40, TypeError, None),
])
def test_prefill_lookahead_refuses_what_no_step_could_leave(bad: Any, error: type,
                                                          words: str | None) -> None:
    with pytest.raises(error, match=words):
        Scheduler(SchedulerConfig(num_blocks=8, max_num_batched_tokens=64,
                                  prefill_lookahead_tokens=bad))
    # Above a chunk's cap: a capped chunk could never leave that many.
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(SchedulerConfig(num_blocks=8, long_prefill_token_threshold=2,
                                  prefill_lookahead_tokens=3))
    Scheduler(SchedulerConfig(num_blocks=8, max_num_batched_tokens=64,
                              prefill_lookahead_tokens=63))


@pytest.mark.parametrize("config, words", [
    ({"num_speculative_tokens": 0, "policy": "mixed"}, "num_speculative_tokens > 0"),
    ({"num_speculative_tokens": 2, "policy": "atom"}, "policy=mixed"),
])
def test_first_decode_padding_needs_drafts_and_mixed_steps(config: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Scheduler(SchedulerConfig(num_blocks=8, pad_first_decode_rows=True, **config))
    Scheduler(SchedulerConfig(num_blocks=8, pad_first_decode_rows=True, num_speculative_tokens=2,
                              policy="mixed"))


# ---------------------------------------------------------------------------------------------
# Sampling parameters
# ---------------------------------------------------------------------------------------------

BAD_SAMPLING = [
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_sequences=[[]]), "stop_token_sequences"),
    (dict(stop_token_sequences=[[1, -2]]), "stop_token_sequences"),
]


@pytest.mark.parametrize(("kw", "field"), BAD_SAMPLING, ids=[str(k) for k, _ in BAD_SAMPLING])
def test_invalid_sampling_params(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_valid_limits() -> None:
    SamplingParams(top_p=1.0, top_k=1, temperature=0.0, max_tokens=1, n=2)
    SamplingParams(top_p=1e-6, top_k=-1)


# ---------------------------------------------------------------------------------------------
# add_request / abort_request
# ---------------------------------------------------------------------------------------------

BAD_PROMPTS = [
    ("empty list", [], ValueError),
    ("empty array", np.array([], dtype=np.int32), ValueError),
    ("float list", [1.5, 2.0], TypeError),
    ("float array", np.array([1.0, 2.0]), TypeError),
    ("str tokens", ["a", "b"], TypeError),
    ("str prompt", "abc", TypeError),
    ("None token", [1, None], TypeError),
    ("negative token", [3, -1], ValueError),
    ("negative token array", np.array([3, -1], dtype=np.int64), ValueError),
    ("token 2**31", [5, 2**31], ValueError),
    ("token 2**31 array", np.array([5, 2**31], dtype=np.int64), ValueError),
    # A 2-D array is neither "a sequence of ints" nor a 1-D integer array: docs/api.md does not
    # pin TypeError vs ValueError for it, so either is accepted.
    ("2-D array", np.array([[1, 2], [3, 4]], dtype=np.int32), (TypeError, ValueError)),
    ("2-D list", [[1, 2], [3, 4]], (TypeError, ValueError)),
]


@pytest.mark.parametrize(("what", "bad", "exc"), BAD_PROMPTS, ids=[w for w, _, _ in BAD_PROMPTS])
def test_bad_prompt(what: str, bad: Any, exc: Any) -> None:
    d = new_driver()
    d.schedule()
    d.update()
    expect_unchanged(d.sched, exc, lambda: d.sched.add_request(50, bad))
    with pytest.raises(KeyError):
        d.sched.request_state(50)
    d.run()
    assert_same_run(d, reference("sync", 0))


BAD_CALLS = [
    ("duplicate live id", lambda s: s.add_request(0, prompt(3)), ValueError),
    ("negative id", lambda s: s.add_request(-1, prompt(3)), ValueError),
    ("str id", lambda s: s.add_request("x", prompt(3)), TypeError),
    ("n > 1", lambda s: s.add_request(51, prompt(3), SamplingParams(n=2)), ValueError),
    ("params of the wrong type", lambda s: s.add_request(52, prompt(3), {"n": 1}), TypeError),
    ("abort unknown id", lambda s: s.abort_request(99), KeyError),
    ("abort negative id", lambda s: s.abort_request(-5), KeyError),
]


@pytest.mark.parametrize(("what", "call", "exc"), BAD_CALLS, ids=[w for w, _, _ in BAD_CALLS])
def test_bad_request_calls(what: str, call: Callable, exc: Any) -> None:
    d = new_driver()
    d.schedule()
    d.update()
    expect_unchanged(d.sched, exc, lambda: call(d.sched))
    d.run()
    assert_same_run(d, reference("sync", 0))


def test_duplicate_id_while_waiting() -> None:
    s = Scheduler(make_config(**BASE_CFG))
    s.add_request(7, prompt(3))
    expect_unchanged(s, ValueError, lambda: s.add_request(7, prompt(4)))
    assert s.num_waiting == 1


def test_abort_of_finished_request_is_key_error() -> None:
    d = new_driver()
    tried: set[int] = set()

    def hook(dr: Driver, it: int) -> bool:
        for rid in list(dr.reasons):
            if rid not in tried:
                tried.add(rid)
                expect_unchanged(dr.sched, KeyError, lambda r=rid: dr.sched.abort_request(r))
        return False

    d.run(hook=hook)
    assert tried == {0, 1, 2}
    assert_same_run(d, reference("sync", 0))


def test_prompt_longer_than_max_model_len_is_rejected_not_raised() -> None:
    d = new_driver()
    d.add(60, prompt(65))
    assert d.sched.num_waiting == 4
    d.run()
    assert d.rejected == {
        60: "unschedulable: input tokens=65 > max_model_len=64. Increase max_model_len or "
        "shorten the prompt."
    }
    assert 60 not in d.tokens or d.tokens[60] == []
    assert {r: d.results()[r] for r in (0, 1, 2)} == reference("sync", 0).results()


# ---------------------------------------------------------------------------------------------
# schedule / update
# ---------------------------------------------------------------------------------------------


def test_schedule_with_two_batches_outstanding() -> None:
    d = new_driver("async")
    calls = []

    def pre(dr: Driver, b: Any, outputs: dict, rec: Any) -> None:
        if dr.sched.num_outstanding_batches < 2:  # the tail of the run
            return
        calls.append(b)
        expect_unchanged(dr.sched, ValueError, lambda: dr.sched.schedule())

    d.pre_update = pre
    d.run()
    assert calls
    assert_same_run(d, reference("async", 0))


def test_update_with_a_batch_that_is_not_the_oldest() -> None:
    d = new_driver("async")
    calls = []

    def pre(dr: Driver, b: Any, outputs: dict, rec: Any) -> None:
        if not dr.pending:
            return
        newer, newer_out, _ = dr.pending[0]
        calls.append(1)
        expect_unchanged(dr.sched, ValueError, lambda: dr.sched.update(newer, **newer_out))

    d.pre_update = pre
    d.run()
    assert calls
    assert_same_run(d, reference("async", 0))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_update_twice_with_the_same_batch(mode: str) -> None:
    d = new_driver(mode)

    def post(dr: Driver, b: Any, outputs: dict, rec: Any) -> None:
        expect_unchanged(dr.sched, ValueError, lambda: dr.sched.update(b, **outputs))

    d.post_update = post
    d.run()
    assert_same_run(d, reference(mode, 0))


def _emitting_row(rec: Any) -> int | None:
    for i, e in enumerate(rec.emits_token):
        if e:
            return i
    return None


def _faults_k0(b: Any, out: dict, rec: Any) -> list[tuple[str, dict, Any]]:
    n = rec.num_rows
    s = np.asarray(out["sampled_token_ids"])
    faults: list[tuple[str, dict, Any]] = [
        ("one row too many", dict(out, sampled_token_ids=np.zeros(n + 1, np.int32)), ValueError),
        ("no rows", dict(out, sampled_token_ids=np.zeros(0, np.int32)), ValueError),
        ("float64 tokens", dict(out, sampled_token_ids=s.astype(np.float64)), TypeError),
        ("float32 tokens", dict(out, sampled_token_ids=s.astype(np.float32)), TypeError),
        ("width 2 when K=0", dict(out, sampled_token_ids=np.zeros((n, 2), np.int32)), ValueError),
        ("3-D tokens", dict(out, sampled_token_ids=np.zeros((n, 1, 1), np.int32)), ValueError),
        ("object tokens", dict(out, sampled_token_ids=s.astype(object)), TypeError),
        # None is both the wrong type and the wrong shape: either error is fine.
        ("None tokens", dict(out, sampled_token_ids=None), (TypeError, ValueError)),
        ("logprobs wrong shape", dict(out, logprobs=np.zeros(n + 1, np.float32)), ValueError),
        ("logprobs int dtype", dict(out, logprobs=np.zeros(n, np.int32)), TypeError),
    ]
    if n > 1:
        faults.append(
            ("one row too few", dict(out, sampled_token_ids=np.zeros(n - 1, np.int32)), ValueError)
        )
    i = _emitting_row(rec)
    if i is not None:
        neg = s.copy()
        neg[i] = -7
        faults.append(("negative accepted token", dict(out, sampled_token_ids=neg), ValueError))
    return faults


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bad_update_outputs_k0(mode: str) -> None:
    d = new_driver(mode)
    seen: list[str] = []

    def pre(dr: Driver, b: Any, outputs: dict, rec: Any) -> None:
        for what, bad, exc in _faults_k0(b, outputs, rec):
            seen.append(what)
            try:
                expect_unchanged(dr.sched, exc, lambda bad=bad: dr.sched.update(b, **bad))
            except AssertionError as e:  # name the fault in the failure
                raise AssertionError(
                    f"{what} (batch {rec.id}, prefill={rec.is_prefill}): {e}") from e

    d.pre_update = pre
    d.run()
    assert "negative accepted token" in seen
    assert_same_run(d, reference(mode, 0))


def _faults_k(b: Any, out: dict, rec: Any, k: int) -> list[tuple[str, dict, Any]]:
    n = rec.num_rows
    s = np.asarray(out["sampled_token_ids"])
    drafts = np.asarray(out["draft_token_ids"])
    faults: list[tuple[str, dict, Any]] = [
        ("drafts missing", {kk: v for kk, v in out.items() if kk != "draft_token_ids"},
         ValueError),
        ("drafts wrong width", dict(out, draft_token_ids=np.zeros((n, k + 1), np.int32)),
         ValueError),
        ("drafts wrong rows", dict(out, draft_token_ids=np.zeros((n + 1, k), np.int32)),
         ValueError),
        ("drafts float64", dict(out, draft_token_ids=drafts.astype(np.float64)), TypeError),
        ("tokens 1-D when K>0", dict(out, sampled_token_ids=s[:, 0].copy()), ValueError),
        ("tokens width K", dict(out, sampled_token_ids=s[:, :k].copy()), ValueError),
        ("tokens width K+2", dict(out, sampled_token_ids=np.zeros((n, k + 2), np.int32)),
         ValueError),
        ("tokens float64", dict(out, sampled_token_ids=s.astype(np.float64)), TypeError),
        ("logprobs wrong width", dict(out, logprobs=np.zeros((n, k), np.float32)), ValueError),
    ]
    acc = out.get("num_accepted")
    if rec.is_prefill:
        twos = np.full(n, 2, np.int32)
        faults.append(("prefill with num_accepted 2", dict(out, num_accepted=twos), ValueError))
    else:
        assert acc is not None
        without = {kk: v for kk, v in out.items() if kk != "num_accepted"}
        faults += [
            ("num_accepted missing", without, ValueError),
            ("num_accepted 0", dict(out, num_accepted=np.where(np.arange(n) == 0, 0, acc)
                                    .astype(np.int32)), ValueError),
            ("num_accepted K+2", dict(out, num_accepted=np.where(np.arange(n) == 0, k + 2, acc)
                                      .astype(np.int32)), ValueError),
            ("num_accepted -1", dict(out, num_accepted=np.full(n, -1, np.int32)), ValueError),
            ("num_accepted float", dict(out, num_accepted=acc.astype(np.float64)), TypeError),
            ("num_accepted wrong length", dict(out, num_accepted=np.ones(n + 1, np.int32)),
             ValueError),
        ]
        # A negative token among the accepted ones of row 0.
        a0 = int(acc[0])
        neg = s.copy()
        neg[0, a0 - 1] = -1
        faults.append(("negative accepted token", dict(out, sampled_token_ids=neg), ValueError))
    return faults


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bad_update_outputs_with_drafts(mode: str) -> None:
    k = 2
    d = new_driver(mode, k)
    seen: set[str] = set()

    def pre(dr: Driver, b: Any, outputs: dict, rec: Any) -> None:
        for what, bad, exc in _faults_k(b, outputs, rec, k):
            seen.add(what)
            try:
                expect_unchanged(dr.sched, exc, lambda bad=bad: dr.sched.update(b, **bad))
            except AssertionError as e:
                raise AssertionError(
                    f"{what} (batch {rec.id}, prefill={rec.is_prefill}): {e}") from e

    d.pre_update = pre
    d.run()
    assert {"num_accepted 0", "num_accepted K+2", "drafts missing", "prefill with num_accepted 2",
            "negative accepted token"} <= seen
    assert_same_run(d, reference(mode, k))


def test_failed_update_does_not_touch_spec_stats() -> None:
    """Out-of-range accepted counts are a ValueError, not a crash or a stats update (8.35)."""
    k = 3
    d = new_driver("sync", k)
    d.schedule()
    d.update()
    d.schedule()
    b, out, rec = d.pending[0]
    before = d.sched.stats()
    for a in (0, k + 2, 100):
        bad = dict(out, num_accepted=np.full(rec.num_rows, a, np.int32))
        expect_unchanged(d.sched, ValueError, lambda bad=bad: d.sched.update(b, **bad))
    assert d.sched.stats() == before
    d.update()
    d.run()
    assert_same_run(d, reference("sync", k))


def test_set_drafts_verifies_them_next_and_refuses_bad_ones_unchanged() -> None:
    """Scheduler.set_drafts: drafts a drafter proposes after the update that returned the
    request's last token (vLLM's n-gram proposer) are verified by its next row; bad input is a
    typed error that changes nothing."""
    k = 2
    s = Scheduler(SchedulerConfig(num_blocks=17, block_size=4, max_num_seqs=4,
                                  max_num_batched_tokens=64, max_model_len=64,
                                  num_speculative_tokens=k))
    s.add_request(1, [10, 11, 12], SamplingParams(max_tokens=8))
    s.add_request(2, [20, 21, 22], SamplingParams(max_tokens=8))
    b = s.schedule()
    s.update(b, np.array([[100, -1, -1], [200, -1, -1]], np.int32),
             draft_token_ids=np.full((2, k), -1, np.int32))
    s.abort_request(2)
    s.add_request(3, [30, 31], SamplingParams(max_tokens=8))  # waiting
    for bad, exc in [([1, 2, 3], ValueError), ([5, -1], ValueError), ([2**31], ValueError),
                     (["a"], TypeError), ({5}, TypeError), ("5", TypeError)]:
        expect_unchanged(s, exc, lambda bad=bad: s.set_drafts(1, bad))
    expect_unchanged(s, KeyError, lambda: s.set_drafts(9, [5]))
    expect_unchanged(s, ValueError, lambda: s.set_drafts(3, [5]))
    s.set_drafts(1, np.array([30, 31], np.int64))
    b = s.schedule(allow_prefill=False)  # the decode step (3 waits: ATOM's policy)
    row = list(b.req_ids).index(1)
    assert b.num_scheduled_tokens[row] == 1 + k
    assert b.spec_draft_tokens[row].tolist() == [30, 31]
    expect_unchanged(s, ValueError, lambda: s.set_drafts(1, [5]))  # its row is in flight
    plain = Scheduler(SchedulerConfig(num_blocks=17, block_size=4, max_num_seqs=4,
                                      max_num_batched_tokens=64, max_model_len=64))
    plain.add_request(1, [10, 11, 12], SamplingParams(max_tokens=8))
    plain.update(plain.schedule(), np.array([100], np.int32))
    expect_unchanged(plain, ValueError, lambda: plain.set_drafts(1, [5]))


# ---------------------------------------------------------------------------------------------
# Values that slip through naive range checks, foreign batches, array layouts
# ---------------------------------------------------------------------------------------------

NAN = float("nan")


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(top_p=NAN), "top_p"),
        (dict(temperature=NAN), "temperature"),
    ],
    ids=["top_p nan", "temperature nan"],
)
def test_nan_sampling_values_are_rejected(kw: dict, field: str) -> None:
    """top_p must be in (0, 1] and temperature >= 0: NaN is neither (a check written as
    `x <= 0 || x > 1` lets NaN through)."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_nan_delay_factor_is_rejected() -> None:
    with pytest.raises(ValueError, match="scheduler_delay_factor"):
        Scheduler(SchedulerConfig(num_blocks=8, scheduler_delay_factor=NAN))


def test_update_with_a_batch_of_another_scheduler() -> None:
    """Two schedulers number their batches alike; a batch of one is not an outstanding batch of
    the other, so update() must refuse it even though the ids match."""
    s1 = Scheduler(make_config(**BASE_CFG))
    s2 = Scheduler(make_config(**BASE_CFG))
    s1.add_request(0, prompt(5))
    s2.add_request(0, prompt(3, 50))
    s2.add_request(1, prompt(3, 60))
    b1 = s1.schedule()
    b2 = s2.schedule()
    assert b1.id == b2.id
    expect_unchanged(s1, ValueError, lambda: s1.update(b2, np.array([11, 12], np.int32)))
    out = s1.update(b1, np.array([11], np.int32))
    assert [o.request_id for o in out] == [0]


def test_update_after_the_batch_was_consumed_and_a_new_one_scheduled() -> None:
    d = new_driver()
    b_old = d.sched.schedule()
    first = d.model.run(BatchRecord.of(b_old))
    d.sched.update(b_old, **first)
    b_new = d.sched.schedule()
    assert b_new is not None
    expect_unchanged(d.sched, ValueError, lambda: d.sched.update(b_old, **first))


def test_strided_and_fortran_inputs_are_read_correctly() -> None:
    """Non-contiguous prompt arrays and column slices / Fortran-ordered outputs are valid numpy
    integer arrays: the values, not the memory layout, count."""
    k = 2
    s = Scheduler(make_config(num_blocks=16, block_size=4, num_speculative_tokens=k))
    p = np.arange(100, 120, dtype=np.int64)[::2]  # strided view
    s.add_request(0, p, SamplingParams(max_tokens=10))
    b = s.schedule()
    assert list(b.scheduled_tokens) == list(range(100, 120, 2))
    wide = np.array([[42, 0, 7, 0, 9, 0]], dtype=np.int32)
    s.update(b, wide[:, ::2], draft_token_ids=np.asfortranarray(np.array([[50, 51]], np.int32)))
    b = s.schedule()
    assert list(b.scheduled_tokens) == [42, 50, 51]
    sampled = np.asfortranarray(np.array([[43, 44, 45]], dtype=np.int32))
    acc = np.array([0, 2, 0], dtype=np.int32)[1::2]  # strided, value 2
    drafts = np.array([[60, 0, 61, 0]], dtype=np.int32)[:, ::2]
    out = s.update(b, sampled, num_accepted=acc, draft_token_ids=drafts)
    assert [list(o.output_tokens) for o in out] == [[43, 44]]
    b = s.schedule()
    assert list(b.scheduled_tokens) == [44, 60, 61]
    s.check_invariants()


def test_strided_sampled_tokens_k0() -> None:
    s = Scheduler(make_config(num_blocks=16, block_size=4))
    s.add_request(0, prompt(3), SamplingParams(max_tokens=5))
    s.add_request(1, prompt(3, 40), SamplingParams(max_tokens=5))
    b = s.schedule()
    col = np.array([[21, 0], [22, 0]], dtype=np.int32)[:, 0]  # strided column
    out = s.update(b, col)
    assert [list(o.output_tokens) for o in out] == [[21], [22]]
