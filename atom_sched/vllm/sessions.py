"""Streaming-input sessions (vLLM's resumable requests) on the vLLM side of AtomScheduler.

vLLM's ``AsyncLLM.generate`` with an input stream sends each chunk of input as a request with
the session's id and ``resumable=True``, and closes the stream with one that is not resumable.
The core keeps a session's KV between turns (``SamplingParams.resumable``,
``Scheduler.continue_session``); this module keeps what vLLM's side of a session needs: the
inputs that arrive while a turn runs, and the ``Request`` rewritten for the next turn as vLLM's
own scheduler rewrites it.
"""

from __future__ import annotations

from collections import deque

from vllm.v1.request import Request, StreamingUpdate

# A session's queued inputs: the next turns' updates, None for "the stream closed".
SessionInputs = deque[StreamingUpdate | None]


def start_next_turn(request: Request, update: StreamingUpdate, block_size: int) -> None:
    """Rewrites a session's ``Request`` for its next turn, as vLLM's scheduler does: its
    outputs join the prompt but the last it sampled (no step ever computed it), the update's
    tokens follow, and the update's sampling parameters, ``max_tokens`` and arrival time replace
    the old ones (its ``num_computed_tokens``, the KV it kept, stays)."""
    kept = request.num_tokens - 1
    kept_outputs = request._all_token_ids[request.num_prompt_tokens:kept]
    del request._all_token_ids[kept:]
    del request.block_hashes[kept // block_size:]
    request._output_token_ids.clear()
    assert request.prompt_token_ids is not None  # prompt embeddings are refused
    request.prompt_token_ids.extend(kept_outputs)
    new_tokens = list(update.prompt_token_ids or ())
    request._all_token_ids.extend(new_tokens)
    request.prompt_token_ids.extend(new_tokens)
    request.update_block_hashes()  # (no-op without a block hasher)
    request.num_prompt_tokens = len(request.prompt_token_ids)
    request.arrival_time = update.arrival_time
    request.sampling_params = update.sampling_params
    request.max_tokens = update.max_tokens
    request.spec_token_ids = []
