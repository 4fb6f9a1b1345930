"""The connectors' control channel: authenticated, bounded frames and the checks of every field a
peer or a proxy hands a connector.

Anything on 127.0.0.1 can connect to a connector's socket, so nothing a frame says is trusted
until it has passed here:

* a frame is ``[kind, header, tag]`` (plus data frames after it): ``header`` is a msgpack map of
  at most :data:`MAX_HEADER_BYTES`, ``tag`` authenticates the kind and the header; a frame that
  fails any check raises :class:`FrameError`, which the connector counts and drops (it never
  leaves ``poll()``);
* a MAC under the pair's secret alone proves only that *someone* with the secret once sent the
  frame: a stranger who catches one (the decode engine connects wherever its
  ``kv_transfer_params`` point) could replay it to the producer. So the secret signs just the
  handshake, and every other frame travels in a :class:`Session`: the consumer sends ``OPEN``
  (the endpoint it means to reach and a fresh nonce), the producer answers ``SESSION`` (that
  nonce and a fresh one of its own), and both derive a key from the secret, the endpoint and the
  two nonces. A frame's tag is then a sequence number and an HMAC under that key over the
  direction, the number, the kind and the header: a frame from another session, a replay within
  one (numbers only grow), a reflection (the direction) or an ``OPEN`` meant for another
  endpoint (a listener relaying to the producer) fails;
* transfer ids are 128-bit random hex strings, never request ids, so they cannot be guessed;
* :func:`parse_remote_params` checks the ``kv_transfer_params`` a decode engine is given (they
  come from the proxy, which copies them from the prefill engine's output).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "FrameError",
    "MAX_HEADER_BYTES",
    "OPEN",
    "RemoteParams",
    "SESSION",
    "Session",
    "Signer",
    "check_loopback_host",
    "check_secret",
    "new_transfer_id",
    "parse_remote_params",
]

logger = logging.getLogger("atom_sched.connectors")

MAX_HEADER_BYTES = 1 << 20  # a PULL of 100k block ids fits; anything larger is refused
MAC_BYTES = 32
SEQ_BYTES = 8
NONCE_BYTES = 16
OPEN = b"OPEN"  # consumer -> producer, under the secret: {to: "host:port", nonce}
SESSION = b"SESSION"  # producer -> consumer, under the secret: {nonce (the consumer's), reply}
_TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
MAX_TOKEN_ID = 2**31 - 1
MAX_DRAFTS = 64


class FrameError(ValueError):
    """A frame (or a field in it) that is malformed, oversized or not authenticated."""


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


def check_secret(secret: Any) -> bytes:
    """The pair's shared secret: bytes, at least 16 of them."""
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise ValueError("the connector secret must be at least 16 bytes "
                         "(for example secrets.token_bytes(32)), the same on both engines")
    return bytes(secret)


def new_transfer_id() -> str:
    return secrets.token_hex(16)


def transfer_id(value: Any) -> str:
    """``value`` if it has the form of a transfer id, else FrameError."""
    if not isinstance(value, str) or not _TRANSFER_ID.fullmatch(value):
        raise FrameError("a transfer id is 32 lowercase hex digits")
    return value


def int_field(hdr: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = hdr.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise FrameError(f"{key} must be an integer in [{lo}, {hi}]")
    return value


def id_list(value: Any, what: str, max_len: int, upper: int | None = None) -> list[int]:
    """A non-empty list of distinct non-negative ints (below ``upper`` when given)."""
    if not isinstance(value, (list, tuple)) or not 0 < len(value) <= max_len:
        raise FrameError(f"{what} must be a list of 1 to {max_len} ids")
    if any(type(v) is not int or v < 0 or (upper is not None and v >= upper) for v in value):
        raise FrameError(f"{what} must hold non-negative integers"
                         + ("" if upper is None else f" below {upper}"))
    if len(set(value)) != len(value):
        raise FrameError(f"{what} names an id twice")
    return list(value)


class Signer:
    """Packs and checks ``[kind, header, mac]`` frames under one shared secret (the handshake's
    frames; everything else travels in a :class:`Session`)."""

    def __init__(self, secret: bytes) -> None:
        self._key = check_secret(secret)

    def _mac(self, kind: bytes, header: bytes) -> bytes:
        return hmac.new(self._key, kind + b"\0" + header, hashlib.sha256).digest()

    def pack(self, kind: bytes, header: dict[str, Any]) -> list[bytes]:
        return self.sign(kind, msgpack.packb(header))

    def sign(self, kind: bytes, body: bytes) -> list[bytes]:
        """The frames of an already encoded header."""
        return [kind, body, self._tag(kind, body)]

    def _tag(self, kind: bytes, body: bytes) -> bytes:
        return self._mac(kind, body)

    def _check_tag(self, kind: bytes, body: bytes, tag: bytes) -> None:
        if len(tag) != MAC_BYTES or not hmac.compare_digest(tag, self._mac(kind, body)):
            raise FrameError("not authenticated (wrong or missing MAC: another secret?)")

    def unpack(self, frames: Sequence[Any], kinds: dict[bytes, int]) -> tuple[bytes, dict, list]:
        """``(kind, header, data frames)`` of a frame whose kind is a key of ``kinds`` (the value:
        how many data frames that kind carries), else FrameError. ``frames`` are bytes or
        ``zmq.Frame`` s; the data frames are returned as they came."""
        if len(frames) < 3:
            raise FrameError(f"{len(frames)} frames, a message has at least 3")
        kind, body, mac = (_bytes(f) for f in frames[:3])
        if kind not in kinds:
            raise FrameError(f"unknown message kind {kind[:16]!r}")
        if len(frames) != 3 + kinds[kind]:
            raise FrameError(f"{kind.decode()} has {len(frames)} frames, not {3 + kinds[kind]}")
        if len(body) > MAX_HEADER_BYTES:
            raise FrameError(f"a {len(body)}-byte header (at most {MAX_HEADER_BYTES})")
        self._check_tag(kind, body, mac)
        try:
            header = msgpack.unpackb(body, strict_map_key=True, raw=False)
        except Exception as e:  # noqa: BLE001 - any decoding failure is a malformed frame
            raise FrameError(f"undecodable header ({type(e).__name__})") from None
        if not isinstance(header, dict):
            raise FrameError("the header is not a map")
        return kind, header, list(frames[3:])


def _bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else frame.bytes


class Session(Signer):
    """One side of an authenticated session between a consumer and the producer at
    ``endpoint`` (``"host:port"``). The key is the secret's HMAC of the endpoint and both nonces,
    so it is fresh for every session and useless anywhere else; a tag is an 8-byte sequence
    number and the HMAC of the direction, the number, the kind and the header under that key. A
    side accepts only numbers above the last it accepted: a replay (or a frame reordered behind
    a later one, which ZMQ never does on one connection) is refused."""

    def __init__(self, secret: bytes, endpoint: str, client_nonce: bytes, server_nonce: bytes,
                 *, producer: bool) -> None:
        key = hmac.new(check_secret(secret), b"atom_sched session v1\0" + endpoint.encode()
                       + b"\0" + client_nonce + server_nonce, hashlib.sha256).digest()
        super().__init__(key)
        self._out, self._in = (b"P", b"C") if producer else (b"C", b"P")
        self._sent = 0
        self._seen = 0

    @property
    def used(self) -> bool:
        """Whether a frame has come in this session (its peer has the key)."""
        return self._seen > 0

    def _seq_mac(self, direction: bytes, seq: bytes, kind: bytes, body: bytes) -> bytes:
        return hmac.new(self._key, direction + seq + kind + b"\0" + body, hashlib.sha256).digest()

    def _tag(self, kind: bytes, body: bytes) -> bytes:
        self._sent += 1
        seq = self._sent.to_bytes(SEQ_BYTES, "big")
        return seq + self._seq_mac(self._out, seq, kind, body)

    def _check_tag(self, kind: bytes, body: bytes, tag: bytes) -> None:
        if len(tag) != SEQ_BYTES + MAC_BYTES:
            raise FrameError("not authenticated (no session tag: open a session first)")
        seq = tag[:SEQ_BYTES]
        if int.from_bytes(seq, "big") <= self._seen:
            raise FrameError("a replayed frame (its sequence number was seen)")
        if not hmac.compare_digest(tag[SEQ_BYTES:], self._seq_mac(self._in, seq, kind, body)):
            raise FrameError("not authenticated in this session (a frame from another session?)")
        self._seen = int.from_bytes(seq, "big")


def nonce_field(hdr: dict[str, Any], key: str) -> bytes:
    value = hdr.get(key)
    if not isinstance(value, bytes) or len(value) != NONCE_BYTES:
        raise FrameError(f"{key} must be {NONCE_BYTES} bytes")
    return value


class ClientHandshake:
    """The consumer's side of opening a session with the producer at ``endpoint``:
    :meth:`open_frames` to send, then :meth:`accept` the producer's ``SESSION`` reply."""

    def __init__(self, secret: bytes, endpoint: str) -> None:
        self._secret = check_secret(secret)
        self._signer = Signer(secret)
        self.endpoint = endpoint
        self._nonce = secrets.token_bytes(NONCE_BYTES)

    def open_frames(self) -> list[bytes]:
        return self._signer.pack(OPEN, {"to": self.endpoint, "nonce": self._nonce})

    def accept(self, frames: Sequence[Any]) -> Session:
        """The session a ``SESSION`` reply opens (FrameError if it does not answer this
        handshake: a replay of another one, or not signed with the secret)."""
        _, hdr, _ = self._signer.unpack(frames, {SESSION: 0})
        if not hmac.compare_digest(nonce_field(hdr, "nonce"), self._nonce):
            raise FrameError("SESSION answers another handshake")
        return Session(self._secret, self.endpoint, self._nonce, nonce_field(hdr, "reply"),
                       producer=False)


def server_open(secret: bytes, endpoint: str, frames: Sequence[Any]) -> tuple[Session, list]:
    """The producer's side of a handshake: ``(the session, the SESSION frames to send back)``
    for an ``OPEN`` signed with the secret and naming ``endpoint``; else FrameError. A replayed
    OPEN gets a new session whose key its sender cannot derive without the secret."""
    signer = Signer(secret)
    _, hdr, _ = signer.unpack(frames, {OPEN: 0})
    if hdr.get("to") != endpoint:
        raise FrameError(f"OPEN for another endpoint ({str(hdr.get('to'))[:64]!r}): relayed?")
    client_nonce = nonce_field(hdr, "nonce")
    reply = secrets.token_bytes(NONCE_BYTES)
    session = Session(secret, endpoint, client_nonce, reply, producer=True)
    return session, signer.pack(SESSION, {"nonce": client_nonce, "reply": reply})


@dataclass(frozen=True)
class RemoteParams:
    """A decode request's checked ``kv_transfer_params``: where its prompt KV is."""

    remote_block_ids: list[int]
    host: str
    port: int
    transfer_id: str
    first_token_id: int | None
    draft_token_ids: list[int]
    num_prompt_tokens: int | None

    @property
    def endpoint(self) -> tuple[str, int]:
        return (self.host, self.port)


def parse_remote_params(p: Any, max_blocks: int) -> RemoteParams:
    """Check a decode engine's ``kv_transfer_params`` (ValueError naming the field)."""
    if not isinstance(p, dict):
        raise ValueError("kv_transfer_params must be a dict")
    if not p.get("do_remote_prefill"):
        raise ValueError("the decode engine's kv_transfer_params need do_remote_prefill=True "
                         "(pass the prefill engine's kv_transfer_params output)")
    missing = [k for k in ("remote_block_ids", "remote_host", "remote_port", "transfer_id")
               if k not in p]
    if missing:
        raise ValueError(f"kv_transfer_params lack {missing}")
    host = p["remote_host"]
    if not isinstance(host, str):
        raise ValueError("remote_host must be a string")
    host = check_loopback_host(host)
    try:
        blocks = id_list(p["remote_block_ids"], "remote_block_ids", max_blocks)
        port = int_field(p, "remote_port", 1, 65535)
        tid = transfer_id(p["transfer_id"])
        first = None if p.get("first_token_id") is None else int_field(
            p, "first_token_id", 0, MAX_TOKEN_ID)
        drafts = p.get("draft_token_ids") or []
        if not isinstance(drafts, (list, tuple)) or len(drafts) > MAX_DRAFTS or any(
                type(t) is not int or not 0 <= t <= MAX_TOKEN_ID for t in drafts):
            raise FrameError(f"draft_token_ids must be at most {MAX_DRAFTS} token ids")
        n_prompt = None if p.get("num_prompt_tokens") is None else int_field(
            p, "num_prompt_tokens", 1, 1 << 40)
    except FrameError as e:
        raise ValueError(f"kv_transfer_params: {e}") from None
    return RemoteParams(blocks, host, port, tid, first, list(drafts), n_prompt)
