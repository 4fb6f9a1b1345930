"""Stand-ins for what AMD ATOM's engine hands its scheduler, written from
shared/spec/atom-scheduler-behaviour.md (no ATOM code): the ``Sequence`` with its enums and
sampling fields (spec 1), the ``Config`` attributes the scheduler reads (spec 3.1), a
``FakeRunner`` that consumes each ``ScheduledBatch`` the way ATOM's ModelRunner does (spec 6:
deferred outputs, host placeholders subtracted with the fresh ``num_rejected``, slot mappings from
the block tables) and an ``engine_loop`` shaped like ATOM's EngineCore step (spec 5.6).

The runner keeps a fake KV cache (slot -> token) and checks, for every row, that each position it
reads before its own inputs holds the request's true token: a wrong context length, position,
block table or input token fails the test where it happens. Its tokens come from the fake model
as functions of the position (``model.token(rid, p - P)`` is the token at position p of a
request with a P-token prompt), so any correct schedule yields the oracle's output; its drafts
are the true tokens as far as the model will accept them.
"""

from __future__ import annotations

import enum
import itertools
import queue
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .fake_model import FakeModel


class SequenceStatus(enum.Enum):
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()
    EXIT_ENGINE = enum.auto()


class SequenceType(enum.Enum):
    DUMMY = enum.auto()
    PREFILL = enum.auto()
    DECODE = enum.auto()


@dataclass
class AtomSamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_strings: list[str] | None = None
    n: int = 1
    logprobs: bool | int | None = None


class Sequence:
    """ATOM's Sequence fields the scheduler and the engine use (spec 1.3)."""

    counter = itertools.count()

    def __init__(self, token_ids: list[int], block_size: int,
                 sampling_params: AtomSamplingParams | None = None,
                 stop_token_sequences: list[list[int]] | None = None,
                 id: int | None = None) -> None:  # noqa: A002 - ATOM's name
        sp = sampling_params or AtomSamplingParams()
        self.id = id or next(Sequence.counter)
        self.block_size = block_size
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_tokens = len(token_ids)
        self.status = SequenceStatus.WAITING
        self.type = SequenceType.DUMMY
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.temperature, self.top_k, self.top_p = sp.temperature, sp.top_k, sp.top_p
        self.max_tokens, self.ignore_eos = sp.max_tokens, sp.ignore_eos
        self.stop_strings = sp.stop_strings
        self.stop_token_sequences = stop_token_sequences or []
        self.return_logprobs = bool(sp.logprobs)
        self.logprobs: list[float] = []
        self.output_tokens: list[int] = []
        self.num_rejected = 0
        self.num_bonus_tokens = 0
        self.spec_token_ids = np.zeros(0, np.int32)
        self.kv_transfer_params: dict[str, Any] | None = None
        self.kv_transfer_params_output: dict[str, Any] | None = None
        self.is_first_decode = False
        self.needs_independent_noise = False
        self.external_request_id: Any = None
        self.arrive_time = 0.0
        self.first_token_time = 0.0
        self.leave_time = 0.0
        self.leave_reason = ""

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @num_tokens.setter
    def num_tokens(self, n: int) -> None:
        self._num_tokens = n
        self.num_blocks = -(-n // self.block_size)
        self.last_block_num_tokens = n - (self.num_blocks - 1) * self.block_size

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_tokens]


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int


@dataclass
class Config:
    num_kvcache_blocks: int
    kv_cache_block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    bos_token_id: int = 0
    eos_token_id: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    scheduler_delay_factor: float = 0.0
    speculative_config: SpeculativeConfig | None = None
    kv_events_config: Any = None
    kv_transfer_config: Any = None
    enable_tbo: bool = False


class FakeRunner:
    """ATOM's ModelRunner on a fake KV cache (see the module docstring). ``deferred``: each
    ``forward`` returns the previous forward's outputs, as ATOM's production runner does."""

    def __init__(self, model: FakeModel, k: int, prompts: dict[int, list[int]],
                 block_size: int, deferred: bool, output_type: Any) -> None:
        self.model, self.k, self.prompts = model, k, prompts
        self.bs, self.deferred = block_size, deferred
        self.output_type = output_type  # ScheduledBatchOutput of the module under test
        self.kv: dict[int, int] = {}
        self.prev: tuple[list[int], list[tuple]] | None = None
        self.gpu: dict[int, tuple[int, list[int], int]] = {}  # rid -> (last, drafts, rejected)
        self.forwards = 0
        self.dummies = 0  # dummy batches run (ATOM's dummy_execution)
        self.rows_checked = 0

    def truth(self, rid: int, p: int) -> int:
        prompt = self.prompts[rid]
        return prompt[p] if p < len(prompt) else self.model.token(rid, p - len(prompt))

    def slot(self, bt: list[int], p: int) -> int:
        assert p // self.bs < len(bt), f"position {p} past the block table {bt}"
        return bt[p // self.bs] * self.bs + p % self.bs

    def forward(self, batch: Any) -> Any:
        self.forwards += 1
        results = self._dummy(batch) if batch.is_dummy_run else self._run(batch)
        out = self._outputs(list(batch.req_ids), results)
        if not self.deferred:
            return out
        prev_out, self.prev = self.prev, (list(batch.req_ids), results)
        if prev_out is None:
            return self.output_type([], [], None, None, None, is_deferred_out=True)
        return self._outputs(*prev_out)

    def _dummy(self, batch: Any) -> list[tuple]:
        """ATOM's dummy_execution row: K+1 zero tokens at positions 0..K of its block table (the
        null block: a live row reading it fails ``check_context``), nothing checked."""
        assert batch.req_ids == [-1] and batch.scheduled_tokens.tolist() == [0] * (self.k + 1)
        assert set(batch.block_tables[0]) == {0}, "a dummy row writes into the null block"
        for p in range(self.k + 1):
            self.kv[self.slot(batch.block_tables[0], p)] = 0
        self.dummies += 1
        return [((0,), self.k, [0] * self.k)]

    def _run(self, batch: Any) -> list[tuple]:
        prefill = batch.total_seqs_num_prefill > 0
        prev_ids = set(self.prev[0]) if self.prev is not None else set()
        st = batch.scheduled_tokens
        spec_rows = iter(getattr(batch, "scheduled_spec_decode_tokens", np.zeros((0, 0))))
        results, off = [], 0
        for i, rid in enumerate(batch.req_ids):
            q = int(batch.num_scheduled_tokens[i])
            bt = batch.block_tables[i]
            inputs = [int(x) for x in st[off:off + q]]
            off += q
            if prefill:
                start = int(batch.num_cached_tokens[i])
                assert int(batch.context_lens[i]) == start + q
            else:
                assert q == self.k + 1
                deferred = self.deferred and rid in prev_ids
                r = self.gpu[rid][2] if deferred else int(batch.num_rejected[i])
                start = int(batch.context_lens[i]) - r - q
                if deferred:  # the inputs are on the device: the last token and its drafts
                    inputs = [self.gpu[rid][0], *self.gpu[rid][1]]
                elif self.k:
                    assert inputs[1:] == [int(x) for x in next(spec_rows)]
            self.check_context(rid, bt, start)
            for j, x in enumerate(inputs):
                self.kv[self.slot(bt, start + j)] = x
            # A prefill row's inputs are all real tokens; a decode row's first one is (then drafts).
            for j, x in enumerate(inputs if prefill else inputs[:1]):
                assert x == self.truth(rid, start + j), (rid, start + j, x)
            # The first token it emits sits after its last prompt input (prefill) or after its
            # first input, the last real token (decode).
            results.append(self.sample(rid, start + (q if prefill else 1), 1 if prefill else q))
        return results

    def check_context(self, rid: int, bt: list[int], start: int) -> None:
        """Every position before the row's inputs holds the request's true token."""
        for p in range(start):
            got = self.kv.get(self.slot(bt, p))
            assert got == self.truth(rid, p), f"request {rid} position {p}: KV {got}"
        self.rows_checked += 1

    def sample(self, rid: int, end: int, width: int) -> tuple:
        """The row's accepted tokens and next drafts; ``end`` is the position of the first token
        it emits."""
        g = end - len(self.prompts[rid])  # that token's index among the request's outputs
        a = 1 if width == 1 else min(self.model.accepted(rid, g), width)
        toks = tuple(self.model.token(rid, g + j) for j in range(a))
        # Drafts as a real drafter's would be: the true tokens as far as the next row will
        # accept them, then a wrong one (the fake model dictates the count, the KV check the
        # values).
        nxt = g + a
        good = self.model.accepted(rid, nxt) - 1
        drafts = [self.model.token(rid, nxt + j) if j < good else self.model.draft(rid, nxt, j)
                  for j in range(self.k)]
        rejected = self.k + 1 - a if width > 1 else 0
        self.gpu[rid] = (toks[-1], drafts, rejected)
        return toks, rejected, drafts

    def _outputs(self, req_ids: list[int], results: list[tuple]) -> Any:
        toks = [r[0] for r in results]
        if self.k == 0 and not self.deferred:
            return self.output_type(req_ids, toks, None, None, None)
        rejected = np.array([r[1] for r in results], np.int32)
        return self.output_type(
            req_ids, toks, rejected, np.array([len(t) - 1 for t in toks], np.int32),
            np.array([r[2] for r in results], np.int32).reshape(len(results), self.k)
            if self.k else None, is_deferred_out=self.deferred)


def engine_loop(sched: Any, runner: FakeRunner, max_steps: int = 20_000,
                on_forward: Any = None) -> dict[str, Any]:
    """ATOM's EngineCore step until the scheduler is finished: schedule, take the rejected,
    forward a non-empty batch, postprocess. Returns what the engine saw. ``on_forward(step,
    batch)`` runs between a forward and its postprocess (an engine acting while it is in
    flight)."""
    stream: queue.Queue = queue.Queue()
    finished, rejected, streamed = [], [], {}
    for step in range(max_steps):
        if sched.is_finished():
            break
        result = sched.schedule()
        rejected += sched.take_rejected()
        if result is None:
            continue
        batch, seqs = result
        if not batch.req_ids:
            continue
        out = runner.forward(batch)
        if on_forward is not None:
            on_forward(step, batch)
        finished += sched.postprocess(seqs.values(), out, stream_output_queue=stream)
        while not stream.empty():
            for sid, ro in stream.get_nowait():
                streamed.setdefault(sid, []).append(ro)
    else:
        raise AssertionError("the engine loop did not finish")
    return {"finished": finished, "rejected": rejected, "streamed": streamed}
