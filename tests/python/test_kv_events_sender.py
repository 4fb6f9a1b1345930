"""The KV-event sender thread under failure and abuse (issue 28 item 3): a sender that dies
(ZMQError ENOMEM under memory pressure) must not make close() hang or publish() pretend, and
replay requests must neither starve live batches nor make the publisher queue megabytes."""

import errno
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import zmq

from atom_sched import KVEvent
from atom_sched.kv_events import END_SEQ, KVEventPublisher

LOOPBACK = "tcp://127.0.0.1:*"


def events(tokens=(1, 2, 3, 4)):
    return [KVEvent("BlockStored", [7], None, list(tokens), len(tokens), "GPU")]


def returns_within(fn, seconds):
    """Runs fn in a daemon thread: True if it returned within `seconds` (a hang fails the test
    instead of hanging it)."""
    done = threading.Event()

    def body():
        fn()
        done.set()

    threading.Thread(target=body, daemon=True).start()
    return done.wait(seconds)


def enomem(*args, **kwargs):
    raise zmq.ZMQError(errno.ENOMEM)


def wait_failed(pub, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pub.stats()["failed"]:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("where", ["live", "replay"])
def test_a_dead_sender_is_reported_and_close_returns_within_its_timeout(where, caplog):
    pub = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    closed = False
    try:
        if where == "live":
            pub._pub.send_multipart = enomem
            assert pub.publish(events()) == 0  # numbered before the sender tried it
        else:
            pub._router.recv_multipart = enomem
            ctx = zmq.Context()
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert wait_failed(pub), "the sender's failure was not recorded"
        assert "Cannot allocate memory" in pub.error
        assert [r for r in caplog.records if "KV event sender" in r.getMessage()]
        # The engine goes on: publish() drops, says so by returning None, and counts it.
        before = pub.stats()
        assert pub.publish(events()) is None
        after = pub.stats()
        assert after["dropped"] == before["dropped"] + 1
        assert after["dropped_failed"] == before["dropped_failed"] + 1
        assert after["next_seq"] == before["next_seq"]
        assert pub.flush(1.0)  # nothing is waiting for a sender that is gone
        t0 = time.monotonic()
        assert returns_within(lambda: pub.close(timeout=1.0), 3.0), "close() hung"
        closed = True
        assert time.monotonic() - t0 < 2.0
    finally:
        if where == "replay":
            dealer.close(linger=0)
            ctx.term()
        if not closed:
            pub._closed = True  # leave the hung close() alone


def test_close_returns_within_its_timeout_with_a_stalled_subscriber():
    """A subscriber that never reads holds PUB messages; close() gives them at most its
    timeout."""
    pub = KVEventPublisher(LOOPBACK, hwm=1000)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.connect(pub.endpoint)
    try:
        time.sleep(0.2)
        for _ in range(500):
            pub.publish(events(range(1000, 5000)))
        t0 = time.monotonic()
        assert returns_within(lambda: pub.close(timeout=0.3), 4.0), "close() hung"
        assert time.monotonic() - t0 < 0.8  # before: the PUB socket lingered 1 s past it
    finally:
        sub.close(linger=0)
        ctx.term()


FLOODER = textwrap.dedent("""
    import sys, time, zmq
    endpoint, n, mode, requests, seconds = sys.argv[1:6]
    ctx = zmq.Context()
    socks = []
    for _ in range(int(n)):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if mode == "hold":  # never reads: whatever the publisher sends it queues
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(endpoint)
        socks.append(s)
    request = [b"", (0).to_bytes(8, "big")]  # replay everything, 8 bytes
    print("ready", flush=True)
    end = time.monotonic() + float(seconds)
    sent = 0
    while time.monotonic() < end:
        for s in socks:
            if mode == "hold" and sent >= int(requests) * len(socks):
                continue
            try:
                s.send_multipart(request, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
            if mode == "read":
                try:
                    while True:
                        s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    pass
        time.sleep(0.001 if mode == "read" else 0.01)
""")


def start_flooders(endpoint, n, mode, requests=0, seconds=30.0):
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOODER, endpoint, str(n), mode, str(requests), str(seconds)],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc):
    proc.kill()
    proc.wait(10)


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_replay_floods_do_not_starve_live_batches():
    """Six DEALERs asking to replay a full 10 000-batch ring over and over: the live batches
    published meanwhile still reach a subscriber (before: about 3% of them did in 10 s), and a
    genuine replay still gets every batch it asked for."""
    n_live = 300
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=10_000) as pub:
        for _ in range(10_000):
            pub.publish(events())
        assert pub.flush(30)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        flood = start_flooders(pub.replay_endpoint, 6, "read")
        try:
            # Join the subscriber (PUB/SUB joins asynchronously).
            for _ in range(500):
                pub.publish(events())
                if sub.poll(20):
                    break
            else:
                raise AssertionError("subscriber never joined")
            time.sleep(0.3)  # the flood is on
            while sub.poll(50):
                sub.recv_multipart()
            first = pub.stats()["next_seq"]
            got = set()
            for _ in range(n_live):
                pub.publish(events())
                while sub.poll(0):
                    got.add(int.from_bytes(sub.recv_multipart()[1], "big"))
                time.sleep(0.005)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and len(got) < n_live:
                if sub.poll(50):
                    got.add(int.from_bytes(sub.recv_multipart()[1], "big"))
            live = got & set(range(first, first + n_live))
            assert len(live) >= 0.9 * n_live, f"{len(live)} of {n_live} live batches arrived"
            assert pub.stats()["replays"] > 6
            # A genuine replay during the flood gets all it asked for.
            replayed = replay_all(pub.replay_endpoint, first)
            assert replayed[: n_live] == list(range(first, first + n_live))
        finally:
            stop(flood)
            sub.close(linger=0)
            ctx.term()


def replay_all(endpoint, start):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    seqs = []
    try:
        while True:
            assert sock.poll(5000), "replay timed out"
            frames = sock.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames[3] == b"", frames[3]
                return seqs
            seqs.append(int.from_bytes(frames[2], "big"))
    finally:
        sock.close(linger=0)
        ctx.term()


def test_replay_requests_that_are_never_read_do_not_amplify_memory():
    """Three DEALERs send 20 requests each (480 bytes) for a 2 000-batch ring of ~6 KB batches
    and never read: the publisher must not queue the ring again per request (before, ZMQ held
    up to two rings per peer: about 70 MiB here)."""
    with KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=2_000) as pub:
        big = range(1000, 3000)
        for _ in range(2_000):
            pub.publish(events(big))
        assert pub.flush(30)
        time.sleep(0.2)
        base = rss_bytes()
        flood = start_flooders(pub.replay_endpoint, 3, "hold", requests=20, seconds=30.0)
        try:
            peak = base
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                peak = max(peak, rss_bytes())
                time.sleep(0.05)
            assert peak - base < 16 * 2**20, f"RSS grew by {(peak - base) / 2**20:.1f} MiB"
            assert pub.stats()["replays"] >= 3
            # The publisher still serves live batches and replays.
            assert pub.publish(events()) == 2_000
            assert pub.flush(5)
            assert replay_all(pub.replay_endpoint, 1_990) == list(range(1_990, 2_001))
        finally:
            stop(flood)
