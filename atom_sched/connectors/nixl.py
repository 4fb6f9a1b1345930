"""NIXL KV connectors: prefill/decode disaggregation where the decode engine reads the prefill
engine's KV blocks with NVIDIA NIXL one-sided READs, as vLLM's NixlConnector, SGLang and Dynamo
move KV.

Install: ``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1`` (with ``--no-deps`` about 300 MB;
it runs without a GPU, over UCX). The design is vLLM's:

* one NIXL agent per engine (a unique name), the KV cache registered once: each layer's K and V
  tensor is a region of ``num_blocks`` blocks;
* the decode side asks the producer for its agent metadata over the authenticated side channel
  (``HELLO`` -> ``META``: metadata, region base addresses, block count and size), once per
  producer, checks that the layouts match, loads the metadata and prepares one descriptor list
  per side (every block of every region), once; HELLO names a transfer the producer holds, and
  both travel in a session (control.py), so neither a replayed HELLO nor a listener relaying
  the decode side's frames gets the metadata;
* per request it READs the remote blocks into its own (``make_prepped_xfer`` + ``transfer``)
  with the transfer id as the notification, and polls ``check_xfer_state`` once per engine step:
  done -> ``finished_recving``; an error or a dead producer fails the request with its reason;
* the prefill side turns notifications (``get_new_notifs``) from agents that said HELLO into
  ``finished_sending``; ``DONE`` on the side channel releases a transfer nobody will read, and
  ``release_timeout_s`` frees blocks nobody reads.

UCX settings (measured on a 2-core CPU machine, docs/distributed.md): ``UCX_NET_DEVICES=lo`` is
set before NIXL loads (UCX otherwise listens on every interface), error handling mode "none" (the
shared-memory transports need it; a dead peer is still detected), no progress thread (NIXL's
spins a core). On a CPU the READ is a ``process_vm_readv`` copy that completes inside
``transfer()``.

What an authenticated peer can do: a consumer that knows the secret and a live transfer id gets
the producer's agent metadata, and NIXL READs are one-sided, so it could read any block of the
producer's KV cache. The secret is the trust boundary (as in vLLM, where any peer with the
metadata can); nothing without it gets the metadata (a frame it caught is bound to another
session, or to another endpoint), and every frame and notification is checked before NIXL sees
it.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from .base import ConsumerBase, ProducerBase, Recv
from .control import FrameError, RemoteParams, logger, transfer_id

__all__ = ["NixlConsumer", "NixlProducer", "nixl_available"]

HELLO = b"HELLO"  # consumer -> producer: {agent_name, transfer_id}: asks for the metadata
META = b"META"  # producer -> consumer: {agent_name, metadata, layout}
MAX_METADATA = 1 << 20  # bytes (about 3 KB for a 30-layer model)
MAX_PEERS = 1024  # agent names a producer remembers
_AGENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def nixl_available() -> bool:
    """Whether NIXL is installed (``pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1``)."""
    import importlib.util

    return importlib.util.find_spec("nixl") is not None


def _nixl_api() -> Any:
    # Before UCX loads: listen on loopback only, and quiet UCX's own warnings.
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from nixl import _api

    return _api


def block_descs(bases: list[int], num_blocks: int, block_len: int) -> np.ndarray:
    """NIXL descriptors ``(addr, len, device)`` of every block of every region: descriptor
    ``r * num_blocks + b`` is block ``b`` of region ``r``."""
    addr = (np.asarray(bases, np.uint64)[:, None]
            + np.arange(num_blocks, dtype=np.uint64)[None, :] * np.uint64(block_len)).ravel()
    return np.stack([addr, np.full_like(addr, block_len), np.zeros_like(addr)], axis=1)


def desc_ids(blocks: list[int], regions: int, num_blocks: int) -> np.ndarray:
    """The descriptor indices of ``blocks`` in every region (region-major)."""
    return (np.arange(regions, dtype=np.int64)[:, None] * num_blocks
            + np.asarray(blocks, dtype=np.int64)[None, :]).ravel()


class _Agent:
    """One NIXL agent over an engine's KV cache: every layer's K and V tensor registered once."""

    def __init__(self, engine_id: str, engine: Any) -> None:
        api = _nixl_api()
        self.name = f"{engine_id}-{secrets.token_hex(6)}"
        cfg = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                    backends=[])
        self.agent = api.nixl_agent(self.name, cfg)
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        cache = engine.cache
        tensors = [t for k, v in zip(cache.k, cache.v, strict=True) for t in (k, v)]
        if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
            raise ValueError("the NIXL connector needs contiguous CPU KV tensors")
        self.regions = len(tensors)
        self.num_blocks = int(cache.num_blocks)
        self.block_len = tensors[0].nbytes // self.num_blocks
        self.dtype = str(tensors[0].dtype).removeprefix("torch.")
        self.bases = [int(t.data_ptr()) for t in tensors]
        self.reg = self.agent.get_reg_descs([(b, t.nbytes, 0, "") for b, t in
                                             zip(self.bases, tensors, strict=True)], "DRAM")
        self.agent.register_memory(self.reg, backends=["UCX"])
        self._tensors = tensors  # the registered memory must outlive the registration

    def layout(self) -> dict[str, Any]:
        return {"regions": self.regions, "num_blocks": self.num_blocks,
                "block_len": self.block_len, "dtype": self.dtype, "bases": self.bases}

    def close(self) -> None:
        reg, self.reg = self.reg, None
        if reg is not None:
            try:
                self.agent.deregister_memory(reg, backends=["UCX"])
            except Exception:  # noqa: BLE001 - closing: nothing left to protect
                pass


class NixlProducer(ProducerBase):
    """The prefill engine's connector: hands its NIXL agent metadata to consumers that know the
    secret and frees each finished request's blocks when the consumer's READ notification comes
    (see :class:`~atom_sched.connectors.base.ProducerBase` for the arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handlers[HELLO] = self._hello
        self._agent: _Agent | None = None
        self._peers: set[str] = set()  # agent names that said HELLO with the secret
        self._notifs: list[tuple[str, bytes]] = []

    def bind(self, engine: Any) -> None:
        super().bind(engine)
        self._agent = _Agent(self.engine_id, engine)
        self._closers.append(self._agent.close)

    def _hello(self, ident: bytes, hdr: dict[str, Any]) -> None:
        name = hdr.get("agent_name")
        if not isinstance(name, str) or not _AGENT_NAME.fullmatch(name):
            raise FrameError("agent_name must be 1-128 letters, digits, '.', '_' or '-'")
        if self._agent is None:
            raise FrameError("HELLO before the connector is bound to an engine")
        if transfer_id(hdr.get("transfer_id")) not in self._sends:
            raise FrameError("HELLO for no transfer held here")
        if name not in self._peers and len(self._peers) >= MAX_PEERS:
            raise FrameError(f"more than {MAX_PEERS} consumers")
        self._peers.add(name)
        self._log("hello", -1, name)
        self._send(ident, META, {"agent_name": self._agent.name,
                                 "metadata": self._agent.agent.get_agent_metadata(),
                                 "layout": self._agent.layout()})

    def _collect_notifs(self) -> None:
        if self._agent is None:
            return
        try:
            notifs = self._agent.agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001 - never out of poll(): a peer's fault is logged
            logger.warning("%s: NIXL notifications: %s", self.engine_id, e)
            return
        for name, msgs in notifs.items():
            self._notifs += [(str(name), bytes(m)) for m in msgs]

    def _wait(self, timeout_ms: int) -> None:
        # Notifications have no file descriptor to wait on: look for them every millisecond.
        for _ in range(max(1, timeout_ms)):
            self._collect_notifs()
            if self._notifs or self._sock.poll(1, zmq.POLLIN):
                return

    def _poll_transport(self) -> None:
        self._collect_notifs()
        notifs, self._notifs = self._notifs, []
        for name, msg in notifs:
            try:
                if name not in self._peers:
                    raise FrameError("a notification from an agent that never said HELLO")
                tid = transfer_id(msg.decode("ascii", errors="replace")[:64])
                send = self._sends.get(tid)
                if send is None:
                    raise FrameError("a notification for an unknown transfer")
            except FrameError as e:
                self._reject(str(e))
                continue
            send.served = True
            self._log("served", send.request_id, {"blocks": len(send.blocks), "agent": name})
            self._finish(tid, "acked")



@dataclass
class _Peer:
    """A producer, as the consumer knows it: before META, the requests waiting for it."""

    waiting: list[int] = field(default_factory=list)
    name: str | None = None  # its agent name, once loaded
    handle: Any = None  # its prepared descriptor list
    num_blocks: int = 0


class NixlConsumer(ConsumerBase):
    """The decode engine's connector: READs each remote prefill's blocks from the producer's KV
    cache with NIXL (see :class:`~atom_sched.connectors.base.ConsumerBase` for the arguments)."""

    _reply_kinds = {META: 0}
    _ack_on_side_channel = False  # the READ's notification tells the producer

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._agent: _Agent | None = None
        self._local: Any = None  # the prepared descriptor list of this engine's blocks
        self._peers: dict[tuple[str, int], _Peer] = {}

    def bind(self, engine: Any) -> None:
        super().bind(engine)
        a = self._agent = _Agent(self.engine_id, engine)
        self._closers.append(a.close)
        self._local = a.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", block_descs(a.bases, a.num_blocks, a.block_len), "DRAM")

    def add_request(self, request_id: int, prompt_token_ids: list[int],
                    kv_transfer_params: dict[str, Any]) -> None:
        super().add_request(request_id, prompt_token_ids, kv_transfer_params)
        # Say HELLO now: the metadata is likely here by the time the request has its blocks.
        self._peer(self._remote[int(request_id)])

    def _peer(self, params: RemoteParams) -> _Peer:
        """The producer of ``params``'s transfer; the first time, HELLO (naming that transfer)
        is sent to it."""
        peer = self._peers.get(params.endpoint)
        if peer is None:
            peer = self._peers[params.endpoint] = _Peer()
            assert self._agent is not None
            self._send(params.endpoint, HELLO, {"agent_name": self._agent.name,
                                                "transfer_id": params.transfer_id})
        return peer

    def _link_closed(self, endpoint: tuple[str, int]) -> None:
        # A producer that never answered HELLO is asked again on the next connection; one whose
        # agent is loaded stays (READs do not need the side channel).
        peer = self._peers.get(endpoint)
        if peer is not None and peer.name is None:
            del self._peers[endpoint]

    def _begin(self, rid: int, rec: Recv, failed: dict[int, str]) -> None:
        peer = self._peer(rec.params)
        if peer.name is None:
            peer.waiting.append(rid)
        else:
            self._read(rid, rec, peer, failed)

    def _on_reply(self, endpoint: tuple[str, int], kind: bytes, hdr: dict[str, Any],
                  data: list[Any], recving: list[int], failed: dict[int, str]) -> None:
        peer = self._peers.get(endpoint)
        if peer is None or peer.name is not None:
            raise FrameError("META nobody asked for")
        try:
            self._load_peer(peer, hdr)
        except Exception as e:  # noqa: BLE001 - that producer's requests fail, nothing else
            if isinstance(e, FrameError):
                self._reject(str(e))
            del self._peers[endpoint]
            for rid in peer.waiting:
                if rid in self._recvs:
                    self._fail(rid, f"NIXL handshake with {endpoint}: {str(e)[:160]}", failed)
            return
        for rid in peer.waiting:
            if rid in self._recvs:
                self._read(rid, self._recvs[rid], peer, failed)
        peer.waiting.clear()

    def _load_peer(self, peer: _Peer, hdr: dict[str, Any]) -> None:
        """Check the producer's META against this engine's layout and load its agent."""
        a = self._agent
        assert a is not None
        name, md, lay = hdr.get("agent_name"), hdr.get("metadata"), hdr.get("layout")
        if not isinstance(name, str) or not _AGENT_NAME.fullmatch(name):
            raise FrameError("META: bad agent_name")
        if not isinstance(md, bytes) or not 0 < len(md) <= MAX_METADATA:
            raise FrameError("META: metadata must be 1 byte to 1 MiB")
        if not isinstance(lay, dict):
            raise FrameError("META: no layout")
        mine = a.layout()
        if [lay.get(k) for k in ("regions", "block_len", "dtype")] != [
                mine[k] for k in ("regions", "block_len", "dtype")]:
            raise RuntimeError(f"the producer's KV layout (regions {lay.get('regions')}, block "
                               f"{lay.get('block_len')} bytes, {str(lay.get('dtype'))[:16]}) is "
                               f"not this engine's ({mine['regions']}, {mine['block_len']}, "
                               f"{mine['dtype']}): same model and block size on both sides")
        nb, bases = lay.get("num_blocks"), lay.get("bases")
        if type(nb) is not int or not 0 < nb < 2**31:
            raise FrameError("META: num_blocks out of range")
        if (not isinstance(bases, list) or len(bases) != a.regions
                or any(type(b) is not int or not 0 < b < 2**64 for b in bases)):
            raise FrameError("META: bases must be one address per region")
        loaded = a.agent.add_remote_agent(md)
        peer.name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        peer.handle = a.agent.prep_xfer_dlist(peer.name, block_descs(bases, nb, a.block_len),
                                              "DRAM")
        peer.num_blocks = nb
        self._log("peer", -1, {"agent": peer.name, "num_blocks": nb})

    def _read(self, rid: int, rec: Recv, peer: _Peer, failed: dict[int, str]) -> None:
        a = self._agent
        assert a is not None
        if max(rec.remote_blocks) >= peer.num_blocks:
            self._fail(rid, f"remote block ids beyond the producer's {peer.num_blocks} blocks",
                       failed)
            return
        rec.started = time.monotonic()
        try:
            rec.handle = a.agent.make_prepped_xfer(
                "READ", self._local, desc_ids(rec.local_blocks, a.regions, a.num_blocks),
                peer.handle, desc_ids(rec.remote_blocks, a.regions, peer.num_blocks),
                notif_msg=rec.params.transfer_id.encode())
            # Logged as it is posted: the producer may serve it (and log that) before transfer()
            # returns here.
            self._log("read", rid, {"blocks": len(rec.remote_blocks)})
            a.agent.transfer(rec.handle)
        except Exception as e:  # noqa: BLE001 - a dead or misbehaving producer
            self._read_failed(rid, rec, f"NIXL READ from {rec.endpoint}: {str(e)[:160]}", failed)

    def _poll_transport(self, recving: list[int], failed: dict[int, str]) -> None:
        a = self._agent
        for rid, rec in list(self._recvs.items()):
            if rec.handle is None or rid in failed:
                continue
            try:
                state = a.agent.check_xfer_state(rec.handle)
            except Exception as e:  # noqa: BLE001 - nixlRemoteDisconnectError and the like
                self._read_failed(rid, rec, f"NIXL READ from {rec.endpoint}: {str(e)[:160]}",
                                  failed)
                continue
            if state == "DONE":
                self._release_handle(rec)
                self._received(rid, recving)
            elif state != "PROC":
                self._read_failed(rid, rec, f"NIXL READ from {rec.endpoint} ended in {state}",
                                  failed)

    def _read_failed(self, rid: int, rec: Recv, why: str, failed: dict[int, str]) -> None:
        """Fail the request; forget the producer (it may be dead: a later request
        re-handshakes)."""
        self._release_handle(rec)
        peer = self._peers.pop(rec.endpoint, None)
        if peer is not None and peer.name is not None and self._agent is not None:
            try:
                self._agent.agent.remove_remote_agent(peer.name)
            except Exception:  # noqa: BLE001 - already gone
                pass
        logger.warning("%s: %s", self.engine_id, why)
        self._fail(rid, why, failed)
        self._drop_link(rec.endpoint)  # and its session: a restarted producer knows none

    def _release_handle(self, rec: Recv) -> bool:
        """Release a transfer handle exactly once (NIXL crashes on a released one)."""
        handle, rec.handle = rec.handle, None
        if handle is None or self._agent is None:
            return True
        try:
            self._agent.agent.release_xfer_handle(handle)
            return True
        except Exception:  # noqa: BLE001 - still in flight: NIXL could not cancel it
            rec.handle = handle
            return False

    def _cancel(self, rec: Recv) -> bool:
        return self._release_handle(rec)
