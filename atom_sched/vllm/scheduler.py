"""A vLLM scheduler class driven by atom_sched's C++ core.

vLLM builds it from its own constructor arguments when told ``scheduler_cls`` (the Python API) or
``--scheduler-cls atom_sched.vllm.AtomScheduler`` (the server). Each ``schedule()`` runs one step
of ``atom_sched.Scheduler`` (``policy="mixed"``, vLLM's stall-free batching) and translates its
``Batch`` into vLLM's ``SchedulerOutput``; ``update_from_output()`` feeds the sampled tokens back
to the core and translates its ``StepOutput`` into ``EngineCoreOutputs``. The core's block ids
index vLLM's KV cache directly: both pools have ``num_gpu_blocks`` blocks and keep block 0 as the
null block, so the model runner needs nothing but the ids. docs/vllm.md gives the field mapping.

What this class does not support yet is refused when vLLM constructs it (``UnsupportedFeature``,
naming the feature and the option that turns it off), never silently mis-served.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch
from vllm.multimodal import MULTIMODAL_REGISTRY, MultiModalRegistry
from vllm.v1.core.sched.interface import PauseState, SchedulerInterface
from vllm.v1.core.sched.output import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.stats import PrefixCacheStats, RequestSpecDecodeMetrics, SchedulerStats
from vllm.v1.request import Request, RequestStatus, StreamingUpdate
from vllm.v1.spec_decode.metrics import SpecDecodingStats
from vllm.v1.structured_output.utils import strip_speculative_padding

import atom_sched
from atom_sched.vllm.kv_connector import VllmConnectorBridge, make_kv_connector
from atom_sched.vllm.kv_events import to_vllm_events
from atom_sched.vllm.options import TENANT_ARG, policy_options, request_tenant
from atom_sched.vllm.refusals import UnsupportedFeature
from atom_sched.vllm.refusals import refuse as _refuse
from atom_sched.vllm.sessions import SessionInputs, start_next_turn

# Under vLLM's logger, so that its handlers (the server's log) show these lines.
logger = logging.getLogger("vllm.atom_sched")



__all__ = ["AtomScheduler", "UnsupportedFeature"]




# Speculative methods served: drafts proposed by the model runner after sampling, from the
# request's own tokens (n-gram), by a draft model, or by a drafter on the target's hidden states
# (the EAGLE family); the last two write KV past the verified tokens into slots the core reserves
# (vLLM's num_lookahead_tokens), and the EAGLE family also recomputes a prefix hit's last block.
# The core verifies at most this many drafts a row.
_DRAFT_METHODS = ("ngram", "ngram_gpu", "draft_model", "eagle", "eagle3", "mtp", "dflash",
                  "dspark")
_MAX_DRAFTS = 8

# The core's finish reasons (docs/api.md "Outputs and stop conditions") as vLLM statuses.
_LENGTH_REASONS = {"max_tokens", "max_model_len", "kv_capacity"}


@dataclass(slots=True)
class _Tracked:
    """What this class keeps per live vLLM request besides the vLLM ``Request`` itself."""

    request: Request
    rid: str
    core_id: int
    eos_token_id: int | None
    # Whether the model runner holds the request's state (its block table): False before the
    # first schedule and after a preemption.
    on_runner: bool = False
    ever_scheduled: bool = False
    lora_id: int = 0  # vLLM's lora_int_id, 0 without an adapter
    # A streaming-input session's next turn: it goes to the runner as a new request (vLLM's way).
    next_turn: bool = False


@dataclass
class _InFlight:
    """One scheduled step, until update_from_output: the SchedulerOutput vLLM will hand back,
    the core's batch and its rows' vLLM ids."""

    output: SchedulerOutput
    batch: Any
    row_req_ids: list[str]
    # Each decode row's drafts as scheduled (vLLM's scheduled_spec_decode_tokens).
    drafts: dict[str, list[int]] = field(default_factory=dict)


class AtomScheduler(SchedulerInterface):
    """vLLM's ``SchedulerInterface`` on atom_sched's core (synchronous or async scheduling)."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        structured_output_manager: Any,
        block_size: int,
        hash_block_size: int | None = None,
        mm_registry: MultiModalRegistry = MULTIMODAL_REGISTRY,
        include_finished_set: bool = False,
        log_stats: bool = False,
    ) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.structured_output_manager = structured_output_manager
        self.scheduler_config = vllm_config.scheduler_config
        self.cache_config = vllm_config.cache_config
        self.log_stats = log_stats
        self.block_size = block_size
        self.hash_block_size = hash_block_size if hash_block_size is not None else block_size
        self._check_supported(vllm_config, kv_cache_config, block_size, self.hash_block_size)

        # vLLM's EngineCore reads these attributes directly. The KV connector (vLLM's, role
        # SCHEDULER) answers the core through a bridge, made once the core exists.
        self.connector = make_kv_connector(vllm_config, kv_cache_config)
        self.ec_connector = None
        self._kv: VllmConnectorBridge | None = None

        self.max_model_len = vllm_config.model_config.max_model_len
        self.use_v2_model_runner = bool(getattr(vllm_config, "use_v2_model_runner", False))
        # Async scheduling (vLLM's AsyncScheduler): the next step is scheduled while this one
        # runs; the core schedules it one step ahead (two batches outstanding at most, as
        # vLLM's batch queue), the runner feeds each row the token it sampled last.
        self.async_scheduling = bool(getattr(self.scheduler_config, "async_scheduling", False))
        # The runner's sampling masks are passed through per request, as vLLM's scheduler does.
        self.return_sampling_mask = bool(
            getattr(vllm_config.model_config, "return_sampling_mask", False))
        num_blocks = int(kv_cache_config.num_blocks)
        sc = self.scheduler_config
        budget = getattr(sc, "max_num_scheduled_tokens", None) or sc.max_num_batched_tokens
        # vLLM's names: max_num_seqs is the model runner's slot count; max_num_active_seqs (if
        # set, at most max_num_seqs) caps admission into running, which is the core's limit.
        self.max_num_running_reqs = int(sc.max_num_seqs)
        self.max_num_active_reqs = int(getattr(sc, "max_num_active_seqs", None)
                                       or sc.max_num_seqs)
        self.max_num_scheduled_tokens = int(budget)
        chunked = bool(sc.enable_chunked_prefill)
        threshold = int(sc.long_prefill_token_threshold or 0) if chunked else 0
        policies = policy_options(getattr(vllm_config, "additional_config", None), str(sc.policy))
        # KV-cache events (--kv-events-config): the core records them, vLLM's publisher sends.
        kv_events = vllm_config.kv_events_config
        self.enable_kv_cache_events = bool(kv_events is not None
                                           and kv_events.enable_kv_cache_events)
        # Speculative decoding: K drafts a decode row at most, proposed by the runner after each
        # step's sampling and handed over through update_draft_token_ids() (or kept on the
        # device, with async scheduling); a drafter's KV slots past each row's tokens are
        # reserved by the core (num_lookahead_tokens: K for a draft model or EAGLE, K + 1 for
        # DFlash, else 0).
        self.num_spec_tokens = int(getattr(vllm_config, "num_speculative_tokens", 0) or 0)
        self.num_lookahead_tokens = int(getattr(vllm_config, "num_lookahead_tokens", 0) or 0)
        # A draft model reads one input token more than a row schedules, parallel drafting K - 1
        # or K more (vLLM's max_num_new_slots_for_drafting): vLLM charges each row that many of
        # max_num_batched_tokens (its input budget) on top of its tokens, and so does the core.
        spec = vllm_config.speculative_config
        self.draft_slots_per_row = int(getattr(spec, "max_num_new_slots_for_drafting", 0) or 0)
        # A drafter on the target's hidden states needs them for the tokens just before the
        # first computed one: a prefix hit gives its last block back (vLLM's EAGLE block drop,
        # unless disable_eagle_block_drop).
        drops_hit_block = getattr(spec, "use_eagle_block_drop", None)
        self.recompute_last_hit_block = bool(drops_hit_block is not None and drops_hit_block())
        # Multi-module MTP reads that many known prompt tokens past a chunk's end: no chunk ends
        # fewer than that many before the prompt's end (vLLM's _reserve_prefill_lookahead; an
        # EAGLE-family drafter's 1 constrains nothing).
        lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
        self.prefill_lookahead = lookahead if lookahead > 1 else 0
        core_budget = int(budget)
        if self.draft_slots_per_row:
            # One budget in the core: the input budget, or the scheduled-token cap if it is
            # lower (then stricter than vLLM, which applies the slots to the input budget only).
            core_budget = min(core_budget, int(sc.max_num_batched_tokens))
        # Per-request acceptance metrics in the response (vLLM's observability option).
        obs = getattr(vllm_config, "observability_config", None)
        self.spec_decode_metrics_level = getattr(obs, "per_request_spec_decode_metrics", "none")
        self.core_config = atom_sched.SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=self.max_num_active_reqs,
            max_num_batched_tokens=core_budget,
            max_model_len=self.max_model_len,
            enable_prefix_caching=bool(self.cache_config.enable_prefix_caching),
            enable_chunked_prefill=chunked,
            num_speculative_tokens=self.num_spec_tokens,
            num_lookahead_tokens=self.num_lookahead_tokens,
            draft_slots_per_row=self.draft_slots_per_row,
            recompute_last_hit_block=self.recompute_last_hit_block,
            prefill_lookahead_tokens=self.prefill_lookahead,
            # A request admitted with one token left verifies K -1 drafts, so a step of verify
            # rows keeps its uniform 1 + K shape for full CUDA graphs (vLLM's padding).
            pad_first_decode_rows=self.num_spec_tokens > 0,
            # A prompt's blocks shared from the step that computes them, as vLLM caches blocks
            # at allocation (identical prompts in one step, parallel sampling's children).
            publish_prompt_blocks_at_schedule=True,
            # vLLM's synchronous runner is given every input token: with a step in flight (a
            # batch queue) its requests sit out the next step, as in vLLM's Scheduler.
            schedule_ahead=self.async_scheduling,
            # Stops are per request (SamplingParams.stop_token_ids, EOS included): vLLM's EOS
            # comes with each request and may differ between them.
            eos_token_id=-1,
            policy="mixed",
            long_prefill_token_threshold=threshold,
            long_prefill_token_threshold_adaptive=bool(
                getattr(sc, "long_prefill_token_threshold_adaptive", False)),
            enable_kv_events=self.enable_kv_cache_events,
            # With a step in flight a connector's load into a reused block could race the
            # step's writes: freed blocks wait for it (vLLM's defer_block_free).
            fence_freed_blocks=(self.connector is not None and self.async_scheduling
                                and bool(vllm_config.kv_transfer_config.is_kv_consumer)),
            # A connector that hands KV off when a request finishes: a request preempted with
            # an output in flight must not finish by it, holding no blocks (vLLM's
            # requires_kv_delivery: that output is dropped and recomputed).
            drop_preempted_outputs=(self.connector is not None
                                    and bool(self.connector.requires_kv_delivery)),
            **policies,
        )
        self.core = atom_sched.Scheduler(self.core_config)
        # kv_load_failure_policy: "fail" ends a request whose KV failed to load, "recompute"
        # computes that KV again.
        self._recompute_failed_loads = (
            self.connector is not None
            and vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute")
        if self.connector is not None:
            self._kv = VllmConnectorBridge(
                self.connector, block_size,
                lambda core_id: self._tracked_by_core_id[core_id].request)
            self.core.set_kv_connector(self._kv)
        self.kv_event_publisher = EventPublisherFactory.create(
            kv_events, getattr(vllm_config.parallel_config, "data_parallel_index", 0))
        c = self.core_config
        logger.info(
            "atom_sched scheduler: %d KV blocks of %d tokens, max_num_seqs=%d, %d tokens a step, "
            "prefix caching %s, chunked prefill %s, %s scheduling, %s victims, admission "
            "watermark %d blocks, %d speculative tokens", num_blocks, block_size, sc.max_num_seqs,
            budget, "on" if c.enable_prefix_caching else "off", "on" if chunked else "off",
            c.scheduling, c.preemption_victim, c.admission_watermark_blocks, self.num_spec_tokens)
        # DP prefill balancing (schedule(throttle_prefills=True)): whether the last step that
        # admitted prefills left requests waiting, as vLLM's scheduler keeps it.
        self.prefill_capacity_bound = False

        self.requests: dict[str, Request] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._by_core_id: dict[int, str] = {}
        self._tracked_by_core_id: dict[int, _Tracked] = {}  # the hot path's map
        self._next_core_id = itertools.count()
        # Ids finished since the last schedule() (the model runner frees their state), and per
        # client for include_finished_set (vLLM's multi-engine bookkeeping).
        self.finished_req_ids: set[str] = set()
        self.finished_req_ids_dict: dict[int, set[str]] | None = (
            defaultdict(set) if include_finished_set else None
        )
        self._preempted_since_schedule: set[str] = set()
        # Requests held outside the core, in arrival order, until they can join it
        # (_ready_for_core): their grammar compiling, or no slot for their LoRA adapter.
        self._held: dict[str, Request] = {}
        # Streaming-input sessions (held or in the core): the inputs that arrived while a turn
        # runs, for the turns after it (None: the stream closed).
        self._session_inputs: dict[str, SessionInputs] = {}
        # How many live requests use a grammar (0: the hot paths skip grammar work).
        self._num_structured = 0
        # LoRA: the runner holds at most max_loras adapters at once, so the requests in the core
        # use at most that many (lora_int_id -> how many of them use it).
        lora_config = getattr(vllm_config, "lora_config", None)
        self.max_loras = int(lora_config.max_loras) if lora_config is not None else 0
        self._loras_in_core: Counter[int] = Counter()
        self._lora_ids: dict[str, int] = {}  # name -> lora_int_id, for KV events
        # Requests whose drafts the runner handed over and no row has verified yet (their vLLM
        # Request's spec_token_ids show them, as with vLLM's scheduler).
        self._drafted: set[str] = set()
        self._in_flight: list[_InFlight] = []
        # Outputs of requests finished outside update_from_output (rejected by the core),
        # delivered with the next update_from_output.
        self._pending_outputs: list[tuple[int, EngineCoreOutput]] = []
        self._pause_state = PauseState.UNPAUSED
        self._num_preemptions_seen = 0
        self._prefix_stats = PrefixCacheStats()
        self._prefix_reset = False
        self._spec_stats: SpecDecodingStats | None = None

    # ---- construction checks ----------------------------------------------------------------

    @staticmethod
    def _check_supported(vllm_config: Any, kv_cache_config: Any, block_size: int,
                         hash_block_size: int) -> None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups) or "none"
            raise _refuse(f"hybrid or empty KV caches ({len(groups)} KV-cache groups: {kinds})",
                          "it serves models whose layers share one full-attention KV cache.")
        spec = groups[0].kv_cache_spec
        if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None):
            raise _refuse(f"the KV-cache kind {type(spec).__name__}",
                          "it serves full-attention models only.")
        if spec.block_size != block_size or hash_block_size != block_size:
            raise _refuse(
                f"a scheduler block size ({block_size}) or hash block size ({hash_block_size}) "
                f"other than the KV cache's ({spec.block_size})", "leave them at the default.")
        mc = vllm_config.model_config
        if getattr(mc, "runner_type", "generate") != "generate":
            raise _refuse(f"pooling models (runner {mc.runner_type!r})",
                          "it serves generative models.")
        if getattr(mc, "is_encoder_decoder", False):
            raise _refuse("encoder-decoder models", "it serves decoder-only models.")
        if getattr(mc, "is_multimodal_model", False):
            raise _refuse("multimodal models (encoder inputs and the encoder cache)",
                          "it serves text-only models.")
        spec = vllm_config.speculative_config
        if spec is not None:
            if spec.method not in _DRAFT_METHODS:
                raise _refuse(f"the speculative method {spec.method!r}",
                              f"use {' or '.join(map(repr, _DRAFT_METHODS))} drafts or drop "
                              "--speculative-config.")
            if getattr(spec, "num_speculative_tokens_per_batch_size", None):
                raise _refuse("draft counts that vary with the batch size "
                              "(num_speculative_tokens_per_batch_size)",
                              "give num_speculative_tokens alone.")
            k = int(getattr(vllm_config, "num_speculative_tokens", 0) or 0)
            if not 1 <= k <= _MAX_DRAFTS:
                raise _refuse(f"{k} speculative tokens a step",
                              f"use num_speculative_tokens 1..{_MAX_DRAFTS}.")
        if getattr(vllm_config, "ec_transfer_config", None) is not None:
            raise _refuse("encoder-cache connectors (ec_transfer_config)",
                          "drop --ec-transfer-config.")
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise _refuse("pipeline parallelism", "use pipeline_parallel_size=1.")
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(pc, name, 1) > 1:
                raise _refuse(f"context parallelism ({name})", f"use {name}=1.")
        sc = vllm_config.scheduler_config
        if str(sc.policy) not in ("fcfs", "priority"):
            raise _refuse(f"the scheduling policy {sc.policy!r}", "use fcfs or priority.")
        if getattr(vllm_config, "diffusion_config", None) is not None:
            raise _refuse("diffusion language models (diffusion_config)",
                          "they use vLLM's DiffusionScheduler.")
        aux = getattr(vllm_config, "aux_output_config", None)
        if aux is not None and aux.enabled:
            raise _refuse("auxiliary outputs such as routed experts (aux_output_config)",
                          "drop --enable-return-routed-experts.")

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            self._session_input(rid, request)
            return
        sp = request.sampling_params
        problem = None
        if sp is None or request.pooling_params is not None:
            problem = "pooling requests"
        elif request.prompt_token_ids is None:
            problem = "prompt embeddings"
        elif request.mm_features:
            problem = "multimodal inputs"
        if problem is not None:
            # What a request asks for comes from its client: raising here would stop vLLM's
            # engine loop for every client, so the request alone ends, with an error.
            self._end_unserved(request, RequestStatus.FINISHED_ERROR,
                               f"{problem} (not supported by atom_sched's scheduler yet)")
            return
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)
        self._num_structured += request.use_structured_output
        if request.resumable:
            self._session_inputs[rid] = SessionInputs()
        if self._ready_for_core(request):
            self._admit(request)
        else:
            self.requests[rid] = request
            self._held[rid] = request

    def _ready_for_core(self, request: Request) -> bool:
        """Whether a request can join the core now. Not while vLLM still compiles its grammar
        (grammar_init; vLLM's scheduler holds it back too), nor while the core's requests use
        max_loras other adapters (vLLM's rule: a batch uses at most max_loras; a request held
        for that waits until an adapter's last request ends)."""
        if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            return False
        lora = request.lora_request
        if not self.max_loras or lora is None or lora.lora_int_id <= 0:
            return True
        return (lora.lora_int_id in self._loras_in_core
                or len(self._loras_in_core) < self.max_loras)

    def _admit(self, request: Request) -> None:
        """Hands a request to the core (its values checked there) and tracks it."""
        rid = request.request_id
        sp = request.sampling_params
        tenant = request_tenant(sp.extra_args)
        if tenant is None:
            # A client's value, likewise: the request counts against the default tenant "".
            logger.warning("request %s: extra_args[%r] is not a str of at most 256 bytes; "
                           "counted against the default tenant", rid, TENANT_ARG)
            tenant = ""
        if request.kv_transfer_params and self.connector is None:
            logger.warning("request %s: kv_transfer_params ignored (no KV connector)", rid)
        eos = sp.eos_token_id
        lora = request.lora_request
        core_id = next(self._next_core_id)
        try:
            params = self._core_params(request, sp, request.max_tokens, tenant)
            # vLLM's arrival times are wall-clock; the core wants a finite number that orders
            # them.
            self.core.add_request(core_id, request.prompt_token_ids, params,
                                  arrival_time=float(request.arrival_time))
        except (ValueError, TypeError, OverflowError) as e:
            # A value the core refuses (a cache_salt over 256 bytes, a priority or token id out
            # of range...) is the client's: its request ends with an error, the core unchanged.
            self.requests.pop(rid, None)
            self._num_structured -= request.use_structured_output
            self._end_unserved(request, RequestStatus.FINISHED_ERROR, str(e))
            return
        # vLLM's engine core gives each request a block hasher for vLLM's own prefix cache: a
        # sha256 of each block the request's tokens complete, run on every appended token
        # (about a microsecond per request per step). The core hashes its blocks itself, and
        # without a KV connector (which may key its store by them) nothing vLLM runs with this
        # class reads Request.block_hashes (vLLM's KVCacheManager is never built), so the
        # output tokens are not hashed for it then: block_hashes keeps the prompt's blocks.
        if self.connector is None:
            request._block_hasher = None
        else:
            self.connector.on_new_request(request)
        if self.num_spec_tokens and self.spec_decode_metrics_level != "none":
            request.spec_decode_metrics = RequestSpecDecodeMetrics.new(self.num_spec_tokens)
        self.requests[rid] = request
        tracked = _Tracked(request, rid, core_id, eos)
        if lora is not None and lora.lora_int_id > 0:
            tracked.lora_id = lora.lora_int_id
            self._loras_in_core[lora.lora_int_id] += 1
            self._lora_ids[lora.lora_name] = lora.lora_int_id
        self._tracked[rid] = tracked
        self._by_core_id[core_id] = rid
        self._tracked_by_core_id[core_id] = tracked

    def _core_params(self, request: Request, sp: Any, max_tokens: int, tenant: str
                     ) -> atom_sched.SamplingParams:
        """The core's sampling parameters of a request (or of a session's next turn, with that
        turn's vLLM ``SamplingParams`` and ``max_tokens``)."""
        eos = sp.eos_token_id
        stops = sorted(set(sp.stop_token_ids or ()) | ({eos} if eos is not None else set()))
        lora = request.lora_request
        return atom_sched.SamplingParams(
            max_tokens=max(1, int(max_tokens)),
            ignore_eos=True,  # EOS is one of the stop ids above (none if ignore_eos)
            stop_token_ids=stops,
            min_tokens=min(int(sp.min_tokens or 0), max(1, int(max_tokens))),
            priority=int(request.priority) if self.core_config.scheduling == "priority" else 0,
            cache_salt=request.cache_salt or "",
            lora_name=lora.lora_name if lora is not None else "",
            tenant=tenant,
            resumable=bool(request.resumable),
        )

    # ---- streaming-input sessions -----------------------------------------------------------

    def _session_input(self, rid: str, request: Request) -> None:
        """A request with a live request's id: a session's next input (vLLM's rule). It starts
        the session's next turn if the session waits for input, else it waits for the turn to
        end; a request that is not resumable closes the stream (a session waiting for input
        then ends, aborted, as with vLLM's scheduler)."""
        inputs = self._session_inputs.get(rid)
        if inputs is None:
            raise ValueError(f"duplicate request id {rid!r} (not a streaming-input session)")
        update = StreamingUpdate.from_request(request)
        tracked = self._tracked.get(rid)
        if tracked is None or tracked.request.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
            inputs.append(update)  # (its turn runs, or it is held outside the core)
        elif update is None:
            self.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        else:
            self._start_next_turn(tracked, update)

    def _end_turn(self, tracked: _Tracked) -> None:
        """A session's turn ended (its output, with the turn's finish reason, is out): it waits
        for input, keeping its KV in the core, or takes the input that came meanwhile; if the
        stream closed meanwhile, it ends with this turn."""
        inputs = self._session_inputs[tracked.rid]
        if inputs and inputs[0] is None:
            self.core.end_session(tracked.core_id)
            self._free(tracked.rid)  # its status: the turn's finish
            return
        request = tracked.request
        request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
        tracked.on_runner = False  # the runner keeps its state; its next turn replaces it
        # All its tokens but the last, or none if it was preempted as its turn ended.
        request.num_computed_tokens = int(
            self.core.request_state(tracked.core_id)["num_computed_tokens"])
        request.num_output_placeholders = 0  # a row in flight lands dropped
        request.spec_token_ids = []
        self._drafted.discard(tracked.rid)
        if inputs:
            self._start_next_turn(tracked, inputs.popleft())

    def _start_next_turn(self, tracked: _Tracked, update: StreamingUpdate) -> None:
        """A session waiting for input takes its next turn: the core drops its last sampled
        token and prefills the new ones after its KV; the vLLM Request is rewritten to match."""
        request = tracked.request
        sp = update.sampling_params
        try:
            # (A session keeps its tenant, priority, LoRA and salt: the core checks the last two.)
            params = self._core_params(request, sp, update.max_tokens, tenant="")
            self.core.continue_session(tracked.core_id, list(update.prompt_token_ids or ()),
                                       params, arrival_time=float(update.arrival_time))
        except (ValueError, TypeError, OverflowError) as e:
            # The client's input (an empty chunk, a token id out of range...): the session
            # ends with an error, the core unchanged but for it.
            self.core.abort_request(tracked.core_id)
            self._end_unserved(request, RequestStatus.FINISHED_ERROR, str(e))
            self._free(tracked.rid)
            return
        start_next_turn(request, update, self.block_size)
        request.status = RequestStatus.WAITING
        tracked.next_turn = True
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def _admit_held(self) -> None:
        """Held requests that can now join the core do, in arrival order (one that cannot is
        passed over, as vLLM's scheduler skips it); one whose grammar failed to compile ends
        with an error (vLLM's rule)."""
        for rid, request in list(self._held.items()):
            if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
                grammar = request.structured_output_request.grammar
                if grammar is None:
                    continue  # still compiling
                if isinstance(grammar, Exception):
                    del self._held[rid]
                    self._num_structured -= 1
                    del self.requests[rid]
                    self._end_unserved(request, RequestStatus.FINISHED_ERROR,
                                       f"its grammar did not compile: {grammar}")
                    continue
                request.status = RequestStatus.WAITING
            if self._ready_for_core(request):
                del self._held[rid]
                self._admit(request)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            ids: Iterable[str] = (request_ids,)
        elif request_ids is None:
            ids = list(self.requests)
        else:
            ids = set(request_ids)
        finished = []
        for rid in ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            tracked = self._tracked.get(rid)
            if tracked is not None:  # else it is held outside the core
                try:
                    self.core.abort_request(tracked.core_id)
                except KeyError:
                    pass  # the core already ended it (rejected); vLLM's status decides
            request.status = finished_status
            self._free(rid)
            finished.append(request)
        return finished

    def _free(self, rid: str) -> None:
        tracked = self._tracked.pop(rid, None)
        if tracked is not None:
            self._by_core_id.pop(tracked.core_id, None)
            self._tracked_by_core_id.pop(tracked.core_id, None)
            if tracked.lora_id:
                self._loras_in_core[tracked.lora_id] -= 1
                if not self._loras_in_core[tracked.lora_id]:
                    del self._loras_in_core[tracked.lora_id]  # a slot for another adapter
        self._held.pop(rid, None)
        self._session_inputs.pop(rid, None)
        self._drafted.discard(rid)
        request = self.requests.pop(rid)
        self._num_structured -= request.use_structured_output
        self._preempted_since_schedule.discard(rid)
        self.finished_req_ids.add(rid)
        if self.finished_req_ids_dict is not None:
            self.finished_req_ids_dict[request.client_index].add(rid)

    # ---- schedule ---------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        if self._held:
            self._admit_held()
        batch = None
        if self._pause_state != PauseState.PAUSED_ALL:
            # PAUSED_NEW: nothing admitted from waiting; running requests go on (prompt chunks
            # too) and those whose connector KV has arrived join them (vLLM's rule).
            # throttle_prefills (vLLM's DP prefill balancing): no prefill compute this step, new
            # or a running request's next chunk, while a running request decodes, unless the
            # last step that admitted prefills could not drain the waiting queue.
            defer = (throttle_prefills and not self.prefill_capacity_bound
                     and any(not r.is_prefill_chunk for r in self.running))
            admit = self._pause_state == PauseState.UNPAUSED
            batch = self.core.schedule(allow_prefill=not defer, admit_waiting=admit)
            if admit and not defer:
                self.prefill_capacity_bound = self.core.num_waiting > 0
        self._take_rejected()
        self._note_preemptions()

        new_reqs: list[NewRequestData] = []
        cached_ids: list[str] = []
        resumed_ids: set[str] = set()
        cached_new_blocks: list[tuple[list[int], ...] | None] = []
        cached_computed: list[int] = []
        cached_outputs: list[int] = []
        all_token_ids: dict[str, list[int]] = {}
        num_scheduled: dict[str, int] = {}
        row_req_ids: list[str] = []
        drafts: dict[str, list[int]] = {}
        if batch is not None:
            # The batch's columns as Python lists at once (a numpy scalar per element costs
            # more than the whole row's bookkeeping). The blocks each row gets this step are the
            # core's device plan: new_block_ids[new_block_offsets[r]:new_block_offsets[r + 1]],
            # appended at the row's slot table, or its whole table when the slot starts a new
            # admission or a resume: what vLLM's runner appends, or takes as the new table.
            core_ids = batch.req_ids.tolist()
            n_sched = batch.num_scheduled_tokens.tolist()
            starts = batch.num_cached_tokens.tolist()
            offsets = batch.new_block_offsets.tolist()
            plan_blocks = batch.new_block_ids.tolist()
            tracked_of = self._tracked_by_core_id
            tracked_rows = [tracked_of[c] for c in core_ids]
            row_req_ids = [t.rid for t in tracked_rows]
            num_scheduled = dict(zip(row_req_ids, n_sched, strict=True))
            if all(t.on_runner for t in tracked_rows):
                # Steady state: the runner holds every row's request. The same as the loop
                # below, column by column: only the rows that got blocks carry them.
                requests = [t.request for t in tracked_rows]
                cached_ids = list(row_req_ids)
                cached_computed = starts
                cached_new_blocks = [None] * len(row_req_ids)
                for row in np.flatnonzero(np.diff(batch.new_block_offsets)).tolist():
                    cached_new_blocks[row] = (plan_blocks[offsets[row]:offsets[row + 1]],)
                cached_outputs = [request.num_output_tokens for request in requests]
                ends = (batch.num_cached_tokens + batch.num_scheduled_tokens).tolist()
                for request, end in zip(requests, ends, strict=True):
                    request.num_computed_tokens = end
                    # A row that ends short of the request's known tokens samples nothing.
                    request.is_prefill_chunk = end < request.num_tokens
            else:
                for row, tracked in enumerate(tracked_rows):
                    rid = row_req_ids[row]
                    request = tracked.request
                    start = starts[row]
                    lo, hi = offsets[row], offsets[row + 1]
                    if tracked.on_runner:
                        # The common row: the runner holds the request; only new blocks travel.
                        # (Its status is RUNNING since it went on the runner: a preemption
                        # takes it off, a finish frees it.)
                        cached_ids.append(rid)
                        cached_new_blocks.append((plan_blocks[lo:hi],) if hi > lo else None)
                        cached_computed.append(start)
                        cached_outputs.append(request.num_output_tokens)
                    else:
                        block_ids = (plan_blocks[lo:hi],)  # the slot's whole table
                        request.num_computed_tokens = start
                        request.status = RequestStatus.RUNNING
                        tracked.on_runner = True
                        if tracked.next_turn:
                            # A session's next turn: a new request for the runner, which
                            # replaces the session's state (vLLM's way).
                            tracked.next_turn = False
                            if self.log_stats:
                                request.record_event(EngineCoreEventType.SCHEDULED)
                            new_reqs.append(NewRequestData.from_request(
                                request, block_ids, self._runner_prefill(request)))
                        elif not tracked.ever_scheduled:
                            tracked.ever_scheduled = True
                            if request.prefill_stats is not None:
                                request.prefill_stats.set(request.num_prompt_tokens,
                                                          *self._cached_at_admission(rid, start))
                            if self.log_stats:
                                request.record_event(EngineCoreEventType.SCHEDULED)
                            new_reqs.append(NewRequestData.from_request(
                                request, block_ids, self._runner_prefill(request)))
                        else:
                            # Resumed after a preemption: the runner replaces its block table.
                            if self.log_stats:
                                request.record_event(EngineCoreEventType.SCHEDULED)
                            if self.use_v2_model_runner:
                                new_reqs.append(NewRequestData.from_request(
                                    request, block_ids, self._runner_prefill(request)))
                            else:
                                cached_ids.append(rid)
                                resumed_ids.add(rid)
                                cached_new_blocks.append(block_ids)
                                cached_computed.append(start)
                                cached_outputs.append(request.num_output_tokens)
                                all_token_ids[rid] = list(request.all_token_ids)
                    end = start + n_sched[row]
                    request.num_computed_tokens = end
                    # A row that ends short of the request's known tokens samples nothing.
                    request.is_prefill_chunk = end < request.num_tokens
            if self.num_spec_tokens:
                drafts = self._scheduled_drafts(batch, row_req_ids, n_sched)
                if self._drafted:
                    # The rows scheduled now verify them (or, at the position limit, drop them).
                    for rid in self._drafted.intersection(num_scheduled):
                        self.requests[rid].spec_token_ids = []
                    self._drafted.difference_update(num_scheduled)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=cached_ids,
                resumed_req_ids=resumed_ids,
                new_token_ids=[],
                all_token_ids=all_token_ids,
                new_block_ids=cached_new_blocks,
                num_computed_tokens=cached_computed,
                num_output_tokens=cached_outputs,
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=drafts,
            scheduled_encoder_inputs={},
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=[],
            preempted_req_ids=self._preempted_since_schedule,
            # How many drafts the runner's drafter proposes after this step.
            num_spec_tokens_to_schedule=self.num_spec_tokens,
        )
        if self._kv is not None:
            # Before this step's output placeholders (vLLM's order).
            self._kv.build_meta(out, self.core, lambda rid: self._tracked[rid].core_id)
        if self.async_scheduling and row_req_ids:
            out.pending_structured_output_tokens = self._add_output_placeholders(
                row_req_ids, cached_ids, cached_outputs, drafts)
        if self._num_structured:
            # get_grammar_bitmask() then builds the bitmask of the rows that sample.
            out.has_structured_output_requests = any(
                request.use_structured_output and not request.is_prefill_chunk
                for request in map(self.requests.get, row_req_ids) if request is not None)
        self.finished_req_ids = set()
        self._preempted_since_schedule = set()
        self._in_flight.append(_InFlight(out, batch, row_req_ids, drafts))
        return out

    def _runner_prefill(self, request: Request) -> list[int] | None:
        """The tokens a new request's NewRequestData carries for vLLM's V2 model runner (all
        of them: it takes a new or resumed request whole), none for the V1 runner."""
        return list(request.all_token_ids) if self.use_v2_model_runner else None

    def _cached_at_admission(self, rid: str, start: int) -> tuple[int, int]:
        """(local, external) cached tokens of a request's first admission, whose first row
        starts at ``start``: vLLM's prefill stats."""
        if self._kv is None:
            return start, 0
        return self._kv.cached_at_admission.pop(rid, (start, 0))

    def _add_output_placeholders(self, row_req_ids: list[str], cached_ids: list[str],
                                 cached_outputs: list[int], drafts: dict[str, list[int]]
                                 ) -> bool:
        """Async scheduling: vLLM's AsyncScheduler bookkeeping. A request's outputs the runner
        will sample but the scheduler has not seen are placeholders: the runner counts them in
        its outputs (num_output_tokens), each row that samples adds its own, and each output
        that lands takes them off (a preemption clears them). Returns whether a row that
        samples under a grammar still waits for such an output (vLLM's
        pending_structured_output_tokens: the bitmask waits for it)."""
        requests = self.requests
        for i, rid in enumerate(cached_ids):
            cached_outputs[i] += requests[rid].num_output_placeholders
        pending = False
        for rid in row_req_ids:
            request = requests[rid]
            if request.is_prefill_chunk:
                continue
            pending |= request.use_structured_output and request.num_output_placeholders > 0
            request.num_output_placeholders += 1 + len(drafts.get(rid, ()))
        return pending

    @staticmethod
    def _scheduled_drafts(batch: Any, row_req_ids: list[str], n_sched: list[int]
                          ) -> dict[str, list[int]]:
        """The drafts each decode row verifies: its first ``num_scheduled_tokens - 1`` (fewer
        than proposed only near the position limit), as vLLM's scheduled_spec_decode_tokens."""
        rows = np.flatnonzero((batch.num_scheduled_tokens > 1)
                              & (batch.row_is_prefill == 0)).tolist()
        if not rows:
            return {}
        table = batch.spec_draft_tokens[rows].tolist()
        return {row_req_ids[r]: d[:n_sched[r] - 1] for r, d in zip(rows, table, strict=True)}

    def _take_rejected(self) -> None:
        """Requests the core refused: a prompt it can never hold is FINISHED_IGNORED, as vLLM;
        one whose KV-connector call failed is FINISHED_ERROR (vLLM's scheduler would raise in
        its engine loop)."""
        for rej in self.core.take_rejected():
            rid = self._by_core_id.get(int(rej.request_id))
            if rid is not None:
                status = (RequestStatus.FINISHED_ERROR
                          if rej.reason.startswith("kv connector error")
                          else RequestStatus.FINISHED_IGNORED)
                self._end_unserved(self.requests[rid], status, rej.reason)
                self._free(rid)
        if self._kv is not None:
            self._log_connector_errors()

    def _log_connector_errors(self) -> None:
        """Every failed connector call, a request rejected for it or not (a failing
        request_finished frees the request's blocks at once, its transfer given up)."""
        for error in self.core.take_connector_errors():
            logger.error("KV connector call failed: %s", error)

    def _end_unserved(self, request: Request, status: RequestStatus, why: str) -> None:
        """Ends a request that gets no token: its final output (no tokens, the status's finish
        reason) goes out with the next update_from_output."""
        logger.warning("request %s not served: %s", request.request_id, why)
        request.status = status
        self._pending_outputs.append((request.client_index, EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[],
            finish_reason=request.get_finished_reason(), events=request.take_events(),
            trace_headers=request.trace_headers)))
        if self.finished_req_ids_dict is not None and request.request_id not in self.requests:
            # Never tracked (refused at add_request): _free() does not list it.
            self.finished_req_ids_dict[request.client_index].add(request.request_id)

    def _note_preemptions(self) -> None:
        """Requests the core preempted in this schedule(): the runner drops their state."""
        count = int(self.core.stats()["num_preemptions"])
        if count == self._num_preemptions_seen:
            return
        self._num_preemptions_seen = count
        running = set(self.core.running_ids())
        now = time.monotonic()
        for rid, tracked in self._tracked.items():
            if tracked.on_runner and tracked.core_id not in running:
                tracked.on_runner = False
                request = tracked.request
                request.status = RequestStatus.PREEMPTED
                request.num_computed_tokens = 0
                request.num_output_placeholders = 0  # an output in flight lands all the same
                request.num_preemptions += 1
                if self.log_stats:
                    request.record_event(EngineCoreEventType.PREEMPTED, now)
                self._preempted_since_schedule.add(rid)

    # ---- outputs ----------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any) -> dict[int, EngineCoreOutputs]:
        if not self._in_flight or self._in_flight[0].output is not scheduler_output:
            # vLLM hands its outputs back in the order schedule() returned them (its batch
            # queue is FIFO); anything else would apply one step's tokens to another's rows.
            raise ValueError("update_from_output() takes the oldest SchedulerOutput this "
                             "scheduler returned and has not had back "
                             f"({len(self._in_flight)} outstanding)")
        step = self._in_flight.pop(0)
        kv_output = (getattr(model_runner_output, "kv_connector_output", None)
                     if self._kv is not None else None)
        if kv_output is not None and (kv_output.invalid_block_ids or kv_output.failed_recving):
            # Before the step's tokens apply: a row computed on KV that never arrived streams
            # nothing.
            handle = (self._recompute_kv_loads if self._recompute_failed_loads
                      else self._fail_kv_loads)
            handle(set(kv_output.invalid_block_ids), set(kv_output.failed_recving or ()))
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        if step.batch is not None:
            self._apply(step, scheduler_output, model_runner_output, outputs)
        # Requests ended without a token (refused, failed loads, a row the runner left empty),
        # this step's included.
        for client_index, eco in self._pending_outputs:
            outputs[client_index].append(eco)
        self._pending_outputs = []
        kv_connector_stats = None
        if self._kv is not None:
            kv_connector_stats = self._kv_transfers_done(kv_output)
            self._log_connector_errors()
        events = []
        if self.enable_kv_cache_events:
            # This step's (and, before it, schedule()'s and a reset's) cache changes.
            events = to_vllm_events(self.core.take_events(), self._lora_ids)
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

        result = {ci: EngineCoreOutputs(outputs=outs) for ci, outs in outputs.items()}
        if self.finished_req_ids_dict:
            for ci, finished in self.finished_req_ids_dict.items():
                if (eco := result.get(ci)) is not None:
                    eco.finished_requests = finished
                else:
                    result[ci] = EngineCoreOutputs(finished_requests=finished)
            self.finished_req_ids_dict.clear()
        stats = self.make_stats(kv_connector_stats=kv_connector_stats)
        if stats is not None:
            if (eco := next(iter(result.values()), None)) is None:
                result[0] = eco = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return result

    def _failed_loads(self, invalid_block_ids: set[int], failed_ids: set[str]
                      ) -> Iterator[tuple[_Tracked, dict[str, Any], int]]:
        """The requests a KV load failure hits, with their core state and the position their KV
        fails from: the first block that failed to load, or, for a failed receive, the end of
        their local hits."""
        for rid, tracked in list(self._tracked.items()):
            try:
                state = self.core.request_state(tracked.core_id)
            except KeyError:
                continue
            if rid in failed_ids:
                yield tracked, state, int(state["prefix_hit_tokens"])
                continue
            first = next((i for i, block in enumerate(state["block_table"])
                          if block in invalid_block_ids), None)
            if first is not None:
                yield tracked, state, first * self.block_size

    def _fail_kv_loads(self, invalid_block_ids: set[int], failed_ids: set[str]) -> None:
        """vLLM's kv_load_failure_policy 'fail': a request holding a block whose KV failed to
        load, or whose receive failed, ends with an error."""
        for tracked, _, _ in self._failed_loads(invalid_block_ids, failed_ids):
            self._end_failed_load(tracked, "kv_load_failure_policy 'fail'")

    def _end_failed_load(self, tracked: _Tracked, why: str) -> None:
        self.core.abort_request(tracked.core_id)
        self._end_unserved(tracked.request, RequestStatus.FINISHED_ERROR,
                           f"its KV failed to load ({why})")
        self._free(tracked.rid)

    def _recompute_kv_loads(self, invalid_block_ids: set[int], failed_ids: set[str]) -> None:
        """vLLM's kv_load_failure_policy 'recompute': a request's KV from where it failed is
        computed again, the core rewinding a running request (its output of this step dropped)
        or cutting a load it waits for; one whose failed block the prefix cache already serves
        ends with an error."""
        rescheduled = recomputed = 0
        for tracked, state, position in self._failed_loads(invalid_block_ids, failed_ids):
            try:
                self.core.recompute_kv_from(tracked.core_id, position)
            except ValueError as e:
                self._end_failed_load(tracked, f"it cannot be recomputed: {e}")
                continue
            request = tracked.request
            before = int(state["num_computed_tokens"])
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                request.num_computed_tokens = min(request.num_computed_tokens, position)
            elif int(self.core.request_state(tracked.core_id)["num_computed_tokens"]) < before:
                request.num_computed_tokens = position
                request.is_prefill_chunk = True
                request.num_output_placeholders = 0  # its outputs in flight are dropped
                request.spec_token_ids = []
                self._drafted.discard(tracked.rid)
            else:
                continue
            rescheduled += 1
            recomputed += max(0, before - position)
        if rescheduled:
            logger.warning("KV load failure: %d request(s) compute the failed KV again "
                           "(kv_load_failure_policy 'recompute', %d tokens)", rescheduled,
                           recomputed)

    def _kv_transfers_done(self, kv_output: Any) -> Any:
        """The workers' connector output to the connector, their finished transfers to the
        core (the blocks of a finished send are free; a request whose KV arrived is admitted
        at the next schedule()); returns the step's KV connector stats (workers' and
        scheduler's)."""
        stats = None
        if kv_output is not None:
            self.connector.update_connector_output(kv_output)
            self._kv.report(self.core, kv_output.finished_sending or (),
                            kv_output.finished_recving or ())
            stats = kv_output.kv_connector_stats
        own = self.connector.get_kv_connector_stats()
        if own is not None and not own.is_empty():
            stats = stats.aggregate(own) if stats is not None else own
        return stats

    def _cached_prompt_tokens(self, request: Request) -> int:
        """The prompt tokens in the prefix cache once the prompt is computed: its whole blocks
        (the core publishes each full block as it is computed), none without prefix caching."""
        if not self.core_config.enable_prefix_caching:
            return 0
        return request.num_prompt_tokens // self.block_size * self.block_size

    def _runner_tokens(self, step: _InFlight, mro: Any) -> list[list[int] | None]:
        """Each row's tokens from the runner, None where it sampled none. A row that should
        have sampled and got nothing (the runner and the core disagree: never guessed) ends its
        request with an error, before the core applies the step; the engine goes on (vLLM's
        scheduler counts it as no token and leaves the request running)."""
        sampled_lists = mro.sampled_token_ids
        if sampled_lists:
            index = mro.req_id_to_index
            per_row = [sampled_lists[i] if i is not None else None
                       for i in map(index.get, step.row_req_ids)]
        else:
            per_row = [None] * len(step.row_req_ids)
        if not all(per_row):  # a row without tokens: fine only where it samples nothing
            emits = step.batch.emits_token
            for row, toks in enumerate(per_row):
                rid = step.row_req_ids[row]
                if not toks and emits[row] and rid in self._tracked:
                    request = self.requests[rid]
                    self.finish_requests(rid, RequestStatus.FINISHED_ERROR)
                    self._end_unserved(request, RequestStatus.FINISHED_ERROR,
                                       "the model runner sampled no token for its row, which "
                                       "completes its prompt or decodes")
        return per_row

    def _sampled_tokens(self, step: _InFlight, mro: Any) -> np.ndarray:
        """Without drafts: each row's sampled token (0 for a row that samples nothing)."""
        return np.array([toks[0] if toks else 0 for toks in self._runner_tokens(step, mro)],
                        dtype=np.int32)

    def _verified_tokens(self, step: _InFlight, scheduler_output: SchedulerOutput, mro: Any
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """With drafts: the core's (sampled [rows, K+1], accepted [rows], drafts [rows, K]).

        A decode row's tokens are its accepted drafts and the runner's bonus token; the rest of
        its drafts were rejected, so the vLLM ``Request`` rolls its computed count back by them
        (vLLM's rule), and the step's spec-decoding stats count them. Next step's drafts come
        later, through update_draft_token_ids(): none are handed over here."""
        per_row = self._runner_tokens(step, mro)
        k = self.num_spec_tokens
        sampled = np.zeros((len(per_row), k + 1), dtype=np.int32)
        accepted = np.ones(len(per_row), dtype=np.int32)
        for row, toks in enumerate(per_row):
            if toks:
                if len(toks) > k + 1:
                    raise RuntimeError(
                        f"the model runner returned {len(toks)} tokens for request "
                        f"{step.row_req_ids[row]!r}, more than 1 + {k} drafts")
                sampled[row, :len(toks)] = toks
                accepted[row] = len(toks)
        if step.drafts:
            row_of = {rid: row for row, rid in enumerate(step.row_req_ids)}
            # Drafts a grammar invalidated are not counted as proposed (vLLM's stats rule).
            invalid = scheduler_output.num_invalid_spec_tokens or {}
            for rid, drafts in step.drafts.items():
                row = row_of[rid]
                if not per_row[row]:
                    continue  # finished by vLLM while in flight: the runner dropped it
                num_accepted = int(accepted[row]) - 1
                num_proposed = len(drafts) - invalid.get(rid, 0)
                tracked = self._tracked.get(rid)
                if tracked is not None and tracked.on_runner:
                    # (Preempted since: its counts restarted, this output predates them.)
                    request = tracked.request
                    request.num_computed_tokens -= len(drafts) - num_accepted
                    if request.num_output_placeholders:
                        # Async scheduling: the placeholders covered the rejected drafts too.
                        request.num_output_placeholders = max(
                            0, request.num_output_placeholders - (len(drafts) - num_accepted))
                    if request.spec_decode_metrics is not None:
                        request.spec_decode_metrics.observe(
                            num_draft_tokens=num_proposed, num_accepted=num_accepted,
                            detailed=self.spec_decode_metrics_level == "detailed")
                if self.log_stats and num_proposed:
                    if self._spec_stats is None:
                        self._spec_stats = SpecDecodingStats.new(k)
                    self._spec_stats.observe_draft(num_draft_tokens=num_proposed,
                                                   num_accepted_tokens=num_accepted)
        return sampled, accepted, np.full((len(per_row), k), -1, dtype=np.int32)

    def _apply(self, step: _InFlight, scheduler_output: SchedulerOutput, mro: Any,
               outputs: dict[int, list[EngineCoreOutput]]) -> None:
        if self.num_spec_tokens:
            step_out = self.core.update(step.batch,
                                        *self._verified_tokens(step, scheduler_output, mro))
        else:
            step_out = self.core.update(step.batch, self._sampled_tokens(step, mro))
        # The step's columns as Python lists at once, as in schedule().
        core_ids = step_out.request_ids.tolist()
        new_tokens = step_out.new_tokens.tolist()
        finished_flags = step_out.finished.tolist()
        cached = step_out.num_cached_tokens.tolist()
        # Each entry's request, looked up once (None: finished by vLLM while in flight).
        rows = list(map(self._tracked_by_core_id.get, core_ids))
        if (len(new_tokens) == len(core_ids) and not any(finished_flags)
                and not step_out.num_awaiting_input
                and not self._num_structured and not self.async_scheduling
                and mro.logprobs is None and not mro.prompt_logprobs_dict
                and getattr(mro, "num_nans_in_logits", None) is None
                and (getattr(mro, "sampling_masks", None) is None
                     or not self.return_sampling_mask)
                and None not in rows):
            self._apply_steady(step_out, rows, new_tokens, cached, mro, outputs)
            return
        offsets = step_out.token_offsets.tolist()
        turn_ends = step_out.awaiting_input.tolist()  # sessions' turns that ended
        for k, (tracked, lo, hi, done, turn_end, num_cached) in enumerate(
                zip(rows, offsets[:-1], offsets[1:], finished_flags, turn_ends, cached,
                    strict=True)):
            if tracked is None:
                continue  # finished by vLLM (finish_requests) while in flight
            self._entry_output(step_out, k, tracked, new_tokens[lo:hi], done, num_cached, mro,
                               outputs, turn_end)

    def _apply_steady(self, step_out: Any, rows: list[_Tracked], new_tokens: list[int],
                      cached: list[int], mro: Any, outputs: dict[int, list[EngineCoreOutput]]
                      ) -> None:
        """A step where every entry brings one token and nothing ends, and nothing asks for
        logprobs, masks or grammars: what _entry_output() does, with the work none of it needs
        left out. An entry with anything more to report (its first output's prefill stats, its
        events, trace headers, another client) goes through _entry_output()."""
        first_client: list[EngineCoreOutput] = []
        for k, (tracked, token) in enumerate(zip(rows, new_tokens, strict=True)):
            request = tracked.request
            if (request.prefill_stats is not None or request.events or request.client_index
                    or request.trace_headers is not None):
                self._entry_output(step_out, k, tracked, [token], False, cached[k], mro,
                                   outputs)
                continue
            # Request.append_output_token_ids() without its call overhead (it extends these two
            # lists, then runs the block hasher, which the class removed at add_request).
            request._output_token_ids.append(token)
            request._all_token_ids.append(token)
            first_client.append(EngineCoreOutput(tracked.rid, [token]))
        if first_client:
            outputs[0].extend(first_client)

    def _entry_output(self, step_out: Any, k: int, tracked: _Tracked, tokens: list[int],
                      done: bool, num_cached: int, mro: Any,
                      outputs: dict[int, list[EngineCoreOutput]], turn_end: bool = False
                      ) -> None:
        """Entry ``k`` of the core's step output as the vLLM ``Request``'s new tokens, status and
        stats, and its ``EngineCoreOutput``; a finished request is freed. ``turn_end``: a
        session's turn ended (its output carries the turn's finish reason, as vLLM's)."""
        rid = tracked.rid
        request = tracked.request
        rejected_by_grammar = False
        if tokens:
            request.append_output_token_ids(tokens)
            if self.async_scheduling:
                request.num_output_placeholders = max(
                    0, request.num_output_placeholders - len(tokens))
            if (request.use_structured_output
                    and not self.structured_output_manager.accept_tokens(request, tokens)):
                # vLLM's rule: a token its grammar rejects ends the request with an error.
                logger.error("request %s: its grammar rejected tokens %s; ended", rid, tokens)
                if not done:
                    self.core.abort_request(tracked.core_id)
                done = rejected_by_grammar = True
                turn_end = False  # (vLLM's rule: a session ends with it)
        finish_reason = None
        if done or turn_end:
            reason = step_out.finish_reason(k) or ""
            if rejected_by_grammar:
                request.status = RequestStatus.FINISHED_ERROR
            elif reason in _LENGTH_REASONS:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            elif reason == "abort":
                request.status = RequestStatus.FINISHED_ABORTED
            else:  # "eos" never occurs (ignore_eos); "stop_<id>" covers EOS too
                request.status = RequestStatus.FINISHED_STOPPED
                last = tokens[-1] if tokens else None
                if last is not None and last != tracked.eos_token_id:
                    request.stop_reason = last
            finish_reason = request.get_finished_reason()
        new_logprobs = None
        new_sampling_mask = None
        logprobs = mro.logprobs
        masks = getattr(mro, "sampling_masks", None) if self.return_sampling_mask else None
        if tokens and (logprobs is not None or masks is not None):
            i = mro.req_id_to_index.get(rid)
            if i is not None:
                if logprobs is not None and request.sampling_params.logprobs is not None:
                    new_logprobs = logprobs.slice_request(i, len(tokens))
                if masks is not None:
                    new_sampling_mask = masks.slice_request(i, len(tokens))
        prefill_stats = None
        if request.prefill_stats is not None:
            prefill_stats = request.take_prefill_stats()
            # The prompt tokens the cache holds now, its hits and what it wrote (vLLM's
            # estimate_cached_tokens): the cache-creation count is the difference.
            prefill_stats.finalize(self._cached_prompt_tokens(request))
            self._prefix_stats.record(num_tokens=request.num_prompt_tokens, num_hits=num_cached,
                                      preempted=request.num_preemptions > 0)
        prompt_logprobs = mro.prompt_logprobs_dict
        nans = getattr(mro, "num_nans_in_logits", None)
        outputs[request.client_index].append(EngineCoreOutput(
            request_id=rid,
            new_token_ids=tokens,
            finish_reason=finish_reason,
            new_logprobs=new_logprobs,
            new_sampling_mask=new_sampling_mask,
            new_prompt_logprobs_tensors=prompt_logprobs.get(rid) if prompt_logprobs else None,
            stop_reason=request.stop_reason,
            events=request.take_events() if request.events else None,
            prefill_stats=prefill_stats,
            spec_decode_metrics=request.spec_decode_metrics if finish_reason else None,
            kv_transfer_params=(self._kv.take_params(rid)
                                if finish_reason and self._kv is not None else None),
            trace_headers=request.trace_headers,
            num_nans_in_logits=nans.get(rid, 0) if nans else 0,
        ))
        if turn_end:
            self._end_turn(tracked)
        elif finish_reason is not None:
            self._free(rid)

    # ---- vLLM's Scheduler attributes engines and tools read -----------------------------------

    @property
    def running(self) -> list[Request]:
        """The running requests, in the core's order (a snapshot: changing it changes nothing)."""
        return self._requests_of(self.core.running_ids())

    @property
    def waiting(self) -> list[Request]:
        """The waiting requests (preempted ones included), head first, then those held outside
        the core (their grammar compiling, or no slot for their LoRA; a snapshot)."""
        return self._requests_of(self.core.waiting_ids()) + list(self._held.values())

    def _requests_of(self, core_ids: Iterable[int]) -> list[Request]:
        by_id = self._by_core_id
        return [self.requests[by_id[i]] for i in core_ids if i in by_id]

    def reset_connector_cache(self) -> bool:
        if self.connector is None:
            return True  # nothing to reset (vLLM's answer without a connector)
        if self.connector.reset_cache() is False:
            return False
        self._kv.prefix_stats.reset = True
        return True

    def get_kv_connector(self) -> Any:
        return self.connector

    def has_requests(self) -> bool:
        # A connector still pushing KV keeps the engine stepping (vLLM's rule).
        return (self.has_unfinished_requests() or self.has_finished_requests()
                or (self.connector is not None and self.connector.has_pending_push_work()))

    # ---- the rest of SchedulerInterface -----------------------------------------------------

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The grammar bitmask of the scheduled rows that sample and use structured output,
        from vLLM's structured-output manager, as vLLM's scheduler builds it."""
        if not scheduler_output.has_structured_output_requests:
            return None
        ids = [rid for rid in scheduler_output.num_scheduled_tokens
               if (r := self.requests.get(rid)) is not None
               and r.use_structured_output and not r.is_prefill_chunk]
        if not ids:
            return None
        spec = scheduler_output.scheduled_spec_decode_tokens
        bitmask = self.structured_output_manager.grammar_bitmask(self.requests, ids, spec)
        acceptable = [len(strip_speculative_padding(spec.get(rid, []))) for rid in ids]
        return GrammarOutput(ids, bitmask, acceptable)

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """The drafts the runner proposed after the last step (n-gram): each decoding request's
        next row verifies them (the core's set_drafts). As vLLM's scheduler, drafts of finished
        requests and of prompt chunks are dropped."""
        if not self.num_spec_tokens:
            raise _refuse("draft tokens without speculative decoding",
                          "no draft tokens are expected.")
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids,
                               strict=True):
            tracked = self._tracked.get(rid)
            if tracked is None or not tracked.on_runner or tracked.request.is_prefill_chunk:
                continue
            if tracked.request.use_structured_output:
                # Only the prefix its grammar allows (vLLM's rule).
                drafts = self.structured_output_manager.validate_tokens(tracked.request,
                                                                        list(drafts))
            try:
                self.core.set_drafts(tracked.core_id, drafts)
            except ValueError as e:
                # A draft the core cannot verify (more than K, a negative id) is the drafter's
                # bug, not the request's: the row verifies none and decodes one token.
                logger.warning("request %s: drafts dropped: %s", rid, e)
                drafts = []
            tracked.request.spec_token_ids = list(drafts)
            if drafts:
                self._drafted.add(rid)

    def update_draft_token_ids_in_output(self, draft_token_ids: Any,
                                         scheduler_output: SchedulerOutput) -> None:
        """Async scheduling: the drafts the runner proposed for a step already scheduled with
        placeholders, given only for the grammar bitmask of a structured-output step (vLLM's
        engine defers that step's sampling). As vLLM's scheduler: each request's drafts cut to
        the placeholders it was scheduled with, then to what its grammar allows, padded with -1
        (counted in num_invalid_spec_tokens, not in the stats)."""
        if not self.num_spec_tokens:
            raise _refuse("draft tokens without speculative decoding",
                          "no draft tokens are expected.")
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        invalid: dict[str, int] = {}
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids,
                               strict=True):
            request = self.requests.get(rid)
            placeholders = scheduled.get(rid)
            if request is None or request.is_finished() or not placeholders:
                continue
            drafts = list(drafts)[:len(placeholders)]
            if request.use_structured_output:
                drafts = self.structured_output_manager.validate_tokens(request, drafts)
            num_invalid = len(placeholders) - len(drafts)
            if num_invalid:
                drafts.extend([-1] * num_invalid)
                invalid[rid] = num_invalid
            scheduled[rid] = drafts
        scheduler_output.num_invalid_spec_tokens = invalid

    def get_num_unfinished_requests(self) -> int:
        # vLLM's rule while paused: PAUSED_ALL runs nothing, PAUSED_NEW drains the running
        # requests and those holding KV blocks for a load; the queued ones wait for the resume.
        # Sessions waiting for input are not unfinished work (vLLM's rule).
        if self._pause_state == PauseState.UNPAUSED:
            return len(self.requests) - int(self.core.num_waiting_for_input)
        if self._pause_state == PauseState.PAUSED_ALL:
            return 0
        loading = sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                      for r in self.requests.values())
        return int(self.core.num_running) + loading

    def has_finished_requests(self) -> bool:
        # Final outputs still to deliver count too: vLLM's engine steps (schedule, then
        # update_from_output) only while this or unfinished requests say so.
        # So do requests whose KV waits on a transfer report: the engine steps to collect it.
        return (len(self.finished_req_ids) > 0 or len(self._pending_outputs) > 0
                or (self._kv is not None and len(self._kv.awaiting_report) > 0))

    @property
    def pause_state(self) -> PauseState:
        return self._pause_state

    def set_pause_state(self, pause_state: PauseState) -> None:
        self._pause_state = PauseState(pause_state)

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        if reset_running_requests:
            if self._in_flight:
                return False  # a batch is outstanding: its tokens must land first
            for core_id in list(self.core.running_ids()):
                self.core.preempt_request(core_id)
            self._note_preemptions()
        elif self.core.num_running:
            # vLLM's rule: the cache is reset only while no running request holds blocks.
            return False
        self.core.reset_prefix_cache()
        self._prefix_reset = True
        return self.reset_connector_cache() if reset_connector else True

    def reset_encoder_cache(self) -> None:
        pass  # multimodal models are refused: there is no encoder cache

    def get_request_counts(self) -> tuple[int, int]:
        # (Sessions waiting for input count as waiting, as in vLLM's KV-holding queue.)
        return (int(self.core.num_running), int(self.core.num_waiting)
                + int(self.core.num_waiting_for_input) + len(self._held))

    def get_kv_cache_usage(self) -> float:
        usable = self.core.num_usable_blocks
        return 1.0 - self.core.num_free_blocks / usable if usable else 0.0

    def make_stats(self, *args: Any, kv_connector_stats: Any = None, **kwargs: Any
                   ) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        connector_prefix_stats = None
        if self._kv is not None:
            connector_prefix_stats, self._kv.prefix_stats = (self._kv.prefix_stats,
                                                             PrefixCacheStats())
        prefix_stats, self._prefix_stats = self._prefix_stats, PrefixCacheStats()
        prefix_stats.reset, self._prefix_reset = self._prefix_reset, False
        running, waiting = self.get_request_counts()
        spec_stats, self._spec_stats = self._spec_stats, None
        return SchedulerStats(
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            kv_cache_usage=self.get_kv_cache_usage(),
            prefix_cache_stats=prefix_stats,
            connector_prefix_cache_stats=connector_prefix_stats,
            spec_decoding_stats=spec_stats,
            kv_connector_stats=kv_connector_stats.to_dict() if kv_connector_stats else None,
        )

    def core_stats(self) -> dict[str, Any]:
        """The core's own counters (``atom_sched.Scheduler.stats()``): preemptions, hits..."""
        return self.core.stats()

    def get_kv_event_publisher_config(self) -> Any:
        return self.kv_event_publisher.get_publisher_config()

    def shutdown(self) -> None:
        self.kv_event_publisher.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
