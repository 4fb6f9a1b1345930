"""An n-gram (prompt-lookup) drafter: propose the K tokens that followed the most recent earlier
occurrence of the sequence's last n tokens (n from ``max_ngram`` down to ``min_ngram``).

Cheap and model-free; it pays off when the answer repeats the prompt or itself (quoting, lists,
code). It proposes only what it found: fewer than K drafts near the end of the history, none
without a match, the rest -1 (the scheduler's variable-length drafts: the next step verifies,
and reserves KV for, only those).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramDrafter:
    def __init__(self, k: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.k = k
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, history: np.ndarray) -> np.ndarray:
        """Up to ``K`` draft tokens to follow ``history`` (1-D int array, prompt + generated),
        padded with -1 to K."""
        k = self.k
        h = np.asarray(history)
        L = h.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pattern = h[L - n:]
            windows = sliding_window_view(h[: L - 1], n)  # windows ending before the last token
            hits = np.nonzero((windows == pattern).all(axis=1))[0]
            if hits.size == 0:
                continue
            start = int(hits[-1]) + n  # most recent occurrence
            prop = h[start: start + k]
            if prop.size == 0:
                continue
            out = np.full(k, -1, dtype=np.int32)
            out[: prop.size] = prop
            return out
        return np.full(k, -1, dtype=np.int32)
