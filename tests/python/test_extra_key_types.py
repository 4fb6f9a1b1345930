"""cache_salt and lora_name are text (issue 28 item 5): bytes used to slip through pybind11's
std::string conversion, and a non-UTF-8 salt made publish_step() raise after take_events() had
emptied the queue, losing every request's events of that step."""

import numpy as np
import pytest

from atom_sched import KVEvent, SamplingParams, Scheduler, SchedulerConfig, hash_namespace
from atom_sched.kv_events import KVEventPublisher

LOOPBACK = "tcp://127.0.0.1:*"


@pytest.mark.parametrize("field", ["cache_salt", "lora_name"])
@pytest.mark.parametrize("value", [b"tenant", b"\xff\xfe", bytearray(b"x"), 7, None])
def test_extra_keys_must_be_str_at_construction_and_assignment(field, value):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**{field: value})
    p = SamplingParams(**{field: "tenant-a"})
    with pytest.raises(TypeError, match=field):
        setattr(p, field, value)
    assert getattr(p, field) == "tenant-a"  # unchanged by the refused assignment
    with pytest.raises(TypeError, match=field):
        KVEvent("BlockStored", [1], None, [1, 2], 2, "GPU", **{field: value})
    with pytest.raises(TypeError, match=field):
        hash_namespace(**{field: value})  # the same keys, when a router computes a hash


@pytest.mark.parametrize("field", ["cache_salt", "lora_name"])
def test_text_that_is_not_utf8_encodable_is_refused_by_name(field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: "\udcff"})  # a lone surrogate (os.fsdecode of a bad byte)
    p = SamplingParams()
    with pytest.raises(ValueError, match=field):
        setattr(p, field, "\udcff")
    with pytest.raises(ValueError, match=field):
        hash_namespace(**{field: "\udcff"})


def test_text_round_trips_through_assignment_and_pickle():
    import pickle

    p = SamplingParams(cache_salt="sälz", lora_name="ad✓pter")
    p.cache_salt = "ändern"
    assert (p.cache_salt, p.lora_name) == ("ändern", "ad✓pter")
    q = pickle.loads(pickle.dumps(p))
    assert (q.cache_salt, q.lora_name) == ("ändern", "ad✓pter")
    e = KVEvent("BlockStored", [1], None, [1, 2], 2, "GPU", lora_name="l", cache_salt="s")
    assert (e.lora_name, e.cache_salt) == ("l", "s")


class _Failing:
    """Stands in for an event whose encoding fails for a reason validation cannot catch."""

    kind = "BlockStored"
    block_hashes = [2**70]  # no msgpack integer holds it
    parent_block_hash = None
    token_ids = [1]
    block_size = 1
    medium = "GPU"
    lora_name = ""
    cache_salt = ""


class _Sched:
    def __init__(self, events):
        self.events = events

    def take_events(self):
        out, self.events = self.events, []
        return out


def test_a_step_with_an_unencodable_event_still_publishes_the_others():
    good = [KVEvent("BlockStored", [1], None, [1, 2], 2, "GPU"), KVEvent("BlockRemoved", [3])]
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub:
        with pytest.raises(ValueError, match="1 of 3 KV events"):
            pub.publish_step(_Sched([good[0], _Failing(), good[1]]))
        assert pub.stats()["encode_errors"] == 1
        assert pub.stats()["next_seq"] == 1  # the two others went out as batch 0
        assert pub.flush()
        assert pub.publish_step(_Sched([])) is None


def test_a_step_that_fails_to_encode_as_a_whole_keeps_its_events(monkeypatch):
    """A failure that is not the events' fault (here a MemoryError) keeps them: the next
    publish_step() publishes them before the new ones."""
    from atom_sched import kv_events

    real = kv_events.encode_batch
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_events, "encode_batch", flaky)
    first = [KVEvent("BlockStored", [1], None, [1, 2], 2, "GPU")]
    second = [KVEvent("BlockRemoved", [1])]
    with KVEventPublisher(LOOPBACK) as pub:
        with pytest.raises(MemoryError):
            pub.publish_step(_Sched(list(first)))
        assert pub.publish_step(_Sched(list(second))) == 0
        payload = pub._ring[0].payload
    import msgpack

    _, events, _ = msgpack.unpackb(payload)
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved"]


def test_a_salted_request_and_its_neighbours_publish_their_events():
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, enable_kv_events=True))
    with pytest.raises(TypeError, match="cache_salt"):
        sched.add_request(9, list(range(8)), SamplingParams(cache_salt=b"\xff"))
    sched.add_request(1, list(range(10)), SamplingParams(max_tokens=2))
    sched.add_request(2, list(range(20, 30)), SamplingParams(max_tokens=2, cache_salt="t"))
    b = sched.schedule()
    sched.update(b, np.ones(b.num_rows, dtype=np.int32))
    with KVEventPublisher(LOOPBACK) as pub:
        assert pub.publish_step(sched) == 0
        assert pub.stats()["encode_errors"] == 0
