"""Prefill/decode disaggregation with real engines: the KV connectors move the KV of every layer
from a prefill engine to a decode engine on 127.0.0.1, in ZMQ frames (loopback) or by NIXL READs
(every equality test runs on both).

* With SmolLM2-135M-Instruct, in two processes (``DisaggPair``: multiprocessing spawn, one torch
  thread each): chat prompts with shared prefixes, all longer than a block, are prefilled by one
  engine, their KV pulled by the other, and decoded there. The decode side's greedy tokens must
  equal a single engine's (and transformers' ``generate``, tie-aware as in test_e2e_smollm2.py);
  the prefill side holds each request's blocks until the decode side has acknowledged them; the
  decode side publishes the received prompt blocks in its prefix cache, so a later prompt sharing
  the prefix pulls only its own blocks.
* With a tiny random Llama, both engines in this process (stepped in turn): the same equality in
  the decode side's other protocols (one step ahead, n-gram drafts, the producer's drafts fed to
  the first decode), and the failure paths (an unknown transfer, an abort before admission, a
  non-loopback address).
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("zmq")

from support.disagg import TINY, Pair, tiny_case  # noqa: E402

from atom_sched import block_hash  # noqa: E402
from atom_sched.connectors import DisaggPair, LoopbackConsumer, LoopbackProducer  # noqa: E402
from atom_sched.engine import EngineConfig, GenerationParams, LLMEngine  # noqa: E402

MAX_NEW = 16
BS = 16
# Chat prompts of 37-57 tokens (3-4 blocks of 16). All share the chat template's system prompt
# (one full block); the two list prompts share two full blocks (46 tokens).
LIST = "Here is a list: apple, banana, cherry, date, elderberry, fig, grape. "
PROMPTS = [LIST + "Repeat the list in reverse order.",
           "What is the capital of France?",
           LIST + "Which of these fruits is red?"]
REAL = dict(num_blocks=48, block_size=BS, max_num_seqs=4, max_num_batched_tokens=128,
            max_model_len=512, check_invariants=True, check_builder=True)


def prompt_block_hashes(prompt: list[int], bs: int) -> list[int]:
    """The chained hashes of a prompt's full blocks, as the prefix cache keys them."""
    out: list[int] = []
    parent = None
    for i in range(len(prompt) // bs):
        parent = block_hash(prompt[i * bs:(i + 1) * bs], parent=parent)
        out.append(parent)
    return out


def by_tid(log: list, event: str) -> dict[int, tuple]:
    return {rid: (t, detail) for t, ev, rid, detail in log if ev == event}


# ---- SmolLM2, two processes ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from atom_sched.engine import weights

    if os.environ.get("ATOM_SCHED_SKIP_E2E"):
        pytest.skip("ATOM_SCHED_SKIP_E2E is set")
    torch.set_num_threads(1)
    return weights.ensure_cached().path


@pytest.mark.parametrize("transport", ["loopback", "nixl"])
def test_two_process_disaggregation_equals_one_engine(smollm2, transport):
    t_start = time.perf_counter()
    ref_engine = LLMEngine(EngineConfig(**REAL), model_path=smollm2)
    ids = [ref_engine.encode_prompt(p) for p in PROMPTS]
    assert all(len(p) > BS for p in ids)
    greedy = GenerationParams(max_tokens=MAX_NEW)
    reference = [c.token_ids for c in ref_engine.generate(ids, greedy)]
    eos = ref_engine.eos_token_id
    del ref_engine
    t_ref = time.perf_counter()

    a, c, b = 0, 1, 2  # request ids = prompt indices
    with DisaggPair(smollm2, prefill_config=REAL, decode_config=REAL, threads=1,
                    transport=transport) as pair:
        t_up = time.perf_counter()
        # 1. Prefill A and C only: T0 is the single engine's first token; their blocks are held.
        pre = pair.prefill([ids[a], ids[c]], greedy, request_ids=[a, c])
        for comp, rid in zip(pre, (a, c), strict=True):
            assert comp.token_ids == reference[rid][:1]
            x = comp.kv_transfer_params
            assert x["do_remote_prefill"] and not x["do_remote_decode"]
            assert x["first_token_id"] == reference[rid][0]
            assert len(x["transfer_id"]) == 32  # random, not the request id
            assert x["remote_host"] == "127.0.0.1" and x["remote_port"] == pair.info["prefill"][
                "port"]
            assert len(x["remote_block_ids"]) == -(-len(ids[rid]) // BS)
        held = set(pre[0].kv_transfer_params["remote_block_ids"]) | set(
            pre[1].kv_transfer_params["remote_block_ids"])
        st = pair.state("prefill")
        assert st["pending_sends"] == [a, c]
        assert st["num_free_blocks"] == st["num_usable_blocks"] - len(held), "freed before sent"
        assert st["num_waiting"] == st["num_running"] == 0

        # 2. Decode them: the decode engine pulls the KV, writes it into its own blocks, decodes.
        outs = pair.decode([ids[a], ids[c]], pre, greedy)
        for comp, rid in zip(outs, (a, c), strict=True):
            assert comp.token_ids == reference[rid], f"prompt {rid}"
            assert comp.finish_reason in ("max_tokens", "eos")

        st = pair.state("prefill")
        assert st["pending_sends"] == [] and not st["has_pending"]
        assert st["num_free_blocks"] == st["num_usable_blocks"], "the sends' blocks were not freed"
        dst = pair.state("decode")
        served, released = by_tid(st["log"], "served"), by_tid(st["log"], "released")
        received, alloc = by_tid(dst["log"], "received"), by_tid(dst["log"], "alloc")
        for rid in (a, c):
            # The same clock (CLOCK_MONOTONIC) in both processes: served, received, then freed.
            # (NIXL: the READ is posted, then its notification tells the producer.)
            if transport == "loopback":
                assert served[rid][0] <= received[rid][0] <= released[rid][0]
            else:
                assert by_tid(dst["log"], "read")[rid][0] <= served[rid][0] <= released[rid][0]
            assert released[rid][1] == "acked"
            # Every layer's K and V of the blocks the decode side's prefix cache lacked (C may
            # find the system prompt's block there if A's KV landed before C was admitted):
            # [layers, 2, n, 16, kv_heads, head_dim] float32.
            nblk = alloc[rid][1]["blocks"] - alloc[rid][1]["cached"]
            assert alloc[rid][1]["blocks"] == -(-len(ids[rid]) // BS)
            assert received[rid][1]["blocks"] == nblk
            assert received[rid][1]["bytes"] == nblk * 30 * 2 * BS * 3 * 64 * 4
        # The decode side published the received prompt blocks (8.15): its prefix cache has them.
        cached = set(dst["cached_block_hashes"])
        for rid in (a, c):
            assert set(prompt_block_hashes(ids[rid], BS)) <= cached
        assert dst["stats"]["num_remote_prefills"] == 2
        assert dst["num_free_blocks"] == dst["num_usable_blocks"]

        # 3. B shares A's prefix: the decode side has those blocks and pulls only the rest.
        (out_b,) = pair.generate([ids[b]], greedy, request_ids=[b])
        assert out_b.token_ids == reference[b]
        dst = pair.state("decode")
        alloc = by_tid(dst["log"], "alloc")[b][1]
        shared = len(os.path.commonprefix([ids[a], ids[b]])) // BS
        assert alloc["cached"] == shared >= 2
        assert by_tid(dst["log"], "received")[b][1]["blocks"] == alloc["blocks"] - shared
        assert dst["connector_errors"] == [] and dst["transfer_stats"]["failed"] == 0
        st = pair.state("prefill")
        assert st["num_free_blocks"] == st["num_usable_blocks"] and not st["has_pending"]
        t_pair = time.perf_counter()
        xfer = dst["transfer_stats"]
    assert pair.exitcodes == {"prefill": 0, "decode": 0}  # both stopped cleanly
    ours = [outs[0].token_ids, outs[1].token_ids, out_b.token_ids]

    # The same tokens as transformers' greedy generate (test_e2e's reference, tie-aware).
    from atom_sched.engine import weights
    from atom_sched.engine.reference import check_greedy

    hf = weights.load_hf_model(smollm2)
    for prompt, toks in zip(ids, [ours[0], ours[1], ours[2]], strict=True):
        res = check_greedy(hf, prompt, toks, MAX_NEW, eos)
        assert res.ok, res.detail
    t_end = time.perf_counter()
    print(f"\nreference engine {t_ref - t_start:.1f}s, pair start {t_up - t_ref:.1f}s "
          f"(loads {pair.info['prefill']['load_seconds']:.1f}s/"
          f"{pair.info['decode']['load_seconds']:.1f}s), disaggregated serving "
          f"{t_pair - t_up:.1f}s, transformers check {t_end - t_pair:.1f}s; moved "
          f"{xfer['blocks']} blocks, {xfer['bytes'] / 1e6:.1f} MB in {xfer['transfers']} pulls")


# ---- a tiny random Llama, both engines in this process -------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_case(tmp_path_factory)


MODES = [("sync", {}, {}), ("one-step-ahead", {}, {"one_step_ahead": True}),
         ("spec2-producer-drafts", {"num_speculative_tokens": 2},
          {"num_speculative_tokens": 2, "one_step_ahead": True}),
         ("mixed", {"policy": "mixed"}, {"policy": "mixed", "num_speculative_tokens": 2})]


@pytest.mark.parametrize("transport", ["loopback", "nixl"])
@pytest.mark.parametrize("name,prefill_kw,decode_kw", MODES, ids=[m[0] for m in MODES])
def test_in_process_pair_equals_one_engine(tiny, name, prefill_kw, decode_kw, transport):
    path, prompts, params, ref = tiny
    pair = Pair(path, prefill_kw, decode_kw, transport)
    try:
        for rid, p in enumerate(prompts[:2]):
            pair.submit(rid, p, params)
        pair.run()
        pair.submit(2, prompts[2], params)  # after prompt 0's blocks landed: a prefix hit
        pair.run()
        for rid in range(3):
            comp = pair.dec.completion(rid)
            assert comp.token_ids == ref[rid], (name, rid)
            x = pair.prefilled[rid].kv_transfer_params
            assert x["first_token_id"] == ref[rid][0]
            # The drafts the producer's drafter proposed (up to K: variable-length drafts).
            drafts = x["draft_token_ids"]
            assert len(drafts) <= prefill_kw.get("num_speculative_tokens", 0)
            assert all(d >= 0 for d in drafts)
        assert pair.dec.stats()["num_remote_prefills"] == 3
        alloc = by_tid(pair.cons.log, "alloc")
        assert alloc[0][1]["cached"] == 0 and alloc[2][1]["cached"] == 13 // 4
        for eng in (pair.pre, pair.dec):
            assert eng.scheduler.num_free_blocks == eng.scheduler.num_usable_blocks
            assert not eng.has_unfinished()
        if decode_kw.get("num_speculative_tokens"):
            assert pair.dec.stats()["num_accepted_draft_tokens"] > 0
    finally:
        pair.close()


def test_producer_holds_blocks_until_the_consumer_acknowledges(tiny):
    path, prompts, params, ref = tiny
    pair = Pair(path)
    try:
        pair.prefill_only([0], prompts, params)
        sched = pair.pre.scheduler
        held = len(pair.prefilled[0].kv_transfer_params["remote_block_ids"])
        for _ in range(5):  # nobody pulls: the blocks stay held, the engine keeps polling
            pair.pre.step()
            assert sched.num_free_blocks == sched.num_usable_blocks - held
            assert pair.pre.has_unfinished() and pair.prod.pending_sends == [0]
        pair.dec.add_request(prompts[0], params, request_id=0,
                             kv_transfer_params=pair.prefilled[0].kv_transfer_params)
        pair.run()
        assert pair.dec.completion(0).token_ids == ref[0]
        assert sched.num_free_blocks == sched.num_usable_blocks
        events = [ev for _, ev, rid, _ in pair.prod.log if rid == 0]
        assert events == ["finished", "served", "released"]
    finally:
        pair.close()


def test_failed_transfer_ends_only_its_request(tiny):
    path, prompts, params, ref = tiny
    pair = Pair(path)
    try:
        pair.prefill_only([0], prompts, params)
        bogus = dict(pair.prefilled[0].kv_transfer_params, transfer_id="77" * 16)
        pair.dec.add_request(prompts[0], params, request_id=5, kv_transfer_params=bogus)
        pair.dec.add_request(prompts[1], params, request_id=6)  # an ordinary local request
        pair.dec.add_request(prompts[0], params, request_id=0,
                             kv_transfer_params=pair.prefilled[0].kv_transfer_params)
        pair.run()
        bad = pair.dec.completion(5)
        assert bad.token_ids == [] and bad.finish_reason.startswith("kv transfer failed")
        assert "unknown transfer" in bad.finish_reason
        assert pair.dec.completion(6).token_ids == ref[1]
        assert pair.dec.completion(0).token_ids == ref[0]
        for eng in (pair.pre, pair.dec):
            assert eng.scheduler.num_free_blocks == eng.scheduler.num_usable_blocks
        assert pair.cons.transfer_stats["failed"] == 1
    finally:
        pair.close()


def test_abort_before_admission_releases_the_producer(tiny):
    path, prompts, params, _ = tiny
    pair = Pair(path)
    try:
        pair.prefill_only([0], prompts, params)
        pair.dec.add_request(prompts[0], params, request_id=0,
                             kv_transfer_params=pair.prefilled[0].kv_transfer_params)
        pair.dec.abort(0)  # never scheduled: nothing will pull the KV
        pair.run()
        sched = pair.pre.scheduler
        assert sched.num_free_blocks == sched.num_usable_blocks and not pair.prod.pending_sends
        assert [ev for _, ev, _, _ in pair.prod.log] == ["finished", "released"]
    finally:
        pair.close()


def test_connectors_use_loopback_only(tiny):
    with pytest.raises(ValueError, match="loopback"):
        LoopbackProducer(host="0.0.0.0")
    path, prompts, params, _ = tiny
    dec = LLMEngine(EngineConfig(**TINY), model_path=path)
    cons = LoopbackConsumer(secret=bytes(16))
    try:
        dec.set_kv_connector(cons)
        x = {"do_remote_prefill": True, "remote_block_ids": [0], "remote_host": "10.0.0.1",
             "remote_port": 5555, "transfer_id": "0" * 32, "first_token_id": 5}
        with pytest.raises(ValueError, match="loopback"):
            dec.add_request(prompts[1], params, request_id=0, kv_transfer_params=x)
        assert not dec.has_unfinished() and 0 not in dec.scheduler
        with pytest.raises(ValueError, match="do_remote_prefill"):
            dec.add_request(prompts[1], params, kv_transfer_params={"do_remote_decode": True})
    finally:
        cons.close()
