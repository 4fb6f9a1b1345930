"""The serving simulator: the real Scheduler driven on a simulated clock.

Conversations arrive as a Poisson process; each turn is a request whose follow-up turn arrives
`think_time` seconds after it finishes. Every step the scheduler builds a batch, the clock
advances by the step-time model, and every row that emits gets the next token of its scripted
reply (the model "generates" the dataset's own reply, so a follow-up turn resends exactly the
conversation so far). The synchronous protocol, K = 0.

The recompute tax is read off the batches the scheduler builds, not from a formula: each request's
high-water mark is the end of the furthest position any of its rows has computed, and a row's
positions below that mark are computed again. With K = 0 only a re-admission after a preemption
schedules such positions (its re-prefill starts at the prefix-cache hits of that admission, so what
the cache gives back is never counted). A row whose slot starts afresh (``slot_reset``) for a
request seen before is a re-admission.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import SamplingParams, Scheduler, SchedulerConfig
from .workloads import Conversation

MIN_STEP = 1e-9  # the shortest step (a + b: one token, no context), so the clock advances


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds one forward step takes: ``a + b * tokens + c * sum(context_lens)``.

    The defaults stand for Llama-3-8B in bf16 on one H100-class GPU (an MI300X is close):
    ``a`` = 5 ms, reading the 16 GB of weights once per step at ~3.3 TB/s; ``b`` = 40 us per
    token, 16 GFLOP per token at ~400 TFLOP/s of dense bf16 actually reached; ``c`` = 40 ns per
    token of context, reading its 128 KiB of KV (32 layers x 8 KV heads x 128 x 2 x bf16) at
    ~3.3 TB/s."""

    a: float = 5e-3
    b: float = 40e-6
    c: float = 40e-9

    def __post_init__(self) -> None:
        # NaN or infinite constants made the simulated clock stand still (an endless loop) or
        # every figure NaN; a step that costs nothing never advances the clock either.
        for name in ("a", "b", "c"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"StepTimeModel.{name} must be a finite number >= 0, "
                                 f"got {value!r}")
        if self.a + self.b < MIN_STEP:
            raise ValueError(f"StepTimeModel: a + b must be at least {MIN_STEP:g} s (a step that "
                             "costs nothing never advances the clock)")

    def __call__(self, num_tokens: int, context_tokens: int) -> float:
        return self.a + self.b * num_tokens + self.c * context_tokens


@dataclass
class RequestRecord:
    conversation: int
    turn: int
    arrival: float
    priority: int
    prompt_len: int
    tenant: str = ""
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    cached_tokens: int = 0


@dataclass
class SimResult:
    label: str
    config: dict[str, Any]
    requests: list[RequestRecord]
    duration: float  # simulated seconds, first arrival to last finish
    steps: int
    stats: dict[str, Any]
    rate: float  # conversations per second offered (inf: all at once)
    computed_tokens: int = 0  # every row's scheduled tokens, all steps (the forward work)
    recomputed_tokens: int = 0  # of those, positions the request had computed before
    preempted_tokens: int = 0  # KV positions computed and then dropped by preemptions
    readmissions: int = 0  # admissions of a request that had been admitted before

    @property
    def recompute_tax(self) -> float:
        """Recomputed tokens as a share of all tokens computed."""
        return self.recomputed_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def _of(self, priority: int | None, tenant: str | None) -> list[RequestRecord]:
        return [r for r in self.requests if (priority is None or r.priority == priority)
                and (tenant is None or r.tenant == tenant)]

    def ttft(self, priority: int | None = None, tenant: str | None = None) -> np.ndarray:
        return np.array([r.first_token - r.arrival for r in self._of(priority, tenant)
                         if r.first_token is not None])

    def itl(self, priority: int | None = None, tenant: str | None = None) -> np.ndarray:
        gaps = [np.diff(r.token_times) for r in self._of(priority, tenant)
                if len(r.token_times) > 1]
        return np.concatenate(gaps) if gaps else np.zeros(0)

    def output_tokens_of(self, tenant: str) -> int:
        return sum(len(r.token_times) for r in self._of(None, tenant))

    @property
    def output_tokens(self) -> int:
        return sum(len(r.token_times) for r in self.requests)

    @property
    def throughput(self) -> float:
        """Output tokens per simulated second."""
        return self.output_tokens / self.duration if self.duration > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        return len(self.requests) / self.duration if self.duration > 0 else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return float(self.stats["prefix_hit_rate"])


def length_hints(conversations: list[Conversation], error: float, seed: int) -> list[list[int]]:
    """Each turn's length hint (SamplingParams.length_hint, what SJF orders by): 0, so that the
    exact reply length (the simulator's max_tokens) is the job size, when `error` is 0; else the
    reply length times exp(N(0, error)), at least 1: a length predictor's log-normal error. The
    same hints for every run of one seed."""
    if error == 0:
        return [[0] * len(c.turns) for c in conversations]
    rng = np.random.default_rng([seed, 2])
    return [[max(1, round(len(t.output) * math.exp(rng.normal(0.0, error)))) for t in c.turns]
            for c in conversations]


def simulate(conversations: list[Conversation], config: SchedulerConfig, *, rate: float,
             seed: int = 0, think_time: float = 1.0, step_time: StepTimeModel | None = None,
             label: str = "", progress: Callable[[int], None] | None = None,
             length_hint_error: float = 0.0) -> SimResult:
    """Runs every turn of `conversations` through a Scheduler built from `config`.
    `rate`: conversations per second (Poisson); `math.inf` offers them all at time 0 (the
    saturation throughput). `progress(n)` is called with the number of turns finished.
    Conversations' priorities are used under scheduling="priority" only; `length_hint_error`:
    see length_hints(). ValueError for a rate that is not positive (NaN included), a think time
    or hint error that is not a finite number >= 0."""
    if not isinstance(rate, (int, float)) or not rate > 0:
        raise ValueError(f"rate must be a positive number of conversations/s or math.inf, "
                         f"got {rate!r}")
    if not isinstance(think_time, (int, float)) or not math.isfinite(think_time) or think_time < 0:
        raise ValueError(f"think_time must be a finite number of seconds >= 0, got {think_time!r}")
    if (not isinstance(length_hint_error, (int, float)) or not math.isfinite(length_hint_error)
            or length_hint_error < 0):
        raise ValueError(f"length_hint_error must be a finite number >= 0, "
                         f"got {length_hint_error!r}")
    hints = length_hints(conversations, float(length_hint_error), seed)
    use_priority = config.scheduling == "priority"
    model = step_time or StepTimeModel()
    sched = Scheduler(config)
    rng = np.random.default_rng(seed)
    gaps = (np.zeros(len(conversations)) if np.isinf(rate)
            else rng.exponential(1.0 / rate, len(conversations)))
    arrivals: list[tuple[float, int, int, int]] = []  # (time, tie, conversation, turn)
    for i, t in enumerate(np.cumsum(gaps)):
        heapq.heappush(arrivals, (float(t), i, i, 0))
    tie = len(conversations)
    live: dict[int, RequestRecord] = {}
    outputs: dict[int, np.ndarray] = {}
    done: list[RequestRecord] = []
    next_id = 0
    clock = 0.0
    steps = 0
    sampled = np.zeros(config.max_num_seqs, np.int32)
    # Per request id (ids are 0, 1, ... in arrival order, one per turn): the end of the furthest
    # position computed (high-water mark), the end of the current admission's last row, and
    # whether it has been admitted (a row scheduled) before.
    num_turns = sum(len(c.turns) for c in conversations)
    high = np.zeros(num_turns, np.int64)
    extent = np.zeros(num_turns, np.int64)
    admitted = np.zeros(num_turns, bool)
    computed = recomputed = preempted = readmissions = 0
    while arrivals or live:
        while arrivals and arrivals[0][0] <= clock:
            t, _, c, k = heapq.heappop(arrivals)
            conv = conversations[c]
            turn = conv.turns[k]
            sched.add_request(next_id, turn.prompt,
                              SamplingParams(max_tokens=len(turn.output), ignore_eos=True,
                                             priority=conv.priority if use_priority else 0,
                                             length_hint=hints[c][k], tenant=conv.tenant),
                              arrival_time=t)
            live[next_id] = RequestRecord(c, k, t, conv.priority, len(turn.prompt), conv.tenant)
            outputs[next_id] = turn.output
            next_id += 1
        batch = sched.schedule(now=clock)
        for rej in sched.take_rejected():  # (workloads are sized to fit: never expected)
            raise RuntimeError(f"request {rej.request_id} rejected: {rej.reason}")
        if batch is None:
            if not arrivals:
                raise RuntimeError("requests are live but nothing can be scheduled")
            clock = max(clock, arrivals[0][0])
            continue
        clock += model(int(batch.num_tokens), int(np.asarray(batch.context_lens).sum()))
        steps += 1
        rows = int(batch.num_rows)
        ids = np.asarray(batch.req_ids)
        first = np.asarray(batch.num_cached_tokens, np.int64)  # each row's first position
        end = first + np.asarray(batch.num_scheduled_tokens)
        again = np.asarray(batch.slot_reset, bool) & admitted[ids]  # re-admissions
        if again.any():
            readmissions += int(again.sum())
            preempted += int(extent[ids[again]].sum())
        mark = high[ids]
        recomputed += int(np.clip(np.minimum(mark, end) - first, 0, None).sum())
        computed += int(batch.num_tokens)
        high[ids] = np.maximum(mark, end)
        extent[ids] = end
        admitted[ids] = True
        for i, (rid, emits) in enumerate(zip(batch.req_ids, batch.emits_token, strict=True)):
            if emits:
                rec = live[int(rid)]
                sampled[i] = outputs[int(rid)][len(rec.token_times)]
        for out in sched.update(batch, sampled[:rows]):
            rec = live[out.request_id]
            for _ in out.output_tokens:
                rec.token_times.append(clock)
            if rec.first_token is None:
                rec.first_token = clock
                rec.cached_tokens = out.num_cached_tokens
            if out.finished:
                rec.finish = clock
                done.append(live.pop(out.request_id))
                del outputs[out.request_id]
                conv = conversations[rec.conversation]
                if rec.turn + 1 < len(conv.turns):
                    tie += 1
                    heapq.heappush(arrivals, (clock + think_time, tie, rec.conversation,
                                              rec.turn + 1))
                if progress is not None:
                    progress(len(done))
    start = min((r.arrival for r in done), default=0.0)
    cfg = {name: getattr(config, name) for name in (
        "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
        "policy", "scheduling", "preemption_victim", "sjf_aging_rate",
        "admission_watermark_blocks", "tenant_weights", "cache_decode_blocks",
        "enable_prefix_caching")}
    cfg["length_hint_error"] = float(length_hint_error)
    return SimResult(label=label, config=cfg, requests=done, duration=clock - start, steps=steps,
                     stats=sched.stats(), rate=rate, computed_tokens=computed,
                     recomputed_tokens=recomputed, preempted_tokens=preempted,
                     readmissions=readmissions)
