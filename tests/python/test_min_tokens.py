"""Issue 11 item 5, min_tokens (vLLM's semantics): until a request has generated min_tokens tokens
only the length rules end it; EOS, stop ids and stop sequences before that are ordinary tokens.
Each run goes through the Driver (invariants and batch checks after every call) and ends with the
oracle's tokens and reason, in both step protocols, with and without drafts."""

import copy
import pickle

import pytest
from support import EOS, make_driver, prompt, sp

from atom_sched import SamplingParams

STOP_ID = 7
STOP_SEQ = [5, 6]


def run(overrides: dict[int, int], mode: str, k: int, **params):
    d = make_driver(mode, num_blocks=64, block_size=4, eos_token_id=EOS,
                    stop_token_ids=[STOP_ID], num_speculative_tokens=k)
    d.model.accept = k + 1  # every draft accepted: several stop candidates in one row
    d.model.overrides = {(0, g): t for g, t in overrides.items()}
    d.add(0, prompt(6), sp(stop_token_sequences=[STOP_SEQ], **params))
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    return d


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 3])
def test_stops_before_min_tokens_are_ordinary_tokens(mode, k):
    # EOS at g=0, a stop id at g=1, a stop sequence ending at g=3: all before min_tokens=5.
    d = run({0: EOS, 1: STOP_ID, 2: 5, 3: 6, 5: EOS}, mode, k, max_tokens=20, min_tokens=5)
    assert d.reasons[0] == "eos"
    assert d.tokens[0][:4] == [EOS, STOP_ID, 5, 6] and len(d.tokens[0]) == 6


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stop_at_min_tokens_counts(mode):
    # The 3rd token is the first that may stop: a stop sequence straddling the boundary ends it.
    d = run({1: 5, 2: 6}, mode, 2, max_tokens=20, min_tokens=3)
    assert d.reasons[0] == "stop_sequence" and len(d.tokens[0]) == 3


def test_length_rules_still_apply_before_min_tokens():
    d = run({0: EOS}, "sync", 0, max_tokens=4, min_tokens=4)
    assert d.reasons[0] == "max_tokens" and len(d.tokens[0]) == 4


def test_min_tokens_is_validated_and_kept():
    for bad in (-1, 9):
        with pytest.raises(ValueError, match="min_tokens"):
            SamplingParams(max_tokens=8, min_tokens=bad)
    p = SamplingParams(max_tokens=8, min_tokens=8)
    assert "min_tokens=8" in repr(p)
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert q.min_tokens == 8 and q.max_tokens == 8
    assert SamplingParams().min_tokens == 0
