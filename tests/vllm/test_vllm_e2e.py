"""vLLM serving SmolLM2-135M on the CPU with atom_sched as its scheduler gives the same tokens as
with vLLM's own scheduler: prefix caching, chunked prefill, preemption, stop ids, min_tokens,
length caps, seeded sampling, and an abort through finish_requests.

Needs the venv of scripts/vllm_venv.sh (vLLM's CPU build); run from this folder:

    cd tests/vllm && ../../.venv-vllm/bin/python -m pytest -q .

Each engine runs in its own process (vllm_run.py), about 50 s apiece on two cores.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kv_replay import free_tcp_endpoint, replayed_batches  # noqa: E402
from stand_in import StandInRunner, make_request  # noqa: E402  (tests/vllm/stand_in.py)

HERE = Path(__file__).resolve().parent

# Per prompt of vllm_run.QUESTIONS: the cases a scheduler must stop or not stop on.
SAMPLING = [
    {"temperature": 0.0, "max_tokens": 48, "min_tokens": 20},     # EOS masked until 20 (8 else)
    {"temperature": 0.0, "max_tokens": 48},                       # EOS: "stop", no reason
    {"temperature": 0.0, "max_tokens": 48, "stop_token_ids": [30]},  # "." ends it: reason 30
    {"temperature": 0.0, "max_tokens": 20},                       # "length"
    # Sampled, unseeded: served but not compared. (A seed is what would make it comparable, but
    # vLLM 0.32's CPU runner fails on a seeded request whose prompt is chunked: "CPU Generator
    # does not use offset", with either scheduler.)
    {"temperature": 0.8, "top_p": 0.9, "max_tokens": 32},
    {"temperature": 0.0, "max_tokens": 40},
]
SAMPLED = 4

# Prefix caching and chunked prefill (64-token steps), KV plentiful.
PREFIX_CHUNKED = {"enable_prefix_caching": True, "max_num_batched_tokens": 64,
                  "max_model_len": 1024}
# Six blocks of 128 tokens (five usable): four requests fit (one shared prefix block each plus
# their own), and each needs a third block after ~22 tokens: preemptions.
SMALL_KV = {"enable_prefix_caching": True, "max_num_batched_tokens": 64, "max_model_len": 512,
            "num_gpu_blocks_override": 6}
# vLLM's n-gram drafts (proposed by its model runner from the request's own tokens, after each
# step's sampling), three a step: answers that repeat the question's words accept some.
NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 3, "prompt_lookup_min": 2}}


@functools.cache
def _run(cfg_json: str) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, str(HERE / "vllm_run.py"), cfg_json], cwd=HERE,
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"vllm_run.py failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run(scheduler: str, llm: dict, scenario: str = "generate", **extra) -> dict:
    cfg = {"scheduler": scheduler, "scenario": scenario, "llm": llm, "sampling": SAMPLING,
           **extra}
    return _run(json.dumps(cfg, sort_keys=True))


def _same_answers(ours: dict, theirs: dict) -> None:
    assert ours["scheduler"] == "atom_sched.vllm.scheduler.AtomScheduler"
    assert "AtomScheduler" not in theirs["scheduler"]
    assert len(ours["outputs"]) == len(theirs["outputs"]) == len(SAMPLING)
    for i, (a, b) in enumerate(zip(ours["outputs"], theirs["outputs"], strict=True)):
        if i == SAMPLED:
            assert 1 <= len(a["token_ids"]) <= 32 and a["finish_reason"] in ("stop", "length")
            continue
        assert a["token_ids"] == b["token_ids"], f"prompt {i}: tokens differ"
        assert (a["finish_reason"], a["stop_reason"]) == (b["finish_reason"], b["stop_reason"])


def _check_stop_rules(outputs: list[dict]) -> None:
    min_tok, eos_stop, period, length, _, _ = outputs
    assert len(min_tok["token_ids"]) >= 20
    assert eos_stop["finish_reason"] == "stop" and eos_stop["stop_reason"] is None
    assert period["finish_reason"] == "stop" and period["stop_reason"] == 30
    assert period["token_ids"][-1] == 30 and 30 not in period["token_ids"][:-1]
    assert length["finish_reason"] == "length" and len(length["token_ids"]) == 20


def test_prefix_caching_and_chunked_prefill_give_vllms_answers():
    ours = run("atom", PREFIX_CHUNKED)
    theirs = run("vllm", PREFIX_CHUNKED)
    _same_answers(ours, theirs)
    _check_stop_rules(ours["outputs"])
    stats = ours["core_stats"]
    # The shared system prompt's first block is served from the cache after the first request.
    assert stats["prefix_hit_tokens"] >= 128 * (len(SAMPLING) - 1)
    assert max(o["num_cached_tokens"] for o in ours["outputs"]) >= 128
    # What each prompt found in the cache and what it wrote there, as vLLM reports them (the
    # Anthropic API's cache_creation_input_tokens): the first request writes the shared block.
    counts = [(o["num_cached_tokens"], o["num_cache_creation_tokens"]) for o in ours["outputs"]]
    assert counts == [(o["num_cached_tokens"], o["num_cache_creation_tokens"])
                      for o in theirs["outputs"]]
    assert counts[0][1] >= 128
    assert stats["num_finished"] == len(SAMPLING) and stats["num_preemptions"] == 0
    assert ours["kv_usage_end"] == 0.0


def test_parallel_sampling_children_share_their_prompt_as_with_vllms_scheduler():
    """n = 3 children of each of three prompts arrive together: the first computes the prompt,
    the other two share its full 128-token blocks from that same step (vLLM caches blocks at
    allocation; the core publishes a chunk's blocks when it is scheduled), and every child
    answers as with vLLM's scheduler."""
    # (vLLM refuses n > 1 when greedy: top_k = 1 samples the argmax all the same.)
    greedy_n = [{"temperature": 1.0, "top_k": 1, "max_tokens": 16, "n": 3}]
    llm = {"enable_prefix_caching": True, "max_num_batched_tokens": 1024, "max_model_len": 1024}
    ours = run("atom", llm, sampling=greedy_n, num_prompts=3)
    theirs = run("vllm", llm, sampling=greedy_n, num_prompts=3)
    assert [o["samples"] for o in ours["outputs"]] == [o["samples"] for o in theirs["outputs"]]
    assert all(len(o["samples"]) == 3 for o in ours["outputs"])
    assert ([o["num_cached_tokens"] for o in ours["outputs"]]
            == [o["num_cached_tokens"] for o in theirs["outputs"]])
    # The shared system prompt's block, then each prompt's own blocks: two children of each
    # prompt hit every full block of it; the prompts after the first hit the system block too.
    stats = ours["core_stats"]
    print(f"prefix hit tokens {stats['prefix_hit_tokens']}, steps {stats['num_steps']}")
    assert stats["prefix_hit_tokens"] >= 2 * 3 * 128
    assert stats["num_finished"] == 9 and ours["kv_usage_end"] == 0.0


def test_preemption_under_a_small_kv_pool_gives_vllms_answers():
    ours = run("atom", SMALL_KV)
    theirs = run("vllm", SMALL_KV)
    print(f"preemptions: atom_sched {ours['preemptions']}, vLLM {theirs['preemptions']}; "
          f"prefix hit tokens (atom_sched) {ours['core_stats']['prefix_hit_tokens']}")
    assert ours["preemptions"] > 0, "the scenario must preempt under atom_sched"
    assert theirs["preemptions"] > 0, "the scenario must preempt under vLLM's scheduler"
    _same_answers(ours, theirs)
    _check_stop_rules(ours["outputs"])
    assert ours["core_stats"]["num_finished"] == len(SAMPLING)


def test_atom_sched_policies_keep_vllms_answers_under_preemption():
    """Issue 30's policies through vLLM's additional_config: SJF (by max_tokens) with
    least-computed victims changes whom the small pool serves first, not what it answers; an
    admission watermark of one block on top leaves the running requests room to grow, and the
    pool preempts less."""
    policies = {"scheduling": "sjf", "preemption_victim": "least_computed"}
    theirs = run("vllm", SMALL_KV)
    ours = run("atom", {**SMALL_KV, "additional_config": {"atom_sched": policies}})
    held = run("atom", {**SMALL_KV, "additional_config": {
        "atom_sched": {**policies, "admission_watermark_blocks": 1}}})
    print(f"preemptions: sjf + least computed {ours['preemptions']}, with a watermark "
          f"{held['preemptions']}")
    assert ours["preemptions"] > held["preemptions"]
    for res in (ours, held):
        _same_answers(res, theirs)
        _check_stop_rules(res["outputs"])
        assert res["core_stats"]["num_finished"] == len(SAMPLING)


def test_ngram_speculative_decoding_gives_vllms_answers():
    """Drafts from vLLM's n-gram proposer, handed over after each step and verified by the rows
    the core schedules (rejected ones rolled back), with prefix caching, chunked prefill and
    every stop rule: the same tokens and stops as vLLM's scheduler with the same drafter.

    One request at a time: vLLM 0.32's CPU runner corrupts the answers of a batch of several
    requests with drafts, with its own scheduler as with this class (a token 0, then unrelated
    text, where the answers without drafts are coherent; docs/vllm.md)."""
    one_at_a_time = {**PREFIX_CHUNKED, **NGRAM, "max_num_seqs": 1}
    ours = run("atom", one_at_a_time)
    theirs = run("vllm", one_at_a_time)
    stats = ours["core_stats"]
    print(f"drafts verified {stats['num_draft_tokens']}, accepted "
          f"{stats['num_accepted_draft_tokens']}")
    assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]
    _same_answers(ours, theirs)
    _check_stop_rules(ours["outputs"])
    assert stats["num_finished"] == len(SAMPLING) and ours["kv_usage_end"] == 0.0


def test_a_first_decode_row_is_padded_as_vllm_pads_it():
    """n-gram drafts, one request at a time, prefix caching: three prompts of 129 tokens, then
    the same three again, each of which finds 128 of its tokens (one vLLM CPU block) cached and
    has one left to compute. vLLM pads that first decode row to 1 + K with -1 drafts, and so does
    the class (pad_first_decode_rows): as many padded rows, and the same answers."""
    greedy = [{"temperature": 0.0, "max_tokens": 24}]
    one_at_a_time = {**PREFIX_CHUNKED, **NGRAM, "max_num_seqs": 1}
    runs = {name: run(name, one_at_a_time, sampling=greedy, num_prompts=3,
                      prompt_tail_tokens=129, repeat_prompts=True)
            for name in ("atom", "vllm")}
    ours, theirs = runs["atom"], runs["vllm"]
    print(f"padded rows: atom_sched {ours['padded_rows']}, vLLM {theirs['padded_rows']}")
    assert ours["padded_rows"] == theirs["padded_rows"] == [3]
    assert [o["token_ids"] for o in ours["outputs"]] == [o["token_ids"]
                                                         for o in theirs["outputs"]]
    assert [o["num_cached_tokens"] for o in ours["outputs"]] == [0, 0, 0, 128, 128, 128]
    # A repeated prompt answers as it did the first time (greedy, the same KV).
    assert [o["token_ids"] for o in ours["outputs"][3:]] == [o["token_ids"]
                                                             for o in ours["outputs"][:3]]
    assert ours["core_stats"]["num_finished"] == 6 and ours["kv_usage_end"] == 0.0


def _drafter_writing_ahead(**drafter) -> tuple[dict, dict]:
    """Both schedulers with a drafter that writes KV past each row's verified tokens (three
    tokens a step), one request at a time (vLLM's CPU runner corrupts batches of several with
    drafts), prefix caching, chunked prefill and every stop rule: the same tokens and stops, and
    every row's blocks, as vLLM's runner holds them, cover its positions and the drafter's slots
    past them (which the core reserves: num_lookahead_tokens). Returns (ours, vLLM's)."""
    one_at_a_time = {**PREFIX_CHUNKED, "max_num_seqs": 1}
    ours = run("atom", one_at_a_time, **drafter)
    theirs = run("vllm", one_at_a_time, **drafter)
    stats = ours["core_stats"]
    print(f"drafts verified {stats['num_draft_tokens']}, accepted "
          f"{stats['num_accepted_draft_tokens']}; rows (ours, vLLM's): {ours['lookahead']}, "
          f"{theirs['lookahead']}")
    assert stats["num_draft_tokens"] > 0
    for res in (ours, theirs):
        assert res["lookahead"]["uncovered_rows"] == 0, res["lookahead"]
    _same_answers(ours, theirs)
    _check_stop_rules(ours["outputs"])
    assert stats["num_finished"] == len(SAMPLING) and ours["kv_usage_end"] == 0.0
    return ours, theirs


def test_draft_model_speculative_decoding_gives_vllms_answers():
    """vLLM's draft-model drafter (SmolLM2 drafting for itself): vLLM's answers, with rows that
    needed a block for the drafter's slots alone, and some drafts accepted."""
    ours, _ = _drafter_writing_ahead(draft_model_tokens=3)
    assert ours["core_stats"]["num_accepted_draft_tokens"] > 0
    assert ours["lookahead"]["rows_needing_a_lookahead_block"] > 0


def test_eagle3_speculative_decoding_gives_vllms_answers():
    """vLLM's EAGLE-3 drafter (a seeded random head, eagle_head.py, on SmolLM2's hidden
    states): vLLM's answers, and a prefix hit's last block recomputed for the drafter (vLLM's
    EAGLE block drop; the prompts share one cached block, which no request takes as a hit, with
    either scheduler); the same cached counts and every proposal of the drafter as with vLLM's
    scheduler."""
    ours, theirs = _drafter_writing_ahead(eagle_tokens=3)
    # Without the drop every request after the first would take the system prompt's first block
    # (128 tokens) from the cache, as in test_prefix_caching_and_chunked_prefill_gives_vllms_...
    cached = [o["num_cached_tokens"] for o in ours["outputs"]]
    assert cached == [o["num_cached_tokens"] for o in theirs["outputs"]] == [0] * len(SAMPLING)
    # The drafter saw the same hidden states and tokens at every step (the sampled prompt's
    # drafts are left out with its answer).
    mine, vllms = ours["drafts"], theirs["drafts"]
    assert len(mine) == len(vllms) == len(SAMPLING)
    assert [d for i, d in enumerate(mine) if i != SAMPLED] == \
        [d for i, d in enumerate(vllms) if i != SAMPLED]


# Structured output (vLLM's grammar backend builds the bitmask of the rows this class
# schedules, and advances each grammar with the tokens the core accepts).
CITY = {"type": "object", "properties": {"city": {"type": "string"},
                                         "country": {"type": "string"}},
        "required": ["city", "country"]}
STRUCTURED = [
    {"temperature": 0.0, "max_tokens": 48, "structured_outputs": {"json": CITY}},
    {"temperature": 0.0, "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}},
    {"temperature": 0.0, "max_tokens": 12, "structured_outputs": {"regex": "[A-Z][a-z]+ [0-9]+"}},
    {"temperature": 0.0, "max_tokens": 24},  # no grammar, in the same batches
    {"temperature": 0.0, "max_tokens": 48, "structured_outputs": {"json": CITY}},
    {"temperature": 0.0, "max_tokens": 8, "structured_outputs": {"choice": ["red", "blue"]}},
]


def test_streaming_input_sessions_give_vllms_answers():
    """vLLM's streaming-input sessions (AsyncLLM.generate with an input stream, its engine core
    in a process of its own): three sessions of three turns, greedy, at most 12 tokens a turn,
    with prefix caching and 64-token steps: every turn's tokens and finish reason as with vLLM's
    scheduler. Session 0 is fed at once (its inputs wait while a turn runs); sessions 1 and 2
    turn by turn (each waits for input between turns, its KV kept, and its stream closes while
    it waits). A turn continues after its EOS ("stop") and after its length limit."""
    cfg = {"max_tokens": 12, "turns": 3, "wait": [False, True, True]}
    ours = run("atom", PREFIX_CHUNKED, scenario="sessions", **cfg)
    theirs = run("vllm", PREFIX_CHUNKED, scenario="sessions", **cfg)
    assert [len(turns) for turns in ours["sessions"]] == [3, 3, 3]
    finishes = [t["finish"] for turns in ours["sessions"] for t in turns[:-1]]
    assert {"stop", "length"} <= set(finishes), finishes
    assert ours["sessions"] == theirs["sessions"]


def test_structured_output_gives_vllms_answers():
    """JSON schema, choice and regex grammars beside a request without one, with prefix
    caching and chunked prefill: the same tokens as vLLM's scheduler, and each answer obeys
    its grammar."""
    ours = run("atom", PREFIX_CHUNKED, sampling=STRUCTURED)
    theirs = run("vllm", PREFIX_CHUNKED, sampling=STRUCTURED)
    assert ours["scheduler"] == "atom_sched.vllm.scheduler.AtomScheduler"
    for i, (a, b) in enumerate(zip(ours["outputs"], theirs["outputs"], strict=True)):
        assert a["token_ids"] == b["token_ids"], f"prompt {i}: tokens differ"
        assert a["finish_reason"] == b["finish_reason"]
    texts = [o["text"] for o in ours["outputs"]]
    for i in (0, 4):
        assert set(json.loads(texts[i])) >= {"city", "country"}, texts[i]
    assert texts[1] in ("yes", "no") and texts[5] in ("red", "blue")
    assert re.fullmatch("[A-Z][a-z]+ [0-9]+", texts[2]), texts[2]
    assert ours["core_stats"]["num_finished"] == len(STRUCTURED)


def test_kv_events_announce_the_blocks_vllms_scheduler_announces():
    """--kv-events-config on the real engine: the set of token blocks the class's events say
    were stored is the set vLLM's scheduler announces for the same requests (prefix caching,
    chunked prefill, a KV pool that evicts nothing; 32-token blocks, so that prompts and
    answers fill many, and every request greedy)."""
    greedy = [dict(sp, temperature=0.0) for sp in SAMPLING]
    small_blocks = {**PREFIX_CHUNKED, "block_size": 32}
    ours = run("atom", small_blocks, kv_events=True, sampling=greedy)
    theirs = run("vllm", small_blocks, kv_events=True, sampling=greedy)
    print(f"stored blocks: atom_sched {len(ours['stored_blocks'])}, vLLM "
          f"{len(theirs['stored_blocks'])}")
    assert ours["stored_blocks"] and ours["stored_blocks"] == theirs["stored_blocks"]


def test_lora_adapters_give_vllms_answers():
    """Two LoRA adapters (made for the test, lora_adapter.py) and requests without one, with
    max_loras=1: the class holds one adapter's requests outside the core while the other's run,
    and every answer is vLLM's scheduler's with the same adapters."""
    lora_llm = {**PREFIX_CHUNKED, "enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    greedy = [dict(sp, temperature=0.0) for sp in SAMPLING]
    extra = {"loras": {"A": [1, 1], "B": [2, 2]},
             "lora_of_prompt": ["B", "A", None, "A", "B", None], "sampling": greedy}
    ours = run("atom", lora_llm, **extra)
    theirs = run("vllm", lora_llm, **extra)
    base = run("vllm", PREFIX_CHUNKED, sampling=greedy)
    for i, (a, b) in enumerate(zip(ours["outputs"], theirs["outputs"], strict=True)):
        assert a["token_ids"] == b["token_ids"], f"prompt {i}: tokens differ"
        assert (a["finish_reason"], a["stop_reason"]) == (b["finish_reason"], b["stop_reason"])
    # The adapters change answers (adapter A, seed 1, changes this one on SmolLM2).
    assert ours["outputs"][1]["text"] != base["outputs"][1]["text"]
    assert ours["core_stats"]["num_finished"] == len(SAMPLING)


def test_kv_connector_loads_and_stores_kv_as_with_vllms_scheduler(tmp_path):
    """vLLM's ExampleConnector (a store of prompt KV in files) through the class: KV that
    vLLM's scheduler stored is loaded (synchronously, during the admitting step) and gives the
    same answers; KV the class stored is loaded by vLLM's scheduler and gives them too. Prefix
    caching is off, so every hit is the connector's."""
    llm = {"enable_prefix_caching": False, "max_model_len": 1024}
    theirs_store, ours_store = str(tmp_path / "by_vllm"), str(tmp_path / "by_atom")
    stored_by_vllm = run("vllm", llm, kv_store=theirs_store)
    loaded_by_atom = run("atom", llm, kv_store=theirs_store)
    stored_by_atom = run("atom", llm, kv_store=ours_store)
    loaded_by_vllm = run("vllm", llm, kv_store=ours_store)
    for ours, theirs in ((loaded_by_atom, stored_by_vllm), (stored_by_atom, loaded_by_vllm),
                         (loaded_by_atom, loaded_by_vllm)):
        _same_answers(ours, theirs)
    # The prompts share their first 128-token block: every load is that block.
    assert {o["num_cached_tokens"] for o in stored_by_vllm["outputs"]} == {0}
    assert {o["num_cached_tokens"] for o in loaded_by_atom["outputs"]} == {128}
    assert {o["num_cached_tokens"] for o in loaded_by_vllm["outputs"]} == {128}
    assert os.listdir(ours_store)


def test_a_failed_kv_load_is_recomputed_as_with_vllms_scheduler(tmp_path):
    """kv_load_failure_policy "recompute" on SmolLM2: a store of prompt KV written by vLLM's
    scheduler, then loaded through a connector that corrupts the first block it loads and
    reports it lost (tests/vllm/failing_kv.py). The class computes that KV again and gives the
    answers of the clean run, as vLLM's scheduler does. The loss matters: unreported, it
    changes the first answer; with "fail", that request ends with an error."""
    llm = {"enable_prefix_caching": False, "max_model_len": 1024}
    store = str(tmp_path / "store")
    clean = run("vllm", llm, kv_store=store)
    ours = run("atom", llm, kv_store=store, kv_lost_block="reported",
               kv_failure_policy="recompute")
    theirs = run("vllm", llm, kv_store=store, kv_lost_block="reported",
                 kv_failure_policy="recompute")
    _same_answers(ours, clean)
    _same_answers(ours, theirs)
    silent = run("atom", llm, kv_store=store, kv_lost_block="silent")
    assert silent["outputs"][0]["token_ids"] != clean["outputs"][0]["token_ids"]
    failed = run("atom", llm, kv_store=store, kv_lost_block="reported")
    assert failed["outputs"][0]["finish_reason"] == "error"


def test_abort_through_finish_requests():
    aborted = 3
    ours = run("atom", PREFIX_CHUNKED, scenario="abort", abort_after=6,
               abort_id=str(aborted))
    baseline = run("vllm", PREFIX_CHUNKED)
    for i, (a, b) in enumerate(zip(ours["outputs"], baseline["outputs"], strict=True)):
        if i == aborted:
            assert a is None  # aborted: vLLM's engine returns no final output for it
        elif i != SAMPLED:
            assert a["token_ids"] == b["token_ids"], f"prompt {i}: tokens differ"
    stats = ours["core_stats"]
    assert stats["num_aborted"] == 1 and stats["num_finished"] == len(SAMPLING) - 1
    assert ours["unfinished_after"] == 0 and ours["request_counts"] == [0, 0]
    assert ours["kv_usage_end"] == 0.0


# ---- refusals at construction (no model needed) ----------------------------------------------


def _config(**over):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)], num_blocks=64)
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(runner_type="generate", is_encoder_decoder=False,
                                     is_multimodal_model=False, max_model_len=256),
        speculative_config=None, num_speculative_tokens=0, num_lookahead_tokens=0,
        kv_transfer_config=None, ec_transfer_config=None,
        kv_events_config=None, lora_config=None,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1,
                                        decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1),
        scheduler_config=SimpleNamespace(async_scheduling=False, policy="fcfs",
                                         max_num_seqs=8, max_num_batched_tokens=64,
                                         max_num_scheduled_tokens=None,
                                         enable_chunked_prefill=True,
                                         long_prefill_token_threshold=0),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
    )
    for path, value in over.items():
        obj = cfg
        *parents, leaf = path.split("__")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, value)
    return cfg, kv


def test_accepts_a_plain_config_and_sizes_the_core_from_it():
    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config()
    s = AtomScheduler(cfg, kv, None, block_size=16)
    c = s.core_config
    assert (c.num_blocks, c.block_size, c.max_num_seqs, c.max_num_batched_tokens,
            c.max_model_len) == (64, 16, 8, 64, 256)
    assert c.policy == "mixed" and c.scheduling == "fcfs" and c.enable_prefix_caching
    assert s.get_kv_cache_usage() == 0.0 and s.get_request_counts() == (0, 0)
    assert not s.has_requests()


@pytest.mark.parametrize("method, k, lookahead, slots, drop, prefill_ahead", [
    ("eagle3", 3, 3, 0, True, 1), ("eagle3", 3, 3, 2, True, 1),  # EAGLE-3, P-EAGLE
    ("eagle", 2, 2, 0, False, 1),  # disable_eagle_block_drop
    ("mtp", 1, 1, 0, True, 1), ("mtp", 3, 3, 0, True, 3),  # one MTP module, three
    ("dflash", 4, 5, 4, True, 1), ("dspark", 4, 4, 3, True, 1)])
def test_accepts_the_eagle_family(method, k, lookahead, slots, drop, prefill_ahead):
    """Drafters on the target's hidden states: the KV slots past each row (vLLM's
    num_lookahead_tokens), their input slots, a prefix hit's last block recomputed (vLLM's
    use_eagle_block_drop), and the prompt tokens multi-module MTP reads past a chunk's end
    (num_prefill_lookahead_tokens; 1 constrains nothing), all as vLLM's config gives them."""
    from atom_sched.vllm import AtomScheduler

    spec = SimpleNamespace(method=method, max_num_new_slots_for_drafting=slots,
                           use_eagle_block_drop=lambda: drop)
    cfg, kv = _config(speculative_config=spec, num_speculative_tokens=k,
                      num_lookahead_tokens=lookahead, num_prefill_lookahead_tokens=prefill_ahead)
    c = AtomScheduler(cfg, kv, None, block_size=16).core_config
    assert (c.num_speculative_tokens, c.num_lookahead_tokens, c.draft_slots_per_row,
            c.recompute_last_hit_block) == (k, lookahead, slots, drop)
    assert c.prefill_lookahead_tokens == (prefill_ahead if prefill_ahead > 1 else 0)


@pytest.mark.parametrize("override, words", [
    ({"speculative_config": SimpleNamespace(method="suffix")}, "method 'suffix'"),
    ({"speculative_config": SimpleNamespace(method="ngram"), "num_speculative_tokens": 9},
     "9 speculative tokens"),
    ({"speculative_config": SimpleNamespace(method="ngram",
                                            num_speculative_tokens_per_batch_size=[(1, 8, 2)]),
      "num_speculative_tokens": 2}, "vary with the batch size"),
    ({"ec_transfer_config": object()}, "encoder-cache connectors"),
    ({"model_config__runner_type": "pooling"}, "pooling models"),
    ({"model_config__is_multimodal_model": True}, "multimodal models"),
    ({"model_config__is_encoder_decoder": True}, "encoder-decoder models"),
    ({"parallel_config__pipeline_parallel_size": 2}, "pipeline parallelism"),
    ({"diffusion_config": object()}, "diffusion language models"),
    ({"aux_output_config": SimpleNamespace(enabled=True)}, "routed experts"),
])
def test_refuses_what_it_does_not_serve(override, words):
    from atom_sched.vllm import AtomScheduler, UnsupportedFeature

    cfg, kv = _config(**override)
    with pytest.raises(UnsupportedFeature, match=words):
        AtomScheduler(cfg, kv, None, block_size=16)


def test_refuses_hybrid_and_sliding_window_kv_caches():
    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

    from atom_sched.vllm import AtomScheduler, UnsupportedFeature

    cfg, kv = _config()
    kv.kv_cache_groups = kv.kv_cache_groups * 2
    with pytest.raises(UnsupportedFeature, match="2 KV-cache groups"):
        AtomScheduler(cfg, kv, None, block_size=16)
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32,
                           sliding_window=128)
    kv.kv_cache_groups = [KVCacheGroupSpec(["l0"], sw)]
    with pytest.raises(UnsupportedFeature, match="SlidingWindowSpec"):
        AtomScheduler(cfg, kv, None, block_size=16)


def test_atom_sched_policies_through_additional_config():
    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(additional_config={"atom_sched": {
        "scheduling": "sjf", "preemption_victim": "least_computed", "sjf_aging_rate": 20,
        "admission_watermark_blocks": 3}})
    c = AtomScheduler(cfg, kv, None, block_size=16).core_config
    assert (c.scheduling, c.preemption_victim, c.sjf_aging_rate,
            c.admission_watermark_blocks) == ("sjf", "least_computed", 20.0, 3)
    # vLLM's priority policy alone, and with a victim rule.
    cfg, kv = _config(scheduler_config__policy="priority",
                      additional_config={"atom_sched": {"preemption_victim": "least_computed"}})
    c = AtomScheduler(cfg, kv, None, block_size=16).core_config
    assert (c.scheduling, c.preemption_victim) == ("priority", "least_computed")
    cfg, kv = _config(additional_config={"other_plugin": 1})
    c = AtomScheduler(cfg, kv, None, block_size=16).core_config
    assert (c.scheduling, c.preemption_victim, c.admission_watermark_blocks) == (
        "fcfs", "service_order", 0)


@pytest.mark.parametrize("opts, policy, words", [
    ([], "fcfs", "must be a dict"),
    ({"victim": "x"}, "fcfs", "unknown key"),
    ({"scheduling": "lifo"}, "fcfs", "scheduling must be one of"),
    ({"scheduling": "sjf"}, "priority", "only with it"),
    ({"scheduling": "priority"}, "fcfs", "only with it"),
    ({"preemption_victim": "random"}, "fcfs", "preemption_victim must be one of"),
    ({"sjf_aging_rate": "fast"}, "fcfs", "sjf_aging_rate must be a finite number"),
    ({"sjf_aging_rate": float("nan")}, "fcfs", "sjf_aging_rate must be a finite number"),
    ({"sjf_aging_rate": 0}, "fcfs", "sjf_aging_rate must be a finite number > 0"),
    ({"admission_watermark_blocks": True}, "fcfs", "admission_watermark_blocks must be an int"),
    ({"admission_watermark_blocks": 63}, "fcfs", "admission_watermark_blocks must be in"),
    ({"scheduling": "fair"}, "priority", "only with it"),
    ({"tenant_weights": {"a": "heavy"}}, "fcfs", "tenant_weights must be a dict of str"),
    ({"tenant_weights": {"a": 0}}, "fcfs", "the weight of tenant 'a' must be a finite number"),
])
def test_bad_atom_sched_policies_are_refused_at_construction(opts, policy, words):
    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(scheduler_config__policy=policy, additional_config={"atom_sched": opts})
    with pytest.raises(ValueError, match=words):
        AtomScheduler(cfg, kv, None, block_size=16)


# ---- the protocol against a stand-in model runner (stand_in.py; no model needed) ------------


def test_protocol_with_preemption_and_rejection_against_a_stand_in_runner():
    from vllm.v1.request import RequestStatus

    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config()
    kv.num_blocks = 4  # three usable blocks of 16 tokens
    s = AtomScheduler(cfg, kv, None, block_size=16, log_stats=True)
    runner = StandInRunner(16)
    s.add_request(make_request("a", 14, 8))
    s.add_request(make_request("b", 14, 8))
    s.add_request(make_request("big", 60, 4))  # four blocks: more than the pool holds
    seen_preempted, seen_resumed, finished, outputs = set(), set(), {}, {}
    for _ in range(100):
        if not s.has_requests():
            break
        out = s.schedule()
        seen_preempted |= out.preempted_req_ids or set()
        seen_resumed |= out.scheduled_cached_reqs.resumed_req_ids
        for eco in s.update_from_output(out, runner.step(out)).values():
            for o in eco.outputs:
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished[o.request_id] = str(o.finish_reason)
            assert eco.scheduler_stats is not None
    assert finished == {"a": "length", "b": "length", "big": "length"}
    assert outputs["a"] == [7] * 8 and outputs["b"] == [7] * 8 and outputs.get("big", []) == []
    # "b", admitted last, was the victim when both needed a second block, and came back.
    assert seen_preempted == {"b"} and seen_resumed == {"b"}
    assert s.core_stats()["num_preemptions"] == 1 and s.core_stats()["num_rejected"] == 1
    assert not s.requests and not runner.blocks and s.get_kv_cache_usage() == 0.0
    assert s.get_request_counts() == (0, 0)
    # Aborts: finish_requests ends a waiting and a running request and reports them once.
    s.add_request(make_request("c", 14, 8))
    s.add_request(make_request("d", 14, 8))
    out = s.schedule()
    s.update_from_output(out, runner.step(out))
    done = s.finish_requests(["c", "d", "nope"], RequestStatus.FINISHED_ABORTED)
    assert sorted(r.request_id for r in done) == ["c", "d"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    assert s.finish_requests("c", RequestStatus.FINISHED_ABORTED) == []
    out = s.schedule()
    assert out.finished_req_ids == {"c", "d"} and out.total_num_scheduled_tokens == 0
    s.update_from_output(out, runner.step(out))
    assert not s.has_requests() and s.core_stats()["num_aborted"] == 2


def test_a_row_the_runner_left_without_a_token_ends_only_its_request():
    """The runner and the scheduler disagree: a decoding row comes back with no token. That
    request ends with an error in this step's outputs (the runner is told it finished); the
    others go on and the engine keeps serving (vLLM's scheduler counts no token and leaves the
    request running)."""
    from vllm.v1.outputs import ModelRunnerOutput

    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config()
    s = AtomScheduler(cfg, kv, None, block_size=16, log_stats=True, include_finished_set=True)
    runner = StandInRunner(16)
    s.add_request(make_request("a", 14, 6))
    s.add_request(make_request("b", 14, 6))
    out = s.schedule()
    s.update_from_output(out, runner.step(out))
    out = s.schedule()
    mro = runner.step(out)
    emptied = [[] if rid == "b" else toks
               for rid, toks in zip(mro.req_ids, mro.sampled_token_ids, strict=True)]
    result = s.update_from_output(out, ModelRunnerOutput(
        req_ids=mro.req_ids, req_id_to_index=mro.req_id_to_index, sampled_token_ids=emptied))
    got = {o.request_id: o for eco in result.values() for o in eco.outputs}
    assert str(got["b"].finish_reason) == "error" and got["b"].new_token_ids == []
    assert got["a"].new_token_ids == [7] and got["a"].finish_reason is None
    assert "b" not in s.requests and "b" in result[0].finished_requests
    tokens = {"a": [7, 7]}
    while s.has_requests():
        out = s.schedule()
        assert "b" not in out.num_scheduled_tokens
        for eco in s.update_from_output(out, runner.step(out)).values():
            for o in eco.outputs:
                tokens[o.request_id].extend(o.new_token_ids)
    assert tokens == {"a": [7] * 6}
    assert s.get_kv_cache_usage() == 0.0 and not s.requests


def test_running_waiting_and_sampling_masks_against_a_stand_in_runner():
    import numpy as np
    from vllm.v1.outputs import SamplingMaskLists

    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(scheduler_config__max_num_seqs=2, model_config__return_sampling_mask=True)
    s = AtomScheduler(cfg, kv, None, block_size=16)
    runner = StandInRunner(16)
    for rid in ("a", "b", "c"):
        s.add_request(make_request(rid, 14, 4))
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"] and s.running == []
    out = s.schedule()
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    mro = runner.step(out)
    assert mro.req_ids == ["a", "b"]
    # CSR masks, one position per row: a kept {5, 6}, b kept {7}.
    mro.sampling_masks = SamplingMaskLists(np.array([5, 6, 7], dtype=np.int32),
                                           np.array([0, 2, 3]))
    outs = {o.request_id: o for o in s.update_from_output(out, mro)[0].outputs}
    assert outs["a"].new_sampling_mask.token_ids.tolist() == [5, 6]
    assert outs["b"].new_sampling_mask.token_ids.tolist() == [7]
    # Without return_sampling_mask the masks are not passed on (vLLM's rule).
    s.return_sampling_mask = False
    out = s.schedule()
    mro = runner.step(out)
    mro.sampling_masks = SamplingMaskLists(np.array([1, 2], dtype=np.int32), np.array([0, 1, 2]))
    assert all(o.new_sampling_mask is None
               for o in s.update_from_output(out, mro)[0].outputs)


@pytest.mark.parametrize("scheduling", ["fcfs", "sjf"])
def test_sjf_serves_the_shorter_request_first_against_a_stand_in_runner(scheduling):
    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(additional_config={"atom_sched": {"scheduling": scheduling}})
    s = AtomScheduler(cfg, kv, None, block_size=16)
    runner = StandInRunner(16)
    s.add_request(make_request("long", 14, 40))
    s.add_request(make_request("short", 14, 2))
    out = s.schedule()
    order = [r.req_id for r in out.scheduled_new_reqs]
    assert order == (["short", "long"] if scheduling == "sjf" else ["long", "short"])
    assert s.running == [s.requests[rid] for rid in order]
    finished = []
    for _ in range(60):
        for eco in s.update_from_output(out, runner.step(out)).values():
            finished += [o.request_id for o in eco.outputs if o.finish_reason is not None]
        if not s.has_requests():
            break
        out = s.schedule()
    assert finished == ["short", "long"]


@pytest.mark.parametrize("scheduling", ["fcfs", "fair"])
def test_fair_share_admits_a_light_tenant_beside_a_flood_against_a_stand_in_runner(scheduling):
    """Tenant a sends four 14-token prompts before tenant b's one (extra_args["tenant"], the
    OpenAI server's vllm_xargs); a 64-token step admits all five, b's in second place under
    fair share and last (a chunk) under FCFS."""
    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(additional_config={"atom_sched": {"scheduling": scheduling,
                                                        "tenant_weights": {"a": 1, "b": 2}}})
    s = AtomScheduler(cfg, kv, None, block_size=16)
    assert s.core_config.tenant_weights == {"a": 1.0, "b": 2.0}
    for i in range(4):
        s.add_request(make_request(f"a{i}", 14, 4, extra_args={"tenant": "a"}))
    s.add_request(make_request("b0", 14, 4, extra_args={"tenant": "b"}))
    out = s.schedule()
    order = [r.req_id for r in out.scheduled_new_reqs]
    assert order.index("b0") == (1 if scheduling == "fair" else 4), order
    runner = StandInRunner(16)
    for _ in range(60):
        s.update_from_output(out, runner.step(out))
        if not s.has_requests():
            break
        out = s.schedule()
    assert not s.has_requests() and s.core_stats()["num_finished"] == 5


def test_requests_it_cannot_serve_end_with_an_error_while_the_rest_run():
    """What a client sends that the class or the core cannot serve (a cache_salt over 256
    bytes, a token id past int32) must not raise inside vLLM's
    engine loop, which would stop it for every client: each such request ends with
    finish_reason "error" and no tokens, delivered with the next step's outputs (and in
    finished_requests for vLLM's multi-engine bookkeeping), while the others are served."""
    from vllm.v1.engine import FinishReason

    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config()
    s = AtomScheduler(cfg, kv, None, block_size=16, include_finished_set=True)
    bad = {"salty": make_request("salty", 14, 4, cache_salt="x" * 257),
           "huge_id": make_request("huge_id", [1, 2**31], 4)}
    for request in bad.values():
        s.add_request(request)
    s.add_request(make_request("ok", 14, 4))
    assert s.get_num_unfinished_requests() == 1 and s.has_finished_requests()
    assert s.get_request_counts() == (0, 1) and s.core_stats()["num_finished"] == 0
    runner = StandInRunner(16)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["ok"]
    eco = s.update_from_output(out, runner.step(out))[0]
    ended = {o.request_id: o for o in eco.outputs if o.finish_reason is not None}
    assert set(ended) == set(bad)
    assert all(o.finish_reason == FinishReason.ERROR and o.new_token_ids == []
               for o in ended.values())
    assert set(bad) <= eco.finished_requests
    assert not s.has_finished_requests()
    tokens = [t for o in eco.outputs if o.request_id == "ok" for t in o.new_token_ids]
    while s.has_requests():
        out = s.schedule()
        for e in s.update_from_output(out, runner.step(out)).values():
            tokens += [t for o in e.outputs if o.request_id == "ok" for t in o.new_token_ids]
    assert tokens == [7] * 4 and s.core_stats()["num_finished"] == 1


def test_streaming_input_sessions_against_a_stand_in_runner():
    """vLLM's resumable requests: session "a" is fed turn by turn (it waits for input between
    turns, its KV kept, not counted as unfinished work), session "b" gets its next input and
    its stream's end while its first turn runs (queued, as vLLM's scheduler queues them). Each
    next turn goes to the runner as a new request, computed up to its last turn's last sampled
    token (dropped); a continuation the core refuses ends its session with an error."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config()
    s = AtomScheduler(cfg, kv, None, block_size=16)
    runner = StandInRunner(16)
    a = make_request("a", 20, 3, resumable=True)
    b = make_request("b", 20, 2, resumable=True)
    for request in (a, b, make_request("b", [5, 6, 7], 2, resumable=True),
                    make_request("b", [1], 1)):  # (not resumable: b's stream ends)
        s.add_request(request)
    new_turns: dict[str, list] = {}
    ends: dict[str, list] = {}

    def step() -> None:
        out = s.schedule()
        for new in out.scheduled_new_reqs:
            new_turns.setdefault(new.req_id, []).append(
                (new.num_computed_tokens, list(new.prompt_token_ids)))
        for eco in s.update_from_output(out, runner.step(out)).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    ends.setdefault(o.request_id, []).append(o.finish_reason)
        s.core.check_invariants()

    while s.get_num_unfinished_requests():
        step()
    # a's first turn ended (length); b's two turns ran back to back, and its stream's end
    # finished it with its second turn.
    assert ends == {"a": [FinishReason.LENGTH], "b": [FinishReason.LENGTH] * 2}
    assert a.status == RequestStatus.WAITING_FOR_STREAMING_REQ and "a" in s.requests
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and "b" not in s.requests
    # (b's prompt is a's: a's first block, computed in that same step, is shared, as vLLM's
    # scheduler shares a block from its allocation.)
    assert new_turns["b"] == [(16, list(range(1, 21))),
                              (21, list(range(1, 21)) + [7, 5, 6, 7])]
    assert s.get_num_unfinished_requests() == 0 and s.get_request_counts() == (0, 1)
    assert s.get_kv_cache_usage() > 0  # a's KV, kept between turns

    s.add_request(make_request("a", [9, 9], 2, resumable=True))
    assert s.get_num_unfinished_requests() == 1
    step()
    assert new_turns["a"][-1] == (22, list(range(1, 21)) + [7, 7, 9, 9])
    assert a.num_prompt_tokens == 24 and list(a.output_token_ids) == [7]
    while s.get_num_unfinished_requests():
        step()
    assert ends["a"] == [FinishReason.LENGTH] * 2
    # A next turn the core refuses (a token id past int32): the session ends with an error.
    s.add_request(make_request("a", [2**31], 2, resumable=True))
    assert "a" not in s.requests and a.status == RequestStatus.FINISHED_ERROR
    out = s.schedule()
    eco = s.update_from_output(out, runner.step(out))[0]
    assert [(o.request_id, o.finish_reason) for o in eco.outputs] == [("a", FinishReason.ERROR)]
    assert not s.has_requests() and s.get_kv_cache_usage() == 0.0


def test_a_session_held_outside_the_core_keeps_its_next_input():
    """max_loras = 1: session "b" of adapter B is held outside the core while adapter A's
    request runs; its next input and its stream's end, arriving meanwhile, wait with it (never
    an exception in vLLM's engine loop) and make its second turn its last."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine import FinishReason

    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(lora_config=SimpleNamespace(max_loras=1))
    s = AtomScheduler(cfg, kv, None, block_size=16)
    a, b = LoRARequest("A", 1, "/adapters/a"), LoRARequest("B", 2, "/adapters/b")
    s.add_request(make_request("a", 14, 3, lora_request=a))
    for request in (make_request("b", 14, 2, lora_request=b, resumable=True),
                    make_request("b", [5, 6], 2, lora_request=b, resumable=True),
                    make_request("b", [1], 1, lora_request=b)):
        s.add_request(request)
    assert [r.request_id for r in s.waiting] == ["a", "b"]  # b held: A has the one slot
    runner = StandInRunner(16)
    turns, ends = [], {}
    while s.has_requests():
        out = s.schedule()
        turns += [(n.req_id, n.num_computed_tokens, list(n.prompt_token_ids))
                  for n in out.scheduled_new_reqs]
        for eco in s.update_from_output(out, runner.step(out)).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    ends.setdefault(o.request_id, []).append(o.finish_reason)
        s.core.check_invariants()
    assert ends == {"a": [FinishReason.LENGTH], "b": [FinishReason.LENGTH] * 2}
    assert turns == [("a", 0, list(range(1, 15))), ("b", 0, list(range(1, 15))),
                     ("b", 15, list(range(1, 15)) + [7, 5, 6])]
    assert "b" not in s.requests and s.get_kv_cache_usage() == 0.0


def test_a_lora_name_the_core_refuses_ends_that_request_and_takes_no_adapter_slot():
    """An adapter name over the core's 256 bytes (a name the server was given) ends that request
    with an error; the slot of max_loras = 1 stays free for the next adapter."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine import FinishReason

    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(lora_config=SimpleNamespace(max_loras=1))
    s = AtomScheduler(cfg, kv, None, block_size=16)
    s.add_request(make_request("long", 14, 2, lora_request=LoRARequest("x" * 300, 1, "/x")))
    s.add_request(make_request("ok", 14, 2, lora_request=LoRARequest("B", 2, "/b")))
    assert s.get_request_counts() == (0, 1), "the refused adapter must not hold the slot"
    runner = StandInRunner(16)
    ended = {}
    while s.has_requests():
        out = s.schedule()
        for eco in s.update_from_output(out, runner.step(out)).values():
            ended.update({o.request_id: o.finish_reason for o in eco.outputs
                          if o.finish_reason is not None})
    assert ended == {"long": FinishReason.ERROR, "ok": FinishReason.LENGTH}


def test_a_request_waits_outside_the_core_while_its_grammar_compiles():
    """A structured-output request joins the core only once vLLM's grammar for it has
    compiled (vLLM's WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR): meanwhile it is counted and listed
    as waiting, an abort ends it, and a grammar that failed to compile ends it with an error
    (vLLM's rule) while the others run."""
    from concurrent.futures import Future

    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import Request, RequestStatus

    from atom_sched.vllm import AtomScheduler

    def structured(rid):
        sp = SamplingParams(temperature=0.0, max_tokens=4,
                            structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
        r = Request(request_id=rid, prompt_token_ids=list(range(1, 15)), sampling_params=sp,
                    pooling_params=None)
        compiling = Future()  # vLLM's compilation, not done yet
        r.structured_output_request.grammar = compiling
        return r, compiling

    cfg, kv = _config()
    s = AtomScheduler(cfg, kv, None, block_size=16)
    (broken, compiling), (dropped, _) = structured("broken"), structured("dropped")
    for r in (broken, dropped, make_request("plain", 14, 4)):
        s.add_request(r)
    runner = StandInRunner(16)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["plain"]
    assert s.get_request_counts() == (1, 2) and s.get_num_unfinished_requests() == 3
    assert [r.request_id for r in s.waiting] == ["broken", "dropped"]
    assert not out.has_structured_output_requests and s.get_grammar_bitmask(out) is None
    s.update_from_output(out, runner.step(out))
    assert s.finish_requests("dropped", RequestStatus.FINISHED_ABORTED) == [dropped]
    compiling.set_exception(RuntimeError("bad grammar"))
    out = s.schedule()
    assert "broken" not in out.num_scheduled_tokens
    ended = {o.request_id: o for o in s.update_from_output(out, runner.step(out))[0].outputs
             if o.finish_reason is not None}
    assert ended["broken"].finish_reason == FinishReason.ERROR
    while s.has_requests():
        out = s.schedule()
        s.update_from_output(out, runner.step(out))
    assert s.core_stats()["num_finished"] == 1 and s.get_request_counts() == (0, 0)


def test_at_most_max_loras_adapters_are_in_the_core_at_once():
    """max_loras = 1: requests of adapter B are held outside the core while adapter A's run
    (listed as waiting), requests without an adapter run beside them, and B's join once A's
    last request has ended; no step schedules two adapters; an abort of a held request ends
    it there."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import RequestStatus

    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(lora_config=SimpleNamespace(max_loras=1))
    s = AtomScheduler(cfg, kv, None, block_size=16)
    lora = {"A": LoRARequest("A", 1, "/adapters/a"), "B": LoRARequest("B", 2, "/adapters/b")}
    plan = {"a1": ("A", 3), "b1": ("B", 2), "a2": ("A", 5), "x": (None, 6), "b2": ("B", 2),
            "b3": ("B", 2)}
    for rid, (name, n) in plan.items():
        s.add_request(make_request(rid, 14, n, lora_request=lora.get(name)))
    assert [r.request_id for r in s.waiting][-3:] == ["b1", "b2", "b3"]
    assert s.get_request_counts() == (0, 6)
    assert s.finish_requests("b3", RequestStatus.FINISHED_ABORTED)[0].request_id == "b3"
    runner = StandInRunner(16)
    first_step = {}
    step = 0
    while s.has_requests():
        out = s.schedule()
        adapters = {plan[rid][0] for rid in out.num_scheduled_tokens} - {None}
        assert len(adapters) <= 1, adapters
        for new in out.scheduled_new_reqs:
            first_step[new.req_id] = step
        s.update_from_output(out, runner.step(out))
        step += 1
    assert first_step["a1"] == first_step["a2"] == first_step["x"] == 0
    # B's requests start once a2, A's last, has ended (1 prefill + 4 decode steps).
    assert first_step["b1"] == first_step["b2"] == 5
    assert s.core_stats()["num_finished"] == 5


def _run_async_engine(s, runner, *, after_schedule=None, with_output=None, after_update=None,
                      max_steps: int = 100) -> dict[str, list[int]]:
    """vLLM's engine loop under async scheduling, model-free: the next step is scheduled while
    one is in flight (its batch queue of two), outputs go back oldest first. Hooks:
    ``after_schedule(out, queue)``, ``with_output(out, model_runner_output)`` (to attach what a
    runner would report besides tokens), ``after_update(engine_core_outputs, queue)``. Returns
    every request's streamed tokens."""
    from collections import deque

    got: dict[str, list[int]] = defaultdict(list)
    queue: deque = deque()
    for _ in range(max_steps):
        if not (s.has_requests() or queue):
            return dict(got)
        if len(queue) < 2 and s.has_requests():
            out = s.schedule()
            queue.append(out)
            if after_schedule is not None:
                after_schedule(out, queue)
            if out.total_num_scheduled_tokens:
                continue
        out = queue.popleft()
        mro = runner.step(out)
        if with_output is not None:
            with_output(out, mro)
        result = s.update_from_output(out, mro)
        for eco in result.values():
            for o in eco.outputs:
                got[o.request_id] += o.new_token_ids
        if after_update is not None:
            after_update(result, queue)
    raise AssertionError(f"the requests did not finish in {max_steps} steps")


@pytest.mark.parametrize("num_blocks", [64, 4], ids=["plenty", "preempting"])
def test_async_scheduling_one_step_ahead_against_a_stand_in_runner(num_blocks):
    """async_scheduling (vLLM's AsyncScheduler protocol, its engine's batch queue of two): the
    next step is scheduled before the last one's output lands, each row that samples adds an
    output placeholder the runner counts (num_output_tokens) and its output takes it off; no
    row is scheduled for a request whose outputs in flight end it; with three usable blocks a
    request is preempted while its output is in flight, and every answer is whole."""
    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(scheduler_config__async_scheduling=True)
    kv.num_blocks = num_blocks
    s = AtomScheduler(cfg, kv, None, block_size=16)
    assert s.async_scheduling
    max_tokens = {"a": 8, "b": 8, "c": 3}
    for rid, n in max_tokens.items():
        s.add_request(make_request(rid, 14, n))
    scheduled_tokens, in_flight = 0, set()

    def after_schedule(out, queue):
        nonlocal scheduled_tokens
        c = out.scheduled_cached_reqs
        for rid, n_out in zip(c.req_ids, c.num_output_tokens, strict=True):
            request = s.requests[rid]
            assert n_out == request.num_output_tokens + (
                request.num_output_placeholders - (0 if request.is_prefill_chunk else 1))
        scheduled_tokens += out.total_num_scheduled_tokens
        in_flight.add(len(queue))

    got = _run_async_engine(s, StandInRunner(16), after_schedule=after_schedule)
    assert got == {rid: [7] * n for rid, n in max_tokens.items()}
    assert max(in_flight) == 2
    preempted = s.core_stats()["num_preemptions"]
    assert (preempted > 0) == (num_blocks == 4)
    if not preempted:
        # Every prompt once, then one row per output but the first (the prefill samples it).
        assert scheduled_tokens == sum(14 + n - 1 for n in max_tokens.values())
    assert not s.requests and s.get_request_counts() == (0, 0)


def test_update_from_output_takes_the_oldest_output_back_only():
    """update_from_output() of a SchedulerOutput the class did not return, or not the oldest
    outstanding one, is a ValueError that changes nothing: applying one step's tokens to
    another's rows would corrupt every answer in it."""
    from vllm.v1.core.sched.output import SchedulerOutput

    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(scheduler_config__async_scheduling=True)
    s = AtomScheduler(cfg, kv, None, block_size=16)
    runner = StandInRunner(16)
    s.add_request(make_request("a", 14, 4))
    with pytest.raises(ValueError, match="0 outstanding"):
        s.update_from_output(SchedulerOutput.make_empty(), None)
    first = s.schedule()
    second = s.schedule()
    ran_first = runner.step(first)
    for wrong in (second, SchedulerOutput.make_empty()):
        with pytest.raises(ValueError, match="oldest"):
            s.update_from_output(wrong, ran_first)
    s.update_from_output(first, ran_first)
    got = []
    queue = [second]
    while queue:
        out = queue.pop(0)
        for eco in s.update_from_output(out, runner.step(out)).values():
            got += [t for o in eco.outputs for t in o.new_token_ids]
        if s.has_requests():
            queue.append(s.schedule())
    assert got == [7] * 3 and not s.has_requests()


@pytest.mark.parametrize("bad", [7, ["a"], "x" * 257, "\ud800"])
def test_a_bad_tenant_counts_against_the_default_tenant(bad):
    """The tenant is a client's value (vllm_xargs): one that is not a str of at most 256 bytes
    of UTF-8 must not raise inside vLLM's engine loop; the request runs as tenant ""."""
    from atom_sched.vllm import AtomScheduler

    cfg, kv = _config(additional_config={"atom_sched": {"scheduling": "fair"}})
    s = AtomScheduler(cfg, kv, None, block_size=16)
    s.add_request(make_request("x", 14, 4, extra_args={"tenant": bad}))
    s.add_request(make_request("y", 14, 4, extra_args={"tenant": ""}))
    runner = StandInRunner(16)
    out = s.schedule()
    assert {r.req_id for r in out.scheduled_new_reqs} == {"x", "y"}
    for _ in range(20):
        s.update_from_output(out, runner.step(out))
        if not s.has_requests():
            break
        out = s.schedule()
    assert not s.has_requests() and s.core_stats()["num_finished"] == 2


def _spec_scheduler(k: int = 2, **over):
    from atom_sched.vllm import AtomScheduler

    over.setdefault("speculative_config", SimpleNamespace(method="ngram"))
    cfg, kv = _config(num_speculative_tokens=k, **over)
    return AtomScheduler(cfg, kv, None, block_size=16, log_stats=True)


def test_drafts_are_verified_rolled_back_and_counted_against_a_stand_in_runner():
    """K = 2 drafts a row from update_draft_token_ids (after each step, as vLLM's engine hands
    them over). The stand-in model samples 7: request a's drafts [7, 7] are both accepted (three
    tokens a step), b's [7, 9] lose the second (two a step, the rejected one rolled back), c
    gets none (one a step). Every request stops at max_tokens exactly, the last row truncated."""
    s = _spec_scheduler()
    plan = {"a": [7, 7], "b": [7, 9], "c": []}
    runner = StandInRunner(16, drafter=lambda rid: plan[rid])
    for rid in plan:
        s.add_request(make_request(rid, 14, 8))
    got = {rid: [] for rid in plan}
    widths = {rid: set() for rid in plan}
    drafted = accepted = 0
    for _ in range(20):
        out = s.schedule()
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            assert drafts == plan[rid]
            assert out.num_scheduled_tokens[rid] == 1 + len(drafts)
        for rid, n in out.num_scheduled_tokens.items():
            widths[rid].add(n)
        for eco in s.update_from_output(out, runner.step(out)).values():
            for o in eco.outputs:
                got[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    assert str(o.finish_reason) == "length"
            if (st := eco.scheduler_stats.spec_decoding_stats) is not None:
                drafted += st.num_draft_tokens
                accepted += st.num_accepted_tokens
        for rid in runner.sampled_ids:
            if rid in s.requests:
                # The runner's count of computed tokens: the rejected draft rolled back.
                assert s.requests[rid].num_computed_tokens == runner.tokens[rid] - 1
        s.update_draft_token_ids(runner.take_draft_token_ids())
        if not s.has_requests():
            break
    assert got == {rid: [7] * 8 for rid in plan}
    # Drafts are proposed from the prefill's token on: every decode row of a and b is 3 wide.
    assert widths == {"a": {14, 3}, "b": {14, 3}, "c": {14, 1}}
    core = s.core_stats()
    assert (core["num_draft_tokens"], core["num_accepted_draft_tokens"]) == (drafted, accepted)
    # a: 1 (prefill) + 3 + 3 + 1 (its third row's 3 truncated): drafts 2 x 3, accepted 2 x 3.
    # b: 1 + 2 + 2 + 2 + 1 (its fourth row's 2 truncated): drafts 2 x 4, accepted 1 x 4.
    assert (drafted, accepted) == (6 + 8, 6 + 4)


def test_async_scheduling_with_drafts_on_the_device_against_a_stand_in_runner():
    """ngram_gpu with async scheduling (vLLM's AsyncScheduler with a drafter on the device): a
    decode row is scheduled one step ahead with K placeholder drafts (-1), the runner verifies
    its own; accepted ones come back as tokens, rejected ones roll the request's computed count
    and output placeholders back. Every request stops at max_tokens exactly; the stats count
    every placeholder scheduled against a sampled row as proposed (vLLM's rule)."""
    s = _spec_scheduler(scheduler_config__async_scheduling=True,
                        speculative_config=SimpleNamespace(method="ngram_gpu"))
    assert s.async_scheduling
    plan = {"a": [7, 7], "b": [7, 9], "c": []}
    for rid in plan:
        s.add_request(make_request(rid, 14, 8))
    drafted = accepted = 0

    def after_schedule(out, queue):
        for drafts in out.scheduled_spec_decode_tokens.values():
            assert set(drafts) == {-1}

    def after_update(result, queue):
        nonlocal drafted, accepted
        for eco in result.values():
            if (st := eco.scheduler_stats.spec_decoding_stats) is not None:
                drafted += st.num_draft_tokens
                accepted += st.num_accepted_tokens
        s.core.check_invariants()
        for rid, request in s.requests.items():
            # One placeholder per token the steps in flight may still bring (every row here
            # samples: the prompts are one chunk).
            assert request.num_output_placeholders == sum(
                1 + len(o.scheduled_spec_decode_tokens.get(rid, ()))
                for o in queue if rid in o.num_scheduled_tokens)

    runner = StandInRunner(16, drafter=lambda rid: plan[rid], drafts_on_device=True)
    got = _run_async_engine(s, runner, after_schedule=after_schedule, after_update=after_update)
    assert got == {rid: [7] * 8 for rid in plan}
    assert not s.requests and s.get_kv_cache_usage() == 0.0
    core = s.core_stats()
    assert (core["num_draft_tokens"], core["num_accepted_draft_tokens"]) == (drafted, accepted)
    assert accepted > 0 and drafted > accepted


def test_draft_handover_drops_what_cannot_be_verified():
    """Drafts for a finished or unknown request, for a prompt still being chunked, and drafts
    the core refuses (more than K, negative) are dropped without raising inside vLLM's loop:
    the row verifies none. Draft tokens without speculative decoding are refused."""
    from vllm.v1.outputs import DraftTokenIds

    from atom_sched.vllm import AtomScheduler, UnsupportedFeature

    s = _spec_scheduler(scheduler_config__max_num_batched_tokens=16)
    runner = StandInRunner(16)
    s.add_request(make_request("a", 14, 4))
    s.add_request(make_request("long", 40, 4))  # chunked over three steps
    out = s.schedule()
    s.update_from_output(out, runner.step(out))
    assert s.requests["long"].is_prefill_chunk
    s.update_draft_token_ids(DraftTokenIds(["a", "long", "gone"], [[5, 6, 7], [5], [5]]))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens["a"] == 1
    s.update_from_output(out, runner.step(out))
    s.update_draft_token_ids(DraftTokenIds(["a"], [[-3]]))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {}
    s.update_from_output(out, runner.step(out))

    cfg, kv = _config()
    plain = AtomScheduler(cfg, kv, None, block_size=16)
    with pytest.raises(UnsupportedFeature, match="without speculative decoding"):
        plain.update_draft_token_ids(DraftTokenIds(["a"], [[5]]))


def test_kv_events_go_out_through_vllms_publisher():
    """--kv-events-config: the core's BlockStored (prompt blocks once their KV is computed; a
    prefix hit stores nothing new), BlockRemoved (cached blocks evicted for another prompt) and
    AllBlocksCleared (reset_prefix_cache) reach a ZMQ client in vLLM's format, through vLLM's
    own publisher (its replay socket here)."""
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    from atom_sched.vllm import AtomScheduler

    pub, replay = free_tcp_endpoint(), free_tcp_endpoint()
    cfg, kv = _config(kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=pub, replay_endpoint=replay,
        topic="kv"))
    kv.num_blocks = 5  # four usable blocks of 16 tokens
    s = AtomScheduler(cfg, kv, None, block_size=16)
    published = []
    publish = s.kv_event_publisher.publish
    s.kv_event_publisher.publish = lambda batch: (published.append(batch), publish(batch))
    runner = StandInRunner(16)
    shared = list(range(1, 33))

    def serve(rid, prompt):
        s.add_request(make_request(rid, prompt, 4))
        while s.has_requests():
            out = s.schedule()
            s.update_from_output(out, runner.step(out))

    try:
        serve("a", shared + list(range(100, 108)))  # blocks [1..16], [17..32] stored
        serve("b", shared + list(range(200, 208)))  # a prefix hit: nothing new stored
        serve("c", list(range(300, 360)))  # four blocks: a's two cached ones evicted
        assert s.reset_prefix_cache()
        out = s.schedule()  # a step with nothing to run publishes the reset
        s.update_from_output(out, runner.step(out))
        batches = replayed_batches(replay, len(published))
    finally:
        s.shutdown()
    events = [e for b in batches for e in b.events]
    assert len(batches) == len(published)
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    by_hash = {h: e for e in stored for h in e.block_hashes}
    blocks = [tuple(e.token_ids[i * 16:(i + 1) * 16]) for e in stored
              for i in range(len(e.block_hashes))]
    assert blocks[:2] == [tuple(range(1, 17)), tuple(range(17, 33))]
    assert tuple(range(300, 316)) in blocks and len(blocks) == len(set(blocks))
    assert all(e.block_size == 16 and e.medium == "GPU" and e.group_idx == 0 for e in stored)
    a_hashes = [h for e in stored for h in e.block_hashes][:2]  # the blocks of `blocks[:2]`
    assert set(a_hashes) <= set(removed) <= set(by_hash)
    assert isinstance(events[-1], AllBlocksCleared)


@pytest.mark.parametrize("seed", range(12))
def test_random_streams_keep_every_invariant_against_a_stand_in_runner(seed):
    """The features together, on random streams: arrivals over time, prompts of 5 to 70 tokens
    in a pool of seven 16-token blocks (preemption), one in ten longer (rejected), aborts of
    live requests (in flight too), two LoRA adapters with max_loras = 1, and per seed either
    drafts (some right, some wrong; on one such seed in four a draft model's and on another
    EAGLE-3's, with KV lookahead slots the runner checks, and for EAGLE-3 a prefix hit's last
    block recomputed) or async scheduling. After every call the
    core's invariants hold; no step schedules two adapters; every request that was not aborted
    ends with exactly its max_tokens tokens or is rejected whole; nothing is left behind."""
    import random
    from collections import deque

    from vllm.lora.request import LoRARequest
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    from atom_sched.vllm import AtomScheduler

    rng = random.Random(seed)
    use_async = seed % 2 == 1
    k = 0 if use_async else 2
    over = {"lora_config": SimpleNamespace(max_loras=1),
            "scheduler_config__max_num_seqs": 4, "scheduler_config__max_num_batched_tokens": 32,
            "scheduler_config__async_scheduling": use_async}
    # A draft model's (vLLM: K slots ahead, an input slot a row) or EAGLE-3's (K slots ahead, a
    # prefix hit's last block recomputed), else n-gram's.
    method = {0: "draft_model", 4: "eagle3"}.get(seed % 8, "ngram")
    lookahead = k if method != "ngram" else 0
    slots = 1 if method == "draft_model" else 0
    drop = method == "eagle3"
    if k:
        over.update(speculative_config=SimpleNamespace(
            method=method, max_num_new_slots_for_drafting=slots,
            use_eagle_block_drop=lambda: drop), num_speculative_tokens=k,
            num_lookahead_tokens=lookahead)
    cfg, kv = _config(**over)
    kv.num_blocks = 8
    s = AtomScheduler(cfg, kv, None, block_size=16)
    assert s.core_config.num_lookahead_tokens == lookahead
    assert s.core_config.draft_slots_per_row == slots
    assert s.core_config.recompute_last_hit_block == (drop and k > 0)
    loras = [None, LoRARequest("A", 1, "/a"), LoRARequest("B", 2, "/b")]
    runner = StandInRunner(16, drafter=lambda rid: [7, rng.choice([7, 9])][:rng.randint(0, k)],
                           lookahead=lookahead, position_limit=7 * 16)
    want, got, ended, aborted, adapter = {}, {}, {}, set(), {}
    queue: deque = deque()
    next_id = 0

    def deliver(out):
        for eco in s.update_from_output(out, runner.step(out)).values():
            for o in eco.outputs:
                got[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    ended[o.request_id] = o.finish_reason
        s.core.check_invariants()
        if k:
            s.update_draft_token_ids(runner.take_draft_token_ids())
            s.core.check_invariants()

    for step in range(400):
        if step < 150 and rng.random() < 0.3:
            rid = f"r{next_id}"
            next_id += 1
            want[rid], got[rid] = rng.randint(1, 12), []
            adapter[rid] = rng.choice(loras)
            # One prompt in ten is longer than the pool's 112 positions: rejected.
            length = rng.randint(5, 70) if rng.random() < 0.9 else rng.randint(113, 130)
            s.add_request(make_request(rid, length, want[rid], lora_request=adapter[rid]))
        if step < 150 and s.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(s.requests))
            s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
        s.core.check_invariants()
        if len(queue) < (2 if use_async else 1) and s.has_requests():
            out = s.schedule()
            s.core.check_invariants()
            names = {adapter[r].lora_name for r in out.num_scheduled_tokens if adapter[r]}
            assert len(names) <= 1, names
            # The runner's input buffers: the rows' tokens and their drafter's input slots.
            rows = len(out.num_scheduled_tokens)
            assert out.total_num_scheduled_tokens + rows * slots <= 32
            queue.append(out)
            if use_async and out.total_num_scheduled_tokens and len(queue) < 2:
                continue
        if queue:
            deliver(queue.popleft())
        if step >= 150 and not queue and not s.has_requests():
            break
    assert not queue and not s.has_requests(), "requests left unfinished"
    for rid, n in want.items():
        if rid in aborted:
            continue
        if ended[rid] == FinishReason.LENGTH and got[rid] == []:
            continue  # rejected: the prompt can never fit the pool
        assert got[rid] == [7] * n, (rid, got[rid], n)
    assert not s.requests and not runner.blocks and s.get_kv_cache_usage() == 0.0
    stats = s.core_stats()
    print(f"seed {seed}: {len(want)} requests, {len(aborted)} aborted, "
          f"{stats['num_preemptions']} preemptions, {stats['num_rejected']} rejected, "
          f"{stats['num_accepted_draft_tokens']}/{stats['num_draft_tokens']} drafts accepted")


# ---- KV connectors (tests/vllm/scripted_kv.py; no model needed) ---------------------------------


def _connector_scheduler(name: str = "ScriptedConnector", role: str = "kv_both",
                         num_blocks: int = 64, failure_policy: str = "fail", **over):
    from scripted_kv import ScriptedConnector
    from vllm.config import KVTransferConfig

    from atom_sched.vllm import AtomScheduler

    ScriptedConnector.script, ScriptedConnector.keep = {}, set()
    ScriptedConnector.fail_finish = set()
    cfg, kv = _config(
        kv_transfer_config=KVTransferConfig(kv_connector=name,
                                            kv_connector_module_path="scripted_kv",
                                            kv_role=role,
                                            kv_load_failure_policy=failure_policy),
        scheduler_config__disable_hybrid_kv_cache_manager=True, **over)
    kv.num_blocks = num_blocks
    s = AtomScheduler(cfg, kv, None, block_size=16, log_stats=True)
    return s, ScriptedConnector.last


def _connector_step(s, runner, outputs, kv_output=None):
    out = s.schedule()
    mro = runner.step(out)
    if kv_output is not None:
        mro.kv_connector_output = kv_output
    for eco in s.update_from_output(out, mro).values():
        for o in eco.outputs:
            outputs.setdefault(o.request_id, []).append(o)
    s.core.check_invariants()
    return out


def test_kv_connector_external_tokens_against_a_stand_in_runner():
    """The connector's answers through the class: a synchronous load (the row starts after
    it, has_sync_kv_loads), "cannot tell yet" (skipped, asked again), an asynchronous load
    (WAITING_FOR_REMOTE_KVS holding the loaded tokens' blocks, admitted once the workers report
    it, from the loaded tokens), each allocation shown to the connector and its metadata."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    s, conn = _connector_scheduler()
    assert s.get_kv_connector() is conn
    conn.script.update({"sync": (32, False), "later": None, "async": (32, True)})
    for rid in ("sync", "later", "async"):
        s.add_request(make_request(rid, 40, 2))
    runner, outputs = StandInRunner(16), {}
    out = _connector_step(s, runner, outputs)
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("sync", 32)]
    assert out.num_scheduled_tokens == {"sync": 8} and out.has_sync_kv_loads
    assert isinstance(out.kv_connector_metadata, KVConnectorMetadata)
    assert [(rid, len(ids), n) for rid, ids, n in out.kv_connector_metadata.allocs] == [
        ("sync", 3, 32), ("async", 2, 32)]
    assert s.requests["async"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.get_request_counts() == (1, 2)
    out = _connector_step(s, runner, outputs)  # "later" is asked again: nothing external
    assert [r.req_id for r in out.scheduled_new_reqs] == ["later"]
    assert not out.has_sync_kv_loads
    assert [c[1] for c in conn.calls if c[0] == "match"] == ["sync", "later", "async", "later"]
    _connector_step(s, runner, outputs, KVConnectorOutput(finished_recving={"async"}))
    out = _connector_step(s, runner, outputs)
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("async", 32)]
    for _ in range(10):
        if not s.has_requests():
            break
        _connector_step(s, runner, outputs)
    assert {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()} \
        == {"sync": [7, 7], "later": [7, 7], "async": [7, 7]}
    assert s.get_kv_cache_usage() == 0.0


def test_kv_connector_delayed_free_reports_and_load_failures():
    """A send keeps the request's blocks until the workers report it (the engine keeps
    stepping meanwhile), its kv_transfer_params come with its final output; a report naming an
    id nothing waits on is dropped; a failed load ends its request with an error, nothing
    streamed."""
    from vllm.v1.outputs import KVConnectorOutput

    s, conn = _connector_scheduler()
    conn.keep.add("send")
    conn.script["bad"] = (32, False)
    s.add_request(make_request("send", 20, 1))
    # (A prompt of its own: a prefix of "send"'s would hit its first block, shared from the
    # step that computes it, and the connector's 32 tokens would then run past its end.)
    s.add_request(make_request("bad", list(range(100, 140)), 4))
    runner, outputs = StandInRunner(16), {}
    out = s.schedule()
    bad_blocks = out.scheduled_new_reqs[1].block_ids[0]
    mro = runner.step(out)
    mro.kv_connector_output = KVConnectorOutput(invalid_block_ids={bad_blocks[0]})
    for eco in s.update_from_output(out, mro).values():
        for o in eco.outputs:
            outputs.setdefault(o.request_id, []).append(o)
    s.core.check_invariants()
    (bad,) = outputs["bad"]
    assert bad.new_token_ids == [] and str(bad.finish_reason) == "error"
    (send,) = outputs["send"]
    assert send.new_token_ids == [7] and str(send.finish_reason) == "length"
    assert send.kv_transfer_params == {"sent_by": "scripted", "request": "send"}
    assert ("finished", "send", [out.scheduled_new_reqs[0].block_ids[0][0],
                                 out.scheduled_new_reqs[0].block_ids[0][1]]) in conn.calls
    # Finished, its blocks kept for the send: the engine goes on stepping.
    assert s.get_num_unfinished_requests() == 0 and s.has_requests()
    assert s.get_kv_cache_usage() > 0.0
    _connector_step(s, runner, outputs, KVConnectorOutput(finished_sending={"nobody"}))
    assert s.has_requests()
    _connector_step(s, runner, outputs, KVConnectorOutput(finished_sending={"send"}))
    assert not s.has_requests() and s.get_kv_cache_usage() == 0.0
    assert len(conn.outputs) == 3


def test_failed_kv_loads_are_recomputed_with_the_recompute_policy():
    """kv_load_failure_policy 'recompute': a request whose synchronous load failed at its
    second block computes its prompt again from there in the next step (its token of the failed
    step dropped, the connector not asked again); one whose asynchronous receive failed
    computes all it was loading once the receive is reported. Both are served in full."""
    from vllm.v1.outputs import KVConnectorOutput

    s, conn = _connector_scheduler(failure_policy="recompute")
    conn.script.update({"sync": (32, False), "async": (32, True)})
    s.add_request(make_request("sync", 40, 2))
    s.add_request(make_request("async", 40, 2))
    runner, outputs = StandInRunner(16), {}
    out = s.schedule()
    assert out.num_scheduled_tokens == {"sync": 8}
    sync_blocks = out.scheduled_new_reqs[0].block_ids[0]
    mro = runner.step(out)
    mro.kv_connector_output = KVConnectorOutput(invalid_block_ids={sync_blocks[1]},
                                                failed_recving={"async"})
    for eco in s.update_from_output(out, mro).values():
        for o in eco.outputs:
            outputs.setdefault(o.request_id, []).append(o)
    s.core.check_invariants()
    assert "sync" not in outputs  # its row computed on KV that never arrived
    request = s.requests["sync"]
    assert request.num_computed_tokens == 16 and request.num_output_tokens == 0
    out = _connector_step(s, runner, outputs, KVConnectorOutput(finished_recving={"async"}))
    assert out.num_scheduled_tokens == {"sync": 24}
    assert out.scheduled_cached_reqs.num_computed_tokens == [16]
    out = _connector_step(s, runner, outputs)
    assert out.num_scheduled_tokens["async"] == 40  # all it was loading: computed here
    while s.has_requests():
        _connector_step(s, runner, outputs)
    assert {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()} \
        == {"sync": [7, 7], "async": [7, 7]}
    assert all(str(outs[-1].finish_reason) == "length" for outs in outputs.values())
    assert [c[1] for c in conn.calls if c[0] == "match"].count("sync") == 1
    assert s.get_kv_cache_usage() == 0.0
    # A failed block the prefix cache already serves (others may read it) is not rewound: that
    # request ends with an error.
    conn.script["again"] = (8, False)
    s.add_request(make_request("again", 40, 2))
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens > 32  # 32 cached, then loaded
    mro = runner.step(out)
    mro.kv_connector_output = KVConnectorOutput(
        invalid_block_ids={out.scheduled_new_reqs[0].block_ids[0][0]})
    (eco,) = s.update_from_output(out, mro).values()
    assert [(o.request_id, str(o.finish_reason)) for o in eco.outputs] == [("again", "error")]
    out = s.schedule()  # the runner hears of it
    assert out.finished_req_ids == {"again"}
    s.update_from_output(out, runner.step(out))
    assert not s.has_requests() and s.get_kv_cache_usage() == 0.0


def test_a_failing_connector_costs_only_its_request(caplog):
    """A connector that raises (or claims more tokens than a request has) ends that request with
    an error at admission; one whose request_finished raises frees the blocks at once (nothing
    held for a send). The others are served; every failure is logged."""
    s, conn = _connector_scheduler()
    conn.script.update({"boom": RuntimeError("store down"), "greedy": (41, False),
                        "fractional": (1.5, False)})
    conn.fail_finish.add("fin")
    conn.keep.add("fin")
    for rid in ("boom", "greedy", "fractional", "fin", "fine"):
        s.add_request(make_request(rid, 40, 2))
    runner, outputs = StandInRunner(16), {}
    for _ in range(10):
        if not s.has_requests():
            break
        _connector_step(s, runner, outputs)
    ends = {rid: (str(outs[-1].finish_reason), [t for o in outs for t in o.new_token_ids])
            for rid, outs in outputs.items()}
    assert ends == {"boom": ("error", []), "greedy": ("error", []), "fractional": ("error", []),
                    "fin": ("length", [7, 7]), "fine": ("length", [7, 7])}
    assert s.get_kv_cache_usage() == 0.0 and not s.has_requests()
    logged = caplog.text
    assert "store down" in logged and "claims 41 tokens" in logged and "1.5 tokens" in logged
    assert "transfer engine gone" in logged


def test_a_consumer_connector_with_async_scheduling_against_a_stand_in_runner():
    """Async scheduling with a consumer connector: blocks freed while a step is in flight wait
    for it (the core's fence_freed_blocks), an asynchronous load lands between two steps in
    flight, every answer is whole."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    s, conn = _connector_scheduler(role="kv_consumer", scheduler_config__async_scheduling=True)
    assert s.async_scheduling and s.core_config.fence_freed_blocks
    assert not s.core_config.drop_preempted_outputs  # a consumer hands nothing off
    conn.script.update({"async": (32, True), "sync": (16, False)})
    max_tokens = {"async": 4, "sync": 5, "plain": 3}
    for rid, n in max_tokens.items():
        s.add_request(make_request(rid, 40, n))
    recv_sent = False

    def with_output(out, mro):
        nonlocal recv_sent
        if not recv_sent and s.requests["async"].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            mro.kv_connector_output = KVConnectorOutput(finished_recving={"async"})
            recv_sent = True

    got = _run_async_engine(s, StandInRunner(16), with_output=with_output,
                            after_update=lambda result, queue: s.core.check_invariants())
    assert recv_sent and got == {rid: [7] * n for rid, n in max_tokens.items()}
    assert not s.requests and s.get_kv_cache_usage() == 0.0


def test_a_producer_connector_with_async_scheduling_hands_off_only_held_blocks():
    """A connector that hands KV off at a finish (a producer), async scheduling and a pool of
    three blocks: requests are preempted with outputs in flight. Those outputs are dropped
    (vLLM's requires_kv_delivery), so no request finishes while it holds no blocks: every
    hand-off names the request's blocks; the sends are reported and every answer is whole."""
    from vllm.v1.outputs import KVConnectorOutput

    s, conn = _connector_scheduler(role="kv_both", num_blocks=4,
                                   scheduler_config__async_scheduling=True)
    assert s.core_config.drop_preempted_outputs and s.core_config.fence_freed_blocks
    max_tokens = {"a": 8, "b": 8, "c": 3}
    conn.keep.update(max_tokens)
    for rid, n in max_tokens.items():
        s.add_request(make_request(rid, 14, n))
    reported: set[str] = set()

    def with_output(out, mro):
        finished = {c[1] for c in conn.calls if c[0] == "finished"} - reported
        if finished:
            mro.kv_connector_output = KVConnectorOutput(finished_sending=finished)
            reported.update(finished)

    got = _run_async_engine(s, StandInRunner(16), with_output=with_output,
                            after_update=lambda result, queue: s.core.check_invariants())
    assert got == {rid: [7] * n for rid, n in max_tokens.items()}
    assert s.core_stats()["num_preemptions"] > 0
    handoffs = [c for c in conn.calls if c[0] == "finished"]
    assert sorted(c[1] for c in handoffs) == ["a", "b", "c"]
    assert all(c[2] for c in handoffs), handoffs  # every hand-off names blocks
    assert not s.has_requests() and s.get_kv_cache_usage() == 0.0


def test_a_connector_that_takes_vllms_block_pool_is_refused():
    from atom_sched.vllm import UnsupportedFeature

    with pytest.raises(UnsupportedFeature, match="PoolConnector .*GPU block pool"):
        _connector_scheduler("PoolConnector")
