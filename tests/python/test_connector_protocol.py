"""The scheduler side of the KV connector (prefill/decode disaggregation): ATOM's call order with
its bugs 8.4, 8.5, 8.15, 8.16 and 8.34 fixed. The connectors here are small KVConnector
subclasses that record what the scheduler tells them; the loopback connector that moves real KV
between two engines is tested with the engine."""

import numpy as np
import pytest

from atom_sched import KVConnector, RemoteMatch, SamplingParams, Scheduler, SchedulerConfig

BS = 4


def make(num_blocks=32, k=0, events=True, **kw):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_num_seqs=8,
                          max_num_batched_tokens=64, max_model_len=256, eos_token_id=2,
                          num_speculative_tokens=k, enable_kv_events=events, **kw)
    return Scheduler(cfg)


class Consumer(KVConnector):
    """Decode side: requests listed in `remote` get their prompt KV from a remote prefill."""

    def __init__(self, remote, first_token=-1, drafts=()):
        super().__init__()
        self.remote = dict.fromkeys(remote, True)
        self.first_token = first_token
        self.drafts = list(drafts)
        self.calls = []

    def is_producer(self):
        return False

    def get_num_new_matched_tokens(self, request):
        self.calls.append(("match", request.request_id, list(request.block_ids)))
        if self.remote.get(request.request_id):
            return RemoteMatch(num_tokens=request.num_prompt_tokens, load_async=True,
                               first_token=self.first_token, draft_tokens=self.drafts)
        return (0, False)

    def update_state_after_alloc(self, request):
        self.calls.append(("alloc", request.request_id, list(request.block_ids)))
        self.remote[request.request_id] = False  # ATOM clears do_remote_prefill here

    def request_finished(self, request):
        self.calls.append(("finished", request.request_id, list(request.token_ids)))
        return False


class Producer(KVConnector):
    """Prefill side: every finished request's KV is sent before its blocks are freed."""

    def __init__(self):
        super().__init__()
        self.finished = []

    def is_producer(self):
        return True

    def get_num_new_matched_tokens(self, request):
        return RemoteMatch()

    def update_state_after_alloc(self, request):
        pass

    def request_finished(self, request):
        self.finished.append((request.request_id, list(request.block_ids)))
        return True


def step(s, tokens, k=0):
    b = s.schedule()
    s.check_invariants()
    assert b is not None
    rows = b.num_rows
    sampled = np.tile(np.asarray(tokens[:rows], dtype=np.int32)[:, None], (1, k + 1))
    accepted = None if (k == 0 or b.is_prefill) else np.full(rows, 1, np.int32)
    drafts = np.full((rows, k), 5, np.int32) if k else None
    out = s.update(b, sampled, accepted, drafts)
    s.check_invariants()
    return b, out.outputs()


def test_remote_prefill_waits_then_decodes_with_the_injected_first_token():
    s = make()
    conn = Consumer(remote=[7], first_token=42)
    s.set_kv_connector(conn)
    prompt = list(range(10, 22))  # 12 tokens = 3 full blocks
    s.add_request(7, prompt, SamplingParams(max_tokens=4))
    assert s.schedule() is None  # nothing to compute locally: the KV comes from the producer
    state = s.request_state(7)
    assert state["status"] == "waiting_for_remote_kv"
    assert len(state["block_table"]) == 3  # blocks are allocated for the transfer to fill
    assert [c[0] for c in conn.calls] == ["match", "alloc"]
    assert s.schedule() is None  # still waiting
    s.update_from_kv_xfer_finished(finished_recving=[7])
    s.check_invariants()
    b, outs = step(s, [50])
    assert not b.is_prefill and list(b.req_ids) == [7]
    assert list(b.positions) == [12] and list(b.scheduled_tokens) == [42]
    assert outs[0].output_tokens == [42, 50]  # T0 streamed with the first output
    stored = [e for e in s.take_events() if e.kind == "BlockStored"]
    # The remote-filled prompt blocks are announced once they arrive (ATOM never did: 8.15).
    assert sum(len(e.block_hashes) for e in stored) == 3
    assert s.stats()["num_remote_prefills"] == 1


def test_no_first_token_reforwards_the_last_prompt_token():
    s = make()
    s.set_kv_connector(Consumer(remote=[1]))
    s.add_request(1, list(range(10, 19)), SamplingParams(max_tokens=3))
    s.schedule()
    s.update_from_kv_xfer_finished(finished_recving=[1])
    b, outs = step(s, [60])
    assert list(b.positions) == [8] and list(b.scheduled_tokens) == [18]
    assert outs[0].output_tokens == [60]


def test_connector_is_asked_only_after_the_request_fits():
    """8.5: ATOM probed the connector before can_allocate, so a request that then failed to fit
    was tagged for a remote load it never got."""
    s = make(num_blocks=4)
    conn = Consumer(remote=[])
    s.set_kv_connector(conn)
    s.add_request(0, list(range(10, 22)), SamplingParams(max_tokens=50))  # 3 blocks
    s.add_request(1, list(range(30, 42)), SamplingParams(max_tokens=50))  # 3 more: cannot fit
    step(s, [70, 71])
    assert [c[1] for c in conn.calls if c[0] == "match"] == [0]


def test_drafts_from_the_producer_feed_the_first_speculative_step():
    s = make(k=2)
    s.set_kv_connector(Consumer(remote=[3], first_token=42, drafts=[43, 44, 45]))
    s.add_request(3, list(range(10, 18)), SamplingParams(max_tokens=6))
    s.schedule()
    s.update_from_kv_xfer_finished(finished_recving=[3])
    b = s.schedule()
    assert list(b.scheduled_tokens) == [42, 43, 44]  # T0, then at most K drafts
    assert b.spec_draft_tokens.tolist() == [[43, 44]]
    # The unverified drafts are never hashed into the prefix cache (8.16): only the prompt's
    # two full blocks are announced.
    stored = [e for e in s.take_events() if e.kind == "BlockStored"]
    assert sum(len(e.block_hashes) for e in stored) == 2


def test_injected_token_is_streamed_once_across_a_preemption():
    """8.4: ATOM kept _injected_t0 through preempt() and streamed T0 twice."""
    s = make()
    s.set_kv_connector(Consumer(remote=[0], first_token=42))
    s.add_request(0, list(range(10, 18)), SamplingParams(max_tokens=5))
    s.schedule()
    s.update_from_kv_xfer_finished(finished_recving=[0])
    b = s.schedule()  # first decode, in flight
    s.abort_request(0)  # drop it in a way that keeps the stream honest
    out = s.update(b, np.array([50], np.int32))
    assert len(out) == 0  # finished meanwhile: nothing streamed twice or late
    s.check_invariants()


def test_request_finished_is_called_for_every_finish():
    """8.34: ATOM called request_finished only when streaming produced new tokens."""
    s = make()
    prod = Producer()
    s.set_kv_connector(prod)
    s.add_request(0, list(range(10, 16)), SamplingParams(max_tokens=1))
    s.add_request(1, list(range(20, 26)), SamplingParams(max_tokens=9))
    s.add_request(2, list(range(30, 36)), SamplingParams(max_tokens=9))
    step(s, [60, 61, 62])  # request 0 finishes by max_tokens
    s.abort_request(1)
    step(s, [2])  # request 2 emits EOS
    assert sorted(r for r, _ in prod.finished) == [0, 1, 2]


def test_producer_keeps_blocks_until_they_are_sent():
    s = make()
    prod = Producer()
    s.set_kv_connector(prod)
    s.add_request(0, list(range(10, 22)), SamplingParams(max_tokens=1))
    free_before = s.num_free_blocks
    step(s, [60])
    assert not s.has_unfinished_requests()
    assert s.num_free_blocks == free_before - 3  # the 12-token prompt's blocks wait for the send
    with pytest.raises(ValueError):
        s.add_request(0, [1, 2, 3])  # the id is still held by the pending send
    s.update_from_kv_xfer_finished(finished_sending=[0])
    s.check_invariants()
    assert s.num_free_blocks == free_before
    s.add_request(0, [1, 2, 3])  # now the id is free again


def test_abort_while_kv_is_arriving_keeps_the_blocks_until_it_lands():
    s = make()
    s.set_kv_connector(Consumer(remote=[5]))
    s.add_request(5, list(range(10, 22)), SamplingParams(max_tokens=4))
    s.schedule()
    held = s.num_usable_blocks - s.num_free_blocks
    assert held == 3
    s.abort_request(5)
    s.check_invariants()
    assert s.num_usable_blocks - s.num_free_blocks == 3  # the transfer may still write them
    s.update_from_kv_xfer_finished(finished_recving=[5])
    s.check_invariants()
    assert s.num_free_blocks == s.num_usable_blocks


def test_bad_transfer_reports_change_nothing():
    s = make()
    s.set_kv_connector(Consumer(remote=[1]))
    s.add_request(1, list(range(10, 22)), SamplingParams(max_tokens=4))
    s.add_request(2, list(range(30, 34)), SamplingParams(max_tokens=4))
    s.schedule()
    with pytest.raises(KeyError):
        s.update_from_kv_xfer_finished(finished_recving=[1, 99])
    with pytest.raises(ValueError):
        s.update_from_kv_xfer_finished(finished_recving=[2])  # running, not waiting for KV
    with pytest.raises(KeyError):
        s.update_from_kv_xfer_finished(finished_sending=[1])
    assert s.request_state(1)["remote_ready"] is False
    s.check_invariants()


def test_a_failing_connector_costs_only_its_request():
    class Broken(Consumer):
        def get_num_new_matched_tokens(self, request):
            if request.request_id == 1:
                raise RuntimeError("remote engine unreachable")
            return super().get_num_new_matched_tokens(request)

    s = make()
    s.set_kv_connector(Broken(remote=[]))
    s.add_request(0, [10, 11, 12], SamplingParams(max_tokens=2))
    s.add_request(1, [20, 21, 22], SamplingParams(max_tokens=2))
    b = s.schedule()
    s.check_invariants()
    assert list(b.req_ids) == [0]
    (rejected,) = s.take_rejected()
    assert rejected.request_id == 1 and "remote engine unreachable" in rejected.reason
    assert any("remote engine unreachable" in e for e in s.take_connector_errors())


def test_set_kv_connector_type_checks():
    s = make()
    with pytest.raises(TypeError):
        s.set_kv_connector(object())
    s.set_kv_connector(None)
    assert s.kv_connector is None


def test_count_admittable_head_prefills():
    s = make(num_blocks=8)
    assert s.count_admittable_head_prefills(2) == 0
    s.add_request(0, list(range(10, 22)), SamplingParams())  # 3 blocks
    s.add_request(1, list(range(30, 42)), SamplingParams())  # 3 blocks
    s.add_request(2, list(range(50, 62)), SamplingParams())  # would need 9 in all: too many
    assert s.count_admittable_head_prefills(1) == 1
    assert s.count_admittable_head_prefills(4) == 2
    assert s.count_admittable_head_prefills(0) == 0


@pytest.mark.parametrize("first_token, max_tokens, reason", [(2, 8, "eos"), (42, 1, "max_tokens")])
def test_an_injected_first_token_that_stops_ends_the_request(first_token, max_tokens, reason):
    s = make()
    s.set_kv_connector(Consumer(remote=[4], first_token=first_token))
    s.add_request(4, list(range(10, 18)), SamplingParams(max_tokens=max_tokens))
    s.schedule()
    s.update_from_kv_xfer_finished(finished_recving=[4])
    _, outs = step(s, [77])
    assert [(o.output_tokens, o.finish_reason) for o in outs] == [([first_token], reason)]
    assert not s.has_unfinished_requests()
    assert s.num_free_blocks == s.num_usable_blocks


def test_request_finished_sees_the_reason_and_the_drafts():
    class Recording(Producer):
        def request_finished(self, request):
            self.finished.append((request.finish_reason, list(request.draft_token_ids)))
            return False

    s = make(k=2)
    conn = Recording()
    s.set_kv_connector(conn)
    s.add_request(0, list(range(10, 16)), SamplingParams(max_tokens=1))
    step(s, [60], k=2)
    assert conn.finished == [("max_tokens", [5, 5])]


def test_arrived_kv_joins_the_decode_set_even_behind_a_blocked_head():
    """A request whose KV arrived must not wait behind a head that cannot allocate (the blocks it
    needs may be the ones the arrived request holds) nor behind a prefill veto."""
    s = make(num_blocks=10)
    s.set_kv_connector(Consumer(remote=[1], first_token=42))
    s.add_request(1, list(range(10, 34)), SamplingParams(max_tokens=3))  # 24 tokens: 6 blocks
    assert s.schedule() is None
    s.add_request(2, list(range(40, 64)), SamplingParams(max_tokens=3))  # needs 6: 4 are free
    s.update_from_kv_xfer_finished(finished_recving=[1])
    b = s.schedule(allow_prefill=False)
    assert b is not None and b.req_ids.tolist() == [1]
    s.check_invariants()
    s.update(b, np.array([50], np.int32))
    while s.has_unfinished_requests():  # request 1 finishes and frees what request 2 needs
        step(s, [51, 52])
    s.check_invariants()


def test_a_transfer_report_naming_an_id_twice_changes_nothing():
    s = make()
    s.set_kv_connector(Consumer(remote=[5]))
    s.add_request(5, list(range(10, 22)), SamplingParams(max_tokens=4))
    s.schedule()
    s.abort_request(5)  # its blocks wait for the receive to finish
    used = s.num_usable_blocks - s.num_free_blocks
    with pytest.raises(ValueError):
        s.update_from_kv_xfer_finished(finished_recving=[5, 5])
    assert s.num_usable_blocks - s.num_free_blocks == used
    s.check_invariants()
    s.update_from_kv_xfer_finished(finished_recving=[5])
    assert s.num_free_blocks == s.num_usable_blocks


def test_a_connector_calling_back_into_its_scheduler_gets_an_error_not_a_deadlock():
    class Reentrant(Consumer):
        def get_num_new_matched_tokens(self, request):
            _ = self.sched.num_free_blocks  # re-enters the scheduler from inside schedule()
            return super().get_num_new_matched_tokens(request)

    s = make()
    conn = Reentrant(remote=[])
    conn.sched = s
    s.set_kv_connector(conn)
    s.add_request(0, [10, 11, 12], SamplingParams(max_tokens=2))
    assert s.schedule() is None
    (rejected,) = s.take_rejected()
    assert "must not call into a Scheduler" in rejected.reason
    s.check_invariants()


@pytest.mark.parametrize("kw, what", [
    (dict(first_token=-2), "first_token"),
    (dict(first_token=-(2**31)), "first_token"),
    (dict(draft_tokens=[5, -5]), "draft_tokens[1]"),
    (dict(first_token=7, draft_tokens=[-1]), "draft_tokens[0]"),
])
def test_remote_match_refuses_bad_token_ids_on_construction(kw, what):
    """Issue 12 item 6: RemoteMatch checks its ids as prompt tokens are checked (first_token
    >= -1, drafts >= 0) when built and when set, not only when the scheduler reads the answer."""
    with pytest.raises(ValueError, match=r"RemoteMatch\." + what.replace("[", r"\[")):
        RemoteMatch(num_tokens=4, load_async=True, **kw)


def test_remote_match_setters_check_and_keep_the_old_value():
    m = RemoteMatch(num_tokens=4, load_async=True, first_token=9, draft_tokens=[1, 2])
    with pytest.raises(ValueError, match="first_token"):
        m.first_token = -3
    with pytest.raises(ValueError, match=r"draft_tokens\[2\]"):
        m.draft_tokens = [3, 4, -7]
    assert m.first_token == 9 and m.draft_tokens == [1, 2]
    m.first_token, m.draft_tokens = -1, [0]  # -1: no first token; 0 is a valid id
    assert m.first_token == -1 and m.draft_tokens == [0]


@pytest.mark.parametrize("kw, what", [
    (dict(num_tokens=-1), "num_tokens must be >= 0"),
    (dict(load_async=True), "load_async with nothing to load"),
])
def test_remote_match_refuses_impossible_counts(kw, what):
    with pytest.raises(ValueError, match=what):
        RemoteMatch(**kw)


class External(KVConnector):
    """vLLM's shape of answer: (tokens after the local hit, load_async), or None / (None, _) for
    "cannot tell yet"; answers per request id, each used once (then: nothing external)."""

    def __init__(self, answers):
        super().__init__()
        self.answers = dict(answers)
        self.allocs = {}

    def is_producer(self):
        return False

    def get_num_new_matched_tokens(self, request):
        return self.answers.pop(request.request_id, (0, False))

    def update_state_after_alloc(self, request):
        self.allocs[request.request_id] = (request.num_cached_tokens, list(request.block_ids))

    def request_finished(self, request):
        return False


@pytest.mark.parametrize("later", [None, (None, False), RemoteMatch(retry_later=True)])
def test_cannot_tell_yet_skips_the_request_this_step(later):
    s = make()
    s.set_kv_connector(External({0: later}))
    s.add_request(0, list(range(10, 16)), SamplingParams(max_tokens=1))
    s.add_request(1, list(range(20, 26)), SamplingParams(max_tokens=1))
    b = s.schedule()
    assert list(b.req_ids) == [1] and s.waiting_ids() == [0]
    s.update(b, np.array([5], np.int32))
    b = s.schedule()  # asked again: now nothing external
    assert list(b.req_ids) == [0] and not s.take_rejected() and not s.take_connector_errors()
    s.check_invariants()


def test_external_tokens_synchronous_and_asynchronous():
    """(n, False): the admitting step computes from the local hit + n; (n, True): the request
    waits for the load, then prefills the rest. Positions say where computing starts."""
    s = make()
    conn = External({0: (8, False), 1: (4, True)})
    s.set_kv_connector(conn)
    s.add_request(0, list(range(10, 21)), SamplingParams(max_tokens=1))
    s.add_request(1, list(range(30, 41)), SamplingParams(max_tokens=1))
    b = s.schedule()
    assert list(b.req_ids) == [0] and list(b.positions) == [8, 9, 10]
    assert s.request_state(1)["status"] == "waiting_for_remote_kv"
    assert len(conn.allocs[1][1]) == 3
    s.update(b, np.array([5], np.int32))
    s.update_from_kv_xfer_finished(finished_recving=[1])
    b = s.schedule()
    assert list(b.req_ids) == [1] and list(b.positions) == list(range(4, 11))
    out = s.update(b, np.array([6], np.int32))
    assert [o.output_tokens for o in out] == [[6]]
    s.check_invariants()


@pytest.mark.parametrize("answer", ["lots", (4, True, 9), (4,), ("4", False), 3.5])
def test_a_malformed_answer_is_a_failed_connector_call(answer):
    """Whatever a Python connector returns that is not a RemoteMatch, (num_tokens, load_async) or
    None costs only that request: rejected with a connector error, the rest served, state whole."""
    s = make()
    s.set_kv_connector(External({0: answer}))
    s.add_request(0, list(range(10, 16)), SamplingParams(max_tokens=1))
    s.add_request(1, list(range(20, 26)), SamplingParams(max_tokens=1))
    b = s.schedule()
    assert list(b.req_ids) == [1]
    (rejected,) = s.take_rejected()
    assert rejected.request_id == 0 and rejected.reason.startswith("kv connector error")
    assert len(s.take_connector_errors()) == 1
    assert 0 not in s
    s.check_invariants()
