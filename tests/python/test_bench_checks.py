"""atom-sched bench's per-step decode checks (`--check`) follow the scheduler's contract: a decode
row carries K+1 tokens, fewer near the position limit (issue 12 item 3), and its drafts that were
not scheduled read -1."""

from __future__ import annotations

import json
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


def test_every_reported_figure_is_measured_in_the_run(tmp_path):
    """Issue 12 item 19: no column or field is computed from a constant (the old 'ATOM est.' and
    'speed-up' columns came from a hard-coded 20 us per request): the table's numbers and the
    JSON's results are this run's timings, and the JSON names the machine load they ran under."""
    results = bench.run_suite(quick=True, only="decode_64")
    table = bench.format_table(results)
    header = table.splitlines()[0].lower()
    assert "atom" not in header and "speed" not in header, header
    assert not any("ATOM" in name for name in dir(bench) if name.isupper())
    (res,) = results
    assert res.key == "decode_64" and res.reps > 0 and res.median > 0
    path = tmp_path / "bench.json"
    bench.write_json(path, results, bench.metadata(True, False))
    data = json.loads(path.read_text())
    assert "loadavg" in data["meta"] and data["meta"]["quick"] is True
    assert set(data["results"][0]) >= {"median", "p10", "p90", "reps"}


def test_mixed_workloads_run_and_verify_what_they_claim():
    """The mixed-policy rows: requests decode while the setup still prefills others (the rig's
    request lengths must allow for it), and with a prefill stream every timed step is n decode
    rows plus one chunk, every decode request still running at the end (check mode)."""
    plain = bench.decode_step(64, 150, 10, check=True, policy="mixed", prompt_len=64)
    assert plain.key == "decode_64_mixed" and plain.info["rows"] == 64
    mixed = bench.decode_step(64, 150, 10, check=True, policy="mixed", prefill_chunk=32)
    assert mixed.key == "mixed_64_32" and mixed.budget is None
    assert mixed.info["rows"] == 65 and mixed.info["tokens_per_step"] == 64 + 32


def test_fixed_cost_row_runs_one_request_through_views():
    r = bench.fixed_cost(5, 3, check=True)
    assert r.key == "fixed_py" and r.budget == bench.BUDGETS["fixed_py"] == 1.2
    # (the warm-up steps count too)
    assert r.info["rows"] == 1 and r.info["tokens_gained"] == 3 + 5 * r.info["steps_per_sample"]


def test_engine_path_rows_time_the_step_and_the_outputs():
    flat = bench.decode_step(16, 20, 3, check=True, stream=bench._stream_flat)
    assert flat.key == "engine_16" and flat.name.endswith("(step + flat outputs)")
    objects = bench.decode_step(16, 20, 3, check=True, stream=bench._stream_objects)
    assert objects.key == "engine_16_objects" and objects.budget is None
    assert bench.BUDGETS["engine_1024"] == 40.0


def test_admission_times_a_second_round_on_the_same_scheduler():
    """The admission row times the round after a first one on the same scheduler (every request
    aborted and the prefix cache reset in between): check mode verifies both rounds' batches,
    outputs and cache hits, and the first round's time is reported beside it."""
    r = bench.admission(2, 0, check=True, num_prompts=16, prompt_len=64, shared_len=32,
                        budget_tokens=256)
    assert r.key == "admission" and r.checked and r.reps == 2
    assert r.info["prefix_hit_tokens"] == 32 * r.info["prefix_hit_prompts"] > 0
    assert r.info["first_round_median_us"] > 0 and r.median > 0
