"""KV transfer between a prefill engine and a decode engine in two processes (SmolLM2-135M, the
example engine's float32 paged cache): NIXL READs against the loopback connector's ZMQ frames.

Each request is prefilled by the prefill engine, its prompt KV moved to the decode engine, and
decoded for a couple of tokens there; the decode side's connector times each transfer from the
moment the bytes start moving (NIXL: the READ is posted, after the once-per-producer metadata
handshake; loopback: the PULL is sent, so the time includes the producer's wait for its next
step) to the moment the KV is in place. Prompts are random token ids (no prefix is shared, so
every prompt block moves).

    python benchmarks/bench_kv_transfer.py [--requests 12] [--prompt-tokens 512] [--rounds 2]

Prints, per transport, the bytes moved, GB/s over all transfers (bytes / summed transfer time),
and the median per-request transfer latency.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(transport: str, requests: int, prompt_tokens: int, rounds: int) -> dict[str, float]:
    from atom_sched.connectors import DisaggPair
    from atom_sched.engine import GenerationParams
    from atom_sched.engine.weights import ensure_cached

    cfg = dict(num_blocks=requests * (prompt_tokens // 16 + 2) + 8, block_size=16,
               max_num_seqs=requests, max_num_batched_tokens=prompt_tokens,
               max_model_len=prompt_tokens + 64)
    rng = np.random.default_rng(0)
    seconds, nbytes, blocks = [], 0, 0
    with DisaggPair(ensure_cached().path, prefill_config=cfg, decode_config=cfg,
                    transport=transport) as pair:
        for r in range(rounds):
            prompts = [rng.integers(100, 40_000, size=prompt_tokens).tolist()
                       for _ in range(requests)]
            rids = list(range(r * requests, (r + 1) * requests))
            pair.generate(prompts, GenerationParams(max_tokens=2, ignore_eos=True),
                          request_ids=rids)
        st = pair.state("decode")
    for _, event, _, detail in st["log"]:
        if event == "received" and detail["blocks"]:
            seconds.append(detail["seconds"])
            nbytes += detail["bytes"]
            blocks += detail["blocks"]
    assert st["transfer_stats"]["failed"] == 0
    return {"transfers": len(seconds), "blocks": blocks, "bytes": nbytes,
            "gbps": nbytes / sum(seconds) / 1e9,
            "median_ms": statistics.median(seconds) * 1e3,
            "first_ms": seconds[0] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=12, help="requests per round")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--transports", default="nixl,loopback")
    a = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.2f}; {a.rounds} x {a.requests} requests of "
          f"{a.prompt_tokens} prompt tokens")
    for t in a.transports.split(","):
        r = run(t, a.requests, a.prompt_tokens, a.rounds)
        print(f"{t:>8}: {r['transfers']} transfers, {r['blocks']} blocks, "
              f"{r['bytes'] / 1e6:.0f} MB; {r['gbps']:.2f} GB/s; per request median "
              f"{r['median_ms']:.1f} ms (the first: {r['first_ms']:.1f} ms)")


if __name__ == "__main__":
    main()
