"""The example engine's parts on a tiny random Llama (built in memory by transformers, no download):
the paged-KV forward against transformers' logits, the engine's greedy tokens against
transformers' ``generate`` in every protocol (synchronous, one step ahead, speculative K = 1..4)
under preemption, chunked prefill and prefix caching, seeded sampling, the drafter, the sampler.

The same checks on the real SmolLM2-135M-Instruct are in test_e2e_smollm2.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from atom_sched.engine import EngineConfig, GenerationParams, LLMEngine  # noqa: E402
from atom_sched.engine.drafter import NgramDrafter  # noqa: E402
from atom_sched.engine.model import (  # noqa: E402
    LlamaDims,
    LlamaForCausalLM,
    ModelInputs,
    PagedKVCache,
)
from atom_sched.engine.reference import check_greedy, hf_generate  # noqa: E402
from atom_sched.engine.sampler import Sampler, filter_logits, position_seed  # noqa: E402

EOS = 1
MAX_NEW = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer GQA Llama with random, fairly peaked weights, saved as a checkpoint folder."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-5, initializer_range=0.25, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=EOS, pad_token_id=EOS)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(str(path), safe_serialization=True)
    return path, hf


def test_paged_forward_matches_transformers(tiny):
    """Two sequences, prefilled in chunks into scrambled blocks, then decoded together with a
    draft-verification row: every logit equals transformers' full forward."""
    path, hf = tiny
    dims = LlamaDims.from_hf_config(hf.config.to_dict())
    model = LlamaForCausalLM(dims, {k: v.detach() for k, v in hf.state_dict().items()})
    bs = 4
    cache = PagedKVCache(dims, num_blocks=32, block_size=bs)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(2, 96, size=23).tolist(), rng.integers(2, 96, size=14).tolist()]
    blocks = [[17, 3, 29, 8, 11, 5, 20], [2, 30, 9, 14, 25]]
    with torch.no_grad():
        ref = [hf(torch.tensor([s])).logits[0] for s in seqs]

    def step(spans):  # spans: [(seq, start, end)], each row's tokens [start, end)
        ids, pos, slots, cu, lens = [], [], [], [0], []
        for s, a, b in spans:
            ids += seqs[s][a:b]
            pos += list(range(a, b))
            slots += [blocks[s][p // bs] * bs + p % bs for p in range(a, b)]
            cu.append(cu[-1] + b - a)
            lens.append(b)
        width = max(len(blocks[s]) for s, _, _ in spans)
        bt = [blocks[s] + [0] * (width - len(blocks[s])) for s, _, _ in spans]
        inp = ModelInputs(
            torch.tensor(ids), torch.tensor(pos), torch.tensor(lens, dtype=torch.int32),
            torch.tensor(cu, dtype=torch.int32), torch.tensor(slots),
            torch.tensor(bt, dtype=torch.int32), torch.arange(len(ids)),
            max(b - a for _, a, b in spans), max(lens))
        return model(inp, cache)

    got = [[], []]
    for spans in ([(0, 0, 9), (1, 0, 6)], [(0, 9, 20)], [(1, 6, 11)],
                  [(0, 20, 21), (1, 11, 14)], [(0, 21, 23)]):
        out = step(spans)
        i = 0
        for s, a, b in spans:
            got[s].append(out[i: i + b - a])
            i += b - a
    for s in range(2):
        torch.testing.assert_close(torch.cat(got[s]), ref[s], atol=1e-4, rtol=1e-4)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    shared = rng.integers(2, 96, size=32).tolist()  # 4 full blocks of 8 shared by 3 prompts
    prompts = [shared + rng.integers(2, 96, size=n).tolist() for n in (9, 21, 3)]
    prompts += [rng.integers(2, 96, size=n).tolist() for n in (40, 17, 55)]
    return prompts


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    _, hf = tiny
    return [hf_generate(hf, p, MAX_NEW, EOS) for p in _prompts()]


MODES = [  # (one_step_ahead, K)
    (False, 0), (True, 0), (False, 1), (False, 2), (True, 2), (False, 3), (True, 3),
    (False, 4), (True, 4)]


def _engine(path, one_step_ahead: bool, k: int, **kw) -> LLMEngine:
    cfg = EngineConfig(num_blocks=kw.pop("num_blocks", 22), block_size=8, max_num_seqs=8,
                       max_num_batched_tokens=kw.pop("chunk", 32), max_model_len=512,
                       num_speculative_tokens=k, one_step_ahead=one_step_ahead,
                       check_invariants=True, check_builder=True, **kw)
    return LLMEngine(cfg, model_path=path)


@pytest.mark.parametrize("one_step_ahead,k", MODES,
                         ids=[f"{'async' if a else 'sync'}-K{k}" for a, k in MODES])
def test_greedy_matches_transformers(tiny, tiny_reference, one_step_ahead, k):
    path, hf = tiny
    eng = _engine(path, one_step_ahead, k)
    outs = eng.generate(_prompts(), GenerationParams(max_tokens=MAX_NEW))
    stats = eng.stats()
    assert stats["num_preemptions"] > 0, "the small KV pool should force preemption"
    assert stats["prefix_hit_tokens"] > 0, "the shared prefix should hit the prefix cache"
    assert eng.timings.partial_prefill_rows > 0, "prompts longer than the chunk are chunked"
    ties = 0
    for prompt, out, ref in zip(_prompts(), outs, tiny_reference, strict=True):
        res = check_greedy(hf, prompt, out.token_ids, MAX_NEW, EOS, reference=ref)
        assert res.ok, res.detail
        ties += len(res.ties)
        assert out.finish_reason in ("eos", "max_tokens")
    assert ties <= 1, f"{ties} float-rounding ties on a tiny model: suspicious"
    if k:
        assert stats["num_spec_steps"] > 0 and stats["num_draft_tokens"] > 0
        assert stats["num_accepted_draft_tokens"] > 0, "no draft was ever accepted"


POLICIES = [("fcfs", "least_computed", False, 0), ("sjf", "service_order", True, 2),
            ("sjf", "least_computed", False, 3), ("fair", "service_order", True, 0)]


@pytest.mark.parametrize("scheduling,victim,one_step_ahead,k", POLICIES,
                         ids=[f"{s}-{v}-{'async' if a else 'sync'}-K{k}"
                              for s, v, a, k in POLICIES])
def test_policies_keep_the_greedy_answers(tiny, tiny_reference, scheduling, victim,
                                          one_step_ahead, k):
    """Issue 30: SJF (by length hints, aged), fair share (two tenants, weights 2:1) and
    least-computed victims reach the engine's scheduler, and change the order of service only:
    with the small pool forcing preemption, every answer is still transformers' greedy one."""
    path, hf = tiny
    eng = _engine(path, one_step_ahead, k, scheduling=scheduling, preemption_victim=victim,
                  sjf_aging_rate=5.0, tenant_weights={"t0": 2.0})
    assert (eng.sched_config.scheduling, eng.sched_config.preemption_victim) == (
        scheduling, victim)
    params = [GenerationParams(max_tokens=MAX_NEW, length_hint=MAX_NEW - 3 * i,
                               tenant=f"t{i % 2}") for i in range(len(_prompts()))]
    outs = eng.generate(_prompts(), params)
    assert eng.stats()["num_preemptions"] > 0, "the small KV pool should force preemption"
    for prompt, out, ref in zip(_prompts(), outs, tiny_reference, strict=True):
        res = check_greedy(hf, prompt, out.token_ids, MAX_NEW, EOS, reference=ref)
        assert res.ok, res.detail


def test_sampling_is_seeded_and_mode_independent(tiny):
    """Temperature / top-k / top-p sampling with a seed gives the same tokens in every protocol
    (draws depend on the seed and the position only), and another seed gives others."""
    path, _ = tiny
    params = [GenerationParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.9, seed=100 + i)
              for i in range(len(_prompts()))]
    runs = {}
    for asy, k in [(False, 0), (True, 0), (False, 3), (True, 2)]:
        eng = _engine(path, asy, k)
        runs[(asy, k)] = [o.token_ids for o in eng.generate(_prompts(), params)]
    first = runs[(False, 0)]
    for key, toks in runs.items():
        assert toks == first, f"mode {key} sampled differently"
    other = [GenerationParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.9, seed=7 + i)
             for i in range(len(_prompts()))]
    eng = _engine(path, False, 0)
    assert [o.token_ids for o in eng.generate(_prompts(), other)] != first


def test_top_k_one_is_greedy(tiny, tiny_reference):
    path, _ = tiny
    eng = _engine(path, False, 0, num_blocks=64)
    outs = eng.generate(_prompts(), GenerationParams(max_tokens=MAX_NEW, temperature=1.3, top_k=1,
                                                     seed=3))
    greedy = _engine(path, False, 0, num_blocks=64).generate(
        _prompts(), GenerationParams(max_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]


def test_stop_token_ids_and_max_tokens(tiny, tiny_reference):
    path, _ = tiny
    ref = tiny_reference[3]
    stop = ref[5]
    first = ref.index(stop)
    eng = _engine(path, False, 2, num_blocks=64)
    out = eng.generate([_prompts()[3]], GenerationParams(max_tokens=MAX_NEW,
                                                          stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == f"stop_{stop}"
    out = _engine(path, True, 0).generate([_prompts()[3]], GenerationParams(max_tokens=3))[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "max_tokens"


def test_streaming_events_add_up(tiny):
    path, _ = tiny
    eng = _engine(path, True, 2)
    seen: dict[int, list[int]] = {}
    finished = []
    outs = eng.generate(_prompts(), GenerationParams(max_tokens=MAX_NEW),
                        on_event=lambda ev: (seen.setdefault(ev.request_id, []).extend(
                            ev.token_ids), ev.finished and finished.append(ev.request_id)))
    assert sorted(finished) == sorted(o.request_id for o in outs)
    for o in outs:
        assert seen[o.request_id] == o.token_ids


@pytest.mark.parametrize("one_step_ahead,k", [(False, 0), (True, 0), (True, 3)])
def test_abort_mid_run(tiny, tiny_reference, one_step_ahead, k):
    """Aborting a request (also while a batch holding it is in flight) frees it; the others
    still produce transformers' tokens."""
    path, hf = tiny
    eng = _engine(path, one_step_ahead, k)
    rids = [eng.add_request(p, GenerationParams(max_tokens=MAX_NEW)) for p in _prompts()]
    for _ in range(12):
        eng.step()
    victim = rids[1]
    eng.abort(victim)
    eng.run()
    assert eng.completion(victim).finish_reason == "abort"
    for i, rid in enumerate(rids):
        if rid == victim:
            continue
        c = eng.completion(rid)
        res = check_greedy(hf, c.prompt_token_ids, c.token_ids, MAX_NEW, EOS,
                           reference=tiny_reference[i])
        assert res.ok, res.detail
    assert not eng.has_unfinished()
    assert eng.scheduler.num_free_blocks == eng.scheduler.num_usable_blocks


def test_rejected_prompt_is_reported(tiny):
    path, _ = tiny
    eng = _engine(path, False, 0, num_blocks=64)
    outs = eng.generate([[5] * 600, _prompts()[0]], GenerationParams(max_tokens=4))
    assert outs[0].finish_reason.startswith("rejected: unschedulable: input tokens=600")
    assert outs[0].token_ids == [] and len(outs[1].token_ids) == 4


def test_ngram_drafter():
    d = NgramDrafter(k=3, max_ngram=3, min_ngram=1)
    # "5 6 7" occurred before, followed by "8 9 2": propose them.
    assert d.propose(np.array([1, 5, 6, 7, 8, 9, 2, 5, 6, 7])).tolist() == [8, 9, 2]
    # The most recent occurrence wins.
    assert d.propose(np.array([4, 1, 2, 4, 3, 3, 3, 4])).tolist() == [3, 3, 3]
    assert d.propose(np.array([1, 2, 3, 9, 1, 2, 3])).tolist() == [9, 1, 2]
    # Near the end of the history fewer are found: the rest are -1 (variable-length drafts).
    assert d.propose(np.array([3, 9, 3])).tolist() == [9, 3, -1]
    # No match: no drafts.
    assert d.propose(np.array([1, 2, 3])).tolist() == [-1, -1, -1]
    assert d.propose(np.array([5])).tolist() == [-1, -1, -1]


def test_sampler_filters_and_seeds():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    x = filter_logits(logits, 1.0, 2, 1.0)
    assert torch.isinf(x[2:]).all() and not torch.isinf(x[:2]).any()
    p = logits.softmax(-1)  # [0.64, 0.24, 0.09, ...]: top_p 0.8 keeps the first two
    x = filter_logits(logits, 1.0, -1, 0.8)
    assert torch.isfinite(x[:2]).all() and torch.isinf(x[2:]).all()
    x = filter_logits(logits, 1.0, -1, float(p[0]) * 0.5)
    assert torch.isfinite(x[:1]).all() and torch.isinf(x[1:]).all()
    assert position_seed(1, 5) == position_seed(1, 5) != position_seed(1, 6) != position_seed(2, 5)
    s = Sampler()
    lg = torch.randn(4, 50)
    pos = np.array([[10, 11], [3, 4]])
    args = (np.array([0.0, 1.0], dtype=np.float32), np.array([-1, -1]), np.array([1.0, 1.0]),
            np.array([5, 6]))
    a = s(lg, pos, *args)
    assert a[0].tolist() == lg[:2].argmax(-1).tolist()
    assert (s(lg, pos, *args) == a).all()


def test_kv_event_publisher_gets_every_steps_events(tiny):
    from atom_sched.kv_events import KVEventPublisher

    path, _ = tiny
    off = _engine(path, False, 0)
    with KVEventPublisher("tcp://127.0.0.1:*") as pub:
        with pytest.raises(ValueError, match="enable_kv_events"):
            off.set_kv_event_publisher(pub)
        eng = _engine(path, False, 0, enable_kv_events=True)
        with pytest.raises(TypeError, match="publish_step"):
            eng.set_kv_event_publisher(object())
        eng.set_kv_event_publisher(pub)
        eng.generate(_prompts()[:2], GenerationParams(max_tokens=3))
        assert pub.flush() and pub.stats()["next_seq"] > 0
        assert eng.scheduler.take_events() == []  # the engine drained them every step
        eng.set_kv_event_publisher(None)
