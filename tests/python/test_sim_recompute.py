"""Issue 30, first step: the serving simulator reports the recompute tax, the tokens preemptions
make the engine compute again (less what the prefix cache gives back at re-admission) as a share
of all tokens computed. The simulator reads it off the batches' rows; the driver here counts it
independently from the requests' states (request_state: computed tokens before the step that
preempted, prefix-cache hits at re-admission) and the two must agree exactly."""

import json
import math

import numpy as np
import pytest

from atom_sched import SamplingParams, Scheduler, SchedulerConfig
from atom_sched.cli import main
from atom_sched.sim import simulate, workloads
from atom_sched.sim.workloads import Conversation, Turn


def config(policy: str, num_blocks: int, budget: int = 256) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=16,
                           max_num_batched_tokens=budget, max_model_len=4096, policy=policy)


def workload() -> list[Conversation]:
    """One-turn conversations (all offered at t = 0, so the scheduler's decisions do not depend
    on the step-time model), and two that share a long prompt prefix."""
    convs = workloads.synthetic("chat", num_conversations=60, seed=3, max_model_len=1024,
                                max_tokens=200)
    shared = np.arange(3, 700, dtype=np.int32)
    for tail in (11, 12):
        convs.append(Conversation([Turn(np.append(shared, np.int32(tail)),
                                        np.arange(5, 120, dtype=np.int32))]))
    return convs


def reference(convs: list[Conversation], cfg: SchedulerConfig) -> dict[str, int]:
    """The tax counted from request states, one admission at a time. An admission k of a request
    starts at its prefix-cache hits H (request_state's prefix_hit_tokens) and ends at its computed
    tokens E when it is preempted (read before the schedule() that preempted it) or finishes;
    with W the most the request had computed before it, it computes [H, E) and of those
    [H, min(E, W)) again."""
    s = Scheduler(cfg)
    outputs = {}
    for i, c in enumerate(convs):
        t = c.turns[0]
        s.add_request(i, t.prompt, SamplingParams(max_tokens=len(t.output), ignore_eos=True),
                      arrival_time=0.0)
        outputs[i] = t.output
    status = {i: "waiting" for i in outputs}
    emitted = dict.fromkeys(outputs, 0)
    computed = dict.fromkeys(outputs, 0)  # this admission's computed tokens, last seen
    start = dict.fromkeys(outputs, 0)  # this admission's prefix-cache hits
    most = dict.fromkeys(outputs, 0)  # W: the most computed before this admission
    got = {"computed": 0, "recomputed": 0, "preemptions": 0, "preempted": 0,
           "readmissions": 0, "hits_at_readmission": 0, "mid_prefill": 0}

    def close(i: int) -> None:  # the admission ends at computed[i]
        got["computed"] += computed[i] - start[i]
        got["recomputed"] += max(0, min(computed[i], most[i]) - start[i])
        most[i] = max(most[i], computed[i])

    while True:
        batch = s.schedule(now=0.0)
        if batch is None:
            break
        for i in list(status):
            st = s.request_state(i)
            if status[i] == "running" and st["status"] == "waiting":
                got["preemptions"] += 1
                got["preempted"] += computed[i]
                got["mid_prefill"] += computed[i] < st["num_tokens"] - 1
                close(i)
            elif status[i] == "waiting" and st["status"] == "running":
                start[i] = st["prefix_hit_tokens"]
                if most[i] > 0:
                    got["readmissions"] += 1
                    got["hits_at_readmission"] += start[i]
            status[i] = st["status"]
            if status[i] == "running":
                computed[i] = st["num_computed_tokens"]
        sampled = np.zeros(batch.num_rows, np.int32)
        for row, (rid, emits) in enumerate(zip(batch.req_ids, batch.emits_token, strict=True)):
            if emits:
                sampled[row] = outputs[int(rid)][emitted[int(rid)]]
        for out in s.update(batch, sampled):
            emitted[out.request_id] += len(out.output_tokens)
            if out.finished:
                close(out.request_id)
                del status[out.request_id]
    assert not status and s.stats()["num_preemptions"] == got["preemptions"]
    return got


@pytest.mark.parametrize("policy, budget", [("atom", 256), ("mixed", 256), ("mixed", 32)])
def test_the_tax_under_kv_pressure_is_what_the_requests_recomputed(policy, budget):
    convs = workload()
    cfg = config(policy, num_blocks=100, budget=budget)  # 1,600 tokens of KV: preemptions
    res = simulate(convs, cfg, rate=math.inf, seed=1, label=policy)
    want = reference(convs, cfg)
    assert want["preemptions"] > 10, "the pool forces preemptions"
    if budget == 32:  # prompts in chunks: a decode pass preempts a request mid-prefill
        assert want["mid_prefill"] > 0
    assert want["hits_at_readmission"] > 0, "the prefix cache gives some KV back"
    assert 0 < want["recomputed"] < want["preempted"]
    assert res.stats["num_preemptions"] == want["preemptions"] == res.readmissions
    assert res.recomputed_tokens == want["recomputed"]
    assert res.preempted_tokens == want["preempted"]
    assert res.computed_tokens == want["computed"]
    assert res.recompute_tax == want["recomputed"] / want["computed"]
    assert 0 < res.recompute_tax < 1


@pytest.mark.parametrize("policy", ["atom", "mixed"])
def test_no_kv_pressure_no_tax(policy):
    convs = workload()
    res = simulate(convs, config(policy, num_blocks=4000), rate=math.inf, seed=1)
    assert res.stats["num_preemptions"] == 0 == res.readmissions
    assert res.recomputed_tokens == 0 == res.preempted_tokens and res.recompute_tax == 0.0
    # Without preemption a request computes its prompt past its hits and every output token
    # but the last (whose KV the request never needs).
    assert res.computed_tokens == sum(r.prompt_len - r.cached_tokens + len(r.token_times) - 1
                                      for r in res.requests)


def test_the_report_carries_the_tax(tmp_path, capsys):
    rc = main(["simulate", "--workload", "chat", "--conversations", "60", "--no-progress",
               "--kv-blocks", "200", "--max-model-len", "2048", "--max-tokens", "256",
               "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "recompute tax" in out.splitlines()[1]
    runs = json.loads((tmp_path / "sim.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["atom, saturated", "atom", "mixed"]
    sat = runs[0]
    assert sat["preemptions"] > 0
    rec = sat["recompute"]
    assert rec["readmissions"] == sat["preemptions"]
    assert 0 < rec["tokens"] <= rec["preempted_tokens"]
    assert rec["share"] == rec["tokens"] / sat["computed_tokens"]
    assert f"{100 * rec['share']:.2f}%" in out
