"""atom-sched bench's per-step decode checks (`--check`) follow the scheduler's contract: a decode
row carries K+1 tokens, fewer near the position limit (issue 12 item 3), and its drafts that were
not scheduled read -1."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from atom_sched import SamplingParams, Scheduler, SchedulerConfig

# The harness lives in the repository's benchmarks/, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scheduler_bench as bench  # noqa: E402


def test_decode_check_accepts_rows_shortened_at_max_model_len():
    k, n = 3, 2
    cfg = SchedulerConfig(num_blocks=64, block_size=bench.BLOCK_SIZE, max_num_seqs=n,
                          max_model_len=40, num_speculative_tokens=k)
    s = Scheduler(cfg)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    s.add_request(0, list(range(10, 40)), params)  # 30 tokens: reaches the limit first
    s.add_request(1, list(range(10, 38)), params)
    drafts = np.full((n, k), 7, np.int32)
    sampled = np.full((n, k + 1), 7, np.int32)
    b = s.schedule()
    assert b.is_prefill and b.num_rows == n
    s.update(b, sampled, None, drafts)
    prev, widths = None, []
    while True:
        b = s.schedule()
        assert b is not None and not b.is_prefill and b.num_rows == n
        acc = np.ones(n, np.int32)  # one token a step: a shortened row that ends nothing
        out = s.update(b, sampled, acc, drafts)
        if np.asarray(out.finished).any():
            break
        widths.append([int(x) for x in b.num_scheduled_tokens])
        prev = bench._check_decode_step(s, b, out, n, k, acc, drafts, prev)
    assert [3, 4] in widths, widths  # row 0 at position 37: positions 37..39 only
