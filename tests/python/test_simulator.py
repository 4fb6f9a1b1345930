"""Issue 11 item 6: the serving simulator (atom-sched simulate). ShareGPT V3 is parsed record by
record from its truncated file; a follow-up turn resends exactly the conversation so far; the
simulator drives the real scheduler to completion under every policy and reports what happened;
and on real multi-turn ShareGPT conversations decode-block caching raises the prefix hit rate."""

import json
import math

import numpy as np
import pytest

from atom_sched.cli import main
from atom_sched.sim import StepTimeModel, simulate, workloads
from atom_sched.sim.simulator import SimResult
from atom_sched.sim.workloads import Conversation, Turn, conversations_from_messages


def test_sharegpt_keeps_the_complete_records():
    records = list(workloads.sharegpt_records())
    assert len(records) == workloads.SHAREGPT_RECORDS == 17_671
    assert sum(len(r["conversations"]) for r in records) == 129_071
    multi = sum(1 for r in records
                if sum(m["from"] == "human" for m in r["conversations"]) >= 2)
    assert multi == 12_975


def test_a_follow_up_turn_resends_the_conversation():
    a = np.arange
    msgs = [("system", a(1, 4)), ("user", a(10, 15)), ("assistant", a(20, 26)),
            ("user", a(30, 33)), ("assistant", a(40, 50)), ("assistant", a(60, 62))]
    header = np.array([7, 8], np.int32)
    turns = conversations_from_messages(msgs, header, max_model_len=100, max_tokens=8)
    assert len(turns) == 2, "an assistant message without a user message first is no turn"
    t0, t1 = turns
    assert t0.prompt.tolist() == [1, 2, 3, *range(10, 15), 7, 8]
    assert t0.output.tolist() == list(range(20, 26))
    assert t1.prompt.tolist()[: len(t0.prompt) + len(t0.output)] == (
        t0.prompt.tolist() + t0.output.tolist())
    assert t1.output.tolist() == list(range(40, 48)), "capped at max_tokens"
    short = conversations_from_messages(msgs, header, max_model_len=20, max_tokens=8)
    assert len(short) == 1, "the conversation ends before a turn that does not fit"


def small_config(policy: str, **kw):
    from atom_sched import SchedulerConfig

    return SchedulerConfig(num_blocks=kw.pop("num_blocks", 400), block_size=16,
                           max_num_seqs=16, max_num_batched_tokens=256, max_model_len=4096,
                           policy=policy, **kw)


@pytest.mark.parametrize("policy", ["atom", "mixed"])
@pytest.mark.parametrize("rate", [math.inf, 20.0])
def test_every_turn_runs_to_its_scripted_length(policy, rate):
    convs = workloads.synthetic("chat", num_conversations=60, seed=3, max_model_len=1024,
                                max_tokens=200)
    convs.append(Conversation([Turn(np.arange(3, 300, dtype=np.int32),
                                    np.arange(5, 40, dtype=np.int32)),
                               Turn(np.arange(3, 400, dtype=np.int32),
                                    np.arange(5, 30, dtype=np.int32))]))
    # A pool of 100 blocks (1,600 tokens) forces preemption.
    res = simulate(convs, small_config(policy, num_blocks=100), rate=rate, seed=1,
                   label=policy)
    assert len(res.requests) == sum(len(c.turns) for c in convs)
    for r in res.requests:
        out = convs[r.conversation].turns[r.turn].output
        assert len(r.token_times) == len(out), "every scripted token was emitted once"
        assert r.arrival <= r.first_token <= r.finish
        assert r.token_times == sorted(r.token_times)
    follow = [r for r in res.requests if r.turn == 1][0]
    first = [r for r in res.requests if r.conversation == follow.conversation and r.turn == 0][0]
    assert follow.arrival == pytest.approx(first.finish + 1.0), "think time after the reply"
    assert res.stats["num_preemptions"] > 0
    assert (res.itl() > 0).all() and res.throughput > 0


def test_the_step_time_model():
    m = StepTimeModel(a=1.0, b=0.5, c=0.25)
    assert m(4, 8) == 1.0 + 2.0 + 2.0
    convs = workloads.synthetic("chat", num_conversations=5, seed=0, max_model_len=4096,
                                max_tokens=50)
    res: SimResult = simulate(convs, small_config("atom"), rate=math.inf,
                              step_time=StepTimeModel(a=1.0, b=0.0, c=0.0))
    assert res.duration == pytest.approx(res.steps * 1.0), "one second per step"


def test_decode_caching_raises_the_hit_rate_on_sharegpt_conversations():
    from atom_sched.engine import weights

    tok = weights.load_tokenizer(weights.ensure_cached(verbose=False).path)
    convs = workloads.sharegpt(tok, num_conversations=40, seed=5, max_model_len=4096,
                               max_tokens=256)
    assert any(len(c.turns) > 1 for c in convs)
    on = simulate(convs, small_config("mixed", num_blocks=2000), rate=2.0, seed=2)
    off = simulate(convs, small_config("mixed", num_blocks=2000, cache_decode_blocks=False),
                   rate=2.0, seed=2)
    assert on.prefix_hit_rate > off.prefix_hit_rate > 0
    follow_on = sum(r.cached_tokens for r in on.requests if r.turn > 0)
    follow_off = sum(r.cached_tokens for r in off.requests if r.turn > 0)
    assert follow_on > follow_off


def test_cli_compares_the_policies(tmp_path, capsys):
    rc = main(["simulate", "--workload", "chat", "--conversations", "40", "--no-progress",
               "--priority-classes", "2", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "atom, saturated" in out and "\nmixed, priority " in out and "priority 1 TTFT" in out
    data = json.loads((tmp_path / "sim.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["atom, saturated", "atom, priority",
                                                  "mixed, priority"]
    assert data["meta"]["step_time"] == {"a": 5e-3, "b": 40e-6, "c": 40e-9}
    assert (tmp_path / "latency.png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--conversations", "0"], "--conversations must be >= 1"),
    (["--rate", "-1"], "--rate must be a positive number"),
    (["--load", "0"], "--load must be in (0, 10]"),
    (["--budget", "0"], "--budget must be >= 1"),
    (["--max-model-len", "1"], "no chat conversation fits --max-model-len 1"),
    (["--think-time", "-1"], "--think-time and the step-time constants must be >= 0"),
    (["--step-c=-1e-9"], "--think-time and the step-time constants must be >= 0"),
    (["--rate", "nan"], "--rate must be a positive number"),
    (["--priority-classes", "0"], "--priority-classes must be >= 1"),
])
def test_cli_refuses_bad_arguments(argv, message, capsys, tmp_path):
    rc = main(["simulate", "--workload", "chat", "--out", str(tmp_path), *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kw", [{"think_time": float("nan")}, {"think_time": float("inf")},
                                {"think_time": -1.0}, {"rate": float("nan")}, {"rate": 0.0},
                                {"rate": -2.0}])
def test_simulate_refuses_values_that_would_never_end(kw):
    """From Python as from the command line: a NaN think time or rate used to loop forever."""
    from atom_sched import SchedulerConfig

    turn = Turn(np.arange(2, 7, dtype=np.int32), np.arange(7, 10, dtype=np.int32))
    with pytest.raises(ValueError, match=next(iter(kw))):
        simulate([Conversation(turns=[turn])], SchedulerConfig(num_blocks=64, block_size=4),
                 **{"rate": 1.0, **kw})


@pytest.mark.parametrize("kw", [{"a": float("nan")}, {"b": float("inf")}, {"c": -1e-9},
                                {"a": 0.0, "b": 0.0}])
def test_step_time_model_refuses_constants_that_stop_the_clock(kw):
    with pytest.raises(ValueError, match="StepTimeModel"):
        StepTimeModel(**kw)
