"""Typed stubs of the compiled module atom_sched._core (checked against it by
tests/python/test_stubs.py)."""

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ._views import BatchViews

_IntArray = Sequence[int] | npt.NDArray[np.integer]
_FloatArray = Sequence[float] | npt.NDArray[np.floating]

class InvariantError(RuntimeError): ...

NULL_BLOCK: int
DEVICE_RESULT_HEADER_WORDS: int
DEVICE_ERROR_BITS: dict[int, str]

def block_hash(token_ids: Sequence[int], parent: int | None = None) -> int: ...
def hash_namespace(*, lora_name: str = "", cache_salt: str = "") -> int | None: ...
def _token_rows(
    rows: Sequence[Sequence[int]], width: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]: ...

class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    num_speculative_tokens: int
    eos_token_id: int
    stop_token_ids: list[int]
    scheduler_delay_factor: float
    enable_kv_events: bool
    num_state_slots: int
    policy: Literal["atom", "mixed"]
    scheduling: Literal["fcfs", "priority", "sjf", "fair"]
    long_prefill_token_threshold: int
    cache_decode_blocks: bool
    uniform_decode_rows: bool
    host_block_tables: bool
    preemption_victim: Literal["service_order", "least_computed"]
    sjf_aging_rate: float
    admission_watermark_blocks: int
    tenant_weights: dict[str, float]
    fence_freed_blocks: bool
    drop_preempted_outputs: bool
    num_lookahead_tokens: int
    draft_slots_per_row: int
    recompute_last_hit_block: bool
    long_prefill_token_threshold_adaptive: bool
    prefill_lookahead_tokens: int
    pad_first_decode_rows: bool
    publish_prompt_blocks_at_schedule: bool
    schedule_ahead: bool
    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 8192,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        num_speculative_tokens: int = 0,
        eos_token_id: int = -1,
        stop_token_ids: Sequence[int] = ...,
        scheduler_delay_factor: float = 0.0,
        enable_kv_events: bool = False,
        num_state_slots: int = 0,
        policy: Literal["atom", "mixed"] = "atom",
        scheduling: Literal["fcfs", "priority", "sjf", "fair"] = "fcfs",
        long_prefill_token_threshold: int = 0,
        cache_decode_blocks: bool = True,
        uniform_decode_rows: bool = False,
        host_block_tables: bool = True,
        preemption_victim: Literal["service_order", "least_computed"] = "service_order",
        sjf_aging_rate: float = 100.0,
        admission_watermark_blocks: int = 0,
        tenant_weights: Mapping[str, float] = ...,
        fence_freed_blocks: bool = False,
        drop_preempted_outputs: bool = False,
        num_lookahead_tokens: int = 0,
        draft_slots_per_row: int = 0,
        recompute_last_hit_block: bool = False,
        long_prefill_token_threshold_adaptive: bool = False,
        prefill_lookahead_tokens: int = 0,
        pad_first_decode_rows: bool = False,
        publish_prompt_blocks_at_schedule: bool = False,
        schedule_ahead: bool = True,
    ) -> None: ...
    def validate(self) -> None: ...
    @property
    def max_blocks_per_request(self) -> int: ...

class SamplingParams:
    temperature: float
    top_k: int
    top_p: float
    max_tokens: int
    ignore_eos: bool
    n: int
    logprobs: bool
    stop_token_ids: list[int]
    stop_token_sequences: list[list[int]]
    seed: int
    min_tokens: int
    priority: int
    cache_salt: str
    lora_name: str
    length_hint: int
    tenant: str
    resumable: bool
    def __init__(
        self,
        *,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        max_tokens: int = 64,
        ignore_eos: bool = False,
        n: int = 1,
        logprobs: bool = False,
        stop_token_ids: Sequence[int] = ...,
        stop_token_sequences: Sequence[Sequence[int]] = ...,
        seed: int = -1,
        min_tokens: int = 0,
        priority: int = 0,
        cache_salt: str = "",
        lora_name: str = "",
        length_hint: int = 0,
        tenant: str = "",
        resumable: bool = False,
    ) -> None: ...
    def validate(self) -> None: ...

class RejectedRequest:
    @property
    def request_id(self) -> int: ...
    @property
    def reason(self) -> str: ...

class KVEvent:
    def __init__(
        self,
        kind: str,
        block_hashes: Sequence[int] = ...,
        parent_block_hash: int | None = None,
        token_ids: Sequence[int] = ...,
        block_size: int = 0,
        medium: str | None = "GPU",
        lora_name: str = "",
        cache_salt: str = "",
    ) -> None: ...
    @property
    def kind(self) -> str: ...
    @property
    def block_hashes(self) -> list[int]: ...
    @property
    def parent_block_hash(self) -> int | None: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def medium(self) -> str | None: ...
    @property
    def lora_name(self) -> str: ...
    @property
    def cache_salt(self) -> str: ...

class RequestOutput:
    @property
    def request_id(self) -> int: ...
    @property
    def output_tokens(self) -> list[int]: ...
    @property
    def finished(self) -> bool: ...
    @property
    def awaiting_input(self) -> bool: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def logprobs(self) -> list[float] | None: ...

class StepOutput:
    @property
    def batch_id(self) -> int: ...
    @property
    def request_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def token_offsets(self) -> npt.NDArray[np.int32]: ...
    @property
    def new_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def new_logprobs(self) -> npt.NDArray[np.float32]: ...
    @property
    def finished(self) -> npt.NDArray[np.bool_]: ...
    @property
    def awaiting_input(self) -> npt.NDArray[np.bool_]: ...
    @property
    def num_awaiting_input(self) -> int: ...
    @property
    def num_cached_tokens(self) -> npt.NDArray[np.int32]: ...
    def finish_reason(self, i: int) -> str | None: ...
    def final_token_ids(self, i: int) -> list[int]: ...
    def _atom_stream_items(self, output_type: type) -> list[tuple[int, Any]]: ...
    def outputs(self) -> list[RequestOutput]: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[RequestOutput]: ...

class Batch:
    @property
    def id(self) -> int: ...
    @property
    def is_prefill(self) -> bool: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def total_tokens_num(self) -> int: ...
    @property
    def num_spec_tokens(self) -> int: ...
    @property
    def max_seqlen_q(self) -> int: ...
    @property
    def max_seqlen_k(self) -> int: ...
    @property
    def block_table_width(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_speculative_tokens(self) -> int: ...
    @property
    def req_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def request_slots(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_scheduled_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_cached_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def context_lens(self) -> npt.NDArray[np.int32]: ...
    @property
    def last_block_num_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def temperatures(self) -> npt.NDArray[np.float32]: ...
    @property
    def top_ks(self) -> npt.NDArray[np.int32]: ...
    @property
    def top_ps(self) -> npt.NDArray[np.float32]: ...
    @property
    def seeds(self) -> npt.NDArray[np.int64]: ...
    @property
    def state_slots(self) -> npt.NDArray[np.int32]: ...
    @property
    def row_is_prefill(self) -> npt.NDArray[np.bool_]: ...
    def views(self) -> BatchViews: ...
    @property
    def emits_token(self) -> npt.NDArray[np.bool_]: ...
    @property
    def row_exact(self) -> npt.NDArray[np.bool_]: ...
    @property
    def slot_reset(self) -> npt.NDArray[np.bool_]: ...
    @property
    def new_block_starts(self) -> npt.NDArray[np.int32]: ...
    @property
    def new_block_offsets(self) -> npt.NDArray[np.int32]: ...
    @property
    def new_block_ids(self) -> npt.NDArray[np.int32]: ...
    @property
    def scheduled_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]: ...
    @property
    def cu_seqlens_q(self) -> npt.NDArray[np.int32]: ...
    @property
    def cu_seqlens_k(self) -> npt.NDArray[np.int32]: ...
    @property
    def block_tables(self) -> npt.NDArray[np.int32]: ...  # RuntimeError: host_block_tables=False
    @property
    def spec_draft_tokens(self) -> npt.NDArray[np.int32]: ...
    def __len__(self) -> int: ...

class ConnectorRequest:
    @property
    def request_id(self) -> int: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def block_ids(self) -> list[int]: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def draft_token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> str | None: ...

class RemoteMatch:
    # first_token >= 0 (ATOM's remote prefill): the whole prompt is remote, num_tokens is
    # informational. first_token == -1: num_tokens tokens after the local hit have external KV.
    # retry_later: the connector cannot tell yet (vLLM's None). docs/api.md "KV connector".
    num_tokens: int
    load_async: bool
    first_token: int
    draft_tokens: list[int]
    retry_later: bool
    def __init__(
        self,
        *,
        num_tokens: int = 0,
        load_async: bool = False,
        first_token: int = -1,
        draft_tokens: Sequence[int] = ...,
        retry_later: bool = False,
    ) -> None: ...

class KVConnector:
    def __init__(self) -> None: ...

class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None: ...
    def add_request(
        self,
        request_id: int,
        prompt_token_ids: _IntArray,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None: ...
    def abort_request(self, request_id: int) -> None: ...
    def preempt_request(self, request_id: int) -> None: ...
    def continue_session(
        self,
        request_id: int,
        prompt_token_ids: _IntArray,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None: ...
    def end_session(self, request_id: int) -> None: ...
    def recompute_kv_from(self, request_id: int, position: int) -> None: ...
    def set_drafts(self, request_id: int, draft_token_ids: Sequence[int] | np.ndarray) -> None: ...
    def schedule(
        self, allow_prefill: bool = True, now: float | None = None, admit_waiting: bool = True
    ) -> Batch | None: ...
    def update(
        self,
        batch: Batch,
        sampled_token_ids: _IntArray,
        num_accepted: _IntArray | None = None,
        draft_token_ids: _IntArray | None = None,
        logprobs: _FloatArray | None = None,
    ) -> StepOutput: ...
    def take_rejected(self) -> list[RejectedRequest]: ...
    def take_events(self) -> list[KVEvent]: ...
    def cached_block_hashes(self) -> list[int]: ...
    def stats(self) -> dict[str, int | float | list[int]]: ...
    def get_next_batch_info(
        self, allow_prefill: bool = True, now: float | None = None, admit_waiting: bool = True
    ) -> tuple[bool, int, int]: ...
    def has_unfinished_requests(self) -> bool: ...
    def reset_prefix_cache(self) -> None: ...
    def check_invariants(self) -> None: ...
    def request_state(self, request_id: int) -> dict[str, object]: ...
    def waiting_ids(self) -> list[int]: ...
    def running_ids(self) -> list[int]: ...
    def __contains__(self, request_id: int) -> bool: ...
    def set_kv_connector(self, connector: KVConnector | None) -> None: ...
    @property
    def kv_connector(self) -> KVConnector | None: ...
    def update_from_kv_xfer_finished(
        self, finished_sending: Sequence[int] = ..., finished_recving: Sequence[int] = ...
    ) -> None: ...
    def take_connector_errors(self) -> list[str]: ...
    def count_admittable_head_prefills(self, limit: int) -> int: ...
    @property
    def config(self) -> SchedulerConfig: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_waiting_for_input(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_outstanding_batches(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_usable_blocks(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...

# ---- Device kernels (csrc/python/bind_device.cc; used by atom_sched.device) --------------------
# Pointers are ints (tensor.data_ptr()); on_device=True runs the launcher on `stream`, False the
# CPU reference on host memory.

class DeviceError(RuntimeError): ...

def device_backend() -> str: ...
def device_count() -> int: ...
def device_warp_size() -> int: ...
def device_plan_words(num_rows: int, num_block_updates: int, num_host_tokens: int) -> int: ...
def device_result_words(num_rows: int, k: int) -> int: ...
def device_pack_plan(
    out: int,
    capacity_words: int,
    request_slots: npt.NDArray[np.int32],
    num_scheduled_tokens: npt.NDArray[np.int32],
    num_cached_tokens: npt.NDArray[np.int32],
    is_prefill: npt.NDArray[np.bool_],
    slot_reset: npt.NDArray[np.bool_],
    emits_token: npt.NDArray[np.bool_],
    new_block_starts: npt.NDArray[np.int32],
    new_block_offsets: npt.NDArray[np.int32],
    new_block_ids: npt.NDArray[np.int32],
    scheduled_tokens: npt.NDArray[np.int32],
    cu_seqlens_q: npt.NDArray[np.int32],
) -> int: ...

class DeviceSlotState:
    block_table: int
    computed: int
    last_token: int
    drafts: int
    errors: int
    num_slots: int
    width: int
    k: int
    block_size: int
    plan_words: int
    def __init__(
        self,
        *,
        block_table: int,
        computed: int,
        last_token: int,
        drafts: int,
        errors: int,
        num_slots: int,
        width: int,
        k: int,
        block_size: int,
        plan_words: int,
    ) -> None: ...

class DeviceStepInputs:
    input_ids: int
    positions: int
    slot_mapping: int
    seq_lens: int
    query_start_loc: int
    cu_seqlens_k: int
    block_table: int
    logits_indices: int
    spec_logits_indices: int
    meta: int
    def __init__(
        self,
        *,
        input_ids: int,
        positions: int,
        slot_mapping: int,
        seq_lens: int,
        query_start_loc: int,
        cu_seqlens_k: int,
        block_table: int,
        logits_indices: int,
        spec_logits_indices: int,
        meta: int,
    ) -> None: ...

def device_apply_plan(
    plan: int,
    state: DeviceSlotState,
    out: DeviceStepInputs,
    padded_rows: int,
    padded_tokens: int,
    stream: int = 0,
    on_device: bool = False,
) -> None: ...
def device_build_inputs(
    plan: int,
    state: DeviceSlotState,
    out: DeviceStepInputs,
    padded_rows: int,
    padded_tokens: int,
    stream: int = 0,
    on_device: bool = False,
) -> None: ...
def device_prepare(
    plan: int,
    state: DeviceSlotState,
    out: DeviceStepInputs,
    padded_rows: int,
    padded_tokens: int,
    stream: int = 0,
    on_device: bool = False,
) -> None: ...
def device_accept(
    plan: int,
    state: DeviceSlotState,
    result: int,
    padded_rows: int,
    target_tokens: int,
    next_drafts: int = 0,
    target_probs: int = 0,
    draft_probs: int = 0,
    uniform: int = 0,
    stream: int = 0,
    on_device: bool = False,
) -> None: ...
def device_store_drafts(
    plan: int,
    state: DeviceSlotState,
    next_drafts: int,
    result: int,
    padded_rows: int,
    stream: int = 0,
    on_device: bool = False,
) -> None: ...
