"""AMD ATOM's scheduler API over the atom_sched core: replace
``from atom.model_engine.scheduler import Scheduler, ScheduledBatch, ScheduledBatchOutput`` (and
``SpecStats``, ``CacheStats``) by ``from atom_sched.compat.atom import ...`` (docs/atom.md).

ATOM's engine keeps calling ``schedule()`` -> its ModelRunner's ``forward(batch)`` ->
``postprocess(seqs, fwd_output, ...)``. In production the runner's outputs are *deferred*: each
forward returns the previous batch's tokens. Here that is the core's one-step-ahead protocol:
``schedule()`` schedules batch t while batch t-1 is in flight, and ``postprocess`` hands the
outputs it receives to ``update()`` of the batch they belong to (with non-deferred outputs, the
batch just scheduled). The engine's ``Sequence`` objects stay the engine's: the core decides, and
this layer writes the results into them (status, block table, tokens at each output, finish).

What the runner reads keeps ATOM's meaning, so ATOM's ModelRunner builds the same device inputs:
``context_lens`` of a decode row whose previous step is still in flight is the context if every
token of that step is accepted (the runner subtracts the fresh ``num_rejected``, as ATOM's
placeholder count does); ``scheduled_tokens`` hold the EOS id where only the device knows the
token, as ATOM's placeholders; ``block_tables`` are the sequences' own ``block_table`` lists.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np

from .._core import ConnectorRequest, KVConnector, RemoteMatch, SchedulerConfig, _token_rows
from .._core import SamplingParams as CoreParams
from .._core import Scheduler as CoreScheduler

__all__ = ["CacheStats", "RequestOutput", "ScheduledBatch", "ScheduledBatchOutput", "Scheduler",
           "SpecStats"]

logger = logging.getLogger("atom_sched.compat.atom")


# ---- statistics (ATOM's SpecStats and CacheStats, spec 5.1 and 5.2) ------------------------------
class SpecStats:
    """Draft acceptance of speculative decoding, as ATOM counts it: ``update(a)`` once per decode
    output of a request, ``a`` its accepted tokens (1..K+1)."""

    def __init__(self, mtp_k: int, log_interval: int = 1000) -> None:
        self.mtp_k = mtp_k
        self.log_interval = log_interval
        self.reset()

    def update(self, num_accepted_tokens: int) -> None:
        a = int(num_accepted_tokens)
        if not 1 <= a <= self.mtp_k + 1:
            raise KeyError(a)
        self.total_draft_tokens += self.mtp_k
        self._interval_draft_tokens += self.mtp_k
        self.distribution[a - 1] += 1
        self._interval_distribution[a - 1] += 1
        if self.total_draft_tokens % (self.log_interval * self.mtp_k) == 0:
            self._log()
            self._reset_interval()

    def update_counts(self, accepted: np.ndarray) -> None:
        """``update(a)`` for every ``a`` of ``accepted`` (one decode step's rows), at once."""
        if accepted.size == 0:
            return
        lo, hi = int(accepted.min()), int(accepted.max())
        if lo < 1 or hi > self.mtp_k + 1:
            raise KeyError(lo if lo < 1 else hi)
        counts = np.bincount(accepted - 1, minlength=self.mtp_k + 1).tolist()
        for i, c in enumerate(counts):
            self.distribution[i] += c
            self._interval_distribution[i] += c
        step = self.log_interval * self.mtp_k
        before = self.total_draft_tokens
        self.total_draft_tokens += self.mtp_k * accepted.size
        self._interval_draft_tokens += self.mtp_k * accepted.size
        if step and before // step != self.total_draft_tokens // step:
            self._log()
            self._reset_interval()

    @property
    def total_accepted(self) -> int:
        return sum(k * v for k, v in self.distribution.items())

    @property
    def total_steps(self) -> int:
        return sum(self.distribution.values())

    @property
    def acceptance_rate(self) -> float:
        return self.total_accepted / self.total_draft_tokens if self.total_draft_tokens else 0.0

    def get_statistics(self) -> dict[str, Any]:
        return {"total_draft_tokens": self.total_draft_tokens,
                "total_accepted_tokens": self.total_accepted,
                "acceptance_rate": self.acceptance_rate,
                "distribution": dict(self.distribution)}

    def reset(self) -> None:
        self.total_draft_tokens = 0
        self.distribution = dict.fromkeys(range(self.mtp_k + 1), 0)
        self._reset_interval()

    def _reset_interval(self) -> None:
        self._interval_draft_tokens = 0
        self._interval_distribution = dict.fromkeys(range(self.mtp_k + 1), 0)

    def _log(self) -> None:
        if logger.isEnabledFor(logging.INFO):  # (about once a step at 1,000 running)
            logger.info("[MTP Stats] %d draft tokens, %d accepted, acceptance rate %.3f",
                        self.total_draft_tokens, self.total_accepted, self.acceptance_rate)


class CacheStats:
    """Prefix-cache hits of admitted prompts: ``update(cached, full)`` once per admission."""

    def __init__(self, log_interval: int = 100) -> None:
        self.log_interval = log_interval
        self.total_requests = self.total_cached_tokens = self.total_full_tokens = 0
        self._reset_interval()

    def update(self, num_cached_tokens: int, num_full_tokens: int) -> None:
        self.total_requests += 1
        self.total_cached_tokens += int(num_cached_tokens)
        self.total_full_tokens += int(num_full_tokens)
        self._interval_requests += 1
        self._interval_cached += int(num_cached_tokens)
        self._interval_full += int(num_full_tokens)
        if self._interval_requests >= self.log_interval:
            logger.info("[Cache Stats] prefix hit rate %.3f over %d requests",
                        self._interval_cached / max(1, self._interval_full),
                        self._interval_requests)
            self._reset_interval()

    @property
    def hit_rate(self) -> float:
        return self.total_cached_tokens / self.total_full_tokens if self.total_full_tokens else 0.0

    def _reset_interval(self) -> None:
        self._interval_requests = self._interval_cached = self._interval_full = 0


# ---- what the runner gets and gives back ---------------------------------------------------------
class RequestOutput(NamedTuple):
    """ATOM's streamed output of one request in one step (``request.RequestOutput``'s fields; a
    named tuple: built in C for a whole step, picklable for the engine's output socket)."""

    request_id: int
    output_tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    kv_transfer_params_output: dict[str, Any] | None = None
    num_cached_tokens: int = 0



class ScheduledBatchOutput:
    """ATOM's runner-to-scheduler contract (spec 1.5): per request of ``req_ids`` (the batch the
    outputs belong to), ``token_ids[i]`` its accepted tokens, ``num_rejected``/``num_bonus`` and
    ``draft_token_ids`` (K > 0)."""

    def __init__(self, req_ids: list[int], token_ids: list[tuple[int, ...]],
                 num_rejected: np.ndarray | None, num_bonus: np.ndarray | None,
                 draft_token_ids: np.ndarray | None, is_deferred_out: bool = False,
                 is_prev_prefill: bool = False, logprobs: dict[int, float] | None = None) -> None:
        self.req_ids = req_ids
        self.token_ids = token_ids
        self.num_rejected = num_rejected
        self.num_bonus = num_bonus
        self.draft_token_ids = draft_token_ids
        self.is_deferred_out = is_deferred_out
        self.is_prev_prefill = is_prev_prefill
        self.logprobs = logprobs
        self._req_id_to_idx: dict[int, int] | None = None

    def get_idx(self, req_id: int) -> int | None:
        if self._req_id_to_idx is None:
            self._req_id_to_idx = {rid: i for i, rid in enumerate(self.req_ids)}
        return self._req_id_to_idx.get(req_id)


@dataclass
class ScheduledBatch:
    """What ATOM's ModelRunner reads, with ATOM's names, dtypes and meaning (spec 3.8)."""

    req_ids: list[int] = field(default_factory=list)
    num_scheduled_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    temperatures: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    top_ks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    top_ps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    return_logprobs: list[bool] = field(default_factory=list)
    needs_independent_noise: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    num_rejected: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    num_bonus: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    num_cached_tokens: list[int] = field(default_factory=list)
    context_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    scheduled_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    block_tables: list[list[int]] = field(default_factory=list)
    last_block_num_tokens: list[int] = field(default_factory=list)
    per_req_cache_groups: list[int] = field(default_factory=list)
    is_first_decode_without_local_prefill: list[bool] = field(default_factory=list)
    mrope_positions_by_req: dict[int, Any] = field(default_factory=dict)
    mrope_position_deltas: dict[int, int] = field(default_factory=dict)
    has_mrope: bool = False
    multimodal_data: dict[int, Any] = field(default_factory=dict)
    external_request_ids: list[Any] = field(default_factory=list)
    total_tokens_num: int = 0
    total_tokens_num_prefill: int = 0
    total_tokens_num_decode: int = 0
    total_seqs_num: int = 0
    total_seqs_num_prefill: int = 0
    total_seqs_num_decode: int = 0
    connector_meta_output: Any = None
    is_dummy_run: bool = False
    num_spec_step: int = 0
    remote_kv_block_ids: list[int] = field(default_factory=list)
    remote_kv_seq_blocks: dict[int, list[int]] = field(default_factory=dict)
    finished_recving_kv_req_ids: list[int] = field(default_factory=list)
    # scheduled_spec_decode_tokens (int32 [rows with drafts, K]) is set on decode batches only.


class _BatchSequences(Mapping):
    """``schedule()``'s ``{id: Sequence}`` in row order; ``values()`` (what ATOM's EngineCore
    reads) costs nothing, the dict is built on first lookup."""

    def __init__(self, ids: list[int], seqs: list[Any]) -> None:
        self._ids, self._seqs = ids, seqs
        self._dict: dict[int, Any] | None = None

    def _map(self) -> dict[int, Any]:
        if self._dict is None:
            self._dict = dict(zip(self._ids, self._seqs, strict=True))
        return self._dict

    def __getitem__(self, sid: int) -> Any:
        return self._map()[sid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def values(self) -> list[Any]:  # type: ignore[override]
        return self._seqs

    def __eq__(self, other: object) -> bool:
        return self._map() == (dict(other) if isinstance(other, Mapping) else other)

    __hash__ = None  # type: ignore[assignment]


class _QueueSnapshot(tuple):
    """ATOM's ``Scheduler.waiting``/``running`` deque as a reader sees it: the engine's own
    ``Sequence`` objects in ATOM's order (len, iteration, indexing, membership), taken when the
    attribute is read. The core owns the queues, so the snapshot refuses a deque's mutators."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Scheduler.running and Scheduler.waiting are read-only snapshots (the "
                        "core owns the queues): queue with add()/extend(), preempt with "
                        "preempt(seq)")

    append = appendleft = extend = extendleft = insert = pop = popleft = remove = clear = (
        rotate) = _refuse


@dataclass
class _Forwarded:
    """A batch handed to the runner whose outputs have not come back: ``core`` is the core's
    batch, or None for a dummy batch (see ``Scheduler._dummy_batch``)."""

    core: Any
    req_ids: list[int]


@dataclass
class _RowLayout:
    """What a batch copies per row from the request in each row's slot (set at admission)."""

    slots: np.ndarray
    req_ids: list[int]
    return_logprobs: list[bool]
    block_tables: list[list[int]]  # the sequences' own block_table lists
    external_request_ids: list[Any]
    seqs: list[Any]


def _scheduled_batch(req_ids: list[int], nsched: np.ndarray, ctx: np.ndarray,
                     is_prefill: np.ndarray, block_size: int, num_spec_step: int,
                     **rows: Any) -> ScheduledBatch:
    """A ScheduledBatch from its per-row fields (``rows``), with what ATOM derives from them:
    each row's tokens in its last block, the totals, and the zeroed rejection counts (a row's
    ``context_lens`` already accounts for them, see ``Scheduler._atom_context``)."""
    n = len(req_ids)
    prefill_tokens = int(nsched[is_prefill].sum())
    num_prefill = int(is_prefill.sum())
    return ScheduledBatch(
        req_ids=req_ids, num_scheduled_tokens=nsched, context_lens=ctx,
        num_rejected=np.zeros(n, np.int32), num_bonus=np.zeros(n, np.int32),
        last_block_num_tokens=_last_block_tokens(ctx, block_size).tolist(),
        is_first_decode_without_local_prefill=[False] * n,
        total_tokens_num=int(nsched.sum()), total_tokens_num_prefill=prefill_tokens,
        total_tokens_num_decode=int(nsched.sum()) - prefill_tokens, total_seqs_num=n,
        total_seqs_num_prefill=num_prefill, total_seqs_num_decode=n - num_prefill,
        num_spec_step=num_spec_step, **rows)


def _last_block_tokens(ctx: np.ndarray, block_size: int) -> np.ndarray:
    """Tokens in each row's last block (1..block_size), as ATOM's ``last_block_num_tokens``."""
    return ctx - (-(-ctx // block_size) - 1) * block_size


def _int32_array(values: Any, what: str) -> np.ndarray:
    """``values`` as an int32 array, refusing (ValueError) what numpy would wrap or truncate:
    non-integers, and integers outside int32."""
    a = np.asarray(values)
    if a.dtype.kind not in "iu":
        raise ValueError(f"postprocess: {what} must be integers, got dtype {a.dtype}")
    if a.dtype != np.int32 and a.size:
        lo, hi = int(a.min()), int(a.max())
        info = np.iinfo(np.int32)
        if lo < info.min or hi > info.max:
            raise ValueError(f"postprocess: {what} holds {lo if lo < info.min else hi}, not an "
                             "int32")
    return a.astype(np.int32, copy=False)


def _gather(items: list[Any], index: list[int]) -> list[Any]:
    """``[items[i] for i in index]``, gathered in C."""
    if len(index) > 1:
        return list(itemgetter(*index)(items))
    return [items[i] for i in index]


def _write_tokens(seq: Any, tokens: list[int]) -> None:
    """A Sequence's token lists and count from its whole sequence (prompt and outputs)."""
    seq.token_ids[:] = tokens
    seq.output_tokens[:] = tokens[seq.num_prompt_tokens:]
    seq.num_tokens = len(tokens)


def _enum_member(current: Any, name: str) -> Any:
    """``name`` of the enum ``current`` belongs to: the engine's own SequenceStatus/Type."""
    return type(current)[name]


class _AtomConnector(KVConnector):
    """ATOM's scheduler-side KV connector (``KVConnectorSchedulerBase``: MoRIIO, Mooncake...)
    seen by the core. Each callback gets the engine's ``Sequence`` with what the connector reads
    brought up to date (block table, prefix hits, tokens), as ATOM's scheduler calls it."""

    def __init__(self, atom_connector: Any, compat: Scheduler) -> None:
        super().__init__()
        self.atom = atom_connector
        self.compat = compat

    def is_producer(self) -> bool:
        flag = self.atom.is_producer
        return bool(flag() if callable(flag) else flag)

    def _seq(self, request: ConnectorRequest) -> Any:
        seq = self.compat._seqs[request.request_id]
        seq.block_table[:] = request.block_ids
        seq.num_cached_tokens = request.num_cached_tokens
        return seq

    def get_num_new_matched_tokens(self, request: ConnectorRequest) -> RemoteMatch:
        seq = self._seq(request)
        _count, load_async = self.atom.get_num_new_matched_tokens(seq)
        if not load_async:
            return RemoteMatch()  # ATOM ignores the count of a synchronous answer
        # ATOM's remote prefill covers the whole prompt (its count is informational) and
        # injects the producer's first token (and drafts) at the ready transition.
        params = getattr(seq, "kv_transfer_params", None) or {}
        t0 = params.get("first_token_id")
        drafts = list(params.get("draft_token_ids") or [])[: self.compat.mtp_k]
        return RemoteMatch(num_tokens=request.num_prompt_tokens, load_async=True,
                           first_token=-1 if t0 is None else int(t0), draft_tokens=drafts)

    def update_state_after_alloc(self, request: ConnectorRequest) -> None:
        seq = self._seq(request)
        remote = bool((getattr(seq, "kv_transfer_params", None) or {}).get("do_remote_prefill"))
        self.atom.update_state_after_alloc(seq)
        if remote:  # its KV comes from a prefill engine: it waits for it, as in ATOM
            seq.status = _enum_member(seq.status, "WAITING_FOR_REMOTE_KVS")

    def request_finished(self, request: ConnectorRequest) -> bool:
        seq = self._seq(request)
        _write_tokens(seq, list(request.token_ids))  # every token, the last step's included
        if self.compat.mtp_k:  # the drafts proposed with the last token (ATOM's connector
            seq.spec_token_ids = np.asarray(request.draft_token_ids, np.int32)  # sends them)
        self.atom.request_finished(seq)
        # ATOM's producer keeps every finished request's blocks until the send completes.
        return self.is_producer()


def _atom_kv_connector(config: Any) -> Any:
    """ATOM's own scheduler-side connector for ``config.kv_transfer_config``, as its scheduler
    builds it (``get_kvconnector("scheduler", config)``)."""
    try:
        from atom.utils.forward_context import get_kvconnector  # type: ignore[import-not-found]
    except ImportError as e:
        raise ValueError("kv_transfer_config is set but ATOM's get_kvconnector cannot be "
                         "imported: pass Scheduler(config, kv_connector=...)") from e
    return get_kvconnector("scheduler", config)


class Scheduler:
    """ATOM's ``Scheduler(config)`` over the core (docs/atom.md). ``config`` is ATOM's Config or
    any object with its attribute names; ``kv_connector`` is ATOM's scheduler-side connector
    (by default built from ``config.kv_transfer_config`` as ATOM does)."""

    def __init__(self, config: Any, kv_connector: Any = None) -> None:
        spec = getattr(config, "speculative_config", None)
        self.mtp_k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec else 0
        self.use_spec = spec is not None
        self.block_size = int(config.kv_cache_block_size)
        self.eos_token_id = int(getattr(config, "eos_token_id", -1))
        self.bos_token_id = int(getattr(config, "bos_token_id", -1))
        self.stop_token_ids = [int(t) for t in getattr(config, "stop_token_ids", None) or []]
        self.max_num_seqs = int(config.max_num_seqs)
        self.max_num_batched_tokens = int(config.max_num_batched_tokens)
        self.max_model_len = int(config.max_model_len)
        self.enable_chunked_prefill = bool(getattr(config, "enable_chunked_prefill", True))
        prefix = bool(getattr(config, "enable_prefix_caching", True))
        events = getattr(config, "kv_events_config", None)
        events_on = bool(getattr(events, "enable_kv_cache_events", False))
        # ATOM's pool holds num_kvcache_blocks ids; block 0 of them is the core's null block
        # (never handed out: padded block-table entries point at it).
        self.config = SchedulerConfig(
            num_blocks=int(config.num_kvcache_blocks), block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_prefix_caching=prefix,
            enable_chunked_prefill=self.enable_chunked_prefill,
            num_speculative_tokens=self.mtp_k, eos_token_id=self.eos_token_id,
            stop_token_ids=self.stop_token_ids,
            scheduler_delay_factor=float(getattr(config, "scheduler_delay_factor", 0.0) or 0.0),
            enable_kv_events=events_on,
            # ATOM caches prompt blocks only: decode blocks are cached only if the config opts in.
            cache_decode_blocks=bool(getattr(config, "cache_decode_blocks", False)),
            # ATOM's runner verifies every decode row as K+1 tokens (see _pad_short_rows).
            uniform_decode_rows=self.mtp_k > 0)
        self._core = CoreScheduler(self.config)
        self._enable_tbo = bool(getattr(config, "enable_tbo", False))
        self._seqs: dict[int, Any] = {}  # live sequences (waiting or running) by id
        self._running: set[int] = set()
        self._forwarded: deque[_Forwarded] = deque()
        # Per device slot (0..max_num_seqs-1): the sequence admitted there and what the batch
        # copies from it each step, so a step touches only the rows that changed.
        self._slot_seq: list[Any] = [None] * self.max_num_seqs
        self._slot_logprobs = np.zeros(self.max_num_seqs, bool)
        self._slot_noise = np.zeros(self.max_num_seqs, bool)
        self._slot_nblocks = np.zeros(self.max_num_seqs, np.int32)  # len(seq.block_table)
        self._slot_prefill = np.zeros(self.max_num_seqs, bool)  # the row kind last scheduled
        self._slot_ntokens = np.zeros(self.max_num_seqs, np.int64)  # tokens known on the host
        self._slot_of: dict[int, int] = {}  # sequence id -> its slot while running
        self._slot_owner = np.full(self.max_num_seqs, -1, np.int64)  # the reverse (-1: free)
        self._slot_table: list[list[int]] = [[] for _ in range(self.max_num_seqs)]
        self._slot_ext: list[Any] = [None] * self.max_num_seqs
        self._layout: _RowLayout | None = None  # the last batch's (see _row_layout)
        # ATOM's per-sequence speculative state of each slot's last output (_keep_spec_state).
        self._slot_bonus = np.zeros(self.max_num_seqs, np.int32)
        self._slot_rejected = np.zeros(self.max_num_seqs, np.int32)
        self._slot_drafts = np.full((self.max_num_seqs, self.mtp_k), -1, np.int32)
        # Preempted sequences: tokens of a batch in flight may land in the core after their
        # lists were written, so they are written again at readmission.
        self._stale: set[int] = set()
        # Sequences that asked for logprobs: one per output token so far (Sequence.logprobs).
        self._logprobs: dict[int, list[float]] = {}
        self._awaiting_first: set[int] = set()  # admitted, first token not out yet
        self._t0_known: set[int] = set()  # remote prefills whose T0 is counted, not streamed
        self.spec_stats = SpecStats(self.mtp_k) if self.use_spec and self.mtp_k else None
        self.cache_stats = CacheStats() if prefix else None
        self.prefill_delayer: Any = None
        self._publisher = self._make_publisher(events) if events_on else None
        if kv_connector is None and getattr(config, "kv_transfer_config", None):
            kv_connector = _atom_kv_connector(config)
        self.kv_connector = kv_connector
        if kv_connector is not None:
            self._core.set_kv_connector(_AtomConnector(kv_connector, self))

    # ---- requests ---------------------------------------------------------------------------
    def add(self, seq: Any) -> None:
        """Queue an engine ``Sequence`` (ATOM's fields: ``id``, ``token_ids``, ``num_tokens``,
        sampling fields, ``stop_token_sequences``...). Bad fields raise ValueError/TypeError and
        queue nothing."""
        sid = seq.id
        if type(sid) is not int or sid < 0:
            raise ValueError(f"sequence id must be a non-negative int, got {sid!r}")
        if sid in self._seqs:
            raise ValueError(f"sequence {sid} is already queued")
        params = CoreParams(
            temperature=float(seq.temperature), top_k=int(seq.top_k), top_p=float(seq.top_p),
            max_tokens=int(seq.max_tokens), ignore_eos=bool(seq.ignore_eos),
            logprobs=bool(getattr(seq, "return_logprobs", False)),
            stop_token_sequences=[list(s) for s in (seq.stop_token_sequences or [])])
        tokens = list(seq.token_ids[: seq.num_tokens])
        # ATOM's clock is time.time() (the IO processor stamps arrive_time with it), for the
        # delay factor's waiting times as for its latencies.
        arrive = float(getattr(seq, "arrive_time", 0.0) or 0.0)
        self._core.add_request(sid, tokens, params,
                               arrival_time=arrive if arrive > 0 else time.time())
        self._seqs[sid] = seq
        if getattr(seq, "return_logprobs", False):
            self._logprobs[sid] = []

    def extend(self, seqs: Iterable[Any]) -> None:
        for seq in seqs:
            self.add(seq)

    def take_rejected(self) -> list[Any]:
        """Sequences the core refused (``leave_reason`` says why), once."""
        out = []
        for r in self._core.take_rejected():
            seq = self._seqs.pop(r.request_id)
            self._logprobs.pop(r.request_id, None)
            seq.status = _enum_member(seq.status, "FINISHED")
            seq.leave_reason = r.reason
            out.append(seq)
        return out

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> tuple[ScheduledBatch, Mapping[int, Any]] | None:
        """The next batch and its sequences by id (row order); None when no request is waiting
        or running. The batch may be empty (the engine then skips the forward)."""
        allow = self._ask_prefill_delayer()
        core = self._core
        if not core.has_unfinished_requests() and not self._forwarded:
            return None
        b = (core.schedule(allow_prefill=allow, now=time.time())
             if core.num_outstanding_batches < 2 else None)
        if b is None:
            self._sync_preemptions()
            self._retire_finished_batches()
            batch, seqs = self._dummy_batch()
        else:
            batch, seqs = self._build(b)
            self._sync_preemptions()
            self._forwarded.append(_Forwarded(b, batch.req_ids))
        if self.kv_connector is not None:  # as ATOM: once per schedule() that returns a batch
            batch.connector_meta_output = self.kv_connector.build_connector_meta()
        return batch, seqs

    def _update_from_kv_xfer_finished(self, kv_connector_output: Any) -> None:
        """What the engine's KV transfers finished (``finished_sending``: the producer may free
        those requests' blocks; ``finished_recving``: their KV is in place), as ATOM's engine core
        reports it after each forward."""
        if kv_connector_output is None:
            return
        sending = sorted(getattr(kv_connector_output, "finished_sending", None) or ())
        recving = sorted(getattr(kv_connector_output, "finished_recving", None) or ())
        if sending or recving:
            self._core.update_from_kv_xfer_finished(finished_sending=sending,
                                                    finished_recving=recving)

    def postprocess(self, seqs: Iterable[Any], fwd_output: ScheduledBatchOutput,
                    stream_output_queue: Any = None, batch: Any = None) -> list[Any]:
        """Hand the runner's outputs to the batch they belong to (the oldest one forwarded:
        deferred outputs belong to the batch before the one just run); stream each request's new
        tokens to ``stream_output_queue`` as ATOM does (one list of ``(id, RequestOutput)`` per
        step); return the sequences that finished."""
        if not fwd_output.req_ids:
            return []  # the first deferred forward has nothing to give back yet
        if not self._forwarded:
            raise ValueError("postprocess: outputs for no forwarded batch")
        fwd = self._forwarded[0]
        if list(fwd_output.req_ids) != fwd.req_ids:
            raise ValueError("postprocess: the outputs' req_ids are not those of the oldest "
                             "forwarded batch (outputs lost or reordered)")
        b = fwd.core
        if b is None:  # a dummy batch: its outputs are dropped
            self._forwarded.popleft()
            return []
        # Checked first, then applied: a refused output changes nothing.
        args, lens = self._update_args(b, fwd_output)
        out = self._core.update(b, *args)
        self._forwarded.popleft()
        if b.is_prefill:  # (ATOM's batches are all prefill or all decode)
            self._advance_prefills(b)
        if self.mtp_k:
            self._keep_spec_state(b, lens, args[2])
        return self._deliver(out, b, fwd_output, stream_output_queue)

    def _advance_prefills(self, b: Any) -> None:
        """ATOM's postprocess advances a sequence's ``num_cached_tokens`` by each prefill chunk
        computed (its prefill progress)."""
        rows = np.flatnonzero(b.row_is_prefill)
        done = (b.num_cached_tokens[rows] + b.num_scheduled_tokens[rows]).tolist()
        for sid, n in zip(b.req_ids[rows].tolist(), done, strict=True):
            if sid in self._running:
                self._seqs[sid].num_cached_tokens = n

    # ---- building the batch -------------------------------------------------------------------
    def _build(self, b: Any) -> tuple[ScheduledBatch, Mapping[int, Any]]:
        slots = b.request_slots
        prev_prefill = self._slot_prefill[slots]  # the kind of each row's previous row
        self._sync_rows(b)
        is_prefill = b.row_is_prefill
        ctx = b.context_lens.copy()
        inexact = ~b.row_exact & ~is_prefill
        if inexact.any():
            ctx[inexact] = self._atom_context(self._slot_ntokens[slots[inexact]],
                                              prev_prefill[inexact])
        rows = self._row_layout(b, slots)
        st = b.scheduled_tokens
        eos = np.int32(self.eos_token_id)
        batch = _scheduled_batch(
            list(rows.req_ids), b.num_scheduled_tokens.copy(), ctx, is_prefill,
            self.block_size, 0 if b.is_prefill else self.mtp_k,
            temperatures=b.temperatures.copy(), top_ks=b.top_ks.copy(), top_ps=b.top_ps.copy(),
            return_logprobs=list(rows.return_logprobs),
            needs_independent_noise=self._slot_noise[slots],
            num_cached_tokens=b.num_cached_tokens.tolist(),
            # The EOS id where only the device knows the token, as ATOM's placeholders.
            scheduled_tokens=np.where(st < 0, eos, st).astype(np.int32),
            block_tables=list(rows.block_tables),
            external_request_ids=list(rows.external_request_ids))
        if not b.is_prefill and self.mtp_k > 0:
            # The drafts of the rows whose inputs the host knows (the device holds the others'),
            # missing ones as placeholders.
            drafts = b.spec_draft_tokens[b.row_exact]
            batch.scheduled_spec_decode_tokens = np.where(drafts < 0, eos, drafts)
            if (batch.num_scheduled_tokens <= self.mtp_k).any():
                self._pad_short_rows(b, batch)
        return batch, _BatchSequences(batch.req_ids, rows.seqs)

    def _row_layout(self, b: Any, slots: np.ndarray) -> _RowLayout:
        """The batch's per-slot lists in row order: the last step's while the rows are the
        same slots in the same order and nobody was admitted (a steady decode step)."""
        last = self._layout
        if (last is not None and len(last.slots) == len(slots) and not b.slot_reset.any()
                and np.array_equal(last.slots, slots)):
            return last
        slot_list = slots.tolist()
        self._layout = _RowLayout(
            slots.copy(), b.req_ids.tolist(), self._slot_logprobs[slots].tolist(),
            _gather(self._slot_table, slot_list), _gather(self._slot_ext, slot_list),
            _gather(self._slot_seq, slot_list))
        return self._layout

    def _pad_short_rows(self, b: Any, batch: ScheduledBatch) -> None:
        """ATOM's runner verifies K+1 tokens per decode row. The core schedules fewer only for a
        row at the position limit (``uniform_decode_rows``), and accepting its tokens ends the
        request: the row is padded to K+1 with placeholders, its extra KV positions pointing at
        the null block, and tokens accepted past its real ones are dropped at postprocess (as
        those past a stop)."""
        q, bs = self.mtp_k + 1, self.block_size
        nsched = batch.num_scheduled_tokens
        short = np.flatnonzero(nsched < q)
        missing = q - nsched[short]
        ends = b.cu_seqlens_q[1:][short]
        batch.scheduled_tokens = np.insert(batch.scheduled_tokens, np.repeat(ends, missing),
                                           np.int32(self.eos_token_id))
        nsched[short] = q
        batch.context_lens[short] += missing
        tables = batch.block_tables
        for i, c in zip(short.tolist(), batch.context_lens[short].tolist(), strict=True):
            tables[i] = tables[i] + [0] * (-(-c // bs) - len(tables[i]))
        batch.last_block_num_tokens = _last_block_tokens(batch.context_lens, bs).tolist()
        extra = int(missing.sum())
        batch.total_tokens_num += extra
        batch.total_tokens_num_decode += extra

    def _atom_context(self, known: np.ndarray, after_prefill: np.ndarray) -> np.ndarray:
        """``context_lens`` of a decode row scheduled while its request's previous row is in
        flight, as ATOM's host counts it: the ``known`` tokens, the previous row's outputs if
        all are accepted (1 after a prefill, K+1 after a decode) and this row's K drafts. ATOM's
        runner subtracts that row's fresh ``num_rejected`` and gets the true context."""
        k = self.mtp_k
        return (known + 1 + k + np.where(after_prefill, 0, k)).astype(np.int32)

    def _sync_rows(self, b: Any) -> None:
        """Write what changed this step into the rows' sequences: admissions (status), the row
        kind (type), prefill progress, and blocks added or released. Only those rows are
        visited: a steady decode step touches a few."""
        if b.num_rows == 0:
            return
        reset, is_prefill = b.slot_reset, b.row_is_prefill
        starts, offs, new_ids = b.new_block_starts, b.new_block_offsets, b.new_block_ids
        slots = b.request_slots
        kind_changed = self._slot_prefill[slots] != is_prefill
        changed = reset | is_prefill | kind_changed | (offs[1:] > offs[:-1]) | (
            starts != self._slot_nblocks[slots])
        rows = np.flatnonzero(changed)
        if rows.size == 0:
            return
        self._slot_nblocks[slots[rows]] = starts[rows] + (offs[1:] - offs[:-1])[rows]
        seqs, id_list = self._seqs, new_ids.tolist()
        offs_l, starts_l = offs.tolist(), starts.tolist()
        for i, slot, rid, fresh, prefill, kind in zip(
                rows.tolist(), slots[rows].tolist(), b.req_ids[rows].tolist(),
                reset[rows].tolist(), is_prefill[rows].tolist(), kind_changed[rows].tolist(),
                strict=True):
            seq = seqs[rid]
            if fresh:
                self._admit(seq, slot)
                if not prefill:  # a remote prefill's first decode: the core injected T0
                    self._slot_ntokens[slot] = int(b.context_lens[i] - b.num_scheduled_tokens[i]
                                                   + 1)
                    self._t0_known.add(rid)
            table = seq.block_table
            if starts_l[i] < len(table):
                del table[starts_l[i]:]
            table += id_list[offs_l[i]:offs_l[i + 1]]
            if kind or fresh:
                self._slot_prefill[slot] = prefill
                seq.type = _enum_member(seq.type, "PREFILL" if prefill else "DECODE")
            if prefill:
                seq.num_cached_tokens = int(b.num_cached_tokens[i])

    def _admit(self, seq: Any, slot: int) -> None:
        if seq.id in self._stale:
            self._stale.discard(seq.id)
            self._write_core_tokens(seq)
        seq.status = _enum_member(seq.status, "RUNNING")
        seq.block_table.clear()
        self._running.add(seq.id)
        self._slot_of[seq.id] = slot
        self._slot_owner[slot] = seq.id
        self._slot_seq[slot] = seq
        self._slot_table[slot] = seq.block_table
        self._slot_ext[slot] = getattr(seq, "external_request_id", None)
        self._slot_ntokens[slot] = seq.num_tokens
        if not getattr(seq, "first_token_time", 0):
            self._awaiting_first.add(seq.id)
        self._slot_logprobs[slot] = bool(getattr(seq, "return_logprobs", False))
        self._slot_noise[slot] = bool(getattr(seq, "needs_independent_noise", False))
        if self.mtp_k:
            self._slot_bonus[slot] = self._slot_rejected[slot] = 0
            self._slot_drafts[slot] = -1

    def _release_slot(self, sid: int) -> None:
        slot = self._slot_of.pop(sid, None)
        if slot is not None and self._slot_owner[slot] == sid:
            self._slot_owner[slot] = -1

    def _sync_preemptions(self) -> None:
        """Sequences the core preempted go back to WAITING without blocks, as ATOM's preempt.
        (Called once the step's admissions are known: then the core runs exactly the sequences
        this layer thinks are running, unless some were preempted.)"""
        if self._core.num_running == len(self._running):
            return
        running = set(self._core.running_ids())
        for sid in [s for s in self._running if s not in running]:
            self._back_to_waiting(self._seqs[sid])

    def _back_to_waiting(self, seq: Any) -> None:
        """ATOM's preempt on the engine's Sequence: WAITING, no blocks, its tokens so far
        written in, the speculative state of its last output cleared."""
        self._running.discard(seq.id)
        self._release_slot(seq.id)
        self._write_core_tokens(seq)
        self._stale.add(seq.id)
        seq.status = _enum_member(seq.status, "WAITING")
        seq.block_table.clear()
        seq.num_cached_tokens = 0
        seq.num_rejected = seq.num_bonus_tokens = 0
        seq.spec_token_ids = np.zeros(0, np.int32)
        seq.is_first_decode = False

    def _dummy_batch(self) -> tuple[ScheduledBatch, dict[int, Any]]:
        """The core has nothing to run now. If a batch of its is in flight, a deferred runner
        still holds that batch's outputs and gives them back only with its next forward (and the
        core may be waiting for them: requests ending with them by length get no row, a
        preempted request is readmitted only once they land): return ATOM's dummy batch
        (``dummy_execution``: one decode row, id -1, K+1 zero tokens, ``is_dummy_run``), its KV
        in the null block. Its own outputs are dropped when they come. Otherwise an empty
        batch (the engine skips the forward)."""
        if not any(fwd.core is not None for fwd in self._forwarded):
            return ScheduledBatch(), {}
        q, bs = self.mtp_k + 1, self.block_size
        batch = _scheduled_batch(
            [-1], np.full(1, q, np.int32), np.full(1, q, np.int32), np.zeros(1, bool), bs,
            self.mtp_k, temperatures=np.zeros(1, np.float32), top_ks=np.full(1, -1, np.int32),
            top_ps=np.ones(1, np.float32), return_logprobs=[False],
            needs_independent_noise=np.zeros(1, bool), num_cached_tokens=[0],
            scheduled_tokens=np.zeros(q, np.int32), block_tables=[[0] * -(-q // bs)],
            external_request_ids=[None])
        batch.is_dummy_run = True
        if self.mtp_k > 0:
            batch.scheduled_spec_decode_tokens = np.zeros((1, self.mtp_k), np.int32)
        self._forwarded.append(_Forwarded(None, [-1]))
        return batch, {}

    def _retire_finished_batches(self) -> None:
        """A forwarded batch whose requests have all finished (its rows were scheduled one step
        ahead of their last output) would wait for its outputs until some later forward: the
        core gets it back now (it discards the rows of finished requests), and the outputs are
        dropped when they come."""
        for fwd in self._forwarded:
            if fwd.core is None:
                continue
            if any(rid in self._seqs for rid in fwd.req_ids):
                return
            b, n, k = fwd.core, fwd.core.num_rows, self.mtp_k
            if k == 0:
                self._core.update(b, np.zeros(n, np.int32))
            else:
                self._core.update(b, np.zeros((n, k + 1), np.int32),
                                  None if b.is_prefill else np.ones(n, np.int32),
                                  np.full((n, k), -1, np.int32))
            fwd.core = None

    # ---- outputs ------------------------------------------------------------------------------
    def _update_args(self, b: Any,
                     out: ScheduledBatchOutput) -> tuple[tuple[Any, ...], np.ndarray]:
        """``update()``'s arrays from ATOM's outputs (checked: ValueError names what is wrong),
        and each row's count of tokens the runner accepted."""
        n, k = b.num_rows, self.mtp_k
        try:
            num_rows = len(out.token_ids)
        except TypeError:
            raise ValueError("postprocess: token_ids must be a list of token rows, got "
                             f"{type(out.token_ids).__name__}") from None
        if num_rows != n:
            raise ValueError(f"postprocess: {num_rows} token rows for {n} requests")
        try:
            sampled, lens = _token_rows(out.token_ids, k + 1)
        except (TypeError, ValueError) as e:
            raise ValueError(f"postprocess: token ids must be int32 integers ({e})") from None
        limit = np.where(b.row_is_prefill, 1, k + 1)  # the runner's width (see _pad_short_rows)
        bad = np.flatnonzero((lens < 1) | (lens > limit))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"postprocess: request {out.req_ids[i]} got {lens[i]} tokens")
        logprobs = self._logprob_rows(out, lens) if self._logprobs and out.logprobs else None
        if k == 0:  # one token each
            return (sampled.reshape(n), None, None,
                    None if logprobs is None else logprobs.reshape(n)), lens
        drafts = out.draft_token_ids
        if drafts is None or len(drafts) == 0:
            drafts = np.full((n, k), -1, np.int32)
        drafts = _int32_array(drafts, "draft_token_ids")
        if drafts.shape != (n, k):
            raise ValueError(f"postprocess: draft_token_ids of shape {drafts.shape}, the batch "
                             f"needs ({n}, {k})")
        # A padded row accepts at most its real tokens (the rest lie past the position limit).
        accepted = None if b.is_prefill else np.minimum(lens, b.num_scheduled_tokens)
        return (sampled, accepted, drafts, logprobs), lens

    def _logprob_rows(self, out: ScheduledBatchOutput, lens: np.ndarray) -> np.ndarray:
        """ATOM's runner gives one logprob per sequence per step (``{id: float}``), its last
        token's: as ``update()``'s logprobs (the shape of the sampled tokens), NaN elsewhere. The
        core drops it with its token if a stop cuts the row."""
        lp = np.full((len(lens), self.mtp_k + 1), np.nan, np.float32)
        for sid, value in out.logprobs.items():
            i = out.get_idx(sid)
            if i is not None and sid in self._logprobs:
                lp[i, lens[i] - 1] = value
        return lp

    def _deliver(self, out: Any, b: Any, fwd_output: ScheduledBatchOutput,
                 stream: Any) -> list[Any]:
        """Stream a step's outputs (one list of ``(id, RequestOutput)``, built in C), finish the
        sequences that ended, return them. A running sequence's token lists are left as they
        are (ATOM's hold placeholders while it runs): they are written at its finish, from the
        whole sequence the core gives, or at a preemption."""
        if len(out) == 0:
            return []
        ids, counts = out.request_ids, np.diff(out.token_offsets)
        self._count_tokens(b, ids, counts)
        if self._logprobs and fwd_output.logprobs:
            self._keep_logprobs(ids, out)
        if self._awaiting_first:
            now, cached = time.time(), out.num_cached_tokens
            for i in (i for i, sid in enumerate(ids.tolist()) if sid in self._awaiting_first):
                self._first_output(int(ids[i]), int(cached[i]), now)
        finished = [self._finish(int(ids[i]), out.finish_reason(i), out.final_token_ids(i))
                    for i in np.flatnonzero(out.finished).tolist()]
        if stream is not None:
            items = out._atom_stream_items(RequestOutput)
            if finished:
                self._add_transfer_params(items, finished)
            if items:
                stream.put_nowait(items)
        return finished

    def _keep_logprobs(self, ids: np.ndarray, out: Any) -> None:
        """``Sequence.logprobs``, one per output token (the runner's value on each step's last
        token, NaN on its other tokens: accepted drafts, a remote first token; ATOM's are
        misaligned with MTP, 8.13)."""
        values, offs = out.new_logprobs.tolist(), out.token_offsets.tolist()
        for i, sid in enumerate(ids.tolist()):
            kept = self._logprobs.get(sid)
            if kept is not None:
                kept += values[offs[i]:offs[i + 1]]

    @staticmethod
    def _add_transfer_params(items: list[tuple[int, RequestOutput]], finished: list[Any]) -> None:
        """A producer's connector leaves ``kv_transfer_params_output`` in the finished Sequence:
        its last RequestOutput carries it, as ATOM's."""
        params = {seq.id: p for seq in finished
                  if (p := getattr(seq, "kv_transfer_params_output", None)) is not None}
        if params:
            for j, (sid, ro) in enumerate(items):
                if sid in params:
                    items[j] = (sid, ro._replace(kv_transfer_params_output=params[sid]))

    def _count_tokens(self, b: Any, ids: np.ndarray, counts: np.ndarray) -> None:
        """Add each request's new tokens to its slot's known count (a preempted request's
        in-flight token can still come: its slot is not its own then, and its count is taken
        at re-admission)."""
        if len(ids) == b.num_rows and np.array_equal(ids, b.req_ids):
            slots = b.request_slots  # one entry per row, in row order
        else:
            slot_of = self._slot_of
            slots = np.fromiter((slot_of.get(sid, -1) for sid in ids.tolist()), np.int64,
                                len(ids))
        own = (self._slot_owner[slots] == ids) & (slots >= 0)  # (slot -1 reads another's)
        if own.all():
            self._slot_ntokens[slots] += counts
        else:
            self._slot_ntokens[slots[own]] += counts[own]
        if self._t0_known:  # their first output streams T0, counted at admission already
            for i in (i for i, sid in enumerate(ids.tolist()) if sid in self._t0_known):
                self._t0_known.discard(int(ids[i]))
                if own[i]:
                    self._slot_ntokens[slots[i]] -= 1

    def _first_output(self, sid: int, cached: int, now: float) -> None:
        self._awaiting_first.discard(sid)
        seq = self._seqs[sid]
        seq.first_token_time = now
        seq.prefix_cache_hit_tokens = cached
        if self.cache_stats is not None:
            self.cache_stats.update(cached, seq.num_prompt_tokens)

    def _keep_spec_state(self, b: Any, accepted: np.ndarray, drafts: np.ndarray) -> None:
        """ATOM's per-sequence view of the last output (``num_bonus_tokens``, ``num_rejected``,
        ``spec_token_ids``), kept per device slot for the rows that emitted and written into
        the Sequence at its finish (as its tokens: ATOM's own readers, its scheduler and
        connector, read them there; a per-row write each step would cost more than the
        core's step); ``spec_stats`` counts the decode rows' acceptances."""
        if self.spec_stats is not None and not b.is_prefill:
            self.spec_stats.update_counts(accepted)
        slots, prefill = b.request_slots, b.row_is_prefill
        own = (self._slot_owner[slots] == b.req_ids) & b.emits_token
        if not own.all():
            slots, prefill, accepted, drafts = slots[own], prefill[own], accepted[own], drafts[own]
        self._slot_bonus[slots] = accepted - 1
        self._slot_rejected[slots] = np.where(prefill, 0, self.mtp_k + 1 - accepted)
        self._slot_drafts[slots] = drafts

    def _write_spec_state(self, seq: Any, slot: int) -> None:
        seq.num_bonus_tokens = int(self._slot_bonus[slot])
        seq.num_rejected = int(self._slot_rejected[slot])
        seq.spec_token_ids = self._slot_drafts[slot].copy()

    def _write_core_tokens(self, seq: Any) -> None:
        """Write the core's tokens of a live request into its Sequence (a preemption, a
        readmission: rare)."""
        _write_tokens(seq, self._core.request_state(seq.id)["token_ids"])

    def _finish(self, sid: int, reason: str, tokens: list[int]) -> Any:
        seq = self._seqs.pop(sid)
        _write_tokens(seq, tokens)
        slot = self._slot_of.get(sid)
        if self.mtp_k and slot is not None and self._slot_owner[slot] == sid:
            self._write_spec_state(seq, slot)
        if sid in self._logprobs:
            seq.logprobs = self._logprobs.pop(sid)
        self._stale.discard(sid)
        seq.status = _enum_member(seq.status, "FINISHED")
        seq.leave_reason = reason
        seq.leave_time = time.time()
        self._running.discard(sid)
        self._release_slot(sid)
        return seq

    # ---- queries (spec 5.5) ------------------------------------------------------------------
    @property
    def running(self) -> _QueueSnapshot:
        """ATOM's ``running`` deque, read-only: the running sequences in service order (admission
        order, a preemption victim taken from the tail). Built when read: no cost per step."""
        seqs = self._seqs
        return _QueueSnapshot([seqs[sid] for sid in self._core.running_ids()])

    @property
    def waiting(self) -> _QueueSnapshot:
        """ATOM's ``waiting`` deque, read-only: first in, first out, a preempted sequence at the
        head, sequences loading remote KV (``WAITING_FOR_REMOTE_KVS``) at the tail. Built when
        read: no cost per step."""
        seqs = self._seqs
        return _QueueSnapshot([seqs[sid] for sid in self._core.waiting_ids()])

    def get_request_counts(self) -> tuple[int, int]:
        return self._core.num_running, self._core.num_waiting

    def get_num_unfinished_requests(self) -> int:
        return self._core.num_running + self._core.num_waiting

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        return self.has_unfinished_requests()

    def is_finished(self) -> bool:
        """Nothing waits, runs or is in flight (an engine takes the rejected right after each
        ``schedule()``, as ATOM's EngineCore does)."""
        return not self._core.has_unfinished_requests() and not (
            self._core.num_outstanding_batches)

    def get_next_batch_info(self) -> tuple[bool, int, int]:
        return self._core.get_next_batch_info(now=time.time())

    def preempt(self, seq: Any) -> None:
        """Preempt a running sequence now (ATOM's ``preempt``, recompute): its blocks are freed,
        it goes back to the head of waiting with its tokens, and is prefilled again when it is
        readmitted. A batch in flight that holds it still delivers its tokens. ValueError if
        ``seq`` is not one of this scheduler's running sequences (nothing changes)."""
        sid = getattr(seq, "id", None)
        if type(sid) is not int or self._seqs.get(sid) is not seq:
            raise ValueError(f"preempt: sequence {sid!r} is not queued in this scheduler")
        if sid not in self._running:
            raise ValueError(f"preempt: sequence {sid} is not running")
        self._core.preempt_request(sid)
        self._back_to_waiting(seq)

    # ---- data parallel, KV events ------------------------------------------------------------
    def set_prefill_delayer(self, delayer: Any) -> None:
        """ATOM's PrefillDelayer protocol: ``delayer.should_allow_prefill(local_prefillable,
        token_usage=..., local_alignment_ready=...)`` is asked before every schedule()."""
        self.prefill_delayer = delayer

    def _ask_prefill_delayer(self) -> bool:
        d = self.prefill_delayer
        if d is None:
            return True
        required = 2 if self._enable_tbo else 1
        count = self._core.count_admittable_head_prefills(required)
        usage = 1.0 - self._core.num_free_blocks / max(1, self.config.num_blocks - 1)
        return bool(d.should_allow_prefill(local_prefillable=count > 0, token_usage=usage,
                                           local_alignment_ready=count >= required))

    def _make_publisher(self, events: Any) -> Any:
        from ..kv_events import KVEventPublisher

        kw: dict[str, Any] = {}
        for name in ("replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic"):
            value = getattr(events, name, None)
            if value is not None:
                kw[name] = value
        # ATOM's default endpoints bind every interface ("tcp://*:5557"): here loopback only.
        for name in ("replay_endpoint",):
            if kw.get(name):
                kw[name] = kw[name].replace("tcp://*", "tcp://127.0.0.1")
        endpoint = getattr(events, "endpoint", None) or "tcp://127.0.0.1:5557"
        return KVEventPublisher(endpoint.replace("tcp://*", "tcp://127.0.0.1"), **kw)

    def publish_kv_events(self) -> None:
        if self._publisher is not None:
            self._publisher.publish_step(self._core)

    def shutdown_kv_events(self) -> None:
        try:
            if self._publisher is not None:
                self._publisher.close()
        except Exception:  # noqa: BLE001 - ATOM swallows shutdown errors
            logger.exception("KV event publisher shutdown")
