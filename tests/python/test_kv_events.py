"""The KV-event publisher speaks vLLM's wire format over real ZMQ sockets on 127.0.0.1."""

import random
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from atom_sched import KVEvent, SamplingParams, Scheduler, SchedulerConfig
from atom_sched.kv_events import (
    END_SEQ,
    KVEventPublisher,
    check_bind_endpoint,
    encode_batch,
    offset_endpoint_port,
)

# Golden vectors of shared/spec/kv-events-wire.md (msgspec 0.23 with vLLM 0.33's struct flags).
GOLDEN_MAP = (
    "93cb3ff00000000000009288a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102"
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473940a0b0c0daa626c6f636b5f73697a6502"
    "a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d"
    "6f766564ac626c6f636b5f6861736865739101a66d656469756da347505500"
)
GOLDEN_ARRAY = (
    "93cb3ff00000000000009298ab426c6f636b53746f726564920102c0940a0b0c0d02c0a3475055c093ac426c6f63"
    "6b52656d6f7665649101a347505500"
)
LOOPBACK = "tcp://127.0.0.1:*"


def golden_events():
    return [
        KVEvent("BlockStored", [1, 2], None, [10, 11, 12, 13], 2, "GPU"),
        KVEvent("BlockRemoved", [1], medium="GPU"),
    ]


def test_golden_vectors_byte_for_byte():
    assert encode_batch(1.0, golden_events(), 0, "map").hex() == GOLDEN_MAP
    assert encode_batch(1.0, golden_events(), 0, "array").hex() == GOLDEN_ARRAY


def test_large_hashes_are_uint64_and_cleared_has_no_fields():
    big = 2**64 - 5
    payload = encode_batch(2.5, [KVEvent("BlockRemoved", [big]), KVEvent("AllBlocksCleared")],
                           None)
    assert bytes.fromhex("cf" + big.to_bytes(8, "big").hex()) in payload
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (2.5, None)
    assert events[1] == {"type": "AllBlocksCleared"}
    array = msgpack.unpackb(encode_batch(0.0, [KVEvent("AllBlocksCleared")], 1, "array"))
    assert array[1] == [["AllBlocksCleared"]]


def test_endpoint_offsets_by_data_parallel_rank():
    assert offset_endpoint_port("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint_port("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert offset_endpoint_port("inproc://kv", 2) == "inproc://kv_dp2"
    with pytest.raises(ValueError):
        KVEventPublisher(encoding="json")


class Subscriber:
    """A router-like consumer: a SUB socket that checks the 3-frame framing of every message."""

    def __init__(self, endpoint, topic=b""):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)

    def recv(self, timeout_ms=2000):
        if not self.sub.poll(timeout_ms):
            return None
        frames = self.sub.recv_multipart()
        assert len(frames) == 3, "vLLM framing: topic, seq, payload"
        assert len(frames[1]) == 8
        return frames[0], int.from_bytes(frames[1], "big"), frames[2]

    def close(self):
        self.sub.close(linger=0)
        self.ctx.term()




def replay_dealer(endpoint, start):
    """Replays from `start` with a DEALER (which, unlike REQ, can read several replies)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert sock.poll(2000), "replay timed out"
            frames = sock.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                assert frames[1] == b"" and frames[3] == b""
                return out
            _, topic, seq, payload = frames
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)
        ctx.term()


def wait_joined(pub, sub):
    """PUB/SUB joins asynchronously: publish until the subscriber sees a batch."""
    for _ in range(200):
        pub.publish([KVEvent("AllBlocksCleared")])
        got = sub.recv(timeout_ms=20)
        if got is not None:
            return got[1]
    raise AssertionError("subscriber never joined")


def test_golden_batch_over_the_wire_with_topic_and_continuous_sequence():
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv@pod@model") as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        sub = Subscriber(pub.endpoint, b"kv@pod@model")
        try:
            first = wait_joined(pub, sub)
            while sub.recv(timeout_ms=100) is not None:  # drain the join probes
                pass
            base = pub.stats()["next_seq"]
            for _ in range(20):
                pub.publish(golden_events(), ts=1.0)
            seqs = []
            for _ in range(20):
                topic, seq, payload = sub.recv()
                assert topic == b"kv@pod@model"
                assert payload.hex() == GOLDEN_MAP
                seqs.append(seq)
            assert seqs == list(range(base, base + 20))
            # Replay from any number returns exactly the buffered batches from there on.
            replayed = replay_dealer(pub.replay_endpoint, base + 5)
            assert [s for s, _ in replayed] == list(range(base + 5, base + 20))
            assert all(p.hex() == GOLDEN_MAP for _, p in replayed)
            # Batches sent before the subscriber joined are not lost: replay has them.
            assert [s for s, _ in replay_dealer(pub.replay_endpoint, 0)][:first + 1] == list(
                range(first + 1))
        finally:
            sub.close()


def test_a_lagging_sender_skips_batches_but_replay_keeps_every_numbered_one():
    """A sequence number is never lost: a batch the sender skips (it lagged more than
    max_queue_size behind) stays in the replay ring, so a subscriber that sees the gap gets it
    back (the old queue dropped numbered batches: the replay ring held [0, 3, 4])."""
    pub = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, max_queue_size=2)
    gate, inside = threading.Event(), threading.Event()
    real_send = pub._pub.send_multipart
    sent = []

    def slow_send(frames, flags=0):
        inside.set()
        gate.wait(5)
        sent.append(int.from_bytes(frames[1], "big"))
        real_send(frames, flags)

    pub._pub.send_multipart = slow_send
    try:
        pub.publish(golden_events())  # seq 0: taken by the sender, which then blocks
        assert inside.wait(5)
        for _ in range(4):  # seqs 1..4 while it is stuck: it may lag 2 behind, so 1, 2 are skipped
            pub.publish(golden_events())
        gate.set()
        assert pub.flush()
        st = pub.stats()
        assert (st["sent"], st["dropped"], st["dropped_lag"], st["dropped_hwm"]) == (3, 2, 2, 0)
        assert [s for s, _ in replay_dealer(pub.replay_endpoint, 0)] == [0, 1, 2, 3, 4]
    finally:
        pub.close()
    assert sent == [0, 3, 4]


def test_a_stalled_subscriber_costs_counted_drops_that_replay_recovers():
    """ZMQ's own high-water-mark drops are counted: a subscriber that stops reading gets exactly
    the batches stats() calls sent, in order, and the gaps are exactly the dropped ones, which the
    replay socket still has."""
    n = 600
    tokens = list(range(1000, 5000))  # about 12 KB a batch: far beyond the socket buffers
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, hwm=4, buffer_steps=n + 10) as pub:
        sub = Subscriber(pub.endpoint)
        sub.sub.setsockopt(zmq.RCVHWM, 4)
        try:
            first = wait_joined(pub, sub)
            for _ in range(n):
                pub.publish([KVEvent("BlockStored", [7], None, tokens, 4000, "GPU")])
            assert pub.flush(30)
            st = pub.stats()
            assert st["sent"] + st["dropped"] == st["next_seq"]
            assert st["dropped_hwm"] == st["dropped"] > 0
            got = []
            while (msg := sub.recv(timeout_ms=500)) is not None:
                got.append(msg[1])
            assert got == sorted(got) and len(got) == st["sent"] - first - 1
            gaps = sorted(set(range(first + 1, st["next_seq"])) - set(got))
            assert len(gaps) == st["dropped"]
            replayed = dict(replay_dealer(pub.replay_endpoint, gaps[0]))
            assert set(gaps) <= set(replayed)
        finally:
            sub.close()


def test_malformed_replay_requests_get_an_error_end_marker():
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub:
        pub.publish(golden_events())
        assert pub.flush()
        ctx = zmq.Context()
        try:
            for frames in ([b"", b"\x00" * 7], [b"\x00" * 8], [b"", b"\x00" * 8, b"x"],
                           [b"x", b"\x00" * 8]):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(pub.replay_endpoint)
                sock.send_multipart(frames)
                assert sock.poll(2000), f"no answer to {frames}"
                reply = sock.recv_multipart()
                assert reply[:3] == [b"", b"", END_SEQ] and b"DEALER" in reply[3]
                sock.close()
            # A frame over the size cap closes that connection inside ZMQ; replay still works.
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pub.replay_endpoint)
            sock.send_multipart([b"", b"\x00" * 100_000])
            assert not sock.poll(300)
            sock.close()
        finally:
            ctx.destroy(linger=0)
        assert [s for s, _ in replay_dealer(pub.replay_endpoint, 0)] == [0]
        st = pub.stats()
        assert st["replay_errors"] == 4 and st["replays"] == 1


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:*", "tcp://*:*", "tcp://eth0:*",
                                      "tcp://10.1.2.3:5557", "udp://127.0.0.1:5557"])
def test_binds_are_loopback_only_unless_allowed(endpoint):
    with pytest.raises(ValueError, match="loopback|tcp://"):
        KVEventPublisher(endpoint)
    with pytest.raises(ValueError, match="loopback|tcp://"):
        KVEventPublisher(LOOPBACK, replay_endpoint=endpoint)
    assert check_bind_endpoint("tcp://0.0.0.0:5557", allow_remote=True)
    assert check_bind_endpoint("ipc:///tmp/kv") and check_bind_endpoint("tcp://localhost:1")


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive free TCP ports on 127.0.0.1."""
    for _ in range(50):
        base = random.randrange(20_000, 60_000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def test_data_parallel_ranks_get_ports_that_cannot_collide():
    p = free_port_run(4)
    ep = f"tcp://127.0.0.1:{p}"
    # Replay on P+1 with two ranks: rank 1's PUB would land on rank 0's replay port.
    for rank in (0, 1):
        with pytest.raises(ValueError, match="overlap"):
            KVEventPublisher(ep, replay_endpoint=f"tcp://127.0.0.1:{p + 1}",
                             data_parallel_rank=rank, data_parallel_size=2)
    with pytest.raises(ValueError, match="overlap"):  # the size defaults to rank + 1
        KVEventPublisher(ep, replay_endpoint=f"tcp://127.0.0.1:{p + 1}", data_parallel_rank=1)
    with pytest.raises(ValueError, match="outside"):
        KVEventPublisher(ep, data_parallel_rank=2, data_parallel_size=2)
    # Replay ports from P+2: both ranks serve side by side, each on its own ports.
    ranks = [KVEventPublisher(ep, replay_endpoint=f"tcp://127.0.0.1:{p + 2}", topic=f"r{r}",
                              data_parallel_rank=r, data_parallel_size=2) for r in (0, 1)]
    try:
        assert [r.endpoint for r in ranks] == [f"tcp://127.0.0.1:{p + r}" for r in (0, 1)]
        assert [r.replay_endpoint for r in ranks] == [f"tcp://127.0.0.1:{p + 2 + r}"
                                                       for r in (0, 1)]
        for r, pub in enumerate(ranks):
            sub = Subscriber(pub.endpoint)
            try:
                wait_joined(pub, sub)  # its PUB port is its own
            finally:
                sub.close()
            pub.publish(golden_events())
            assert pub.flush()
            batches = replay_dealer(pub.replay_endpoint, 0)
            assert batches and all(msgpack.unpackb(b)[2] == r for _, b in batches)
    finally:
        for pub in ranks:
            pub.close()


def test_publishing_nothing_sends_nothing():
    with KVEventPublisher(LOOPBACK) as pub:
        assert pub.publish([]) is None
        assert pub.stats()["next_seq"] == 0


def run_workload(sched, pub, seed):
    """A random request stream with a small pool: prefix hits, evictions, a cache reset."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 99) for _ in range(12)]
    nid = 0
    reset_done = False
    for _ in range(2000):
        if nid < 60 and rng.random() < 0.4:
            tail = [rng.randrange(10, 99) for _ in range(rng.randrange(1, 20))]
            sched.add_request(nid, prefix[: rng.randrange(0, 13)] + tail,
                              SamplingParams(max_tokens=rng.randrange(1, 12)))
            nid += 1
        if nid == 30 and not reset_done:
            sched.reset_prefix_cache()
            reset_done = True
        b = sched.schedule()
        if b is not None:
            sched.update(b, np.array([rng.randrange(10, 99) for _ in range(b.num_rows)],
                                     dtype=np.int32))
        pub.publish_step(sched)
        if nid >= 60 and not sched.has_unfinished_requests():
            break


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_an_indexer_replaying_the_events_ends_with_the_pools_cache(encoding):
    sched = Scheduler(SchedulerConfig(num_blocks=24, block_size=4, max_num_seqs=4,
                                      max_num_batched_tokens=64, enable_kv_events=True))
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, encoding=encoding,
                          data_parallel_rank=0) as pub:
        run_workload(sched, pub, seed=7)
        deadline = time.time() + 5
        while pub.stats()["sent"] < pub.stats()["next_seq"] and time.time() < deadline:
            time.sleep(0.01)
        batches = replay_dealer(pub.replay_endpoint, 0)
    assert [s for s, _ in batches] == list(range(len(batches)))
    index: set[int] = set()
    kinds = set()
    for _, payload in batches:
        ts, events, rank = msgpack.unpackb(payload)
        assert rank == 0 and isinstance(ts, float)
        for e in events:
            if encoding == "map":
                kind, hashes = e["type"], e.get("block_hashes", [])
            else:
                kind, hashes = e[0], (e[1] if len(e) > 1 else [])
            kinds.add(kind)
            if kind == "BlockStored":
                assert not index & set(hashes), "a hash announced twice without a removal"
                index |= set(hashes)
            elif kind == "BlockRemoved":
                assert set(hashes) <= index
                index -= set(hashes)
            else:
                index.clear()
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert index == set(sched.cached_block_hashes())
    assert index  # the workload leaves a warm cache
