"""The driver: runs a Scheduler with a FakeModel, synchronously or one step ahead (schedule t+1
before update t, at most two batches outstanding), calls ``check_invariants()`` after every
schedule and update, checks every batch against docs/api.md (support/checks.py), and collects each
request's streamed tokens, log-probabilities, finish reason and cached-token count."""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from atom_sched import SamplingParams, Scheduler, SchedulerConfig

from .checks import BatchChecks, BatchRecord
from .fake_model import FakeModel
from .oracle import (
    ReqInfo,
    expected_output,
    position_limit,
    rejection_reason,
    req_info,
    usable_blocks,
)


def make_config(num_blocks: int = 64, **kw: Any) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=num_blocks, **kw)


class Driver(BatchChecks):
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
        self.reqs[rid] = req_info([int(x) for x in prompt], sp)
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

    def _record(self, so: Any, rec: BatchRecord) -> None:
        outs = so.outputs()
        n = len(outs)
        assert len(so) == n
        rids = so.request_ids
        offs = so.token_offsets
        new = so.new_tokens
        fin = so.finished
        cached = so.num_cached_tokens
        if self.check:
            assert cached.dtype == np.int32 and cached.shape == (n,)
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
                # The flat accessors an engine streams from agree with the objects.
                assert so.finish_reason(i) == o.finish_reason
                assert int(cached[i]) == o.num_cached_tokens
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


def admission_order(d: Driver) -> list[int]:
    """Request ids in the order their first prefill row was scheduled."""
    seen: list[int] = []
    for b in d.batches:
        for rid, cached in zip(b.req_ids, b.num_cached_tokens, strict=True):
            if b.is_prefill and cached == 0 and rid not in seen:
                seen.append(rid)
    return seen


def sp(**kw: Any) -> SamplingParams:
    return SamplingParams(**kw)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))
