"""Issue 10 item 2: Batch.views() returns every array a model runner and sampler read in one call,
built once per batch buffer and shape and then returned again, so a steady step pays one call
instead of a numpy object per array. The arrays equal the Batch attributes (the Driver checks
that on every batch of every suite); here: reuse, rebuilding on a new shape, staleness, and the
memory rules (read-only; an array kept past its scheduler stays valid; no reference cycle)."""

import gc
import pickle
import weakref

import numpy as np
import pytest

from atom_sched import BatchViews, SamplingParams, Scheduler, SchedulerConfig


def make(k: int = 0) -> Scheduler:
    s = Scheduler(SchedulerConfig(num_blocks=256, block_size=4, num_speculative_tokens=k))
    for rid in range(3):
        s.add_request(rid, list(range(10 + rid, 20 + rid)),
                      SamplingParams(max_tokens=50, ignore_eos=True))
    return s


def step(s: Scheduler, k: int = 0):
    b = s.schedule()
    v = b.views()
    n = b.num_rows
    if k:
        s.update(b, np.full((n, k + 1), 7, np.int32), np.ones(n, np.int32),
                 np.full((n, k), 8, np.int32))
    else:
        s.update(b, np.full(n, 7, np.int32))
    return b, v


@pytest.mark.parametrize("k", [0, 2])
def test_views_are_reused_per_buffer_while_the_shape_holds(k):
    s = make(k)
    _, prefill = step(s, k)
    assert isinstance(prefill, BatchViews) and prefill.positions.shape == (30,)
    _, d1 = step(s, k)
    _, d2 = step(s, k)
    _, d3 = step(s, k)
    assert d1 is not prefill, "a new shape builds new views"
    assert d3 is d1, "the same buffer and shape: the same object (two buffers alternate)"
    assert d2 is not d1
    assert d3.spec_draft_tokens.shape == (3, k)
    s.abort_request(2)  # two rows now: rebuilt
    b, d4 = step(s, k)
    assert d4 is not d1 and d4.req_ids.tolist() == [0, 1]


def test_views_of_a_shape_that_recurs_are_reused():
    # Finishes and admissions change the row count from step to step, mostly among a few
    # values: each buffer keeps the views of the shapes it had (the least recently used of 16
    # make room), so a shape that comes back costs no new arrays.
    s = make()
    step(s)  # the prefill
    _, d1 = step(s)  # three rows, one buffer
    _, d2 = step(s)  # three rows, the other
    s.abort_request(2)
    _, d3 = step(s)
    _, d4 = step(s)
    assert d3.req_ids.tolist() == [0, 1] and d3 is not d1
    s.add_request(9, list(range(30, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    step(s)  # its prefill
    b5, d5 = step(s)
    b6, d6 = step(s)
    assert d5 is d2 and d6 is d1, "three rows again, in each buffer: the views kept"
    assert d5.req_ids.tolist() == [0, 1, 9] and d6.req_ids.tolist() == [0, 1, 9]
    np.testing.assert_array_equal(d6.positions, b6.positions)


def test_views_of_a_stale_batch_raise_and_arrays_are_borrowed():
    s = make()
    b0, v0 = step(s)
    keep = np.array(v0.positions)
    step(s)
    step(s)  # b0's buffer now holds another batch
    with pytest.raises(RuntimeError, match="no longer valid"):
        b0.views()
    assert not v0.positions.flags.writeable
    assert not np.array_equal(v0.positions, keep), "borrowed: overwritten in place"


def test_arrays_outlive_their_scheduler_and_make_no_cycle():
    s = make()
    step(s)
    b, v = step(s)
    kept = v.slot_mapping
    value = kept.tolist()
    alive = weakref.ref(s)
    del s, b, v
    gc.collect()
    assert alive() is None, "the cached views keep no reference to the Scheduler"
    assert kept.tolist() == value, "the array still reads the (now frozen) buffer"


def test_step_output_flat_accessors_refuse_bad_indices():
    s = make()
    b = s.schedule()
    out = s.update(b, np.full(b.num_rows, 7, np.int32))
    assert out.finish_reason(0) is None and len(out.num_cached_tokens) == len(out)
    for bad in (-1, len(out)):
        with pytest.raises(IndexError, match="entries"):
            out.finish_reason(bad)


def test_final_token_ids_give_a_finished_requests_whole_sequence():
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    s.add_request(1, [5, 6, 7], SamplingParams(max_tokens=2))
    s.add_request(2, [8, 9], SamplingParams(max_tokens=9))
    s.update(s.schedule(), np.array([10, 20], np.int32))
    out = s.update(s.schedule(), np.array([11, 21], np.int32))
    ids = out.request_ids.tolist()
    done, running = ids.index(1), ids.index(2)
    assert out.finish_reason(done) == "max_tokens"
    assert out.final_token_ids(done) == [5, 6, 7, 10, 11]
    with pytest.raises(ValueError, match="did not finish"):
        out.final_token_ids(running)
    for bad in (-1, len(out)):
        with pytest.raises(IndexError, match="entries"):
            out.final_token_ids(bad)
    s.update(s.schedule(), np.array([22], np.int32))
    with pytest.raises(RuntimeError, match="no longer valid"):
        out.final_token_ids(done)


def test_without_host_block_tables_a_batch_has_none_and_says_why():
    cfg = SchedulerConfig(num_blocks=256, block_size=4, max_num_seqs=8, host_block_tables=False)
    assert cfg.host_block_tables is False
    assert pickle.loads(pickle.dumps(cfg)).host_block_tables is False
    assert SchedulerConfig(num_blocks=8).host_block_tables is True
    with pytest.raises(TypeError):
        SchedulerConfig(num_blocks=8, host_block_tables="no")
    with_tables = SchedulerConfig(num_blocks=256, block_size=4, max_num_seqs=8)
    runs = [Scheduler(cfg), Scheduler(with_tables)]
    for s in runs:
        for rid in range(6):
            s.add_request(rid, list(range(10 + rid, 20 + rid)),
                          SamplingParams(max_tokens=3 + rid, ignore_eos=True))
    for _ in range(12):  # prefill, then decode steps in which requests finish (rows shift)
        bs = [s.schedule() for s in runs]
        if bs[0] is None:
            break
        without, with_ = (b.views() for b in bs)
        with pytest.raises(RuntimeError, match="host_block_tables=False"):
            _ = bs[0].block_tables
        assert without.block_tables is None and with_.block_tables is not None
        for name, a, b in zip(BatchViews._fields, without, with_, strict=True):
            if name != "block_tables":
                np.testing.assert_array_equal(a, b, err_msg=name)
        outs = [[(o.request_id, o.output_tokens, o.finish_reason)
                 for o in s.update(b, np.full(b.num_rows, 7, np.int32))]
                for s, b in zip(runs, bs, strict=True)]
        assert outs[0] == outs[1]
        runs[0].check_invariants()
    assert not runs[0].has_unfinished_requests()
