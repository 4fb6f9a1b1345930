"""Issue 12, items 7-10: the Python object model. No pure-Python call may crash the process,
token containers are typed consistently, and the config objects survive copy and pickle."""

import copy
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest

import atom_sched
from atom_sched import SamplingParams, Scheduler, SchedulerConfig

BOUND_TYPES = [getattr(atom_sched._core, n) for n in dir(atom_sched._core)
               if isinstance(getattr(atom_sched._core, n), type)
               and not issubclass(getattr(atom_sched._core, n), BaseException)]

# Every way Python reads an object directly: each must raise TypeError on a bare __new__ object.
PROBES = {
    "len": len, "repr": repr, "str": str, "iter": iter, "hash": hash,
    "eq": lambda o: o == o, "index": lambda o: o[0],
}


def _probe_in_subprocess(type_name: str, probe: str, attrs: bool) -> subprocess.CompletedProcess:
    # A crash must fail this test, not kill pytest: run each probe in a child interpreter.
    code = f"""
import atom_sched._core as c
t = c.{type_name}
o = t.__new__(t)
probe = {probe!r}
fn = {{"len": len, "repr": repr, "str": str, "iter": iter, "hash": hash,
      "eq": lambda o: o == o, "index": lambda o: o[0]}}[probe]
outcomes = []
def run(f):
    try:
        f()
        outcomes.append("ok")
    except TypeError as e:
        outcomes.append("TypeError")
    except (AttributeError, NotImplementedError, KeyError, IndexError) as e:
        outcomes.append(type(e).__name__)
run(lambda: fn(o))
if {attrs}:
    for name in dir(t):
        if name.startswith("__"):
            continue
        def get(name=name):
            v = getattr(o, name)
            if callable(v):
                v()
        run(get)
print(",".join(outcomes))
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("cls", BOUND_TYPES, ids=lambda t: t.__name__)
def test_uninitialised_objects_raise_instead_of_crashing(cls):
    for i, probe in enumerate(PROBES):
        r = _probe_in_subprocess(cls.__name__, probe, attrs=(i == 0))
        assert r.returncode == 0, f"{cls.__name__} {probe}: rc={r.returncode} {r.stderr[-500:]}"
        outcomes = r.stdout.strip().split(",")
        # Reading anything of an uninitialised object is refused (the default object methods
        # like __eq__ by identity or hash by address never touch C++ memory: those may pass).
        if probe == "len" or probe == "repr" or probe == "index":
            assert outcomes[0] in ("TypeError", "ok") and (
                outcomes[0] == "TypeError" or probe == "repr"), (cls.__name__, probe, outcomes)
        assert all(o in ("TypeError", "AttributeError", "ok") for o in outcomes[1:]), outcomes
        if i == 0:
            assert "ok" not in outcomes[1:], (cls.__name__, outcomes)


def test_issue_reproducers_raise_type_error():
    so = atom_sched.StepOutput.__new__(atom_sched.StepOutput)
    with pytest.raises(TypeError, match="not initialised"):
        len(so)
    b = atom_sched.Batch.__new__(atom_sched.Batch)
    with pytest.raises(TypeError, match="not initialised"):
        repr(b)
    c = SchedulerConfig.__new__(SchedulerConfig)
    with pytest.raises(TypeError, match="not initialised"):
        c.num_blocks  # noqa: B018


@pytest.mark.parametrize("cls", [c for c in BOUND_TYPES if not c.__name__.endswith("Connector")],
                         ids=lambda t: t.__name__)
def test_assigning_to_uninitialised_objects_raises_instead_of_crashing(cls):
    """A setter writes into the value pybind11 never constructed (assigning a list to
    RemoteMatch.draft_tokens or SchedulerConfig.stop_token_ids of a bare __new__ object crashed).
    Every writable attribute, with a value of its own type, is refused with TypeError."""
    code = f"""
import atom_sched._core as c
t = c.{cls.__name__}
o = t.__new__(t)
samples = [[1, 2, 3], 3, 0.5, True, "x", None]
out = []
for name in dir(t):
    prop = getattr(t, name, None)
    if name.startswith("__") or not isinstance(prop, property) or prop.fset is None:
        continue
    for v in samples:
        try:
            setattr(o, name, v)
            out.append(name + ":ok")
        except TypeError as e:
            out.append("TypeError" if "not initialised" in str(e) else name + ":other")
print(",".join(out))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{cls.__name__}: rc={r.returncode} {r.stderr[-500:]}"
    outcomes = [o for o in r.stdout.strip().split(",") if o]
    assert all(o == "TypeError" for o in outcomes), (cls.__name__, outcomes)


# ---- item 9: token containers ------------------------------------------------------------


def _sched():
    return Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=256))


@pytest.mark.parametrize("prompt", [
    (t for t in [1, 2, 3]), {1, 2, 3}, 7, frozenset({1}), {1: 2}, b"\x01\x02",
    bytearray(b"\x01\x02"), memoryview(b"\x01\x02"), 3.0, None,
], ids=["generator", "set", "int", "frozenset", "dict", "bytes", "bytearray",
        "memoryview-bytes", "float", "None"])
def test_non_sequence_prompts_are_type_errors(prompt):
    s = _sched()
    with pytest.raises(TypeError):
        s.add_request(0, prompt)
    assert 0 not in s and not s.has_unfinished_requests()


@pytest.mark.parametrize("prompt, value", [
    ([1, 2**70], "1180591620717411303424"), ([1, -2**70], "-1180591620717411303424"),
    (np.array([1, 2**64 - 1], dtype=np.uint64), "18446744073709551615"),
    (np.array([1, 2**31], dtype=np.uint32), "2147483648"),
    ((5, 2**63), "9223372036854775808"),
])
def test_out_of_range_tokens_are_value_errors_naming_the_value(prompt, value):
    s = _sched()
    with pytest.raises(ValueError, match=value):
        s.add_request(0, prompt)
    assert 0 not in s


@pytest.mark.parametrize("prompt", [
    [1, 2, 3], (1, 2, 3), range(1, 4), np.array([1, 2, 3], dtype=np.uint16),
    memoryview(np.array([1, 2, 3], dtype=np.int32)), np.array([1, 2, 3], dtype=np.int64)[::1],
    np.array([1, 0, 2, 0, 3], dtype=np.int32)[::2],
])
def test_token_containers_accepted(prompt):
    s = _sched()
    s.add_request(0, prompt)
    assert list(s.request_state(0)["token_ids"]) == [1, 2, 3]


def test_prompt_is_copied_before_validation_under_a_writer_thread():
    # Item 7: a thread rewriting the prompt array while add_request runs must never get a
    # negative id stored: what is validated is a private copy, and that copy is what is stored.
    n = 1 << 21
    prompt = np.ones(n, dtype=np.int32)
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            prompt[::7] = -5
            prompt[::7] = 1

    s = Scheduler(SchedulerConfig(num_blocks=(n // 16) * 2 + 64, block_size=16,
                                  max_model_len=n + 64, max_num_batched_tokens=8192))
    t = threading.Thread(target=writer)
    t.start()
    try:
        accepted = 0
        for rid in range(20):
            try:
                s.add_request(rid, prompt)
            except ValueError:
                continue  # the copy held a -5: refused, nothing stored
            accepted += 1
            toks = np.asarray(s.request_state(rid)["token_ids"])
            assert toks.min() >= 0, f"request {rid} stored a negative token"
            s.abort_request(rid)
    finally:
        stop.set()
        t.join()


# ---- item 10: copy, deepcopy, pickle -------------------------------------------------------

CONFIG = SchedulerConfig(num_blocks=123, block_size=8, max_num_seqs=7, max_num_batched_tokens=99,
                         max_model_len=512, enable_prefix_caching=False,
                         enable_chunked_prefill=False, num_speculative_tokens=2,
                         eos_token_id=5, stop_token_ids=[9, 10], scheduler_delay_factor=0.5,
                         enable_kv_events=True, num_state_slots=3, num_lookahead_tokens=2,
                         draft_slots_per_row=1, recompute_last_hit_block=True,
                         long_prefill_token_threshold_adaptive=True, policy="mixed",
                         prefill_lookahead_tokens=3, pad_first_decode_rows=True,
                         publish_prompt_blocks_at_schedule=True, schedule_ahead=False)
PARAMS = SamplingParams(temperature=0.5, top_k=4, top_p=0.75, max_tokens=17, ignore_eos=True,
                        logprobs=True, stop_token_ids=[3], stop_token_sequences=[[4, 5]],
                        seed=1234)


def _fields(o):
    return {k: getattr(o, k) for k in dir(o)
            if not k.startswith("_") and not callable(getattr(o, k))}


@pytest.mark.parametrize("obj", [CONFIG, PARAMS], ids=["SchedulerConfig", "SamplingParams"])
@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle0", "pickle2", "pickle5"])
def test_config_objects_round_trip(obj, how):
    if how == "copy":
        new = copy.copy(obj)
    elif how == "deepcopy":
        new = copy.deepcopy(obj)
    else:
        new = pickle.loads(pickle.dumps(obj, protocol=int(how[-1])))
    assert type(new) is type(obj) and new is not obj
    assert _fields(new) == _fields(obj)
    assert len(_fields(obj)) >= 10
    # Independent: changing the copy leaves the original alone.
    new.stop_token_ids = [1]
    assert obj.stop_token_ids != [1]


def test_unpickling_validates_like_the_constructor():
    state = PARAMS.__getstate__()
    state["max_tokens"] = -3
    bad = SamplingParams.__new__(SamplingParams)
    with pytest.raises(ValueError):
        bad.__setstate__(state)


def test_config_pickles_into_a_worker_process():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        got = pool.apply(repr, (CONFIG,))
    assert got == repr(CONFIG)
