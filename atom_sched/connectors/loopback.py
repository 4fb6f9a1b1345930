"""Loopback KV connectors: prefill/decode disaggregation between two engines on one machine.

:class:`LoopbackProducer` sits on the prefill engine, :class:`LoopbackConsumer` on the decode
engine. Each is an :class:`atom_sched.KVConnector` (the scheduler side, called by the C++
scheduler) and also the engine side that moves the KV (called by
:meth:`atom_sched.engine.LLMEngine.step` on the engine's thread: ``poll()``).

The KV moves over ZMQ on 127.0.0.1, pulled by the decode side as ATOM's MoRIIO and vLLM's NIXL
connectors read the remote blocks:

1. Prefill engine: a request added with ``kv_transfer_params={"do_remote_decode": True}`` (and
   ``max_tokens=1``) is prefilled and samples its first token T0. ``request_finished`` returns
   True (the scheduler keeps its blocks) and records ATOM's ``kv_transfer_params_output``:
   ``remote_block_ids``, ``remote_host``/``remote_port`` (the producer's ROUTER socket),
   ``transfer_id``, ``first_token_id``, ``draft_token_ids``, ... (the engine's
   ``Completion.kv_transfer_params``).
2. Decode engine: the same prompt added with those params. ``get_num_new_matched_tokens`` answers
   ``RemoteMatch(num_tokens=prompt_len, load_async=True, first_token=T0, draft_tokens=...)`` while
   the request has not been allocated (no side effect: a dry run may ask); once its blocks are
   allocated ``update_state_after_alloc`` records them (minus the blocks the local prefix cache
   already had) and clears the flag, as ATOM does.
3. Decode ``poll()``: sends ``PULL(transfer_id, remote block ids)`` to the producer.
4. Prefill ``poll()``: reads those blocks (every layer, K and V) out of its paged cache and replies
   with one frame ``[layers, 2, n, block_size, kv_heads, head_dim]``.
5. Decode ``poll()``: writes the frame into its own blocks, answers ``DONE`` and reports the
   request in ``finished_recving``; the scheduler then decodes it, starting from T0, and
   publishes the received prompt blocks in its prefix cache.
6. Prefill ``poll()``: on ``DONE`` it reports ``finished_sending``; only then does the scheduler
   free the request's blocks.

A failure (unknown transfer, layout mismatch, timeout) ends the decode request with a
``"kv transfer failed: ..."`` reason; the producer always gets a ``DONE`` or ``RELEASE`` so it
frees its blocks (and frees them anyway after ``release_timeout_s``).
"""

from __future__ import annotations

import ipaddress
import time
import warnings
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from .._core import ConnectorRequest, KVConnector, RemoteMatch

__all__ = ["LoopbackConsumer", "LoopbackProducer", "check_loopback_host"]

# Message kinds (frame 0 after the ROUTER's identity frame); frame 1 is a msgpack header.
PULL = b"PULL"  # consumer -> producer: {transfer_id, request_id, block_ids}
KV = b"KV"  # producer -> consumer: {transfer_id, request_id, shape, dtype}, then the data frame
ERR = b"ERR"  # producer -> consumer: {transfer_id, request_id, error}
DONE = b"DONE"  # consumer -> producer: {transfer_id} (received, or given up): free the blocks


def check_loopback_host(host: str) -> str:
    """``host`` if it is a loopback address (the only kind these connectors use), else
    ValueError."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"loopback connectors bind and connect to loopback only, not {host!r}")
    return host


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _LoopbackBase(KVConnector):
    """Engine binding, the event log and transfer statistics shared by both sides."""

    def __init__(self, engine_id: str) -> None:
        super().__init__()
        self.engine_id = engine_id
        self._engine: Any = None
        self._ctx = zmq.Context()
        self._closed = False
        # (monotonic time, event, request/transfer id, detail): for tests and debugging.
        self.log: list[tuple[float, str, int, Any]] = []
        self.transfer_stats = {"transfers": 0, "blocks": 0, "bytes": 0, "seconds": 0.0,
                               "failed": 0}

    # -- engine side ----------------------------------------------------------------------------
    def bind(self, engine: Any) -> None:
        """Called by ``LLMEngine.set_kv_connector``: the engine whose KV cache this moves."""
        self._engine = engine

    def _layout(self) -> tuple[int, ...]:
        """``(layers, 2, block_size, kv_heads, head_dim)`` of the bound engine's cache."""
        cache = self._engine.cache
        return (len(cache.k), 2, *cache.block_shape)

    def _log(self, event: str, rid: int, detail: Any = None) -> None:
        self.log.append((time.monotonic(), event, int(rid), detail))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._ctx.destroy(linger=0)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


class LoopbackProducer(_LoopbackBase):
    """The prefill engine's connector: keeps finished requests' blocks until the decode engine
    has pulled them. Serves pulls on a ROUTER socket bound to ``host:port`` (port 0: a free
    port, see :attr:`port`)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, engine_id: str = "prefill-0",
                 release_timeout_s: float = 300.0) -> None:
        super().__init__(engine_id)
        self.host = check_loopback_host(host)
        self.release_timeout_s = float(release_timeout_s)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{self.host}:{int(port)}")
            self.port = int(port)
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        self._marked: dict[int, dict[str, Any]] = {}  # do_remote_decode requests not finished
        self._sends: dict[int, dict[str, Any]] = {}  # transfer id -> blocks held for the pull
        self._outputs: dict[int, dict[str, Any]] = {}  # kv_transfer_params_output, not taken
        self._finished: list[int] = []  # sends to report as finished_sending

    # -- scheduler side (KVConnector) -----------------------------------------------------------
    def is_producer(self) -> bool:
        return True

    def get_num_new_matched_tokens(self, request: ConnectorRequest) -> RemoteMatch:
        return RemoteMatch()  # the prefill engine computes every prompt itself

    def update_state_after_alloc(self, request: ConnectorRequest) -> None:
        pass

    def request_finished(self, request: ConnectorRequest) -> bool:
        rid = request.request_id
        params = self._marked.pop(rid, None)
        if params is None:
            return False  # an ordinary request, served here
        tokens = request.token_ids
        prompt_len = request.num_prompt_tokens
        blocks = list(request.block_ids)
        if len(tokens) <= prompt_len or not blocks:
            self._log("not_sent", rid, "finished before its prefill completed")
            return False
        self._sends[rid] = {"blocks": blocks, "since": time.monotonic(), "served": 0}
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
            "transfer_id": rid,
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
        self._marked[int(request_id)] = kv_transfer_params

    def take_kv_transfer_params_output(self, request_id: int) -> dict[str, Any] | None:
        """ATOM's ``kv_transfer_params_output`` of a finished request (once)."""
        return self._outputs.pop(int(request_id), None)

    def has_pending(self) -> bool:
        return bool(self._sends or self._finished)

    @property
    def pending_sends(self) -> list[int]:
        return sorted(self._sends)

    def release(self, transfer_id: int) -> None:
        """Give up a send (e.g. the request needs no decode): its blocks are freed at the next
        step."""
        self._finish(int(transfer_id), "released")

    def poll(self, timeout_ms: int = 0) -> tuple[list[int], list[int], dict[int, str]]:
        """Serve pulls and acknowledgements; returns ``(finished_sending, [], {})``."""
        if timeout_ms and self._sends:
            self._sock.poll(timeout_ms, zmq.POLLIN)
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) < 3:
                continue
            ident, kind, hdr = frames[0], frames[1], msgpack.unpackb(frames[2])
            if kind == PULL:
                self._serve(ident, hdr)
            elif kind == DONE:
                self._finish(int(hdr["transfer_id"]), "acked")
        now = time.monotonic()
        for tid, send in list(self._sends.items()):
            if now - send["since"] > self.release_timeout_s:
                self._finish(tid, "timed out")
        done, self._finished = self._finished, []
        return done, [], {}

    def _serve(self, ident: bytes, hdr: dict[str, Any]) -> None:
        tid = int(hdr["transfer_id"])
        send = self._sends.get(tid)
        ids = [int(b) for b in hdr["block_ids"]]
        error = None
        if send is None:
            error = f"unknown transfer {tid} at {self.engine_id}"
        elif not set(ids) <= set(send["blocks"]):
            error = f"transfer {tid}: blocks {ids} are not the request's"
        if error is not None:
            self._log("refused", tid, error)
            reply = {"transfer_id": tid, "request_id": hdr.get("request_id"), "error": error}
            self._sock.send_multipart([ident, ERR, msgpack.packb(reply)])
            return
        t0 = time.perf_counter()
        data = self._engine.read_kv_blocks(ids).numpy()
        reply = {"transfer_id": tid, "request_id": hdr.get("request_id"),
                 "shape": list(data.shape), "dtype": str(data.dtype)}
        self._log("served", tid, {"blocks": len(ids), "bytes": int(data.nbytes)})
        # copy=False: ZMQ sends straight from the tensor (it keeps a reference until sent).
        self._sock.send_multipart([ident, KV, msgpack.packb(reply), memoryview(data)],
                                  copy=False)
        send["served"] += 1
        st = self.transfer_stats
        st["transfers"] += 1
        st["blocks"] += len(ids)
        st["bytes"] += data.nbytes
        st["seconds"] += time.perf_counter() - t0

    def _finish(self, tid: int, why: str) -> None:
        if self._sends.pop(tid, None) is None:
            return
        self._outputs.pop(tid, None)
        self._finished.append(tid)
        self._log("released", tid, why)


@dataclass
class _Recv:
    """A decode request whose prompt KV is on its way."""

    params: dict[str, Any]
    local_blocks: list[int]  # where the KV goes (the blocks the local prefix cache lacks)
    remote_blocks: list[int]  # where it comes from, one for one
    sent_at: float | None = None
    endpoint: tuple[str, int] = ("127.0.0.1", 0)


class LoopbackConsumer(_LoopbackBase):
    """The decode engine's connector: requests added with the producer's
    ``kv_transfer_params`` get their prompt KV from it instead of prefilling."""

    def __init__(self, *, engine_id: str = "decode-0", recv_timeout_s: float = 60.0) -> None:
        super().__init__(engine_id)
        self.recv_timeout_s = float(recv_timeout_s)
        self._remote: dict[int, dict[str, Any]] = {}  # do_remote_prefill, not allocated yet
        self._recvs: dict[int, _Recv] = {}  # allocated, KV not written yet
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
        t0 = params.get("first_token_id")
        return RemoteMatch(num_tokens=request.num_prompt_tokens, load_async=True,
                           first_token=-1 if t0 is None else int(t0),
                           draft_tokens=[int(t) for t in params.get("draft_token_ids") or ()])

    def update_state_after_alloc(self, request: ConnectorRequest) -> None:
        rid = request.request_id
        params = self._remote.pop(rid, None)  # ATOM clears do_remote_prefill here
        if params is None:
            return  # a local prefill (or a re-admission after a preemption)
        bs = self._engine.cache.block_size
        need = _cdiv(request.num_prompt_tokens, bs)
        have = request.num_cached_tokens // bs  # blocks the local prefix cache already holds
        remote = [int(b) for b in params["remote_block_ids"]]
        n_remote = params.get("num_prompt_tokens", request.num_prompt_tokens)
        if len(remote) < need or n_remote != request.num_prompt_tokens:
            self._release_remote(params)
            raise ValueError(f"the producer's KV covers {n_remote} tokens in {len(remote)} "
                             f"blocks, the prompt has {request.num_prompt_tokens}")
        local = list(request.block_ids)
        rec = _Recv(params, local[have:need], remote[have:need],
                    endpoint=(params["remote_host"], int(params["remote_port"])))
        self._recvs[rid] = rec
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
        p = kv_transfer_params
        if not p.get("do_remote_prefill"):
            raise ValueError("the decode engine's kv_transfer_params need do_remote_prefill=True "
                             "(pass the prefill engine's kv_transfer_params output)")
        missing = [k for k in ("remote_block_ids", "remote_host", "remote_port", "transfer_id")
                   if k not in p]
        if missing:
            raise ValueError(f"kv_transfer_params lack {missing}")
        check_loopback_host(str(p["remote_host"]))
        self._remote[int(request_id)] = p

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
        for sock in self._socks.values():
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_reply(sock, frames, recving, failed)
        now = time.monotonic()
        for rid, rec in list(self._recvs.items()):
            if rec.sent_at is not None and now - rec.sent_at > self.recv_timeout_s:
                del self._recvs[rid]
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
            sock.connect(f"tcp://{check_loopback_host(host)}:{port}")
            self._socks[endpoint] = sock
        return sock

    def _pull(self, rid: int, recving: list[int]) -> None:
        rec = self._recvs.get(rid)
        if rec is None:
            return
        tid = int(rec.params["transfer_id"])
        if not rec.local_blocks:  # everything was in the local prefix cache
            del self._recvs[rid]
            self._release_remote(rec.params)
            recving.append(rid)
            self._log("received", rid, {"blocks": 0, "bytes": 0})
            return
        rec.sent_at = time.monotonic()
        hdr = {"transfer_id": tid, "request_id": rid, "block_ids": rec.remote_blocks}
        self._socket(rec.endpoint).send_multipart([PULL, msgpack.packb(hdr)])
        self._log("pull", rid, {"blocks": len(rec.remote_blocks)})

    def _on_reply(self, sock: zmq.Socket, frames: list[Any], recving: list[int],
                  failed: dict[int, str]) -> None:
        if len(frames) < 2:
            return
        kind = frames[0].bytes
        hdr = msgpack.unpackb(frames[1].bytes)
        rid = hdr.get("request_id")
        rec = self._recvs.get(rid) if rid is not None else None
        tid = int(hdr.get("transfer_id", -1))
        if rec is None or int(rec.params["transfer_id"]) != tid:
            return  # a late reply for a request that already failed
        del self._recvs[rid]
        try:
            if kind == ERR:
                raise RuntimeError(str(hdr.get("error")))
            if kind != KV or len(frames) < 3:
                raise RuntimeError(f"unexpected reply {kind!r}")
            want = [*self._layout()[:2], len(rec.local_blocks), *self._layout()[2:]]
            if list(hdr["shape"]) != want:
                raise RuntimeError(f"KV layout {hdr['shape']} from the producer, this engine "
                                   f"needs {want} (same model and block size on both sides)")
            arr = np.frombuffer(frames[2].buffer, dtype=np.dtype(hdr["dtype"])).reshape(want)
            with warnings.catch_warnings():  # read-only buffer: it is only copied from
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(arr)
            self._engine.write_kv_blocks(rec.local_blocks, data)
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            failed[rid] = str(e)
            self._release_remote(rec.params)
            return
        seconds = time.monotonic() - (rec.sent_at or time.monotonic())
        st = self.transfer_stats
        st["transfers"] += 1
        st["blocks"] += len(rec.local_blocks)
        st["bytes"] += arr.nbytes
        st["seconds"] += seconds
        self._log("received", rid, {"blocks": len(rec.local_blocks), "bytes": int(arr.nbytes),
                                    "seconds": seconds})
        # Received: the producer may free its blocks; the scheduler may decode the request.
        sock.send_multipart([DONE, msgpack.packb({"transfer_id": tid})])
        recving.append(rid)

    def _release_remote(self, params: dict[str, Any]) -> None:
        """Tell the producer it may free a transfer's blocks (nothing more will be pulled)."""
        try:
            sock = self._socket((str(params["remote_host"]), int(params["remote_port"])))
            sock.send_multipart([DONE, msgpack.packb({"transfer_id": int(params["transfer_id"])})],
                                zmq.NOBLOCK)
        except (zmq.ZMQError, KeyError, ValueError):
            pass  # the producer frees it after its release timeout
