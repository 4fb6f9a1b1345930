"""End-to-end tokens/s of vLLM on this machine with its own scheduler and with AtomScheduler.

Each run is one ``vllm.LLM`` in a fresh process (``--one vllm|atom``), serving the same batch of
requests with ``llm.generate``: SmolLM2-135M-Instruct (the example engine's model folder) on
vLLM's CPU build, ``--requests`` chat prompts (the questions of tests/vllm/vllm_run.py with its
shared system prompt, cycled, each made distinct by a numbered question so that only the system
prompt is shared), greedy, ``ignore_eos`` with ``--max-tokens`` each, so both schedulers produce
exactly the same number of tokens. The time is ``llm.generate``'s wall clock after a warm-up
request; tokens/s counts the output tokens. The two schedulers alternate (``--rounds``, who goes
first alternating); reported: each run (its steps, the tokens they computed, and the time spent
inside the scheduler's ``schedule`` and ``update_from_output``), the medians, and atom_sched /
vLLM.

    .venv-vllm/bin/python benchmarks/vllm_e2e_bench.py [--requests 64] [--max-tokens 64]
        [--rounds 3] [--max-num-seqs 32] [--max-num-batched-tokens 512] [--json out.json]

A benchmark, not a test: nothing is asserted about the time. The answers of the two schedulers
are compared (token for token) and a difference is reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))  # vllm_run.py: the model folder, the prompts

ATOM = "atom_sched.vllm.AtomScheduler"


def one_run(args: argparse.Namespace) -> dict:
    """One engine, one timed generate: printed as the last line, ``RESULT <json>``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm_run
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    path = vllm_run.model_path()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = []
    for i in range(args.requests):
        question = vllm_run.QUESTIONS[i % len(vllm_run.QUESTIONS)]
        msgs = [{"role": "system", "content": vllm_run.SYSTEM},
                {"role": "user", "content": f"Question {i}: {question}"}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        prompts.append({"prompt_token_ids": list(ids)})
    kwargs = {} if args.one == "vllm" else {"scheduler_cls": ATOM}
    llm = LLM(model=path, enforce_eager=True, dtype="float32", max_model_len=1024,
              enable_prefix_caching=True, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, **kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up: first-call costs out of the timing
    # The engine's steps, the tokens they computed (prompt and decode) and the seconds spent in
    # the scheduler's two calls, through thin wrappers around them (both schedulers alike).
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    counts = {"steps": 0, "scheduled_tokens": 0, "scheduler_s": 0.0}
    schedule, update = sched.schedule, sched.update_from_output

    def counted_schedule(*a, **k):
        t = time.perf_counter()
        out = schedule(*a, **k)
        counts["scheduler_s"] += time.perf_counter() - t
        if out.total_num_scheduled_tokens:
            counts["steps"] += 1
            counts["scheduled_tokens"] += out.total_num_scheduled_tokens
        return out

    def timed_update(*a, **k):
        t = time.perf_counter()
        out = update(*a, **k)
        counts["scheduler_s"] += time.perf_counter() - t
        return out

    sched.schedule, sched.update_from_output = counted_schedule, timed_update
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"scheduler": f"{type(sched).__module__}.{type(sched).__name__}",
            "seconds": seconds, "output_tokens": sum(map(len, tokens)),
            "tokens_per_s": sum(map(len, tokens)) / seconds, **counts, "tokens": tokens}


def spawn(which: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--one", which, "--requests", str(args.requests),
           "--max-tokens", str(args.max_tokens), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{which} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", choices=["vllm", "atom"], help=argparse.SUPPRESS)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_run(args)), flush=True)
        return
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {"vllm": [], "atom": []}
    for r in range(args.rounds):
        order = ("vllm", "atom") if r % 2 == 0 else ("atom", "vllm")
        for which in order:
            res = spawn(which, args)
            runs[which].append(res)
            print(f"round {r + 1} {which:4}: {res['output_tokens']} tokens in "
                  f"{res['seconds']:.2f} s = {res['tokens_per_s']:.1f} tokens/s "
                  f"({res['steps']} steps computing {res['scheduled_tokens']} tokens; "
                  f"{1000 * res['scheduler_s']:.0f} ms in the scheduler)",
                  flush=True)
    same = all(a["tokens"] == runs["vllm"][0]["tokens"] for a in runs["atom"])
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    print(f"median tokens/s: vLLM's scheduler {med['vllm']:.1f}, atom_sched {med['atom']:.1f}, "
          f"atom_sched / vLLM {med['atom'] / med['vllm']:.3f}; answers identical: {same}")
    print(f"load average at start {load_start}, at end {os.getloadavg()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        for v in runs.values():
            for x in v:
                x.pop("tokens")
        args.json.write_text(json.dumps({
            "started": started.isoformat(), "machine": platform.platform(),
            "cpus": os.cpu_count(), "args": {k: v for k, v in vars(args).items()
                                             if k not in ("one", "json")},
            "load_start": load_start, "load_end": os.getloadavg(), "runs": runs,
            "median_tokens_per_s": med, "answers_identical": same}, indent=1))


if __name__ == "__main__":
    main()
