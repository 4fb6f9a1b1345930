"""Property tests of the device kernels' CPU references (the same code paths the kernels share),
on random states and plans: rows in any order, mixed prefill and decode rows, resets, new blocks,
K = 0..8, padding; greedy and probabilistic verification."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch", reason="the device suites allocate buffers with torch")

from support.device import Buffers, random_case  # noqa: E402

from atom_sched import _core  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None)


def run_prepare(case, **kw):
    b = Buffers(case, "cpu", **kw)
    before = b.snapshot()
    _core.device_prepare(b.plan.data_ptr(), b.state, b.outputs, case.padded_rows,
                         case.padded_tokens)
    return b, before


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(0, 8), pad=st.booleans())
def test_prepare_invariants(seed: int, k: int, pad: bool) -> None:
    case = random_case(np.random.default_rng(seed), k, pad=pad)
    b, before = run_prepare(case)
    s = b.snapshot()
    n, m, rp, tp = case.num_rows, case.num_tokens, case.padded_rows, case.padded_tokens
    W, bs = case.width, case.block_size
    assert s["errors"][0] == 0
    qsl, seq = s["query_start_loc"][: rp + 1], s["seq_lens"][:rp]
    q = np.array([r["q"] for r in case.rows])
    assert qsl[0] == 0 and (np.diff(qsl[: n + 1]) == q).all()
    assert (qsl[n:] == m).all(), "padding repeats the total"
    assert (seq[n:rp] == 0).all()
    assert (s["cu_seqlens_k"][1 : rp + 1] == np.cumsum(seq)).all()
    for i, r in enumerate(case.rows):
        slot = r["slot"]
        start = r["start"] if r["prefill"] else int(before["computed"][slot])
        assert seq[i] == start + r["q"]
        assert s["computed"][slot] == seq[i]
        t0 = qsl[i]
        pos = s["positions"][t0 : t0 + r["q"]]
        assert (pos == np.arange(start, start + r["q"])).all()
        table = s["table"][slot]
        np.testing.assert_array_equal(s["block_table"][i], table)
        np.testing.assert_array_equal(s["slot_mapping"][t0 : t0 + r["q"]],
                                      table[pos // bs].astype(np.int64) * bs + pos % bs)
        ids = s["input_ids"][t0 : t0 + r["q"]]
        if not r["prefill"]:
            expect = [before["last"][slot]] + list(before["drafts"][slot][: r["q"] - 1])
            assert list(ids) == expect
        if r["reset"]:  # zeroed, then only this step's new blocks
            untouched = table == 0
            assert untouched.sum() >= W - 2
    assert (s["slot_mapping"][m:tp] == -1).all() and (s["input_ids"][m:tp] == 0).all()
    assert (s["block_table"][n:rp] == 0).all()
    assert (s["logits_indices"][:rp] == np.maximum(qsl[1 : rp + 1] - 1, 0)).all()
    spec = s["spec_logits_indices"][:rp]
    assert ((spec >= 0) & (spec < max(m, 1))).all(), "every gather index is in bounds"
    # Slots not in the batch are untouched.
    other = np.setdiff1d(np.arange(case.num_slots), [r["slot"] for r in case.rows])
    np.testing.assert_array_equal(s["computed"][other], before["computed"][other])
    np.testing.assert_array_equal(s["table"][other], before["table"][other])
    assert list(s["meta"][:4]) == [n, m, int(q.max()), int(seq[:n].max())]


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(0, 8), prob=st.booleans(),
       match=st.floats(0.0, 1.0), with_drafts=st.booleans())
def test_accept_bookkeeping(seed: int, k: int, prob: bool, match: float,
                            with_drafts: bool) -> None:
    rng = np.random.default_rng(seed)
    case = random_case(rng, k)
    b, _ = run_prepare(case)
    mid = b.snapshot()  # state after prepare: computed includes this step's q
    n, rp = case.num_rows, case.padded_rows
    drafts_state = mid["drafts"]
    # Targets agree with each row's drafts on a random prefix (probability `match` per draft).
    target = rng.integers(6000, 9000, size=(rp, k + 1)).astype(np.int32)
    for i, r in enumerate(case.rows):
        for j in range(k):
            if rng.random() < match:
                target[i, j] = drafts_state[r["slot"]][j]
    nxt = rng.integers(10, 5000, size=(rp, max(k, 1))).astype(np.int32)[:, :k].copy()
    tp = rng.random((rp, k)).astype(np.float32)
    dp = rng.random((rp, k)).astype(np.float32)
    un = rng.random((rp, k)).astype(np.float32)
    ptr = lambda a: a.ctypes.data if a is not None and a.size else 0  # noqa: E731
    use_drafts = with_drafts and k > 0
    _core.device_accept(
        b.plan.data_ptr(), b.state, b.result.data_ptr(), rp, ptr(target),
        ptr(nxt) if use_drafts else 0, ptr(tp) if prob and k else 0,
        ptr(dp) if prob and k else 0, ptr(un) if prob and k else 0,
    )
    s = b.snapshot()
    res = s["result"]
    assert list(res[:3]) == [n, 0, k]
    toks = res[4 : 4 + n * (k + 1)].reshape(n, k + 1)
    acc = res[4 + n * (k + 1) : 4 + n * (k + 2)]
    for i, r in enumerate(case.rows):
        slot, q = r["slot"], r["q"]
        a = int(acc[i])
        kr = 0 if r["prefill"] else q - 1
        assert 1 <= a <= kr + 1, "accepted counts in 1..K+1"
        if not r["emits"]:
            assert a == 1 and (toks[i] == -1).all()
            assert s["computed"][slot] == mid["computed"][slot]
            assert s["last"][slot] == mid["last"][slot]
            continue
        d = drafts_state[slot]

        def verified(j: int, i: int = i, d: np.ndarray = d) -> bool:
            if prob and k:
                return bool(np.float32(un[i, j]) * np.float32(dp[i, j]) < np.float32(tp[i, j]))
            return bool(d[j] == target[i, j])

        # Every accepted draft passed verification; the first failure stops acceptance, so no
        # token after the first rejection is ever accepted.
        assert all(verified(j) for j in range(a - 1))
        if a - 1 < kr:
            assert not verified(a - 1)
        assert list(toks[i, : a - 1]) == list(d[: a - 1])
        assert toks[i, a - 1] == target[i, a - 1]
        assert (toks[i, a:] == -1).all()
        # The computed length rolls back by exactly the rejected count (decode rows only).
        rolled = 0 if r["prefill"] else q - a
        assert s["computed"][slot] == mid["computed"][slot] - rolled
        assert s["last"][slot] == toks[i, a - 1]
        if use_drafts:
            assert list(s["drafts"][slot][:k]) == list(nxt[i])
        else:
            assert list(s["drafts"][slot][:k]) == list(d[:k])


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(0, 8))
def test_split_kernels_equal_prepare(seed: int, k: int) -> None:
    """apply_plan then build_inputs is exactly prepare."""
    case = random_case(np.random.default_rng(seed), k)
    one = Buffers(case, "cpu")
    two = Buffers(case, "cpu")
    _core.device_prepare(one.plan.data_ptr(), one.state, one.outputs, case.padded_rows,
                         case.padded_tokens)
    _core.device_apply_plan(two.plan.data_ptr(), two.state, two.outputs, case.padded_rows,
                            case.padded_tokens)
    _core.device_build_inputs(two.plan.data_ptr(), two.state, two.outputs, case.padded_rows,
                              case.padded_tokens)
    a, b = one.snapshot(), two.snapshot()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_status_errors_become_python_exceptions() -> None:
    case = random_case(np.random.default_rng(0), 2)
    b = Buffers(case, "cpu")
    with pytest.raises(ValueError, match="plan is null"):
        _core.device_prepare(0, b.state, b.outputs, 1, 1)
    with pytest.raises(ValueError, match="padded_rows"):
        _core.device_prepare(b.plan.data_ptr(), b.state, b.outputs, 0, 1)
    with pytest.raises(ValueError, match="target_probs"):
        _core.device_accept(b.plan.data_ptr(), b.state, b.result.data_ptr(), 4, 8, 0, 8)
    if _core.device_backend() == "none":
        with pytest.raises(_core.DeviceError, match="no GPU back end"):
            _core.device_prepare(b.plan.data_ptr(), b.state, b.outputs, 1, 1, 0, True)
    elif _core.device_count() == 0:
        with pytest.raises(_core.DeviceError, match="no .* device"):
            _core.device_prepare(b.plan.data_ptr(), b.state, b.outputs, 1, 1, 0, True)
    plan = np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="words"):
        _core.device_pack_plan(
            plan.ctypes.data, 4, np.array([0], np.int32), np.array([1], np.int32),
            np.array([0], np.int32), np.array([True]), np.array([True]), np.array([True]),
            np.array([0], np.int32), np.array([0, 0], np.int32), np.array([], np.int32),
            np.array([5], np.int32), np.array([0, 1], np.int32),
        )
    with pytest.raises(TypeError):
        _core.device_pack_plan(
            plan.ctypes.data, 4, np.array([0], np.int64), np.array([1], np.int32),
            np.array([0], np.int32), np.array([True]), np.array([True]), np.array([True]),
            np.array([0], np.int32), np.array([0, 0], np.int32), np.array([], np.int32),
            np.array([5], np.int32), np.array([0, 1], np.int32),
        )
