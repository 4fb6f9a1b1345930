"""KV-cache events over ZMQ in vLLM's wire format, so KV-aware routers (NVIDIA Dynamo, llm-d's
indexer, the SGLang gateway) can index what this engine caches. The format is described in
shared/spec/kv-events-wire.md; in short:

* every message is three frames: ``[topic, seq (8 bytes, big-endian), msgpack(batch)]`` with
  ``seq`` counting batches from 0, so a subscriber sees gaps when batches are dropped;
* a batch is the array ``[ts (float64), events, data_parallel_rank]``; each event is a map with a
  ``"type"`` key (vLLM >= 0.24, SGLang) or, with ``encoding="array"``, a tagged positional array
  (older consumers);
* an optional ROUTER socket replays buffered batches from a requested ``seq`` onwards to a
  DEALER client, ending with ``[b"", b"", END_SEQ, b""]`` (``KVEventPublisher._take_replays``).

Publishing never blocks the engine: ``publish`` encodes and numbers the step's events and puts
them in the replay ring; a background thread sends them. A batch it cannot send (it lags too far
behind, or a subscriber's high-water mark is full) is counted in ``stats()["dropped"]`` and stays
in the ring: subscribers see the gap in the sequence numbers and replay it. Replays are streamed
a few batches at a time after the live ones, so requests cannot starve live batches, and never
faster than the client reads, so they cannot make the publisher queue the ring again per request.
If the sender thread fails, the publisher logs it once and drops batches from then on (the
engine goes on): ``error``, ``stats()["failed"]``.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgpack
import zmq

__all__ = [
    "END_SEQ",
    "KVEventPublisher",
    "check_bind_endpoint",
    "check_dp_layout",
    "encode_batch",
    "encode_event",
    "extra_keys",
    "offset_endpoint_port",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
MAX_REPLAY_REQUEST = 256  # bytes per frame; a request is 8 (ZMQ drops a peer that sends more)
# The sender's work per round of its loop: live batches first, then at most this many replay
# requests read and replay batches sent (over all clients), so replays cannot starve live ones.
LIVE_BATCHES_PER_ROUND = 256
REPLAY_REQUESTS_PER_ROUND = 8
REPLAY_BATCHES_PER_ROUND = 32
# Replays streamed at once (one per client; a client's new request replaces its own): a request
# from another client beyond these gets the end marker with "busy" in its last frame.
MAX_REPLAY_STREAMS = 8
# Replay messages ZMQ may queue per client (ZMQ_SNDHWM): a client that does not read stalls its
# replay there instead of making the publisher queue the ring; one stalled this long is dropped.
REPLAY_SNDHWM = 32
REPLAY_STALL_S = 5.0
_log = logging.getLogger(__name__)
Encoding = Literal["map", "array"]


class EventLike(Protocol):
    kind: str
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None
    lora_name: str  # "" for none (an older event object may lack both)
    cache_salt: str


def extra_keys(event: EventLike) -> list[tuple[str, ...] | None] | None:
    """vLLM's per-block ``extra_keys`` of a BlockStored: the LoRA name on every block, the cache
    salt on a sequence's first block (this event's first when it has no parent); None when the
    blocks have no extra keys."""
    lora = getattr(event, "lora_name", "")
    salt = getattr(event, "cache_salt", "")
    if not lora and not salt:
        return None
    out: list[tuple[str, ...] | None] = []
    for i in range(len(event.block_hashes)):
        keys = ((lora,) if lora else ()) + (
            (salt,) if salt and i == 0 and event.parent_block_hash is None else ())
        out.append(keys or None)
    return out


def encode_event(event: EventLike, encoding: Encoding = "map") -> Any:
    """The msgpack-ready form of one event: vLLM's map layout or the legacy positional one.
    Blocks hashed under extra keys (SamplingParams.lora_name, cache_salt) carry ``lora_name`` and,
    in the map layout, ``extra_keys`` and ``cache_salt``; their hashes differ from the same
    tokens' without them. The positional layout carries no salt: multi-tenant routing needs the
    map layout."""
    kind = event.kind
    if kind == "BlockStored":
        fields = {
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": getattr(event, "lora_name", "") or None,
        }
        keys = extra_keys(event)
        if keys is not None and encoding == "map":
            fields["extra_keys"] = keys
            if getattr(event, "cache_salt", ""):
                # Dynamo's field: its indexer namespaces a salted sequence by it (it does not read
                # the salt from vLLM's extra_keys); other consumers ignore an unknown field.
                fields["cache_salt"] = event.cache_salt
    elif kind == "BlockRemoved":
        fields = {"block_hashes": list(event.block_hashes), "medium": event.medium}
    elif kind == "AllBlocksCleared":
        fields = {}
    else:
        raise ValueError(f"unknown KV event kind {kind!r}")
    if encoding == "map":
        return {"type": kind, **fields}
    if encoding == "array":
        return [kind, *fields.values()]
    raise ValueError(f"encoding must be 'map' or 'array', got {encoding!r}")


def encode_batch(
    ts: float,
    events: Iterable[EventLike],
    data_parallel_rank: int | None,
    encoding: Encoding = "map",
) -> bytes:
    """msgpack bytes of one batch: ``[ts, events, data_parallel_rank]`` (always an array)."""
    body = [float(ts), [encode_event(e, encoding) for e in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


def _encodable(event: EventLike, encoding: Encoding) -> bool:
    try:
        msgpack.packb(encode_event(event, encoding), use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def offset_endpoint_port(endpoint: str, data_parallel_rank: int) -> str:
    """vLLM's rule: a TCP port is offset by the DP rank; an inproc/ipc name gets ``_dp{rank}``."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{host}:{int(port) + data_parallel_rank}"
        if port == "*":
            return endpoint  # the system picks a free port per rank anyway
    raise ValueError(f"cannot offset endpoint {endpoint!r} by data parallel rank")


def check_bind_endpoint(endpoint: str, allow_remote: bool = False) -> str:
    """``endpoint`` if this publisher may bind it: ipc/inproc, or TCP on a loopback address
    unless ``allow_remote`` (a router on another machine needs it, and then anyone who can reach
    the port can read which prefixes this engine caches)."""
    if endpoint.startswith(("ipc://", "inproc://")) or allow_remote:
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"endpoint {endpoint!r}: tcp://, ipc:// or inproc://")
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # "*", an interface name or a host name
    if not loopback:
        raise ValueError(f"endpoint {endpoint!r} is not loopback-only: pass allow_remote=True to "
                         "publish to other machines")
    return endpoint


def _tcp_port(endpoint: str) -> tuple[str, int] | None:
    host, _, port = endpoint.rpartition(":")
    return (host, int(port)) if endpoint.startswith("tcp://") and port.isdigit() else None


def check_dp_layout(endpoint: str, replay_endpoint: str | None, data_parallel_size: int) -> None:
    """ValueError if offsetting both endpoints by the rank (vLLM's rule) makes one rank's PUB
    port another rank's replay port: the port ranges ``[P, P + size)`` and ``[R, R + size)``
    must not overlap (for example P=5557, R=5557+size)."""
    pub, rep = _tcp_port(endpoint), _tcp_port(replay_endpoint or "")
    if pub is None or rep is None or pub[0] != rep[0] or pub[1] == 0 or rep[1] == 0:
        return
    if abs(pub[1] - rep[1]) < data_parallel_size:
        raise ValueError(
            f"with {data_parallel_size} data-parallel ranks, PUB ports {pub[1]}.."
            f"{pub[1] + data_parallel_size - 1} and replay ports {rep[1]}.."
            f"{rep[1] + data_parallel_size - 1} overlap: put the replay port at least "
            f"{data_parallel_size} away (e.g. {pub[1] + data_parallel_size})")


@dataclass
class _Batch:
    seq: int
    payload: bytes


@dataclass
class _Replay:
    """One client's replay in progress: batches ``[cursor, end)``, then the end marker."""

    cursor: int
    end: int  # next_seq when the request came: the batches buffered then
    progress: float  # time.monotonic() of its last message sent


class KVEventPublisher:
    """Publishes one batch of KV events per engine step (see the module docstring).

    ``endpoint`` is bound (loopback only unless ``allow_remote``); ``replay_endpoint``, if given,
    serves replays. Both are offset by ``data_parallel_rank``; ``data_parallel_size`` (default:
    the rank + 1) lets the constructor refuse a port layout where ranks would collide. Use as a
    context manager or call ``close()``.

    Every numbered batch is kept in the replay ring (``buffer_steps`` batches) whether or not it
    could be sent: a batch is skipped on the PUB socket (counted in ``stats()["dropped"]``) when
    the sender thread lags more than ``max_queue_size`` batches behind, or when a subscriber's
    high-water mark (``hwm`` messages) is full; subscribers see the gap in the sequence numbers
    and replay it.

    If the sender thread fails (say ``ZMQError: Cannot allocate memory``), it closes its sockets,
    the failure is logged once and kept in ``error``, and ``stats()["failed"]`` is 1. The engine
    is not interrupted: from then on ``publish()`` and ``publish_step()`` drop each batch
    (``publish_step()`` still drains the scheduler), return None and count it in ``dropped`` and
    ``dropped_failed``, as are the batches that were waiting to be sent. Routers see no batch at
    all; an engine that must not run without them checks ``error``. ``close()`` returns within
    its timeout in every case.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        encoding: Encoding = "map",
        data_parallel_rank: int = 0,
        data_parallel_size: int | None = None,
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
        allow_remote: bool = False,
    ) -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"encoding must be 'map' or 'array', got {encoding!r}")
        if buffer_steps < 1 or max_queue_size < 1 or hwm < 1:
            raise ValueError("buffer_steps, max_queue_size and hwm must be >= 1")
        size = data_parallel_rank + 1 if data_parallel_size is None else data_parallel_size
        if not 0 <= data_parallel_rank < size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} outside [0, {size})")
        check_dp_layout(endpoint, replay_endpoint, size)
        self.topic = topic.encode()
        self.encoding: Encoding = encoding
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = check_bind_endpoint(offset_endpoint_port(endpoint, data_parallel_rank),
                                            allow_remote)
        self.replay_endpoint = (
            check_bind_endpoint(offset_endpoint_port(replay_endpoint, data_parallel_rank),
                                allow_remote) if replay_endpoint else None)
        self._max_lag = min(max_queue_size, buffer_steps)
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 1000)
            self._pub.set_hwm(hwm)
            # A full subscriber makes the send fail (all subscribers or none get a batch), so the
            # sender counts what it could not send instead of ZMQ dropping it silently.
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            self._pub.bind(self.endpoint)
            # With port "*" the system picks one: report the address actually bound.
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self._router = None
            if self.replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                # A full client makes a send fail (EAGAIN) rather than ZMQ drop it silently; the
                # sender retries that replay later.
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._router.setsockopt(zmq.SNDHWM, REPLAY_SNDHWM)
                self._router.setsockopt(zmq.RCVHWM, 4 * REPLAY_REQUESTS_PER_ROUND)
                self._router.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST)
                self._router.bind(self.replay_endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._ring: deque[_Batch] = deque(maxlen=buffer_steps)
        self._cond = threading.Condition()
        self._next_seq = 0  # the number of the next batch published
        self._next_send = 0  # the number of the next batch the sender thread sends
        self._stats = {"sent": 0, "dropped": 0, "dropped_lag": 0, "dropped_hwm": 0,
                       "dropped_failed": 0, "encode_errors": 0, "replays": 0, "replay_errors": 0,
                       "replays_refused": 0, "replays_abandoned": 0}
        self._closed = False
        self.error: str | None = None  # why the sender thread failed ("Type: message")
        self._close_deadline = 0.0  # time.monotonic() by which close() must return
        self._held: list[EventLike] = []  # a step's events whose publication failed as a whole
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    # -- engine side -------------------------------------------------------------------------

    def publish(self, events: Iterable[EventLike], ts: float | None = None) -> int | None:
        """Numbers and queues one batch; returns its sequence number, or None if there were no
        events or the sender thread has failed (the batch is dropped: see ``error``). Never
        blocks on the network."""
        events = list(events)
        if not events:
            return None
        if self._closed:
            raise RuntimeError("publish() on a closed KVEventPublisher")
        if self.error is not None:
            return self._drop_failed()
        try:
            payload = encode_batch(
                time.time() if ts is None else ts, events, self.data_parallel_rank, self.encoding
            )
        except (TypeError, ValueError, OverflowError):
            with self._cond:
                self._stats["encode_errors"] += 1
            raise
        return self._enqueue(payload)

    def _drop_failed(self) -> None:
        with self._cond:
            self._stats["dropped"] += 1
            self._stats["dropped_failed"] += 1
        return None

    def _enqueue(self, payload: bytes) -> int | None:
        with self._cond:
            if self.error is not None:  # the sender failed since publish() checked
                self._stats["dropped"] += 1
                self._stats["dropped_failed"] += 1
                return None
            seq = self._next_seq
            self._next_seq += 1
            self._ring.append(_Batch(seq, payload))
            self._cond.notify()
        return seq

    def publish_step(self, scheduler: Any) -> int | None:
        """Drains the scheduler's events of this step and publishes them as one batch.

        No event of the step is lost to another's failure. An event that cannot be encoded
        (not one the scheduler makes: its ``cache_salt``/``lora_name`` are checked at
        ``SamplingParams``) is left out and counted in ``stats()["encode_errors"]``; the others
        are published, then ValueError says how many were left out. Any other failure
        (MemoryError, ...) keeps the events: the next ``publish_step()`` publishes them first.
        """
        if self._closed:
            raise RuntimeError("publish_step() on a closed KVEventPublisher")
        events = self._held + list(scheduler.take_events())
        self._held = []
        if not events:
            return None
        if self.error is not None:
            return self._drop_failed()
        ts = time.time()
        try:
            payload = encode_batch(ts, events, self.data_parallel_rank, self.encoding)
        except (TypeError, ValueError, OverflowError) as exc:
            good = [e for e in events if _encodable(e, self.encoding)]
            if len(good) == len(events):  # the batch fails as a whole: not one event's fault
                self._held = events
                raise
            seq = (self._enqueue(encode_batch(ts, good, self.data_parallel_rank, self.encoding))
                   if good else None)
            with self._cond:
                self._stats["encode_errors"] += len(events) - len(good)
            raise ValueError(
                f"{len(events) - len(good)} of {len(events)} KV events of this step cannot be "
                f"encoded and were left out (the other {len(good)} were published as batch "
                f"{seq}): {exc}") from exc
        except BaseException:
            self._held = events
            raise
        return self._enqueue(payload)

    def stats(self) -> dict[str, int]:
        """``sent``; ``dropped``: not sent, that is ``dropped_lag`` + ``dropped_hwm`` (replayable
        while in the ring) + ``dropped_failed`` (lost to a failed sender thread; those published
        after the failure have no number, so then ``sent + dropped`` exceeds ``next_seq``);
        ``failed`` (1 once the sender thread failed: ``error`` says why); ``encode_errors``
        (``publish()`` calls whose events could not be encoded, and events ``publish_step()``
        left out); ``next_seq``; ``replays``; ``replay_errors`` (malformed replay requests);
        ``replays_refused`` (while ``MAX_REPLAY_STREAMS`` other clients were served) and
        ``replays_abandoned`` (the client left, or read nothing for ``REPLAY_STALL_S``)."""
        with self._cond:
            failed = int(self.error is not None)
            return {**self._stats, "next_seq": self._next_seq, "failed": failed}

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until every published batch was sent or dropped; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._next_send < self._next_seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.01))
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued and closes the sockets, returning within about ``timeout`` s
        whatever the state of the sender thread or the subscribers: what is not sent by then is
        not sent."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        with self._cond:
            self._close_deadline = deadline
            self._closed = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            # The sender thread owns the sockets (ZMQ sockets must not be used from two threads)
            # and closes them as it exits, which it does between two non-blocking sends: end the
            # context then, without waiting here.
            threading.Thread(target=self._ctx.term, name="kv-event-publisher-term",
                             daemon=True).start()
            return
        # The sender closed its sockets as it exited (the PUB one lingering at most until the
        # deadline); linger=0 closes any it could not.
        self._ctx.destroy(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- background thread -------------------------------------------------------------------

    def _next_batch(self) -> _Batch | None:
        """The next batch to send (under the lock), skipping what lags too far behind or has
        left the ring; None when everything published was sent."""
        ring = self._ring
        if self._next_send >= self._next_seq:
            return None
        first = max(self._next_seq - self._max_lag, ring[0].seq)
        if self._next_send < first:
            skipped = first - self._next_send
            self._stats["dropped"] += skipped
            self._stats["dropped_lag"] += skipped
            self._next_send = first
        return ring[self._next_send - ring[0].seq]

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # recorded, logged, reported by stats()
            self._fail(exc)
        finally:
            # Whatever happened, close the sockets: an open one makes Context.term() block.
            linger = 0
            if self.error is None:
                linger = int(max(0.0, self._close_deadline - time.monotonic()) * 1000)
            for sock, ms in ((self._pub, linger), (self._router, 0)):
                if sock is not None:
                    try:
                        sock.close(linger=ms)
                    except Exception:  # close() destroys the context anyway
                        _log.exception("closing a KV event socket")

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self.error = f"{type(exc).__name__}: {exc}"
            lost = self._next_seq - self._next_send
            self._stats["dropped"] += lost
            self._stats["dropped_failed"] += lost
            self._next_send = self._next_seq
            self._cond.notify_all()
        _log.error("KV event sender thread failed; KV events are dropped from now on: %s",
                   self.error, exc_info=exc)

    def _loop(self) -> None:
        replays: dict[bytes, _Replay] = {}
        while True:
            busy = self._send_live()
            with self._cond:
                if self._closed and self._next_send >= self._next_seq:
                    return
            if self._router is not None:
                busy = self._take_replays(replays) | busy
                busy = self._send_replays(replays) | busy
            if not busy:
                with self._cond:
                    if self._next_send >= self._next_seq and not self._closed:
                        # Replay requests do not wake this: they wait at most this long.
                        self._cond.wait(0.005 if replays else 0.01)

    def _send_live(self) -> bool:
        """Sends up to LIVE_BATCHES_PER_ROUND published batches; True if there were any."""
        for n in range(LIVE_BATCHES_PER_ROUND):
            with self._cond:
                batch = self._next_batch()
            if batch is None:
                return n > 0
            try:
                self._pub.send_multipart(
                    [self.topic, batch.seq.to_bytes(8, "big"), batch.payload], zmq.NOBLOCK)
                key = "sent"
            except zmq.Again:  # a subscriber's high-water mark is full
                key = "dropped_hwm"
            with self._cond:
                self._stats[key] += 1
                self._stats["dropped"] += key != "sent"
                self._next_send = batch.seq + 1
                self._cond.notify_all()
        return True

    def _send_replay_frames(self, frames: list[bytes]) -> bool | None:
        """True if sent; False if the client's queue is full (try later); None if the client is
        gone."""
        try:
            self._router.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return None
            raise
        return True

    def _take_replays(self, replays: dict[bytes, _Replay]) -> bool:
        """Reads up to REPLAY_REQUESTS_PER_ROUND replay requests. The exchange (a DEALER client; a
        REQ socket would read only the first reply): the client sends ``[b"", start_seq]`` (8
        bytes, big-endian); the reply is ``[b"", topic, seq, payload]`` for every batch buffered
        at the request from ``start_seq`` on, then the end marker ``[b"", b"", END_SEQ, b""]``.
        A malformed request, or one while MAX_REPLAY_STREAMS other clients are served, gets the
        end marker at once with the reason in its last frame."""
        n = 0
        while n < REPLAY_REQUESTS_PER_ROUND:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            identity = frames[0]
            error = None
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                error, key = (b"replay request must be [b'', start_seq (8 bytes big-endian)] "
                              b"from a DEALER socket"), "replay_errors"
            elif identity not in replays and len(replays) >= MAX_REPLAY_STREAMS:
                error, key = b"replay busy: ask again later", "replays_refused"
            else:
                key = "replays"
            with self._cond:
                self._stats[key] += 1
                end = self._next_seq
            if error is not None:
                self._send_replay_frames([identity, b"", b"", END_SEQ, error])
            else:  # a client's new request replaces its replay in progress
                replays.pop(identity, None)
                replays[identity] = _Replay(int.from_bytes(frames[2], "big"), end,
                                            time.monotonic())
        return n > 0

    def _send_replays(self, replays: dict[bytes, _Replay]) -> bool:
        """Sends up to REPLAY_BATCHES_PER_ROUND replay messages, taking the clients in turn."""
        budget = REPLAY_BATCHES_PER_ROUND
        now = time.monotonic()
        for identity in list(replays):
            if budget <= 0:
                break
            r = replays.pop(identity)  # put back at the end if it is not finished
            while budget > 0:
                with self._cond:
                    ring = self._ring
                    first = ring[0].seq if ring else self._next_seq
                    r.cursor = max(r.cursor, first)  # what left the ring is gone
                    batch = ring[r.cursor - first] if r.cursor < r.end else None
                frames = ([identity, b"", self.topic, batch.seq.to_bytes(8, "big"), batch.payload]
                          if batch is not None else [identity, b"", b"", END_SEQ, b""])
                sent = self._send_replay_frames(frames)
                if not sent:
                    break
                budget -= 1
                r.progress = now
                if batch is None:
                    break
                r.cursor += 1
            if sent is None or (sent is False and now - r.progress > REPLAY_STALL_S):
                with self._cond:
                    self._stats["replays_abandoned"] += 1
            elif not (sent and batch is None):  # not finished: its turn comes again
                replays[identity] = r
        return budget < REPLAY_BATCHES_PER_ROUND
