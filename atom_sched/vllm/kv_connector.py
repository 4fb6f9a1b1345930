"""vLLM's scheduler-side KV connector (``--kv-transfer-config``: NIXL, LMCache, a shared store...)
behind the core's connector calls.

The core decides which blocks a request gets and when they may be reused; it asks its
``atom_sched.KVConnector`` at the same points vLLM's scheduler asks a vLLM connector. This bridge
answers the core by asking the vLLM connector with the vLLM ``Request`` and vLLM's block objects,
and keeps what the vLLM class needs back: each request's external token count (for its prefill
stats), the ``kv_transfer_params`` of a finished request (for its final output), and which ids
still wait on a transfer report from the workers.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole, SupportsHMA
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

import atom_sched
from atom_sched.vllm.refusals import refuse

logger = logging.getLogger(__name__)

# What a block the request found in the local prefix cache carries for a vLLM connector: a block
# hash (connectors tell cached blocks from fresh ones by it, get_unhashed_block_ids()).
_LOCAL_HIT = make_block_hash_with_group_id(b"atom_sched:local-prefix-hit", 0)


def _blocks(block_ids: Iterable[int], num_local: int) -> KVCacheBlocks:
    blocks = []
    for i, block_id in enumerate(block_ids):
        block = KVCacheBlock(block_id)
        if i < num_local:
            block.set_block_hash(_LOCAL_HIT)
        blocks.append(block)
    return KVCacheBlocks((blocks,))


def make_kv_connector(vllm_config: Any, kv_cache_config: Any) -> Any:
    """vLLM's scheduler-side connector of ``--kv-transfer-config``, or None without one. A
    connector that manages vLLM's own GPU block pool (CPU offloading, Mooncake's store: they
    take vLLM's KVCacheManager, which this scheduler replaces) is refused."""
    if vllm_config.kv_transfer_config is None:
        return None
    connector = KVConnectorFactory.create_connector(
        config=vllm_config, role=KVConnectorRole.SCHEDULER, kv_cache_config=kv_cache_config)
    parts = getattr(connector, "_connectors", None) or [connector]  # MultiConnector's
    for part in parts:
        if (type(part).bind_gpu_block_pool is not KVConnectorBase_V1.bind_gpu_block_pool
                or type(part).bind_kv_cache_manager
                is not KVConnectorBase_V1.bind_kv_cache_manager):
            connector.shutdown()
            raise refuse(f"the KV connector {type(part).__name__} (it manages vLLM's GPU "
                         "block pool, which atom_sched's scheduler replaces)",
                         "use a transfer connector (NIXL, a shared store) or vLLM's scheduler.")
    return connector


class VllmConnectorBridge(atom_sched.KVConnector):
    """The core's connector calls answered by a vLLM connector (role SCHEDULER).

    ``request_of(core_id)`` gives the vLLM ``Request`` of a request the core asks about (the vLLM
    class's map). A vLLM connector that raises costs only that request (the core's rule: rejected
    at admission; at a finish, its blocks are freed at once)."""

    def __init__(self, connector: Any, block_size: int,
                 request_of: Callable[[int], Request]) -> None:
        super().__init__()
        self.connector = connector
        self.block_size = block_size
        self._request_of = request_of
        # The last answer per core id, until its blocks are allocated: (local, external, async).
        self._answers: dict[int, tuple[int, int, bool]] = {}
        # vLLM id -> (local, external) cached tokens of its admission, for the prefill stats
        # of its first row (taken by the vLLM class then).
        self.cached_at_admission: dict[str, tuple[int, int]] = {}
        # vLLM id -> kv_transfer_params of a finished request, for its final output.
        self._params: dict[str, dict[str, Any]] = {}
        # vLLM id -> core id of every request a transfer report may still name: loading its KV
        # asynchronously, or finished with its blocks kept for a send.
        self.awaiting_report: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        # Whether a request admitted since the last build_meta() loads KV synchronously: the
        # workers then load before the forward pass (vLLM's has_sync_kv_loads).
        self._sync_loads = False

    # ---- the core's calls -------------------------------------------------------------------

    def is_producer(self) -> bool:
        return False  # the core decides from request_finished()'s answer

    def get_num_new_matched_tokens(self, creq: atom_sched.ConnectorRequest) -> Any:
        request = self._request_of(creq.request_id)
        local = creq.num_cached_tokens
        if getattr(request, "skip_reading_prefix_cache", False):
            return atom_sched.RemoteMatch()
        external, load_async = self.connector.get_num_new_matched_tokens(request, local)
        if external is None:
            return None  # cannot tell yet: asked again at the next step
        if isinstance(external, bool) or not isinstance(external, numbers.Integral) \
                or external < 0:
            raise ValueError(f"get_num_new_matched_tokens returned {external!r} tokens")
        external = int(external)
        num_tokens = len(creq.token_ids)
        if external > num_tokens - local:
            raise ValueError(f"get_num_new_matched_tokens claims {external} tokens after a "
                             f"local hit of {local}; the request has {num_tokens}")
        load_async = bool(load_async) and external > 0
        self._answers[creq.request_id] = (local, external, load_async)
        return atom_sched.RemoteMatch(num_tokens=external, load_async=load_async)

    def update_state_after_alloc(self, creq: atom_sched.ConnectorRequest) -> None:
        request = self._request_of(creq.request_id)
        local, external, load_async = self._answers.pop(
            creq.request_id, (creq.num_cached_tokens, 0, False))
        block_ids = list(creq.block_ids)
        if load_async:
            # vLLM allocates the blocks of the loaded tokens only before the load lands.
            block_ids = block_ids[:-(-(local + external) // self.block_size)]
            self.awaiting_report[request.request_id] = creq.request_id
            request.num_computed_tokens = local + external
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        else:
            self._sync_loads |= external > 0
        self.connector.update_state_after_alloc(
            request, _blocks(block_ids, local // self.block_size), external)
        self.cached_at_admission[request.request_id] = (local, external)
        self.prefix_stats.record(num_tokens=request.num_tokens - local, num_hits=external,
                                 preempted=request.num_preemptions > 0)

    def request_finished(self, creq: atom_sched.ConnectorRequest) -> bool:
        request = self._request_of(creq.request_id)
        self._answers.pop(creq.request_id, None)  # asked, then not admitted (no budget left)
        self.cached_at_admission.pop(request.request_id, None)
        # vLLM hands over the blocks of the computed tokens.
        computed = -(-request.num_computed_tokens // self.block_size)
        block_ids = list(creq.block_ids)[:computed]
        if isinstance(self.connector, SupportsHMA):
            delay, params = self.connector.request_finished_all_groups(request, (block_ids,))
        else:
            delay, params = self.connector.request_finished(request, block_ids)
        if params:
            self._params[request.request_id] = params
        if delay:
            self.awaiting_report[request.request_id] = creq.request_id
        return bool(delay)

    # ---- what the vLLM class asks -----------------------------------------------------------

    def take_params(self, rid: str) -> dict[str, Any] | None:
        return self._params.pop(rid, None)

    def build_meta(self, scheduler_output: SchedulerOutput, core: atom_sched.Scheduler,
                   core_id_of: Callable[[str], int]) -> None:
        """The step's connector metadata on ``scheduler_output``, as vLLM's scheduler sets it:
        with the block tables of the scheduled requests offered to the connector while it
        builds (resolved on access), then withdrawn (they are not for the workers)."""
        out = scheduler_output
        out.has_sync_kv_loads, self._sync_loads = self._sync_loads, False
        out.kv_connector_block_state = KVConnectorBlockState(
            req_ids=set(out.num_scheduled_tokens),
            resolve_block_ids=lambda rid: (
                list(core.request_state(core_id_of(rid))["block_table"]),),
            boundary_state_offloads={})
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        out.kv_connector_block_state = None

    def report(self, core: atom_sched.Scheduler, finished_sending: Iterable[str],
               finished_recving: Iterable[str]) -> None:
        """The workers' transfer reports to the core. An id the core does not wait on (unknown,
        or not in that state) is the worker's mistake: logged and dropped, the rest applied."""
        sending, recving = [], []
        for ids, out in ((finished_sending, sending), (finished_recving, recving)):
            for rid in ids or ():
                core_id = self.awaiting_report.get(rid)
                if core_id is None:
                    logger.warning("KV transfer report for request %s, which waits on none", rid)
                else:
                    out.append((rid, core_id))
        if not sending and not recving:
            return
        try:
            core.update_from_kv_xfer_finished(
                finished_sending=[c for _, c in sending], finished_recving=[c for _, c in recving])
        except (ValueError, KeyError):
            # One bad id refuses the whole report: apply the ids one by one.
            for kind, pairs in (("finished_sending", sending), ("finished_recving", recving)):
                for rid, core_id in pairs:
                    try:
                        core.update_from_kv_xfer_finished(**{kind: [core_id]})
                    except (ValueError, KeyError) as e:
                        logger.warning("KV transfer report %s for request %s dropped: %s",
                                       kind, rid, e)
        for rid, core_id in sending + recving:
            if core_id not in core or core.request_state(core_id)["status"] != "finished":
                # Its blocks are free (or it went on to run): no report is awaited any more.
                self.awaiting_report.pop(rid, None)
