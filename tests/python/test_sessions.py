"""Streaming-input sessions through the Python API (docs/api.md "Streaming-input sessions"):
SamplingParams(resumable=True), a turn's end in StepOutput, continue_session(), end_session(),
and bad input refused with the session left as it was."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from atom_sched import SamplingParams, Scheduler, SchedulerConfig

PROMPT = list(range(100, 106))  # 6 tokens: a block and a half of 4


def make_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=17, block_size=4, max_num_seqs=4,
                                     max_num_batched_tokens=64, max_model_len=64,
                                     enable_prefix_caching=True))


def run_until_stop(s: Scheduler, rid: int, token: int):
    """Steps synchronously, every row sampling `token`, until `rid`'s entry stops; returns the
    step output and the entry's index."""
    for _ in range(32):
        batch = s.schedule()
        assert batch is not None
        out = s.update(batch, np.full(batch.num_rows, token, dtype=np.int32))
        s.check_invariants()
        for i, req in enumerate(out.request_ids.tolist()):
            if req == rid and out.finish_reason(i) is not None:
                return out, i
    raise AssertionError(f"request {rid} never stopped")


def session(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, resumable=True, **kw)


def test_a_turn_ends_keeping_the_kv_and_the_next_resumes_after_it() -> None:
    s = make_scheduler()
    s.add_request(1, PROMPT, session(2))
    out, i = run_until_stop(s, 1, 9)
    assert out.finish_reason(i) == "max_tokens"
    assert out.awaiting_input.tolist()[i] and not out.finished.tolist()[i]
    assert out.num_awaiting_input == 1
    entry = out.outputs()[i]
    assert entry.awaiting_input and not entry.finished and entry.finish_reason == "max_tokens"
    with pytest.raises(ValueError, match="did not finish"):
        out.final_token_ids(i)
    state = s.request_state(1)
    assert state["status"] == "waiting_for_input" and state["resumable"]
    assert state["token_ids"] == PROMPT + [9, 9]
    assert state["num_computed_tokens"] == 7  # all but the last sampled token
    assert s.num_waiting_for_input == 1 and s.num_waiting == 0
    assert not s.has_unfinished_requests()
    assert s.schedule() is None
    assert s.num_free_blocks == 16 - 2

    s.continue_session(1, [7, 8], SamplingParams(max_tokens=1, temperature=0.0))
    s.check_invariants()
    assert s.num_waiting == 1 and s.num_waiting_for_input == 0 and s.has_unfinished_requests()
    batch = s.schedule()
    assert batch.num_cached_tokens.tolist() == [7]
    assert batch.scheduled_tokens.tolist() == [7, 8]
    assert batch.positions.tolist() == [7, 8]
    out = s.update(batch, np.array([5], dtype=np.int32))
    s.check_invariants()
    assert out.finished.tolist() == [True] and out.finish_reason(0) == "max_tokens"
    assert out.final_token_ids(0) == PROMPT + [9, 7, 8, 5]  # the last turn's 9 dropped
    assert 1 not in s and s.num_free_blocks == 16


def test_end_session_ends_a_waiting_session_and_makes_a_running_turn_the_last() -> None:
    s = make_scheduler()
    s.add_request(1, PROMPT, session(1))
    s.add_request(2, PROMPT, session(3))
    run_until_stop(s, 1, 9)
    s.end_session(1)  # waiting for input: it ends now
    assert 1 not in s and s.stats()["num_aborted"] == 1
    s.end_session(2)  # running: this turn is its last
    out, i = run_until_stop(s, 2, 9)
    assert out.finished.tolist()[i] and not out.awaiting_input.tolist()[i]
    assert 2 not in s and s.num_free_blocks == 16
    with pytest.raises(KeyError):
        s.end_session(2)


def test_bad_continuations_are_refused_and_leave_the_session_as_it_was() -> None:
    s = make_scheduler()
    s.add_request(1, PROMPT, session(2, lora_name="a"))
    with pytest.raises(ValueError, match="not a session waiting for input"):
        s.continue_session(1, [1], session(2, lora_name="a"))
    with pytest.raises(KeyError):
        s.continue_session(5, [1], session(2))
    run_until_stop(s, 1, 9)
    before = s.request_state(1)
    free = s.num_free_blocks
    bad = [
        ([], session(2, lora_name="a"), ValueError),
        ([1, -2], session(2, lora_name="a"), ValueError),
        ([1, 2**40], session(2, lora_name="a"), (ValueError, OverflowError)),
        (["x"], session(2, lora_name="a"), TypeError),
        ([1], session(2, lora_name="b"), ValueError),  # another adapter
        ([1], session(2, lora_name="a", cache_salt="s"), ValueError),  # another salt
        ([1], "params", TypeError),
    ]
    for tokens, params, error in bad:
        with pytest.raises(error):
            s.continue_session(1, tokens, params)
        s.check_invariants()
        assert s.request_state(1) == before and s.num_free_blocks == free
    with pytest.raises(ValueError):
        s.continue_session(1, [1], session(2, lora_name="a"), arrival_time=float("nan"))
    assert s.request_state(1) == before
    s.continue_session(1, [1], session(2, lora_name="a"))
    with pytest.raises(ValueError, match="already arrived"):
        s.continue_session(1, [2], session(2, lora_name="a"))


def test_resumable_is_a_flag_of_sampling_params() -> None:
    assert SamplingParams().resumable is False
    p = SamplingParams(resumable=True)
    assert p.resumable and "resumable=True" in repr(p)
    assert pickle.loads(pickle.dumps(p)).resumable is True
    with pytest.raises(TypeError):
        SamplingParams(resumable="yes")
    # Per-request state slots cannot be rewound by a token: sessions are refused with them.
    s = Scheduler(SchedulerConfig(num_blocks=17, block_size=4, num_state_slots=2))
    with pytest.raises(ValueError, match="state slots"):
        s.add_request(1, PROMPT, SamplingParams(resumable=True))
    assert 1 not in s
