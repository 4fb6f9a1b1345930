"""Issue 12, item 13: KeyboardInterrupt and SystemExit raised in a KV connector callback reach the
engine instead of becoming a rejection, and the scheduler's state stays whole.

The rule (docs/api.md, "KV connectors"): the call finishes consistently (a request being admitted
stays waiting as it was, one being finished finishes), then the exception is raised when the call
returns; when the call returns a batch or step outputs, which raising would lose, the next call on
that Scheduler raises it before changing anything."""

import pytest

from atom_sched import KVConnector, RemoteMatch, SamplingParams, Scheduler, SchedulerConfig


def make():
    return Scheduler(SchedulerConfig(num_blocks=9, block_size=4, max_num_seqs=8,
                                     max_num_batched_tokens=64, max_model_len=64))


class Interrupting(KVConnector):
    """Raises `exc` once from `method` for request `rid`; otherwise keeps nothing."""

    def __init__(self, method, rid, exc):
        super().__init__()
        self.method, self.rid, self.exc = method, rid, exc
        self.calls = []

    def _maybe_raise(self, method, request):
        self.calls.append((method, request.request_id))
        if (method, request.request_id) == (self.method, self.rid):
            self.method = None
            raise self.exc

    def is_producer(self):
        return False

    def get_num_new_matched_tokens(self, request):
        self._maybe_raise("match", request)
        return RemoteMatch()

    def update_state_after_alloc(self, request):
        self._maybe_raise("alloc", request)

    def request_finished(self, request):
        self._maybe_raise("finished", request)
        return False


def assert_whole(s):
    s.check_invariants()
    assert s.take_rejected() == []
    assert s.take_connector_errors() == []
    assert s.stats()["num_connector_errors"] == 0


def run_to_end(s):
    while s.has_unfinished_requests():
        batch = s.schedule()
        s.update(batch, [7] * len(batch))
        s.check_invariants()


@pytest.mark.parametrize("method", ["match", "alloc"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)])
def test_interrupt_of_the_only_admission_is_raised_at_once(method, exc):
    s = make()
    s.set_kv_connector(Interrupting(method, 1, exc))
    s.add_request(1, list(range(1, 9)), SamplingParams(max_tokens=2))
    with pytest.raises(type(exc)) as info:
        s.schedule()  # nothing was scheduled: nothing is lost by raising now
    assert info.value is exc
    assert s.waiting_ids() == [1] and s.running_ids() == []
    assert s.num_free_blocks == s.num_usable_blocks
    assert_whole(s)
    run_to_end(s)  # asked again at its next admission, it is served
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize("method", ["match", "alloc"])
def test_interrupt_after_an_admission_comes_with_the_next_call(method):
    s = make()
    s.set_kv_connector(Interrupting(method, 2, KeyboardInterrupt()))
    for rid in (1, 2, 3):
        s.add_request(rid, [10 * rid + i for i in range(4)], SamplingParams(max_tokens=1))
    batch = s.schedule()  # request 1 admitted, then the interrupt: the batch is returned
    assert batch is not None and list(batch.req_ids) == [1]
    with pytest.raises(KeyboardInterrupt):
        s.update(batch, [7])  # raised before the step is applied...
    assert s.waiting_ids() == [2, 3] and s.running_ids() == [1]
    out = s.update(batch, [7])  # ...so the engine may apply it now
    assert [o.request_id for o in out] == [1]
    assert_whole(s)
    run_to_end(s)


def test_interrupt_in_request_finished_keeps_the_step_outputs():
    s = make()
    conn = Interrupting("finished", 1, SystemExit("shutting down"))
    s.set_kv_connector(conn)
    s.add_request(1, [1, 2, 3], SamplingParams(max_tokens=1))
    s.add_request(2, [4, 5, 6], SamplingParams(max_tokens=1))
    out = s.update(s.schedule(), [7, 8])  # both finish; the interrupt waits for the next call
    assert {(o.request_id, o.finish_reason) for o in out} == {(1, "max_tokens"), (2, "max_tokens")}
    assert ("finished", 2) in conn.calls  # the other request's callback still ran
    with pytest.raises(SystemExit, match="shutting down"):
        s.stats()
    assert s.num_free_blocks == s.num_usable_blocks  # request 1 finished as if nothing was kept
    assert_whole(s)


def test_interrupt_in_abort_is_raised_by_abort():
    s = make()
    s.set_kv_connector(Interrupting("finished", 1, KeyboardInterrupt()))
    s.add_request(1, [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(KeyboardInterrupt):
        s.abort_request(1)
    assert 1 not in s
    assert_whole(s)


def test_interrupt_in_a_dry_run_is_raised_by_it():
    s = make()
    s.set_kv_connector(Interrupting("match", 1, KeyboardInterrupt()))
    s.add_request(1, [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(KeyboardInterrupt):
        s.get_next_batch_info()
    assert_whole(s)
    run_to_end(s)


def test_ordinary_exceptions_still_reject_only_their_request():
    s = make()
    s.set_kv_connector(Interrupting("match", 1, ValueError("bad\n/srv/path.py line 3")))
    s.add_request(1, [1, 2, 3], SamplingParams(max_tokens=1))
    s.add_request(2, [4, 5, 6], SamplingParams(max_tokens=1))
    batch = s.schedule()
    assert list(batch.req_ids) == [2]
    (rejected,) = s.take_rejected()
    assert (rejected.request_id, rejected.reason) == (1, "kv connector error: ValueError: bad")
