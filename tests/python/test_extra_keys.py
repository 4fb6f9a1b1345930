"""Issue 11 item 5, cache_salt and LoRA in the block-hash chain (vLLM's extra keys): two tenants
with different salts, or requests for different LoRA adapters, never share a cached block; the
KV events carry the keys a router needs to tell them apart (lora_name, extra_keys) and hashes it
can recompute (block 0's parent is hash_namespace(...)). Runs go through the Driver (invariants
and batch checks after every call, the oracle's outputs), both protocols, K = 0 and K > 0."""

import copy
import pickle

import msgpack
import pytest
from support import event_kind, make_driver, prompt, sp

from atom_sched import KVEvent, SamplingParams, block_hash, hash_namespace
from atom_sched.kv_events import encode_batch, encode_event

BS = 4
PROMPT = prompt(12, 100)  # 3 full blocks


def run(mode: str, k: int, keys: list[dict]):
    """One request per entry of `keys`, each admitted after the previous one finished; returns
    the driver and each request's prefix-cache hit tokens."""
    d = make_driver(mode, num_blocks=64, block_size=BS, num_speculative_tokens=k,
                    enable_kv_events=True)
    for rid, kw in enumerate(keys):
        d.add(rid, PROMPT, sp(max_tokens=3, ignore_eos=True, **kw))
        d.run()
    d.check_all_done()
    d.check_against_oracle()
    return d, [d.cached_first[rid] for rid in range(len(keys))]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 2])
def test_tenants_share_blocks_only_under_the_same_keys(mode, k):
    keys = [dict(cache_salt="tenant-a"), dict(cache_salt="tenant-b"), dict(cache_salt="tenant-a"),
            {}, dict(lora_name="sql-adapter"), dict(lora_name="sql-adapter"),
            dict(lora_name="sql-adapter", cache_salt="tenant-a"), {}]
    _, hits = run(mode, k, keys)
    assert hits == [0, 0, 8, 0, 0, 8, 0, 8]


def test_events_carry_the_keys_and_recomputable_hashes():
    d, _ = run("sync", 0, [dict(cache_salt="tenant-a", lora_name="sql-adapter")])
    stored = [e for e in d.sched.take_events() if event_kind(e) == "BlockStored"]
    first = stored[0]
    assert first.lora_name == "sql-adapter" and first.cache_salt == "tenant-a"
    assert first.parent_block_hash is None
    parent = hash_namespace(lora_name="sql-adapter", cache_salt="tenant-a")
    chain = []
    for i in range(3):
        parent = block_hash(PROMPT[i * BS : (i + 1) * BS], parent)
        chain.append(parent)
    assert list(first.block_hashes) == chain
    unsalted = block_hash(PROMPT[:BS])
    assert chain[0] != unsalted
    m = encode_event(first, "map")
    assert m["lora_name"] == "sql-adapter"
    assert m["extra_keys"] == [("sql-adapter", "tenant-a"), ("sql-adapter",), ("sql-adapter",)]
    assert m["cache_salt"] == "tenant-a"  # Dynamo's field (its indexer ignores the extra keys)
    wire = msgpack.unpackb(encode_batch(1.0, [first], 0), raw=False)
    assert wire[1][0]["extra_keys"] == [["sql-adapter", "tenant-a"], ["sql-adapter"],
                                        ["sql-adapter"]]
    # Without extra keys the event is unchanged (no extra_keys field, lora_name None).
    plain = encode_event(KVEvent("BlockStored", [1], None, [1, 2], 2), "map")
    assert "extra_keys" not in plain and "cache_salt" not in plain and plain["lora_name"] is None
    arr = encode_event(first, "array")
    assert arr[-1] == "sql-adapter", "the positional layout ends at lora_name"


def test_the_keys_are_validated_and_kept():
    p = SamplingParams(cache_salt="s" * 256, lora_name="l")
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert q.cache_salt == "s" * 256 and q.lora_name == "l"
    for field in ("cache_salt", "lora_name"):
        with pytest.raises(ValueError, match=f"{field} must be at most 256 bytes"):
            SamplingParams(**{field: "é" * 129})  # 258 bytes of UTF-8
    with pytest.raises(TypeError):
        SamplingParams(cache_salt=5)
    assert hash_namespace() is None
    assert hash_namespace(lora_name="a") != hash_namespace(cache_salt="a")
    assert hash_namespace(lora_name="ab") != hash_namespace(lora_name="a", cache_salt="b")
