"""KV-cache events over ZMQ in vLLM's wire format, so KV-aware routers (NVIDIA Dynamo, llm-d's
indexer, the SGLang gateway) can index what this engine caches. The format is described in
shared/spec/kv-events-wire.md; in short:

* every message is three frames: ``[topic, seq (8 bytes, big-endian), msgpack(batch)]`` with
  ``seq`` counting batches from 0, so a subscriber sees gaps when batches are dropped;
* a batch is the array ``[ts (float64), events, data_parallel_rank]``; each event is a map with a
  ``"type"`` key (vLLM >= 0.24, SGLang) or, with ``encoding="array"``, a tagged positional array
  (older consumers);
* an optional ROUTER socket replays buffered batches from a requested ``seq`` onwards, ending
  with ``[b"", END_SEQ, b""]``.

Publishing never blocks the engine: ``publish`` encodes the step's events and hands them to a
background thread through a bounded queue; when the queue is full the oldest batch is dropped
(counted in ``stats()``; subscribers see the gap in the sequence numbers and can replay).
"""

from __future__ import annotations

import queue
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
    "encode_batch",
    "encode_event",
    "extra_keys",
    "offset_endpoint_port",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
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
    in the map layout, ``extra_keys``; their hashes differ from the same tokens' without them."""
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


@dataclass
class _Batch:
    seq: int
    payload: bytes


class KVEventPublisher:
    """Publishes one batch of KV events per engine step (see the module docstring).

    ``endpoint`` is bound (the default is loopback only); ``replay_endpoint``, if given, serves
    replays. Both are offset by ``data_parallel_rank``. Use as a context manager or call
    ``close()``.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        encoding: Encoding = "map",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
    ) -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"encoding must be 'map' or 'array', got {encoding!r}")
        if buffer_steps < 1 or max_queue_size < 1:
            raise ValueError("buffer_steps and max_queue_size must be >= 1")
        if data_parallel_rank < 0:
            raise ValueError("data_parallel_rank must be >= 0")
        self.topic = topic.encode()
        self.encoding: Encoding = encoding
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self.replay_endpoint = (
            offset_endpoint_port(replay_endpoint, data_parallel_rank) if replay_endpoint else None
        )
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.bind(self.endpoint)
        # With port "*" the system picks one: report the address actually bound.
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = None
        if self.replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self._router.bind(self.replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=max_queue_size)
        self._ring: deque[_Batch] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._next_seq = 0
        self._sent = 0
        self._dropped = 0
        self._encode_errors = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    # -- engine side -------------------------------------------------------------------------

    def publish(self, events: Iterable[EventLike], ts: float | None = None) -> int | None:
        """Queues one batch; returns its sequence number, or None if there were no events."""
        events = list(events)
        if not events:
            return None
        if self._closed:
            raise RuntimeError("publish() on a closed KVEventPublisher")
        try:
            payload = encode_batch(
                time.time() if ts is None else ts, events, self.data_parallel_rank, self.encoding
            )
        except (TypeError, ValueError, OverflowError):
            with self._lock:
                self._encode_errors += 1
            raise
        with self._lock:
            batch = _Batch(self._next_seq, payload)
            self._next_seq += 1
        self._put(batch)
        return batch.seq

    def publish_step(self, scheduler: Any) -> int | None:
        """Drains the scheduler's events of this step and publishes them as one batch."""
        return self.publish(scheduler.take_events())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "sent": self._sent,
                "dropped": self._dropped,
                "encode_errors": self._encode_errors,
                "next_seq": self._next_seq,
            }

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued (waiting up to ``timeout`` s), then closes the sockets."""
        if self._closed:
            return
        self._closed = True
        try:  # let the sender drain what is queued; drop the oldest only if it is stuck
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            self._put(None)
        self._thread.join(timeout)
        # The sender thread owns the sockets and closes them as it exits (ZMQ sockets must not be
        # used from two threads). A sender stuck past the timeout is a daemon: leave it be.
        if not self._thread.is_alive():
            self._ctx.term()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- background thread -------------------------------------------------------------------

    def _put(self, item: _Batch | None) -> None:
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                try:
                    dropped = self._queue.get_nowait()
                except queue.Empty:
                    continue
                if dropped is None:  # closing: the stop sentinel stays, this batch goes
                    self._queue.put_nowait(None)
                    dropped = item
                with self._lock:
                    self._dropped += 1
                if dropped is item:
                    return

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while True:
            if self._router is not None and poller.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if item is None:
                self._pub.close(linger=1000)
                if self._router is not None:
                    self._router.close(linger=0)
                return
            self._pub.send_multipart([self.topic, item.seq.to_bytes(8, "big"), item.payload])
            self._ring.append(item)
            with self._lock:
                self._sent += 1

    def _serve_replay(self) -> None:
        frames = self._router.recv_multipart()
        # A REQ client's request reaches the ROUTER as [identity, b"", start_seq].
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for batch in list(self._ring):
            if batch.seq >= start:
                self._router.send_multipart(
                    [identity, b"", self.topic, batch.seq.to_bytes(8, "big"), batch.payload]
                )
        self._router.send_multipart([identity, b"", b"", END_SEQ, b""])
