"""Loopback KV connectors: prefill/decode disaggregation between two engines on one machine, with
no dependency beyond ZMQ; the KV itself travels in ZMQ frames (nixl.py moves it with NIXL READs
instead, several times faster; this is the fallback).

:class:`LoopbackProducer` sits on the prefill engine, :class:`LoopbackConsumer` on the decode
engine. Each is an :class:`atom_sched.KVConnector` (the scheduler side, called by the C++
scheduler) and also the engine side that moves the KV (called by
:meth:`atom_sched.engine.LLMEngine.step` on the engine's thread: ``poll()``); base.py holds what
they share with the NIXL pair.

The decode side pulls, as ATOM's MoRIIO and vLLM's NIXL connectors read the remote blocks:

1. Prefill engine: a request added with ``kv_transfer_params={"do_remote_decode": True}`` (and
   ``max_tokens=1``) is prefilled and samples its first token T0. ``request_finished`` returns
   True (the scheduler keeps its blocks) and records ATOM's ``kv_transfer_params_output``:
   ``remote_block_ids``, ``remote_host``/``remote_port`` (the producer's side channel), a random
   ``transfer_id``, ``first_token_id``, ``draft_token_ids``, ... (the engine's
   ``Completion.kv_transfer_params``).
2. Decode engine: the same prompt added with those params (checked by
   :func:`~atom_sched.connectors.control.parse_remote_params`). ``get_num_new_matched_tokens``
   answers ``RemoteMatch(num_tokens=prompt_len, load_async=True, first_token=T0, ...)`` while
   the request has not been allocated; once its blocks are allocated ``update_state_after_alloc``
   records them (minus the blocks the local prefix cache already had).
3. Decode ``poll()``: sends ``PULL(transfer_id, remote block ids)`` to the producer.
4. Prefill ``poll()``: checks the pull (the transfer's own blocks, each once, one pull per
   transfer) and replies with one frame ``[layers, 2, n, block_size, kv_heads, head_dim]``.
5. Decode ``poll()``: checks the reply (the exact shape, dtype and size it expects), writes it
   into its own blocks, answers ``DONE`` and reports the request in ``finished_recving``; the
   scheduler then decodes it, starting from T0, and publishes the received prompt blocks.
6. Prefill ``poll()``: on ``DONE`` from the consumer that pulled, it reports
   ``finished_sending``; only then does the scheduler free the request's blocks.

Every message travels in a session keyed from the pair's shared ``secret`` and fresh nonces
(``OPEN`` -> ``SESSION`` first, control.py), so a frame caught by a listener is useless to
replay. A failed transfer (unknown transfer, layout mismatch, timeout) ends the decode request
with a ``"kv transfer failed: ..."`` reason; the producer frees blocks nobody pulls after
``release_timeout_s``.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import torch

from .base import ConsumerBase, ProducerBase, Recv
from .control import FrameError, check_loopback_host, id_list, transfer_id

__all__ = ["LoopbackConsumer", "LoopbackProducer", "check_loopback_host"]

PULL = b"PULL"  # consumer -> producer: {transfer_id, block_ids}
KV = b"KV"  # producer -> consumer: {transfer_id, shape, dtype}, then the data frame
ERR = b"ERR"  # producer -> consumer: {transfer_id, error}


class LoopbackProducer(ProducerBase):
    """The prefill engine's connector: serves pulls of finished requests' KV on its side channel
    (see :class:`~atom_sched.connectors.base.ProducerBase` for the arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handlers[PULL] = self._serve

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
        self._log("served", send.request_id, {"blocks": len(ids), "bytes": int(data.nbytes)})
        # copy=False: ZMQ sends straight from the array (it keeps a reference until sent).
        self._send(ident, KV, {"transfer_id": tid, "shape": list(data.shape),
                               "dtype": str(data.dtype)}, memoryview(data))
        self._count(len(ids), int(data.nbytes), time.perf_counter() - t0)


class LoopbackConsumer(ConsumerBase):
    """The decode engine's connector: pulls each remote prefill's KV from its producer in one
    frame (see :class:`~atom_sched.connectors.base.ConsumerBase` for the arguments)."""

    _reply_kinds = {KV: 1, ERR: 0}

    def _begin(self, rid: int, rec: Recv, failed: dict[int, str]) -> None:
        hdr = {"transfer_id": rec.params.transfer_id, "block_ids": rec.remote_blocks}
        self._send(rec.endpoint, PULL, hdr)
        self._log("pull", rid, {"blocks": len(rec.remote_blocks)})

    def _on_reply(self, endpoint: tuple[str, int], kind: bytes, hdr: dict[str, Any],
                  data: list[Any], recving: list[int], failed: dict[int, str]) -> None:
        rid, rec = self._recv_for(endpoint, hdr)
        try:
            if kind == ERR:
                raise RuntimeError(str(hdr.get("error"))[:200])
            shape = self._check_kv(hdr, data[0], len(rec.local_blocks))
            arr = np.frombuffer(data[0].buffer, dtype=self._dtype()).reshape(shape)
            with warnings.catch_warnings():  # read-only buffer: it is only copied from
                warnings.simplefilter("ignore", UserWarning)
                self._engine.write_kv_blocks(rec.local_blocks, torch.from_numpy(arr))
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            self._fail(rid, str(e), failed)
            return
        self._received(rid, recving)

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
