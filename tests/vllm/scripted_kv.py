"""A scheduler-side vLLM KV connector that answers from a script and records every call: what a
test needs to drive the class's connector protocol without a transfer engine. vLLM loads it by
``KVTransferConfig(kv_connector="ScriptedConnector", kv_connector_module_path="scripted_kv")``.

``ScriptedConnector.script[request_id]``: what get_num_new_matched_tokens answers for it, once
(``(tokens, load_async)``, ``None`` for "cannot tell yet", or an exception to raise); nothing
scripted: ``(0, False)``. ``ScriptedConnector.keep``: ids whose blocks request_finished keeps for
a send; ``ScriptedConnector.fail_finish``: ids whose request_finished raises.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class ScriptedMetadata(KVConnectorMetadata):
    def __init__(self, allocs: list[tuple[str, list[int], int]]) -> None:
        self.allocs = allocs


class ScriptedConnector(KVConnectorBase_V1):
    script: dict[str, Any] = {}
    keep: set[str] = set()
    fail_finish: set[str] = set()
    last: ScriptedConnector | None = None

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls: list[tuple] = []
        self._allocs: list[tuple[str, list[int], int]] = []
        self.outputs: list[Any] = []
        ScriptedConnector.last = self

    # worker side: never called in these tests
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        self.calls.append(("match", request.request_id, num_computed_tokens))
        answer = self.script.pop(request.request_id, (0, False))
        if isinstance(answer, Exception):
            raise answer
        return (None, False) if answer is None else answer

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        ids = blocks.get_block_ids()[0]
        self.calls.append(("alloc", request.request_id, list(ids), num_external_tokens,
                           list(blocks.get_unhashed_block_ids())))
        self._allocs.append((request.request_id, list(ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._allocs = ScriptedMetadata(self._allocs), []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        rid = request.request_id
        self.calls.append(("finished", rid, list(block_ids)))
        if rid in self.fail_finish:
            raise RuntimeError("transfer engine gone")
        return rid in self.keep, {"sent_by": "scripted", "request": rid}

    def update_connector_output(self, connector_output: Any) -> None:
        self.outputs.append(connector_output)


class PoolConnector(ScriptedConnector):
    """Takes vLLM's GPU block pool, as CPU-offloading connectors do: the class refuses it."""

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.pool = gpu_block_pool
