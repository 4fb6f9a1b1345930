"""A stand-in for vLLM's V1 model runner and a vLLM ``Request`` factory, model-free.

Shared by the protocol tests (test_vllm_e2e.py) and the speed benchmark
(benchmarks/vllm_scheduler_bench.py), which drive a scheduler class (vLLM's own or
``AtomScheduler``) without a model: the stand-in keeps, per request, what vLLM's V1 runner keeps
(``gpu_model_runner._update_states``), checks that every scheduled position has a block that is
not the null block, and answers each step with a ``ModelRunnerOutput`` that samples one token for
every row that reaches the end of its request's known tokens.

vLLM is imported inside the functions, so that a module importing this one can skip cleanly
(``pytest.importorskip("vllm")``) where vLLM is not installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def follow_blocks(blocks: dict[str, list[int]], out: Any) -> dict[str, int]:
    """Brings ``blocks`` (the block ids vLLM's model runner holds per request) up to date with a
    ``SchedulerOutput``: dropped when finished, set for a new request (or replaced: a
    streaming-input session's next turn comes as a new request with its id, vLLM's
    ``_update_streaming_request``), replaced on a resume, appended otherwise. Returns each
    scheduled request's ``num_computed_tokens``."""
    for rid in out.finished_req_ids:
        blocks.pop(rid, None)
    computed = {}
    for new in out.scheduled_new_reqs:
        blocks[new.req_id] = list(new.block_ids[0])
        computed[new.req_id] = new.num_computed_tokens
    c = out.scheduled_cached_reqs
    for i, rid in enumerate(c.req_ids):
        ids = c.new_block_ids[i]
        if rid in c.resumed_req_ids:
            blocks[rid] = list(ids[0])
        elif ids is not None:
            blocks[rid].extend(ids[0])
        computed[rid] = c.num_computed_tokens[i]
    return computed


def slots_needed(end: int, lookahead: int, position_limit: int) -> int:
    """KV slots a row ending at ``end`` needs: its positions, and a draft model's ``lookahead``
    past them below ``position_limit`` (vLLM's num_lookahead_tokens, capped at max_model_len)."""
    return max(end, min(end + lookahead, position_limit))


class StandInRunner:
    """Keeps per request what vLLM's V1 model runner keeps: block ids appended, or replaced on a
    resume; dropped when finished. ``step(scheduler_output)`` returns the ``ModelRunnerOutput``."""

    def __init__(self, block_size: int, token: int = 7,
                 drafter: Callable[[str], list[int]] | None = None,
                 drafts_on_device: bool = False, lookahead: int = 0,
                 position_limit: int = 1 << 30) -> None:
        self.block_size = block_size
        self.token = token
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, int] = {}  # tokens the runner knows (prompt and outputs)
        self.prompt_len: dict[str, int] = {}
        # Speculative decoding: the "model" always samples `token`, so a row accepts its
        # leading drafts equal to it, then samples one more. After each step, `drafter(rid)`
        # proposes the next drafts of every request that sampled (take_draft_token_ids()).
        self.drafter = drafter
        self.sampled_ids: list[str] = []
        # Async scheduling's drafts (ngram_gpu, EAGLE...): the runner keeps what `drafter`
        # proposed after a request's last sample and verifies those where the scheduler put
        # placeholders (-1); missing ones are never accepted.
        self.drafts_on_device = drafts_on_device
        self.device_drafts: dict[str, list[int]] = {}
        # A draft model writes KV for its proposals past a row's positions: `lookahead` slots
        # more, below `position_limit` (vLLM's num_lookahead_tokens, capped at max_model_len).
        self.lookahead = lookahead
        self.position_limit = position_limit

    def step(self, out: Any, token: int | None = None) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        token = self.token if token is None else token
        computed = follow_blocks(self.blocks, out)
        for rid in out.finished_req_ids:
            self.tokens.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = self.prompt_len[new.req_id] = len(new.prompt_token_ids)
        c = out.scheduled_cached_reqs
        for rid, outputs in zip(c.req_ids, c.num_output_tokens or (), strict=False):
            # Outputs the scheduler dropped (a rewind after a failed KV load) are trimmed, as
            # vLLM's runner trims its request state to num_output_tokens.
            self.tokens[rid] = min(self.tokens[rid], self.prompt_len[rid] + outputs)
        for rid in c.resumed_req_ids:
            if rid in c.all_token_ids:  # a resumed request's tokens are the scheduler's
                self.tokens[rid] = len(c.all_token_ids[rid])
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            end = computed[rid] + n
            blocks = self.blocks[rid]
            assert 0 not in blocks, "the null block was handed out"
            assert len(blocks) * self.block_size >= end, "positions without a block"
            need = slots_needed(end, self.lookahead, self.position_limit)
            assert len(blocks) * self.block_size >= need, "the drafter's lookahead has no block"
            req_ids.append(rid)
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            if self.drafts_on_device and drafts:
                assert all(d == -1 for d in drafts), "async scheduling sends placeholders"
                own = self.device_drafts.get(rid, [])[:len(drafts)]
                drafts = own + [-1] * (len(drafts) - len(own))
            if end - len(drafts) >= self.tokens[rid]:
                accepted = next((i for i, d in enumerate(drafts) if d != token), len(drafts))
                sampled.append([token] * (accepted + 1))
                self.tokens[rid] += accepted + 1
            else:
                sampled.append([])
        self.sampled_ids = [rid for rid, toks in zip(req_ids, sampled, strict=True) if toks]
        if self.drafts_on_device:
            for rid in self.sampled_ids:
                self.device_drafts[rid] = self.drafter(rid)
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)


    def take_draft_token_ids(self) -> Any:
        """The drafts ``drafter`` proposes for the requests the last step sampled (vLLM's
        ``DraftTokenIds``, which its engine hands to ``update_draft_token_ids``)."""
        from vllm.v1.outputs import DraftTokenIds

        assert self.drafter is not None
        return DraftTokenIds(list(self.sampled_ids), [self.drafter(r) for r in self.sampled_ids])


def make_request(rid: str, prompt: list[int] | int, max_tokens: int, *,
                 eos_token_id: int | None = None,
                 block_hasher: Callable[[Any], list[Any]] | None = None,
                 extra_args: dict[str, Any] | None = None, **request_args: Any) -> Any:
    """A vLLM ``Request`` with greedy ``SamplingParams``. ``prompt`` is the token ids, or a
    length n for the ids 1..n. With ``eos_token_id`` the request stops on it, as after vLLM's
    ``update_from_generation_config``; ``block_hasher`` is what vLLM's engine core gives each
    request when prefix caching is on (``get_request_block_hasher``); ``extra_args`` are the
    SamplingParams' (the OpenAI server's ``vllm_xargs``); ``request_args`` go to ``Request``
    (``cache_salt``, ``priority``...)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra_args)
    if eos_token_id is not None:
        sp.update_from_generation_config({}, eos_token_id)
    ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    return Request(request_id=rid, prompt_token_ids=ids, sampling_params=sp,
                   pooling_params=None, block_hasher=block_hasher, **request_args)
