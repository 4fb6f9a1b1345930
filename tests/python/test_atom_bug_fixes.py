"""One test per ATOM bug that DESIGN.md section 5 fixes in the core (numbers: spec section 8).

Each docstring says what ATOM did and why the test would fail on ATOM's behaviour. The driver
(support.Driver) also checks, in every test, that each streamed token is the model's token for
that position (no placeholder, no lost or duplicated token), that prefill rows carry exactly the
request's real tokens, and that every log-probability lines up with its token.
"""

from __future__ import annotations

import pytest
from support import (
    EOS,
    Driver,
    cdiv,
    event_kind,
    make_driver,
    prompt,
    sp,
)

import atom_sched  # noqa: E402

BS = 4


# ---------------------------------------------------------------------------------------------
# 8.1 preemption with outputs in flight
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 2])
def test_8_1_preemption_with_outputs_in_flight(k: int) -> None:
    """8.1: ATOM preempts in schedule() after postprocess appended placeholder tokens (the EOS
    id) for the in-flight step, strips the wrong number of them (none at all without MTP), and
    drops the in-flight output of the victim. The victim is then re-prefilled with an EOS
    placeholder as if it were a real token (e.g. [20, 21, 22, 200, E]) and its output skips a
    token. Here, one step ahead with a pool small enough to preempt every few steps: every
    re-prefill row must carry exactly the real tokens (the driver checks prefill rows against
    prompt + streamed tokens, so a placeholder fails), and every request's streamed tokens must
    be the model's token sequence with nothing lost, which ATOM's dropped output breaks."""
    kw = dict(num_blocks=6, block_size=BS, enable_prefix_caching=False,
              num_speculative_tokens=k, eos_token_id=EOS, max_model_len=20)
    for mode in ("async", "sync"):
        d = make_driver(mode, **kw)
        for r in range(4):
            d.add(r, prompt(3, 100 * (r + 1)), sp(max_tokens=10))
        d.run()
        d.check_all_done()
        d.check_against_oracle()
        assert d.sched.stats()["num_preemptions"] > 0, mode
        for rec in d.batches:
            if rec.is_prefill:
                assert (rec.scheduled_tokens >= 0).all()
                assert EOS not in rec.scheduled_tokens.tolist()


def test_8_1_preempted_victim_keeps_its_in_flight_token() -> None:
    """8.1, deterministic: request 1 is preempted while the batch holding its first decode is
    in flight. ATOM loses that output (postprocess only walks `running`) and re-prefills
    [prompt, E]. Here the token that batch produces is kept: the re-prefill row holds the prompt
    and both generated tokens, and emits the third."""
    d = make_driver("async", num_blocks=3, block_size=BS, enable_prefix_caching=False,
                    eos_token_id=EOS)
    d.add(0, prompt(3, 100), sp(max_tokens=3))
    d.add(1, prompt(3, 200), sp(max_tokens=3))
    d.schedule()  # b1: prefill both (1 block each); outputs in flight
    b2 = d.schedule()  # b2: decode position 3 (first block) for both
    assert b2 is not None and b2.req_ids == [0, 1]
    d.update()  # b1 -> token 0 for both
    b3 = d.schedule()  # position 4 needs a 2nd block: 0 takes the last one, 1 preempts itself
    assert b3 is not None and b3.req_ids == [0]
    assert d.sched.stats()["num_preemptions"] == 1
    d.update()  # b2 -> token 1 for both, 1 included although it is preempted
    assert len(d.tokens[1]) == 2
    d.run()
    d.check_against_oracle()
    re = [r for r in d.batches if r.is_prefill and 1 in r.req_ids][-1]
    i = re.row(1)
    assert re.num_cached_tokens[i] == 0
    assert re.row_tokens(i) == prompt(3, 200) + d.model.sequence(1, 2)


# ---------------------------------------------------------------------------------------------
# 8.2 chunked re-prefill of a preempted request
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_8_2_chunked_reprefill_covers_generated_tokens(mode: str) -> None:
    """8.2: ATOM sizes Phase-1 chunks and the partial-prefill flag by the *prompt* length, so a
    preempted request (prompt 3 + 2 generated = 5 tokens) re-admitted with a 4-token chunk is
    taken as fully prefilled after that chunk: position 4 never gets KV and the chunk's garbage
    sample is appended as a real token. Here the prefill target is all 5 tokens: chunks of 4
    (emits nothing) then 1 (emits), and the output continues with the right token."""
    d = make_driver(mode, num_blocks=3, block_size=BS, enable_prefix_caching=False,
                    max_num_batched_tokens=4)
    d.add(0, prompt(3, 100), sp(max_tokens=3))
    d.add(1, prompt(3, 200), sp(max_tokens=5))
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    assert d.sched.stats()["num_preemptions"] >= 1
    re = [r for r in d.batches if r.is_prefill and 1 in r.req_ids][-2:]
    chunks = [(r.num_cached_tokens[r.row(1)], r.num_scheduled_tokens[r.row(1)],
               r.emits_token[r.row(1)]) for r in re]
    assert chunks == [(0, 4, False), (4, 1, True)]


# ---------------------------------------------------------------------------------------------
# 8.3 partial prefills and the prefill veto
# ---------------------------------------------------------------------------------------------


def test_8_3_partial_prefill_is_not_decoded_when_prefill_is_vetoed() -> None:
    """8.3: with the PrefillDelayer's veto (allow_prefill=False), ATOM's decode loop takes every
    running sequence, including one whose prefill is only partly done, and decodes its last
    prompt token over KV that was never computed. Here the partial request is skipped: the
    decode batch holds only the request that finished its prefill, and the partial one resumes
    where it stopped once prefill is allowed again."""
    d = make_driver(num_blocks=32, block_size=BS, max_num_batched_tokens=8)
    d.add(0, prompt(4, 100), sp(max_tokens=5))
    d.add(1, prompt(20, 200), sp(max_tokens=5))
    b1 = d.schedule()
    assert b1 is not None and b1.req_ids == [0, 1] and b1.emits_token == [True, False]
    d.update()
    b2 = d.schedule(allow_prefill=False)
    assert b2 is not None and not b2.is_prefill and b2.req_ids == [0]
    d.update()
    b3 = d.schedule()
    assert b3 is not None and b3.is_prefill and b3.req_ids == [1]
    assert b3.num_cached_tokens == [4] and b3.num_scheduled_tokens == [8]
    d.update()
    d.run()
    d.check_against_oracle()


def test_8_3_only_partial_prefills_and_veto_gives_no_batch() -> None:
    """8.3: with nothing but a partial prefill running and prefill vetoed there is no row to
    run; ATOM would schedule the partial request as a decode."""
    d = make_driver(num_blocks=32, block_size=BS, max_num_batched_tokens=8)
    d.add(0, prompt(20, 100), sp(max_tokens=2))
    d.schedule()
    d.update()
    assert d.schedule(allow_prefill=False) is None
    assert d.sched.num_running == 1
    d.run()
    d.check_against_oracle()


def test_8_3_veto_keeps_waiting_requests_waiting() -> None:
    """8.3: a veto skips Phase 1 and Phase 2 (ATOM's too); the waiting request is not admitted
    and the decode batch is built from running requests only. On ATOM this passes as well; it
    pins the part of the veto that is kept while the partial-prefill skip above is fixed."""
    d = make_driver(num_blocks=32, block_size=BS)
    d.add(0, prompt(4, 100), sp(max_tokens=4))
    d.schedule()
    d.update()
    d.add(1, prompt(4, 200), sp(max_tokens=4))
    b = d.schedule(allow_prefill=False)
    assert b is not None and not b.is_prefill and b.req_ids == [0]
    assert d.sched.num_waiting == 1
    d.update()
    d.run()
    d.check_against_oracle()


# ---------------------------------------------------------------------------------------------
# 8.6 / 8.7 exact block reservation
# ---------------------------------------------------------------------------------------------


def test_8_6_no_over_reservation_at_a_block_boundary() -> None:
    """8.6: ATOM's can_append(seq, n) asks for blocks covering len(seq) + n tokens, n more than
    the step writes. A 3-token prompt in a 1-block pool (block size 4): its first decode writes
    position 3, still in block 0, but ATOM demands a 2nd block, finds none and preempts the
    request (which then can never run). Here it decodes without preemption."""
    d = make_driver(num_blocks=1 + 1, block_size=BS)
    d.add(0, prompt(3), sp(max_tokens=2))
    d.run()
    assert d.reasons == {0: "max_tokens"}
    assert d.sched.stats()["num_preemptions"] == 0
    assert [r.is_prefill for r in d.batches] == [True, False]


def test_8_6_no_over_reservation_with_drafts() -> None:
    """8.6 with K = 1: a 2-token prompt; the first decode writes positions 2 and 3 (block 0).
    ATOM's can_append(len + K + 1) wants a 2nd block and preempts in a 1-block pool."""
    d = make_driver(num_blocks=1 + 1, block_size=BS, num_speculative_tokens=1)
    d.model.accept = 1
    d.add(0, prompt(2), sp(max_tokens=2))
    d.run()
    assert d.reasons == {0: "max_tokens"}
    assert d.sched.stats()["num_preemptions"] == 0


def _check_exact_blocks(d: Driver, bs: int) -> None:
    """After each schedule of a single-request run: blocks held == ceil(context / bs)."""
    while d.busy():
        rec = d.schedule()
        assert rec is not None
        assert d.cfg is not None
        held = d.sched.num_usable_blocks - d.sched.num_free_blocks
        assert held == cdiv(rec.context_lens[0], bs), (rec.context_lens, held)
        d.update()


@pytest.mark.parametrize("accept", [1, 2, 4, None])
def test_8_7_exact_reservation_block_size_2_k_3(accept: int | None) -> None:
    """8.7: ATOM's may_append allocates only when 0 < len % bs <= n, so with block size 2 and
    K = 3 (4 positions per decode row) a step that starts at a block boundary gets no new block
    although it writes 2 blocks further: its KV goes to slots it does not own. 8.6's
    over-reservation makes it preempt in a pool that fits exactly. Here, every step holds exactly
    ceil(context / bs) blocks, every slot of the batch lies in the row's own blocks (the driver
    checks slot_mapping against block_tables), and a pool of exactly the blocks the longest step
    needs runs with no preemption."""
    k, bs = 3, 2
    # prompt 3, max_tokens 5: the last decode starts at most at R = 7 -> context 6 + 4 = 10.
    d = make_driver(num_blocks=5 + 1, block_size=bs, num_speculative_tokens=k)
    d.model.accept = accept
    d.add(0, prompt(3), sp(max_tokens=5))
    _check_exact_blocks(d, bs)
    assert d.reasons == {0: "max_tokens"} and len(d.tokens[0]) == 5
    assert d.sched.stats()["num_preemptions"] == 0
    d.check_all_done()
    d.check_against_oracle()


def test_8_7_exact_reservation_many_requests() -> None:
    """8.6/8.7 with several requests, block size 2, K = 3: invariants and slot checks after every
    step, then no leak."""
    d = make_driver(num_blocks=20, block_size=2, num_speculative_tokens=3,
                    enable_prefix_caching=False)
    for r in range(4):
        d.add(r, prompt(1 + 2 * r, 100 * (r + 1)), sp(max_tokens=9))
    d.run()
    d.check_all_done()
    d.check_against_oracle()


# ---------------------------------------------------------------------------------------------
# 8.8 max_model_len during decode; 8.10 max_tokens under MTP
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 3])
def test_8_8_max_model_len_stops_decode(mode: str, k: int) -> None:
    """8.8: ATOM has no max_model_len stop in decode: a request grows past max_model_len (and
    overflows block-table rows sized for it) until max_tokens. Here it stops with
    "max_model_len" exactly when its total length reaches the limit, also when K drafts are
    accepted at once (the extra tokens are dropped)."""
    d = make_driver(mode, num_blocks=16, block_size=BS, max_model_len=10,
                    num_speculative_tokens=k)
    d.model.accept = k + 1
    d.add(0, prompt(8), sp(max_tokens=100))
    d.run()
    assert d.reasons == {0: "max_model_len"}
    assert 8 + len(d.tokens[0]) == 10
    d.check_all_done()
    d.check_against_oracle()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 6])
def test_8_10_no_max_tokens_overshoot_under_mtp(mode: str, max_tokens: int) -> None:
    """8.10: ATOM checks max_tokens after appending all accepted tokens and never truncates, so
    with K = 3 and every draft accepted a request asked for 3 tokens gets 5. Here it gets
    exactly max_tokens."""
    k = 3
    d = make_driver(mode, num_blocks=16, block_size=BS, num_speculative_tokens=k)
    d.model.accept = k + 1
    d.add(0, prompt(4), sp(max_tokens=max_tokens))
    d.run()
    assert d.reasons == {0: "max_tokens"}
    assert d.tokens[0] == d.model.sequence(0, max_tokens)


# ---------------------------------------------------------------------------------------------
# 8.11 / 8.12 stop semantics
# ---------------------------------------------------------------------------------------------


def _run_k3(overrides: dict[int, int], cfg: dict | None = None, **params) -> Driver:
    k = 3
    cfg = dict(num_blocks=32, block_size=BS, eos_token_id=EOS, num_speculative_tokens=k) | (
        cfg or {}
    )
    d = make_driver(**cfg)
    d.model.accept = k + 1
    d.model.overrides = {(0, g): t for g, t in overrides.items()}
    d.add(0, params.pop("prompt", prompt(4)), sp(**params))
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    return d


def test_8_11_earliest_stop_sequence_wins() -> None:
    """8.11: ATOM scans the stop sequences in list order and, for each, the new tokens from the
    last backwards, so with new tokens [20, 5, 6, 7] and stop sequences [[6, 7], [5]] it stops at
    the end of [6, 7] and keeps all four. The earliest stop is [5] at the 2nd token: the output
    ends there."""
    d = _run_k3({1: 20, 2: 5, 3: 6, 4: 7}, max_tokens=20, stop_token_sequences=[[6, 7], [5]])
    assert d.reasons[0] == "stop_sequence"
    assert d.tokens[0][1:] == [20, 5]


def test_8_11_stop_sequence_never_reaches_into_the_prompt() -> None:
    """8.11: ATOM's match window spans the prompt, so a prompt ending in 6 and a first generated
    token 7 matches the stop sequence [6, 7] at once. Only generated tokens count here."""
    k = 0
    d = make_driver(num_blocks=32, block_size=BS, num_speculative_tokens=k)
    d.model.overrides = {(0, 0): 7}
    d.add(0, prompt(3) + [6], sp(max_tokens=4, stop_token_sequences=[[6, 7]]))
    d.run()
    assert d.reasons[0] == "max_tokens" and len(d.tokens[0]) == 4
    d.check_against_oracle()


def test_8_11_stop_sequence_within_one_mtp_row() -> None:
    """8.11 (control): a stop sequence [6, 7] at new tokens 1-2 of the row [6, 7, 8, x]. ATOM's
    backwards scan finds this one too and truncates after 7, so this passes on ATOM as well; it
    pins that the forward (earliest-stop) scan still cuts the rest of the row."""
    d = _run_k3({1: 6, 2: 7, 3: 8}, max_tokens=20, stop_token_sequences=[[6, 7]])
    assert d.reasons[0] == "stop_sequence" and d.tokens[0][1:] == [6, 7]


def test_8_11_stop_sequence_spanning_two_mtp_rows() -> None:
    """8.11 (control): a stop sequence whose first token ends one MTP row and whose second starts
    the next stops the request after its last token. ATOM's window also reaches back into earlier
    generated tokens, so this passes on ATOM too; it guards the fixed scan, which must look back
    across rows while never reaching into the prompt (the test above)."""
    # Row 1 = g1..g4 ends with 6, row 2 starts with 7.
    d = _run_k3({4: 6, 5: 7}, max_tokens=20, stop_token_sequences=[[6, 7]])
    assert d.reasons[0] == "stop_sequence" and len(d.tokens[0]) == 6


def test_8_12_earliest_stop_token_wins_over_a_later_eos() -> None:
    """8.12: ATOM checks EOS anywhere in the new tokens before stop token ids, so new tokens
    [30, 99, EOS, 40] with stop id 99 end as "eos" with [30, 99, EOS]. The earliest stop wins:
    "stop_99" after [30, 99]."""
    d = _run_k3({1: 30, 2: 99, 3: EOS, 4: 40}, cfg=dict(stop_token_ids=[99]), max_tokens=20)
    assert d.reasons[0] == "stop_99"
    assert d.tokens[0][1:] == [30, 99]


def test_8_12_earliest_eos_wins_over_a_later_stop_token() -> None:
    """8.12 (control): the mirror case, EOS before a stop id in one MTP row, ends at EOS. ATOM
    agrees here (EOS is checked first and truncation keeps up to it); together with the test
    above it shows the order is by position, not by kind."""
    d = _run_k3({1: 30, 2: EOS, 3: 99}, cfg=dict(stop_token_ids=[99]), max_tokens=20)
    assert d.reasons[0] == "eos" and d.tokens[0][1:] == [30, EOS]


def test_8_12_ignore_eos_keeps_stop_token_ids() -> None:
    """8.12: ATOM's ignore_eos also disables stop_token_ids (both sit behind `not ignore_eos`),
    so this request would run to max_tokens. ignore_eos ignores only EOS: "stop_99"."""
    d = make_driver(num_blocks=32, block_size=BS, eos_token_id=EOS, stop_token_ids=[99])
    d.model.overrides = {(0, 1): EOS, (0, 2): 99}
    d.add(0, prompt(4), sp(max_tokens=10, ignore_eos=True))
    d.run()
    assert d.reasons[0] == "stop_99" and d.tokens[0][1:] == [EOS, 99]
    d.check_against_oracle()


def test_8_12_ignore_eos_keeps_request_stop_ids_under_mtp() -> None:
    """8.12: with ignore_eos ATOM also ignores the request's stop_token_ids; here EOS is appended
    as a normal token and the later stop id 77 still stops the request."""
    d = _run_k3({1: EOS, 2: 55, 3: 77}, max_tokens=20, ignore_eos=True, stop_token_ids=[77])
    assert d.reasons[0] == "stop_77" and d.tokens[0][1:] == [EOS, 55, 77]


def test_8_12_max_tokens_truncates_before_a_later_stop() -> None:
    """8.10/8.12: max_tokens is reached by the 2nd token; ATOM would look at the whole MTP row, find
    the stop id 99 later in it and report "stop_99" with extra tokens. The earliest stop is
    max_tokens, and the row is cut there."""
    d = _run_k3({1: 30, 2: 31, 3: 99}, cfg=dict(stop_token_ids=[99]), max_tokens=2)
    assert d.reasons[0] == "max_tokens" and d.tokens[0][1:] == [30]


# ---------------------------------------------------------------------------------------------
# 8.13 logprobs under MTP
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_8_13_logprobs_aligned_with_tokens_under_mtp(mode: str, k: int) -> None:
    """8.13: ATOM overwrites only the last logprob each step and appends K+1-r zeros as
    placeholders, so with MTP the logprob list neither has one entry per token nor the right
    values, and preemption does not strip it. Here each streamed chunk carries exactly one
    logprob per token, equal to the value passed for that accepted position, across varying
    acceptance, stop truncation and preemption (a small pool)."""
    d = make_driver(mode, num_blocks=7, block_size=BS, num_speculative_tokens=k,
                    eos_token_id=EOS, enable_prefix_caching=False, max_model_len=24)
    d.model.logprobs = True
    for r in range(3):
        d.add(r, prompt(3 + r, 100 * (r + 1)), sp(max_tokens=7 + r, logprobs=True))
    d.add(3, prompt(3, 900), sp(max_tokens=9))  # no logprobs asked (test_api checks None)
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    for r in range(3):
        assert len(d.logprobs[r]) == len(d.tokens[r])
        assert d.logprobs[r] == [d.model.logprob(r, g) for g in range(len(d.tokens[r]))]


def test_8_13_logprobs_with_stop_truncation() -> None:
    """8.13: when EOS truncates an MTP row, ATOM still has one overwritten logprob per step plus
    placeholder zeros; here the logprobs are cut with the tokens: one per streamed token."""
    k = 3
    d = make_driver(num_blocks=16, block_size=BS, num_speculative_tokens=k, eos_token_id=EOS)
    d.model.logprobs = True
    d.model.accept = k + 1
    d.model.overrides = {(0, 2): EOS}
    d.add(0, prompt(4), sp(max_tokens=20, logprobs=True))
    d.run()
    assert d.reasons[0] == "eos" and len(d.tokens[0]) == 3
    assert d.logprobs[0] == [d.model.logprob(0, g) for g in range(3)]


# ---------------------------------------------------------------------------------------------
# 8.17 get_next_batch_info
# ---------------------------------------------------------------------------------------------


def _info(d: Driver) -> tuple[bool, int, int]:
    i = d.sched.get_next_batch_info()
    return (bool(i[0]), int(i[1]), int(i[2]))


def test_8_17_next_batch_info_decode_counts_k_and_rows() -> None:
    """8.17: ATOM reports a decode as (False, len(running), len(running)), ignoring K (tokens
    are rows * (K+1)) and max_num_seqs. Here it is what schedule() does."""
    k = 2
    d = make_driver(num_blocks=32, block_size=BS, num_speculative_tokens=k)
    for r in range(3):
        d.add(r, prompt(4, 100 * (r + 1)), sp(max_tokens=10))
    assert _info(d) == (True, 12, 3)
    d.schedule()
    d.update()
    assert _info(d) == (False, 3 * (k + 1), 3)
    rec = d.schedule()
    assert rec is not None and rec.summary() == (False, 9, 3)
    d.update()


def test_8_17_next_batch_info_counts_prefix_hits() -> None:
    """8.17: ATOM's estimate ignores prefix-cache hits (num_tokens - num_cached_tokens with
    num_cached_tokens still 0 while waiting)."""
    d = make_driver(num_blocks=32, block_size=BS)
    p = prompt(9)
    d.add(0, p, sp(max_tokens=1))
    d.run()
    d.add(1, p, sp(max_tokens=1))
    assert _info(d) == (True, 1, 1)
    rec = d.schedule()
    assert rec is not None and rec.summary() == (True, 1, 1)
    d.update()


def test_8_17_next_batch_info_with_an_oversized_head() -> None:
    """8.17: with an oversized request at the head of waiting ATOM answers (True, 0, 0) although
    schedule() rejects it and admits the requests behind it."""
    d = make_driver(num_blocks=32, block_size=BS, max_model_len=16)
    d.add(0, prompt(17), sp())
    d.add(1, prompt(5), sp(max_tokens=2))
    assert _info(d) == (True, 5, 1)
    rec = d.schedule()
    assert rec is not None and rec.summary() == (True, 5, 1)
    d.update()
    d.run()


def test_8_17_next_batch_info_partial_prefill_and_budget() -> None:
    """8.17: ATOM reports a partial prefill as (True, min(remaining, budget), 1), ignoring the
    waiting requests that Phase 2 admits into the rest of the budget in the same batch (here 4
    left of request 0 plus 3 of request 1: (True, 7, 2))."""
    d = make_driver(num_blocks=32, block_size=BS, max_num_batched_tokens=8)
    d.add(0, prompt(12), sp(max_tokens=2))
    d.add(1, prompt(3, 300), sp(max_tokens=2))
    assert _info(d) == (True, 8, 1)
    d.schedule()
    d.update()
    assert _info(d) == (True, 7, 2)  # 4 left of 0, then 3 of 1
    d.run()  # the driver compares info and schedule() at every step


def test_8_17_next_batch_info_max_num_seqs() -> None:
    """8.17: with max_num_seqs bounding the running set (8.40) the first batch admits 2 of 4
    requests; ATOM's estimate counts waiting prompts up to the budget only. The driver also
    compares get_next_batch_info() with every schedule() of the run."""
    d = make_driver(num_blocks=64, block_size=BS, max_num_seqs=2)
    for r in range(4):
        d.add(r, prompt(3, 100 * (r + 1)), sp(max_tokens=3))
    assert _info(d) == (True, 6, 2)
    d.run()
    d.check_against_oracle()


# ---------------------------------------------------------------------------------------------
# 8.18 / 8.19 per-row arrays aligned with rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_8_18_8_19_per_row_arrays_aligned_with_rows(mode: str) -> None:
    """8.18/8.19: ATOM's ScheduledBatch omits rows without drafts from
    scheduled_spec_decode_tokens, rows without a per-request cache group from
    per_req_cache_groups, and rows with an empty block table from block_tables, so row i of those
    no longer belongs to req_ids[i]. Here every per-row array has num_rows entries in row order:
    the driver checks each row's block table against its slots and positions, its sampling
    parameters against its request, and (synchronously) its drafts against the drafts that
    request was given; state slots are per row with -1 where none."""
    k = 2
    d = make_driver(mode, num_blocks=40, block_size=BS, num_speculative_tokens=k,
                    num_state_slots=3, max_num_batched_tokens=12)
    params = [
        sp(max_tokens=6, temperature=0.0, top_k=1),
        sp(max_tokens=9, top_p=0.5),
        sp(max_tokens=4, temperature=0.7, top_k=20, top_p=0.9),
        sp(max_tokens=5),
    ]
    for r, p in enumerate(params):
        d.add(r, prompt(2 + 3 * r, 100 * (r + 1)), p)
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    for rec in d.batches:
        n = rec.num_rows
        assert len(rec.state_slots) == n and all(0 <= s < 3 for s in rec.state_slots)
        assert len(set(rec.state_slots)) == n
        assert rec.block_tables.shape[0] == n and rec.spec_draft_tokens.shape[0] == n
        if not rec.is_prefill:
            assert rec.spec_draft_tokens.shape == (n, k)
            if mode == "sync":
                for i in range(len(rec.req_ids)):
                    assert list(rec.spec_draft_tokens[i]) == rec.row_tokens(i)[1:]


# ---------------------------------------------------------------------------------------------
# 8.29 free list without duplicates
# ---------------------------------------------------------------------------------------------


def test_8_29_free_list_is_lru_without_stale_duplicates() -> None:
    """8.29: ATOM's free list is a deque with lazy deletion: a block freed, claimed again by a
    cache hit (its deque entry goes stale, not removed) and freed again sits in the deque twice
    and is popped at its *earlier* position, so it is evicted before blocks freed before it and
    its cached prefix is lost. Pool of 4 blocks (block size 4):
      A = P + [x] (P one full block): blocks [0, 1]; finishes; freed last-first: free = 2 3 1 0
      B = P + [y]: hits block 0 (cached), takes 2; finishes: free = 3 1 2 0 (ATOM: 3 1 0* 2 0)
      C = 12 fresh tokens: takes 3 blocks, 3 1 2 here; ATOM takes 3 1 0 and evicts P
      D = P + [z]: hits P here (num_cached_tokens 4); on ATOM it misses.
    With KV events: no BlockRemoved while C takes its blocks (none of 3, 1, 2 holds a hash)."""
    d = make_driver(num_blocks=4 + 1, block_size=BS, enable_kv_events=True)
    p = prompt(4, 100)
    d.add(0, p + [5], sp(max_tokens=1))
    d.run()
    d.add(1, p + [6], sp(max_tokens=1))
    d.run()
    assert d.cached_first[1] == 4
    d.sched.take_events()
    d.add(2, prompt(12, 500), sp(max_tokens=1))
    d.schedule()
    assert [event_kind(e) for e in d.sched.take_events()] == []
    assert d.sched.num_free_blocks == 1
    d.update()
    d.add(3, p + [7], sp(max_tokens=1))
    d.run()
    assert d.cached_first[3] == 4
    d.check_all_done()


def test_8_29_free_block_count_and_ownership_stay_exact() -> None:
    """8.29: whatever the history of frees and cache hits, the blocks held by running requests
    (each table's blocks, shared prefix blocks counted once) plus the free count add up to the
    pool, and no block is owned twice by one table."""
    d = make_driver(num_blocks=10 + 1, block_size=BS, enable_prefix_caching=True)
    base = prompt(8, 100)
    for r in range(6):
        d.add(r, base[: 4 + 4 * (r % 2)] + prompt(1 + r, 1000 + 10 * r), sp(max_tokens=3 + r))

    checked = []

    def pre(dr: Driver, b: object, outputs: dict, rec) -> None:
        # Right after schedule(): a decode batch holding every running request shows every
        # block table that holds blocks.
        if dr.pending or rec.is_prefill or rec.num_rows != dr.sched.num_running:
            return
        held: set[int] = set()
        for i in range(rec.num_rows):
            nb = cdiv(rec.context_lens[i], BS)
            row = [int(x) for x in rec.block_tables[i, :nb]]
            assert len(set(row)) == nb
            held |= set(row)
        assert len(held) + dr.sched.num_free_blocks == 10
        checked.append(rec.id)

    d.pre_update = pre
    d.run()
    assert checked
    d.check_all_done()
    d.check_against_oracle()


# ---------------------------------------------------------------------------------------------
# 8.30 duplicate content published once
# ---------------------------------------------------------------------------------------------


def test_8_30_duplicate_content_is_published_once() -> None:
    """8.30: two identical prompts admitted in the same step both compute their blocks; ATOM's
    hash_blocks then publishes the same hashes twice (two BlockStored, the map overwritten, the
    first block orphaned) and later removes them once. Here the second copy is not registered:
    one BlockStored per hash, and every BlockRemoved matches an earlier BlockStored."""
    d = make_driver(num_blocks=6 + 1, block_size=BS, enable_kv_events=True)
    p = prompt(8, 100)
    h0 = atom_sched.block_hash(p[:4])
    h1 = atom_sched.block_hash(p[4:], h0)
    d.add(0, p, sp(max_tokens=1))
    d.add(1, p, sp(max_tokens=1))
    rec = d.schedule()
    assert rec is not None and rec.req_ids == [0, 1] and rec.num_cached_tokens == [0, 0]
    d.update()
    evs = d.sched.take_events()
    stored = [int(h) for e in evs if event_kind(e) == "BlockStored" for h in e.block_hashes]
    assert stored == [h0, h1]
    # A third copy hits both published blocks (the last block is a hit only with a 9th token).
    d.add(2, p + [9], sp(max_tokens=1))
    d.run()
    assert d.cached_first[2] == 8
    # Evict everything with fresh prompts, then balance stored against removed.
    d.add(3, prompt(24, 700), sp(max_tokens=1))
    d.run()
    evs += d.sched.take_events()
    live: set[int] = set()
    for e in evs:
        kind = event_kind(e)
        hs = [int(h) for h in e.block_hashes] if kind != "AllBlocksCleared" else []
        if kind == "BlockStored":
            assert not (set(hs) & live), f"hash stored twice: {set(hs) & live}"
            live |= set(hs)
        elif kind == "BlockRemoved":
            assert set(hs) <= live, f"removed without being stored: {set(hs) - live}"
            live -= set(hs)
    assert h0 not in live and h1 not in live


# ---------------------------------------------------------------------------------------------
# 8.35 stats with K
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_8_35_spec_stats(k: int) -> None:
    """8.35: ATOM's SpecStats.update raises KeyError for an accepted count outside 1..K+1 and
    divides by zero with K = 0. Here the counters are exact: acceptance_counts[a-1] counts the
    verified decode rows that accepted a tokens, drafts = K per row, accepted drafts = a - 1 per
    row; prefill outputs are not counted."""
    d = make_driver(num_blocks=64, block_size=BS, num_speculative_tokens=k)
    for r in range(3):
        d.add(r, prompt(4, 100 * (r + 1)), sp(max_tokens=200))
    d.schedule()
    d.update()
    counts = [0] * (k + 1)
    for _ in range(6):
        rec = d.schedule()
        assert rec is not None and not rec.is_prefill
        d.update()
        for a in rec.accepted:
            counts[a - 1] += 1
    st = d.sched.stats()
    rows = sum(counts)
    assert rows == 18
    assert list(st["acceptance_counts"]) == counts
    assert st["num_spec_steps"] == rows
    assert st["num_draft_tokens"] == k * rows
    acc = sum(i * c for i, c in enumerate(counts))
    assert st["num_accepted_draft_tokens"] == acc
    assert st["acceptance_rate"] == pytest.approx(acc / (k * rows))
    for r in range(3):
        d.abort(r)


def test_8_35_stats_without_drafts() -> None:
    """8.35: ATOM's SpecStats with mtp_k = 0 would divide by zero on its first log; here the
    acceptance rate without drafts is simply 0.0."""
    d = make_driver(num_blocks=16, block_size=BS)
    d.add(0, prompt(4), sp(max_tokens=5))
    d.run()
    st = d.sched.stats()
    assert st["acceptance_rate"] == 0.0
    assert st["num_draft_tokens"] == 0 and st["num_accepted_draft_tokens"] == 0
    assert st["prefix_hit_rate"] == 0.0


def test_8_35_stats_before_anything() -> None:
    """8.35: stats are readable before any step: rates are 0.0 (no division by zero) and the
    acceptance histogram has K+1 zero entries."""
    d = make_driver(num_blocks=16, block_size=BS, num_speculative_tokens=2)
    st = d.sched.stats()
    assert st["acceptance_rate"] == 0.0 and st["prefix_hit_rate"] == 0.0
    assert list(st["acceptance_counts"]) == [0, 0, 0]


# ---------------------------------------------------------------------------------------------
# 8.40 max_num_seqs bounds the running set
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_8_40_max_num_seqs_bounds_running(mode: str) -> None:
    """8.40: ATOM caps each batch at max_num_seqs but admits up to max_num_seqs new prefills
    per step whatever the size of `running` (29 running with a cap of 8 was seen); its decode
    loop then always takes the same first max_num_seqs from the head while the others hold KV
    and starve. Here the running set never exceeds max_num_seqs and every decode batch holds
    every running request that is not mid-prefill."""
    d = make_driver(mode, num_blocks=128, block_size=BS, max_num_seqs=3)
    for r in range(8):
        d.add(r, prompt(3 + r, 100 * (r + 1)), sp(max_tokens=4 + (r * 3) % 5))

    def hook(dr: Driver, it: int) -> bool:
        assert dr.sched.num_running <= 3
        return False

    d.run(hook=hook)
    assert d.max_running <= 3
    if mode == "sync":
        for rec in d.batches:
            if not rec.is_prefill:
                assert rec.num_rows == len(rec.req_ids) <= 3
    # Every request started decoding soon after its prefill: no starvation.
    d.check_all_done()
    d.check_against_oracle()


def test_8_40_every_running_request_decodes_every_step() -> None:
    """8.40: ATOM's decode loop takes the first max_num_seqs of a running set that can be larger,
    so the tail never decodes. Here, in every decode step, every running request has a row."""
    d = make_driver(num_blocks=128, block_size=BS, max_num_seqs=2)
    for r in range(4):
        d.add(r, prompt(4, 100 * (r + 1)), sp(max_tokens=5))
    while d.busy():
        running_before = d.sched.num_running
        rec = d.schedule()
        assert rec is not None
        if not rec.is_prefill:
            assert rec.num_rows == running_before == d.sched.num_running
        d.update()
    d.check_all_done()

