"""The dense sampler specchat used before the sparse path: the reference `sampling.process` must equal.

Kept verbatim (whole-vocabulary float64 vectors, a full copy of the row for penalties) so the tests can
check, configuration by configuration, that the sparse Dist path gives the same distribution to 1e-9.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specchat.sampling import SamplingParams, top_k_ids


def dense_apply_penalties(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """llama.cpp's penalties over the last `repeat_last_n` tokens of `history` (context + drafts so far),
    and banned tokens set to -inf."""
    if params.banned:
        logits = logits.copy()
        logits[list(params.banned)] = -np.inf
    if not params.has_penalty or len(history) == 0:
        return logits
    window = history if params.repeat_last_n == -1 else history[-params.repeat_last_n :]
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    out = logits.copy()
    hit = out[ids]
    if params.repeat_penalty != 1.0:
        hit = np.where(hit > 0, hit / params.repeat_penalty, hit * params.repeat_penalty)
    hit = hit - counts * params.frequency_penalty - params.presence_penalty
    out[ids] = hit
    return out


def dense_process(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """Raw logits -> the probability vector the sampler draws from (float64, len n_vocab, sums to 1).

    Order follows llama.cpp's default chain: penalties, top-k, top-p, min-p, temperature. Work is done on
    the top-k candidate set only, so a 262k vocabulary costs one argpartition, not a full sort.
    """
    logits = dense_apply_penalties(logits, params, history)
    n_vocab = logits.shape[0]
    out = np.zeros(n_vocab, dtype=np.float64)
    if params.greedy:
        out[int(np.argmax(logits))] = 1.0
        return out
    if 0 < params.top_k < n_vocab:
        ids = top_k_ids(logits, params.top_k)
    else:
        ids = np.arange(n_vocab)
    z = logits[ids].astype(np.float64)
    order = np.lexsort((ids, -z))  # falling logit, then lowest id
    ids, z = ids[order], z[order]
    if params.top_p < 1.0 or params.min_p > 0.0:
        base = np.exp(z - z[0])
        base /= base.sum()
        keep = len(z)
        if params.top_p < 1.0:
            # smallest prefix whose mass reaches top_p (at least one token)
            keep = min(keep, int(np.searchsorted(np.cumsum(base), params.top_p, side="left")) + 1)
        if params.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(base >= params.min_p * base[0]))))
        ids, z = ids[:keep], z[:keep]
    w = np.exp((z - z[0]) / params.temperature)
    out[ids] = w / w.sum()
    return out
