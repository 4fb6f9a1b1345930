"""Scheduler.recompute_kv_from() through the Python API (docs/api.md "KV connector"): a failed
KV load's rewind, the outputs of rows in flight dropped, bad calls refused with nothing
changed."""

from __future__ import annotations

import numpy as np
import pytest

from atom_sched import SamplingParams, Scheduler, SchedulerConfig


def test_a_rewound_request_drops_its_rows_in_flight_and_computes_again() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=17, block_size=4, max_model_len=64))
    s.add_request(1, list(range(10, 20)), SamplingParams(max_tokens=4))
    batch = s.schedule()
    s.update(batch, np.array([50], dtype=np.int32))
    batch = s.schedule()  # a decode row in flight
    with pytest.raises(ValueError, match="the prefix cache serves its KV up to position 8"):
        s.recompute_kv_from(1, 4)  # its prompt's whole blocks are cached: others may use them
    s.recompute_kv_from(1, 8)
    s.check_invariants()
    out = s.update(batch, np.array([51], dtype=np.int32))
    assert len(out) == 0, "the row computed on KV that failed: its token is dropped"
    batch = s.schedule()
    assert batch.num_cached_tokens.tolist() == [8]
    assert batch.scheduled_tokens.tolist() == [18, 19, 50]
    out = s.update(batch, np.array([52], dtype=np.int32))
    assert out.new_tokens.tolist() == [52]
    assert s.request_state(1)["token_ids"] == list(range(10, 20)) + [50, 52]


def test_bad_calls_are_refused_and_change_nothing() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=17, block_size=4, max_model_len=64))
    s.add_request(1, list(range(10, 20)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="neither running nor waiting for remote KV"):
        s.recompute_kv_from(1, 0)  # waiting
    with pytest.raises(KeyError):
        s.recompute_kv_from(2, 0)
    batch = s.schedule()
    before = s.request_state(1)
    for bad, error in ((-1, ValueError), ("4", TypeError), (2**40, TypeError)):
        with pytest.raises(error):
            s.recompute_kv_from(1, bad)
        assert s.request_state(1) == before
    s.check_invariants()
    s.update(batch, np.array([50], dtype=np.int32))
