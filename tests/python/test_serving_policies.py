"""Issue 30 items 1 and 2 through the Python API: preemption_victim="least_computed" (the running
request with the fewest computed tokens is preempted first, within the lowest priority under
priority scheduling), admission_watermark_blocks (admissions leave blocks free for the running
requests, which cuts the recompute tax) and scheduling="sjf" (shortest job first by length_hint
or max_tokens, aged at sjf_aging_rate job tokens a second). Runs go through the Driver
(invariants and batch checks after every call) in both step protocols, with and without drafts,
and end with the oracle's tokens; the simulator and its command line run every combination."""

import copy
import json
import math
import pickle

import numpy as np
import pytest
from support import admission_order, make_driver, prompt, sp, state_snapshot

from atom_sched import SamplingParams, Scheduler, SchedulerConfig
from atom_sched.cli import main
from atom_sched.sim import simulate, workloads


def test_config_fields_are_validated_and_kept():
    c = SchedulerConfig(num_blocks=16, scheduling="sjf", preemption_victim="least_computed",
                        sjf_aging_rate=2.5)
    assert (c.scheduling, c.preemption_victim, c.sjf_aging_rate) == ("sjf", "least_computed", 2.5)
    assert "scheduling='sjf', preemption_victim='least_computed'" in repr(c)
    for d in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
        assert (d.scheduling, d.preemption_victim, d.sjf_aging_rate) == (
            "sjf", "least_computed", 2.5)
    default = SchedulerConfig(num_blocks=16)
    assert default.preemption_victim == "service_order" and default.sjf_aging_rate == 100.0
    with pytest.raises(ValueError, match="preemption_victim must be 'service_order' or "
                                         "'least_computed', got 'lifo'"):
        SchedulerConfig(num_blocks=16, preemption_victim="lifo")
    with pytest.raises(ValueError, match="scheduling must be 'fcfs', 'priority', 'sjf' or 'fair'"):
        c.scheduling = "SJF"
    assert c.scheduling == "sjf"
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="sjf_aging_rate must be a finite number > 0"):
            Scheduler(SchedulerConfig(num_blocks=16, scheduling="sjf", sjf_aging_rate=bad))


def test_watermark_is_kept_validated_and_keeps_blocks_free():
    c = SchedulerConfig(num_blocks=11, block_size=4, admission_watermark_blocks=2,
                        enable_prefix_caching=False)
    assert c.admission_watermark_blocks == 2
    assert pickle.loads(pickle.dumps(c)).admission_watermark_blocks == 2
    assert SchedulerConfig(num_blocks=11).admission_watermark_blocks == 0
    for bad in (-1, 10):
        with pytest.raises(ValueError, match=r"admission_watermark_blocks must be in "
                                             r"0\.\.num_blocks - 2"):
            Scheduler(SchedulerConfig(num_blocks=11, admission_watermark_blocks=bad))
    # 10 usable blocks: 16, 16 and 4 tokens take 4, 4 and 1; the third would leave 1 < 2 free.
    s = Scheduler(c)
    for rid, n in enumerate((16, 16, 4)):
        s.add_request(rid, prompt(n, 100 * rid), SamplingParams())
    b = s.schedule()
    assert list(b.req_ids) == [0, 1] and s.waiting_ids() == [2]
    assert s.num_free_blocks == 2
    s.check_invariants()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 2])
def test_watermark_runs_agree_with_the_oracle(mode, k):
    d = make_driver(mode, num_blocks=9, block_size=4, num_speculative_tokens=k,
                    admission_watermark_blocks=2)
    for rid in range(6):
        d.add(rid, prompt(6 + rid, 100 * rid), sp(max_tokens=12))
    d.run()
    d.check_all_done()
    d.check_against_oracle()


def test_fair_share_config_and_tenant_are_validated_and_kept():
    c = SchedulerConfig(num_blocks=16, scheduling="fair", tenant_weights={"a": 3.0, "b": 1})
    assert c.scheduling == "fair" and c.tenant_weights == {"a": 3.0, "b": 1.0}
    for d in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
        assert d.scheduling == "fair" and d.tenant_weights == {"a": 3.0, "b": 1.0}
    assert SchedulerConfig(num_blocks=16).tenant_weights == {}
    with pytest.raises(TypeError, match="tenant_weights must be a dict"):
        SchedulerConfig(num_blocks=16, tenant_weights=[("a", 1.0)])
    with pytest.raises(TypeError, match="a tenant_weights key must be str"):
        SchedulerConfig(num_blocks=16, tenant_weights={b"a": 1.0})
    with pytest.raises(TypeError, match="a weight must be a number"):
        SchedulerConfig(num_blocks=16, tenant_weights={"a": "1"})
    for bad in (0.0, -2.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="the weight of tenant 'a' must be a finite number"):
            Scheduler(SchedulerConfig(num_blocks=16, scheduling="fair",
                                      tenant_weights={"a": bad}))
    p = SamplingParams(tenant="acme")
    assert p.tenant == "acme" and pickle.loads(pickle.dumps(p)).tenant == "acme"
    with pytest.raises(TypeError, match="tenant must be str"):
        SamplingParams(tenant=b"acme")
    with pytest.raises(ValueError, match="tenant must be at most 256 bytes"):
        SamplingParams(tenant="x" * 257)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 2])
def test_fair_share_serves_a_light_tenant_beside_a_flood(mode, k):
    """Tenant a sends 8 prompts before tenant b's 2: FCFS admits all of a's first; fair share
    (both at 0, then b behind) admits b's first prompt second. Under KV pressure every request
    still ends with the oracle's tokens."""
    d = make_driver(mode, num_blocks=13, block_size=4, scheduling="fair",
                    enable_chunked_prefill=False, max_num_batched_tokens=8,
                    num_speculative_tokens=k, enable_prefix_caching=False)
    for rid in range(8):
        d.add(rid, prompt(8, 100 * rid), sp(max_tokens=10, tenant="a"))
    for rid in (8, 9):
        d.add(rid, prompt(8, 100 * rid), sp(max_tokens=10, tenant="b"))
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    assert admission_order(d)[:2] == [0, 8]


def test_length_hint_is_kept_and_validated():
    p = SamplingParams(length_hint=7)
    assert p.length_hint == 7 and pickle.loads(pickle.dumps(p)).length_hint == 7
    assert SamplingParams().length_hint == 0
    with pytest.raises(ValueError, match="length_hint must be >= 0"):
        SamplingParams(length_hint=-1)
    s = Scheduler(SchedulerConfig(num_blocks=16, scheduling="sjf"))
    s.add_request(0, prompt(4), SamplingParams())
    before = state_snapshot(s)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        s.add_request(1, prompt(4), SamplingParams(priority=1))
    assert state_snapshot(s) == before
    s.check_invariants()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 3])
def test_sjf_admits_short_jobs_first_and_ages_long_ones(mode, k):
    # One prompt per step (budget 8, no chunking): the admission order is the service order.
    # Aging 1 token/s: key = arrival + job. 0: 40 tokens at 0 (key 40); 1: 5 at 30 (35);
    # 2: hint 2 (max_tokens 50) at 1 (3); 3: 10 at 0 (10); 4: 1 at 39.5 (40.5): 0 aged past it.
    d = make_driver(mode, num_blocks=64, block_size=4, scheduling="sjf", sjf_aging_rate=1.0,
                    enable_chunked_prefill=False, max_num_batched_tokens=8,
                    num_speculative_tokens=k)
    jobs = {0: (40, 0, 0.0), 1: (5, 0, 30.0), 2: (50, 2, 1.0), 3: (10, 0, 0.0), 4: (1, 0, 39.5)}
    for rid, (max_tokens, hint, arrival) in jobs.items():
        d.add(rid, prompt(8, 100 * rid), sp(max_tokens=max_tokens, length_hint=hint),
              arrival_time=arrival)
    assert d.sched.waiting_ids() == [2, 3, 1, 0, 4]
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    assert admission_order(d) == [2, 3, 1, 0, 4]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("victim", ["service_order", "least_computed"])
def test_victims_under_kv_pressure(mode, k, victim):
    """6 usable blocks of 4: 0 (8 tokens), 1 (4), 2 (8) fill 5 after the prefill, and every
    decode row needs a block. The first victim is the request served last (2) or the one with
    the fewest computed tokens (1, which preempts itself); either way every request ends with
    the oracle's tokens."""
    d = make_driver(mode, num_blocks=7, block_size=4, enable_prefix_caching=False,
                    num_speculative_tokens=k, preemption_victim=victim)
    d.add(0, prompt(8, 100), sp(max_tokens=10))
    d.add(1, prompt(4, 200), sp(max_tokens=10))
    d.add(2, prompt(8, 300), sp(max_tokens=10))
    first_victim = None
    while d.busy():
        running = d.sched.running_ids()
        d.step()
        preempted = [r for r in running if r in d.sched.waiting_ids()]
        if preempted and first_victim is None:
            first_victim = preempted
    d.check_all_done()
    d.check_against_oracle()
    assert first_victim == ([1] if victim == "least_computed" else [2])


def test_simulator_runs_every_policy_and_records_it():
    convs = workloads.synthetic("chat", num_conversations=40, seed=5, max_model_len=1024,
                                max_tokens=200)
    for c in convs[::3]:
        c.priority = 1
    results = {}
    for scheduling in ("fcfs", "priority", "sjf"):
        for victim in ("service_order", "least_computed"):
            cfg = SchedulerConfig(num_blocks=120, block_size=16, max_num_seqs=16,
                                  max_num_batched_tokens=256, max_model_len=1024,
                                  scheduling=scheduling, preemption_victim=victim)
            r = simulate(convs, cfg, rate=math.inf,
                         length_hint_error=0.5 if scheduling == "sjf" else 0.0)
            assert len(r.requests) == 40 and r.stats["num_preemptions"] > 0
            assert (r.config["scheduling"], r.config["preemption_victim"]) == (scheduling, victim)
            results[scheduling, victim] = r
    # Every run produces every reply whole: the outputs do not depend on the policy.
    tokens = {key: sorted(len(q.token_times) for q in r.requests) for key, r in results.items()}
    assert len(set(map(tuple, tokens.values()))) == 1
    with pytest.raises(ValueError, match="length_hint_error must be a finite number >= 0"):
        simulate(convs, cfg, rate=math.inf, length_hint_error=math.nan)


def test_length_hints_are_exact_or_log_normal():
    from atom_sched.sim.simulator import length_hints

    convs = workloads.synthetic("chat", num_conversations=30, seed=1, max_model_len=1024,
                                max_tokens=300)
    assert length_hints(convs, 0.0, 0) == [[0] * len(c.turns) for c in convs]
    noisy = length_hints(convs, 0.5, 0)
    assert noisy == length_hints(convs, 0.5, 0), "the same hints for every run of one seed"
    ratios = [h / len(t.output) for c, hs in zip(convs, noisy, strict=True)
              for t, h in zip(c.turns, hs, strict=True)]
    assert min(ratios) < 0.9 and max(ratios) > 1.1 and all(h >= 1 for hs in noisy for h in hs)


def test_simulator_reports_each_tenant_and_fair_share_protects_the_light_one():
    """A flood: 80% of the conversations are tenant t0's, all offered at once. Under FCFS the
    light tenant t1 waits behind t0's backlog; under fair share its TTFT drops, and each run
    reports every tenant's requests, tokens, TTFT and ITL."""
    from atom_sched.sim import report

    convs = workloads.synthetic("chat", num_conversations=60, seed=4, max_model_len=1024,
                                max_tokens=150)
    for i, c in enumerate(convs):
        c.tenant = "t1" if i % 5 == 4 else "t0"
    runs = {}
    for scheduling in ("fcfs", "fair"):
        cfg = SchedulerConfig(num_blocks=400, block_size=16, max_num_seqs=8,
                              max_num_batched_tokens=256, max_model_len=1024,
                              scheduling=scheduling)
        runs[scheduling] = simulate(convs, cfg, rate=math.inf, label=scheduling)
    for r in runs.values():
        by_tenant = report.summary(r)["by_tenant"]
        assert sorted(by_tenant) == ["t0", "t1"]
        assert by_tenant["t1"]["requests"] == 12 and by_tenant["t0"]["requests"] == 48
        assert sum(v["output_tokens"] for v in by_tenant.values()) == r.output_tokens
    light = {k: float(np.median(r.ttft(tenant="t1"))) for k, r in runs.items()}
    assert light["fair"] < 0.5 * light["fcfs"], light
    assert "fair: tenant t1: 12 requests" in report.format_table(list(runs.values()))


def test_simulate_cli_runs_the_cross_product(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["simulate", "--workload", "chat", "--conversations", "30", "--rate", "5",
                 "--kv-blocks", "200", "--policy", "mixed", "--scheduling", "fcfs,sjf",
                 "--victim", "service_order,least_computed", "--sjf-aging-rate", "50",
                 "--watermark", "0,4",
                 "--length-hint-error", "0.3", "--no-progress", "--out", str(out)]) == 0
    runs = json.loads((out / "sim.json").read_text())["runs"]
    assert [r["label"] for r in runs] == [
        "mixed", "mixed, watermark 4", "mixed, least computed",
        "mixed, least computed, watermark 4", "mixed, sjf", "mixed, sjf, watermark 4",
        "mixed, sjf, least computed", "mixed, sjf, least computed, watermark 4"]
    assert [(r["config"]["scheduling"], r["config"]["preemption_victim"],
             r["config"]["admission_watermark_blocks"]) for r in runs] == [
        (s, v, w) for s in ("fcfs", "sjf") for v in ("service_order", "least_computed")
        for w in (0, 4)]
    assert all(r["config"]["sjf_aging_rate"] == 50 for r in runs)
    assert "mixed, sjf, least computed, watermark 4" in capsys.readouterr().out


def test_simulate_cli_with_tenants(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["simulate", "--workload", "chat", "--conversations", "30", "--rate", "1000",
                 "--kv-blocks", "300", "--policy", "mixed", "--scheduling", "fcfs,fair",
                 "--tenants", "0.8,0.2", "--tenant-weights", "1,2", "--no-progress",
                 "--out", str(out)]) == 0
    runs = json.loads((out / "sim.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["mixed", "mixed, fair"]
    for r in runs:
        assert r["config"]["tenant_weights"] == {"t0": 1.0, "t1": 2.0}
        assert set(r["by_tenant"]) == {"t0", "t1"}
        assert sum(t["requests"] for t in r["by_tenant"].values()) == r["requests"]
    assert "mixed, fair: tenant t1:" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [("--scheduling", "fifo"), ("--scheduling", "fcfs,"),
                                         ("--tenants", "0.5,0.6"), ("--tenants", "0,1"),
                                         ("--tenant-weights", "1"),
                                         ("--victim", "lifo"), ("--sjf-aging-rate", "0"),
                                         ("--sjf-aging-rate", "nan"),
                                         ("--length-hint-error", "-1"),
                                         ("--length-hint-error", "inf")])
def test_simulate_cli_refuses_bad_policy_flags(flag, value, tmp_path, capsys):
    assert main(["simulate", "--workload", "chat", flag, value,
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err
    assert not (tmp_path / "o").exists()
