"""Local processes on a connector's side channel, for the attack tests: a peer (DEALER) on a
producer's port that may open a session when it has the secret, a fake producer (ROUTER) where
a decode engine's ``kv_transfer_params`` point, and a relay that forwards whatever a decode
engine sends it to the real producer (a listener on a port named in hostile params)."""

from __future__ import annotations

import time
from typing import Any

import zmq

from atom_sched.connectors.control import OPEN, ClientHandshake, Session, server_open


class Peer:
    """A local process's DEALER socket on the producer's port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.session: Session | None = None
        self.sent: list[list[bytes]] = []  # every message sent, to replay

    def send_raw(self, frames: list[bytes]) -> None:
        self.sent.append(list(frames))
        self.sock.send_multipart(frames)

    def open(self, engine: Any, secret: bytes, timeout_s: float = 5.0) -> Session:
        """Open a session with the secret (the producer answers in its engine's steps)."""
        hs = ClientHandshake(secret, f"127.0.0.1:{self.port}")
        self.send_raw(hs.open_frames())
        deadline = time.monotonic() + timeout_s
        while not self.sock.poll(10):
            engine.step()
            assert time.monotonic() < deadline, "no SESSION came"
        self.session = hs.accept(self.sock.recv_multipart())
        return self.session

    def send(self, kind: bytes, hdr: dict[str, Any]) -> None:
        assert self.session is not None
        self.send_raw(self.session.pack(kind, hdr))

    def replies(self, engine: Any, timeout_s: float = 0.3) -> list[list[bytes]]:
        """Step the engine until ``timeout_s`` passes; every reply the peer got meanwhile."""
        got = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            engine.step()
            while self.sock.poll(10):
                got.append(self.sock.recv_multipart())
        return got

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class FakeProducer:
    """A ROUTER socket where a decode engine's kv_transfer_params point: it answers OPEN as a
    producer with ``secret`` would, and hands the test each message of the session."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.sessions: dict[bytes, Session] = {}

    def next_message(self, engine: Any, kinds: dict[bytes, int], steps: int = 400
                     ) -> tuple[bytes, bytes, dict, list[bytes]]:
        """Step ``engine`` until a message of ``kinds`` comes in a session: ``(identity, kind,
        header, frames)``."""
        for _ in range(steps):
            engine.step()
            while self.sock.poll(5):
                ident, *msg = self.sock.recv_multipart()
                if msg[0] == OPEN:
                    session, reply = server_open(self.secret, f"127.0.0.1:{self.port}", msg)
                    self.sessions[ident] = session
                    self.sock.send_multipart([ident, *reply])
                    continue
                kind, hdr, _ = self.sessions[ident].unpack(msg, kinds)
                return ident, kind, hdr, msg
        raise AssertionError(f"no {list(kinds)} came")

    def send(self, ident: bytes, frames: list[bytes]) -> None:
        self.sock.send_multipart([ident, *frames])

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class Relay:
    """A listener on a port named in a decode request's hostile kv_transfer_params that
    forwards every message the decode engine sends it to the real producer, and the producer's
    answers back: the strongest position a local stranger without the secret can take."""

    def __init__(self, producer_port: int) -> None:
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(f"tcp://127.0.0.1:{producer_port}")
        self.caught: list[list[bytes]] = []  # what the decode engine sent
        self.answers: list[list[bytes]] = []  # what the producer answered
        self._ident: bytes | None = None

    def drive(self, decode: Any, prefill: Any, seconds: float = 1.0) -> None:
        """Step both engines for ``seconds``, relaying between them."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            decode.step()
            self.pump()
            prefill.step()
            self.pump()

    def pump(self) -> None:
        while self.front.poll(0):
            self._ident, *msg = self.front.recv_multipart()
            self.caught.append(msg)
            self.back.send_multipart(msg)
        while self.back.poll(0):
            msg = self.back.recv_multipart()
            self.answers.append(msg)
            if self._ident is not None:
                self.front.send_multipart([self._ident, *msg])

    def close(self) -> None:
        self.ctx.destroy(linger=0)
