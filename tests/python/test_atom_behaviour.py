"""ATOM's scheduling behaviour that atom_sched keeps (spec sections 2-5, docs/api.md "Policy").

Block size 4 throughout unless said otherwise; token timelines are written in the comments.
"""

from __future__ import annotations

import pytest
from support import (
    EOS,
    cdiv,
    make_driver,
    prompt,
    rejection_reason,
    sp,
)

import atom_sched

BS = 4


# ---------------------------------------------------------------------------------------------
# Admission (Phase 2) and its breaks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_head_that_cannot_allocate_blocks_everything_behind_it(mode: str) -> None:
    d = make_driver(mode, num_blocks=4 + 1, block_size=BS, enable_prefix_caching=False)
    d.add(0, prompt(12, 100), sp(max_tokens=1))  # 3 blocks
    d.add(1, prompt(8, 200), sp(max_tokens=1))  # 2 blocks: only 1 left -> break
    d.add(2, prompt(2, 300), sp(max_tokens=1))  # would fit, but strict FCFS
    rec = d.schedule()
    assert rec is not None and rec.req_ids == [0]
    assert d.sched.num_waiting == 2 and d.sched.num_running == 1
    assert d.sched.num_free_blocks == 1
    d.run()
    assert [r.req_ids for r in d.batches if r.is_prefill] == [[0], [1, 2]]
    d.check_all_done()
    d.check_against_oracle()


def test_non_chunked_budget_break() -> None:
    d = make_driver(
        num_blocks=32, block_size=BS, enable_chunked_prefill=False, max_num_batched_tokens=10
    )
    d.add(0, prompt(6, 100), sp(max_tokens=3))
    d.add(1, prompt(6, 200), sp(max_tokens=3))  # 6 > 4 left and the batch has tokens: break
    d.add(2, prompt(3, 300), sp(max_tokens=3))  # 3 <= 4 would fit, but it is behind the break
    b1 = d.schedule()
    assert b1 is not None and b1.req_ids == [0] and b1.num_tokens == 6
    d.update()
    b2 = d.schedule()
    assert b2 is not None and b2.is_prefill
    assert b2.req_ids == [1, 2] and b2.num_scheduled_tokens == [6, 3]
    d.update()
    b3 = d.schedule()
    assert b3 is not None and not b3.is_prefill and b3.req_ids == [0, 1, 2]
    d.update()
    d.run()
    d.check_against_oracle()


def test_chunked_admission_takes_what_budget_is_left() -> None:
    d = make_driver(num_blocks=32, block_size=BS, max_num_batched_tokens=10)
    d.add(0, prompt(6, 100), sp(max_tokens=3))
    d.add(1, prompt(6, 200), sp(max_tokens=3))
    d.add(2, prompt(3, 300), sp(max_tokens=3))
    b1 = d.schedule()
    assert b1 is not None and b1.req_ids == [0, 1]
    assert b1.num_scheduled_tokens == [6, 4] and b1.emits_token == [True, False]
    d.update()
    # Phase 1 first (the rest of 1), then Phase 2 (2). Prefill-only: 0 does not decode.
    b2 = d.schedule()
    assert b2 is not None and b2.is_prefill and b2.req_ids == [1, 2]
    assert b2.num_cached_tokens == [4, 0] and b2.num_scheduled_tokens == [2, 3]
    assert b2.emits_token == [True, True]
    d.update()
    b3 = d.schedule()
    assert b3 is not None and not b3.is_prefill and b3.req_ids == [0, 1, 2]
    d.update()
    d.run()
    d.check_against_oracle()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_chunked_prefill_across_steps(mode: str) -> None:
    d = make_driver(mode, num_blocks=16, block_size=BS, max_num_batched_tokens=8)
    d.add(0, prompt(25), sp(max_tokens=3))
    d.run()
    pre = [r for r in d.batches if r.is_prefill]
    assert [(r.num_cached_tokens[0], r.num_scheduled_tokens[0]) for r in pre] == [
        (0, 8),
        (8, 8),
        (16, 8),
        (24, 1),
    ]
    assert [r.emits_token[0] for r in pre] == [False, False, False, True]
    # Blocks for all 25 tokens are allocated at admission.
    assert all(not r.is_prefill for r in d.batches[4:])
    assert d.chunks[0][0] == d.tokens[0][:1]  # the first streamed chunk follows the last chunk
    d.check_against_oracle()


def test_allocation_covers_the_whole_prompt_at_admission() -> None:
    d = make_driver(num_blocks=16 + 1, block_size=BS, max_num_batched_tokens=8)
    d.add(0, prompt(25), sp(max_tokens=3))
    d.schedule()
    assert d.sched.num_free_blocks == 16 - cdiv(25, BS)
    d.update()


def test_partial_prefills_resume_first_in_running_order() -> None:
    d = make_driver(num_blocks=32, block_size=BS, max_num_batched_tokens=8)
    d.add(0, prompt(12, 100), sp(max_tokens=2))
    d.add(1, prompt(12, 200), sp(max_tokens=2))
    d.add(2, prompt(12, 300), sp(max_tokens=2))
    steps = []
    for _ in range(5):
        rec = d.schedule()
        assert rec is not None and rec.is_prefill
        steps.append(list(zip(rec.req_ids, rec.num_cached_tokens, rec.num_scheduled_tokens,
                                 strict=True)))
        d.update()
    assert steps == [
        [(0, 0, 8)],
        [(0, 8, 4), (1, 0, 4)],
        [(1, 4, 8)],
        [(2, 0, 8)],
        [(2, 8, 4)],
    ]
    d.run()
    d.check_against_oracle()


def test_prefix_probe_comes_before_the_budget_check() -> None:
    """num_new = num_tokens - hits * block_size is what is compared with the budget."""
    d = make_driver(
        num_blocks=32, block_size=BS, enable_chunked_prefill=False, max_num_batched_tokens=10
    )
    shared = prompt(8, 500)
    d.add(0, shared, sp(max_tokens=1))
    d.run()  # publishes the two full blocks of `shared`
    d.add(1, prompt(6, 100), sp(max_tokens=2))
    d.add(2, shared[:4] + prompt(4, 700), sp(max_tokens=2))  # 8 tokens, 4 cached -> 4 new
    rec = d.schedule()
    assert rec is not None and rec.req_ids == [1, 2]
    assert rec.num_cached_tokens == [0, 4] and rec.num_scheduled_tokens == [6, 4]
    d.update()
    d.run()
    d.check_against_oracle()


def test_max_num_seqs_bounds_admission() -> None:
    d = make_driver(num_blocks=32, block_size=BS, max_num_seqs=2)
    for r in range(3):
        d.add(r, prompt(3, 100 * (r + 1)), sp(max_tokens=2))
    rec = d.schedule()
    assert rec is not None and rec.req_ids == [0, 1]
    assert d.sched.num_waiting == 1
    d.update()
    rec = d.schedule()
    assert rec is not None and not rec.is_prefill and rec.req_ids == [0, 1]
    d.update()  # both finish (2 tokens)
    rec = d.schedule()
    assert rec is not None and rec.is_prefill and rec.req_ids == [2]
    d.update()
    d.run()
    d.check_against_oracle()


# ---------------------------------------------------------------------------------------------
# Decode and preemption
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_preemption_victim_is_the_tail_and_goes_to_the_head_of_waiting(mode: str) -> None:
    d = make_driver(mode, num_blocks=4 + 1, block_size=BS, enable_prefix_caching=False)
    for r in range(3):
        d.add(r, prompt(4, 100 * (r + 1)), sp(max_tokens=3))  # 1 block each
    d.add(3, prompt(8, 900), sp(max_tokens=2))  # 2 blocks: blocked behind them
    b1 = d.schedule()
    assert b1 is not None and b1.req_ids == [0, 1, 2]
    assert d.sched.num_waiting == 1
    if mode == "sync":
        d.update()
    # Decode: each request now needs a 2nd block for position 4. 0 takes the last free block;
    # 1 finds none, so the tail of running (2) is preempted, and 1 takes 2's block.
    b2 = d.schedule()
    assert b2 is not None and not b2.is_prefill and b2.req_ids == [0, 1]
    assert d.sched.stats()["num_preemptions"] == 1
    assert d.sched.num_running == 2 and d.sched.num_waiting == 2
    d.run()
    # 2 was put back at the head of waiting, in front of 3, which had waited longer.
    admitted = [r.req_ids for r in d.batches if r.is_prefill]
    assert admitted[:2] == [[0, 1, 2], [2, 3]]
    d.check_all_done()
    d.check_against_oracle()


def test_request_that_is_the_tail_preempts_itself() -> None:
    d = make_driver(num_blocks=3, block_size=BS, enable_prefix_caching=False)
    d.add(0, prompt(4, 100), sp(max_tokens=2))
    d.add(1, prompt(4, 200), sp(max_tokens=2))
    d.schedule()
    d.update()
    rec = d.schedule()
    assert rec is not None and rec.req_ids == [0]
    assert d.sched.num_waiting == 1 and d.sched.num_running == 1
    assert d.sched.stats()["num_preemptions"] == 1
    d.update()
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    # 1 is re-prefilled with its prompt and the token it had generated.
    re = [r for r in d.batches if r.is_prefill and 1 in r.req_ids][-1]
    i = re.row(1)
    assert re.num_cached_tokens[i] + re.num_scheduled_tokens[i] == 5


def test_decode_budget_limits_rows() -> None:
    k = 1
    d = make_driver(
        num_blocks=32, block_size=BS, num_speculative_tokens=k, max_num_batched_tokens=5
    )
    for r in range(3):
        d.add(r, prompt(1, 100 * (r + 1)), sp(max_tokens=6))
    pre = d.schedule()
    assert pre is not None and pre.req_ids == [0, 1, 2]
    d.update()
    rec = d.schedule()
    assert rec is not None and not rec.is_prefill
    assert rec.req_ids == [0, 1]  # 2 * (K+1) = 4 <= 5, a third row would need 6
    d.update()
    d.run()
    d.check_against_oracle()


# ---------------------------------------------------------------------------------------------
# Prefix cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_prefix_hits_and_the_last_block_rule(mode: str) -> None:
    d = make_driver(mode, num_blocks=16, block_size=BS)
    p = prompt(8, 100)  # exactly 2 full blocks
    d.add(0, p, sp(max_tokens=1))
    d.run()
    # Same 8 tokens: the last block is never a hit, so only block 0 is.
    d.add(1, p, sp(max_tokens=1))
    d.run()
    # 9 tokens: both full blocks hit, 1 token computed.
    d.add(2, p + [5], sp(max_tokens=1))
    d.run()
    # Only the first block shared.
    d.add(3, p[:4] + prompt(4, 300), sp(max_tokens=1))
    d.run()
    # Shares 3 tokens only: no full block, no hit.
    d.add(4, p[:3] + prompt(5, 400), sp(max_tokens=1))
    d.run()
    rows = {
        r.req_ids[0]: (r.num_cached_tokens[0], r.num_scheduled_tokens[0])
        for r in d.batches
        if r.is_prefill
    }
    assert rows == {0: (0, 8), 1: (4, 4), 2: (8, 1), 3: (4, 4), 4: (0, 8)}
    assert d.cached_first == {0: 0, 1: 4, 2: 8, 3: 4, 4: 0}
    st = d.sched.stats()
    assert st["num_prefix_queries"] == 5
    assert st["prefix_query_tokens"] == 8 + 8 + 9 + 8 + 8
    assert st["prefix_hit_tokens"] == 16
    assert st["prefix_hit_rate"] == pytest.approx(16 / 41)
    d.check_against_oracle()


def test_hit_on_blocks_of_a_live_request_shares_them() -> None:
    d = make_driver(num_blocks=16 + 1, block_size=BS)
    p = prompt(9, 100)
    d.add(0, p, sp(max_tokens=20))
    a = d.schedule()
    d.update()
    assert d.sched.num_free_blocks == 16 - 3
    d.add(1, p[:8] + [7], sp(max_tokens=2))
    b = d.schedule()
    assert b is not None and b.req_ids == [1]
    assert b.num_cached_tokens == [8] and b.num_scheduled_tokens == [1]
    assert list(b.block_tables[0, :2]) == list(a.block_tables[0, :2])
    assert int(b.block_tables[0, 2]) != int(a.block_tables[0, 2])
    assert d.sched.num_free_blocks == 16 - 4  # only the last block is new
    d.update()
    d.run()
    d.check_all_done()
    d.check_against_oracle()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_identical_prompts_in_the_same_step_get_no_hit(mode: str) -> None:
    d = make_driver(mode, num_blocks=16, block_size=BS)
    p = prompt(8, 100)
    d.add(0, p, sp(max_tokens=2))
    d.add(1, p, sp(max_tokens=2))
    rec = d.schedule()
    assert rec is not None and rec.req_ids == [0, 1]
    assert rec.num_cached_tokens == [0, 0], "hashes must not be published at allocation"
    d.run()
    d.add(2, p, sp(max_tokens=2))
    d.run()
    assert d.cached_first == {0: 0, 1: 0, 2: 4}


def test_hashes_are_published_by_update_not_by_schedule() -> None:
    """One step ahead: the second prompt is admitted while the first one's prefill is in flight."""
    d = make_driver("async", num_blocks=16, block_size=BS)
    p = prompt(8, 100)
    d.add(0, p, sp(max_tokens=3))
    b1 = d.schedule()
    assert b1 is not None and b1.req_ids == [0]
    d.add(1, p, sp(max_tokens=3))
    b2 = d.schedule()
    assert b2 is not None and b2.is_prefill and b2.req_ids == [1]
    assert b2.num_cached_tokens == [0]
    d.update()  # publishes 0's blocks
    d.add(2, p + [1], sp(max_tokens=3))
    d.update()
    b3 = d.schedule()
    assert b3 is not None and b3.is_prefill and b3.req_ids == [2]
    assert b3.num_cached_tokens == [8]
    d.run()
    d.check_against_oracle()


def test_prefix_caching_disabled_never_hits() -> None:
    d = make_driver(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    p = prompt(9, 100)
    d.add(0, p, sp(max_tokens=1))
    d.run()
    d.add(1, p, sp(max_tokens=1))
    d.run()
    assert d.cached_first == {0: 0, 1: 0}
    assert d.sched.stats()["prefix_hit_tokens"] == 0


def test_reset_prefix_cache_forgets_hashes() -> None:
    d = make_driver(num_blocks=16, block_size=BS)
    p = prompt(9, 100)
    d.add(0, p, sp(max_tokens=1))
    d.run()
    d.sched.reset_prefix_cache()
    d.sched.check_invariants()
    d.add(1, p, sp(max_tokens=1))
    d.run()
    assert d.cached_first == {0: 0, 1: 0}


def test_block_hash_matches_atom_vectors() -> None:
    h = atom_sched.block_hash([1, 2, 3, 4])
    assert h == 8356527653647720045
    assert atom_sched.block_hash([5, 6, 7, 8], h) == 610383040053763902


# ---------------------------------------------------------------------------------------------
# Static rejection
# ---------------------------------------------------------------------------------------------


def test_rejection_reasons_exact_text() -> None:
    d = make_driver(
        num_blocks=8,
        block_size=BS,
        max_model_len=16,
        enable_chunked_prefill=False,
        max_num_batched_tokens=12,
    )
    d.add(0, prompt(17), sp())
    d.add(1, prompt(13), sp())
    d.add(2, prompt(5), sp(max_tokens=2))
    rec = d.schedule()
    # Rejections "continue": the request behind them is admitted in the same step.
    assert rec is not None and rec.req_ids == [2]
    assert d.rejected == {
        0: "unschedulable: input tokens=17 > max_model_len=16. Increase max_model_len or "
        "shorten the prompt.",
        1: "unschedulable: input tokens=13 > max_num_batched_tokens=12. Increase "
        "max_num_batched_tokens, enable chunked prefill, or shorten the prompt.",
    }
    assert d.sched.take_rejected() == []
    st = d.sched.stats()
    assert st["num_rejected"] == 2
    d.update()
    d.run()
    d.check_all_done()
    assert d.reasons == {2: "max_tokens"}


def test_rejection_pool_too_small_exact_text() -> None:
    # ATOM's text, which also says that one of num_blocks ids is the null block.
    d = make_driver(num_blocks=2 + 1, block_size=BS, max_model_len=64)
    d.add(0, prompt(9), sp())
    d.add(1, prompt(8), sp(max_tokens=1))
    d.run()
    assert d.rejected == {
        0: "unschedulable: needs 3 KV blocks for 9 input tokens > the pool's 2 (num_blocks=3 less "
        "the null block). Shorten the prompt or increase num_blocks."
    }
    assert d.reasons == {1: "max_tokens"}


@pytest.mark.parametrize(
    ("n", "cfg"),
    [
        (20, dict(max_model_len=16, enable_chunked_prefill=False, max_num_batched_tokens=8,
                  num_blocks=2)),
        (10, dict(max_model_len=64, enable_chunked_prefill=False, max_num_batched_tokens=8,
                  num_blocks=2)),
        (10, dict(max_model_len=64, enable_chunked_prefill=True, max_num_batched_tokens=8,
                  num_blocks=2)),
    ],
)
def test_rejection_reason_order(n: int, cfg: dict) -> None:
    d = make_driver(block_size=BS, **cfg)
    d.add(0, prompt(n), sp())
    assert d.schedule() is None
    assert d.cfg is not None
    assert d.rejected == {0: rejection_reason(n, d.cfg)}
    assert not d.sched.has_unfinished_requests()
    with pytest.raises(KeyError):
        d.sched.abort_request(0)
    d.add(0, prompt(3), sp(max_tokens=1))  # a rejected id may be reused
    d.run()
    assert d.reasons == {0: "max_tokens"}


def test_prompt_of_exactly_max_num_batched_tokens_is_admitted_without_chunking() -> None:
    d = make_driver(num_blocks=8, block_size=BS, enable_chunked_prefill=False,
                    max_num_batched_tokens=8)
    d.add(0, prompt(8), sp(max_tokens=2))
    d.run()
    assert d.rejected == {} and d.reasons == {0: "max_tokens"}


# ---------------------------------------------------------------------------------------------
# Stop checks
# ---------------------------------------------------------------------------------------------


def _run_one(overrides: dict, cfg: dict | None = None, **params) -> tuple[list[int], str]:
    cfg = dict(num_blocks=32, block_size=BS, eos_token_id=EOS) | (cfg or {})
    d = make_driver(**cfg)
    d.model.overrides = {(0, g): t for g, t in overrides.items()}
    d.add(0, params.pop("prompt", prompt(5)), sp(**params))
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    return d.tokens[0], d.reasons[0]


def test_eos_stops_and_is_kept() -> None:
    toks, why = _run_one({2: EOS}, max_tokens=10)
    assert why == "eos" and len(toks) == 3 and toks[-1] == EOS


def test_eos_on_the_prefill_token() -> None:
    toks, why = _run_one({0: EOS}, max_tokens=10)
    assert (toks, why) == ([EOS], "eos")


def test_ignore_eos_ignores_eos() -> None:
    toks, why = _run_one({1: EOS}, max_tokens=4, ignore_eos=True)
    assert why == "max_tokens" and len(toks) == 4 and toks[1] == EOS


def test_no_eos_configured() -> None:
    toks, why = _run_one({1: EOS}, cfg=dict(eos_token_id=-1), max_tokens=4)
    assert why == "max_tokens" and len(toks) == 4


def test_config_stop_token() -> None:
    toks, why = _run_one({1: 99}, cfg=dict(stop_token_ids=[99]), max_tokens=10)
    assert why == "stop_99" and toks[-1] == 99 and len(toks) == 2


def test_request_stop_token() -> None:
    toks, why = _run_one({3: 77}, max_tokens=10, stop_token_ids=[77])
    assert why == "stop_77" and len(toks) == 4


def test_stop_sequence_across_steps() -> None:
    toks, why = _run_one({1: 6, 2: 7}, max_tokens=10, stop_token_sequences=[[6, 7]])
    assert why == "stop_sequence" and toks[1:] == [6, 7]


def test_stop_sequence_must_be_contiguous() -> None:
    toks, why = _run_one({1: 6, 2: 8, 3: 7}, max_tokens=5, stop_token_sequences=[[6, 7]])
    assert why == "max_tokens" and len(toks) == 5


def test_single_token_stop_sequence() -> None:
    toks, why = _run_one({2: 6}, max_tokens=10, stop_token_sequences=[[9, 9, 9], [6]])
    assert why == "stop_sequence" and len(toks) == 3


def test_stop_sequence_wins_over_eos_on_the_same_token() -> None:
    toks, why = _run_one({1: 6, 2: EOS}, max_tokens=10, stop_token_sequences=[[6, EOS]])
    assert why == "stop_sequence" and toks[-1] == EOS


def test_max_tokens() -> None:
    toks, why = _run_one({}, max_tokens=6)
    assert why == "max_tokens" and len(toks) == 6


def test_max_tokens_one_is_the_prefill_token_only() -> None:
    toks, why = _run_one({}, max_tokens=1)
    assert why == "max_tokens" and len(toks) == 1


def test_max_model_len_stops_decode() -> None:
    toks, why = _run_one({}, cfg=dict(max_model_len=12), prompt=prompt(10), max_tokens=100)
    assert why == "max_model_len" and len(toks) == 2


def test_max_tokens_checked_before_max_model_len() -> None:
    toks, why = _run_one({}, cfg=dict(max_model_len=12), prompt=prompt(10), max_tokens=2)
    assert why == "max_tokens" and len(toks) == 2


# ---------------------------------------------------------------------------------------------
# scheduler_delay_factor (ATOM's _passed_delay)
# ---------------------------------------------------------------------------------------------


def test_delay_factor_holds_admission_back() -> None:
    d = make_driver(num_blocks=32, block_size=BS, scheduler_delay_factor=0.5)
    d.add(0, prompt(4, 100), sp(max_tokens=10), arrival_time=10.0)
    b = d.schedule(now=10.0)  # nothing running: admission passes
    assert b is not None and b.is_prefill and b.req_ids == [0]
    d.update()
    d.add(1, prompt(4, 200), sp(max_tokens=3), arrival_time=10.6)
    # last prompt latency = 11.0 - 10.0 = 1.0; oldest waiting waited 0.4 <= 0.5 * 1.0: hold.
    b = d.schedule(now=11.0)
    assert b is not None and not b.is_prefill and b.req_ids == [0]
    d.update()
    # Waited 0.6 > 0.5: admit.
    b = d.schedule(now=11.2)
    assert b is not None and b.is_prefill and b.req_ids == [1]
    d.update()
    t = 12.0
    while d.busy():
        t += 0.1
        if d.schedule(now=t) is not None:
            d.update()
    d.check_against_oracle()


def test_delay_factor_passes_when_nothing_runs() -> None:
    d = make_driver(num_blocks=32, block_size=BS, scheduler_delay_factor=100.0)
    d.add(0, prompt(4), sp(max_tokens=1), arrival_time=50.0)
    b = d.schedule(now=50.0)
    assert b is not None and b.req_ids == [0]
    d.update()


def test_delay_factor_zero_ignores_time() -> None:
    d = make_driver(num_blocks=32, block_size=BS)
    d.add(0, prompt(4, 100), sp(max_tokens=10), arrival_time=10.0)
    d.schedule(now=10.0)
    d.update()
    d.add(1, prompt(4, 200), sp(max_tokens=3), arrival_time=10.99)
    b = d.schedule(now=11.0)
    assert b is not None and b.is_prefill and b.req_ids == [1]
    d.update()


# ---------------------------------------------------------------------------------------------
# Per-request state slots
# ---------------------------------------------------------------------------------------------


def test_state_slot_exhaustion_blocks_admission() -> None:
    d = make_driver(num_blocks=32, block_size=BS, num_state_slots=1)
    d.add(0, prompt(4, 100), sp(max_tokens=2))
    d.add(1, prompt(4, 200), sp(max_tokens=2))
    b = d.schedule()
    assert b is not None and b.req_ids == [0] and b.state_slots == [0]
    assert d.sched.num_waiting == 1
    d.update()
    b = d.schedule()
    assert b is not None and not b.is_prefill and b.req_ids == [0] and b.state_slots == [0]
    d.update()  # 0 finishes, its slot is free again
    b = d.schedule()
    assert b is not None and b.is_prefill and b.req_ids == [1] and b.state_slots == [0]
    d.update()
    d.run()
    d.check_all_done()
    d.check_against_oracle()


def test_state_slots_are_distinct_and_cost_no_blocks() -> None:
    d = make_driver(num_blocks=2 + 1, block_size=BS, num_state_slots=2)
    d.add(0, prompt(4, 100), sp(max_tokens=1))
    d.add(1, prompt(4, 200), sp(max_tokens=1))
    b = d.schedule()
    assert b is not None and b.req_ids == [0, 1]
    assert sorted(b.state_slots) == [0, 1]
    assert d.sched.num_free_blocks == 0
    d.update()
    d.check_all_done()


def test_no_state_slots_configured_means_minus_one() -> None:
    d = make_driver(num_blocks=8, block_size=BS)
    d.add(0, prompt(4), sp(max_tokens=3))
    d.run()
    assert all(s == -1 for r in d.batches for s in r.state_slots)
