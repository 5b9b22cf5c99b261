"""How many tokens to draft at each step (k = 0 means plain decoding).

Drafting pays only when the tokens it is expected to add outweigh what verifying them costs. On a GPU
at batch 1 verifying 8 tokens costs about as much as 1; on two CPU cores it costs 3-5x, so the same
drafter that doubles speed there loses here. `AdaptivePolicy` (one subclass per kind of drafter) decides from
measurements on this machine:

    expected tokens(n) = 1 + sum_{j<=n} prod_{i<=j} a_i      a_i = P(draft i accepted | drafts < i accepted)
    rate(n)            = expected tokens(n) / (verify_cost(n + 1) + draft_cost(n))

and picks the n with the best rate, n = 0 included. verify_cost comes from timing the target on batches
of the CALIBRATION_SIZES, a few seconds on the first run (up to 8 always, bigger within a budget; cached
per model file and thread count), rescaled online by what steps really take, and only those batch sizes
are sent (--reproducible: fixed reference costs instead, nothing timed or learned from the clock);
a_i are running estimates: for a draft model, one per draft position; for prompt lookup, one per
length of the match the token continues (a_i = A(m + i) for an m-token match: see LookupAcceptance),
so a 24-token match predicts a long accepted run and a 1-token match almost none. A draft model's are
saved per (target file, drafter) in the cache dir when a run ends and read back, discounted, by the next
process (`AcceptanceStore`); lookup's belong to one conversation (see AdaptivePolicy.CARRIED). The hybrid
drafter asks `choose` each step whether lookup's match, the draft model or neither has the best expected
rate.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from .costs import CostModel, cached_cost_model, cost_cache_key, reference_cost_model, write_atomic
from .drafters import Draft
from .paths import cache_dir
from .stats import StepStats

MAX_POSITION = 8  # draft positions >= this share one acceptance estimate
# Draft only when the predicted rate beats plain decoding by this much: the acceptance estimates come
# from a handful of observations, and on a CPU a wrong guess costs several tokens' worth of time.
DRAFT_MARGIN = 1.04
# Prompt lookup's first token is a coin toss with bimodal odds (a span starts, or a common phrase
# repeats by chance), so its estimates are rougher: a lookup draft must promise more. Replaying the
# report's prompts on their target-only replies, sends predicted to gain 4-10% lost time on
# smollm2-135m (0.97x in the worst category, 1.00x at 1.1), and gemma-3-270m was no slower at 1.1.
LOOKUP_MARGIN = 1.1
# What a draft from earlier replies (another conversation) may send until it has earned more: each one
# accepted whole doubles it, a miss brings it back. Their estimates come from other prompts, and a
# 55-token draft of an unrelated reply once made a run slower than plain decoding.
HISTORY_FIRST = 4
# What a short fresh match in this conversation (the first lookup token after a miss, shorter than
# FRESH_TRUSTED, its continuation not yet seen to repeat) may send: a 3-token match is a coin toss, and a
# wrong 24-token draft costs seven steps of plain decoding on two CPU cores. A fresh draft taken whole
# puts the next one inside the copied span, where the estimates decide alone. A 12-token match is what
# llama.cpp's ngram-simple drafts 48 tokens on.
FRESH_FIRST = 7
FRESH_TRUSTED = 12
# Until this reply has copied (a lookup token came true that continued a match of at least this many
# tokens), a match shorter than this drafts nothing from the conversation: its proposal is still checked
# against what the target emits, for free, and a hit grows the match past the bar. A reply that copies
# nothing has only chance matches, and a short one ends before its own misses outweigh the priors: where a
# batch of 2-4 costs little more than one token (2 AVX-512 cores), maths-4's 8-token reply sent 9 draft
# tokens of 1-3-token matches, 1 accepted: 0.89x of target-only (with the bar: 5, 0.98-0.99x in two full
# runs). A reply that copies loses a step.
# Replayed at that machine's costs (benchmarks/lookup_replay.py), against llama.cpp's n-gram drafters: the
# 40 evaluation prompts 1.32x either way, worst 0.94x -> 1.01x (maths-4; of target-only 0.96x -> 1.04x);
# the 16 learning prompts 1.27x either way (learned 1.28x -> 1.27x). A bar of 3 or more cost 1-4% overall
# and put one prompt at 0.92x with learned state.
UNCOPIED_MIN = 2
# Inside a copied span whose match is at least SPAN_LONG tokens, a draft the estimates chose to send may
# run to SPAN_FACTOR times the match length, at the batch size that costs least per token (SuffixDecoding,
# Oliaro et al. 2024, sizes drafts by the match length the same way). A long copy tends to go on, and its
# per-position estimates, multiplied over 40 positions, undersell that: a 13-token match drafted 23, then
# 39, then 47 where the copy ran 150 tokens. Replayed on target-only replies at one calibration's costs
# (benchmarks/lookup_replay.py), against llama.cpp's n-gram drafters: 1.02x -> 1.05x on the 16 learning
# prompts, 1.09x -> 1.13x on the 40 evaluation ones.
SPAN_LONG = 8
SPAN_FACTOR = 4
# ... and to at most this many tokens (llama.cpp's ngram-simple drafts 48): past it a batch costs hardly less
# per token (gemma-3-270m: 2.8 ms at 48, 2.7 at 64) while a copy that ends early wastes more. Replayed
# with 63, the geometric means were the same and the worst prompt slower (0.95x against 0.96x of llama.cpp
# on the 40 evaluation prompts, 0.98x against 1.00x on the 16 learning ones).
SPAN_MAX = 47
DRAFT_MAX = 64  # --draft-max's default: the policy decides below it; long lookup matches use it


@runtime_checkable
class Policy(Protocol):
    def plan(self, limit: int) -> int:
        """Most tokens the drafter should propose now (0 = do not call it), at most `limit`."""

    def trim(self, draft: Draft) -> int:
        """How many of the draft's tokens to send to the target."""

    def observe(self, step: StepStats, proposed: Sequence[int], emitted: Sequence[int]) -> None:
        """The step's outcome: what the drafter proposed (before trimming) and the tokens emitted."""

    def finish(self) -> None:
        """A generation ended: keep what was learned (the adaptive policy saves its estimates)."""

    @property
    def drafting_possible(self) -> bool:
        """False when no draft could pay here: the engine then does not even prefill the drafter."""


class FixedPolicy:
    """Always the same k: --draft-fixed, and --no-spec (k = 0)."""

    drafting_possible = True

    def __init__(self, k: int):
        self.k = k

    def plan(self, limit: int) -> int:
        return max(0, min(self.k, limit))

    def trim(self, draft: Draft) -> int:
        return len(draft.tokens)

    def observe(self, step: StepStats, proposed: Sequence[int], emitted: Sequence[int]) -> None:
        pass

    def finish(self) -> None:
        pass


# -- acceptance --------------------------------------------------------------------------------------


@dataclass
class Acceptance:
    """Running estimates of a_i (conditional acceptance at draft position i) for one kind of proposal,
    as decayed Beta counts so they follow the conversation."""

    prior_hits: float
    prior_tries: float
    decay: float = 0.98
    hits: np.ndarray = field(default_factory=lambda: np.zeros(MAX_POSITION))
    tries: np.ndarray = field(default_factory=lambda: np.zeros(MAX_POSITION))

    def rates(self, n: int) -> np.ndarray:
        per_position = (self.hits + self.prior_hits) / (self.tries + self.prior_tries)
        # A position never reached yet borrows the estimate of the one before it: along a copied span
        # acceptance stays about flat, and falling back to the prior would cap drafts at what has been seen.
        seen = self.tries >= 0.5
        for i in range(1, MAX_POSITION):
            if not seen[i] and seen[:i].any():
                per_position[i] = per_position[i - 1]
        return per_position[np.minimum(np.arange(n), MAX_POSITION - 1)]

    def record(self, accepted: int, tried: int) -> None:
        """Positions 0..tried-1 were checked; the first `accepted` of them were kept."""
        if tried <= 0:
            return
        self.hits *= self.decay
        self.tries *= self.decay
        for i in range(tried):
            j = min(i, MAX_POSITION - 1)
            self.tries[j] += 1
            if i < accepted:
                self.hits[j] += 1

    def as_dict(self) -> dict:
        return {"hits": [round(float(x), 4) for x in self.hits], "tries": [round(float(x), 4) for x in self.tries]}

    def absorb(self, saved: dict, trust: float) -> bool:
        """Start from counts an earlier process saved, discounted so that at most `trust` observations
        per position carry over: a fresh run begins where the last one left off, and its own evidence
        overrides the old within a few steps. False (and nothing changed) for anything malformed."""
        try:
            hits = np.asarray(saved["hits"], dtype=np.float64)
            tries = np.asarray(saved["tries"], dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            return False
        if hits.shape != (MAX_POSITION,) or tries.shape != (MAX_POSITION,):
            return False
        if not (np.isfinite(hits).all() and np.isfinite(tries).all()) or (hits < 0).any() or (hits > tries + 1e-6).any():
            return False
        scale = np.where(tries > trust, trust / np.maximum(tries, 1e-12), 1.0)
        self.hits = hits * scale
        self.tries = tries * scale
        return True


def best_length(
    a: Sequence[float], verify_cost: CostModel, draft_cost_per_token: float = 0.0, overhead: float = 0.0,
    margin: float = DRAFT_MARGIN, rollback: float = 0.0,
) -> tuple[int, float]:
    """argmax over n of expected tokens(n) / (verify(n+1) + n * draft cost + per-step overhead), over the
    n whose batch n + 1 the cost model may send: (n, tokens per second). Within 1% of the best, the
    shortest draft wins: the same speed for less work.

    It runs every step between two decodes, when the CPU caches hold model weights and each numpy call
    costs several microseconds whatever its size: for the at most 64 positions a Python loop is cheaper
    (the same sums, in the same order, as 1 + cumsum(cumprod(a))).

    `rollback`: what a step that drafts anything costs on top (a recurrent target's checkpoint: the copy,
    and on a rejection the restore and the kept tokens evaluated again), as observed."""
    a = a.tolist() if isinstance(a, np.ndarray) else list(a)
    n_max = len(a)
    table, sendable = verify_cost.seconds_list(n_max + 1), verify_cost.sendable_list(n_max + 1)
    rates = [0.0] * (n_max + 1)
    accepted = 0.0  # expected accepted drafts among the first n
    run = 1.0  # P(drafts 0..n-1 all accepted)
    for n in range(n_max + 1):
        if n:
            run *= a[n - 1]
            accepted += run
        if sendable[n + 1]:
            rates[n] = (1.0 + accepted) / (table[n + 1] + n * draft_cost_per_token + overhead + (rollback if n else 0.0))
    if max(rates[1:], default=0.0) < rates[0] * margin:
        return 0, rates[0]  # a predicted gain this small is inside the estimates' error
    threshold = max(rates) / 1.01
    best = next(n for n, rate in enumerate(rates) if rate >= threshold)
    return best, rates[best]


# matched n-gram lengths that share an estimate: 1, 2, 3, 4-5, 6-7, 8-11, 12-15, 16-23, 24-31, 32+
LOOKUP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# P(the next copied token is right) per bucket, before any evidence, for each state of LookupAcceptance:
# inside a copied span or at a fresh match, times whether the earlier occurrences of the n-gram went on
# with one token (a single one, or all of at least two: agreed) or with several (contested). Measured on
# target-only replies of gemma-3-270m to the 16 prompts of benchmarks/data/unseen_learning.jsonl (none
# of them in the evaluation set), then rounded down and smoothed across sparse buckets: in a span with a
# single earlier occurrence 0.55 at 2 tokens, 0.80 at 4, 0.94 at 8, 0.99 at 16+; agreed 1.00 (1384 of
# 1384) at 32+; contested 0.31-0.71 from 3 to 8 tokens; a fresh 1-token match 0.42 single, 0.56 agreed,
# 0.20 contested. Being in a copy is strong evidence, and these decide how early in a copy drafting
# starts; a conversation's own counts replace them within a few tokens (DECAY).
LOOKUP_PRIOR = np.array([
    [0.30, 0.55, 0.70, 0.75, 0.85, 0.90, 0.94, 0.96, 0.97, 0.98],  # in span, single
    [0.30, 0.65, 0.75, 0.80, 0.85, 0.92, 0.95, 0.97, 0.98, 0.99],  # in span, agreed
    [0.20, 0.40, 0.40, 0.50, 0.55, 0.65, 0.80, 0.85, 0.90, 0.95],  # in span, contested
    [0.35, 0.55, 0.65, 0.65, 0.70, 0.75, 0.80, 0.85, 0.85, 0.90],  # fresh, single
    [0.45, 0.55, 0.60, 0.65, 0.70, 0.75, 0.80, 0.85, 0.90, 0.93],  # fresh, agreed (a loop, a repeated phrase)
    [0.15, 0.20, 0.30, 0.35, 0.40, 0.50, 0.60, 0.70, 0.75, 0.80],  # fresh, contested
])


def match_bucket(length: int) -> int:
    """The bucket of a matched n-gram length (its smallest member): 1, 2, 3, 4, 6, 8, 12, 16, 24 or 32."""
    return LOOKUP_BUCKETS[_bucket(length)]


# bucket index of every length up to the last bucket's (longer lengths share the last), as a list: the
# policy looks up one per draft position every step
_BUCKET_OF = [max(0, sum(b <= m for b in LOOKUP_BUCKETS) - 1) for m in range(LOOKUP_BUCKETS[-1] + 1)]


def _bucket(length: int) -> int:
    return _BUCKET_OF[min(max(length, 0), LOOKUP_BUCKETS[-1])]


class LookupAcceptance:
    """P(the next copied token is right | the match so far is m tokens long), per bucket of m, as
    decayed counts, kept apart for matches in the context and in earlier replies, and by the state of
    the token: whether it follows a correct lookup token (inside a span being copied) or starts a fresh
    match (after a miss, or the first of a run), and whether the earlier occurrences of the n-gram it
    continues went on the same way (`agreement`, see Draft.agree): once (SINGLE), the same way every
    time, at least twice (AGREED: a loop, a repeated phrase), or in several ways (CONTESTED: a branch).

    Draft position i of an m-token match, reached with every draft before it accepted, continues an
    (m + i)-token match inside a span, so a_0 = A(m | state), a_i = A(m + i | in span): every verified or
    shadow-checked token teaches one bucket, and a long match predicts a long accepted run by itself. The
    states keep a spurious short match (a common phrase, right after the reply left the text it was
    copying) from borrowing the record of tokens inside copied spans, let a continuation that has held
    three times in a loop be trusted at once, and hold back at a branch: a 32-token match into a list
    whose items differ is right about the next token far less often than one whose occurrences agree."""

    DECAY = 0.95  # per observation of a bucket: about the last twenty count, so it follows the reply
    PRIOR_WEIGHT = 2.0
    SINGLE, AGREED, CONTESTED = 0, 1, 2  # the agreement of the earlier occurrences
    IN_SPAN, FRESH = 0, 3  # state = IN_SPAN or FRESH, plus the agreement
    # [history][state][bucket]: an earlier reply is weaker evidence than this conversation
    PRIOR = LOOKUP_PRIOR[None, :, :] * np.array([1.0, 0.8])[:, None, None]
    _prior = PRIOR.tolist()

    def __init__(self) -> None:
        shape = (2, len(LOOKUP_PRIOR), len(LOOKUP_BUCKETS))  # [from history][state][bucket]
        self.hits = np.zeros(shape)
        self.tries = np.zeros(shape)
        self.after_miss = True  # the run's first lookup token is a fresh match
        self.copied = False  # whether this reply has copied: a hit continuing a match of UNCOPIED_MIN+ tokens
        # how the earlier occurrences of the current proposal's n-gram went on: it tells about the
        # proposal's first token only, and goes back to SINGLE once that token is checked
        self.agreement = self.SINGLE
        self._table: list = []  # the estimates as nested lists: read every step, see best_length
        self._refresh()

    def _refresh(self) -> None:
        """[history][state][bucket] -> the estimate, from the counts."""
        self._table = ((self.hits + self.PRIOR_WEIGHT * self.PRIOR) / (self.tries + self.PRIOR_WEIGHT)).tolist()

    def fresh(self) -> bool:
        """Whether the next lookup token starts a fresh match that has not repeated (see FRESH_FIRST)."""
        return self.after_miss and self.agreement != self.AGREED

    def _state(self) -> int:
        return (self.FRESH if self.after_miss else self.IN_SPAN) + self.agreement

    def rates(self, match: int, n: int, history: bool = False) -> list[float]:
        if n <= 0:
            return []
        table = self._table[int(history)]
        span = table[self.IN_SPAN]
        return [table[self._state()][_bucket(match)]] + [span[_bucket(match + i)] for i in range(1, n)]

    def add(self, match: int, hit: bool, history: bool = False) -> None:
        """One checked token: the proposal continuing an m-token match was right or wrong."""
        h, s, b = int(history), self._state(), _bucket(match)
        hits = float(self.hits[h, s, b]) * self.DECAY + hit
        tries = float(self.tries[h, s, b]) * self.DECAY + 1.0
        self.hits[h, s, b], self.tries[h, s, b] = hits, tries
        self._table[h][s][b] = (hits + self.PRIOR_WEIGHT * self._prior[h][s][b]) / (tries + self.PRIOR_WEIGHT)
        self.after_miss = not hit
        self.copied = self.copied or (hit and match >= UNCOPIED_MIN)
        self.agreement = self.SINGLE

    def record(self, match: int, accepted: int, tried: int, history: bool = False) -> None:
        """A verified step: drafts 0..accepted-1 were right; draft `accepted` (if tried) was wrong; the
        ones after it were never reached, so they say nothing."""
        for i in range(min(tried, accepted + 1)):
            self.add(match + i, i < accepted, history)


class AcceptanceStore:
    """Acceptance estimates kept across processes: one JSON file in the cache dir, one entry per
    (target file, drafter). Written atomically at the end of each generation; a missing, corrupt or
    foreign file (or entry) is ignored and overwritten, never an error."""

    VERSION = 5
    # observations a saved estimate counts as (per position), however many it had: what other prompts
    # taught is a prior, and two of this run's own misses outweigh it (with 8, a store learned on prompts
    # the reply copied sent 24-token drafts into a reply that copied nothing, one miss after another)
    TRUST = 2.0

    def __init__(self, path: Path, key: str, label: str = ""):
        self.path = path
        self.key = key
        self.label = label

    def _read(self) -> dict:
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return {}
        if not isinstance(doc, dict) or doc.get("version") != self.VERSION or not isinstance(doc.get("entries"), dict):
            return {}
        return doc["entries"]

    def load(self) -> dict[str, dict]:
        entry = self._read().get(self.key)
        tables = entry.get("tables") if isinstance(entry, dict) else None
        return tables if isinstance(tables, dict) else {}

    def save(self, tables: dict[str, dict]) -> None:
        entries = self._read()
        entries[self.key] = {"label": self.label, "updated": time.time(), "tables": tables}
        if len(entries) > 64:  # forget the pairs not used for the longest time
            for old in sorted(entries, key=lambda k: entries[k].get("updated", 0) if isinstance(entries[k], dict) else 0)[:-64]:
                del entries[old]
        write_atomic(self.path, json.dumps({"version": self.VERSION, "entries": entries}))


class AdaptivePolicy:
    """The default: picks k per step to maximise expected tokens per second (see module doc). This base
    holds what every drafter kind shares: the target's cost model, the draft limit, the per-step overhead
    and the estimates kept across runs. One subclass per kind of drafter holds its own acceptance model:

    - DraftModelPolicy: choose k before the model drafts, from its per-position acceptance and its cost.
    - LookupPolicy: the proposal is free, so propose first and trim with what the match looks like.
    - HybridPolicy: lookup runs first; `choose` compares its best rate with the model's and with k = 0."""

    kind = ""
    # The estimates the next process starts from (AcceptanceStore). A draft model's acceptance is a trait
    # of the pair, so it carries over. Lookup's is a trait of the conversation (does this reply copy its
    # prompt?) and its priors were measured: replayed on 40 unseen prompts with the state 16 others left
    # (benchmarks/lookup_replay.py), carrying it over at any weight was slower than starting empty (1.16x
    # of llama.cpp at 2 observations a bucket, 1.17x at 0.5, 1.18x empty; one prompt 0.95x -> 0.86x).
    CARRIED = ("model",)

    def __init__(self, verify_cost: CostModel, *, draft_max: int, draft_cost: CostModel | None = None,
                 store: AcceptanceStore | None = None, learn_costs: bool = True):
        self.verify_cost = verify_cost
        self.draft_cost = draft_cost
        self.draft_max = draft_max
        # False (--reproducible): the costs stay as given, nothing is learned from the clock, so the
        # draft lengths depend only on the tokens
        self.learn_costs = learn_costs
        # this generation's steps: all, those that drafted, those where lookup had a match
        self._steps = self._sent = self._matched = 0
        self.last_note: str | None = None  # why the last generation drafted nothing (see decline_note)
        # Seconds per step spent outside drafting and verifying (bookkeeping, the consumer drawing
        # tokens). Paid once per step whatever k is, so it favours longer drafts.
        self.overhead = 0.0
        # Seconds a drafting step spends on the target's recurrent-state checkpoints (0 for a KV cache)
        self.rollback = 0.0
        self._last_observed: float | None = None
        # The largest batch evaluated so far. A batch larger than any before it grows llama.cpp's output
        # and compute buffers, and the first touch of that memory is paid inside the decode: gemma-3-270m's
        # first 64-token batch of a process took 311 ms, the next ones 170 ms (16 tokens: 99 ms, then 57).
        # Learnt from, that one-off made every later batch look 16% dearer, and the next drafts shorter.
        self._largest_batch = 1
        self._setup()
        self.drafting_possible = self._drafting_possible()
        self.store = store
        carried = {name: e for name, e in self._estimates().items() if name in self.CARRIED}
        if store is not None and carried:  # start from the estimates an earlier process saved
            saved = store.load()  # (lookup alone carries nothing over: the file is not even read)
            for name, estimate in carried.items():
                if name in saved:
                    estimate.absorb(saved[name], AcceptanceStore.TRUST)

    # --- what each kind adds

    def _setup(self) -> None:
        """Create this kind's estimates (each subclass adds its own, then calls super)."""

    def _drafting_possible(self) -> bool:
        return True

    def _estimates(self) -> dict[str, Acceptance | LookupAcceptance]:
        """This kind's acceptance estimates, by the name they are saved under."""
        return {}

    def tables(self) -> dict[str, dict]:
        """The estimates worth keeping for the next process."""
        return {name: e.as_dict() for name, e in self._estimates().items()
                if name in self.CARRIED and e.tries.sum() > 0}

    # --- memory across runs

    def finish(self) -> None:
        self.last_note = self.decline_note()
        self._steps = self._sent = self._matched = 0
        tables = self.tables()
        if self.store is not None and tables:  # lookup alone keeps nothing (CARRIED): no file written
            self.store.save(tables)
        self.verify_cost.save(self.draft_cost)  # the steps' timings, for the next process (nothing if not learned)

    def _count(self, step: StepStats, proposed: Sequence[int]) -> None:
        self._steps += 1
        self._sent += step.drafted > 0
        self._matched += bool(proposed)

    def _steps_cost(self, n: int) -> float:
        """What a batch of n tokens costs here, in one-token steps."""
        one = self.verify_cost(1)
        return self.verify_cost(n) / one if one > 0 else float("nan")

    def decline_note(self) -> str | None:
        """Why this generation sent no draft, in a few words, from the costs measured here (None when it
        drafted, or ran no step)."""
        if self._steps == 0 or self._sent > 0:
            return None
        return self._why_not()

    def _why_not(self) -> str:
        return f"draft off: a 4-token verify costs {self._steps_cost(4):.1f} steps here"

    # --- learning the costs

    def _observe_overhead(self, step: StepStats) -> None:
        now = time.perf_counter()
        if self._last_observed is not None:
            extra = now - self._last_observed - step.verify_seconds - step.draft_seconds
            # a gap longer than a few token times is a pause (the user typing), not overhead
            if 0.0 <= extra < 3 * self.verify_cost(1):
                self.overhead = 0.9 * self.overhead + 0.1 * extra
        self._last_observed = now

    def _observe_costs(self, step: StepStats) -> None:
        if not self.learn_costs:
            return
        self._observe_overhead(step)
        if step.drafted:
            self.rollback = 0.8 * self.rollback + 0.2 * step.rollback_seconds
        n = step.drafted + 1
        if n > self._largest_batch:  # a first touch of grown buffers, not what batches of n cost
            self._largest_batch = n
            return
        self.verify_cost.update(n, step.verify_seconds)


class DraftModelPolicy(AdaptivePolicy):
    """A draft model: k is chosen before it drafts, from one acceptance estimate per draft position and
    what its tokens cost."""

    kind = "draft-model"

    def _setup(self) -> None:
        super()._setup()
        # a draft model gets an optimistic prior so it is tried; its misses then teach the policy
        self.model_acceptance = Acceptance(prior_hits=2.0, prior_tries=3.0)
        # A draft model whose every token costs about as much as a target token cannot pay even if it
        # were always right (a self-pair on a CPU): then it is not even given the prompt.
        self.model_possible = best_length(
            np.ones(max(1, self.draft_max)), self.verify_cost, self.draft_cost(1) if self.draft_cost else 0.0
        )[0] > 0

    def _drafting_possible(self) -> bool:
        return self.model_possible

    def _estimates(self) -> dict[str, Acceptance | LookupAcceptance]:
        return {**super()._estimates(), "model": self.model_acceptance}

    def _model_best(self, limit: int) -> tuple[int, float]:
        if not self.model_possible or limit <= 0:
            return 0, 1.0 / (self.verify_cost(1) + self.overhead)
        per_token = self.draft_cost(1) if self.draft_cost else 0.0
        return best_length(self.model_acceptance.rates(limit), self.verify_cost, per_token, self.overhead,
                           rollback=self.rollback)

    def plan(self, limit: int) -> int:
        limit = min(limit, self.draft_max)
        if limit <= 0:
            return 0
        n, _ = self._model_best(limit)
        return n

    def trim(self, draft: Draft) -> int:
        return len(draft.tokens)

    def _why_not(self) -> str:
        if not self.model_possible:
            per_token = self.draft_cost(1) / self.verify_cost(1) if self.draft_cost else 0.0
            return (f"draft off: a draft token costs {per_token:.2f} steps and a 2-token verify "
                    f"{self._steps_cost(2):.1f} steps here, so no draft can pay")
        a = float(self.model_acceptance.rates(1)[0])
        return (f"draft off: acceptance estimate {a:.0%} is too low for a 4-token verify that costs "
                f"{self._steps_cost(4):.1f} steps here")

    def _learn_model(self, step: StepStats) -> None:
        if self.learn_costs and self.draft_cost is not None and step.drafted > 0:
            self.draft_cost.update(1, step.draft_seconds / step.drafted)
        self.model_acceptance.record(step.accepted, step.drafted)

    def observe(self, step: StepStats, proposed: Sequence[int], emitted: Sequence[int]) -> None:
        self._count(step, proposed)
        self._observe_costs(step)
        self._learn_model(step)


def agreement(draft: Draft) -> int:
    """How the earlier occurrences of lookup's n-gram went on (LookupAcceptance's SINGLE, AGREED or
    CONTESTED): with the proposed token every time, at least twice, is a loop or a repeated phrase;
    with other tokens too, a branch."""
    if draft.seen >= 2 and draft.agree == draft.seen:
        return LookupAcceptance.AGREED
    return LookupAcceptance.CONTESTED if draft.agree < draft.seen else LookupAcceptance.SINGLE


class LookupPolicy(AdaptivePolicy):
    """Prompt lookup: its proposal costs nothing, so look first (plan = the limit) and trim the match to
    what its length predicts (LookupAcceptance). Proposals not sent are checked against what the target
    emits next: free evidence."""

    kind = "prompt-lookup"

    def _setup(self) -> None:
        super()._setup()
        self.lookup = LookupAcceptance()
        self._match: tuple[int, bool] | None = None  # this step's lookup match: (length, from history)
        # proposed tokens not sent to the target, checked against what it emits: free evidence
        self._shadow: list[int] = []
        self._shadow_match: tuple[int, bool] = (0, False)  # match length the shadow's first token continues
        self.history_earned = HISTORY_FIRST
        self._from_history = False  # whether the last proposal looked at came from earlier replies

    def _drafting_possible(self) -> bool:
        return True  # lookup is free: always worth looking

    def _estimates(self) -> dict[str, Acceptance | LookupAcceptance]:
        return {**super()._estimates(), "lookup": self.lookup}

    def _lookup_best(self, match: int, n_tokens: int, history: bool) -> tuple[int, float]:
        if history:  # another conversation's text earns its length in this one (see HISTORY_FIRST)
            n_tokens = min(n_tokens, self.history_earned)
        elif match < UNCOPIED_MIN and not self.lookup.copied:
            return 0, 0.0  # a chance match in a reply that has copied nothing yet (see UNCOPIED_MIN)
        elif match < FRESH_TRUSTED and self.lookup.fresh():
            n_tokens = min(n_tokens, FRESH_FIRST)
        n, rate = best_length(self.lookup.rates(match, n_tokens, history), self.verify_cost, 0.0, self.overhead,
                              LOOKUP_MARGIN, self.rollback)
        if n and not history and not self.lookup.after_miss and match >= SPAN_LONG:
            # a long copy goes on: as far as SPAN_FACTOR x the match, at the cheapest size per token
            longest = min(n_tokens, SPAN_FACTOR * match, SPAN_MAX)
            batch = self.verify_cost.cheapest_batch(n + 1, longest + 1)
            if batch is not None and self.verify_cost(batch) / batch < self.verify_cost(n + 1) / (n + 1):
                n = batch - 1
        return n, rate

    def plan(self, limit: int) -> int:
        return max(0, min(limit, self.draft_max))  # lookup's proposal is free: look first, decide in trim

    def finish(self) -> None:
        self.lookup.copied = False  # the next reply shows for itself whether it copies (see UNCOPIED_MIN)
        super().finish()

    def _why_not(self) -> str:
        if not self._matched:
            return "draft off: prompt lookup found nothing in the text to copy"
        return (f"draft off: the lookup matches were too short to pay for a 4-token verify that costs "
                f"{self._steps_cost(4):.1f} steps here")

    def _look_at(self, draft: Draft) -> bool:
        """Set the estimates' state for this proposal; whether it comes from earlier replies."""
        history = draft.source == "history"
        if draft.tokens and history != self._from_history:
            # a span followed in the other source says nothing about this one: it is a fresh match
            self.lookup.after_miss = True
            self._from_history = history
        self.lookup.agreement = agreement(draft)
        return history

    def trim(self, draft: Draft) -> int:
        if not draft.tokens:
            return 0
        history = self._look_at(draft)
        self._match = (draft.match_len, history)
        n, _ = self._lookup_best(draft.match_len, len(draft.tokens), history)
        return n

    def observe(self, step: StepStats, proposed: Sequence[int], emitted: Sequence[int]) -> None:
        self._count(step, proposed)
        self._observe_costs(step)
        match, self._match = self._match, None
        self._learn_lookup(step, proposed, emitted, match)

    def _learn_lookup(self, step: StepStats, proposed: Sequence[int], emitted: Sequence[int],
                      match: tuple[int, bool] | None) -> None:
        if not proposed or match is None:
            self._check_shadow(emitted)
            return
        length, history = match
        if step.drafted:
            # a real verification supersedes any shadow over the same tokens
            self.lookup.record(length, step.accepted, step.drafted, history)
            if history:  # a draft from earlier replies taken whole doubles what the next may send
                self.history_earned = (min(2 * self.history_earned, self.draft_max) if step.accepted == step.drafted
                                       else max(HISTORY_FIRST, step.accepted))
            self._shadow = []
        else:
            overlap = min(len(proposed), len(self._shadow))
            if self._shadow and list(proposed[:overlap]) == self._shadow[:overlap]:
                # the span being followed, proposed again: keep following the older shadow rather than
                # counting the same tokens twice (its match length has grown with it)
                self._check_shadow(emitted)
                return
        # Tokens proposed but not verified teach the policy for free: compare them with what the target
        # emits next. For a one-hot proposal a match has exactly the acceptance probability.
        tail = list(proposed[step.drafted :])
        if step.accepted == step.drafted and tail:
            self._shadow, self._shadow_match = tail, (length + step.drafted, history)
            self._check_shadow(emitted[step.accepted :])  # the step's own last token checks the tail's first

    def _check_shadow(self, emitted: Sequence[int]) -> None:
        for token in emitted:
            if not self._shadow:
                break
            hit = token == self._shadow[0]
            length, history = self._shadow_match
            self.lookup.add(length, hit, history)
            self._shadow_match = (length + 1, history)
            self._shadow = self._shadow[1:] if hit else []


class HybridPolicy(LookupPolicy, DraftModelPolicy):
    """Prompt lookup first, the draft model otherwise: each step `choose` (the HybridDrafter's) sends
    lookup's match, has the model draft, or drafts nothing, whichever has the best expected rate."""

    kind = "hybrid"

    def _setup(self) -> None:
        super()._setup()
        self._source = "prompt-lookup"  # this step's, set by choose()
        self._lookup_n = 0  # how many of lookup's tokens `choose` decided to send

    def choose(self, found: Draft, limit: int) -> tuple[str, int]:
        """("prompt-lookup", n) to send n of lookup's tokens (`found`, maybe none), ("draft-model", k) to
        have the model draft k, or ("none", 0), whichever has the best expected tokens per second. Lookup
        wins ties: its drafts cost nothing, so a long match beats the model even where the model's tokens
        are cheap."""
        history = self._look_at(found)
        lookup_n, lookup_rate = (0, 0.0) if not found.tokens else self._lookup_best(found.match_len, len(found.tokens), history)
        model_n, model_rate = self._model_best(limit)
        self._match = (found.match_len, history) if found.tokens else None
        if lookup_n > 0 and lookup_rate >= model_rate:
            self._source, self._lookup_n = "prompt-lookup", lookup_n
            return "prompt-lookup", lookup_n
        if model_n > 0:
            self._source = "draft-model"
            return "draft-model", model_n
        self._source = "none"
        return "none", 0

    def trim(self, draft: Draft) -> int:
        if not draft.tokens or self._source == "draft-model":
            return len(draft.tokens)
        return min(len(draft.tokens), self._lookup_n)

    def _why_not(self) -> str:
        return (f"draft off: neither the lookup matches nor the draft model paid for a 4-token verify that "
                f"costs {self._steps_cost(4):.1f} steps here")

    def observe(self, step: StepStats, proposed: Sequence[int], emitted: Sequence[int]) -> None:
        self._count(step, proposed)
        self._observe_costs(step)
        source, self._source = self._source, "none"  # until the next choose()
        match, self._match = self._match, None
        if source == "draft-model":
            self._learn_model(step)
            self._check_shadow(emitted)
            return
        self._learn_lookup(step, proposed, emitted, match)


# the policy for each kind of drafter; any other (a test's scripted drafter) is treated as a model
POLICIES: dict[str, type[AdaptivePolicy]] = {
    "draft-model": DraftModelPolicy, "prompt-lookup": LookupPolicy, "hybrid": HybridPolicy,
    # a head's tokens cost time like a draft model's: learned per drafted token
    "mtp": DraftModelPolicy, "eagle3": DraftModelPolicy,
}


def _file_size(backend) -> int | None:
    try:
        return Path(backend.path).stat().st_size if backend.path else None
    except OSError:
        return None


HEAD_KINDS = ("mtp", "eagle3")  # drafting heads: a draft model's policy, their own cost


def make_policy(loaded, draft_max: int, draft_fixed: int | None, *, remember: bool = True,
                reproducible: bool = False, notify: Callable[[str, float], None] | None = None) -> Policy:
    """The policy a command runs with: none without a drafter, fixed with --draft-fixed, else adaptive,
    starting from the estimates earlier runs saved for this target and drafter (unless remember=False).

    reproducible (--reproducible): adaptive, but its draft lengths depend only on the tokens: fixed
    reference costs instead of timings (nothing measured, nothing learned from the clock) and no
    estimates read from or saved for other runs. `notify(model, seconds)` is called before a
    calibration (the first run on a machine)."""
    if loaded.drafter is None or draft_max == 0 or getattr(loaded, "drafting_off", None):
        return FixedPolicy(0)
    if draft_fixed is not None:
        return FixedPolicy(draft_fixed)
    drafter = loaded.drafter
    draft_cost = None
    if reproducible:
        verify = reference_cost_model()
        if drafter.kind in HEAD_KINDS:  # one or a few layers on the target's weights
            draft_cost = CostModel([1], [verify(1) * 0.1], measured=True)
        elif drafter.kind in ("draft-model", "hybrid"):
            # a draft token's cost relative to a target token: the ratio of the model files' sizes
            sizes = _file_size(drafter.backend), _file_size(loaded.target)
            ratio = min(1.0, max(0.02, sizes[0] / sizes[1])) if all(sizes) else 0.25
            draft_cost = CostModel([1], [verify(1) * ratio], measured=True)
        policy = POLICIES.get(drafter.kind, DraftModelPolicy)(verify, draft_max=draft_max, draft_cost=draft_cost,
                                                              learn_costs=False)
    else:
        cache_file = cache_dir() / "costs.json"
        verify = cached_cost_model(loaded.target, cache_file, notify)
        drafter_id = drafter.kind
        if drafter.kind in ("draft-model", "hybrid", *HEAD_KINDS):
            draft_cost = cached_cost_model(drafter.backend, cache_file, notify)
            drafter_id += ":" + cost_cache_key(drafter.backend)
        store = None
        if remember:
            label = f"{loaded.target.name} + {loaded.drafter_label}"
            store = AcceptanceStore(cache_dir() / "acceptance.json", f"{cost_cache_key(loaded.target)}|{drafter_id}", label)
        policy = POLICIES.get(drafter.kind, DraftModelPolicy)(verify, draft_max=draft_max, draft_cost=draft_cost,
                                                              store=store)
    if drafter.kind == "hybrid":
        drafter.use_policy(policy)
    return policy
