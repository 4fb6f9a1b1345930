"""The loopback connectors against a hostile local process: every attack found on the old
protocol (issue 13) is a test here.

The prefill engine's ROUTER socket listens on 127.0.0.1, so any local process can send it frames;
the decode engine connects wherever its ``kv_transfer_params`` point, so a fake producer can
answer it. Whatever arrives, neither engine may crash, leak another request's KV, send more than
one request's own blocks once, or let anyone but the consumer that pulled release a transfer.
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
zmq = pytest.importorskip("zmq")
import msgpack  # noqa: E402
from support.disagg import TINY, Pair, tiny_case  # noqa: E402
from support.side_channel import FakeProducer, Peer, Relay  # noqa: E402

from atom_sched.connectors import LoopbackConsumer, LoopbackProducer  # noqa: E402
from atom_sched.connectors.base import MAX_FRAMES_PER_POLL, MAX_PRODUCERS  # noqa: E402
from atom_sched.connectors.control import MAX_HEADER_BYTES, Signer  # noqa: E402
from atom_sched.engine import EngineConfig, LLMEngine  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_case(tmp_path_factory)


@pytest.fixture
def held(tiny):
    """A pair whose prefill engine holds prompt 0's KV for a pull nobody has made yet."""
    path, prompts, params, ref = tiny
    pair = Pair(path)
    pair.prefill_only([0, 1], prompts, params)
    yield pair, prompts, params, ref
    pair.close()


def xfer(pair: Pair, rid: int) -> dict:
    return pair.prefilled[rid].kv_transfer_params


def finish(pair: Pair, rids, prompts, params, ref) -> None:
    """Forward ``rids`` to the decode engine, run both to the end, and check the outputs and that
    every block came back."""
    for rid in rids:
        pair.dec.add_request(prompts[rid], params, request_id=rid,
                             kv_transfer_params=xfer(pair, rid))
    pair.run()
    for rid in rids:
        assert pair.dec.completion(rid).token_ids == ref[rid]
    for eng in (pair.pre, pair.dec):
        assert eng.scheduler.num_free_blocks == eng.scheduler.num_usable_blocks


def malformed_frames(tid: str, blocks: list[int]) -> dict[str, list[bytes]]:
    """Frames of every shape a careless or hostile sender might produce, none authenticated."""
    hdr = msgpack.packb({"transfer_id": tid, "block_ids": blocks})
    return {
        "empty": [b""],
        "one frame": [b"PULL"],
        "old unauthenticated pull": [b"PULL", hdr],
        "garbage header": [b"PULL", b"\xc1\xff\x00", b"x" * 32],
        "header is a list": [b"PULL", msgpack.packb([1, 2]), b"x" * 32],
        "unknown kind": [b"HELO", hdr, b"x" * 32],
        "short mac": [b"PULL", hdr, b"x"],
        "wrong mac": [b"PULL", hdr, b"x" * 32],
        "extra frames": [b"PULL", hdr, b"x" * 32, b"data"],
        "done without mac": [b"DONE", msgpack.packb({"transfer_id": tid})],
        "oversized header": [b"PULL", b"\xc0" * (MAX_HEADER_BYTES + 1), b"x" * 32],
        "binary kind": [bytes(range(256)), hdr, b"x" * 32],
        "huge frame": [b"PULL", b"\x00" * (4 << 20), b"x" * 32],
    }


def test_malformed_and_unauthenticated_frames_are_dropped_and_logged(held):
    pair, prompts, params, ref = held
    x = xfer(pair, 0)
    peer = Peer(pair.prod.port)
    try:
        cases = malformed_frames(x["transfer_id"], x["remote_block_ids"])
        for name, frames in cases.items():
            peer.sock.send_multipart(frames)
            assert peer.replies(pair.pre, 0.05) == [], name  # silence: nothing to learn
        # A frame ZMQ itself refuses (over MAXMSGSIZE) never reaches the connector.
        assert pair.prod.transfer_stats["rejected"] == len(cases) - 1
        assert pair.prod.pending_sends == [0, 1]
        assert {ev for _, ev, _, _ in pair.prod.log} == {"finished", "rejected"}
    finally:
        peer.close()
    finish(pair, [0, 1], prompts, params, ref)  # the real transfers still work


def test_a_peer_without_the_secret_can_neither_confirm_nor_release_a_transfer(held):
    pair, prompts, params, ref = held
    x = xfer(pair, 0)
    peer = Peer(pair.prod.port)
    wrong = Signer(b"another secret, 16+ bytes")
    try:
        for rid in (0, 1):  # the old transfer ids were request ids
            peer.sock.send_multipart(wrong.pack(b"DONE", {"transfer_id": f"{rid:032x}"}))
        peer.sock.send_multipart(wrong.pack(b"DONE", {"transfer_id": x["transfer_id"]}))
        peer.sock.send_multipart(wrong.pack(b"PULL", {"transfer_id": x["transfer_id"],
                                                      "block_ids": x["remote_block_ids"]}))
        assert peer.replies(pair.pre) == []
        assert pair.prod.pending_sends == [0, 1]
        assert pair.prod.transfer_stats["rejected"] == 4
        assert pair.prod.transfer_stats["transfers"] == 0
    finally:
        peer.close()
    finish(pair, [0, 1], prompts, params, ref)


def test_transfer_ids_are_random_and_unguessable(held):
    pair = held[0]
    tids = [xfer(pair, rid)["transfer_id"] for rid in (0, 1)]
    assert len(set(tids)) == 2
    for t in tids:
        assert len(t) == 32 and int(t, 16) not in (0, 1)


def pull_replies(pair: Pair, peer: Peer, tid: str, blocks) -> list[dict]:
    """PULL in ``peer``'s session; the replies, checked in it."""
    peer.send(b"PULL", {"transfer_id": tid, "block_ids": blocks})
    out = []
    for frames in peer.replies(pair.pre):
        kind, hdr, data = peer.session.unpack(frames, {b"KV": 1, b"ERR": 0})
        out.append({"kind": kind, **hdr, "bytes": sum(len(d) for d in data)})
    return out


def test_pulls_are_bounded_to_the_transfers_own_blocks_once_each(held):
    """An authenticated peer (it has the secret) still gets only what the transfer holds: no
    repeated block ids (200 repeats got a 141 MiB reply), no other request's blocks, no more ids
    than the transfer has (3 KB asked for 2.2 GB), and one pull per transfer."""
    pair, prompts, params, ref = held
    a, b = xfer(pair, 0), xfer(pair, 1)
    peer = Peer(pair.prod.port)
    try:
        peer.open(pair.pre, pair.prod.secret)
        bad = {
            "repeated ids": a["remote_block_ids"][:1] * 200,
            "another request's blocks": b["remote_block_ids"],
            "one foreign block": a["remote_block_ids"][:-1] + b["remote_block_ids"][:1],
            "more ids than the transfer": list(range(1000)),
            "negative id": [-1],
            "no ids": [],
            "not a list": 7,
            "strings": ["0"],
            "floats": [0.5],
            "bools": [True],
            "huge": [2**63],
        }
        for name, blocks in bad.items():
            replies = pull_replies(pair, peer, a["transfer_id"], blocks)
            assert [r["kind"] for r in replies] == [b"ERR"], name
            assert replies[0]["bytes"] == 0
            assert str(b["remote_block_ids"]) not in replies[0]["error"]
        unknown = pull_replies(pair, peer, "ab" * 16, a["remote_block_ids"])
        assert "unknown transfer" in unknown[0]["error"]
        for bad_tid in (0, "0", "AB" * 16, ["x"], None):
            peer.send(b"PULL", {"transfer_id": bad_tid, "block_ids": [0]})
            assert peer.replies(pair.pre, 0.05) == []
        # Signed, but not a header: garbage, a list, nesting deeper than any decoder's stack.
        for body in (b"\xc1\xff", msgpack.packb([1, 2]), b"\x91" * 100_000 + b"\x00"):
            peer.send_raw(peer.session.sign(b"PULL", body))
            assert peer.replies(pair.pre, 0.05) == []
        assert pair.prod.transfer_stats["rejected"] == 8
        assert pair.prod.transfer_stats["transfers"] == 0

        # A valid pull is served once; the second one is refused.
        ok = pull_replies(pair, peer, a["transfer_id"], a["remote_block_ids"])
        assert [r["kind"] for r in ok] == [b"KV"]
        n = len(a["remote_block_ids"])
        assert ok[0]["bytes"] == n * pair.prod._block_bytes()
        again = pull_replies(pair, peer, a["transfer_id"], a["remote_block_ids"])
        assert [r["kind"] for r in again] == [b"ERR"] and "already" in again[0]["error"]
    finally:
        peer.close()


def test_only_the_consumer_that_pulled_can_release_the_transfer(held):
    pair, prompts, params, ref = held
    thief, other = Peer(pair.prod.port), Peer(pair.prod.port)
    try:
        for peer in (thief, other):  # both have the secret
            peer.open(pair.pre, pair.prod.secret)
        # The decode engine pulls request 0 (its PULL goes out in this step) ...
        pair.dec.add_request(prompts[0], params, request_id=0,
                             kv_transfer_params=xfer(pair, 0))
        deadline = time.monotonic() + 10
        while "served" not in {ev for _, ev, _, _ in pair.prod.log}:
            pair.pre.step()  # the producer opens the session, then serves the real pull
            links = pair.cons._links.values()
            if not ("pull" in {ev for _, ev, _, _ in pair.cons.log}
                    and all(lk.session is not None and not lk.queued for lk in links)):
                pair.dec.step()  # until its PULL is out (it waits for the session)
            assert time.monotonic() < deadline
        # ... and a third party that knows the transfer id tries to confirm it first.
        tid = xfer(pair, 0)["transfer_id"]
        other.send(b"DONE", {"transfer_id": tid})
        assert other.replies(pair.pre, 0.05) == []
        assert pair.prod.pending_sends == [0, 1]
        assert pair.prod.log[-1][1] == "rejected"
        # A second pull of the served transfer is refused, whoever sends it.
        got = pull_replies(pair, thief, tid, xfer(pair, 0)["remote_block_ids"])
        assert [r["kind"] for r in got] == [b"ERR"]
    finally:
        thief.close()
        other.close()
    finish(pair, [1], prompts, params, ref)
    assert pair.dec.completion(0).token_ids == ref[0]
    released = [d for _, ev, rid, d in pair.prod.log if ev == "released" and rid == 0]
    assert released == ["acked"]


# ---- the decode side against a fake producer --------------------------------------------------
def fake_params(port: int, prompt, first_token: int) -> dict:
    n = -(-len(prompt) // TINY["block_size"])
    return {"do_remote_prefill": True, "remote_block_ids": list(range(n)),
            "remote_host": "127.0.0.1", "remote_port": port, "transfer_id": "cd" * 16,
            "first_token_id": first_token, "num_prompt_tokens": len(prompt)}


def decode_against(tiny, frames_for, secret=b"s" * 32, timeout_s=0.5):
    """A decode engine pulling request 9 from a fake producer (it has the secret) that answers
    the PULL with ``frames_for(header, session)``, beside an ordinary local request 4; returns
    (engine, consumer, the PULL's header)."""
    path, prompts, params, ref = tiny
    dec = LLMEngine(EngineConfig(**TINY), model_path=path)
    cons = LoopbackConsumer(secret=secret, recv_timeout_s=timeout_s)
    dec.set_kv_connector(cons)
    fake = FakeProducer(secret)
    try:
        dec.add_request(prompts[1], params, request_id=4)
        dec.add_request(prompts[0], params, request_id=9,
                        kv_transfer_params=fake_params(fake.port, prompts[0], ref[0][0]))
        ident, _, pull, _ = fake.next_message(dec, {b"PULL": 0})
        for frames in frames_for(pull, fake.sessions[ident]):
            fake.send(ident, frames)
        deadline = time.monotonic() + 30
        while dec.has_unfinished():
            dec.step()
            assert time.monotonic() < deadline
        assert dec.completion(4).token_ids == ref[1]
        assert dec.scheduler.num_free_blocks == dec.scheduler.num_usable_blocks
        return dec, cons, pull
    finally:
        fake.close()
        cons.close()


def kv_reply(signer: Signer, tid: str, shape, dtype: str, data: bytes) -> list[list[bytes]]:
    return [[*signer.pack(b"KV", {"transfer_id": tid, "shape": shape, "dtype": dtype}), data]]


def test_the_pull_is_authenticated_and_names_only_the_transfer(tiny):
    # (next_message() checked it in the session.)
    _, _, hdr = decode_against(tiny, lambda hdr, s: [], secret=b"k" * 32, timeout_s=0.2)
    assert set(hdr) == {"transfer_id", "block_ids"} and hdr["transfer_id"] == "cd" * 16


@pytest.mark.parametrize("case", ["unsigned", "wrong secret", "secret without session",
                                  "replayed", "garbage", "other transfer", "one frame",
                                  "numeric transfer id"])
def test_replies_that_fail_authentication_are_dropped_and_the_request_times_out(tiny, case):
    secret = b"s" * 32
    master, wrong = Signer(secret), Signer(b"w" * 32)

    def err(s, tid):
        return [*s.pack(b"ERR", {"transfer_id": tid, "error": "x"})]

    def replayed(h, s):
        once = err(s, "ef" * 16)  # authenticated, for no transfer: dropped ...
        return [once, once]  # ... and then the same frames again

    frames = {
        "unsigned": lambda h, s: [[b"KV", msgpack.packb(h), b"\0" * 40, b"x"]],
        "wrong secret": lambda h, s: [err(wrong, h["transfer_id"])],
        "secret without session": lambda h, s: [err(master, h["transfer_id"])],
        "replayed": replayed,
        "garbage": lambda h, s: [[b"\xff" * 7, b"\x00"]],
        "other transfer": lambda h, s: [err(s, "ef" * 16)],
        "one frame": lambda h, s: [[b"KV"]],
        "numeric transfer id": lambda h, s: [[*s.pack(b"ERR", {"transfer_id": 7, "error": "x"})]],
    }[case]
    dec, cons, _ = decode_against(tiny, frames, secret=secret, timeout_s=0.3)
    assert cons.transfer_stats["rejected"] >= 1
    if case == "replayed":
        whys = [d for _, ev, _, d in cons.log if ev == "rejected"]
        assert len(whys) == 2 and "replayed" in whys[1]
    comp = dec.completion(9)
    assert comp.token_ids == [] and comp.finish_reason.startswith("kv transfer failed: no KV")


@pytest.mark.parametrize("case", ["error", "wrong shape", "object dtype", "short data",
                                  "long data", "float64", "no shape"])
def test_authenticated_but_wrong_kv_fails_only_its_request(tiny, case):
    secret = b"s" * 32
    dec0 = LLMEngine(EngineConfig(**TINY), model_path=tiny[0])
    layout = [len(dec0.cache.k), 2]
    block = list(dec0.cache.block_shape)
    block_bytes = 4 * int(torch.tensor(layout + block).prod())
    del dec0

    def frames(h, s):
        n = len(h["block_ids"])
        shape, tid = layout[:2] + [n] + block, h["transfer_id"]
        return {
            "error": [[*s.pack(b"ERR", {"transfer_id": tid, "error": "E" * 10_000})]],
            "wrong shape": kv_reply(s, tid, shape[:-1] + [shape[-1] * 2], "float32",
                                    b"\0" * (n * block_bytes * 2)),
            "object dtype": kv_reply(s, tid, shape, "object", b"\0" * (n * block_bytes)),
            "short data": kv_reply(s, tid, shape, "float32", b"\0" * (n * block_bytes - 4)),
            "long data": kv_reply(s, tid, shape, "float32", b"\0" * (n * block_bytes + 4)),
            "float64": kv_reply(s, tid, shape, "float64", b"\0" * (2 * n * block_bytes)),
            "no shape": [[*s.pack(b"KV", {"transfer_id": tid}), b""]],
        }[case]

    dec, cons, _ = decode_against(tiny, frames, secret=secret)
    comp = dec.completion(9)
    assert comp.token_ids == [] and comp.finish_reason.startswith("kv transfer failed")
    assert len(comp.finish_reason) < 400
    assert cons.transfer_stats["failed"] == 1 and cons.transfer_stats["transfers"] == 0


@pytest.mark.parametrize("field,value,match", [
    ("remote_block_ids", [0, 0, 1, 2, 3], "twice"),
    ("remote_block_ids", [0, -1], "non-negative"),
    ("remote_block_ids", "0,1", "list"),
    ("remote_block_ids", list(range(100)), "list of 1 to"),
    ("remote_port", 0, "remote_port"),
    ("remote_port", "5555", "remote_port"),
    ("remote_host", ["127.0.0.1"], "remote_host"),
    ("transfer_id", 7, "transfer id"),
    ("transfer_id", "x" * 32, "transfer id"),
    ("first_token_id", -3, "first_token_id"),
    ("draft_token_ids", [1, "2"], "draft_token_ids"),
    ("num_prompt_tokens", 2.5, "num_prompt_tokens"),
])
def test_bad_kv_transfer_params_are_refused_at_add_request(tiny, field, value, match):
    path, prompts, params, ref = tiny
    dec = LLMEngine(EngineConfig(**TINY), model_path=path)
    cons = LoopbackConsumer(secret=b"s" * 32)
    try:
        dec.set_kv_connector(cons)
        x = dict(fake_params(5555, prompts[0], 3), **{field: value})
        with pytest.raises(ValueError, match=match):
            dec.add_request(prompts[0], params, request_id=9, kv_transfer_params=x)
        assert not dec.has_unfinished() and 9 not in dec.scheduler
    finally:
        cons.close()


def test_the_secret_is_required_and_checked():
    with pytest.raises(TypeError):
        LoopbackConsumer()  # type: ignore[call-arg]
    for bad in (b"short", "a string secret of 32 characters", None):
        with pytest.raises(ValueError, match="secret"):
            LoopbackConsumer(secret=bad)


# ---- replays, relays and floods (issue 28) ----------------------------------------------------
def test_a_listener_relaying_the_decode_engines_frames_gets_no_kv(held):
    """Hostile kv_transfer_params name a real transfer but a stranger's port; the stranger relays
    everything the decode engine sends to the real producer and everything back. Before sessions
    the decode engine's signed PULL, replayed, got the transfer's KV; now the producer refuses
    the OPEN (it names the stranger's endpoint), and nothing is served."""
    pair, prompts, params, ref = held
    relay = Relay(pair.prod.port)
    pair.cons.recv_timeout_s = 0.5  # the hostile request then fails soon
    try:
        hostile = dict(xfer(pair, 0), remote_port=relay.port)
        pair.dec.add_request(prompts[0], params, request_id=100, kv_transfer_params=hostile)
        relay.drive(pair.dec, pair.pre)
        assert relay.caught, "the decode engine never spoke to the relay"
        assert relay.answers == []  # the producer said nothing: no SESSION, no KV
        assert pair.prod.transfer_stats["transfers"] == 0 and pair.prod.pending_sends == [0, 1]
        whys = [d for _, ev, _, d in pair.prod.log if ev == "rejected"]
        assert whys and "another endpoint" in whys[0]
    finally:
        relay.close()
    finish(pair, [0, 1], prompts, params, ref)
    assert pair.dec.completion(100).finish_reason.startswith("kv transfer failed")


def test_frames_caught_from_a_session_are_useless_replayed(held):
    """A peer with the secret opens a session and pulls; a stranger who caught every frame
    replays them on its own connection (the OPEN gets a fresh session, the PULL fails in it) and
    on the same one (refused as a replay): no KV either way."""
    pair, prompts, params, ref = held
    x = xfer(pair, 0)
    honest, stranger = Peer(pair.prod.port), Peer(pair.prod.port)
    try:
        honest.open(pair.pre, pair.prod.secret)
        bad = pull_replies(pair, honest, x["transfer_id"], [10_000])  # refused, but authentic
        assert [r["kind"] for r in bad] == [b"ERR"]
        before = pair.prod.transfer_stats["rejected"]
        for frames in honest.sent:
            stranger.send_raw(frames)
        got = stranger.replies(pair.pre)
        assert [m[0] for m in got] == [b"SESSION"]  # a session whose key it cannot derive
        honest.send_raw(honest.sent[-1])
        assert honest.replies(pair.pre, 0.1) == []
        assert pair.prod.transfer_stats["rejected"] == before + 2
        whys = [d for _, ev, _, d in pair.prod.log if ev == "rejected"][-2:]
        assert "another session" in whys[0] and "replayed" in whys[1]
        assert pair.prod.transfer_stats["transfers"] == 0
    finally:
        honest.close()
        stranger.close()
    finish(pair, [0, 1], prompts, params, ref)


def test_a_flood_of_bad_frames_costs_each_poll_a_bounded_amount(held, caplog):
    """20,000 frames without a session: one poll() reads at most MAX_FRAMES_PER_POLL of them,
    the log gets one warning, and an honest transfer completes while the flood goes on."""
    pair, prompts, params, ref = held
    flooder = Peer(pair.prod.port)
    try:
        for _ in range(20_000):
            flooder.sock.send_multipart([b"PULL", b"\x80", b"x" * 40])
        time.sleep(0.5)  # let them arrive
        caplog.set_level("WARNING", logger="atom_sched.connectors")
        t0 = time.perf_counter()
        pair.prod.poll(0)
        one_poll = time.perf_counter() - t0
        assert pair.prod.transfer_stats["rejected"] == MAX_FRAMES_PER_POLL
        assert one_poll < 1.0
        for _ in range(50):
            pair.prod.poll(0)
        assert pair.prod.transfer_stats["rejected"] == 51 * MAX_FRAMES_PER_POLL
        assert len([r for r in caplog.records if "rejected" in r.getMessage()]) == 1
        for _ in range(20_000):  # still flooding while the honest transfers run
            flooder.sock.send_multipart([b"PULL", b"\x80", b"x" * 40])
        finish(pair, [0, 1], prompts, params, ref)
    finally:
        flooder.close()


def test_the_consumer_keeps_sockets_only_for_producers_it_still_needs(tiny):
    """Requests naming 100 different ports (nobody listens there): at most MAX_PRODUCERS
    producers at once (a request naming one more is refused at add_request), and once the
    requests have failed no socket stays open."""
    path, prompts, params, ref = tiny
    dec = LLMEngine(EngineConfig(**TINY), model_path=path)
    cons = LoopbackConsumer(secret=b"s" * 32, recv_timeout_s=0.2, link_idle_s=0.0)
    dec.set_kv_connector(cons)
    try:
        refused = 0
        for i in range(100):
            try:
                dec.add_request(prompts[0], params, request_id=i,
                                kv_transfer_params=fake_params(20_000 + i, prompts[0], 3))
            except ValueError as e:
                assert "producers" in str(e)
                refused += 1
        assert refused == 100 - MAX_PRODUCERS
        assert cons.num_sockets == MAX_PRODUCERS
        deadline = time.monotonic() + 60
        while dec.has_unfinished():
            dec.step()
            assert time.monotonic() < deadline
        dec.step()
        assert cons.num_sockets == 0
        assert dec.scheduler.num_free_blocks == dec.scheduler.num_usable_blocks
    finally:
        cons.close()


def test_a_producer_restarted_on_its_port_serves_again(tiny):
    """The consumer's session is with the producer that answered its OPEN; one restarted on the
    same port knows none, so the next pull in the old session times out, the link is dropped,
    and the request after it opens a new session and gets its KV."""
    path, prompts, params, ref = tiny
    pair = Pair(path)
    try:
        pair.prefill_only([0], prompts, params)
        finish(pair, [0], prompts, params, ref)
        port, secret = pair.prod.port, pair.prod.secret
        pair.prod.close()
        pair.prod = LoopbackProducer(port=port, secret=secret)
        pair.pre.set_kv_connector(pair.prod)
        pair.cons.recv_timeout_s = 0.5
        pair.prefill_only([1, 2], prompts, params)
        pair.dec.add_request(prompts[1], params, request_id=1, kv_transfer_params=xfer(pair, 1))
        deadline = time.monotonic() + 30
        while pair.dec.has_unfinished():
            pair.step()
            assert time.monotonic() < deadline
        assert pair.dec.completion(1).finish_reason.startswith("kv transfer failed: no KV")
        pair.prod.release(xfer(pair, 1)["transfer_id"])
        finish(pair, [2], prompts, params, ref)
    finally:
        pair.close()
