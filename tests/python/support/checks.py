"""Checks of what the scheduler hands out: BatchRecord (a copy of one batch, since the scheduler
reuses its buffers), every batch against docs/api.md (dtypes, shapes, rows, positions, slots,
block tables and the block-table contract, the device plan replayed onto per-slot tables), and
the externally visible state a failed call must leave unchanged."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from atom_sched import NULL_BLOCK, Scheduler

from .fake_model import num_valid
from .oracle import cdiv, final_length

PER_ROW_INT32 = (
    "request_slots",
    "num_scheduled_tokens",
    "num_cached_tokens",
    "context_lens",
    "last_block_num_tokens",
    "top_ks",
    "state_slots",
)
PER_ROW_FLOAT32 = ("temperatures", "top_ps")
PER_ROW_BOOL = ("row_is_prefill", "emits_token", "row_exact")
PER_TOKEN = {"scheduled_tokens": np.int32, "positions": np.int64, "slot_mapping": np.int64}

def state_snapshot(sched: Scheduler) -> tuple:
    """The externally visible state a failed call must leave unchanged."""
    return (
        sched.num_waiting,
        sched.num_running,
        sched.num_free_blocks,
        sched.num_outstanding_batches,
        sched.has_unfinished_requests(),
        _plain(sched.stats()),
    )


def _plain(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, (list, tuple, np.ndarray)) else v) for k, v in d.items()}


def event_kind(ev: Any) -> str:
    """'BlockStored' / 'BlockRemoved' / 'AllBlocksCleared', whatever the binding's spelling."""
    k = getattr(ev, "kind", None)
    if k is None:
        k = type(ev).__name__
    s = re.sub(r"[^a-z]", "", str(getattr(k, "name", k)).lower())
    for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        if name.lower() in s:
            return name
    raise AssertionError(f"unknown KV event kind {k!r}")

@dataclass
class BatchRecord:
    """A copy of one batch (the scheduler reuses its buffers)."""

    id: int
    is_prefill: bool
    num_rows: int
    num_tokens: int
    num_spec_tokens: int
    req_ids: list[int]
    num_scheduled_tokens: list[int]
    num_cached_tokens: list[int]
    context_lens: list[int]
    row_is_prefill: list[bool]
    emits_token: list[bool]
    row_exact: list[bool]
    state_slots: list[int]
    positions: np.ndarray
    scheduled_tokens: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    spec_draft_tokens: np.ndarray
    cu_seqlens_q: np.ndarray
    accepted: list[int] = field(default_factory=list)
    step_output: list[tuple[int, list[int], str | None]] = field(default_factory=list)

    @staticmethod
    def of(b: Any) -> BatchRecord:
        return BatchRecord(
            id=int(b.id),
            is_prefill=bool(b.is_prefill),
            num_rows=int(b.num_rows),
            num_tokens=int(b.num_tokens),
            num_spec_tokens=int(b.num_spec_tokens),
            req_ids=[int(x) for x in b.req_ids],
            num_scheduled_tokens=[int(x) for x in b.num_scheduled_tokens],
            num_cached_tokens=[int(x) for x in b.num_cached_tokens],
            context_lens=[int(x) for x in b.context_lens],
            row_is_prefill=[bool(x) for x in b.row_is_prefill],
            emits_token=[bool(x) for x in b.emits_token],
            row_exact=[bool(x) for x in b.row_exact],
            state_slots=[int(x) for x in b.state_slots],
            positions=np.array(b.positions, copy=True),
            scheduled_tokens=np.array(b.scheduled_tokens, copy=True),
            slot_mapping=np.array(b.slot_mapping, copy=True),
            block_tables=np.array(b.block_tables, copy=True),
            spec_draft_tokens=np.array(b.spec_draft_tokens, copy=True),
            cu_seqlens_q=np.array(b.cu_seqlens_q, copy=True),
        )

    def row(self, rid: int) -> int:
        return self.req_ids.index(rid)

    def row_tokens(self, i: int) -> list[int]:
        s, e = int(self.cu_seqlens_q[i]), int(self.cu_seqlens_q[i + 1])
        return [int(x) for x in self.scheduled_tokens[s:e]]

    def row_positions(self, i: int) -> list[int]:
        s, e = int(self.cu_seqlens_q[i]), int(self.cu_seqlens_q[i + 1])
        return [int(x) for x in self.positions[s:e]]

    def summary(self) -> tuple:
        return (self.is_prefill, self.num_tokens, self.num_rows)



class BatchChecks:
    """The per-batch checks of the Driver (a mixin: they read the driver's config, pending
    batches, requests and device-slot replay state)."""

    def _check_batch(self, b: Any, rec: BatchRecord) -> None:
        n = rec.num_rows
        k = self.k
        assert n >= 1, "schedule() returned a batch without rows"
        assert isinstance(b.req_ids, np.ndarray)
        assert b.req_ids.dtype == np.int64 and b.req_ids.shape == (n,)
        for name in PER_ROW_INT32:
            a = getattr(b, name)
            assert a.dtype == np.int32 and a.shape == (n,), (name, a.dtype, a.shape)
        for name in PER_ROW_FLOAT32:
            a = getattr(b, name)
            assert a.dtype == np.float32 and a.shape == (n,), (name, a.dtype, a.shape)
        for name in PER_ROW_BOOL:
            a = getattr(b, name)
            assert a.dtype == np.bool_ and a.shape == (n,), (name, a.dtype, a.shape)
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            a = getattr(b, name)
            assert a.dtype == np.int32 and a.shape == (n + 1,), (name, a.dtype, a.shape)
        for name, dt in PER_TOKEN.items():
            a = getattr(b, name)
            assert a.dtype == dt and a.shape == (rec.num_tokens,), (name, a.dtype, a.shape)
        width = int(b.block_table_width)
        assert b.block_tables.dtype == np.int32 and b.block_tables.shape == (n, width)
        assert b.spec_draft_tokens.dtype == np.int32 and b.spec_draft_tokens.shape[0] == n
        # views(): the same arrays, in one call (a cached object: equal values, dtypes, shapes).
        views = b.views()
        for name, arr in views._asdict().items():
            attr = getattr(b, name)
            assert arr.dtype == attr.dtype and arr.shape == attr.shape, (name, arr.shape)
            assert np.array_equal(arr, attr) and not arr.flags.writeable, name
        assert len(set(rec.req_ids)) == n, "a request appears twice in one batch"
        assert int(b.total_tokens_num) == rec.num_tokens == sum(rec.num_scheduled_tokens)
        cu_q = [int(x) for x in b.cu_seqlens_q]
        cu_k = [int(x) for x in b.cu_seqlens_k]
        assert cu_q[0] == 0 and cu_k[0] == 0
        assert [cu_q[i + 1] - cu_q[i] for i in range(n)] == rec.num_scheduled_tokens
        assert [cu_k[i + 1] - cu_k[i] for i in range(n)] == rec.context_lens
        pairs = zip(rec.num_cached_tokens, rec.num_scheduled_tokens, strict=True)
        assert [c + s for c, s in pairs] == rec.context_lens
        assert int(b.max_seqlen_q) == max(rec.num_scheduled_tokens)
        assert int(b.max_seqlen_k) == max(rec.context_lens)
        # Row kinds: ATOM's policy never mixes them; a mixed batch has its decode rows first.
        kinds = rec.row_is_prefill
        assert rec.is_prefill == all(kinds), "is_prefill: every row is a prefill row"
        if self.sched_cfg.policy == "atom":
            assert len(set(kinds)) == 1, "ATOM's policy mixed prefill and decode rows"
        assert kinds == sorted(kinds), "a prefill row before a decode row"
        assert rec.num_spec_tokens == (0 if rec.is_prefill else k)
        assert b.spec_draft_tokens.shape == (n, rec.num_spec_tokens)
        for i in range(n):
            if kinds[i]:
                assert rec.num_scheduled_tokens[i] >= 1
                drafts = [int(x) for x in rec.spec_draft_tokens[i]]
                assert drafts == [-1] * rec.num_spec_tokens, ("a prefill row's drafts", drafts)
                continue
            assert rec.emits_token[i], "every decode row emits"
            # K+1 tokens (the last token and K drafts), fewer only where a position would
            # reach the limit; the drafts that were not scheduled read -1.
            c, w = rec.num_cached_tokens[i], rec.num_scheduled_tokens[i]
            want = min(k + 1, self.limit - c)
            known = self.model.last_drafts.get(rec.req_ids[i])
            if rec.row_exact[i] and known is not None:  # drafts known: only those proposed
                want = min(want, 1 + num_valid(known))
            assert w >= 1 and w == want, ("decode row width", rec.req_ids[i], w, want, c)
            rest = [int(x) for x in rec.spec_draft_tokens[i, w - 1 :]]
            assert rest == [-1] * (k + 1 - w), ("unscheduled drafts", rec.req_ids[i], rest)
        if n:
            # Every position is below min(max_model_len, the pool's positions) (a model's rotary
            # table has max_model_len rows).
            assert int(rec.positions.max()) < self.limit, ("position past the limit", self.limit)
        if self.mode == "sync":
            assert all(rec.row_exact), "synchronous protocol: every row is exact"
            assert (rec.scheduled_tokens >= 0).all(), "synchronous protocol: every token known"
        cfg = self.cfg
        if cfg is not None:
            bs = int(cfg.block_size)
            assert n <= cfg.max_num_seqs
            assert rec.num_tokens <= cfg.max_num_batched_tokens
            lbn = [int(x) for x in b.last_block_num_tokens]
            for i in range(n):
                L = rec.context_lens[i]
                assert lbn[i] == L - (cdiv(L, bs) - 1) * bs, ("last_block_num_tokens", i)
            slots: list[int] = []
            for i in range(n):
                # Rows that are not exact hold upper bounds, consistent among themselves.
                c, L = rec.num_cached_tokens[i], rec.context_lens[i]
                pos = rec.row_positions(i)
                assert pos == list(range(c, L)), ("positions", i, pos, c, L)
                s0 = int(rec.cu_seqlens_q[i])
                for j, p in enumerate(pos):
                    blk = int(rec.block_tables[i, p // bs])
                    assert NULL_BLOCK < blk < cfg.num_blocks, ("null block in use", i, p)
                    assert int(rec.slot_mapping[s0 + j]) == blk * bs + p % bs, ("slot", i, p)
                    slots.append(blk * bs + p % bs)
                nblk = cdiv(L, bs)
                used = [int(x) for x in rec.block_tables[i, :nblk]]
                assert len(set(used)) == nblk, ("a block twice in one table", i, used)
                assert NULL_BLOCK not in used, ("a row's position maps to the null block", i)
            assert len(set(slots)) == len(slots), "two tokens of one batch write the same KV slot"
            self._check_device_plan(b, rec, bs)
        for i, rid in enumerate(rec.req_ids):
            info = self.reqs.get(rid)
            if info is None:
                continue
            assert float(b.temperatures[i]) == pytest.approx(info.temperature)
            assert int(b.top_ks[i]) == info.top_k
            assert float(b.top_ps[i]) == pytest.approx(info.top_p)
            known = self.known(rid)
            toks = rec.row_tokens(i)
            if not kinds[i]:
                # No row for a request whose outputs in flight (each emits at least one token)
                # end it by a length rule: it would be discarded (docs/api.md, policy item 4).
                inflight = self._inflight_rows(rid)
                end = final_length(info, self.sched_cfg)
                assert not inflight or len(known) + inflight < end, (
                    f"wasted row: request {rid} has {len(known)} tokens and {inflight} rows in "
                    f"flight, which end it at {end}"
                )
            if kinds[i]:
                c, L = rec.num_cached_tokens[i], rec.context_lens[i]
                assert L <= len(known), "prefill beyond the known tokens"
                assert toks == known[c:L], ("prefill tokens", rid, toks, known[c:L])
                assert rec.emits_token[i] == (L == len(known)), ("emits_token", rid)
                continue
            if not rec.row_exact[i]:
                continue
            pos = rec.row_positions(i)
            for j, (p, t) in enumerate(zip(pos, toks, strict=True)):
                if self.mode == "sync":
                    if j == 0:
                        assert p == len(known) - 1, ("decode position", rid, p, len(known))
                        assert t == known[-1], ("decode input", rid, t, known[-1])
                    else:
                        d = self.model.last_drafts[rid][j - 1]
                        assert t == d, ("draft input", rid, j, t, d)
                        assert int(b.spec_draft_tokens[i, j - 1]) == d
                elif t != -1 and p < len(known):
                    assert t == known[p], ("decode input", rid, p, t, known[p])
                elif k == 0:
                    assert t == -1, ("a token the host cannot know", rid, p, t)

    def _inflight_rows(self, rid: int) -> int:
        """Rows of `rid` in the outstanding batches whose outputs the scheduler will keep (a
        prefill row restarts the count: the rows before a re-prefill were discarded)."""
        count = 0
        for _, _, r in self.pending:
            if rid not in r.req_ids:
                continue
            i = r.row(rid)
            if r.row_is_prefill[i]:
                count = int(r.emits_token[i])
            else:
                count += 1
        return count

    def _check_device_plan(self, b: Any, rec: BatchRecord, bs: int) -> None:
        """Replays the batch's device plan onto per-slot tables, as the device would, and checks
        that every row's slot table then equals its block_tables row."""
        n = rec.num_rows
        slots = [int(x) for x in b.request_slots]
        reset = [bool(x) for x in b.slot_reset]
        starts = [int(x) for x in b.new_block_starts]
        offs = [int(x) for x in b.new_block_offsets]
        ids = [int(x) for x in b.new_block_ids]
        assert b.slot_reset.dtype == np.bool_ and b.slot_reset.shape == (n,)
        assert b.new_block_starts.dtype == np.int32 and b.new_block_starts.shape == (n,)
        assert b.new_block_offsets.dtype == np.int32 and b.new_block_offsets.shape == (n + 1,)
        assert b.new_block_ids.dtype == np.int32 and b.new_block_ids.shape == (offs[-1],)
        assert offs[0] == 0 and all(offs[i] <= offs[i + 1] for i in range(n))
        assert len(set(slots)) == n, "two rows share a device slot"
        assert self.cfg is not None
        for i, rid in enumerate(rec.req_ids):
            slot = slots[i]
            assert 0 <= slot < self.cfg.max_num_seqs, ("request_slots out of range", slot)
            if reset[i]:
                table: list[int] = []
            else:
                assert self.device_slot_of.get(rid) == slot, (
                    f"request {rid} moved from device slot {self.device_slot_of.get(rid)} to "
                    f"{slot} without a slot reset"
                )
                table = self.device_tables[slot]
            assert 0 <= starts[i] <= len(table), ("new_block_starts", rid, starts[i], len(table))
            table = table[: starts[i]] + ids[offs[i] : offs[i + 1]]
            self.device_tables[slot] = table
            self.device_slot_of[rid] = slot
            need = cdiv(rec.context_lens[i], bs)
            assert len(table) >= need, ("device table too short", rid, table, need)
            row = [int(x) for x in rec.block_tables[i]]
            assert row[: len(table)] == table, ("device table != block_tables row", rid)
            assert all(x == NULL_BLOCK for x in row[len(table) :]), ("block_tables padding", rid)

