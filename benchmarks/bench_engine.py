"""Throughput of the example engine (SmolLM2-135M-Instruct on the CPU) against transformers.

For 1, 8 and 32 concurrent requests (greedy, every answer exactly ``--tokens`` long):

* the engine (atom_sched Scheduler + DeviceBatchBuilder + paged-KV model), all requests served
  together by continuous batching;
* transformers' ``generate`` one request at a time;
* transformers' ``generate`` on the whole set as one batch, left-padded.

Then n-gram speculative decoding K = 0..4 on 1 and 8 requests whose answers repeat their prompts
(acceptance rate, tokens/s), and the host overhead: the scheduler's and the builder's time per
step and their share of the step time.

    python benchmarks/bench_engine.py [--quick] [--tokens 32] [--threads 1] [--out bench_out]

Writes a table to stdout and ``<out>/engine.json``. Run from outside the repository root (as
``make bench-engine`` does) so the installed package is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from atom_sched.engine import EngineConfig, GenerationParams, LLMEngine, set_threads, weights

TOPICS = ["the sea", "a mountain", "the moon", "a city at night", "autumn leaves", "a robot",
          "a library", "the desert"]
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
    "Explain what a CPU does in one sentence.", "Give me two tips for learning to code.",
    "Why is the sky blue?", "What is photosynthesis?", "Translate 'good morning' to Spanish.",
]
REPEAT = [  # answers that quote their prompt: where a prompt-lookup drafter pays off
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river.",
    "Copy this list: apples, oranges, pears, plums, grapes, cherries, lemons, limes.",
    "Say again, word for word: to be or not to be, that is the question.",
    "Repeat: one two three four five six seven eight nine ten.",
    "Write this code again: for i in range(10): print(i * i)",
    "Echo back: The meeting is on Monday at nine in the main room.",
    "Repeat exactly: red, green, blue, cyan, magenta, yellow, black, white.",
    "Copy: Paris is the capital of France and Berlin is the capital of Germany.",
]


def prompts(n: int) -> list[str]:
    base = QUESTIONS + [f"Write a short poem about {t}." for t in TOPICS]
    return [base[i % len(base)] + ("" if i < len(base) else f" (variant {i // len(base)})")
            for i in range(n)]


def run_engine(model_path: Path, texts: list[str], tokens: int, k: int = 0,
               one_step_ahead: bool = False) -> dict:
    eng = LLMEngine(EngineConfig(num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048,
                                 max_model_len=1024, num_speculative_tokens=k,
                                 one_step_ahead=one_step_ahead), model_path=model_path)
    ids = [eng.encode_prompt(t) for t in texts]
    params = GenerationParams(max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = eng.generate(ids, params)
    dt = time.perf_counter() - t0
    gen = sum(len(o.token_ids) for o in outs)
    tm, st = eng.timings, eng.stats()
    steps = max(tm.steps, 1)
    return {
        "seconds": dt, "generated": gen, "tokens_per_s": gen / dt, "steps": tm.steps,
        "step_ms": tm.total / steps * 1e3,
        "scheduler_us_per_step": tm.scheduler / steps * 1e6,
        "builder_us_per_step": tm.builder / steps * 1e6,
        "host_share": (tm.scheduler + tm.builder) / max(tm.total, 1e-12),
        "shares": tm.shares(),
        "acceptance_rate": st["acceptance_rate"],
        "tokens_per_request_step": tm.decode_tokens / max(tm.decode_rows, 1),
    }


@torch.inference_mode()
def run_hf_one_by_one(hf, tok, texts: list[str], tokens: int) -> dict:
    t0 = time.perf_counter()
    gen = 0
    for t in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": t}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)
        out = hf.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                          temperature=None, top_p=None, top_k=None, pad_token_id=tok.eos_token_id)
        gen += out.shape[1] - ids["input_ids"].shape[1]
    dt = time.perf_counter() - t0
    return {"seconds": dt, "generated": gen, "tokens_per_s": gen / dt}


@torch.inference_mode()
def run_hf_batched(hf, tok, texts: list[str], tokens: int) -> dict:
    tok.padding_side = "left"
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                     tokenize=False) for t in texts]
    enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    t0 = time.perf_counter()
    out = hf.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                      temperature=None, top_p=None, top_k=None, pad_token_id=tok.eos_token_id)
    dt = time.perf_counter() - t0
    gen = (out.shape[1] - enc["input_ids"].shape[1]) * len(texts)
    return {"seconds": dt, "generated": gen, "tokens_per_s": gen / dt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 and 8 requests, K=2 only")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per answer (default 32)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both sides (default 1: fair on a shared machine)")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    set_threads(args.threads)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    cached = weights.ensure_cached(verbose=True)
    hf = weights.load_hf_model(cached.path)
    tok = weights.load_tokenizer(cached.path)

    sizes = [1, 8] if args.quick else [1, 8, 32]
    rows = []
    for n in sizes:
        texts = prompts(n)
        print(f"[{n} requests] engine ...", file=sys.stderr, flush=True)
        eng = run_engine(cached.path, texts, args.tokens)
        print(f"[{n} requests] transformers one by one ...", file=sys.stderr, flush=True)
        one = run_hf_one_by_one(hf, tok, texts, args.tokens)
        print(f"[{n} requests] transformers batched ...", file=sys.stderr, flush=True)
        bat = run_hf_batched(hf, tok, texts, args.tokens)
        rows.append({"requests": n, "engine": eng, "hf_one_by_one": one, "hf_batched": bat})

    spec = []
    for n in (1, 8):
        for k in ([0, 2] if args.quick else [0, 1, 2, 3, 4]):
            print(f"[spec K={k}] engine on {n} quoting prompt(s) ...", file=sys.stderr, flush=True)
            r = run_engine(cached.path, REPEAT[:n], args.tokens, k=k)
            spec.append({"requests": n, "k": k, **r})

    print(f"\nSmolLM2-135M-Instruct, float32, {args.threads} torch thread(s), {args.tokens} "
          f"tokens per answer (greedy), {platform.processor() or platform.machine()}, "
          f"load average {load0:.2f} at start" if load0 is not None else "")
    print("\n| concurrent requests | engine tok/s | transformers one by one tok/s | "
          "transformers batched (padded) tok/s | engine step ms | scheduler us/step | "
          "builder us/step | host share of step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        e = r["engine"]
        one, bat = r["hf_one_by_one"], r["hf_batched"]
        print(f"| {r['requests']} | {e['tokens_per_s']:.1f} | {one['tokens_per_s']:.1f}"
              f" | {bat['tokens_per_s']:.1f} | {e['step_ms']:.1f} | "
              f"{e['scheduler_us_per_step']:.0f} | {e['builder_us_per_step']:.0f} | "
              f"{e['host_share'] * 100:.3f}% |")
    print("\n| quoting prompts | n-gram K | acceptance rate | tokens per request per decode "
          "step | engine tok/s |")
    print("|---:|---:|---:|---:|---:|")
    for s in spec:
        print(f"| {s['requests']} | {s['k']} | {s['acceptance_rate']:.2f} | "
              f"{s['tokens_per_request_step']:.2f} | {s['tokens_per_s']:.1f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "tokens": args.tokens, "loadavg_start": load0,
            "loadavg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__}
    (out / "engine.json").write_text(json.dumps({"meta": meta, "concurrency": rows,
                                                 "speculative": spec}, indent=1))
    print(f"\nwrote {out / 'engine.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
