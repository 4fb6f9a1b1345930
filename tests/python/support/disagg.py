"""Two engines of a tiny random Llama in one process, joined by the loopback connectors: the
model (``tiny_case``) and ``Pair``, which steps both engines in turn and forwards finished
prefills as a disaggregating proxy does."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from atom_sched.connectors import (
    LoopbackConsumer,
    LoopbackProducer,
    NixlConsumer,
    NixlProducer,
)
from atom_sched.engine import EngineConfig, GenerationParams, LLMEngine

TRANSPORTS = {"loopback": (LoopbackProducer, LoopbackConsumer),
              "nixl": (NixlProducer, NixlConsumer)}
TINY = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
            max_model_len=256, check_invariants=True, check_builder=True)


def tiny_case(tmp_path_factory):
    """A 2-layer GQA Llama with random, fairly peaked weights (as in test_engine.py), saved in a
    temporary folder; returns ``(path, prompts, params, reference token ids)`` for three prompts
    (the first and the third share 13 tokens)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-5, initializer_range=0.25, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=1)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(path), safe_serialization=True)
    rng = np.random.default_rng(3)
    base = rng.integers(2, 96, size=13).tolist()
    prompts = [base + rng.integers(2, 96, size=6).tolist(), rng.integers(2, 96, size=7).tolist(),
               base + rng.integers(2, 96, size=3).tolist()]
    params = GenerationParams(max_tokens=12, ignore_eos=True)
    ref = LLMEngine(EngineConfig(**TINY), model_path=path).generate(prompts, params)
    return path, prompts, params, [r.token_ids for r in ref]


class Pair:
    """Both engines in one process; ``step()`` steps each once and forwards finished prefills."""

    def __init__(self, path, prefill_kw=None, decode_kw=None, transport="loopback"):
        self.pre = LLMEngine(EngineConfig(**dict(TINY, **(prefill_kw or {}))), model_path=path)
        self.dec = LLMEngine(EngineConfig(**dict(TINY, **(decode_kw or {}))), model_path=path)
        producer, consumer = TRANSPORTS[transport]
        self.prod = producer()
        self.cons = consumer(secret=self.prod.secret)
        self.pre.set_kv_connector(self.prod)
        self.dec.set_kv_connector(self.cons)
        self.prompts: dict[int, tuple[list[int], GenerationParams]] = {}
        self.prefilled: dict[int, object] = {}
        self.events: dict[int, list] = {}

    def submit(self, rid, prompt, params):
        self.prompts[rid] = (prompt, params)
        self.pre.add_request(prompt, GenerationParams(max_tokens=1, ignore_eos=True),
                             request_id=rid, kv_transfer_params={"do_remote_decode": True})

    def prefill_only(self, rids, prompts, params):
        """Submit ``rids`` and step until the prefill engine has finished them, without handing
        them to the decode engine: their KV stays held there."""
        for rid in rids:
            self.submit(rid, prompts[rid], params)
        for _ in range(10_000):
            if set(rids) <= set(self.prefilled):
                return
            self.step(forward=False)
        raise AssertionError("the prefill engine did not finish")

    def step(self, forward=True):
        for ev in self.pre.step():
            if ev.finished:
                comp = self.pre.completion(ev.request_id)
                self.prefilled[ev.request_id] = comp
                if forward:
                    prompt, params = self.prompts[ev.request_id]
                    self.dec.add_request(prompt, params, request_id=ev.request_id,
                                         kv_transfer_params=comp.kv_transfer_params)
        for ev in self.dec.step():
            self.events.setdefault(ev.request_id, []).append(ev)

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not (self.pre.has_unfinished() or self.dec.has_unfinished()):
                return
            self.step()
        raise AssertionError("the pair did not finish")

    def close(self):
        self.prod.close()
        self.cons.close()
