"""The fake model: deterministic outputs keyed by (request id, tokens generated so far).

The token a request generates as its g-th output (g = 0 for the token sampled after its prefill)
is ``token(rid, g)``, a hash of ``(seed, rid, g)`` mapped into ``[10, 10 + vocab)``: never EOS,
never a small "special" id unless a test scripts it through ``overrides``. With K > 0 drafts the
number of accepted tokens of a decode row is ``accepted(rid, g)``, capped at the row's width (K+1,
fewer near the position limit: no draft past it is scheduled, so none can be accepted). Tokens
depend only on the request id and on the number of tokens the request has generated so far, which
the model tracks itself as the device would (``gen``), so a synchronous and a one-step-ahead run
must stream exactly the same tokens (how many per step may differ near the limit, where a row one
step ahead starts from an upper bound and so may be narrower).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # checks.py imports this module (through the oracle)
    from .checks import BatchRecord

MASK64 = (1 << 64) - 1

# The ids the fake model never produces on its own (tests script them through overrides).
EOS = 1


def mix(*xs: int) -> int:
    """A small deterministic 64-bit mixer (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & MASK64)) & MASK64
        h = (h + 0x9E3779B97F4A7C15) & MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK64
        h ^= h >> 31
    return h



def num_valid(drafts: list[int]) -> int:
    """Leading drafts that were proposed (the rest of a row's K are -1)."""
    n = 0
    while n < len(drafts) and drafts[n] >= 0:
        n += 1
    return n


class FakeModel:
    """Deterministic outputs keyed by (request id, tokens generated so far)."""

    def __init__(
        self,
        k: int = 0,
        *,
        seed: int = 0,
        vocab: int = 1000,
        overrides: dict[tuple[int, int], int] | None = None,
        accept: int | Callable[[int, int], int] | None = None,
        logprobs: bool = False,
        two_d: bool = False,
        rejected_fill: int = -1,
        drafts: Callable[[int, int], int] | None = None,
    ) -> None:
        self.k = k
        self.seed = seed
        self.vocab = vocab
        self.overrides = dict(overrides or {})
        self.accept = accept
        self.logprobs = logprobs
        self.two_d = two_d  # K == 0: pass sampled tokens as (n, 1) instead of (n,)
        self.rejected_fill = rejected_fill
        # How many drafts the drafter proposes after g tokens of request rid (0..K; None: K):
        # the rest of the row's K are -1 (variable-length drafts).
        self.num_drafts = drafts
        self.gen: dict[int, int] = defaultdict(int)  # device-side generated count
        self.last_drafts: dict[int, list[int]] = {}
        self.calls = 0

    # -- values ---------------------------------------------------------------------------------
    def token(self, rid: int, g: int) -> int:
        t = self.overrides.get((rid, g))
        if t is not None:
            return t
        return mix(self.seed, rid, g, 1) % self.vocab + 10

    def sequence(self, rid: int, n: int) -> list[int]:
        return [self.token(rid, g) for g in range(n)]

    def accepted(self, rid: int, g: int) -> int:
        if self.k == 0:
            return 1
        if self.accept is None:
            a = mix(self.seed, rid, g, 2) % (self.k + 1) + 1
        elif callable(self.accept):
            a = self.accept(rid, g)
        else:
            a = self.accept
        assert 1 <= a <= self.k + 1
        return a

    def draft(self, rid: int, g: int, j: int) -> int:
        return mix(self.seed, rid, g, j, 3) % self.vocab + 10

    def logprob(self, rid: int, g: int) -> float:
        # Multiples of 1/256 in (-4, 0]: exact in float32.
        return -float(mix(self.seed, rid, g, 4) % 1024) / 256.0

    def reset(self, rid: int) -> None:
        self.gen[rid] = 0
        self.last_drafts.pop(rid, None)

    # -- one forward ----------------------------------------------------------------------------
    def run(self, rec: BatchRecord) -> dict[str, Any]:
        """The update() keyword arguments for the batch `rec` (advances the device-side counts)."""
        self.calls += 1
        k = self.k
        n = rec.num_rows
        w = 1 if k == 0 else k + 1
        sampled = np.full((n, w), self.rejected_fill, dtype=np.int32)
        acc = np.ones(n, dtype=np.int32)
        drafts = np.zeros((n, k), dtype=np.int32)
        lps = np.zeros((n, w), dtype=np.float32)
        rec.accepted = [0] * n
        for i, rid in enumerate(rec.req_ids):
            rid = int(rid)
            if not rec.emits_token[i]:
                sampled[i, :] = 0
                continue
            g = self.gen[rid]
            # A row near the position limit carries fewer than K+1 tokens: at most that many.
            a = (1 if rec.row_is_prefill[i]
                 else min(self.accepted(rid, g), rec.num_scheduled_tokens[i],
                          1 + num_valid(self.last_drafts.get(rid, [0] * k))))
            for j in range(a):
                sampled[i, j] = self.token(rid, g + j)
                lps[i, j] = self.logprob(rid, g + j)
            acc[i] = a
            rec.accepted[i] = a
            self.gen[rid] = g + a
            m = k if self.num_drafts is None else self.num_drafts(rid, g + a)
            d = [self.draft(rid, g + a, j) if j < m else -1 for j in range(k)]
            drafts[i, :] = d
            self.last_drafts[rid] = d
        out: dict[str, Any] = {}
        out["sampled_token_ids"] = sampled if (k > 0 or self.two_d) else sampled[:, 0].copy()
        if k > 0:
            out["draft_token_ids"] = drafts
            if not rec.is_prefill:
                out["num_accepted"] = acc
        if self.logprobs:
            out["logprobs"] = lps if (k > 0 or self.two_d) else lps[:, 0].copy()
        return out
