"""Helpers of the device-builder suites (test_device_*.py).

* ``SpecModel``: a deterministic stand-in for a model with a drafter, keyed by (request id, tokens
  generated so far), as the device sees them. For a decode row it picks the accepted count
  ``a`` and returns the target tokens (greedy) or the probabilities (probabilistic) that make the
  device's verification accept exactly ``a`` tokens, so a run's outputs do not depend on the step
  protocol.
* ``run_builder``: drives a real ``Scheduler`` with a ``DeviceBatchBuilder`` (sync or one step
  ahead), feeding ``accept()``'s result into ``update``, and checks every step's device tensors
  against the host batch arrays (exact in the synchronous protocol) and the slot state against the
  scheduler's request state.
* ``random_case``: a random device state and plan (rows in any order, mixed prefill and decode
  rows, resets, new blocks, K = 0..8) for kernel-vs-reference parity and property tests.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import atom_sched
from atom_sched import _core

from .fake_model import mix  # one deterministic mixer for every suite

EOS = 1


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class SpecModel:
    """Decisions depend only on (seed, rid, g), g = tokens the request generated so far, so the
    streamed tokens are the same whatever the schedule (sync, one step ahead, preemptions):
    the request's g-th generated token is ``token(rid, g)``; after g tokens the drafter proposes
    ``draft(rid, g, j)``, which is ``token(rid, g + j)`` for the first ``accepted(rid, g) - 1``
    drafts and a wrong token after; the target model's token at each position is the true one.
    With ``variable_drafts`` the drafter proposes ``num_drafts(rid, g)`` of the K (the rest -1)."""

    def __init__(self, k: int, seed: int = 0, eos_rate: int = 40, probabilistic: bool = False,
                 variable_drafts: bool = False):
        self.k = k
        self.seed = seed
        self.eos_rate = eos_rate  # one token in eos_rate is EOS (0: never)
        self.probabilistic = probabilistic
        self.variable_drafts = variable_drafts
        self.gen: dict[int, int] = defaultdict(int)

    def token(self, rid: int, g: int) -> int:
        h = mix(self.seed, rid, g, 1)
        if self.eos_rate and h % self.eos_rate == 0:
            return EOS
        return h % 5000 + 10

    def accepted(self, rid: int, g: int) -> int:
        return mix(self.seed, rid, g, 2) % (self.k + 1) + 1 if self.k else 1

    def num_drafts(self, rid: int, g: int) -> int:
        return mix(self.seed, rid, g, 8) % (self.k + 1) if self.variable_drafts else self.k

    def draft(self, rid: int, g: int, j: int) -> int:
        if j >= self.num_drafts(rid, g):
            return -1  # not proposed
        t = self.token(rid, g + j)
        return t if j < self.accepted(rid, g) - 1 else t + 7000  # + 7000: surely wrong

    def outputs(self, batch: Any, device: Any) -> dict[str, Any]:
        """accept() arguments for `batch` (rows in batch order), advancing the generated counts."""
        import torch

        n, k = int(batch.num_rows), self.k
        target = np.zeros((n, k + 1), dtype=np.int32)
        drafts = np.zeros((n, k), dtype=np.int32)
        tp = np.full((n, k), 0.5, dtype=np.float32)
        dp = np.full((n, k), 0.5, dtype=np.float32)
        un = np.full((n, k), 0.5, dtype=np.float32)
        emits = batch.emits_token
        prefill_rows = batch.row_is_prefill
        for i, rid in enumerate(int(r) for r in batch.req_ids):
            if not emits[i]:
                continue
            g = self.gen[rid]
            # A decode row verifies its q - 1 drafts (q <= K+1; narrower near the position
            # limit or the pool's end): it accepts at most q tokens.
            q = int(batch.num_scheduled_tokens[i])
            a = (1 if prefill_rows[i]
                 else min(self.accepted(rid, g), q, 1 + self.num_drafts(rid, g)))
            # Inputs were [last, draft(rid, g, 0..k-1)]; the target's token at each position:
            target[i, :] = [self.token(rid, g + j) for j in range(k + 1)]
            if self.probabilistic and not prefill_rows[i]:
                for j in range(k):  # accept draft j+1 iff u * p_draft < p_target
                    dp[i, j] = (mix(self.seed, rid, g, j, 6) % 100 + 1) / 100.0
                    un[i, j] = (mix(self.seed, rid, g, j, 7) % 100) / 100.0
                    prod = np.float32(un[i, j]) * np.float32(dp[i, j])
                    tp[i, j] = prod + np.float32(0.01) if j < a - 1 else prod * np.float32(0.5)
            self.gen[rid] = g + a
            drafts[i, :] = [self.draft(rid, g + a, j) for j in range(k)]
        out: dict[str, Any] = {"target_token_ids": torch.from_numpy(target).to(device)}
        if k > 0:
            out["next_draft_token_ids"] = torch.from_numpy(drafts).to(device)
        if self.probabilistic and k > 0 and not batch.is_prefill:
            out["target_probs"] = torch.from_numpy(tp).to(device)
            out["draft_probs"] = torch.from_numpy(dp).to(device)
            out["uniform"] = torch.from_numpy(un).to(device)
        return out

    def sequence(self, rid: int, n: int) -> list[int]:
        return [self.token(rid, g) for g in range(n)]


# ---------------------------------------------------------------------------------------------
# Driving a scheduler through the builder
# ---------------------------------------------------------------------------------------------


@dataclass
class RunLog:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0  # steps with a decode row (a mixed step too)
    mixed_steps: int = 0  # steps with prefill and decode rows (policy="mixed")
    preemptions: int = 0
    finished: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    inputs: dict[int, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    prefix_hits: int = 0
    slot_reuses: int = 0
    padded_steps: int = 0


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy()


def check_inputs_against_host(b: Any, x: Any, k: int, exact: bool,
                              tables: np.ndarray | None = None) -> None:
    """The builder's tensors equal the host batch arrays (where the host is exact). ``tables``:
    the rows' block tables, for a batch that carries none (host_block_tables=False)."""
    n, m = int(b.num_rows), int(b.num_tokens)
    assert x.num_rows == n and x.num_tokens == m
    ids, pos, slots = _np(x.input_ids), _np(x.positions), _np(x.slot_mapping)
    qsl, cuk, seq = _np(x.query_start_loc), _np(x.cu_seqlens_k), _np(x.seq_lens)
    table, logits, spec = _np(x.block_table), _np(x.logits_indices), _np(x.spec_logits_indices)
    assert ids.dtype == np.int32 and pos.dtype == np.int64 and slots.dtype == np.int64
    np.testing.assert_array_equal(qsl[: n + 1], b.cu_seqlens_q)
    if exact:
        np.testing.assert_array_equal(ids[:m], b.scheduled_tokens)
        np.testing.assert_array_equal(pos[:m], b.positions)
        np.testing.assert_array_equal(slots[:m], b.slot_mapping)
        np.testing.assert_array_equal(seq[:n], b.context_lens)
        np.testing.assert_array_equal(cuk[: n + 1], b.cu_seqlens_k)
    else:
        known = b.scheduled_tokens >= 0
        np.testing.assert_array_equal(ids[:m][known], b.scheduled_tokens[known])
        rows_exact = np.asarray(b.row_exact)
        tok_exact = np.repeat(rows_exact, np.asarray(b.num_scheduled_tokens))
        np.testing.assert_array_equal(pos[:m][tok_exact], b.positions[tok_exact])
        np.testing.assert_array_equal(slots[:m][tok_exact], b.slot_mapping[tok_exact])
        np.testing.assert_array_equal(seq[:n][rows_exact], b.context_lens[rows_exact])
        # Where the host has only upper bounds, the device is never above them.
        assert (seq[:n] <= b.context_lens).all()
    np.testing.assert_array_equal(table[:n], b.block_tables if tables is None else tables)
    # The rows whose logits a runner needs: those that emit a token.
    np.testing.assert_array_equal(_np(x.sample_rows), np.flatnonzero(np.asarray(b.emits_token)))
    cu = np.asarray(b.cu_seqlens_q)
    np.testing.assert_array_equal(logits[:n], cu[1:] - 1)
    # A decode row: each of its tokens, then its last one repeated (a row narrower than K+1
    # tokens); a prefill row: its last token K+1 times.
    last = (cu[1:] - 1)[:, None]
    spec_want = np.minimum(cu[:-1, None] + np.arange(k + 1)[None, :], last)
    prefill_rows = np.asarray(b.row_is_prefill)
    spec_want[prefill_rows] = np.repeat(last, k + 1, axis=1)[prefill_rows]
    np.testing.assert_array_equal(spec[:n], spec_want)
    # Padding, as a captured graph needs it.
    rp, tp = x.num_rows_padded, x.num_tokens_padded
    assert ids.shape == (tp,) and table.shape[0] == rp and qsl.shape == (rp + 1,)
    assert (slots[m:] == -1).all() and (ids[m:] == 0).all() and (pos[m:] == 0).all()
    assert (seq[n:] == 0).all() and (qsl[n:] == m).all() and (cuk[n:] == cuk[n]).all()
    assert (table[n:] == 0).all()
    assert (np.diff(qsl) >= 0).all()
    assert (logits[n:] == max(m - 1, 0)).all()


def check_state_against_scheduler(builder: Any, sched: Any, slot_of: dict[int, int]) -> None:
    """After update: each running request's device slot holds its computed length, last token,
    drafts and block table."""
    st = builder.slot_state()
    k = builder.k
    for rid, slot in slot_of.items():
        if rid not in sched:
            continue
        rs = sched.request_state(rid)
        if rs["status"] != "running":
            continue
        if rs["num_computed_tokens"] < rs["prefill_target"]:
            continue  # a partial prefill has sampled nothing yet
        assert st["computed"][slot] == rs["num_computed_tokens"], (rid, slot)
        assert st["last_token"][slot] == rs["token_ids"][-1], (rid, slot)
        if k:
            assert list(st["drafts"][slot]) == list(rs["drafts"]), (rid, slot)
        bt = rs["block_table"]
        assert list(st["block_table"][slot][: len(bt)]) == list(bt)
        assert not st["block_table"][slot][len(bt) :].any()


def run_builder(
    cfg: Any,
    prompts: dict[int, tuple[list[int], Any]],
    model: SpecModel,
    *,
    mode: str = "sync",
    device: str = "cpu",
    capture_sizes: tuple[int, ...] = (),
    cuda_graphs: bool = False,
    split_drafts: bool = False,
    max_steps: int = 5000,
    kernels: bool | None = None,
) -> tuple[RunLog, Any]:
    """Runs every prompt to completion through the builder; returns the log and the builder.
    ``kernels``: DeviceBatchBuilder's (None: the kernels where the build can run them, so the
    hip-cpu build runs them on CPU tensors; False: the CPU references)."""
    sched = atom_sched.Scheduler(cfg)
    builder = atom_sched.DeviceBatchBuilder(
        cfg, device=device, capture_sizes=capture_sizes, cuda_graphs=cuda_graphs, kernels=kernels
    )
    k = int(cfg.num_speculative_tokens)
    for rid, (p, sp) in prompts.items():
        sched.add_request(rid, p, sp)
    log = RunLog()
    pending: list[tuple[Any, Any]] = []  # (batch, accept result) not yet passed to update
    slot_of: dict[int, int] = {}
    seen_slots: dict[int, set[int]] = defaultdict(set)

    def consume() -> None:
        b, res = pending.pop(0)
        so = sched.update(b, **res.update_kwargs())
        for o in so:
            log.tokens[int(o.request_id)].extend(int(t) for t in o.output_tokens)
            if o.finished:
                log.finished[int(o.request_id)] = o.finish_reason
        sched.check_invariants()

    while sched.has_unfinished_requests() or pending:
        assert log.steps < max_steps, "run did not finish"
        if mode == "async" and len(pending) == 2:
            consume()
        b = sched.schedule() if sched.has_unfinished_requests() else None
        if b is None:
            if not pending:
                break
            consume()
            continue
        log.steps += 1
        log.prefill_steps += bool(b.is_prefill)
        log.decode_steps += not b.is_prefill
        log.mixed_steps += bool(not b.is_prefill and np.asarray(b.row_is_prefill).any())
        n = int(b.num_rows)
        for i in range(n):
            rid, slot = int(b.req_ids[i]), int(b.request_slots[i])
            if b.slot_reset[i]:
                if any(s != rid for s in seen_slots[slot]):
                    log.slot_reuses += 1
                seen_slots[slot].add(rid)
                if int(b.num_cached_tokens[i]) > 0:
                    log.prefix_hits += 1
            slot_of[rid] = slot
        x = builder.prepare(b)
        log.padded_steps += x.num_rows_padded > n
        tables = None
        if not cfg.host_block_tables:  # the requests' tables, as the rows would hold them
            tables = np.zeros((n, int(b.block_table_width)), np.int32)
            for i in range(n):
                bt = sched.request_state(int(b.req_ids[i]))["block_table"]
                tables[i, : len(bt)] = bt
        check_inputs_against_host(b, x, k, exact=(mode == "sync"), tables=tables)
        # Record every input the device built, by request and position (to compare protocols).
        ids, pos = _np(x.input_ids), _np(x.positions)
        cu = np.asarray(b.cu_seqlens_q)
        for i in range(n):
            rid = int(b.req_ids[i])
            for t in range(int(cu[i]), int(cu[i + 1])):
                log.inputs[rid][int(pos[t])] = int(ids[t])
        out = model.outputs(b, builder.device)
        if split_drafts and k > 0:
            drafts = out.pop("next_draft_token_ids")
            res = builder.accept(b, **out)
            assert res.drafts_pending and not res.ready()
            builder.store_drafts(res, drafts)
        else:
            res = builder.accept(b, **out)
        pending.append((b, res))
        if mode == "sync":
            consume()
            check_state_against_scheduler(builder, sched, slot_of)
    log.preemptions = int(sched.stats()["num_preemptions"])
    assert builder.errors == 0
    for rid, toks in log.tokens.items():  # exactly the model's tokens, whatever the schedule
        assert toks == model.sequence(rid, len(toks)), rid
    return log, builder


# ---------------------------------------------------------------------------------------------
# Random device states and plans
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    """A random state and plan (numpy, host memory) with the sizes to launch it with."""

    num_slots: int
    width: int
    k: int
    block_size: int
    table: np.ndarray
    computed: np.ndarray
    last: np.ndarray
    drafts: np.ndarray
    plan: np.ndarray
    num_rows: int
    num_tokens: int
    padded_rows: int
    padded_tokens: int
    rows: list[dict[str, Any]]


def random_case(rng: np.random.Generator, k: int, *, num_slots: int = 24, width: int = 8,
                block_size: int = 4, max_rows: int | None = None, pad: bool = True) -> Case:
    S, W, bs = num_slots, width, block_size
    cap = W * bs
    table = rng.integers(1, 10_000, size=(S, W), dtype=np.int32)
    computed = rng.integers(0, cap - k - 1, size=S, dtype=np.int32)
    last = rng.integers(10, 5000, size=S, dtype=np.int32)
    drafts = rng.integers(10, 5000, size=(S, max(k, 1)), dtype=np.int32)
    n = int(rng.integers(1, (max_rows or S) + 1))
    slots = rng.permutation(S)[:n].astype(np.int32)  # unique, any order
    rows: list[dict[str, Any]] = []
    q_list, cached, prefill, reset, emits, starts, offsets, ids, toks = ([] for _ in range(9))
    offsets = [0]
    for slot in slots:
        is_prefill = bool(rng.integers(0, 2))
        is_reset = is_prefill and bool(rng.integers(0, 2))
        if is_prefill:
            start = int(rng.integers(0, cap - 1))
            q = int(rng.integers(1, min(cap - start, 3 * bs) + 1))
            row_emits = bool(rng.integers(0, 2))
            row_tokens = rng.integers(10, 5000, size=q).astype(np.int32)
        else:
            start = 0
            q = int(rng.integers(1, k + 2))
            row_emits = True
            row_tokens = np.full(q, -1, dtype=np.int32)
        nb = int(rng.integers(0, 3))
        bstart = 0 if is_reset else int(rng.integers(0, W - nb + 1))
        new = rng.integers(1, 10_000, size=nb).astype(np.int32)
        q_list.append(q)
        cached.append(start)
        prefill.append(is_prefill)
        reset.append(is_reset)
        emits.append(row_emits)
        starts.append(bstart)
        ids.extend(int(v) for v in new)
        offsets.append(len(ids))
        toks.extend(int(v) for v in row_tokens)
        rows.append(dict(slot=int(slot), q=q, prefill=is_prefill, reset=is_reset,
                         emits=row_emits, start=start))
    cu = np.concatenate([[0], np.cumsum(q_list)]).astype(np.int32)
    m = int(cu[-1])
    rp = n + (int(rng.integers(0, 4)) if pad else 0)
    tp = m + (int(rng.integers(0, 6)) if pad else 0)
    words = _core.device_plan_words(n, len(ids), m)
    plan = np.zeros(words, dtype=np.int32)
    got = _core.device_pack_plan(
        plan.ctypes.data, words,
        slots, np.array(q_list, np.int32), np.array(cached, np.int32),
        np.array(prefill, np.bool_), np.array(reset, np.bool_), np.array(emits, np.bool_),
        np.array(starts, np.int32), np.array(offsets, np.int32), np.array(ids, np.int32),
        np.array(toks, np.int32), cu,
    )
    assert got <= words
    return Case(S, W, k, bs, table, computed, last, drafts, plan[:got], n, m, rp, tp, rows)


class Buffers:
    """A Case's state and output buffers as torch tensors on `device`, with pointer structs."""

    def __init__(self, case: Case, device: Any, extra_rows: int = 0, extra_tokens: int = 0):
        import torch

        self.torch = torch
        self.case = case
        dev = torch.device(device)
        t = lambda a: torch.from_numpy(np.array(a, copy=True)).to(dev)  # noqa: E731 (own copy)
        self.table, self.computed, self.last = t(case.table), t(case.computed), t(case.last)
        self.drafts, self.errors = t(case.drafts), torch.zeros(1, dtype=torch.int32, device=dev)
        self.plan = t(case.plan)
        R = case.padded_rows + extra_rows
        T = case.padded_tokens + extra_tokens
        z = lambda *s, dtype=torch.int32: torch.full(s, 7777, dtype=dtype, device=dev)  # noqa
        self.out = dict(
            input_ids=z(T), positions=z(T, dtype=torch.int64), slot_mapping=z(T, dtype=torch.int64),
            seq_lens=z(R), query_start_loc=z(R + 1), cu_seqlens_k=z(R + 1),
            block_table=z(R, case.width), logits_indices=z(R),
            spec_logits_indices=z(R, case.k + 1), meta=z(8),
        )
        self.result = z(_core.device_result_words(R, case.k))
        self.state = _core.DeviceSlotState(
            block_table=self.table.data_ptr(), computed=self.computed.data_ptr(),
            last_token=self.last.data_ptr(), drafts=self.drafts.data_ptr(),
            errors=self.errors.data_ptr(), num_slots=case.num_slots, width=case.width,
            k=case.k, block_size=case.block_size, plan_words=int(self.plan.numel()),
        )
        self.outputs = _core.DeviceStepInputs(**{k: v.data_ptr() for k, v in self.out.items()})

    def snapshot(self) -> dict[str, np.ndarray]:
        d = {k: v.cpu().numpy().copy() for k, v in self.out.items()}
        for name in ("table", "computed", "last", "drafts", "errors", "result"):
            d[name] = getattr(self, name).cpu().numpy().copy()
        return d
