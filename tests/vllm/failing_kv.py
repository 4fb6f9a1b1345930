"""A KV connector whose first load fails: vLLM's ExampleConnector (prompt KV in files) that,
in each engine, corrupts the first block it loads and reports it in
``get_block_ids_with_load_errors()``, as a transfer that lost a block would. With
``kv_load_failure_policy="recompute"`` a scheduler must compute that block's KV again (and what
followed it) to give the answers of a clean load; with ``"fail"`` the request ends with an error.

Loaded by name (``kv_connector_module_path="failing_kv"``) from this folder.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class FailingLoadConnector(ExampleConnector):
    failed_once = False  # per process: each engine runs in a process of its own

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._lost: set[int] = set()
        if FailingLoadConnector.failed_once:
            return
        for req in connector_metadata.requests:
            if not req.is_store and len(req.slot_mapping):
                self._lost = {int(req.slot_mapping[0]) // self._block_size}
                FailingLoadConnector.failed_once = True
                return

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        # The lost block's KV is garbage (zeros here), in every attention layer.
        for block in self._lost:
            slots = torch.arange(block * self._block_size, (block + 1) * self._block_size)
            for layer in forward_context.no_compile_layers.values():
                kv = getattr(layer, "kv_cache", None)
                if isinstance(kv, torch.Tensor):
                    kv[slots // self._block_size, :, slots % self._block_size] = 0

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(getattr(self, "_lost", ()))


class SilentLossConnector(FailingLoadConnector):
    """The same loss, never reported: what the corruption does to the answers unrecovered."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()
