"""A toy engine loop around atom_sched: what an engine does each step, with a stand-in "model".

The stand-in model samples a deterministic token per row from (request id, position), so the run
is reproducible; it exercises everything the scheduler does: continuous batching, chunked prefill,
prefix caching, preemption under a small KV pool, speculative decoding (--spec K) and the
one-step-ahead protocol (--async). The real-model engine comes with the end-to-end issue.

    python examples/toy_engine.py [--spec 2] [--async] [--requests 12]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from atom_sched import SamplingParams, Scheduler, SchedulerConfig

EOS = 2


def fake_tokens(batch, k: int, rng: np.random.Generator):
    """Sampled tokens (rows, K+1), accepted counts and drafts, as a sampler would return them."""
    rows = batch.num_rows
    last_pos = batch.positions[batch.cu_seqlens_q[1:] - 1]
    base = (batch.req_ids * 7919 + last_pos * 31) % 500 + 10
    sampled = (base[:, None] + np.arange(k + 1)[None, :]).astype(np.int32)
    sampled[rng.random(rows) < 0.02, 0] = EOS  # now and then a request ends early
    accepted = None
    if k > 0 and not batch.is_prefill:
        accepted = rng.integers(1, k + 2, size=rows).astype(np.int32)
    drafts = np.full((rows, k), 11, dtype=np.int32) if k > 0 else None
    return sampled, accepted, drafts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--spec", type=int, default=0, help="speculative tokens per step (K)")
    ap.add_argument("--async", dest="one_step_ahead", action="store_true",
                    help="schedule step t+1 before the outputs of step t arrive")
    ap.add_argument("--blocks", type=int, default=48, help="KV blocks (small: forces preemption)")
    args = ap.parse_args()

    sched = Scheduler(SchedulerConfig(
        num_blocks=args.blocks, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
        max_model_len=1024, num_speculative_tokens=args.spec, eos_token_id=EOS,
        enable_kv_events=True))
    rng = np.random.default_rng(0)
    system_prompt = list(range(100, 164))  # 64 shared tokens: prefix-cache hits
    for i in range(args.requests):
        prompt = system_prompt + rng.integers(10, 1000, size=int(rng.integers(20, 200))).tolist()
        sched.add_request(i, prompt, SamplingParams(max_tokens=int(rng.integers(8, 48))))

    texts: dict[int, list[int]] = {}
    in_flight = []
    step = 0
    t0 = time.perf_counter()
    while sched.has_unfinished_requests() or in_flight:
        batch = sched.schedule() if sched.num_outstanding_batches < 2 else None
        if batch is not None:
            kind = "prefill" if batch.is_prefill else "decode "
            print(f"step {step:3d} {kind} rows={batch.num_rows:2d} tokens={batch.num_tokens:4d} "
                  f"free_blocks={sched.num_free_blocks:3d} running={sched.num_running}")
            in_flight.append((batch, fake_tokens(batch, args.spec, rng)))
            step += 1
        if not in_flight or (args.one_step_ahead and len(in_flight) < 2 and batch is not None):
            continue
        done, (sampled, accepted, drafts) = in_flight.pop(0)
        for out in sched.update(done, sampled, accepted, drafts):
            texts.setdefault(out.request_id, []).extend(out.output_tokens)
            if out.finished:
                print(f"    request {out.request_id} finished ({out.finish_reason}): "
                      f"{len(texts[out.request_id])} tokens, "
                      f"{out.num_cached_tokens} prompt tokens from the prefix cache")
        sched.check_invariants()
    elapsed = time.perf_counter() - t0
    for r in sched.take_rejected():
        print(f"rejected {r.request_id}: {r.reason}")
    stats = sched.stats()
    events = sched.take_events()
    print(f"\n{step} steps in {elapsed * 1e3:.1f} ms; preemptions={stats['num_preemptions']}, "
          f"prefix hit rate={stats['prefix_hit_rate']:.2f}, "
          f"spec acceptance={stats['acceptance_rate']:.2f}, KV events={len(events)}")


if __name__ == "__main__":
    main()
