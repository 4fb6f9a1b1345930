"""NVIDIA Dynamo's own KV indexer (ai-dynamo-runtime 1.6.1, ``python -m dynamo.indexer``) fed by
our KVEventPublisher agrees with our prefix cache.

After every phase of each workload (prefix hits, evictions, a reset while blocks are in use, a
block cached under a parent its request does not hold, tenants, a batch lost on the wire), two
things must hold:

* the indexer's tree for the worker equals the scheduler's cached set (which, by the block pool's
  rule, is exactly what a prefix lookup can reach);
* for new prompts, the indexer's overlap score equals the scheduler's own prefix-cache hits for
  them, measured by admitting the prompt and reading its ``num_cached_tokens``.

And the indexer never has to skip an event (no "Failed to find parent block", no removal of a
block it lacks). The indexer binds its HTTP port on every interface (hard-coded in 1.6.1): it is
started only here, on a free port, and stopped by pid.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
from support import Driver, FakeModel, make_config, sp

from atom_sched import KVEvent, Scheduler, block_hash, hash_namespace
from atom_sched.dynamo_indexer import DynamoIndexer
from atom_sched.kv_events import KVEventPublisher

if not DynamoIndexer.available():
    if os.environ.get("CI"):
        pytest.fail("ai-dynamo-runtime is not installed (make venv installs it)",
                    pytrace=False)
    pytest.skip("ai-dynamo-runtime is not installed (make venv installs it)",
                allow_module_level=True)

BS = 4
LOOPBACK = "tcp://127.0.0.1:*"
_worker_ids = itertools.count(1)


@pytest.fixture(scope="module")
def indexer():
    with DynamoIndexer(threads=1) as idx:
        yield idx


class Worker:
    """A scheduler driven by the fake model, publishing its events every step to an endpoint the
    indexer subscribes to (with replay)."""

    def __init__(self, idx: DynamoIndexer, **cfg_kw) -> None:
        self.idx = idx
        self.id = next(_worker_ids)
        cfg = make_config(**{**dict(num_blocks=24, block_size=BS, max_num_seqs=4,
                                    max_num_batched_tokens=64, max_model_len=96,
                                    enable_kv_events=True), **cfg_kw})
        self.sched = Scheduler(cfg)
        self.pub = KVEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
        self.driver = Driver(self.sched, FakeModel(0), cfg=cfg)
        self.driver.post_update = lambda *_: self.pub.publish_step(self.sched)
        self._next_rid = itertools.count()
        idx.register(self.id, self.pub.endpoint, BS, replay_endpoint=self.pub.replay_endpoint)
        idx.wait_joined(self.id, lambda: self.pub.publish([KVEvent("BlockRemoved", [])]))
        self.applied_before = idx.events_applied()

    def add(self, prompt, **kw) -> int:
        rid = next(self._next_rid)
        self.driver.add(rid, prompt, sp(**kw))
        return rid

    def run(self, hook=None) -> None:
        self.driver.run(hook=hook)
        self.pub.publish_step(self.sched)  # what an abort or a reset recorded after the last step

    def expected_blocks(self, prompt, lora: str = "", salt: str = "") -> int:
        """Leading full blocks of ``prompt`` in our prefix cache (the scheduler's lookup)."""
        cached = set(self.sched.cached_block_hashes())
        parent = hash_namespace(lora_name=lora, cache_salt=salt)
        n = 0
        while (n + 1) * BS <= len(prompt):
            parent = block_hash(prompt[n * BS:(n + 1) * BS], parent)
            if parent not in cached:
                break
            n += 1
        return n

    def check_in_sync(self, probes=(), lora: str = "", salt: str = "") -> list[int]:
        """The indexer's tree equals our cached set; its scores for ``probes`` equal our hits
        (then each probe is served, so its admission proves the hit). Returns the scores."""
        self.wait_synced()
        scores = []
        for prompt in probes:
            self.wait_synced()  # the previous probe's events are in the index too
            kw = {k: v for k, v in (("lora_name", lora), ("cache_salt", salt)) if v}
            score = self.idx.query(prompt, **kw).get(self.id, 0)
            assert score == self.expected_blocks(prompt, lora, salt), prompt
            rid = self.add(prompt, max_tokens=2, **kw)
            self.run()
            if len(prompt) % BS:  # a block-aligned prompt never hits its last block
                assert self.driver.cached_first[rid] == score * BS
            scores.append(score)
        return scores

    def wait_synced(self) -> None:
        """Until the indexer's tree equals the scheduler's cached set."""
        self.pub.flush()
        want = set(self.sched.cached_block_hashes())
        self.idx.wait_for(lambda: self.idx.block_hashes(self.id) == want,
                          what=f"worker {self.id}'s tree to equal the cached set")

    def check_nothing_skipped(self) -> None:
        bad = {k: v for k, v in self.idx.events_applied().items()
               if k[1] != "ok" and v != self.applied_before.get(k, 0)}
        assert not bad, f"the indexer skipped events: {bad}\n{self.idx.log_tail()}"

    def close(self) -> None:
        self.idx.unregister(self.id)
        self.pub.close()


@pytest.fixture
def worker(indexer):
    w = Worker(indexer)
    yield w
    w.close()


def family(rng: random.Random, base: list[int], n: int) -> list[list[int]]:
    """``n`` prompts that share a random-length prefix of ``base``, none block-aligned."""
    out = []
    for _ in range(n):
        head = base[:rng.randrange(0, len(base) + 1)]
        tail = [rng.randrange(10, 900) for _ in range(rng.randrange(1, 12))]
        p = head + tail
        out.append(p if len(p) % BS else p + [7])
    return out


def test_prefix_hits_and_evictions(worker):
    rng = random.Random(5)
    base = [rng.randrange(10, 900) for _ in range(24)]
    for round_ in range(4):
        for p in family(rng, base, 6):
            worker.add(p, max_tokens=rng.randrange(1, 6))
        worker.run()  # 24 blocks for 6 prompts of up to 9 blocks: evictions every round
        scores = worker.check_in_sync(family(rng, base, 3))
        assert round_ < 3 or any(scores), "no probe hit the shared prefix"
    assert worker.idx.events_applied().get(("removed", "ok"), 0) > 0
    worker.check_nothing_skipped()


def test_reset_while_blocks_are_in_use(worker):
    """A reset while requests run: their later blocks (decode blocks here) would name parents
    the routers have cleared; they are not cached, and the indexer skips nothing."""
    long = list(range(100, 130))
    rids = [worker.add(long + [i], max_tokens=24) for i in range(2)]

    def reset_mid_decode(d, it):
        if it == 4:
            worker.sched.reset_prefix_cache()
        return False

    worker.run(hook=reset_mid_decode)
    assert all(worker.driver.reasons[r] for r in rids)
    worker.check_in_sync([long + [1, 2, 3], list(range(100, 111))])
    worker.check_nothing_skipped()


def test_a_block_cached_under_a_parent_its_request_does_not_hold(worker):
    """Two requests compute the same first block in the same step: the second copy is not cached
    and the second request's next block is cached under the first's block. When the first
    finishes and its blocks are evicted, that child goes too (leaves first), and comes back,
    announced again, once recomputed."""
    shared = list(range(200, 204))
    a = worker.add(shared + list(range(300, 306)), max_tokens=1)
    b = worker.add(shared + list(range(400, 413)), max_tokens=30)

    def evict_a_while_b_decodes(d, it):
        if it == 3:  # a is done; fill the pool so a's free blocks are handed out again
            for i in range(3):
                worker.add(list(range(600 + 20 * i, 617 + 20 * i)), max_tokens=1)
        return False

    worker.run(hook=evict_a_while_b_decodes)
    assert worker.driver.reasons[a] and worker.driver.reasons[b]
    worker.check_in_sync([shared + list(range(400, 413)), shared + [1]])
    worker.check_nothing_skipped()


def test_tenants_never_share_a_prefix(worker):
    prompt = list(range(500, 515))
    worker.add(prompt, max_tokens=2, cache_salt="tenant-a")
    worker.add(prompt, max_tokens=2, lora_name="sql")
    worker.run()
    probe = prompt + [9]
    assert worker.check_in_sync([probe], salt="tenant-a") == [3]
    assert worker.check_in_sync([probe], lora="sql") == [3]
    assert worker.check_in_sync([probe], salt="tenant-b") == [0]
    # No tenant's blocks serve a plain request; once one is served, the next plain one hits.
    assert worker.check_in_sync([probe, probe]) == [0, 4]  # 16 tokens: 4 full blocks
    worker.check_nothing_skipped()


def test_a_batch_lost_on_the_wire_is_replayed(worker):
    """A batch the PUB socket could not send (a subscriber's high-water mark) stays numbered in
    the replay ring; Dynamo sees the gap, replays, and ends equal to the cache."""
    import zmq

    real = worker.pub._pub.send_multipart
    lost = []

    def lose_one(frames, flags=0):
        if not lost and frames[2]:
            lost.append(int.from_bytes(frames[1], "big"))
            raise zmq.Again()
        return real(frames, flags)

    worker.pub._pub.send_multipart = lose_one
    worker.add(list(range(700, 713)), max_tokens=3)
    worker.run()
    worker.add(list(range(800, 813)), max_tokens=3)  # a later batch reveals the gap
    worker.run()
    # The sender thread sends (and loses) the batches after publish() returns: wait for it.
    assert worker.pub.flush()
    assert lost and worker.pub.stats()["dropped_hwm"] == 1
    worker.check_in_sync([list(range(700, 713)), list(range(800, 811))])
    assert any("Gap detected" in r.get("message", "") for r in worker.idx.log_records())
    worker.check_nothing_skipped()


def test_two_data_parallel_ranks_are_indexed_apart(indexer):
    """Two DP ranks of one worker on the layout the publisher enforces (PUB P+rank, replay
    P+2+rank): Dynamo keeps a tree per rank and scores each as that rank's scheduler hits."""
    import socket

    for _ in range(20):  # four consecutive free ports
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + 3 < 65536:
            try:
                pubs = [KVEventPublisher(f"tcp://127.0.0.1:{base}",
                                         replay_endpoint=f"tcp://127.0.0.1:{base + 2}",
                                         data_parallel_rank=r, data_parallel_size=2)
                        for r in (0, 1)]
                break
            except Exception:  # noqa: BLE001 - a port was taken: try another base
                continue
    else:
        pytest.fail("no four consecutive free ports")
    wid = next(_worker_ids)
    scheds = []
    try:
        for rank, pub in enumerate(pubs):
            indexer.register(wid, pub.endpoint, BS, replay_endpoint=pub.replay_endpoint,
                             dp_rank=rank)
        for pub in pubs:
            indexer.wait_joined(wid, lambda p=pub: p.publish([KVEvent("BlockRemoved", [])]))
        prompts = [list(range(300, 313)), list(range(400, 417))]
        for rank, pub in enumerate(pubs):
            cfg = make_config(num_blocks=24, block_size=BS, max_num_seqs=4,
                              max_num_batched_tokens=64, max_model_len=96,
                              enable_kv_events=True)
            sched = Scheduler(cfg)
            d = Driver(sched, FakeModel(0), cfg=cfg)
            d.post_update = lambda *_, p=pub, s=sched: p.publish_step(s)
            d.add(0, prompts[rank], sp(max_tokens=2))
            d.run()
            pub.flush()
            scheds.append(sched)
        for rank, prompt in enumerate(prompts):
            want = {str(r): len(set(scheds[r].cached_block_hashes())
                                & set(_chain(prompt))) * BS for r in (0, 1)}
            want = {r: t for r, t in want.items() if t}

            def scores(prompt=prompt):
                got = indexer.query_raw(prompt + [7])["scores"].get(str(wid), {})
                return {r: t for r, t in got.items() if t}

            indexer.wait_for(lambda want=want, scores=scores: scores() == want,
                             what=f"rank {rank}'s prefix scored on its own rank")
    finally:
        indexer.unregister(wid)
        for pub in pubs:
            pub.close()


def _chain(prompt):
    parent, out = None, []
    for i in range(len(prompt) // BS):
        parent = block_hash(prompt[i * BS:(i + 1) * BS], parent)
        out.append(parent)
    return out


def test_an_indexer_started_in_a_thread_outlives_that_thread():
    """The parent-death signal follows the thread that forked the child: an indexer started in
    a short-lived thread was killed when that thread ended (issue 28). It now lives until
    close() or the process's exit."""
    import threading
    import time

    made: list[DynamoIndexer] = []
    t = threading.Thread(target=lambda: made.append(DynamoIndexer(threads=1)))
    t.start()
    t.join()
    (idx,) = made
    try:
        time.sleep(1.0)
        assert idx._proc is not None and idx._proc.poll() is None, idx.log_tail()
        assert idx._request("GET", "/health", timeout=5.0)[0] == 200
    finally:
        idx.close()
        idx._log.close()
