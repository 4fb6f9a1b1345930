"""KV-aware routing with NVIDIA Dynamo's own indexer, against round-robin routing.

Several SmolLM2 engines publish their KV events (atom_sched.kv_events); Dynamo's standalone KV
indexer (ai-dynamo-runtime 1.6.1, `python -m dynamo.indexer`) subscribes to every engine and
indexes what each one caches. Each request is routed to the engine with the longest cached prefix
of its prompt (ties: the engine that served fewest requests, a stand-in for the load term of
Dynamo's own router). The same requests are then served
on fresh engines in round-robin order. Prompts are documents with several questions each, in a
shuffled order; the script prints the share of prompt tokens served from the prefix cache.

    python examples/kv_routing.py [--engines 2] [--docs 3] [--questions 3] [--max-tokens 4]

The indexer's HTTP port binds every interface (hard-coded in Dynamo 1.6.1): it runs only while
this script does, on a free port.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from atom_sched import KVEvent
from atom_sched.dynamo_indexer import DynamoIndexer
from atom_sched.engine import EngineConfig, GenerationParams, LLMEngine
from atom_sched.engine.weights import ensure_cached
from atom_sched.kv_events import KVEventPublisher

TOPICS = ["the history of the printing press", "how bees build their hives",
          "the water cycle", "the rules of chess", "how bread is baked", "the moons of Jupiter"]
QUESTIONS = ["Summarize it in one sentence.", "What is the most surprising fact in it?",
             "Give it a short title.", "Who would enjoy reading it?", "List three key words."]


def workload(docs: int, questions: int, seed: int) -> list[str]:
    """``docs`` long shared contexts, each asked ``questions`` questions, in a shuffled order."""
    prompts = []
    for d in range(docs):
        topic = TOPICS[d % len(TOPICS)]
        context = (f"Read the following notes about {topic} and answer the question after them. "
                   + " ".join(f"Note {i}: this is line {i} of the notes about {topic}, which "
                              f"the reader should keep in mind." for i in range(6)))
        prompts += [f"{context}\nQuestion: {QUESTIONS[q % len(QUESTIONS)]}"
                    for q in range(questions)]
    random.Random(seed).shuffle(prompts)
    return prompts


@dataclass
class Result:
    policy: str
    prompt_tokens: int
    cached_tokens: int
    per_engine: list[int]  # requests served by each engine

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


def serve(policy: str, prompts: Sequence[str], engines: int, config: EngineConfig,
          idx: DynamoIndexer, worker_base: int, max_tokens: int) -> Result:
    """Serves ``prompts`` one at a time on ``engines`` fresh engines, each routed by
    ``policy`` ("kv-aware" or "round-robin")."""
    model = ensure_cached().path
    fleet = [LLMEngine(config, model_path=model) for _ in range(engines)]
    pubs = [KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
            for _ in fleet]
    try:
        for i, (eng, pub) in enumerate(zip(fleet, pubs, strict=True)):
            eng.set_kv_event_publisher(pub)
            idx.register(worker_base + i, pub.endpoint, config.block_size,
                         replay_endpoint=pub.replay_endpoint)
            idx.wait_joined(worker_base + i,
                            lambda p=pub: p.publish([KVEvent("BlockRemoved", [])]))
        served = [0] * engines
        total = cached = 0
        params = GenerationParams(max_tokens=max_tokens)
        for n, text in enumerate(prompts):
            # Plain text: the chat template's system prompt would be a prefix of every request,
            # and a router that weighs only the overlap would send everything to one engine.
            ids = fleet[0].encode_prompt(text, chat=False)
            if policy == "kv-aware":
                scores = idx.query(ids)
                pick = max(range(engines),
                           key=lambda e: (scores.get(worker_base + e, 0), -served[e], -e))
            else:
                pick = n % engines
            (comp,) = fleet[pick].generate([ids], params)
            served[pick] += 1
            total += len(ids)
            cached += comp.num_cached_tokens
            _wait_indexed(idx, worker_base + pick, fleet[pick], pubs[pick])
        return Result(policy, total, cached, served)
    finally:
        for i, pub in enumerate(pubs):
            idx.unregister(worker_base + i)
            pub.close()


def _wait_indexed(idx: DynamoIndexer, worker: int, eng: LLMEngine, pub: KVEventPublisher) -> None:
    """Until the indexer holds exactly what the engine caches, so the next routing decision sees
    this request's blocks (a live router would route on a slightly older view)."""
    pub.flush()
    want = set(eng.scheduler.cached_block_hashes())
    idx.wait_for(lambda: idx.block_hashes(worker) == want, what=f"engine {worker} indexed")


def run(engines: int = 2, docs: int = 3, questions: int = 3, max_tokens: int = 4,
        seed: int = 0, report: Callable[[str], None] = print) -> dict[str, Result]:
    config = EngineConfig(num_blocks=256, block_size=16, max_num_seqs=4, enable_kv_events=True)
    prompts = workload(docs, questions, seed)
    results = {}
    with DynamoIndexer() as idx:
        for k, policy in enumerate(("kv-aware", "round-robin")):
            results[policy] = r = serve(policy, prompts, engines, config, idx,
                                        worker_base=100 * (k + 1), max_tokens=max_tokens)
            report(f"{policy:>11}: {r.cached_tokens:5d} of {r.prompt_tokens:5d} prompt tokens "
                   f"from the prefix cache ({100 * r.hit_rate:.1f}%), requests per engine "
                   f"{r.per_engine}")
    return results


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--docs", type=int, default=3, help="shared contexts")
    ap.add_argument("--questions", type=int, default=3, help="questions per context")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the request order's shuffle")
    a = ap.parse_args(argv)
    if a.engines < 1 or a.docs < 1 or a.questions < 1 or a.max_tokens < 1:
        ap.error("--engines, --docs, --questions and --max-tokens must be >= 1")
    if not DynamoIndexer.available():
        ap.error("needs NVIDIA Dynamo's indexer: pip install ai-dynamo-runtime==1.6.1")
    run(a.engines, a.docs, a.questions, a.max_tokens, a.seed)


if __name__ == "__main__":
    main()
