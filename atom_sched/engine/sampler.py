"""Token sampling: greedy (argmax), or temperature / top-k / top-p with a per-request seed.

A seeded draw depends only on (request seed, position of the token being sampled), never on the
batch it happens in, so a request samples the same tokens whatever else runs beside it, after a
preemption, one step ahead or not, and with or without speculative decoding (speculative decoding
with a deterministic drafter needs no other correction: the target token at each position is
sampled from the target distribution and a draft is accepted when it equals it).
"""

from __future__ import annotations

import numpy as np
import torch

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, token position) (splitmix64 finalizer)."""
    z = (seed * _MIX + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                  ) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering of one row of logits."""
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        cum = probs.cumsum(-1)
        drop = (cum - probs) > top_p  # keep the smallest prefix whose mass reaches top_p
        drop[0] = False
        x = x.clone()
        x[order[drop]] = float("-inf")
    return x


class Sampler:
    def __call__(self, logits: torch.Tensor, positions: np.ndarray, temperatures: np.ndarray,
                 top_ks: np.ndarray, top_ps: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """``logits`` ``[rows * n, V]`` (row-major, ``n`` logits per row); ``positions``
        ``[rows, n]`` = the input position each logits row was computed at (the sampled token
        goes to position + 1). Per-row ``temperatures``, ``top_ks``, ``top_ps``, ``seeds``.
        Returns the sampled tokens ``[rows, n]`` (int64)."""
        rows, n = positions.shape
        out = logits.argmax(-1).view(rows, n).numpy().astype(np.int64)
        hot = np.nonzero(temperatures > 0)[0]
        if hot.size == 0:
            return out
        gen = torch.Generator(device=logits.device)
        for r in hot:
            t, k, p, seed = float(temperatures[r]), int(top_ks[r]), float(top_ps[r]), int(seeds[r])
            for j in range(n):
                x = filter_logits(logits[r * n + j], t, k, p)
                gen.manual_seed(position_seed(seed, int(positions[r, j]) + 1))
                out[r, j] = int(torch.multinomial(x.softmax(-1), 1, generator=gen))
        return out
