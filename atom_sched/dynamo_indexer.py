"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``, ai-dynamo-runtime 1.6.1)
run as a subprocess and queried over HTTP: a real KV-aware router's index, fed by our
``KVEventPublisher`` over ZMQ (the router tests and ``examples/kv_routing.py`` use it).

What the indexer does (read from its sources and checked against the installed 1.6.1 binary):

* ``POST /register`` connects a ZMQ SUB socket (topic filter ``b""``: every topic) to the
  worker's endpoint, so the publisher must bind. With a ``replay_endpoint`` it also connects a
  DEALER; on a sequence gap (or a first batch with seq > 0) it sends ``[b"", start_seq (8 bytes
  big-endian)]`` and reads ``[b"", topic, seq, payload]`` replies (or the older topic-less
  form) until an empty payload. It waits for that end marker without a timeout: live batches
  queue up meanwhile.
* Each ``BlockStored`` block is indexed under its "local hash": XXH3-64 (seed 1337) of the
  block's own token ids as little-endian u32 (not chained; the tree supplies the prefix), the
  seed mixed with ``lora_name`` and the cache namespace (a top-level ``cache_salt`` or an
  ``extra_keys`` item ``"dynamo-cache-salt:<ns>"``; our bare salt in ``extra_keys`` is ignored).
  A run whose ``block_size`` differs from the registered one is dropped ("Block not published.
  Block size must be ..."). Our xxh64 chain hashes are only the external ids that
  ``BlockRemoved`` and ``parent_block_hash`` refer to; a store under an unknown parent is
  skipped ("Failed to find parent block; skipping store operation").
* ``POST /query`` hashes the token ids the same way and returns, per worker and DP rank, the
  matched prefix length in *tokens* (matched blocks * block size).
* Its HTTP port binds 0.0.0.0 (hard-coded): start it only inside a test, on a free port.

Usage::

    with DynamoIndexer() as idx:
        idx.register(1, pub.endpoint, block_size=4, replay_endpoint=pub.replay_endpoint)
        idx.wait_joined(1, lambda: pub.publish([KVEvent("BlockRemoved", [])]))
        ...  # run the scheduler, publish its events
        idx.wait_for(lambda: idx.block_hashes(1) == set(sched.cached_block_hashes()))
        assert idx.query(prompt) == {1: expected_blocks}
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["DynamoIndexer", "DynamoIndexerError"]

T = TypeVar("T")
MODEL = "default"  # the indexer keys workers by (model_name, routing_group); one model suffices
_APPLIED = re.compile(
    r'dynamo_kvrouter_kv_cache_events_applied\{event_type="(\w+)",status="(\w+)"\} (\S+)')


class DynamoIndexerError(RuntimeError):
    """The indexer failed to start, answered an HTTP error, or a wait timed out."""


def _free_port() -> int:
    # The indexer binds 0.0.0.0, so probe the same wildcard address. The port could be taken
    # between here and its bind: start() retries on a fresh port if the process exits early.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent(parent: int) -> None:
    # Runs in the child before exec: if the test process dies without close() (SIGKILL, a
    # killed CI job), the kernel sends SIGTERM to the indexer rather than leaving an orphan
    # that keeps a port open on every interface. Linux only; elsewhere close() must run.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl: no signal will come
        os._exit(1)


# Subprocesses start from this one thread, which lives until the interpreter exits: the kernel's
# parent-death signal follows the *thread* that forked the child, so a DynamoIndexer made in a
# short-lived thread (a test's, a request handler's) got SIGTERM the moment that thread ended.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynamo-indexer-spawner")


def _popen(**kwargs: Any) -> subprocess.Popen[bytes]:
    parent = os.getpid()
    guard = (lambda: _die_with_parent(parent)) if sys.platform == "linux" else None
    return _spawner.submit(subprocess.Popen, **kwargs, preexec_fn=guard).result()


class DynamoIndexer:
    """A ``python -m dynamo.indexer`` subprocess on a free port, stopped by pid on close().

    ``threads=1`` selects its single-threaded ``KvIndexer``: events are applied in order on one
    thread, the simplest model to reason about in tests (the default, 4, shards across threads).
    Logs go to a temporary file as JSON lines (``DYN_LOGGING_JSONL=1``), see ``log_records()``.
    """

    def __init__(
        self,
        *,
        threads: int = 1,
        log_level: str = "info",
        startup_timeout: float = 30.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.threads = threads
        self.log_level = log_level
        self.startup_timeout = startup_timeout
        self.extra_args = list(extra_args)
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        # A file, not a pipe: nobody drains a pipe while a test runs, and a full one would
        # block the indexer's logging (and so the indexer) mid-test.
        self._log = tempfile.NamedTemporaryFile(prefix="dynamo-indexer-", suffix=".log")
        try:
            self.start()
        except BaseException:
            self._log.close()
            raise

    @staticmethod
    def available() -> bool:
        """Whether ai-dynamo-runtime is installed (``pip install ai-dynamo-runtime==1.6.1``)."""
        return importlib.util.find_spec("dynamo") is not None and (
            importlib.util.find_spec("dynamo.indexer") is not None
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        env = dict(os.environ, DYN_LOGGING_JSONL="1", DYN_LOG=self.log_level)
        for _ in range(3):
            self.port = _free_port()
            cmd = [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port),
                   "--threads", str(self.threads), *self.extra_args]
            self._proc = _popen(
                args=cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env)
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break  # exited: most likely lost the port race; try another port
                try:
                    if self._request("GET", "/health", timeout=1.0)[0] == 200:
                        return
                except OSError:
                    pass  # not listening yet
                time.sleep(0.05)
            else:
                self.close()
                raise DynamoIndexerError(
                    f"dynamo.indexer not ready on port {self.port} after "
                    f"{self.startup_timeout} s; log tail:\n{self.log_tail()}")
        code = self._proc.returncode if self._proc else None
        raise DynamoIndexerError(
            f"dynamo.indexer exited with code {code}; log tail:\n{self.log_tail()}")

    def close(self, timeout: float = 5.0) -> None:
        """Stops the process by its pid: SIGTERM, then SIGKILL after ``timeout`` s."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)

    def __enter__(self) -> DynamoIndexer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._log.close()

    # -- HTTP --------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None,
                 timeout: float = 10.0) -> tuple[int, str]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:  # 4xx/5xx still carry the indexer's message
            return e.code, e.read().decode()

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        status, text = self._request(method, path, body)
        if status >= 400:
            raise DynamoIndexerError(f"{method} {path} -> {status}: {text}")
        return json.loads(text) if text else None

    def register(self, worker_id: int, zmq_endpoint: str, block_size: int,
                 replay_endpoint: str | None = None, *, dp_rank: int | None = None,
                 model_name: str = MODEL) -> None:
        """Subscribes to a worker's KV events (the publisher's bound endpoint, e.g.
        ``pub.endpoint``). ``block_size`` must equal the events' block size, else every
        BlockStored is dropped. Without ``replay_endpoint`` lost batches stay lost."""
        body: dict[str, Any] = {"instance_id": worker_id, "endpoint": zmq_endpoint,
                                "model_name": model_name, "block_size": block_size}
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        if dp_rank is not None:
            body["dp_rank"] = dp_rank
        self._call("POST", "/register", body)

    def unregister(self, worker_id: int, *, dp_rank: int | None = None,
                   model_name: str = MODEL) -> None:
        """Drops the worker (or one DP rank of it) and its blocks from the index."""
        body: dict[str, Any] = {"instance_id": worker_id, "model_name": model_name}
        if dp_rank is not None:  # dp_rank is honoured only together with a routing group
            body.update(dp_rank=dp_rank, routing_group="default")
        self._call("POST", "/unregister", body)

    def workers(self) -> list[dict[str, Any]]:
        """``GET /workers``: one entry per worker with its listeners' status (``pending``,
        ``active``, ``failed``, ...)."""
        return self._call("GET", "/workers")

    def query_raw(self, token_ids: Iterable[int], *, lora_name: str | None = None,
                  cache_salt: str | None = None, model_name: str = MODEL) -> dict[str, Any]:
        """``POST /query`` as returned: ``{"scores": {worker: {dp_rank: tokens}},
        "frequencies": [...], "instances": {worker: {"longest_matched": tokens, ...}}}``."""
        body: dict[str, Any] = {"token_ids": list(token_ids), "model_name": model_name}
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return self._call("POST", "/query", body)

    def query(self, token_ids: Iterable[int], *, lora_name: str | None = None,
              cache_salt: str | None = None, model_name: str = MODEL) -> dict[int, int]:
        """Matched prefix length in *blocks* per worker (best DP rank); workers without a match
        are absent. The indexer reports tokens; dividing by the worker's block size gives the
        number we compare with the scheduler's cached blocks."""
        raw = self.query_raw(token_ids, lora_name=lora_name, cache_salt=cache_salt,
                             model_name=model_name)
        block_size = self._block_size(model_name)
        return {int(w): max(ranks.values()) // block_size
                for w, ranks in raw["scores"].items() if ranks}

    def dump(self) -> dict[str, Any]:
        """``GET /dump``: ``{"model:routing_group": {"block_size": n, "events": [...]}}``; each
        event is ``{"worker_id", "storage_tier", "event": {"event_id", "dp_rank", "data":
        {"stored": {"parent_hash", "blocks": [{"block_hash", "tokens_hash", ...}]}}}}`` with
        ``block_hash`` our external hash and ``tokens_hash`` the indexer's local hash."""
        return self._call("GET", "/dump")

    def _block_size(self, model_name: str) -> int:
        for entry in self.workers():
            if entry["model_name"] == model_name:
                return int(entry["block_size"])
        raise DynamoIndexerError(f"no worker registered for model {model_name!r}")

    # -- reading the index -------------------------------------------------------------------

    def stored_blocks(self, worker_id: int | None = None,
                      model_name: str = MODEL) -> list[dict[str, Any]]:
        """The dump's stored blocks of one worker (all when None), each with ``parent_hash``
        and ``worker_id`` added, in dump order (parents before children)."""
        entry = self.dump().get(f"{model_name}:default", {})
        if "error" in entry:
            raise DynamoIndexerError(f"dump failed: {entry['error']}")
        out = []
        for ev in entry.get("events", []):
            if worker_id is not None and ev["worker_id"] != worker_id:
                continue
            stored = ev["event"]["data"].get("stored")
            if stored is None:
                continue
            parent = stored["parent_hash"]
            for block in stored["blocks"]:
                out.append({**block, "parent_hash": parent, "worker_id": ev["worker_id"]})
                parent = block["block_hash"]
        return out

    def block_hashes(self, worker_id: int | None = None, model_name: str = MODEL) -> set[int]:
        """Our external block hashes the index holds: equal to
        ``Scheduler.cached_block_hashes()`` once in sync (a removed block takes its descendants
        out of the index; the block pool removes them too, leaves first)."""
        return {b["block_hash"] for b in self.stored_blocks(worker_id, model_name)}

    # -- waiting -----------------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], T], timeout: float = 10.0,
                 what: str = "condition", interval: float = 0.05) -> T:
        """Polls ``predicate()`` until it returns a truthy value (returned). Events reach the
        index asynchronously (ZMQ, then the indexer's worker thread), so tests poll instead of
        sleeping. On timeout the error carries the indexer's log tail."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if self._proc is None or self._proc.poll() is not None:
                raise DynamoIndexerError(f"indexer exited while waiting for {what}; log tail:\n"
                                         f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise DynamoIndexerError(f"timed out after {timeout} s waiting for {what}; "
                                         f"log tail:\n{self.log_tail()}")
            time.sleep(interval)

    def wait_listening(self, worker_id: int, timeout: float = 10.0) -> None:
        """Waits until every listener of the worker is ``active``: its SUB socket exists and its
        receive loop runs. That does not mean connected (ZMQ connects in the background, even
        to an address nobody binds); use ``wait_joined`` to know a batch got through."""

        def active() -> bool:
            for entry in self.workers():
                if entry["instance_id"] == worker_id:
                    listeners = list(entry.get("listeners", {}).values())
                    for x in listeners:  # e.g. a bind address ("tcp://*:5557") cannot connect
                        if x["status"] == "failed":
                            raise DynamoIndexerError(
                                f"worker {worker_id}'s listener failed: {x.get('last_error')}")
                    return bool(listeners) and all(x["status"] == "active" for x in listeners)
            return False

        self.wait_for(active, timeout, f"worker {worker_id}'s listener to be active")

    def events_applied(self) -> dict[tuple[str, str], int]:
        """Events the index has applied, by (``stored|removed|cleared``, status), from
        ``/metrics`` (all workers together). Statuses other than ``ok`` include
        ``parent_block_not_found`` and ``block_not_found``."""
        status, text = self._request("GET", "/metrics")
        if status != 200:
            raise DynamoIndexerError(f"GET /metrics -> {status}")
        out = {}
        for m in _APPLIED.finditer(text):
            if float(m.group(3)):
                out[(m.group(1), m.group(2))] = int(float(m.group(3)))
        return out

    def wait_joined(self, worker_id: int, publish_noop: Callable[[], object],
                    timeout: float = 10.0) -> None:
        """Waits until the worker's listener is active and has applied a batch, publishing a
        no-op batch (e.g. ``pub.publish([KVEvent("BlockRemoved", [])])``) before each check.
        Why: a batch published before the SUB socket has joined is lost, and the indexer only
        asks for a replay when a later batch shows the gap, so a test whose last batch is lost
        would wait forever. Call it before the traffic under test, with no other publisher.
        (With ``threads > 1`` an empty BlockRemoved is counted as ``block_not_found`` and logs a
        harmless WARN; with ``threads=1`` it is ``ok``.)"""
        self.wait_listening(worker_id, timeout)
        base = sum(self.events_applied().values())

        def applied() -> bool:
            publish_noop()
            return sum(self.events_applied().values()) > base

        self.wait_for(applied, timeout, f"worker {worker_id}'s first applied batch",
                      interval=0.02)

    # -- logs --------------------------------------------------------------------------------

    def log_text(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_records(self, level: str | None = None) -> list[dict[str, Any]]:
        """The JSON log lines (``time, level, target, message`` and the event's fields, e.g.
        ``{"level": "WARN", "message": "Gap detected: expected seq 3, got 4", ...}``)."""
        records = []
        for line in self.log_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a non-JSON line (e.g. a panic message)
            if level is None or rec.get("level") == level.upper():
                records.append(rec)
        return records
