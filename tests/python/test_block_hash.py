"""atom_sched.block_hash: ATOM's published vectors, input validation, and the xxhash reference."""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import atom_sched

H_1234 = 8356527653647720045  # block_hash([1, 2, 3, 4])
U64_MAX = 2**64 - 1


def test_imports_compiled_module_from_installed_package() -> None:
    core = Path(atom_sched._core.__file__)
    assert core.name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert core.parent == Path(atom_sched.__file__).parent
    assert "block_hash" in atom_sched.__all__


def test_atom_vectors() -> None:
    assert atom_sched.block_hash([1, 2, 3, 4]) == H_1234 == 0x73F859A04F669E6D
    assert atom_sched.block_hash([5, 6, 7, 8], H_1234) == 610383040053763902
    assert atom_sched.block_hash([1, 2, 3, 4], parent=42) == 3613909605708555987


def test_none_parent_is_no_parent_and_zero_parent_is_not() -> None:
    assert atom_sched.block_hash([1, 2, 3, 4], None) == H_1234
    assert atom_sched.block_hash([1, 2, 3, 4], 0) != H_1234
    assert atom_sched.block_hash([]) == 0xEF46DB3751D8E999  # xxHash64 of nothing


def test_accepts_any_sequence_and_index_types() -> None:
    assert atom_sched.block_hash((1, 2, 3, 4)) == H_1234
    assert atom_sched.block_hash(range(1, 5)) == H_1234
    assert atom_sched.block_hash([np.int64(1), np.int32(2), 3, 4]) == H_1234
    assert atom_sched.block_hash([1, 2, 3, 4], parent=np.uint64(42)) == 3613909605708555987


@pytest.mark.parametrize("bad", [-1, 2**31, 2**63, 2**64, -(2**70)])
def test_token_out_of_range_is_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match="token id"):
        atom_sched.block_hash([1, bad, 3])


@pytest.mark.parametrize("bad", [-1, 2**64, 2**80])
def test_parent_out_of_range_is_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match="parent"):
        atom_sched.block_hash([1, 2], parent=bad)


@pytest.mark.parametrize("tokens", [[1.0, 2], ["1"], [None], [[1]]])
def test_non_int_token_is_type_error(tokens: list) -> None:
    with pytest.raises(TypeError):
        atom_sched.block_hash(tokens)


def test_non_sequence_or_bad_parent_type_is_type_error() -> None:
    with pytest.raises(TypeError):
        atom_sched.block_hash(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        atom_sched.block_hash([1], parent=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        atom_sched.block_hash([1], parent="7")  # type: ignore[arg-type]


def test_extreme_valid_values() -> None:
    # Largest token and parent are accepted and match the reference byte encoding.
    xxhash = pytest.importorskip("xxhash")
    tokens = [0, 2**31 - 1]
    want = xxhash.xxh64(
        U64_MAX.to_bytes(8, "little") + np.asarray(tokens, dtype="<i8").tobytes(), seed=0
    ).intdigest()
    assert atom_sched.block_hash(tokens, parent=U64_MAX) == want


def _reference(tokens: list[int], parent: int | None) -> int:
    xxhash = pytest.importorskip("xxhash")
    h = xxhash.xxh64(seed=0)
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.intdigest()


@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=80),
    parent=st.none() | st.integers(0, U64_MAX),
)
def test_matches_xxhash_reference(tokens: list[int], parent: int | None) -> None:
    assert atom_sched.block_hash(tokens, parent) == _reference(tokens, parent)
