"""Shared helpers for the atom_sched pytest suites.

* ``FakeModel``: a deterministic stand-in for the model. The token a request generates as its g-th
  output (g = 0 for the token sampled after its prefill) is ``token(rid, g)``, a hash of
  ``(seed, rid, g)`` mapped into ``[10, 10 + vocab)``: never EOS, never a small "special" id unless
  a test scripts it through ``overrides``. With K > 0 drafts the number of accepted tokens of a
  decode row is ``accepted(rid, g)``, capped at the row's width (K+1, fewer near the position
  limit: no draft past it is scheduled, so none can be accepted). Tokens depend only on the
  request id and on the number of tokens the request has generated so far, which the model
  tracks itself as the device would (``gen``), so a synchronous and a one-step-ahead run must
  stream exactly the same tokens (how many per step may differ near the limit, where a row one
  step ahead starts from an upper bound and so may be narrower).
* ``Driver``: runs a Scheduler with a FakeModel, synchronously or one step ahead (schedule t+1
  before update t, at most two batches outstanding), calls ``check_invariants()`` after every
  schedule and update, checks every batch against docs/api.md, and collects each request's
  streamed tokens, log-probabilities, finish reason and cached-token count.
* ``expected_output``: an oracle for a request's complete output and finish reason under the fixed
  stop semantics of docs/api.md (earliest stop wins, stop sequences over generated tokens only,
  then the length rules max_tokens, max_model_len, kv_capacity).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

# A module missing these must fail every suite loudly, never skip it.
from atom_sched import NULL_BLOCK, SamplingParams, Scheduler, SchedulerConfig

MASK64 = (1 << 64) - 1

# The ids the fake model never produces on its own (tests script them through overrides).
EOS = 1

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
PER_ROW_BOOL = ("emits_token", "row_exact")
PER_TOKEN = {"scheduled_tokens": np.int32, "positions": np.int64, "slot_mapping": np.int64}


def _mix(*xs: int) -> int:
    """A small deterministic 64-bit mixer (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & MASK64)) & MASK64
        h = (h + 0x9E3779B97F4A7C15) & MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK64
        h ^= h >> 31
    return h


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_config(num_blocks: int = 64, **kw: Any) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=num_blocks, **kw)


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


# ---------------------------------------------------------------------------------------------
# The fake model
# ---------------------------------------------------------------------------------------------


class FakeModel:
    """Deterministic outputs keyed by (request id, tokens generated so far)."""

    def __init__(
        self,
        k: int = 0,
        *,
        seed: int = 0,
        vocab: int = 1000,
        overrides: dict[tuple[int, int], int] | None = None,
        accept: int | Callable[[int, int], int] | None = None,
        logprobs: bool = False,
        two_d: bool = False,
        rejected_fill: int = -1,
    ) -> None:
        self.k = k
        self.seed = seed
        self.vocab = vocab
        self.overrides = dict(overrides or {})
        self.accept = accept
        self.logprobs = logprobs
        self.two_d = two_d  # K == 0: pass sampled tokens as (n, 1) instead of (n,)
        self.rejected_fill = rejected_fill
        self.gen: dict[int, int] = defaultdict(int)  # device-side generated count
        self.last_drafts: dict[int, list[int]] = {}
        self.calls = 0

    # -- values ---------------------------------------------------------------------------------
    def token(self, rid: int, g: int) -> int:
        t = self.overrides.get((rid, g))
        if t is not None:
            return t
        return _mix(self.seed, rid, g, 1) % self.vocab + 10

    def sequence(self, rid: int, n: int) -> list[int]:
        return [self.token(rid, g) for g in range(n)]

    def accepted(self, rid: int, g: int) -> int:
        if self.k == 0:
            return 1
        if self.accept is None:
            a = _mix(self.seed, rid, g, 2) % (self.k + 1) + 1
        elif callable(self.accept):
            a = self.accept(rid, g)
        else:
            a = self.accept
        assert 1 <= a <= self.k + 1
        return a

    def draft(self, rid: int, g: int, j: int) -> int:
        return _mix(self.seed, rid, g, j, 3) % self.vocab + 10

    def logprob(self, rid: int, g: int) -> float:
        # Multiples of 1/256 in (-4, 0]: exact in float32.
        return -float(_mix(self.seed, rid, g, 4) % 1024) / 256.0

    def reset(self, rid: int) -> None:
        self.gen[rid] = 0
        self.last_drafts.pop(rid, None)

    # -- one forward ----------------------------------------------------------------------------
    def run(self, rec: BatchRecord) -> dict[str, Any]:
        """The update() keyword arguments for the batch `rec` (advances the device-side counts)."""
        self.calls += 1
        k = self.k
        n = rec.num_rows
        w = 1 if k == 0 else k + 1
        sampled = np.full((n, w), self.rejected_fill, dtype=np.int32)
        acc = np.ones(n, dtype=np.int32)
        drafts = np.zeros((n, k), dtype=np.int32)
        lps = np.zeros((n, w), dtype=np.float32)
        rec.accepted = [0] * n
        for i, rid in enumerate(rec.req_ids):
            rid = int(rid)
            if not rec.emits_token[i]:
                sampled[i, :] = 0
                continue
            g = self.gen[rid]
            # A row near the position limit carries fewer than K+1 tokens: at most that many.
            a = 1 if rec.is_prefill else min(self.accepted(rid, g), rec.num_scheduled_tokens[i])
            for j in range(a):
                sampled[i, j] = self.token(rid, g + j)
                lps[i, j] = self.logprob(rid, g + j)
            acc[i] = a
            rec.accepted[i] = a
            self.gen[rid] = g + a
            d = [self.draft(rid, g + a, j) for j in range(k)]
            drafts[i, :] = d
            self.last_drafts[rid] = d
        out: dict[str, Any] = {}
        out["sampled_token_ids"] = sampled if (k > 0 or self.two_d) else sampled[:, 0].copy()
        if k > 0:
            out["draft_token_ids"] = drafts
            if not rec.is_prefill:
                out["num_accepted"] = acc
        if self.logprobs:
            out["logprobs"] = lps if (k > 0 or self.two_d) else lps[:, 0].copy()
        return out


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


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


@dataclass
class ReqInfo:
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    stop_ids: list[int]
    stop_seqs: list[list[int]]
    logprobs: bool
    temperature: float
    top_k: int
    top_p: float


def _req_info(prompt: list[int], sp: SamplingParams | None) -> ReqInfo:
    sp = sp if sp is not None else SamplingParams()
    return ReqInfo(
        prompt=list(prompt),
        max_tokens=int(sp.max_tokens),
        ignore_eos=bool(sp.ignore_eos),
        stop_ids=[int(x) for x in sp.stop_token_ids],
        stop_seqs=[[int(x) for x in s] for s in sp.stop_token_sequences],
        logprobs=bool(sp.logprobs),
        temperature=float(sp.temperature),
        top_k=int(sp.top_k),
        top_p=float(sp.top_p),
    )


def expected_output(
    model: FakeModel, rid: int, info: ReqInfo, cfg: SchedulerConfig
) -> tuple[list[int], str]:
    """The full output and finish reason of request `rid` under docs/api.md's stop semantics."""
    stop_ids = set(int(x) for x in cfg.stop_token_ids) | set(info.stop_ids)
    eos = int(cfg.eos_token_id)
    max_len = int(cfg.max_model_len)
    pool_positions = usable_blocks(cfg) * int(cfg.block_size)
    out: list[int] = []
    g = 0
    while True:
        t = model.token(rid, g)
        out.append(t)
        g += 1
        if any(len(out) >= len(s) and out[-len(s) :] == s for s in info.stop_seqs):
            return out, "stop_sequence"
        if eos >= 0 and t == eos and not info.ignore_eos:
            return out, "eos"
        if t in stop_ids:
            return out, f"stop_{t}"
        if len(out) >= info.max_tokens:
            return out, "max_tokens"
        if len(info.prompt) + len(out) >= max_len:
            return out, "max_model_len"
        if len(info.prompt) + len(out) > pool_positions:
            return out, "kv_capacity"


def usable_blocks(cfg: SchedulerConfig) -> int:
    """Blocks requests can hold: all ids but the null block (docs/design.md, block-table
    contract)."""
    return int(cfg.num_blocks) - 1


def final_length(info: ReqInfo, cfg: SchedulerConfig) -> int:
    """The token count at which a length rule (max_tokens, max_model_len, kv_capacity) ends a
    request, whatever its tokens."""
    return min(
        len(info.prompt) + info.max_tokens,
        int(cfg.max_model_len),
        usable_blocks(cfg) * int(cfg.block_size) + 1,
    )


def position_limit(cfg: SchedulerConfig) -> int:
    """Every scheduled position is below this: min(max_model_len, the pool's positions)."""
    return min(int(cfg.max_model_len), usable_blocks(cfg) * int(cfg.block_size))


def rejection_reason(n: int, cfg: SchedulerConfig) -> str | None:
    """ATOM's static rejection of a prompt of `n` tokens (docs/api.md policy item 5)."""
    if n > cfg.max_model_len:
        return (
            f"unschedulable: input tokens={n} > max_model_len={cfg.max_model_len}. "
            "Increase max_model_len or shorten the prompt."
        )
    if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
        return (
            f"unschedulable: input tokens={n} > max_num_batched_tokens="
            f"{cfg.max_num_batched_tokens}. Increase max_num_batched_tokens, enable chunked "
            "prefill, or shorten the prompt."
        )
    nb = cdiv(n, cfg.block_size)
    if nb > usable_blocks(cfg):
        return (
            f"unschedulable: needs {nb} KV blocks for {n} input tokens > the pool's "
            f"{usable_blocks(cfg)} (num_blocks={cfg.num_blocks} less the null block). Shorten the "
            "prompt or increase num_blocks."
        )
    return None


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


class Driver:
    """Runs a Scheduler with a FakeModel and checks everything it can along the way."""

    def __init__(
        self,
        sched: Scheduler,
        model: FakeModel,
        mode: str = "sync",
        check: bool = True,
        cfg: SchedulerConfig | None = None,
        now: Callable[[int], float | None] | None = None,
    ) -> None:
        assert mode in ("sync", "async")
        self.sched = sched
        self.model = model
        self.mode = mode
        self.check = check
        self.cfg = cfg
        self.k = model.k if cfg is None else int(cfg.num_speculative_tokens)
        assert self.k == model.k, "model and config disagree on K"
        # The scheduler's own config (the row-width and length rules need it even without cfg).
        self.sched_cfg: SchedulerConfig = sched.config
        self.limit = position_limit(self.sched_cfg)
        self.now = now
        self.pending: deque[tuple[Any, dict[str, Any], BatchRecord]] = deque()
        self.reqs: dict[int, ReqInfo] = {}
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.logprobs: dict[int, list[float]] = defaultdict(list)
        self.chunks: dict[int, list[list[int]]] = defaultdict(list)
        self.reasons: dict[int, str] = {}
        self.finish_count: Counter[int] = Counter()
        self.rejected: dict[int, str] = {}
        self.aborted: set[int] = set()
        self.cached_first: dict[int, int] = {}
        self.cached_last: dict[int, int] = {}
        self.batches: list[BatchRecord] = []
        self.iterations = 0
        self.max_running = 0
        # The device side of the plan: each device slot's block table, rebuilt from the batches'
        # slot_reset / new_block_starts / new_block_offsets / new_block_ids only.
        self.device_tables: dict[int, list[int]] = {}
        self.device_slot_of: dict[int, int] = {}
        # Optional callbacks (fault injection): fn(driver, batch, outputs, record).
        self.pre_update: Callable[..., None] | None = None
        self.post_update: Callable[..., None] | None = None

    # -- requests -------------------------------------------------------------------------------
    def add(
        self,
        rid: int,
        prompt: list[int] | np.ndarray,
        sp: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        kw: dict[str, Any] = {}
        if arrival_time is not None:
            kw["arrival_time"] = arrival_time
        self.sched.add_request(rid, prompt, sp, **kw)
        self.reqs[rid] = _req_info([int(x) for x in prompt], sp)
        self.model.reset(rid)
        for d in (self.tokens, self.logprobs, self.chunks):
            d.pop(rid, None)
        for d2 in (self.reasons, self.rejected, self.cached_first, self.cached_last):
            d2.pop(rid, None)
        self.finish_count.pop(rid, None)
        self.aborted.discard(rid)
        self._check()

    def abort(self, rid: int) -> None:
        self.sched.abort_request(rid)
        self.aborted.add(rid)
        self._check()

    def is_live(self, rid: int) -> bool:
        return (
            rid in self.reqs
            and rid not in self.reasons
            and rid not in self.rejected
            and rid not in self.aborted
        )

    def known(self, rid: int) -> list[int]:
        return self.reqs[rid].prompt + self.tokens[rid]

    # -- protocol -------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.check:
            self.sched.check_invariants()

    def schedule(self, allow_prefill: bool = True, now: float | None = None) -> BatchRecord | None:
        if now is None and self.now is not None:
            now = self.now(self.iterations)
        kw: dict[str, Any] = {"allow_prefill": allow_prefill}
        if now is not None:
            kw["now"] = now
        info = None
        if self.check and allow_prefill and now is None:
            info = tuple(self.sched.get_next_batch_info())
        b = self.sched.schedule(**kw)
        self._check()
        for r in self.sched.take_rejected():
            rid = int(r.request_id)
            assert rid not in self.rejected, f"request {rid} rejected twice"
            self.rejected[rid] = r.reason
        self.max_running = max(self.max_running, self.sched.num_running)
        if self.cfg is not None:
            assert self.sched.num_running <= self.cfg.max_num_seqs, "running set over max_num_seqs"
        if b is None:
            if info is not None:
                assert info == (False, 0, 0), f"get_next_batch_info {info} but schedule() -> None"
            return None
        rec = BatchRecord.of(b)
        if self.check:
            if info is not None:
                assert (bool(info[0]), int(info[1]), int(info[2])) == rec.summary(), (
                    f"get_next_batch_info {info} != schedule() {rec.summary()}"
                )
            self._check_batch(b, rec)
        outputs = self.model.run(rec)
        self.pending.append((b, outputs, rec))
        self.batches.append(rec)
        return rec

    def update(self) -> Any:
        b, outputs, rec = self.pending.popleft()
        if self.pre_update is not None:
            self.pre_update(self, b, outputs, rec)
        so = self.sched.update(b, **outputs)
        self._check()
        self._record(so, rec)
        if self.post_update is not None:
            self.post_update(self, b, outputs, rec)
        return so

    def step(self, allow_prefill: bool = True) -> bool:
        """One iteration of the chosen protocol. Returns whether anything happened."""
        self.iterations += 1
        if self.mode == "sync":
            if self.pending:  # a test scheduled by hand: finish that step first
                self.update()
                return True
            rec = self.schedule(allow_prefill)
            if rec is None:
                return False
            self.update()
            return True
        # One step ahead: schedule t+1, then update t.
        rec = self.schedule(allow_prefill) if len(self.pending) < 2 else None
        if len(self.pending) == 2 or (rec is None and self.pending):
            self.update()
            return True
        return rec is not None

    def busy(self) -> bool:
        return bool(self.pending) or self.sched.has_unfinished_requests()

    def run(
        self,
        hook: Callable[[Driver, int], bool] | None = None,
        max_iters: int = 20000,
        allow_prefill: bool | Callable[[int], bool] = True,
    ) -> Driver:
        """Iterates until nothing is left. `hook(driver, iteration)` runs before every iteration
        (to add or abort requests) and returns whether it still has work to inject.
        `allow_prefill` may be a function of the iteration (a data-parallel veto)."""
        idle = 0
        for it in range(max_iters):
            more = hook(self, it) if hook is not None else False
            if not self.busy():
                if more:
                    continue
                break
            ap = allow_prefill(it) if callable(allow_prefill) else allow_prefill
            num_rejected = len(self.rejected)
            progressed = self.step(ap) or len(self.rejected) > num_rejected
            idle = 0 if (progressed or not ap) else idle + 1
            assert idle < 4 or more, (
                f"no progress: waiting={self.sched.num_waiting} running={self.sched.num_running} "
                f"free={self.sched.num_free_blocks}"
            )
        else:
            raise AssertionError(f"did not finish in {max_iters} iterations")
        if self.check:
            assert not self.pending
            assert self.sched.num_outstanding_batches == 0
        return self

    # -- checks ---------------------------------------------------------------------------------
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
        if rec.is_prefill:
            assert rec.num_spec_tokens == 0
            assert all(s >= 1 for s in rec.num_scheduled_tokens)
        else:
            assert rec.num_spec_tokens == k
            assert all(rec.emits_token), "every decode row emits"
            assert b.spec_draft_tokens.shape == (n, k)
            for i in range(n):
                # K+1 tokens (the last token and K drafts), fewer only where a position would
                # reach the limit; the drafts that were not scheduled read -1.
                c, w = rec.num_cached_tokens[i], rec.num_scheduled_tokens[i]
                want = min(k + 1, self.limit - c)
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
            if not rec.is_prefill:
                # No row for a request whose outputs in flight (each emits at least one token)
                # end it by a length rule: it would be discarded (docs/api.md, policy item 4).
                inflight = self._inflight_rows(rid)
                end = final_length(info, self.sched_cfg)
                assert not inflight or len(known) + inflight < end, (
                    f"wasted row: request {rid} has {len(known)} tokens and {inflight} rows in "
                    f"flight, which end it at {end}"
                )
            if rec.is_prefill:
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
            if r.is_prefill:
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

    def _record(self, so: Any, rec: BatchRecord) -> None:
        outs = so.outputs()
        n = len(outs)
        assert len(so) == n
        rids = so.request_ids
        offs = so.token_offsets
        new = so.new_tokens
        fin = so.finished
        if self.check:
            assert rids.dtype == np.int64 and rids.shape == (n,)
            assert offs.dtype == np.int32 and offs.shape == (n + 1,)
            assert new.dtype == np.int32 and new.shape == (int(offs[-1]) if n else 0,)
            assert fin.dtype == np.bool_ and fin.shape == (n,)
            assert [o.request_id for o in so] == [o.request_id for o in outs]
        seen: set[int] = set()
        for i, o in enumerate(outs):
            rid = int(o.request_id)
            toks = [int(t) for t in o.output_tokens]
            if self.check:
                assert int(rids[i]) == rid
                assert toks == [int(t) for t in new[int(offs[i]) : int(offs[i + 1])]]
                assert bool(fin[i]) == bool(o.finished)
                assert rid not in seen, f"request {rid} twice in one StepOutput"
                assert rid not in self.reasons, f"output for request {rid} after it finished"
                assert rid not in self.aborted, f"output for aborted request {rid}"
                assert o.finished == (o.finish_reason is not None)
                assert toks or o.finished, f"empty, unfinished output for {rid}"
                g0 = len(self.tokens[rid])
                assert toks == self.model.sequence(rid, g0 + len(toks))[g0:], (
                    f"request {rid}: streamed {toks} at {g0}, model says "
                    f"{self.model.sequence(rid, g0 + len(toks))[g0:]}"
                )
                info = self.reqs.get(rid)
                if o.logprobs is not None:
                    lp = [float(x) for x in o.logprobs]
                    assert len(lp) == len(toks), f"logprobs misaligned for {rid}"
                    if self.model.logprobs:
                        exp = [self.model.logprob(rid, g0 + j) for j in range(len(toks))]
                        assert lp == exp, (rid, lp, exp)
                elif info is not None and info.logprobs and self.model.logprobs:
                    raise AssertionError(f"request {rid} asked for logprobs, got None")
            seen.add(rid)
            self.tokens[rid].extend(toks)
            self.chunks[rid].append(toks)
            if o.logprobs is not None:
                self.logprobs[rid].extend(float(x) for x in o.logprobs)
            self.cached_first.setdefault(rid, int(o.num_cached_tokens))
            self.cached_last[rid] = int(o.num_cached_tokens)
            if o.finished:
                self.reasons[rid] = o.finish_reason
                self.finish_count[rid] += 1
            rec.step_output.append((rid, toks, o.finish_reason))

    # -- end-of-run checks ----------------------------------------------------------------------
    def check_all_done(self) -> None:
        """Every request ended exactly once; nothing is held any more."""
        for rid in self.reqs:
            ends = (
                (rid in self.reasons) + (rid in self.rejected) + (rid in self.aborted)
            )
            assert ends == 1, (
                f"request {rid}: finished={self.reasons.get(rid)} rejected={rid in self.rejected}"
                f" aborted={rid in self.aborted}"
            )
            assert self.finish_count[rid] <= 1
        assert not self.sched.has_unfinished_requests()
        assert self.sched.num_waiting == 0 and self.sched.num_running == 0
        if self.cfg is not None:
            assert self.sched.num_free_blocks == usable_blocks(self.cfg), "KV blocks leaked"

    def check_against_oracle(self) -> None:
        """Finished requests streamed exactly what the oracle says; rejections are ATOM's."""
        assert self.cfg is not None
        for rid, info in self.reqs.items():
            if rid in self.aborted:
                assert self.tokens[rid] == self.model.sequence(rid, len(self.tokens[rid]))
                continue
            reason = rejection_reason(len(info.prompt), self.cfg)
            if reason is not None:
                assert self.rejected.get(rid) == reason, (rid, self.rejected.get(rid), reason)
                assert not self.tokens[rid]
                continue
            exp_tokens, exp_reason = expected_output(self.model, rid, info, self.cfg)
            assert self.tokens[rid] == exp_tokens, (rid, self.tokens[rid], exp_tokens)
            assert self.reasons.get(rid) == exp_reason, (rid, self.reasons.get(rid), exp_reason)

    def results(self) -> dict[int, tuple[list[int], str | None]]:
        out: dict[int, tuple[list[int], str | None]] = {}
        for rid in self.reqs:
            if rid in self.rejected:
                out[rid] = ([], self.rejected[rid])
            elif rid in self.aborted:
                out[rid] = (list(self.tokens[rid]), "abort")
            else:
                out[rid] = (list(self.tokens[rid]), self.reasons.get(rid))
        return out


def make_driver(
    mode: str = "sync",
    model: FakeModel | None = None,
    check: bool = True,
    now: Callable[[int], float | None] | None = None,
    **cfg_kw: Any,
) -> Driver:
    cfg = make_config(**cfg_kw)
    sched = Scheduler(cfg)
    if model is None:
        model = FakeModel(int(cfg.num_speculative_tokens))
    return Driver(sched, model, mode=mode, check=check, cfg=cfg, now=now)


def drive(
    sched: Scheduler,
    model: FakeModel,
    mode: str = "sync",
    check: bool = True,
    cfg: SchedulerConfig | None = None,
    prompts: dict[int, tuple[list[int], SamplingParams | None]] | None = None,
    hook: Callable[[Driver, int], bool] | None = None,
) -> Driver:
    """Runs `sched` (with `prompts` added through the driver) to completion; returns the Driver,
    whose `tokens`, `reasons`, `rejected`, `chunks`, `logprobs` and `batches` hold the run."""
    d = Driver(sched, model, mode=mode, check=check, cfg=cfg)
    for rid, (prompt, sp) in (prompts or {}).items():
        d.add(rid, prompt, sp)
    return d.run(hook=hook)


def sp(**kw: Any) -> SamplingParams:
    return SamplingParams(**kw)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


__all__ = [
    "EOS",
    "BatchRecord",
    "Driver",
    "FakeModel",
    "cdiv",
    "drive",
    "event_kind",
    "expected_output",
    "final_length",
    "make_config",
    "make_driver",
    "position_limit",
    "prompt",
    "rejection_reason",
    "sp",
    "state_snapshot",
]
