"""Issue 11 item 4, multi-turn reuse: with cache_decode_blocks (the default) the blocks a request
fills while it decodes are published once their tokens are verified, so a follow-up turn that
resends the conversation hits every full block but the one holding the last token (whose KV was
never computed). Off, only prompt blocks are cached, as ATOM. Each run goes through the Driver
(invariants and batch checks after every call, the oracle's tokens at the end) in both step
protocols, with and without drafts (random acceptance: rejected drafts must never be cached)."""

import pickle

import pytest
from support import event_kind, make_driver, prompt, sp

from atom_sched import SchedulerConfig, block_hash

BS = 4


def two_turns(mode: str, k: int, cache_decode_blocks: bool):
    d = make_driver(mode, num_blocks=128, block_size=BS, num_speculative_tokens=k,
                    enable_kv_events=True, cache_decode_blocks=cache_decode_blocks)
    d.model.accept = None  # random acceptance
    first = prompt(10, 100)
    d.add(0, first, sp(max_tokens=23, ignore_eos=True))
    d.run()
    conversation = d.known(0)  # the prompt, then every token streamed
    events = list(d.sched.take_events())
    d.add(1, conversation + prompt(6, 900), sp(max_tokens=3, ignore_eos=True))
    d.run()
    d.check_all_done()
    d.check_against_oracle()
    return d, conversation, events


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 3])
def test_a_follow_up_turn_hits_every_verified_block(mode, k):
    d, conversation, events = two_turns(mode, k, cache_decode_blocks=True)
    assert len(conversation) == 33
    # 32 tokens have verified KV (all but the last): 8 full blocks.
    assert d.cached_first[1] == 32
    stored = [h for e in events if event_kind(e) == "BlockStored" for h in e.block_hashes]
    parent, chain = None, []
    for i in range(8):
        parent = block_hash(conversation[i * BS : (i + 1) * BS], parent)
        chain.append(parent)
    assert stored == chain, "one BlockStored per verified block, in order, real tokens only"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("k", [0, 3])
def test_without_decode_caching_only_prompt_blocks_are_hit(mode, k):
    d, _, events = two_turns(mode, k, cache_decode_blocks=False)
    assert d.cached_first[1] == 8  # the first turn's prompt: 2 full blocks of 10 tokens
    assert sum(len(e.block_hashes) for e in events if event_kind(e) == "BlockStored") == 2


def test_the_option_is_a_config_field():
    c = SchedulerConfig(num_blocks=16)
    assert c.cache_decode_blocks is True
    c.cache_decode_blocks = False
    assert SchedulerConfig(num_blocks=16, cache_decode_blocks=False).cache_decode_blocks is False
    assert pickle.loads(pickle.dumps(c)).cache_decode_blocks is False
