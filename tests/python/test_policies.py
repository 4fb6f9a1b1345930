"""Issue 11 items 1, 3 and 5: the policy seam through the Python API. Priority scheduling (vLLM's
semantics: waiting ordered by (priority, arrival), the preemption victim the running request with
the lowest priority, latest arrival first), long_prefill_token_threshold, and the readiness probe
that calls the admission rule. Runs go through the Driver (invariants, queues in service order
included, and batch checks after every call) and end with the oracle's tokens and reasons, in
both step protocols, with and without drafts."""

import copy
import pickle

import numpy as np
import pytest
from support import admission_order, make_driver, prompt, sp, state_snapshot

from atom_sched import SamplingParams, Scheduler, SchedulerConfig


def test_config_fields_are_validated_and_kept():
    c = SchedulerConfig(num_blocks=16, scheduling="priority", long_prefill_token_threshold=32)
    assert c.scheduling == "priority" and c.long_prefill_token_threshold == 32
    assert "scheduling='priority'" in repr(c)
    for d in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
        assert d.scheduling == "priority" and d.long_prefill_token_threshold == 32
    assert SchedulerConfig(num_blocks=16).scheduling == "fcfs"
    with pytest.raises(ValueError,
                       match="scheduling must be 'fcfs', 'priority', 'sjf' or 'fair', got 'lifo'"):
        SchedulerConfig(num_blocks=16, scheduling="lifo")
    with pytest.raises(ValueError, match="scheduling must be"):
        c.scheduling = "FCFS"
    assert c.scheduling == "priority"
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        Scheduler(SchedulerConfig(num_blocks=16, long_prefill_token_threshold=-1))
    with pytest.raises(ValueError, match="needs enable_chunked_prefill=True"):
        Scheduler(SchedulerConfig(num_blocks=16, long_prefill_token_threshold=8,
                                  enable_chunked_prefill=False))


def test_priority_is_kept_and_refused_without_priority_scheduling():
    p = SamplingParams(priority=-3)
    assert p.priority == -3 and "priority=-3" in repr(p)
    assert pickle.loads(pickle.dumps(p)).priority == -3
    assert SamplingParams().priority == 0
    s = Scheduler(SchedulerConfig(num_blocks=16))
    s.add_request(0, prompt(4), SamplingParams())
    before = state_snapshot(s)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        s.add_request(1, prompt(4), SamplingParams(priority=1))
    assert state_snapshot(s) == before and s.waiting_ids() == [0]
    s.check_invariants()
    s.add_request(1, prompt(4), SamplingParams())  # the id was not taken


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_arrival_time_must_be_finite(bad):
    s = Scheduler(SchedulerConfig(num_blocks=16, scheduling="priority"))
    with pytest.raises(ValueError, match="arrival_time must be finite"):
        s.add_request(0, prompt(4), SamplingParams(), arrival_time=bad)
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 3])
def test_priority_admits_by_priority_then_arrival(mode, k):
    # One prompt per step (budget 8, no chunking): the admission order is the service order.
    d = make_driver(mode, num_blocks=64, block_size=4, scheduling="priority",
                    enable_chunked_prefill=False, max_num_batched_tokens=8,
                    num_speculative_tokens=k)
    prios = {0: 2, 1: 0, 2: 1, 3: 0, 4: -1}
    arrivals = {0: 1.0, 1: 3.0, 2: 2.0, 3: 2.5, 4: 9.0}
    for rid in prios:
        d.add(rid, prompt(8, 100 * rid), sp(priority=prios[rid], max_tokens=4),
              arrival_time=arrivals[rid])
    assert d.sched.waiting_ids() == [4, 3, 1, 2, 0]
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    assert admission_order(d) == [4, 3, 1, 2, 0]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 2])
def test_priority_preempts_the_lowest_priority_latest_arrival(mode, k):
    # 5 usable blocks of 4 tokens; three one-block prompts, then every decode needs more blocks.
    d = make_driver(mode, num_blocks=6, block_size=4, scheduling="priority",
                    enable_prefix_caching=False, num_speculative_tokens=k)
    d.add(0, prompt(4, 100), sp(priority=0, max_tokens=12), arrival_time=0.0)
    d.add(1, prompt(4, 200), sp(priority=1, max_tokens=12), arrival_time=5.0)
    d.add(2, prompt(4, 300), sp(priority=1, max_tokens=12), arrival_time=1.0)
    first_victim = None
    while d.busy():
        running = d.sched.running_ids()
        d.step()
        preempted = [r for r in running if r in d.sched.waiting_ids()]
        if preempted and first_victim is None:
            first_victim = preempted
    d.check_all_done()
    d.check_against_oracle()
    assert d.sched.stats()["num_preemptions"] > 0
    # The latest arrival among the lowest priority (1, at t=5) goes first, not the last admitted.
    assert first_victim == [1]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 3])
def test_long_prefill_threshold_caps_every_prefill_row(mode, k):
    d = make_driver(mode, num_blocks=128, block_size=4, max_num_batched_tokens=64,
                    long_prefill_token_threshold=12, num_speculative_tokens=k)
    for rid, n in enumerate([50, 30, 7, 13]):
        d.add(rid, prompt(n, 100 * rid), sp(max_tokens=5))
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    prefill_rows = [(rid, n) for b in d.batches if b.is_prefill
                    for rid, n in zip(b.req_ids, b.num_scheduled_tokens, strict=True)]
    assert prefill_rows and max(n for _, n in prefill_rows) == 12
    assert sum(n for rid, n in prefill_rows if rid == 0) == 50
    assert [n for rid, n in prefill_rows if rid == 2] == [7]


def test_readiness_probe_counts_a_chunked_admission():
    # Budget 16, chunked: the loop admits 12 tokens of the first and 4 of the second, so the
    # probe counts both (it used to stop at the first prompt that did not fit whole).
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=16))
    s.add_request(0, prompt(12, 100), SamplingParams())
    s.add_request(1, prompt(12, 200), SamplingParams())
    s.add_request(2, prompt(12, 300), SamplingParams())
    assert s.count_admittable_head_prefills(4) == 2
    b = s.schedule()
    assert list(b.req_ids) == [0, 1] and list(b.num_scheduled_tokens) == [12, 4]


def test_readiness_probe_applies_the_long_prefill_cap():
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_num_batched_tokens=16,
                                  long_prefill_token_threshold=4))
    for rid in range(5):
        s.add_request(rid, prompt(12, 100 * rid), SamplingParams())
    assert s.count_admittable_head_prefills(4) == 4
    assert list(s.schedule().num_scheduled_tokens) == [4, 4, 4, 4]


# ---- mixed batches (policy="mixed") ---------------------------------------------------------


def test_policy_is_a_validated_config_field():
    c = SchedulerConfig(num_blocks=16, policy="mixed")
    assert c.policy == "mixed" and "policy='mixed'" in repr(c)
    assert pickle.loads(pickle.dumps(c)).policy == "mixed"
    assert SchedulerConfig(num_blocks=16).policy == "atom"
    with pytest.raises(ValueError, match="policy must be 'atom' or 'mixed', got 'sarathi'"):
        SchedulerConfig(num_blocks=16, policy="sarathi")


def emission_steps(d) -> dict[int, list[int]]:
    """For each request, the indices of the batches in which it emitted a token."""
    steps: dict[int, list[int]] = {}
    for i, b in enumerate(d.batches):
        for rid, emits in zip(b.req_ids, b.emits_token, strict=True):
            if emits:
                steps.setdefault(rid, []).append(i)
    return steps


def staggered_run(policy: str, mode: str, k: int):
    # A large pool (no preemption) and a budget that holds every decode row: prompts of 40
    # tokens arrive every 3 steps while earlier requests decode.
    d = make_driver(mode, num_blocks=256, block_size=4, max_num_seqs=8,
                    max_num_batched_tokens=24, num_speculative_tokens=k, policy=policy)

    def hook(dr, it):
        if it % 3 == 0 and it // 3 < 6:
            rid = it // 3
            dr.add(rid, prompt(40, 100 * rid + 1), sp(max_tokens=12, ignore_eos=True))
        return it < 15

    d.run(hook=hook)
    d.check_all_done()
    d.check_against_oracle()
    return d


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 2])
def test_mixed_batches_never_stall_a_running_request(mode, k):
    mixed = staggered_run("mixed", mode, k)
    assert any(not b.is_prefill and any(b.row_is_prefill) for b in mixed.batches)
    for rid, steps in emission_steps(mixed).items():
        gaps = {b - a for a, b in zip(steps, steps[1:], strict=False)}
        assert gaps <= {1}, f"request {rid} skipped a step under mixed batches: {steps}"
    # ATOM's policy stalls running requests for every prefill step of a new prompt.
    atom = staggered_run("atom", mode, k)
    assert all(b.is_prefill or not any(b.row_is_prefill) for b in atom.batches)
    assert any(len({b - a for a, b in zip(s, s[1:], strict=False)} - {1}) > 0
               for s in emission_steps(atom).values())
    assert atom.results() == mixed.results(), "the policy changes when, never what"


# ---- variable-length drafts through the binding ---------------------------------------------


def test_draft_padding_is_a_suffix_and_a_refusal_changes_nothing():
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, num_speculative_tokens=3))
    s.add_request(0, prompt(6), SamplingParams(max_tokens=20, ignore_eos=True))
    b = s.schedule()
    sampled = np.full((1, 4), 7, np.int32)
    for bad in ([-1, 5, -1], [5, -2, -1], [-7, -1, -1]):
        before = state_snapshot(s)
        with pytest.raises(ValueError, match="draft token"):
            s.update(b, sampled, None, np.array([bad], np.int32))
        assert state_snapshot(s) == before
        s.check_invariants()
    s.update(b, sampled, None, np.array([[11, -1, -1]], np.int32))
    d = s.schedule()
    assert list(d.scheduled_tokens) == [7, 11] and list(d.spec_draft_tokens[0]) == [11, -1, -1]


def test_long_prefill_threshold_spares_a_request_alone_and_can_adapt():
    """vLLM's rules: the cap is for sharing, so a lone request takes the whole budget; with
    long_prefill_token_threshold_adaptive it is floored at the budget over the requests."""
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=32,
                                  long_prefill_token_threshold=4))
    s.add_request(0, prompt(40, 100), SamplingParams())
    assert list(s.schedule().num_scheduled_tokens) == [32]
    for adaptive, chunks in [(False, [4, 4]), (True, [16, 16])]:
        s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=32,
                                      long_prefill_token_threshold=4,
                                      long_prefill_token_threshold_adaptive=adaptive))
        s.add_request(0, prompt(40, 100), SamplingParams())
        s.add_request(1, prompt(40, 200), SamplingParams())
        assert list(s.schedule().num_scheduled_tokens) == chunks
