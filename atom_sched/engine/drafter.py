"""An n-gram (prompt-lookup) drafter: propose the K tokens that followed the most recent earlier
occurrence of the sequence's last n tokens (n from ``max_ngram`` down to ``min_ngram``).

Cheap and model-free; it pays off when the answer repeats the prompt or itself (quoting, lists,
code). With no match it proposes the last token repeated, which is simply rejected.
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
        """``K`` draft tokens to follow ``history`` (1-D int array, prompt + generated)."""
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
            if prop.size < k:
                prop = np.concatenate([prop, np.full(k - prop.size, prop[-1], dtype=h.dtype)])
            return prop.astype(np.int32)
        return np.full(k, h[-1] if L else 0, dtype=np.int32)
