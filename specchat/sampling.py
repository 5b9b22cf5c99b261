"""The speculative sampling rule as pure functions over numpy arrays (Leviathan et al. 2023, Chen et al. 2023).

Nothing here does I/O or knows about models. Three parts, in this order:
- `Dist`, a processed distribution held on its support;
- the rule: `verify` (with `residual` and `sample`), one screen;
- the sampler chain, written once: penalties and bans -> top-k -> top-p -> min-p -> temperature, in
  llama.cpp's default order. `process` runs it on one row of raw logits; the engine runs it for the target
  (p) and for a draft model (q) alike, so both sides of the rule see the same temperature, truncation and
  penalties. `process_rows` (a verify batch's rows) and `draft_step` (a draft model's row) run the same
  chain, handing it the rows' top candidates they have found already.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

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
    def banned_ids(self) -> np.ndarray:
        return _banned(self.banned)[0]

    @property
    def banned_set(self) -> frozenset[int]:
        return _banned(self.banned)[1]

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


class Dist:
    """A processed distribution, held on its support.

    After top-k / top-p / min-p a distribution is a few dozen tokens, so it is kept as (ids, probs) and
    every step of the rule costs O(support), not O(vocabulary): a float64 vector over a 152k vocabulary
    is 1.2 MB to allocate, fill and scan, per draft position and per verified position. `ids is None`
    means the whole vocabulary (a sampler that truncates nothing): `probs` is then indexed by token id.
    `np.asarray(dist)` is the dense vector, for tests and for callers that want one.
    """

    __slots__ = ("_ids", "_probs", "n_vocab", "_lists")

    def __init__(self, ids: np.ndarray | None, probs: np.ndarray, n_vocab: int, lists=None):
        self._ids = ids
        self._probs = probs
        self.n_vocab = n_vocab
        self._lists = lists  # (ids, probs) as Python lists, when the support is small

    @classmethod
    def of_lists(cls, ids: list[int], probs: list[float], n_vocab: int) -> Dist:
        """A small support held as lists; the arrays are made only if something asks for them (the
        per-token path never does: see `lists`)."""
        return cls(None, None, n_vocab, (ids, probs))

    @property
    def ids(self) -> np.ndarray | None:
        if self._probs is None:
            self._arrays()
        return self._ids

    @property
    def probs(self) -> np.ndarray:
        if self._probs is None:
            self._arrays()
        return self._probs

    def _arrays(self) -> None:
        ids, probs = self._lists
        self._ids, self._probs = np.array(ids, dtype=np.int64), np.array(probs, dtype=np.float64)

    def lists(self) -> tuple[list[int], list[float]]:
        """The support as Python lists. Right after a decode the CPU caches hold model weights, and the
        first call of each numpy function is slower than a Python loop over a few dozen floats."""
        if self._lists is None:
            ids = range(self.n_vocab) if self._ids is None else self._ids.tolist()
            self._lists = (ids, self._probs.tolist())
        return self._lists

    def small(self) -> bool:
        """Held on a support of at most SMALL tokens (sampled and combined with Python lists)."""
        if self._lists is not None:
            return len(self._lists[0]) <= SMALL
        return self._ids is not None and len(self._ids) <= SMALL

    @classmethod
    def single(cls, token: int, n_vocab: int) -> Dist:
        return cls(np.array([token], dtype=np.int64), np.ones(1), n_vocab)

    @classmethod
    def of(cls, x: Dist | np.ndarray) -> Dist:
        """A Dist as it is; a dense probability vector as a Dist over its non-zero entries."""
        if isinstance(x, Dist):
            return x
        x = np.asarray(x, dtype=np.float64)
        ids = np.flatnonzero(x)
        return cls(ids, x[ids], x.shape[0])

    def prob(self, token: int) -> float:
        if self._ids is None and self._probs is not None:  # the whole vocabulary, by id
            return float(self._probs[token])
        if self._lists is not None:
            ids, probs = self._lists
            return probs[ids.index(token)] if token in ids else 0.0
        hit = np.flatnonzero(self._ids == token)
        return float(self._probs[hit[0]]) if len(hit) else 0.0

    def probs_at(self, tokens: np.ndarray) -> np.ndarray:
        """P(t) for each t in `tokens` (0 off the support)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if self.ids is None:
            return self.probs[tokens]
        order = np.argsort(self.ids)
        sorted_ids = self.ids[order]
        pos = np.minimum(np.searchsorted(sorted_ids, tokens), len(sorted_ids) - 1)
        return np.where(sorted_ids[pos] == tokens, self.probs[order][pos], 0.0)

    def __getitem__(self, token):
        if isinstance(token, (int, np.integer)):
            return self.prob(int(token))
        return self.probs_at(np.asarray(token))

    def max(self) -> float:
        return float(self.probs.max())

    def dense(self) -> np.ndarray:
        if self.ids is None:
            return np.array(self.probs, dtype=np.float64)
        out = np.zeros(self.n_vocab, dtype=np.float64)
        out[self.ids] = self.probs
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.dense()
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        size = self.n_vocab if self.ids is None else len(self.ids)
        return f"Dist({size} of {self.n_vocab} tokens, top {self.max():.3g})"


# -- the rule ----------------------------------------------------------------------------------------------


def verify(
    p: Sequence[Dist | np.ndarray] | _Lazy,
    q: Sequence[Dist | np.ndarray | None],
    drafts: Sequence[int],
    rng: np.random.Generator,
) -> tuple[int, int]:
    """The rule. p has k+1 rows (target at each draft position and one past), q has k rows (None = the
    drafter was deterministic, q = one-hot). Returns (number of drafts accepted, next token): the next
    token is the residual sample at the first rejection, or the bonus token drawn from p[k]."""
    for i, d in enumerate(drafts):
        p_i = Dist.of(p[i])
        q_i = q[i]
        q_d = 1.0 if q_i is None else Dist.of(q_i).prob(d)
        # u < p/q accepts with probability min(1, p/q); q_d > 0 because d was drawn from q_i
        if rng.random() * q_d < p_i.prob(d):
            continue
        if q_i is None:
            q_i = one_hot(d, p_i.n_vocab)
        return i, sample(residual(p_i, q_i), rng)
    return len(drafts), sample(p[len(drafts)], rng)


def verify_greedy(target_argmax: Sequence[int] | _Lazy, drafts: Sequence[int]) -> tuple[int, int]:
    """Temperature 0: a draft is accepted iff it is the target's argmax; the correction is the argmax."""
    for i, d in enumerate(drafts):
        best = target_argmax[i]
        if best != d:
            return i, best
    return len(drafts), target_argmax[len(drafts)]


def residual(p: Dist | np.ndarray, q: Dist | np.ndarray) -> Dist:
    """normalize(max(0, p - q)): what the target still owes after the draft's proposal was rejected.
    Its support is within p's, so it costs O(support of p)."""
    p, q = Dist.of(p), Dist.of(q)
    if p.small():  # the per-step case: a few dozen candidates, in Python (see Dist.lists)
        ids, probs = p.lists()
        if q.small():
            owed = dict(zip(*q.lists()))
            r = [max(a - owed.get(t, 0.0), 0.0) for t, a in zip(ids, probs)]
        else:
            r = [max(a - q.prob(t), 0.0) for t, a in zip(ids, probs)]
        total = sum(r)
        return Dist.of_lists(ids, [x / total for x in r], p.n_vocab) if total > 0 else p
    if p.ids is None:
        r = p.probs.copy()
        if q.ids is None:
            r -= q.probs
        else:
            r[q.ids] -= q.probs
        r = np.maximum(r, 0.0)
    else:
        r = np.maximum(p.probs - q.probs_at(p.ids), 0.0)
    total = r.sum()
    # total == 0 only if p == q, where a rejection has probability 0; guard against rounding anyway
    return Dist(p.ids, r / total, p.n_vocab) if total > 0 else p


def sample(p: Dist | np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from p (a Dist, or a dense probability vector)."""
    p = Dist.of(p)
    if p.small():
        # the same draw as below (accumulate adds in cumsum's order), without numpy calls
        ids, probs = p.lists()
        cdf = list(accumulate(probs))
        i = bisect.bisect_right(cdf, rng.random() * cdf[-1])
        if i >= len(cdf):
            i = max(j for j, x in enumerate(probs) if x > 0)
        return ids[i]
    cdf = np.cumsum(p.probs)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if i >= len(cdf):  # u * total rounded up to total: the last token with mass
        i = int(np.flatnonzero(p.probs)[-1])
    return i if p.ids is None else int(p.ids[i])


def one_hot(token: int, n_vocab: int) -> Dist:
    return Dist.single(token, n_vocab)


class _Lazy:
    """Row i computed on first access: at a rejection the later positions are never processed. With
    `make_rest`, row 0 is made alone and rows 1.. together, the first time one of them is needed."""

    def __init__(self, n: int, make, make_rest=None):
        self._rows: list = [None] * n
        self._make = make
        self._make_rest = make_rest

    def __getitem__(self, i: int):
        row = self._rows[i]
        if row is None:
            if i > 0 and self._make_rest is not None:
                self._rows[1:] = self._make_rest(1)
                return self._rows[i]
            row = self._rows[i] = self._make(i)
        return row

    def __len__(self) -> int:
        return len(self._rows)


def lazy_rows(n: int, make, make_rest=None) -> _Lazy:
    return _Lazy(n, make, make_rest)


# -- the sampler chain -------------------------------------------------------------------------------------


def process(logits: np.ndarray, params: SamplingParams, history: Sequence[int],
            top: tuple[list[int], list[float]] | None = None) -> Dist:
    """Raw logits -> the distribution the sampler draws from, on its support: the sampler chain. `history`:
    the tokens the penalties see (context + drafts so far). `top`: the row's raw top_k + len(banned) entries
    as top_sorted gives them, where the caller found them already (read only where no penalty applies)."""
    n_vocab = logits.shape[0]
    if params.greedy:
        return Dist.single(greedy_token(logits, params, history), n_vocab)
    ids, z, total = _candidates(logits, params, history, top)
    return _truncate(ids, z, params, n_vocab, total)


def process_rows(rows: np.ndarray, params: SamplingParams, history, start: int = 0) -> list[Dist]:
    """[process(rows[i], params, history(i)) for i >= start], the rows' top candidates found together
    (top_k_rows) where the chain reads them as they are (top-k, no penalty)."""
    n = rows.shape[1]
    if params.greedy or params.has_penalty or not 0 < params.top_k < n or len(rows) - start < 2:
        return [process(rows[i], params, history(i)) for i in range(start, len(rows))]
    tops = top_k_rows(rows[start:], min(n, params.top_k + len(params.banned_set)))
    # a row whose top_k_rows declined (None: a tie at the k-th value) has its candidates found by the chain
    return [process(rows[i], params, (), top) for i, top in enumerate(tops, start)]


def draft_step(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> tuple[int | None, Dist | None, float]:
    """What a draft model needs of one row: (greedy token or None, q or None, draft_confidence). Where no
    penalty or ban applies, the row's raw top candidates are the chain's, and one pass over the row finds
    them and the confidence's both. Greedy returns (token, None, confidence); sampled (None, q, confidence)."""
    n = logits.shape[0]
    top = None
    if not params.has_penalty and not params.banned and n > CONFIDENCE_K:
        k = CONFIDENCE_K if params.greedy else params.top_k
        if CONFIDENCE_K <= k < n:
            top = top_sorted(logits, k)
    confidence = draft_confidence(logits) if top is None else _confidence(top[1])
    if params.greedy:  # top_sorted: the lowest id first among equal maxima, like np.argmax
        return (greedy_token(logits, params, history) if top is None else top[0][0]), None, confidence
    return None, process(logits, params, history, top), confidence


def greedy_token(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> int:
    """argmax of the penalised row (lowest id on a tie, like np.argmax), without copying the row."""
    best = int(np.argmax(logits))
    if not params.has_penalty and best not in params.banned_set:
        return best  # the per-token path of greedy decoding: one pass over the row
    changed = _penalised(logits, params, history)
    if changed is None:
        return best
    touched, values = changed
    if not (touched == best).any() and (values < logits[best]).all():
        return best
    ids, z = _top_candidates(logits, changed, 1)
    return int(ids[z == z.max()].min())


def greedy_rows(rows: np.ndarray, params: SamplingParams, history, start: int = 0) -> list[int]:
    """[greedy_token(rows[i], params, history(i)) for i >= start], one argmax call for all rows when
    no penalty applies."""
    if params.has_penalty or len(rows) - start < 2:
        return [greedy_token(rows[i], params, history(i)) for i in range(start, len(rows))]
    banned = params.banned_set
    best = rows[start:].argmax(axis=1).tolist()
    return [t if t not in banned else greedy_token(rows[start + i], params, ()) for i, t in enumerate(best)]


def draft_confidence(logits: np.ndarray) -> float:
    """How sure a draft model is of its next token, as llama.cpp's --spec-draft-p-min measures it: the
    top token's probability among the 10 best raw logits at temperature 1 (its draft sampler is top-k 10)."""
    z = logits[top_k_ids(logits, min(10, logits.shape[0]))].astype(np.float64)
    return float(1.0 / np.exp(z - z.max()).sum())


CONFIDENCE_K = 10  # draft_confidence's top-k


def _confidence(z_sorted: list[float]) -> float:
    """draft_confidence from raw logits already sorted falling (at least CONFIDENCE_K of them)."""
    top = z_sorted[0]
    return 1.0 / sum(math.exp(v - top) for v in z_sorted[:CONFIDENCE_K])


# the chain's stages: penalties and bans, top-k (the candidates), top-p / min-p / temperature (_truncate)


@lru_cache(maxsize=8)
def _banned(banned: tuple[int, ...]) -> tuple[np.ndarray, frozenset[int]]:
    """The banned ids as a sorted array and as a set, built once per distinct tuple (once per run).

    Not np.unique: without return_counts it asks np.ma whether the array is masked, and the first such call
    of a process imports numpy.ma, inside the first step of a reply."""
    ids = np.array(sorted(set(banned)), dtype=np.int64)
    ids.flags.writeable = False  # shared by every call with the same tuple
    return ids, frozenset(banned)


def _penalised(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int]
) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, new values in logits' dtype) of the entries that penalties and bans change, or None.

    llama.cpp's penalties over the last `repeat_last_n` tokens of `history` (context + drafts so far),
    then banned tokens at -inf. Only these few entries differ from the raw row, so the row (262k floats
    for gemma) is never copied to apply them."""
    ids = np.empty(0, dtype=np.int64)
    values = np.empty(0, dtype=logits.dtype)
    if params.has_penalty and len(history):
        window = history if params.repeat_last_n == -1 else history[-params.repeat_last_n :]
        if len(window) <= SMALL:
            # a window of 64 ids: a dict counts it in microseconds where np.unique sorts and allocates
            # (this runs once per draft position and per verified position)
            counted = Counter(window) if params.frequency_penalty else dict.fromkeys(window, 1)
            for t in params.banned:
                counted.pop(t, None)
            keys = sorted(counted)
            ids = np.array(keys, dtype=np.int64)
            counts = np.array([counted[t] for t in keys], dtype=np.float64) if params.frequency_penalty else 0.0
        else:
            ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
            if params.banned:
                keep = ~np.isin(ids, params.banned_ids)
                ids, counts = ids[keep], counts[keep]
        hit = logits[ids]
        if params.repeat_penalty != 1.0:
            hit = np.where(hit > 0, hit / params.repeat_penalty, hit * params.repeat_penalty)
        values = (hit - counts * params.frequency_penalty - params.presence_penalty).astype(logits.dtype)
    if params.banned:
        banned = params.banned_ids
        ids = np.concatenate([ids, banned])
        values = np.concatenate([values, np.full(len(banned), -np.inf, dtype=logits.dtype)])
    return (ids, values) if len(ids) else None


def penalty_window(tokens: Sequence[int], params: SamplingParams) -> list[int]:
    """The tokens the penalties read at the next position: the last repeat_last_n (a copy to append
    drafts to, whose size does not grow with the context), all of them for -1, none without a penalty."""
    if not params.has_penalty:
        return []
    return list(tokens) if params.repeat_last_n == -1 else list(tokens[-params.repeat_last_n :])


def apply_penalties(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """The whole row with penalties and bans applied (a copy when anything changes)."""
    changed = _penalised(logits, params, history)
    if changed is None:
        return logits
    out = logits.copy()
    out[changed[0]] = changed[1]
    return out


def _candidates(logits: np.ndarray, params: SamplingParams, history: Sequence[int],
                top: tuple[list[int], list[float]] | None = None):
    """Penalties, bans and top-k: (ids, penalised logits) sorted by falling logit then lowest id, holding
    every token the rest of the chain can keep, and the mass top-p and min-p measure against. After top-k:
    Python lists, measured against their own mass (None). Without: the head of the whole vocabulary as
    arrays (_head) and the whole mass; or, where nothing truncates, ids None and the whole row by id."""
    n_vocab = logits.shape[0]
    k = params.top_k
    changed = _penalised(logits, params, history) if params.has_penalty else None
    if 0 < k < n_vocab:
        if changed is None:  # the per-token case: the raw top candidates are the sampler's, bans left out
            ids, z = top if top is not None else top_sorted(logits, min(n_vocab, k + len(params.banned_set)))
            banned = params.banned_set
            if banned:
                kept = [j for j, t in enumerate(ids) if t not in banned]
                ids, z = [ids[j] for j in kept], [z[j] for j in kept]
            if len(ids) >= k:
                return ids[:k], z[:k], None
            changed = _penalised(logits, params, ())  # the bans left too few: banned ids at -inf
        ids, z = _top_candidates(logits, changed, k)
        ids, z = _sorted(ids.tolist(), z.tolist())
        return ids[:k], z[:k], None
    full = logits.astype(np.float64)
    if changed is not None:
        full[changed[0]] = changed[1]
    elif params.banned:
        full[params.banned_ids] = -np.inf
    if params.top_p < 1.0 or params.min_p > 0.0:
        return _head(full, params)
    return None, full, None


def _truncate(ids, z, params: SamplingParams, n_vocab: int, total: float | None) -> Dist:
    """top-p, min-p and temperature over the candidates `_candidates` found. Lists (a top-k's few dozen) are
    worked in plain Python, where each numpy call would cost more than the loop (see Dist.lists); arrays (the
    head of a whole vocabulary) with numpy. Both spell the same arithmetic, in the same order."""
    if ids is None:  # the whole vocabulary, which nothing truncates
        w = np.exp((z - z.max()) / params.temperature)
        return Dist(None, w / w.sum(), n_vocab)
    arrays = isinstance(z, np.ndarray)
    if params.top_p < 1.0 or params.min_p > 0.0:
        keep = _kept(z, params, total, arrays)
        ids, z = ids[:keep], z[:keep]
    scale = 1.0 / params.temperature
    if arrays:
        w = np.exp((z - z[0]) * scale)
        w /= w.sum()
        return Dist(ids, w, n_vocab)
    top, exp = z[0], math.exp
    w = [exp((v - top) * scale) for v in z]
    norm = sum(w)
    return Dist.of_lists(ids, [x / norm for x in w], n_vocab)


def _kept(z, params: SamplingParams, total: float | None, arrays: bool) -> int:
    """How many of the candidates (sorted by falling logit) top-p and min-p keep, their mass at temperature
    1 measured against `total` (None: the candidates' own)."""
    if arrays:
        base = np.exp(z - z[0])
        base /= base.sum() if total is None else total
    else:
        top, exp = z[0], math.exp
        base = [exp(v - top) for v in z]
        norm = sum(base)
        base = [b / norm for b in base]
    keep = len(z)
    if params.top_p < 1.0:  # the smallest prefix whose mass reaches top_p (at least one token)
        mass = np.cumsum(base) if arrays else list(accumulate(base))
        keep = min(keep, bisect.bisect_left(mass, params.top_p) + 1)
    if params.min_p > 0.0:  # the tokens at least min_p times as likely as the first (at least one)
        floor = params.min_p * base[0]
        kept = int(np.count_nonzero(base >= floor)) if arrays else sum(1 for b in base if b >= floor)
        keep = min(keep, max(1, kept))
    return keep


def _head(full: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray, float]:
    """Whole-vocabulary truncation without sorting the whole vocabulary: (ids sorted by falling logit,
    their logits, sum of exp(z - max) over ALL tokens). The ids hold every token top-p / min-p can keep:
    min-p keeps only exp(z - max) >= min_p; top-p keeps a prefix, which lies inside any head already
    holding top_p of the mass."""
    z0 = full.max()
    e = np.exp(full - z0)
    total = float(e.sum())
    ids = None
    if params.min_p > 0.0:
        ids = np.flatnonzero(e >= params.min_p * (1 - 1e-9))  # loose here; the exact test comes after
    else:
        for window in (12.0, 24.0, 48.0):
            near = np.flatnonzero(full >= z0 - window)
            if e[near].sum() >= params.top_p * total * (1 + 1e-9):
                ids = near
                break
    if ids is None:
        ids = np.arange(full.shape[0])
    ids = ids[np.argsort(-full[ids], kind="stable")]
    return ids, full[ids], total


# -- top-k without sorting the vocabulary ------------------------------------------------------------------


SMALL = 256  # supports up to this size are sampled with Python lists (see Dist.lists)
GROUPS = 32  # top_k_ids splits the vocabulary into this many interleaved slices


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits (any order; among equal logits the lowest ids), in about one pass.

    A partition of a 152k-262k vocabulary costs milliseconds. Instead view the row as GROUPS slices
    (row j of logits.reshape(GROUPS, -1)) and take the element-wise maximum across them: one vectorised
    pass giving the max of each column. The k-th largest column max is a lower bound T on the k-th
    largest logit (those k maxima are k distinct logits), so the top k are among the logits >= T, and
    those lie only in columns whose max is >= T: usually about k columns of GROUPS logits each."""
    n = logits.shape[0]
    width = n // GROUPS
    if k >= n:
        return np.arange(n)
    if width < 2 * k:
        bound = np.partition(logits, n - k)[n - k]
        ids = np.flatnonzero(logits >= bound)
        return _best(ids, logits[ids], k)
    column_max = logits[: GROUPS * width].reshape(GROUPS, width).max(axis=0)
    bound = np.partition(column_max, width - k)[width - k]
    columns = np.flatnonzero(column_max >= bound)
    ids = (columns[None, :] + width * np.arange(GROUPS)[:, None]).ravel()
    if GROUPS * width < n:  # the few ids past the last whole slice
        ids = np.concatenate([ids, np.arange(GROUPS * width, n)])
    ids = ids[logits[ids] >= bound]
    return _best(ids, logits[ids], k)


def top_k_lists(logits: np.ndarray, k: int) -> tuple[list[int], list[float]] | None:
    """top_k_rows for one row: the per-token top-k."""
    return top_k_rows(logits[None, :], k)[0] if logits.ndim == 1 else None


def top_sorted(logits: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """The k largest logits as lists, by falling logit then lowest id: top_k_lists, or top_k_ids where
    it declines."""
    top = top_k_lists(logits, k)
    if top is None:
        ids = top_k_ids(logits, k)
        top = _sorted(ids.tolist(), logits[ids].tolist())
    return top


def _best(ids: np.ndarray, z: np.ndarray, k: int) -> np.ndarray:
    """The k best of candidates holding every logit >= the k-th largest: by falling logit, then lowest
    id, so that ties at the boundary always keep the same tokens."""
    if len(ids) <= k:
        return ids
    return ids[np.lexsort((ids, -z))[:k]]


def _top_candidates(logits: np.ndarray, changed: tuple[np.ndarray, np.ndarray],
                    k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, penalised float64 logits) of a set holding the k best penalised logits (maybe more).
    Untouched tokens keep their raw logits, so the best k of them are among the best k + len(touched)
    raw ones; the touched tokens (`changed`, from _penalised) are added with their new values."""
    n = logits.shape[0]
    touched, values = changed
    raw = top_k_ids(logits, min(n, k + len(touched)))
    touched_set = set(touched.tolist())  # a few dozen ids: cheaper than np.isin's sort
    raw = raw[[i not in touched_set for i in raw.tolist()]] if touched_set else raw
    return np.concatenate([raw, touched]), np.concatenate([logits[raw].astype(np.float64), values.astype(np.float64)])


def _sorted(ids: list[int], z: list[float]) -> tuple[list[int], list[float]]:
    """Candidates by falling logit, then lowest id (the order top-p keeps a prefix of)."""
    pairs = sorted(zip([-v for v in z], ids))
    return [t for _, t in pairs], [-v for v, _ in pairs]


@lru_cache(maxsize=32)
def _flat_starts(m: int, n: int, step: int, count: int) -> np.ndarray:
    """(m, count) offsets into an (m, n) array read as one vector: row i's start + step * j."""
    out = n * np.arange(m, dtype=np.intp)[:, None] + step * np.arange(count, dtype=np.intp)[None, :]
    out.flags.writeable = False  # shared by every call with the same shape
    return out


def top_k_rows(rows: np.ndarray, k: int) -> list[tuple[list[int], list[float]] | None]:
    """For each row of an (m, n) array: its k largest entries as lists sorted by falling value (then
    lowest id), exactly top_k_ids' answer in _sorted's order; or None where this cannot be sure of it (a
    tie at the k-th value, a vocabulary that is not a multiple of GROUPS, a short row), and the caller
    uses top_k_ids. One set of numpy calls for all rows: right after a decode the first call of each
    numpy function is slow, whatever its size (see Dist.lists).

    top_k_ids' bound, per row: take the k + 1 columns with the largest maxima; every other column's
    entries are at most the smallest of those maxima, c. The k + 1 largest entries of the chosen columns
    are all >= c (the k + 1 maxima are among them). So if the k-th of them is above the (k+1)-th, it is
    above every entry left out anywhere: these k are exactly the top k, with no tie to break."""
    m, n = rows.shape
    width = n // GROUPS
    c = k + 1
    if n % GROUPS or width < 2 * c:
        return [None] * m
    rows = np.ascontiguousarray(rows)
    column_max = rows.reshape(m, GROUPS, width).max(axis=1)  # (m, width)
    cols = np.argpartition(column_max, width - c, axis=1)[:, width - c :]  # (m, c)
    # (m, GROUPS * c): entry r * c + j of row i is row i's slice r at column cols[i, j]
    flat = rows.reshape(-1)
    block = flat[_flat_starts(m, n, width, GROUPS)[:, :, None] + cols[:, None, :]].reshape(m, GROUPS * c)
    sel = np.argpartition(block, GROUPS * c - c, axis=1)[:, GROUPS * c - c :]  # (m, c) into block
    z = block.reshape(-1)[_flat_starts(m, GROUPS * c, 0, 1) + sel].tolist()
    out: list[tuple[list[int], list[float]] | None] = []
    for values, chosen, where in zip(z, sel.tolist(), cols.tolist()):
        pairs = sorted(zip([-v for v in values], [(i // c) * width + where[i % c] for i in chosen]))
        if pairs[k - 1][0] < pairs[k][0]:  # else the k-th ties with the (k+1)-th: top_k_ids decides
            out.append(([t for _, t in pairs[:k]], [-v for v, _ in pairs[:k]]))
        else:
            out.append(None)
    return out
