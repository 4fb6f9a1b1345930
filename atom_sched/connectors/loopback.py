"""Loopback KV connectors: prefill/decode disaggregation between two engines on one machine, with
no dependency beyond ZMQ (the NIXL connector is the fast path; this is the fallback).

:class:`LoopbackProducer` sits on the prefill engine, :class:`LoopbackConsumer` on the decode
engine. Each is an :class:`atom_sched.KVConnector` (the scheduler side, called by the C++
scheduler) and also the engine side that moves the KV (called by
:meth:`atom_sched.engine.LLMEngine.step` on the engine's thread: ``poll()``).

The KV moves over ZMQ on 127.0.0.1, pulled by the decode side as ATOM's MoRIIO and vLLM's NIXL
connectors read the remote blocks:

1. Prefill engine: a request added with ``kv_transfer_params={"do_remote_decode": True}`` (and
   ``max_tokens=1``) is prefilled and samples its first token T0. ``request_finished`` returns
   True (the scheduler keeps its blocks) and records ATOM's ``kv_transfer_params_output``:
   ``remote_block_ids``, ``remote_host``/``remote_port`` (the producer's ROUTER socket), a random
   ``transfer_id``, ``first_token_id``, ``draft_token_ids``, ... (the engine's
   ``Completion.kv_transfer_params``).
2. Decode engine: the same prompt added with those params (checked by
   :func:`~atom_sched.connectors.control.parse_remote_params`). ``get_num_new_matched_tokens``
   answers ``RemoteMatch(num_tokens=prompt_len, load_async=True, first_token=T0, ...)`` while
   the request has not been allocated (no side effect: a dry run may ask); once its blocks are
   allocated ``update_state_after_alloc`` records them (minus the blocks the local prefix cache
   already had) and clears the flag, as ATOM does.
3. Decode ``poll()``: sends ``PULL(transfer_id, remote block ids)`` to the producer.
4. Prefill ``poll()``: checks the pull (authenticated, the transfer's own blocks, each once, one
   pull per transfer, from one consumer) and replies with one frame
   ``[layers, 2, n, block_size, kv_heads, head_dim]``.
5. Decode ``poll()``: checks the reply (authenticated, the exact shape, dtype and size it
   expects), writes it into its own blocks, answers ``DONE`` and reports the request in
   ``finished_recving``; the scheduler then decodes it, starting from T0, and publishes the
   received prompt blocks in its prefix cache.
6. Prefill ``poll()``: on ``DONE`` from the consumer that pulled, it reports
   ``finished_sending``; only then does the scheduler free the request's blocks.

Every message is authenticated with the pair's shared ``secret`` (control.py); a frame that fails
any check is logged and dropped, and never raises out of ``poll()``. A failed transfer (unknown
transfer, layout mismatch, timeout) ends the decode request with a ``"kv transfer failed: ..."``
reason; the producer frees blocks nobody pulls after ``release_timeout_s``.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from .._core import ConnectorRequest, KVConnector, RemoteMatch
from .control import (
    FrameError,
    RemoteParams,
    Signer,
    check_loopback_host,
    id_list,
    logger,
    new_transfer_id,
    parse_remote_params,
    transfer_id,
)

__all__ = ["LoopbackConsumer", "LoopbackProducer", "check_loopback_host"]

# Message kinds (frame 0 after the ROUTER's identity frame), each followed by a msgpack header and
# its MAC; the number is how many data frames follow.
PULL = b"PULL"  # consumer -> producer: {transfer_id, block_ids}
DONE = b"DONE"  # consumer -> producer: {transfer_id} (received, or given up): free the blocks
KV = b"KV"  # producer -> consumer: {transfer_id, shape, dtype}, then the data frame
ERR = b"ERR"  # producer -> consumer: {transfer_id, error}
TO_PRODUCER = {PULL: 0, DONE: 0}
TO_CONSUMER = {KV: 1, ERR: 0}
LOG_ENTRIES = 10_000  # the event log is a ring: a flood of bad frames cannot grow memory


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _LoopbackBase(KVConnector):
    """Engine binding, the signer, the event log and transfer statistics of both sides."""

    def __init__(self, engine_id: str, secret: bytes) -> None:
        super().__init__()
        self.engine_id = engine_id
        self._signer = Signer(secret)
        self._engine: Any = None
        self._ctx = zmq.Context()
        self._closed = False
        # (monotonic time, event, request id or -1, detail): for tests, operators and debugging.
        self.log: deque[tuple[float, str, int, Any]] = deque(maxlen=LOG_ENTRIES)
        self.transfer_stats = {"transfers": 0, "blocks": 0, "bytes": 0, "seconds": 0.0,
                               "failed": 0, "rejected": 0}

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
        return int(np.prod(self._layout())) * self._dtype().itemsize

    def _log(self, event: str, rid: int, detail: Any = None) -> None:
        self.log.append((time.monotonic(), event, int(rid), detail))

    def _reject(self, why: str) -> None:
        """A frame that failed a check: counted, logged, dropped."""
        self.transfer_stats["rejected"] += 1
        self._log("rejected", -1, why)
        logger.warning("%s: rejected a frame: %s", self.engine_id, why)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._ctx.destroy(linger=0)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


@dataclass
class _Send:
    """A finished prefill whose blocks are held until the consumer has pulled them."""

    request_id: int
    blocks: list[int]
    since: float
    peer: bytes | None = None  # the ROUTER identity of the consumer that pulled
    served: bool = False


class LoopbackProducer(_LoopbackBase):
    """The prefill engine's connector: keeps finished requests' blocks until the decode engine
    has pulled them. Serves pulls on a ROUTER socket bound to ``host:port`` (port 0: a free
    port, see :attr:`port`). ``secret`` (16 bytes or more) is shared with the consumers; without
    one a random secret is made (:attr:`secret`, to hand to the consumer)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None = None,
                 engine_id: str = "prefill-0", release_timeout_s: float = 300.0) -> None:
        import secrets

        self.secret = secrets.token_bytes(32) if secret is None else secret
        super().__init__(engine_id, self.secret)
        self.host = check_loopback_host(host)
        self.release_timeout_s = float(release_timeout_s)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Only headers come in: a larger frame closes that peer's connection inside ZMQ.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 << 20)
        if port:
            self._sock.bind(f"tcp://{self.host}:{int(port)}")
            self.port = int(port)
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        self._marked: set[int] = set()  # do_remote_decode requests not finished
        self._sends: dict[str, _Send] = {}  # transfer id -> blocks held for the pull
        self._outputs: dict[int, dict[str, Any]] = {}  # kv_transfer_params_output, not taken
        self._finished: list[int] = []  # request ids to report as finished_sending

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
        self._sends[tid] = _Send(rid, blocks, time.monotonic())
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
        """The request ids whose blocks are held for a pull."""
        return sorted(s.request_id for s in self._sends.values())

    def release(self, transfer_id: str) -> None:
        """Give up a send (e.g. the request needs no decode): its blocks are freed at the next
        step."""
        self._finish(transfer_id, "released")

    def poll(self, timeout_ms: int = 0) -> tuple[list[int], list[int], dict[int, str]]:
        """Serve pulls and acknowledgements; returns ``(finished_sending, [], {})``."""
        if timeout_ms and self._sends:
            self._sock.poll(timeout_ms, zmq.POLLIN)
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                kind, hdr, _ = self._signer.unpack(frames[1:], TO_PRODUCER)
                if kind == PULL:
                    self._serve(frames[0], hdr)
                else:
                    self._on_done(frames[0], hdr)
            except FrameError as e:
                self._reject(str(e))
        now = time.monotonic()
        for tid, send in list(self._sends.items()):
            if now - send.since > self.release_timeout_s:
                self._finish(tid, "timed out")
        done, self._finished = self._finished, []
        return done, [], {}

    def _serve(self, ident: bytes, hdr: dict[str, Any]) -> None:
        tid = transfer_id(hdr.get("transfer_id"))
        send = self._sends.get(tid)
        error = None
        if send is None:
            error = "unknown transfer"
        elif send.served:
            error = "transfer already pulled"
        else:
            try:
                ids = id_list(hdr.get("block_ids"), "block_ids", len(send.blocks))
            except FrameError as e:
                ids, error = [], str(e)
            if error is None and not set(ids) <= set(send.blocks):
                error = "block_ids are not the transfer's"
        if error is not None:
            self._log("refused", -1 if send is None else send.request_id, error)
            self._send(ident, ERR, {"transfer_id": tid, "error": f"{error} at {self.engine_id}"})
            return
        assert send is not None
        t0 = time.perf_counter()
        data = self._engine.read_kv_blocks(ids).numpy()
        send.peer, send.served = ident, True
        reply = {"transfer_id": tid, "shape": list(data.shape), "dtype": str(data.dtype)}
        self._log("served", send.request_id, {"blocks": len(ids), "bytes": int(data.nbytes)})
        # copy=False: ZMQ sends straight from the array (it keeps a reference until sent).
        self._sock.send_multipart([ident, *self._signer.pack(KV, reply), memoryview(data)],
                                  copy=False)
        st = self.transfer_stats
        st["transfers"] += 1
        st["blocks"] += len(ids)
        st["bytes"] += data.nbytes
        st["seconds"] += time.perf_counter() - t0

    def _on_done(self, ident: bytes, hdr: dict[str, Any]) -> None:
        tid = transfer_id(hdr.get("transfer_id"))
        send = self._sends.get(tid)
        if send is None:
            raise FrameError("DONE for an unknown transfer")
        if send.peer is not None and send.peer != ident:
            raise FrameError("DONE from a peer that did not pull the transfer")
        self._finish(tid, "acked" if send.served else "released by the consumer")

    def _send(self, ident: bytes, kind: bytes, hdr: dict[str, Any]) -> None:
        self._sock.send_multipart([ident, *self._signer.pack(kind, hdr)])

    def _finish(self, tid: str, why: str) -> None:
        send = self._sends.pop(tid, None)
        if send is None:
            return
        self._outputs.pop(send.request_id, None)
        self._finished.append(send.request_id)
        self._log("released", send.request_id, why)


@dataclass
class _Recv:
    """A decode request whose prompt KV is on its way."""

    params: RemoteParams
    local_blocks: list[int]  # where the KV goes (the blocks the local prefix cache lacks)
    remote_blocks: list[int]  # where it comes from, one for one
    sent_at: float | None = None

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.params.endpoint


class LoopbackConsumer(_LoopbackBase):
    """The decode engine's connector: requests added with the producer's
    ``kv_transfer_params`` get their prompt KV from it instead of prefilling. ``secret`` is the
    producers' (:attr:`LoopbackProducer.secret`)."""

    def __init__(self, *, secret: bytes, engine_id: str = "decode-0",
                 recv_timeout_s: float = 60.0) -> None:
        super().__init__(engine_id, secret)
        self.recv_timeout_s = float(recv_timeout_s)
        self._remote: dict[int, RemoteParams] = {}  # do_remote_prefill, not allocated yet
        self._recvs: dict[int, _Recv] = {}  # allocated, KV not written yet
        self._by_tid: dict[str, int] = {}  # transfer id -> request id, for the _recvs
        self._to_pull: list[int] = []
        self._socks: dict[tuple[str, int], zmq.Socket] = {}

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
        need = _cdiv(request.num_prompt_tokens, bs)
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
        self._recvs[rid] = _Recv(params, list(request.block_ids)[have:need], remote[have:need])
        self._by_tid[params.transfer_id] = rid
        self._to_pull.append(rid)
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
        max_blocks = _cdiv(self._engine.sched_config.max_model_len, self._engine.cache.block_size)
        self._remote[int(request_id)] = parse_remote_params(kv_transfer_params, max_blocks)

    def has_pending(self) -> bool:
        return bool(self._recvs)

    def poll(self, timeout_ms: int = 0) -> tuple[list[int], list[int], dict[int, str]]:
        """Send queued pulls, write arrived KV; returns ``([], finished_recving, failed)``."""
        recving: list[int] = []
        failed: dict[int, str] = {}
        for rid in self._to_pull:
            self._pull(rid, recving)
        self._to_pull.clear()
        if timeout_ms and self._recvs:
            poller = zmq.Poller()
            for s in self._socks.values():
                poller.register(s, zmq.POLLIN)
            poller.poll(timeout_ms)
        for endpoint, sock in self._socks.items():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._on_reply(endpoint, sock, frames, recving, failed)
                except FrameError as e:
                    self._reject(str(e))
        now = time.monotonic()
        for rid, rec in list(self._recvs.items()):
            if rec.sent_at is not None and now - rec.sent_at > self.recv_timeout_s:
                self._end(rid)
                failed[rid] = f"no KV from {rec.endpoint} in {self.recv_timeout_s:g} s"
                self._release_remote(rec.params)
        for rid, why in failed.items():
            self.transfer_stats["failed"] += 1
            self._log("failed", rid, why)
        return [], recving, failed

    def _socket(self, endpoint: tuple[str, int]) -> zmq.Socket:
        sock = self._socks.get(endpoint)
        if sock is None:
            host, port = endpoint
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # The largest reply this engine can need: a whole max_model_len request's blocks.
            max_blocks = _cdiv(self._engine.sched_config.max_model_len,
                               self._engine.cache.block_size)
            sock.setsockopt(zmq.MAXMSGSIZE, max_blocks * self._block_bytes() + (1 << 20))
            sock.connect(f"tcp://{check_loopback_host(host)}:{port}")
            self._socks[endpoint] = sock
        return sock

    def _end(self, rid: int) -> _Recv:
        rec = self._recvs.pop(rid)
        self._by_tid.pop(rec.params.transfer_id, None)
        return rec

    def _pull(self, rid: int, recving: list[int]) -> None:
        rec = self._recvs.get(rid)
        if rec is None:
            return
        if not rec.local_blocks:  # everything was in the local prefix cache
            self._end(rid)
            self._release_remote(rec.params)
            recving.append(rid)
            self._log("received", rid, {"blocks": 0, "bytes": 0})
            return
        rec.sent_at = time.monotonic()
        hdr = {"transfer_id": rec.params.transfer_id, "block_ids": rec.remote_blocks}
        self._socket(rec.endpoint).send_multipart(self._signer.pack(PULL, hdr))
        self._log("pull", rid, {"blocks": len(rec.remote_blocks)})

    def _on_reply(self, endpoint: tuple[str, int], sock: zmq.Socket, frames: list[Any],
                  recving: list[int], failed: dict[int, str]) -> None:
        kind, hdr, data = self._signer.unpack(frames, TO_CONSUMER)
        tid = transfer_id(hdr.get("transfer_id"))
        rid = self._by_tid.get(tid)
        if rid is None or self._recvs[rid].endpoint != endpoint:
            raise FrameError("a reply for no transfer pulled from that producer")
        rec = self._end(rid)
        try:
            if kind == ERR:
                raise RuntimeError(str(hdr.get("error"))[:200])
            shape = self._check_kv(hdr, data[0], len(rec.local_blocks))
            arr = np.frombuffer(data[0].buffer, dtype=self._dtype()).reshape(shape)
            with warnings.catch_warnings():  # read-only buffer: it is only copied from
                warnings.simplefilter("ignore", UserWarning)
                kv = torch.from_numpy(arr)
            self._engine.write_kv_blocks(rec.local_blocks, kv)
            nbytes = arr.nbytes
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            failed[rid] = str(e)
            self._release_remote(rec.params)
            return
        seconds = time.monotonic() - (rec.sent_at or time.monotonic())
        st = self.transfer_stats
        st["transfers"] += 1
        st["blocks"] += len(rec.local_blocks)
        st["bytes"] += nbytes
        st["seconds"] += seconds
        self._log("received", rid, {"blocks": len(rec.local_blocks), "bytes": nbytes,
                                    "seconds": seconds})
        # Received: the producer may free its blocks; the scheduler may decode the request.
        sock.send_multipart(self._signer.pack(DONE, {"transfer_id": tid}))
        recving.append(rid)

    def _check_kv(self, hdr: dict[str, Any], frame: Any, n_blocks: int) -> list[int]:
        """The KV's shape if the header names exactly the layout, dtype and size this engine
        needs for ``n_blocks``; else RuntimeError (the request fails)."""
        layout = self._layout()
        want = [*layout[:2], n_blocks, *layout[2:]]
        dtype = str(self._dtype())
        if hdr.get("shape") != want or hdr.get("dtype") != dtype:
            raise RuntimeError(f"KV layout {str(hdr.get('shape'))[:80]} "
                               f"{str(hdr.get('dtype'))[:16]} from the producer, this engine "
                               f"needs {want} {dtype} (same model and block size on both sides)")
        nbytes = n_blocks * self._block_bytes()
        if len(frame) != nbytes:
            raise RuntimeError(f"{len(frame)} bytes of KV, the layout needs {nbytes}")
        return want

    def _release_remote(self, params: RemoteParams) -> None:
        """Tell the producer it may free a transfer's blocks (nothing more will be pulled)."""
        try:
            sock = self._socket(params.endpoint)
            sock.send_multipart(self._signer.pack(DONE, {"transfer_id": params.transfer_id}),
                                zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the producer frees it after its release timeout
