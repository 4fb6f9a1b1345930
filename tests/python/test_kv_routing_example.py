"""examples/kv_routing.py end to end: SmolLM2 engines publishing KV events, NVIDIA Dynamo's own
indexer routing by them, and round-robin routing on the same requests for comparison."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
from atom_sched.dynamo_indexer import DynamoIndexer  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kv_routing.py"


def test_kv_aware_routing_hits_the_prefix_cache_more_than_round_robin():
    if os.environ.get("ATOM_SCHED_SKIP_E2E"):
        pytest.skip("ATOM_SCHED_SKIP_E2E is set")
    if not DynamoIndexer.available():
        pytest.fail("ai-dynamo-runtime is not installed (make venv installs it)")
    spec = importlib.util.spec_from_file_location("kv_routing", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules["kv_routing"] = example  # its dataclasses look their module up there
    spec.loader.exec_module(example)
    lines: list[str] = []
    results = example.run(engines=2, docs=3, questions=2, max_tokens=2, report=lines.append)
    kv, rr = results["kv-aware"], results["round-robin"]
    assert kv.prompt_tokens == rr.prompt_tokens > 0
    assert sum(kv.per_engine) == sum(rr.per_engine) == 6
    # Every question after a context's first lands where that context is cached.
    assert kv.hit_rate > rr.hit_rate and kv.cached_tokens >= 3 * 64
    assert len(lines) == 2 and "round-robin" in lines[1]
