"""The speculative sampling rule as pure functions over numpy arrays (Leviathan et al. 2023, Chen et al. 2023).

Nothing here does I/O or knows about models. `process` turns one row of raw logits into the distribution a
sampler with the user's settings would draw from; the engine runs it for the target (p) and for a draft
model (q) alike, so both sides of the rule see the same temperature, truncation and penalties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Sampler settings, with llama.cpp's defaults and meanings (llama-cli --temp, --top-k, ...)."""

    temperature: float = 0.8
    top_k: int = 40  # 0 = whole vocabulary
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_last_n: int = 64  # window the three penalties look at
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    banned: tuple[int, ...] = ()  # never sampled, e.g. end-of-generation ids for --ignore-eos

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalty(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )

    def check(self) -> None:
        """Raise ValueError naming the first setting that is out of range."""
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"--temp must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"--min-p must be in [0, 1], got {self.min_p}")
        if not np.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise ValueError(f"--repeat-penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise ValueError(f"--repeat-last-n must be >= -1 (-1 = whole context), got {self.repeat_last_n}")
        for name, value in (("--frequency-penalty", self.frequency_penalty), ("--presence-penalty", self.presence_penalty)):
            if not np.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be a non-negative integer, got {self.seed}")


def apply_penalties(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
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


def greedy_token(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> int:
    return int(np.argmax(apply_penalties(logits, params, history)))


def top_k_ids(logits: np.ndarray, k: int, window: float = 12.0) -> np.ndarray:
    """Ids of the k largest logits (any order). A partition of a 262k vocabulary costs milliseconds,
    so first keep only logits within `window` of the max: when at least k survive, the top k are
    exactly among them."""
    near = np.flatnonzero(logits >= logits.max() - window)
    if len(near) >= k:
        return near[np.argpartition(logits[near], len(near) - k)[len(near) - k :]]
    n = logits.shape[0]
    return np.argpartition(logits, n - k)[n - k :]


def process(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """Raw logits -> the probability vector the sampler draws from (float64, len n_vocab, sums to 1).

    Order follows llama.cpp's default chain: penalties, top-k, top-p, min-p, temperature. Work is done on
    the top-k candidate set only, so a 262k vocabulary costs one argpartition, not a full sort.
    """
    logits = apply_penalties(logits, params, history)
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
    order = np.argsort(-z, kind="stable")
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


def one_hot(token: int, n_vocab: int) -> np.ndarray:
    out = np.zeros(n_vocab, dtype=np.float64)
    out[token] = 1.0
    return out


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from probability vector p (only its non-zero entries are touched)."""
    support = np.flatnonzero(p)
    cdf = np.cumsum(p[support])
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(support[min(i, len(support) - 1)])


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """normalize(max(0, p - q)): what the target still owes after the draft's proposal was rejected."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    # total == 0 only if p == q, where a rejection has probability 0; guard against rounding anyway
    return r / total if total > 0 else p


def verify(
    p: Sequence[np.ndarray] | _Lazy,
    q: Sequence[np.ndarray | None],
    drafts: Sequence[int],
    rng: np.random.Generator,
) -> tuple[int, int]:
    """The rule. p has k+1 rows (target at each draft position and one past), q has k rows (None = the
    drafter was deterministic, q = one-hot). Returns (number of drafts accepted, next token): the next
    token is the residual sample at the first rejection, or the bonus token drawn from p[k]."""
    for i, d in enumerate(drafts):
        p_i = p[i]
        q_i = q[i]
        q_d = 1.0 if q_i is None else float(q_i[d])
        # u < p/q accepts with probability min(1, p/q); q_d > 0 because d was drawn from q_i
        if rng.random() * q_d < p_i[d]:
            continue
        if q_i is None:
            q_i = one_hot(d, p_i.shape[0])
        return i, sample(residual(p_i, q_i), rng)
    return len(drafts), sample(p[len(drafts)], rng)


def verify_greedy(target_argmax: Sequence[int] | _Lazy, drafts: Sequence[int]) -> tuple[int, int]:
    """Temperature 0: a draft is accepted iff it is the target's argmax; the correction is the argmax."""
    for i, d in enumerate(drafts):
        best = target_argmax[i]
        if best != d:
            return i, best
    return len(drafts), target_argmax[len(drafts)]


class _Lazy:
    """Row i computed on first access: at a rejection the later positions are never processed."""

    def __init__(self, n: int, make):
        self._rows: list = [None] * n
        self._make = make

    def __getitem__(self, i: int):
        row = self._rows[i]
        if row is None:
            row = self._rows[i] = self._make(i)
        return row

    def __len__(self) -> int:
        return len(self._rows)


def lazy_rows(n: int, make) -> _Lazy:
    return _Lazy(n, make)
