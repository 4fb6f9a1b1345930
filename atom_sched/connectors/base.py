"""What every KV connector pair shares, whatever moves the bytes (ZMQ frames in loopback.py, NIXL
one-sided READs in nixl.py):

* :class:`ProducerBase`, on the prefill engine: which requests go to a decode engine, their blocks
  held until the consumer is done with them (or ``release_timeout_s`` passes), ATOM's
  ``kv_transfer_params_output``, and an authenticated ROUTER side channel on 127.0.0.1 that
  every transport uses for its control messages (at least ``DONE``: the consumer gives a transfer
  up or has it);
* :class:`ConsumerBase`, on the decode engine: the checked ``kv_transfer_params`` of each remote
  prefill, the scheduler side of the protocol (a dry-run-safe ``get_num_new_matched_tokens``,
  ``update_state_after_alloc`` recording where the KV goes), the requests in flight with their
  timeout, and one authenticated DEALER per producer.

A transport subclass adds its message kinds and moves the KV: the producer's ``_handlers`` and
``_poll_transport``; the consumer's ``_begin`` (start a request's transfer), ``_poll_transport``
and ``_reply_kinds``/``_on_reply``. Control frames are checked by control.py and travel in a
session per consumer connection (``OPEN`` -> ``SESSION``, control.py); anything that fails a check
is counted and dropped and never raises out of ``poll()``.

What a flood costs: one ``poll()`` reads at most :data:`MAX_FRAMES_PER_POLL` frames a socket
(ZMQ queues the rest, and a ROUTER takes its peers in turn, so an honest consumer's frames still
come through), and rejected frames are logged at most once every :data:`REJECT_LOG_INTERVAL_S`
seconds with the count since (``transfer_stats["rejected"]`` counts them all). A consumer keeps a
socket per producer only while a request needs it (plus ``link_idle_s``), at most
:data:`MAX_PRODUCERS` producers at once.
"""

from __future__ import annotations

import secrets
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from .._core import ConnectorRequest, KVConnector, RemoteMatch
from .control import (
    OPEN,
    ClientHandshake,
    FrameError,
    RemoteParams,
    Session,
    check_loopback_host,
    check_secret,
    logger,
    new_transfer_id,
    parse_remote_params,
    server_open,
    transfer_id,
)

DONE = b"DONE"  # consumer -> producer: {transfer_id} (received, or given up): free the blocks
LOG_ENTRIES = 10_000  # the event log is a ring: a flood of bad frames cannot grow memory
MAX_FRAMES_PER_POLL = 64  # frames one poll() reads from one socket; ZMQ queues the rest
REJECT_LOG_INTERVAL_S = 10.0  # at most one warning this often about rejected frames
MAX_SESSIONS = 256  # sessions a producer keeps (least recently used go first, unproven first)
MAX_PRODUCERS = 64  # distinct producers a consumer talks to at once


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _release(ctx: zmq.Context, sockets: list[zmq.Socket], closers: list[Callable[[], None]]
             ) -> None:
    """Close a connector's resources: its transport's (``closers``, last opened first), every
    socket, then the context. A weakref finalizer runs it on close(), when the connector is
    collected, or at exit; it holds the sockets itself, so that a connector collected in a
    reference cycle still closes them before the context terminates (the context's own
    finalizer would block in ``term()`` on sockets nobody closed)."""
    for close in reversed(closers):
        try:
            close()
        except Exception:  # noqa: BLE001 - closing: nothing left to protect
            pass
    for sock in sockets:
        sock.close(linger=0)
    ctx.destroy(linger=0)


class ConnectorBase(KVConnector):
    """Engine binding, the secret, the event log and transfer statistics of both sides."""

    def __init__(self, engine_id: str, secret: bytes) -> None:
        super().__init__()
        self.engine_id = engine_id
        self._secret = check_secret(secret)
        self._engine: Any = None
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._closers: list[Callable[[], None]] = []
        self._finalizer = weakref.finalize(self, _release, self._ctx, self._sockets,
                                           self._closers)
        # (monotonic time, event, request id or -1, detail): for tests, operators and debugging.
        self.log: deque[tuple[float, str, int, Any]] = deque(maxlen=LOG_ENTRIES)
        self.transfer_stats = {"transfers": 0, "blocks": 0, "bytes": 0, "seconds": 0.0,
                               "failed": 0, "rejected": 0}
        self._rejects_unlogged = 0
        self._reject_logged_at = -REJECT_LOG_INTERVAL_S

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def num_sockets(self) -> int:
        """Sockets open now (the producer's one; a consumer's, one per producer it needs)."""
        return len(self._sockets)

    def _new_socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._sockets.append(sock)
        return sock

    def _close_socket(self, sock: zmq.Socket, linger_ms: int = 0) -> None:
        self._sockets.remove(sock)
        sock.close(linger=linger_ms)

    # -- engine side ----------------------------------------------------------------------------
    def bind(self, engine: Any) -> None:
        """Called by ``LLMEngine.set_kv_connector``: the engine whose KV cache this moves."""
        self._engine = engine

    def _layout(self) -> tuple[int, ...]:
        """``(layers, 2, block_size, kv_heads, head_dim)`` of the bound engine's cache."""
        cache = self._engine.cache
        return (len(cache.k), 2, *cache.block_shape)

    def _dtype(self) -> np.dtype:
        return np.dtype(str(self._engine.cache.k[0].dtype).removeprefix("torch."))

    def _block_bytes(self) -> int:
        """Bytes of one block over every layer, K and V."""
        return int(np.prod(self._layout())) * self._dtype().itemsize

    def _max_blocks(self) -> int:
        """Blocks of the longest request this engine admits."""
        return cdiv(self._engine.sched_config.max_model_len, self._engine.cache.block_size)

    def _log(self, event: str, rid: int, detail: Any = None) -> None:
        self.log.append((time.monotonic(), event, int(rid), detail))

    def _reject(self, why: str) -> None:
        """A frame that failed a check: counted, kept in the log ring, dropped; a warning at
        most every REJECT_LOG_INTERVAL_S (a flood must not flood the logs too)."""
        self.transfer_stats["rejected"] += 1
        self._log("rejected", -1, why)
        self._rejects_unlogged += 1
        now = time.monotonic()
        if now - self._reject_logged_at >= REJECT_LOG_INTERVAL_S:
            logger.warning("%s: rejected %d frame(s) since the last warning, the last: %s",
                           self.engine_id, self._rejects_unlogged, why)
            self._rejects_unlogged = 0
            self._reject_logged_at = now

    def _count(self, blocks: int, nbytes: int, seconds: float) -> None:
        st = self.transfer_stats
        st["transfers"] += 1
        st["blocks"] += blocks
        st["bytes"] += nbytes
        st["seconds"] += seconds

    def close(self) -> None:
        """Close the sockets and the transport (also done when the connector is collected)."""
        self._finalizer()


@dataclass
class Send:
    """A finished prefill whose blocks are held until the consumer is done with them."""

    request_id: int
    blocks: list[int]
    since: float
    peer: bytes | None = None  # the side-channel identity of the consumer that pulled
    served: bool = False


class ProducerBase(ConnectorBase):
    """The prefill engine's side: keeps finished requests' blocks until the decode engine is done
    with them. Its side channel is a ROUTER socket on ``host:port`` (port 0: a free port, see
    :attr:`port`). ``secret`` (16 bytes or more) is shared with the consumers; without one a
    random secret is made (:attr:`secret`, to hand to the consumer)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None = None,
                 engine_id: str = "prefill-0", release_timeout_s: float = 300.0) -> None:
        self.secret = secrets.token_bytes(32) if secret is None else secret
        super().__init__(engine_id, self.secret)
        self.host = check_loopback_host(host)
        self.release_timeout_s = float(release_timeout_s)
        self._sock = self._new_socket(zmq.ROUTER)
        # Only headers come in: a larger frame closes that peer's connection inside ZMQ.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 << 20)
        if port:
            self._sock.bind(f"tcp://{self.host}:{int(port)}")
            self.port = int(port)
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        # A session per consumer connection (ROUTER identity); see control.py.
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()
        self._marked: set[int] = set()  # do_remote_decode requests not finished
        self._sends: dict[str, Send] = {}  # transfer id -> blocks held for the consumer
        self._outputs: dict[int, dict[str, Any]] = {}  # kv_transfer_params_output, not taken
        self._finished: list[int] = []  # request ids to report as finished_sending
        # Side-channel message kinds -> handler(identity, header); a transport adds its own.
        self._handlers: dict[bytes, Callable[[bytes, dict[str, Any]], None]] = {
            DONE: self._on_done}

    # -- scheduler side (KVConnector) -----------------------------------------------------------
    def is_producer(self) -> bool:
        return True

    def get_num_new_matched_tokens(self, request: ConnectorRequest) -> RemoteMatch:
        return RemoteMatch()  # the prefill engine computes every prompt itself

    def update_state_after_alloc(self, request: ConnectorRequest) -> None:
        pass

    def request_finished(self, request: ConnectorRequest) -> bool:
        rid = request.request_id
        if rid not in self._marked:
            return False  # an ordinary request, served here
        self._marked.discard(rid)
        tokens = request.token_ids
        prompt_len = request.num_prompt_tokens
        blocks = list(request.block_ids)
        if len(tokens) <= prompt_len or not blocks:
            self._log("not_sent", rid, "finished before its prefill completed")
            return False
        tid = new_transfer_id()
        self._sends[tid] = Send(rid, blocks, time.monotonic())
        engine = self._engine
        drafts = engine.last_drafts(rid) if engine is not None else []
        # ATOM's kv_transfer_params_output (spec 5.6), plus the prompt length for checking.
        self._outputs[rid] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_handshake_port": self.port,
            "tp_size": 1,
            "dp_rank": 0,
            "transfer_id": tid,
            "first_token_id": int(tokens[prompt_len]),
            "draft_token_ids": [int(t) for t in drafts],
            "num_prompt_tokens": prompt_len,
        }
        self._log("finished", rid, len(blocks))
        return True

    # -- engine side ----------------------------------------------------------------------------
    def add_request(self, request_id: int, prompt_token_ids: list[int],
                    kv_transfer_params: dict[str, Any]) -> None:
        if not kv_transfer_params.get("do_remote_decode"):
            raise ValueError("the prefill engine's kv_transfer_params need do_remote_decode=True")
        self._marked.add(int(request_id))

    def take_kv_transfer_params_output(self, request_id: int) -> dict[str, Any] | None:
        """ATOM's ``kv_transfer_params_output`` of a finished request (once)."""
        return self._outputs.pop(int(request_id), None)

    def has_pending(self) -> bool:
        return bool(self._sends or self._finished)

    @property
    def pending_sends(self) -> list[int]:
        """The request ids whose blocks are held for a consumer."""
        return sorted(s.request_id for s in self._sends.values())

    def release(self, transfer_id: str) -> None:
        """Give up a send (e.g. the request needs no decode): its blocks are freed at the next
        step."""
        self._finish(transfer_id, "released")

    def poll(self, timeout_ms: int = 0) -> tuple[list[int], list[int], dict[int, str]]:
        """Serve the side channel and the transport; returns ``(finished_sending, [], {})``."""
        if timeout_ms and self._sends:
            self._wait(timeout_ms)
        for _ in range(MAX_FRAMES_PER_POLL):
            try:
                ident, *frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                self._on_frames(ident, frames)
            except FrameError as e:
                self._reject(str(e))
        self._poll_transport()
        now = time.monotonic()
        for tid, send in list(self._sends.items()):
            if now - send.since > self.release_timeout_s:
                self._finish(tid, "timed out")
        done, self._finished = self._finished, []
        return done, [], {}

    def _on_frames(self, ident: bytes, frames: list[bytes]) -> None:
        """One message from the consumer connection ``ident``: an OPEN starts its session
        (replacing any earlier one), anything else must come in that session."""
        if frames and frames[0] == OPEN:
            session, reply = server_open(self._secret, f"{self.host}:{self.port}", frames)
            self._keep_session(ident, session)
            self._sock.send_multipart([ident, *reply], zmq.NOBLOCK)
            return
        session = self._sessions.get(ident)
        if session is None:
            raise FrameError("no session on this connection (OPEN first)")
        kind, hdr, _ = session.unpack(frames, dict.fromkeys(self._handlers, 0))
        self._sessions.move_to_end(ident)
        self._handlers[kind](ident, hdr)

    def _keep_session(self, ident: bytes, session: Session) -> None:
        """Keep at most MAX_SESSIONS: the least recently used goes, one that never carried a
        frame (a replayed OPEN's, say) before any that did."""
        self._sessions.pop(ident, None)
        if len(self._sessions) >= MAX_SESSIONS:
            unproven = next((i for i, s in self._sessions.items() if not s.used), None)
            self._sessions.pop(next(iter(self._sessions)) if unproven is None else unproven)
        self._sessions[ident] = session

    def _wait(self, timeout_ms: int) -> None:
        """Wait for work when the engine is idle: by default, for a side-channel frame."""
        self._sock.poll(timeout_ms, zmq.POLLIN)

    def _poll_transport(self) -> None:
        """The transport's own progress (completion notifications), once per poll."""

    def _on_done(self, ident: bytes, hdr: dict[str, Any]) -> None:
        tid = transfer_id(hdr.get("transfer_id"))
        send = self._sends.get(tid)
        if send is None:
            raise FrameError("DONE for an unknown transfer")
        if send.peer is not None and send.peer != ident:
            raise FrameError("DONE from a peer that did not pull the transfer")
        self._finish(tid, "acked" if send.served else "released by the consumer")

    def _send(self, ident: bytes, kind: bytes, hdr: dict[str, Any], *data: Any) -> None:
        """A reply in ``ident``'s session (dropped if that consumer's queue is full: it times
        out and fails only its request)."""
        try:
            self._sock.send_multipart([ident, *self._sessions[ident].pack(kind, hdr), *data],
                                      zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._log("dropped", -1, f"a {kind.decode()} reply: the consumer's queue is full")

    def _finish(self, tid: str, why: str) -> None:
        send = self._sends.pop(tid, None)
        if send is None:
            return
        self._outputs.pop(send.request_id, None)
        self._finished.append(send.request_id)
        self._log("released", send.request_id, why)


@dataclass
class Link:
    """The consumer's connection to one producer: its DEALER socket, the handshake until the
    producer's SESSION arrives, then the session; frames sent before that wait in ``queued``."""

    sock: zmq.Socket
    handshake: ClientHandshake
    session: Session | None = None
    queued: list[tuple[bytes, dict[str, Any]]] = field(default_factory=list)
    idle_since: float | None = None  # when the last request that needed it ended


@dataclass
class Recv:
    """A decode request whose prompt KV is on its way."""

    params: RemoteParams
    local_blocks: list[int]  # where the KV goes (the blocks the local prefix cache lacks)
    remote_blocks: list[int]  # where it comes from, one for one
    sent_at: float | None = None  # when the request asked for its KV (the timeout runs from here)
    started: float | None = None  # when the bytes started moving (transfer time runs from here)
    handle: Any = None  # the transport's handle of the transfer in flight

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.params.endpoint


class ConsumerBase(ConnectorBase):
    """The decode engine's side: requests added with the producer's ``kv_transfer_params`` get
    their prompt KV from it instead of prefilling. ``secret`` is the producers'
    (:attr:`ProducerBase.secret`)."""

    def __init__(self, *, secret: bytes, engine_id: str = "decode-0",
                 recv_timeout_s: float = 60.0, link_idle_s: float = 5.0) -> None:
        super().__init__(engine_id, secret)
        self.recv_timeout_s = float(recv_timeout_s)
        # A producer's socket is closed once no request has needed it for this long.
        self.link_idle_s = float(link_idle_s)
        self._remote: dict[int, RemoteParams] = {}  # do_remote_prefill, not allocated yet
        self._recvs: dict[int, Recv] = {}  # allocated, KV not written yet
        self._by_tid: dict[str, int] = {}  # transfer id -> request id, for the _recvs
        self._to_start: list[int] = []
        self._links: dict[tuple[str, int], Link] = {}

    # -- scheduler side (KVConnector) -----------------------------------------------------------
    def is_producer(self) -> bool:
        return False

    def get_num_new_matched_tokens(self, request: ConnectorRequest) -> RemoteMatch:
        # No side effect: get_next_batch_info() asks on a dry run (ATOM's MoRIIO tagged here).
        params = self._remote.get(request.request_id)
        if params is None:
            return RemoteMatch()
        t0 = params.first_token_id
        return RemoteMatch(num_tokens=request.num_prompt_tokens, load_async=True,
                           first_token=-1 if t0 is None else t0,
                           draft_tokens=params.draft_token_ids)

    def update_state_after_alloc(self, request: ConnectorRequest) -> None:
        rid = request.request_id
        params = self._remote.pop(rid, None)  # ATOM clears do_remote_prefill here
        if params is None:
            return  # a local prefill (or a re-admission after a preemption)
        bs = self._engine.cache.block_size
        need = cdiv(request.num_prompt_tokens, bs)
        have = request.num_cached_tokens // bs  # blocks the local prefix cache already holds
        remote = params.remote_block_ids
        n_remote = params.num_prompt_tokens or request.num_prompt_tokens
        if len(remote) != need or n_remote != request.num_prompt_tokens:
            self._release_remote(params)
            raise ValueError(f"the producer's KV covers {n_remote} tokens in {len(remote)} "
                             f"blocks, the prompt has {request.num_prompt_tokens}")
        if params.transfer_id in self._by_tid:
            self._release_remote(params)
            raise ValueError("another request is already receiving this transfer")
        self._recvs[rid] = Recv(params, list(request.block_ids)[have:need], remote[have:need])
        self._by_tid[params.transfer_id] = rid
        self._to_start.append(rid)
        self._log("alloc", rid, {"blocks": need, "cached": have})

    def request_finished(self, request: ConnectorRequest) -> bool:
        params = self._remote.pop(request.request_id, None)
        if params is not None:
            # Finished (aborted) before its blocks were allocated: nothing will be pulled, so
            # let the producer free its blocks now.
            self._release_remote(params)
        return False

    # -- engine side ----------------------------------------------------------------------------
    def add_request(self, request_id: int, prompt_token_ids: list[int],
                    kv_transfer_params: dict[str, Any]) -> None:
        params = parse_remote_params(kv_transfer_params, self._max_blocks())
        if params.endpoint not in self._links and len(self._links) >= MAX_PRODUCERS:
            self._close_idle_links(time.monotonic(), idle_s=0.0)
            if len(self._links) >= MAX_PRODUCERS:
                raise ValueError(f"kv_transfer_params: requests already wait on {MAX_PRODUCERS}"
                                 f" producers, {params.endpoint} would be one more")
        self._remote[int(request_id)] = params
        self._link(params.endpoint)  # open the session now: it is likely up by the first use

    def has_pending(self) -> bool:
        return bool(self._recvs)

    def poll(self, timeout_ms: int = 0) -> tuple[list[int], list[int], dict[int, str]]:
        """Start queued transfers, collect finished ones; returns
        ``([], finished_recving, failed)``."""
        recving: list[int] = []
        failed: dict[int, str] = {}
        for rid in self._to_start:
            rec = self._recvs.get(rid)
            if rec is None:
                continue
            if not rec.local_blocks:  # everything was in the local prefix cache
                self._end(rid)
                self._release_remote(rec.params)
                recving.append(rid)
                self._log("received", rid, {"blocks": 0, "bytes": 0})
                continue
            rec.sent_at = time.monotonic()
            self._begin(rid, rec, failed)
        self._to_start.clear()
        if timeout_ms and self._recvs:
            self._wait(timeout_ms)
        for endpoint, link in list(self._links.items()):
            for _ in range(MAX_FRAMES_PER_POLL):
                try:
                    frames = link.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._on_frames(endpoint, link, frames, recving, failed)
                except FrameError as e:
                    self._reject(str(e))
        self._poll_transport(recving, failed)
        now = time.monotonic()
        for rid, rec in list(self._recvs.items()):
            if (rid not in failed and rec.sent_at is not None
                    and now - rec.sent_at > self.recv_timeout_s and self._cancel(rec)):
                self._fail(rid, f"no KV from {rec.endpoint} in {self.recv_timeout_s:g} s",
                           failed)
                # The session may be dead (a producer restarted on its port knows none): the
                # next request opens a new one.
                self._drop_link(rec.endpoint)
        for rid, why in failed.items():
            self.transfer_stats["failed"] += 1
            self._log("failed", rid, why)
        self._close_idle_links(now, self.link_idle_s)
        return [], recving, failed

    def _on_frames(self, endpoint: tuple[str, int], link: Link, frames: list[Any],
                   recving: list[int], failed: dict[int, str]) -> None:
        """One message from a producer: its SESSION answer first, then replies in the
        session."""
        if link.session is None:
            link.session = link.handshake.accept(frames)
            self._log("session", -1, f"{endpoint[0]}:{endpoint[1]}")
            queued, link.queued = link.queued, []
            for kind, hdr in queued:
                self._send(endpoint, kind, hdr)
            return
        kind, hdr, data = link.session.unpack(frames, self._reply_kinds)
        self._on_reply(endpoint, kind, hdr, data, recving, failed)

    def _close_idle_links(self, now: float, idle_s: float) -> None:
        """Close the sockets no request has needed for ``idle_s`` (a DONE still queued for a
        producer that never answered is dropped with it: that producer frees the blocks after
        its release timeout)."""
        in_use = {p.endpoint for p in self._remote.values()}
        in_use.update(r.endpoint for r in self._recvs.values())
        for endpoint, link in list(self._links.items()):
            if endpoint in in_use:
                link.idle_since = None
            elif link.idle_since is None and idle_s > 0:
                link.idle_since = now
            elif link.idle_since is None or now - link.idle_since >= idle_s:
                self._drop_link(endpoint)

    def _drop_link(self, endpoint: tuple[str, int]) -> None:
        link = self._links.pop(endpoint, None)
        if link is not None:
            # A moment for a DONE just sent to leave; close() later drops it regardless.
            self._close_socket(link.sock, linger_ms=100)
            self._link_closed(endpoint)

    def _link_closed(self, endpoint: tuple[str, int]) -> None:
        """The transport forgets what it kept for that connection."""

    # -- for the transport ----------------------------------------------------------------------
    _reply_kinds: dict[bytes, int] = {}  # side-channel kinds a producer sends -> data frames
    _ack_on_side_channel = True  # DONE tells the producer it may free (unless the transport does)

    def _begin(self, rid: int, rec: Recv, failed: dict[int, str]) -> None:
        """Start moving ``rec``'s blocks (or fail it into ``failed``)."""
        raise NotImplementedError

    def _on_reply(self, endpoint: tuple[str, int], kind: bytes, hdr: dict[str, Any],
                  data: list[Any], recving: list[int], failed: dict[int, str]) -> None:
        raise FrameError(f"unexpected {kind!r}")

    def _poll_transport(self, recving: list[int], failed: dict[int, str]) -> None:
        """The transport's own progress, once per poll."""

    def _cancel(self, rec: Recv) -> bool:
        """Stop a timed-out transfer; False if it may still write into the request's blocks
        (then it keeps its blocks until the transport says it ended)."""
        return True

    def _wait(self, timeout_ms: int) -> None:
        """Wait for a reply when the engine is idle."""
        poller = zmq.Poller()
        for link in self._links.values():
            poller.register(link.sock, zmq.POLLIN)
        poller.poll(timeout_ms)

    def _received(self, rid: int, recving: list[int]) -> None:
        """``rid``'s KV is in place: tell the producer (it frees its blocks) and the scheduler."""
        rec = self._end(rid)
        seconds = time.monotonic() - (rec.started or rec.sent_at or time.monotonic())
        nbytes = len(rec.local_blocks) * self._block_bytes()
        self._count(len(rec.local_blocks), nbytes, seconds)
        self._log("received", rid, {"blocks": len(rec.local_blocks), "bytes": nbytes,
                                    "seconds": seconds})
        if self._ack_on_side_channel:
            self._send(rec.endpoint, DONE, {"transfer_id": rec.params.transfer_id})
        recving.append(rid)

    def _fail(self, rid: int, why: str, failed: dict[int, str]) -> None:
        """``rid``'s transfer failed: the request ends with ``why``; the producer may free."""
        rec = self._end(rid)
        failed[rid] = why
        self._release_remote(rec.params)

    def _recv_for(self, endpoint: tuple[str, int], hdr: dict[str, Any]) -> tuple[int, Recv]:
        """The request a reply is for: a transfer this side started, with that producer."""
        rid = self._by_tid.get(transfer_id(hdr.get("transfer_id")))
        if rid is None or self._recvs[rid].endpoint != endpoint:
            raise FrameError("a reply for no transfer started with that producer")
        return rid, self._recvs[rid]

    def _link(self, endpoint: tuple[str, int]) -> Link:
        """The connection to the producer at ``endpoint``; the first time, it connects and sends
        OPEN."""
        link = self._links.get(endpoint)
        if link is None:
            host, port = endpoint
            sock = self._new_socket(zmq.DEALER)
            # An unguessable identity (ZMQ's own are sequential): nobody can reconnect under it
            # to catch a reply meant for this connection.
            sock.setsockopt(zmq.ROUTING_ID, b"\x01" + secrets.token_bytes(15))
            # The largest reply this engine can need: a whole max_model_len request's blocks.
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_blocks() * self._block_bytes() + (1 << 20))
            sock.connect(f"tcp://{check_loopback_host(host)}:{port}")
            link = self._links[endpoint] = Link(sock, ClientHandshake(self._secret,
                                                                      f"{host}:{port}"))
            self._post(link, link.handshake.open_frames())
        return link

    def _send(self, endpoint: tuple[str, int], kind: bytes, hdr: dict[str, Any]) -> None:
        """Send ``kind`` to the producer at ``endpoint`` in its session (queued until the
        session is open)."""
        link = self._link(endpoint)
        if link.session is None:
            link.queued.append((kind, hdr))
        else:
            self._post(link, link.session.pack(kind, hdr))

    def _post(self, link: Link, frames: list[bytes]) -> None:
        try:
            link.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # the producer is not reading: its requests time out
            self._log("dropped", -1, f"a {frames[0].decode()} frame: the producer's queue is full")

    def _end(self, rid: int) -> Recv:
        rec = self._recvs.pop(rid)
        self._by_tid.pop(rec.params.transfer_id, None)
        return rec

    def _release_remote(self, params: RemoteParams) -> None:
        """Tell the producer it may free a transfer's blocks (nothing more will be read; if the
        DONE is lost, the producer frees them after its release timeout)."""
        self._send(params.endpoint, DONE, {"transfer_id": params.transfer_id})
