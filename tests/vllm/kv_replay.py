"""Reading back the KV-cache event batches a vLLM publisher sent, through its replay socket.

Shared by the model-free test (test_vllm_e2e.py) and the engine runs (vllm_run.py). A replay
cannot miss batches to ZMQ's slow-joiner race the way a fresh subscriber can.
"""

from __future__ import annotations

import socket
import time
from typing import Any


def free_tcp_endpoint() -> str:
    """A ``tcp://127.0.0.1:PORT`` endpoint on a port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def replayed_batches(replay_endpoint: str, count: int) -> list[Any]:
    """The first ``count`` batches a vLLM publisher sent, read back through its replay socket
    (ZMQ DEALER; no subscriber can miss them to the slow-joiner race): polled until the
    publisher's thread has sent them all."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context.instance()
    deadline = time.monotonic() + 30
    with ctx.socket(zmq.DEALER) as sock:
        sock.connect(replay_endpoint)
        while True:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            batches = []
            while True:
                assert sock.poll(10_000), "no answer from the replay socket"
                _, _, seq, payload = sock.recv_multipart()
                if not payload:
                    break  # the end marker
                batches.append(decoder.decode(payload))
            if len(batches) >= count or time.monotonic() > deadline:
                return batches
            time.sleep(0.05)
