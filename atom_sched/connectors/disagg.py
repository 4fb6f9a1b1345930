"""Two engines in two processes on one machine: a prefill engine and a decode engine joined by
KV connectors (loopback or NIXL), and the proxy that routes each request through them.

:class:`DisaggPair` starts both engines (``multiprocessing`` spawn), each with one torch thread by
default, and serves prompts as a disaggregating proxy does (vLLM's toy proxy, ATOM's router):

1. the prompt goes to the prefill engine with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": True}``;
2. its completion carries T0 and ``kv_transfer_params`` (where the KV is);
3. the prompt goes to the decode engine with the user's parameters and those
   ``kv_transfer_params``; the decode engine pulls the KV from the prefill engine and streams T0
   followed by the rest.

A prompt whose T0 already ends it (a stop token, or ``max_tokens=1``) is answered by the prefill
engine alone, and its blocks are released there.

Each worker runs :func:`engine_worker`: it steps its engine whenever it has work (transfers
included) and answers commands from its pipe between steps.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

__all__ = ["DisaggPair", "engine_worker"]


TRANSPORTS = ("loopback", "nixl")


def _connector(role: str, transport: str, kwargs: dict[str, Any]) -> Any:
    if transport == "nixl":
        from .nixl import NixlConsumer as Consumer
        from .nixl import NixlProducer as Producer
    elif transport == "loopback":
        from .loopback import LoopbackConsumer as Consumer
        from .loopback import LoopbackProducer as Producer
    else:
        raise ValueError(f"transport {transport!r}: one of {TRANSPORTS}")
    if role == "prefill":
        return Producer(**kwargs)
    if role == "decode":
        return Consumer(**kwargs)
    raise ValueError(f"role {role!r}: 'prefill' or 'decode'")


def engine_worker(pipe: Connection, role: str, model_path: str | None,
                  engine_config: dict[str, Any], threads: int = 1,
                  connector_kwargs: dict[str, Any] | None = None,
                  transport: str = "loopback") -> None:
    """A process's main: an engine with a KV connector (``role`` "prefill" or "decode",
    ``transport`` "loopback" or "nixl"), driven through ``pipe``.

    Commands: ``("add", rid, prompt_ids, GenerationParams, kv_transfer_params)``,
    ``("release", transfer_id)``, ``("state",)``, ``("stop",)``. Replies: ``("ready", info)``,
    ``("done", Completion)``, ``("added", rid, error_or_None)``, ``("state", dict)``,
    ``("crash", traceback)``."""
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from ..engine import EngineConfig, LLMEngine, set_threads

        set_threads(threads)
        t0 = time.perf_counter()
        eng = LLMEngine(EngineConfig(**engine_config), model_path=model_path)
        conn = _connector(role, transport, dict(connector_kwargs or {}))
        eng.set_kv_connector(conn)
        pipe.send(("ready", {"pid": os.getpid(), "port": getattr(conn, "port", None),
                             "load_seconds": time.perf_counter() - t0}))
        running = True
        while running:
            busy = eng.has_unfinished()
            while pipe.poll(0 if busy else 0.02):
                msg = pipe.recv()
                if msg[0] == "add":
                    _, rid, prompt, params, xfer = msg
                    try:
                        eng.add_request(prompt, params, request_id=rid, kv_transfer_params=xfer)
                        pipe.send(("added", rid, None))
                    except Exception as e:  # noqa: BLE001 - reported to the caller
                        pipe.send(("added", rid, f"{type(e).__name__}: {e}"))
                elif msg[0] == "release":
                    conn.release(msg[1])
                elif msg[0] == "state":
                    pipe.send(("state", _state(eng, conn)))
                elif msg[0] == "stop":
                    running = False
                    break
                busy = eng.has_unfinished()
            if running and eng.has_unfinished():
                for ev in eng.step():
                    if ev.finished:
                        pipe.send(("done", eng.completion(ev.request_id)))
                        eng.release(ev.request_id)
        conn.close()
    except BaseException:  # noqa: BLE001 - the parent sees the traceback
        try:
            pipe.send(("crash", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
        raise


def _state(eng: Any, conn: Any) -> dict[str, Any]:
    s = eng.scheduler
    return {
        "num_blocks": s.num_blocks,
        "num_usable_blocks": s.num_usable_blocks,
        "num_free_blocks": s.num_free_blocks,
        "num_waiting": s.num_waiting,
        "num_running": s.num_running,
        "cached_block_hashes": list(s.cached_block_hashes()),
        "pending_sends": list(getattr(conn, "pending_sends", [])),
        "has_pending": conn.has_pending(),
        "log": list(conn.log),
        "transfer_stats": dict(conn.transfer_stats),
        "stats": eng.stats(),
        "steps": eng.timings.steps,
        "connector_errors": list(s.take_connector_errors()),
    }


class DisaggPair:
    """A prefill engine and a decode engine in two processes, and a proxy between them.

    ``prefill_config`` and ``decode_config`` are :class:`EngineConfig` keyword dicts (the block
    size must be the same). ``transport``: "loopback" (the KV in ZMQ frames) or "nixl" (NIXL
    READs). Use as a context manager, or call :meth:`close`."""

    def __init__(self, model_path: str | Path | None = None, *,
                 prefill_config: dict[str, Any] | None = None,
                 decode_config: dict[str, Any] | None = None, threads: int = 1,
                 producer_kwargs: dict[str, Any] | None = None,
                 consumer_kwargs: dict[str, Any] | None = None,
                 timeout_s: float = 600.0, transport: str = "loopback") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: one of {TRANSPORTS}")
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s  # for the engines to start, and for a call to finish
        self._procs: dict[str, Any] = {}
        self._pipes: dict[str, Connection] = {}
        self.info: dict[str, dict[str, Any]] = {}  # per role: pid, port, load_seconds
        self.exitcodes: dict[str, int | None] = {}  # per role, once closed
        self._inbox: dict[str, list[tuple]] = {"prefill": [], "decode": []}
        path = None if model_path is None else str(model_path)
        # The connectors authenticate each other with a secret only the two workers know.
        secret = {"secret": secrets.token_bytes(32)}
        roles = {"prefill": (prefill_config or {}, {**secret, **(producer_kwargs or {})}),
                 "decode": (decode_config or {}, {**secret, **(consumer_kwargs or {})})}
        try:
            for role, (cfg, kw) in roles.items():
                parent, child = ctx.Pipe()
                p = ctx.Process(target=engine_worker, name=f"atom-sched-{role}",
                                args=(child, role, path, dict(cfg), threads, kw, transport),
                                daemon=True)
                p.start()
                child.close()
                self._procs[role], self._pipes[role] = p, parent
            for role in roles:
                self.info[role] = self._expect(role, "ready", timeout_s)[1]
        except BaseException:
            self.close()
            raise

    # -- plumbing -------------------------------------------------------------------------------
    def _recv(self, role: str, timeout: float) -> tuple:
        pipe = self._pipes[role]
        if not pipe.poll(timeout):
            raise TimeoutError(f"the {role} engine did not answer in {timeout:g} s")
        try:
            msg = pipe.recv()
        except EOFError:
            raise RuntimeError(f"the {role} engine exited "
                               f"(code {self._procs[role].exitcode})") from None
        if msg[0] == "crash":
            raise RuntimeError(f"the {role} engine crashed:\n{msg[1]}")
        return msg

    def _expect(self, role: str, kind: str, timeout: float) -> tuple:
        """The next message of ``kind`` from ``role``; others are kept for later."""
        for i, msg in enumerate(self._inbox[role]):
            if msg[0] == kind:
                return self._inbox[role].pop(i)
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv(role, max(0.0, deadline - time.monotonic()))
            if msg[0] == kind:
                return msg
            self._inbox[role].append(msg)

    def state(self, role: str) -> dict[str, Any]:
        """The engine's scheduler and connector state (see ``_state``)."""
        self._pipes[role].send(("state",))
        return self._expect(role, "state", 60.0)[1]

    # -- the proxy ------------------------------------------------------------------------------
    def prefill(self, prompts: Sequence[Sequence[int]], params: Any = None, *,
                request_ids: Sequence[int] | None = None) -> list[Any]:
        """Step 1 alone: prefill ``prompts`` on the prefill engine (``max_tokens=1``,
        ``do_remote_decode``); returns its completions (T0 and ``kv_transfer_params``). Their
        blocks stay held there until :meth:`decode` has pulled them (or they are released)."""
        rids, plist = self._ids_and_params(prompts, params, request_ids)
        for rid, prompt, gp in zip(rids, prompts, plist, strict=True):
            self._pipes["prefill"].send(("add", rid, list(prompt), replace(gp, max_tokens=1),
                                         {"do_remote_decode": True}))
        return self._collect("prefill", rids)

    def decode(self, prompts: Sequence[Sequence[int]], prefilled: Sequence[Any],
               params: Any = None) -> list[Any]:
        """Step 2 alone: decode ``prompts`` on the decode engine from the KV of the prefill
        completions ``prefilled`` (pulled from the prefill engine)."""
        rids = [c.request_id for c in prefilled]
        _, plist = self._ids_and_params(prompts, params, rids)
        results: dict[int, Any] = {}
        todo = []
        for prompt, gp, comp in zip(prompts, plist, prefilled, strict=True):
            if self._needs_decode(comp, gp, results):
                self._pipes["decode"].send(("add", comp.request_id, list(prompt), gp,
                                            comp.kv_transfer_params))
                todo.append(comp.request_id)
        results.update(zip(todo, self._collect("decode", todo), strict=True))
        return [results[r] for r in rids]

    def generate(self, prompts: Sequence[Sequence[int]], params: Any = None, *,
                 request_ids: Sequence[int] | None = None) -> list[Any]:
        """Serve token-id prompts through prefill -> KV transfer -> decode, each request
        going on to the decode engine as soon as its prefill is done; returns the final
        completions in order."""
        rids, plist = self._ids_and_params(prompts, params, request_ids)
        by_rid = dict(zip(rids, zip(prompts, plist, strict=True), strict=True))
        for rid, (prompt, gp) in by_rid.items():
            self._pipes["prefill"].send(("add", rid, list(prompt), replace(gp, max_tokens=1),
                                         {"do_remote_decode": True}))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(results) < len(by_rid):
            role, msg = self._next_done(deadline)
            comp = msg[1]
            rid = comp.request_id
            if role == "decode":
                results[rid] = comp
                continue
            prompt, gp = by_rid[rid]
            if self._needs_decode(comp, gp, results):
                self._pipes["decode"].send(("add", rid, list(prompt), gp,
                                            comp.kv_transfer_params))
        return [results[r] for r in rids]

    # -- proxy helpers --------------------------------------------------------------------------
    @staticmethod
    def _ids_and_params(prompts: Sequence[Any], params: Any,
                        request_ids: Sequence[int] | None) -> tuple[list[int], list[Any]]:
        from ..engine import GenerationParams

        params = params or GenerationParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        rids = list(request_ids) if request_ids is not None else list(range(len(prompts)))
        if not len(plist) == len(rids) == len(prompts):
            raise ValueError("one GenerationParams and one request id per prompt")
        return rids, plist

    def _needs_decode(self, comp: Any, gp: Any, results: dict[int, Any]) -> bool:
        """False (and the prefill completion is the answer) when T0 ends the request: a stop
        token or ``max_tokens=1``; the prefill side's blocks are released then."""
        xfer = comp.kv_transfer_params
        if comp.finish_reason == "max_tokens" and gp.max_tokens > 1 and xfer is not None:
            return True
        if xfer is not None:
            self._pipes["prefill"].send(("release", xfer["transfer_id"]))
        results[comp.request_id] = comp
        return False

    def _next_done(self, deadline: float) -> tuple[str, tuple]:
        """The next ``("done", Completion)`` from either engine (refusals raise)."""
        while True:
            for role in ("prefill", "decode"):
                box = self._inbox[role]
                while True:
                    at = next((i for i, m in enumerate(box) if m[0] in ("done", "added")), None)
                    if at is None:
                        break
                    msg = box.pop(at)
                    if msg[0] == "done":
                        return role, msg
                    self._check_added(role, msg)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("requests unfinished at the deadline")
            ready = wait(list(self._pipes.values()), timeout=min(left, 1.0))
            for role, pipe in self._pipes.items():
                if pipe in ready:
                    self._inbox[role].append(self._recv(role, 0.0))

    @staticmethod
    def _check_added(role: str, msg: tuple) -> None:
        if msg[2] is not None:
            raise RuntimeError(f"the {role} engine refused request {msg[1]}: {msg[2]}")

    def _collect(self, role: str, rids: Sequence[int]) -> list[Any]:
        got: dict[int, Any] = {}
        want = set(rids)
        deadline = time.monotonic() + self.timeout_s
        while want - set(got):
            r, msg = self._next_done(deadline)
            if r != role or msg[1].request_id not in want:
                raise RuntimeError(f"unexpected completion from the {r} engine: {msg[1]}")
            got[msg[1].request_id] = msg[1]
        return [got[r] for r in rids]

    def close(self, timeout: float = 30.0) -> None:
        for pipe in self._pipes.values():
            try:
                pipe.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for role, p in self._procs.items():
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(5)
            self.exitcodes[role] = p.exitcode
        for pipe in self._pipes.values():
            pipe.close()
        self._procs.clear()
        self._pipes.clear()

    def __enter__(self) -> DisaggPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
