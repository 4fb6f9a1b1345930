"""The NIXL connector against misuse and hostile peers.

The producer hands its NIXL agent metadata (which lets a peer READ its KV cache) only to a
consumer that says HELLO, naming a transfer it holds, in a session opened with the pair's secret
(a replayed or relayed HELLO gets nothing); it frees a transfer's blocks only on a
notification from such an agent naming a live transfer. The consumer checks the producer's
META (layout, sizes, addresses) before NIXL sees it, and a producer that dies or lies fails only
the request, with its reason, never hangs the engine.
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
zmq = pytest.importorskip("zmq")
import msgpack  # noqa: E402
from support.disagg import TINY, Pair, tiny_case  # noqa: E402
from support.side_channel import FakeProducer, Peer, Relay  # noqa: E402

from atom_sched.connectors import NixlConsumer, NixlProducer, nixl_available  # noqa: E402
from atom_sched.connectors.control import Signer  # noqa: E402
from atom_sched.connectors.nixl import _nixl_api  # noqa: E402
from atom_sched.engine import EngineConfig, LLMEngine  # noqa: E402

if not nixl_available():
    if os.environ.get("CI"):
        pytest.fail("NIXL is not installed (make venv installs it)", pytrace=False)
    pytest.skip("NIXL is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_case(tmp_path_factory)


@pytest.fixture
def held(tiny):
    """A NIXL pair whose prefill engine holds prompt 0's KV, not read yet."""
    path, prompts, params, ref = tiny
    pair = Pair(path, transport="nixl")
    pair.prefill_only([0], prompts, params)
    yield pair, prompts, params, ref
    pair.close()


def xfer(pair, rid):
    return pair.prefilled[rid].kv_transfer_params


def finish(pair, prompts, params, ref):
    pair.dec.add_request(prompts[0], params, request_id=0, kv_transfer_params=xfer(pair, 0))
    pair.run()
    assert pair.dec.completion(0).token_ids == ref[0]
    for eng in (pair.pre, pair.dec):
        assert eng.scheduler.num_free_blocks == eng.scheduler.num_usable_blocks


def test_metadata_only_for_the_secret(held):
    pair, prompts, params, ref = held
    tid = xfer(pair, 0)["transfer_id"]
    peer = Peer(pair.prod.port)
    try:
        hello = {"agent_name": "thief", "transfer_id": tid}
        # Another secret, no MAC, and the right secret without a session (the old protocol).
        for frames in (Signer(b"w" * 32).pack(b"HELLO", hello),
                       [b"HELLO", msgpack.packb(hello), b"\0" * 32],
                       Signer(pair.prod.secret).pack(b"HELLO", hello)):
            peer.send_raw(frames)
            assert peer.replies(pair.pre, 0.1) == []
        peer.open(pair.pre, pair.prod.secret)
        for bad in ({"agent_name": ""}, {"agent_name": "x" * 200}, {"agent_name": "a b"},
                    {"agent_name": 7}, {"agent_name": None}, {"transfer_id": "ab" * 16},
                    {"transfer_id": None}):  # authenticated, malformed or for no transfer
            peer.send(b"HELLO", dict(hello, **bad))
            assert peer.replies(pair.pre, 0.05) == []
        assert pair.prod.transfer_stats["rejected"] == 10
        peer.send(b"HELLO", {"agent_name": "decode-x", "transfer_id": tid})
        (meta,) = peer.replies(pair.pre, 0.2)
        kind, hdr, _ = peer.session.unpack(meta, {b"META": 0})
        assert isinstance(hdr["metadata"], bytes) and hdr["layout"]["regions"] == 4
    finally:
        peer.close()
    finish(pair, prompts, params, ref)


def test_a_relayed_or_replayed_hello_gets_no_metadata(held):
    """Hostile kv_transfer_params name a live transfer and a stranger's port; the stranger
    relays the decode engine's frames to the producer (before sessions its HELLO, replayed, got
    META: the key to READ every block). Then frames caught from a real session, replayed on a
    new connection and on the same one: still no META."""
    pair, prompts, params, ref = held
    relay = Relay(pair.prod.port)
    pair.cons.recv_timeout_s = 0.5
    try:
        hostile = dict(xfer(pair, 0), remote_port=relay.port)
        pair.dec.add_request(prompts[0], params, request_id=100, kv_transfer_params=hostile)
        relay.drive(pair.dec, pair.pre)
        assert relay.caught and relay.answers == []
        assert pair.prod._peers == set()
    finally:
        relay.close()
    honest, stranger = Peer(pair.prod.port), Peer(pair.prod.port)
    try:
        honest.open(pair.pre, pair.prod.secret)
        honest.send(b"HELLO", {"agent_name": "decode-x", "transfer_id": "ab" * 16})
        assert honest.replies(pair.pre, 0.1) == []  # authentic, but for no transfer
        for frames in honest.sent:
            stranger.send_raw(frames)
        assert [m[0] for m in stranger.replies(pair.pre)] == [b"SESSION"]
        honest.send_raw(honest.sent[-1])
        assert honest.replies(pair.pre, 0.1) == []
        whys = [d for _, ev, _, d in pair.prod.log if ev == "rejected"][-2:]
        assert "another session" in whys[0] and "replayed" in whys[1]
    finally:
        honest.close()
        stranger.close()
    finish(pair, prompts, params, ref)
    assert pair.dec.completion(100).finish_reason.startswith("kv transfer failed")


def test_notifications_from_strangers_or_for_unknown_transfers_free_nothing(held):
    """An agent that got the metadata some other way (it leaked) but never said HELLO, and a
    HELLO'd agent naming garbage or an unknown transfer: the blocks stay held."""
    pair, prompts, params, ref = held
    api = _nixl_api()
    cfg = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                backends=[])
    stranger = api.nixl_agent("stranger", cfg)
    stranger.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    name = stranger.add_remote_agent(pair.prod._agent.agent.get_agent_metadata())
    name = name.decode() if isinstance(name, bytes) else name
    stranger.send_notif(name, xfer(pair, 0)["transfer_id"].encode())
    for _ in range(20):
        pair.pre.step()
    assert pair.prod.pending_sends == [0]
    assert pair.prod.log[-1][1:3] == ("rejected", -1)
    # Now HELLO'd, it names garbage and an unknown transfer.
    peer = Peer(pair.prod.port)
    try:
        peer.open(pair.pre, pair.prod.secret)
        peer.send(b"HELLO", {"agent_name": "stranger", "transfer_id": xfer(pair, 0)["transfer_id"]})
        assert len(peer.replies(pair.pre, 0.2)) == 1
    finally:
        peer.close()
    before = pair.prod.transfer_stats["rejected"]
    for msg in (b"\xff" * 40, b"ab" * 16, b"x" * 10_000):
        stranger.send_notif(name, msg)
    deadline = time.monotonic() + 5
    while pair.prod.transfer_stats["rejected"] < before + 3:
        stranger.get_new_notifs()  # a large notification leaves only as its sender progresses
        pair.pre.step()
        assert time.monotonic() < deadline
    assert pair.prod.pending_sends == [0]
    finish(pair, prompts, params, ref)


def decode_against_fake(tiny, meta_for, timeout_s=0.5):
    """A NIXL decode engine whose request 9's KV is at a fake producer that answers HELLO with
    ``meta_for(real layout)``; returns the completion of request 9 (request 4 is local)."""
    path, prompts, params, ref = tiny
    secret = b"s" * 32
    dec = LLMEngine(EngineConfig(**TINY), model_path=path)
    cons = NixlConsumer(secret=secret, recv_timeout_s=timeout_s)
    dec.set_kv_connector(cons)
    fake = FakeProducer(secret)
    try:
        n = -(-len(prompts[0]) // TINY["block_size"])
        x = {"do_remote_prefill": True, "remote_block_ids": list(range(1, n + 1)),
             "remote_host": "127.0.0.1", "remote_port": fake.port, "transfer_id": "ab" * 16,
             "first_token_id": ref[0][0], "num_prompt_tokens": len(prompts[0])}
        dec.add_request(prompts[1], params, request_id=4)
        dec.add_request(prompts[0], params, request_id=9, kv_transfer_params=x)
        ident, _, hello, _ = fake.next_message(dec, {b"HELLO": 0})
        assert hello["transfer_id"] == x["transfer_id"]
        layout = cons._agent.layout()
        fake.send(ident, fake.sessions[ident].pack(b"META", meta_for(layout)))
        deadline = time.monotonic() + 30
        while dec.has_unfinished():
            dec.step()
            assert time.monotonic() < deadline
        assert dec.completion(4).token_ids == ref[1]
        assert dec.scheduler.num_free_blocks == dec.scheduler.num_usable_blocks
        return dec.completion(9), cons
    finally:
        fake.close()
        cons.close()


def meta(lay, **over):
    m = {"agent_name": "fake-prefill", "metadata": os.urandom(700), "layout": dict(lay)}
    for k, v in over.items():
        if k in lay:
            m["layout"][k] = v
        else:
            m[k] = v
    return m


@pytest.mark.parametrize("case", ["regions", "block_len", "dtype"])
def test_a_producer_with_another_layout_fails_the_request_with_the_reason(tiny, case):
    value = {"regions": 6, "block_len": 1, "dtype": "bfloat16"}[case]
    comp, _ = decode_against_fake(tiny, lambda lay: meta(lay, **{case: value}))
    assert comp.token_ids == [] and "KV layout" in comp.finish_reason


def test_garbage_metadata_fails_the_handshake_cleanly(tiny):
    comp, _ = decode_against_fake(tiny, lambda lay: meta(lay))  # random metadata bytes
    assert comp.token_ids == [] and "NIXL handshake" in comp.finish_reason


@pytest.mark.parametrize("case", ["name", "metadata type", "metadata size", "num_blocks",
                                  "bases", "no layout", "oversized"])
def test_malformed_meta_is_rejected_and_fails_the_request(tiny, case):
    over = {"name": {"agent_name": "a b"}, "metadata type": {"metadata": "text"},
            "metadata size": {"metadata": b""}, "num_blocks": {"num_blocks": 0},
            "bases": {"bases": [1, 2]}, "no layout": {"layout": None},
            "oversized": {"metadata": b"x" * (2 << 20)}}[case]
    comp, cons = decode_against_fake(tiny, lambda lay: meta(lay, **over), timeout_s=0.3)
    # A message over the socket's cap (one request's KV + 1 MiB here) is dropped by ZMQ unread:
    # the request waits for its timeout.
    assert cons.transfer_stats["rejected"] == (0 if case == "oversized" else 1)
    why = "no KV" if case == "oversized" else "NIXL handshake"
    assert comp.token_ids == [] and why in comp.finish_reason


def test_remote_block_ids_beyond_the_producers_cache_fail_the_request(tiny):
    """Real metadata of a live agent, but a block count smaller than the ids the request names:
    checked before NIXL is asked for a READ past the end."""
    pre = LLMEngine(EngineConfig(**TINY), model_path=tiny[0])
    prod = NixlProducer()
    pre.set_kv_connector(prod)
    try:
        real = {"agent_name": prod._agent.name,
                "metadata": prod._agent.agent.get_agent_metadata()}
        # (Its own base addresses: descriptors outside its registered memory fail the handshake.)
        comp, _ = decode_against_fake(
            tiny, lambda lay: meta(prod._agent.layout(), num_blocks=2, **real))
    finally:
        prod.close()
    assert comp.token_ids == [] and "beyond the producer" in comp.finish_reason


def test_a_dead_producer_fails_the_request_instead_of_hanging(tiny):
    """Two processes: after one transfer (the handshake done), the prefill process is killed;
    the next READ fails at once and ends only its request."""
    from atom_sched.connectors import DisaggPair

    path, prompts, params, ref = tiny
    with DisaggPair(path, prefill_config=TINY, decode_config=TINY, transport="nixl",
                    consumer_kwargs={"recv_timeout_s": 20.0}) as pair:
        pre = pair.prefill(prompts[:2], params, request_ids=[0, 1])
        (first,) = pair.decode(prompts[:1], pre[:1], params)
        assert first.token_ids == ref[0]
        pair._procs["prefill"].kill()
        pair._procs["prefill"].join(10)
        t0 = time.monotonic()
        # Straight to the decode engine (the proxy reports the dead prefill engine and stops).
        pair._pipes["decode"].send(("add", 1, prompts[1], params, pre[1].kv_transfer_params))
        second = pair._expect("decode", "done", 30)[1]
        assert time.monotonic() - t0 < 10
        assert second.token_ids == [] and second.finish_reason.startswith("kv transfer failed")
        assert "NIXL READ" in second.finish_reason
        st = pair.state("decode")
        assert st["num_free_blocks"] == st["num_usable_blocks"] and not st["has_pending"]


def test_connectors_collected_unclosed_do_not_hang_the_process(tiny, tmp_path):
    """Every connector bound to an engine, dropped in a reference cycle without close(), then
    one left for the interpreter's exit: before, the garbage collector ran the ZMQ context's
    finalizer while the connector's sockets were still open, and Context.term() blocked the
    process forever."""
    import subprocess
    import sys

    script = tmp_path / "drop.py"
    script.write_text(f"""
import gc, sys
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from support.disagg import TINY
from atom_sched.connectors import LoopbackConsumer, LoopbackProducer, NixlConsumer, NixlProducer
from atom_sched.engine import EngineConfig, LLMEngine
for make in (LoopbackProducer, NixlProducer, lambda: LoopbackConsumer(secret=b"s" * 32),
             lambda: NixlConsumer(secret=b"s" * 32)):
    engine = LLMEngine(EngineConfig(**TINY), model_path={str(tiny[0])!r})
    conn = make()
    engine.set_kv_connector(conn)
    conn.cycle = conn
    del conn, engine
    gc.collect()
left = NixlProducer()
LLMEngine(EngineConfig(**TINY), model_path={str(tiny[0])!r}).set_kv_connector(left)
print("ok", flush=True)
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"
