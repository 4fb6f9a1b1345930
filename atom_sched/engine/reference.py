"""transformers as the reference: its own greedy ``generate`` on the same weights, and the check
that the engine's greedy tokens equal it.

Float rounding differs between the engine (paged KV, batched, chunked) and transformers (dense
cache, one sequence), so where the two top candidates are (nearly) tied the argmax can flip. A
divergence is accepted only if, at that position, the log-probabilities transformers assigns to
the two tokens are within ``tol`` of each other; the comparison then goes on from the engine's
token (transformers continues greedily from the engine's prefix), so every later token is still
checked. Each accepted divergence is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: Max |logprob(a) - logprob(b)| for two tokens to count as a float-rounding tie.
TIE_TOL = 1e-3


@torch.inference_mode()
def hf_generate(hf: Any, prompt: list[int], max_new_tokens: int, eos_token_id: int,
                min_new_tokens: int = 0) -> list[int]:
    """transformers' greedy ``generate`` for one prompt (no padding); the new tokens only, the
    EOS token included when it stopped there. ``min_new_tokens``: EOS is masked before."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      min_new_tokens=min_new_tokens or None,
                      do_sample=False, temperature=None, top_p=None, top_k=None,
                      eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    return [int(t) for t in out[0, len(prompt):]]


@torch.inference_mode()
def hf_logprobs(hf: Any, context: list[int]) -> torch.Tensor:
    """transformers' next-token log-probabilities after ``context``."""
    logits = hf(torch.tensor([context], dtype=torch.long)).logits[0, -1].float()
    return torch.log_softmax(logits, -1)


@dataclass
class Tie:
    position: int  # index in the generated tokens
    engine_token: int
    reference_token: int
    logprob_gap: float


@dataclass
class CheckResult:
    ok: bool
    ties: list[Tie] = field(default_factory=list)
    detail: str = ""


def check_greedy(hf: Any, prompt: list[int], tokens: list[int], max_new_tokens: int,
                 eos_token_id: int, *, reference: list[int] | None = None,
                 tol: float = TIE_TOL) -> CheckResult:
    """Is ``tokens`` (the engine's greedy output, stop token included, at most
    ``max_new_tokens``) what transformers generates for ``prompt``, up to float-rounding ties?
    ``reference``: transformers' output for ``prompt`` if already computed."""
    ties: list[Tie] = []
    start = 0
    ref = reference if reference is not None else hf_generate(hf, prompt, max_new_tokens,
                                                              eos_token_id)
    while True:
        got = tokens[start:]
        j = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), None)
        if j is None:
            if len(got) == len(ref):
                return CheckResult(True, ties)
            return CheckResult(False, ties, f"length differs after position {start}: engine "
                                            f"{len(tokens)} tokens, reference {start + len(ref)}"
                                            f" (engine {tokens}, reference tail {ref})")
        pos = start + j
        lp = hf_logprobs(hf, prompt + tokens[:pos])
        a, b = got[j], ref[j]
        gap = float(abs(lp[a] - lp[b]))
        if gap > tol:
            return CheckResult(False, ties, f"token {pos}: engine {a} (logprob {float(lp[a]):.5f})"
                                            f" vs transformers {b} (logprob {float(lp[b]):.5f}),"
                                            f" gap {gap:.2e} > {tol:.0e}")
        ties.append(Tie(pos, a, b, gap))
        start = pos + 1
        if start >= len(tokens) or tokens[pos] == eos_token_id:
            return CheckResult(start == len(tokens), ties,
                               "" if start == len(tokens) else "tokens after a tied stop")
        ref = hf_generate(hf, prompt + tokens[:start], max_new_tokens - start, eos_token_id)
