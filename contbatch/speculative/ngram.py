"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's tail."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier match of the last n tokens,
    trying the longest n first: a longer match predicts better. Array operations over the
    sequence (one comparison per window and n), no Python loop over its tokens."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows that end before the last token: each has at least one token after it.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
