"""The core's KV-cache events as vLLM's, for vLLM's own event publisher (``--kv-events-config``).

The core records what enters and leaves its prefix cache (``Scheduler.take_events()``):
BlockStored when a step's blocks are published, BlockRemoved when a cached block is evicted,
AllBlocksCleared on a reset. ``AtomScheduler`` turns each step's into vLLM's msgspec structs
(``vllm.distributed.kv_events``) and hands the batch to the publisher vLLM's config names, so a
router subscribed to a vLLM engine (vLLM's ZMQ format, replay included) reads them unchanged.

The block hashes are the core's (64-bit XXH64 chained over the tokens and extra keys), not
vLLM's sha256: a consumer matches stores and removals by hash, and hashes token ids itself when it
indexes prefixes (``token_ids`` and ``block_size`` are vLLM's fields).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from atom_sched.kv_events import extra_keys

__all__ = ["to_vllm_events"]


def to_vllm_events(events: Iterable[Any], lora_ids: dict[str, int] | None = None) -> list[Any]:
    """vLLM's events for the core's, in order. ``lora_ids`` maps a LoRA name to vLLM's adapter
    id (the deprecated ``lora_id`` field); every block is in KV-cache group 0 (the class serves
    one group)."""
    out: list[Any] = []
    for e in events:
        kind = e.kind
        if kind == "BlockStored":
            lora = e.lora_name or None
            out.append(BlockStored(
                block_hashes=list(e.block_hashes),
                parent_block_hash=e.parent_block_hash,
                token_ids=list(e.token_ids),
                block_size=e.block_size,
                lora_id=(lora_ids or {}).get(lora) if lora else None,
                medium=e.medium,
                lora_name=lora,
                extra_keys=extra_keys(e),
                group_idx=0,
            ))
        elif kind == "BlockRemoved":
            out.append(BlockRemoved(block_hashes=list(e.block_hashes), medium=e.medium,
                                    group_idx=0))
        else:
            out.append(AllBlocksCleared())
    return out
