"""atom_sched: the scheduler and paged KV-cache block manager of an LLM inference engine.

A C++ core (ATOM's scheduling policy with ATOM's bugs fixed) bound to Python with pybind11.
See docs/api.md for the full contract. The short version::

    from atom_sched import Scheduler, SchedulerConfig, SamplingParams

    sched = Scheduler(SchedulerConfig(num_blocks=1024, block_size=16, eos_token_id=2))
    sched.add_request(0, [1, 15, 27, 99], SamplingParams(max_tokens=32))
    while sched.has_unfinished_requests():
        batch = sched.schedule()          # numpy views: positions, slot_mapping, block_tables ...
        if batch is None:                 # nothing can run until an outside event (remote KV)
            break
        sampled = run_model(batch)        # one token per row (or K+1 with speculative decoding)
        for out in sched.update(batch, sampled):
            print(out.request_id, out.output_tokens, out.finish_reason)
"""

from ._core import (
    NULL_BLOCK,
    Batch,
    ConnectorRequest,
    DeviceError,
    InvariantError,
    KVConnector,
    KVEvent,
    RejectedRequest,
    RemoteMatch,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    block_hash,
    hash_namespace,
)
from ._views import BatchViews
from .device import AcceptResult, DeviceBatchBuilder, DeviceInputs

__version__ = "0.1.0"

__all__ = [
    "NULL_BLOCK",
    "AcceptResult",
    "Batch",
    "BatchViews",
    "ConnectorRequest",
    "DeviceBatchBuilder",
    "DeviceError",
    "DeviceInputs",
    "InvariantError",
    "KVConnector",
    "KVEvent",
    "RejectedRequest",
    "RemoteMatch",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "StepOutput",
    "block_hash",
    "hash_namespace",
    "__version__",
]
