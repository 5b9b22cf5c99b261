"""Prompt lookup (Saxena 2023; llama.cpp's n-gram drafters): propose what followed the latest earlier
occurrence of the context's tail, in this conversation or in earlier replies, and know from the match
how far to trust it (its length, whether its earlier occurrences agreed, whether the reply is copying).
Its proposals cost nothing, so it proposes every step and the policy prices what it found."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from . import kinds
from .backend import common_prefix
from .drafters import FREE, Draft, Estimating, Forwards, Offer
from .sampling import SamplingParams

# A lookup draft must promise this much more than plain decoding: its first token's odds are bimodal (a span
# starts, or a phrase repeats by chance), so its estimates are rougher than a model's.
# How it was chosen: docs/benchmarks.md, "Tuning constants".
LOOKUP_MARGIN = 1.1
# What a draft from earlier replies (another conversation) may send until it has earned more: each one
# accepted whole doubles it, a miss brings it back. (docs/benchmarks.md, "Tuning constants")
HISTORY_FIRST = 4
# What a short fresh match in this conversation (shorter than FRESH_TRUSTED, its continuation not yet seen
# to repeat) may send: a short match is a coin toss, and a long wrong draft costs several plain steps.
# How it was chosen: docs/benchmarks.md, "Tuning constants".
FRESH_FIRST = 7
FRESH_TRUSTED = 12

# matched n-gram lengths that share an estimate: 1, 2, 3, 4-5, 6-7, 8-11, 12-15, 16-23, 24-31, 32+
LOOKUP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# P(the next copied token is right) per bucket, before any evidence, for each state of LookupAcceptance
# (inside a copied span or at a fresh match, times the agreement of the n-gram's earlier occurrences):
# measured on development prompts' target-only replies, rounded down and smoothed (docs/benchmarks.md,
# "Tuning constants"); a conversation's own counts replace them within a few tokens (DECAY).
LOOKUP_PRIOR = np.array([
    [0.30, 0.55, 0.70, 0.75, 0.85, 0.90, 0.94, 0.96, 0.97, 0.98],  # in span, single
    [0.30, 0.65, 0.75, 0.80, 0.85, 0.92, 0.95, 0.97, 0.98, 0.99],  # in span, agreed
    [0.20, 0.40, 0.40, 0.50, 0.55, 0.65, 0.80, 0.85, 0.90, 0.95],  # in span, contested
    [0.35, 0.55, 0.65, 0.65, 0.70, 0.75, 0.80, 0.85, 0.85, 0.90],  # fresh, single
    [0.45, 0.55, 0.60, 0.65, 0.70, 0.75, 0.80, 0.85, 0.90, 0.93],  # fresh, agreed (a loop, a repeated phrase)
    [0.15, 0.20, 0.30, 0.35, 0.40, 0.50, 0.60, 0.70, 0.75, 0.80],  # fresh, contested
])


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
        self.agreement = self.SINGLE

    def record(self, match: int, accepted: int, tried: int, history: bool = False) -> None:
        """A verified step: drafts 0..accepted-1 were right; draft `accepted` (if tried) was wrong; the
        ones after it were never reached, so they say nothing."""
        for i in range(min(tried, accepted + 1)):
            self.add(match + i, i < accepted, history)

    def as_dict(self) -> dict:
        return {"hits": self.hits.round(4).tolist(), "tries": self.tries.round(4).tolist()}

    def absorb(self, saved: dict, trust: float) -> bool:
        """Take up counts set aside earlier, each bucket discounted to at most `trust` observations (inf:
        exactly as they were); the next token starts a fresh match (the span followed before is another
        phase's). False (and nothing changed) for anything malformed."""
        try:
            hits = np.asarray(saved["hits"], dtype=np.float64)
            tries = np.asarray(saved["tries"], dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            return False
        if hits.shape != self.hits.shape or tries.shape != self.tries.shape or (hits > tries + 1e-6).any():
            return False
        scale = np.where(tries > trust, trust / np.maximum(tries, 1e-12), 1.0)
        self.hits, self.tries = hits * scale, tries * scale
        self.after_miss, self.agreement = True, self.SINGLE
        self._refresh()
        return True


@dataclass
class Evidence:
    """What a lookup draft was based on: the matched n-gram length (a 24-token match predicts a long
    accepted run, a 1-token one hardly anything), how many of the earlier occurrences compared (`agree`
    of `seen`) went on with the same token as this draft, and whether the match is in earlier replies."""

    match_len: int = 0
    agree: int = 0
    seen: int = 0
    history: bool = False


def agreement(evidence: Evidence) -> int:
    """How the earlier occurrences of lookup's n-gram went on (LookupAcceptance's SINGLE, AGREED or
    CONTESTED): with the proposed token every time, at least twice, is a loop or a repeated phrase;
    with other tokens too, a branch."""
    if evidence.seen >= 2 and evidence.agree == evidence.seen:
        return LookupAcceptance.AGREED
    return LookupAcceptance.CONTESTED if evidence.agree < evidence.seen else LookupAcceptance.SINGLE


SEPARATOR = -1  # between the replies of an n-gram history: matches no token, ends every continuation
ORDER = 4  # n-grams up to this length are indexed; longer matches extend a 4-gram's, token by token
# Where the context has a match, an earlier reply's replaces it only when it is longer by more than this:
# the context's own continuation is the one the reply is copying. (docs/benchmarks.md, "Tuning constants")
HISTORY_LEAD = 4
# ... and only a match of at least this many tokens is followed there at all: a shorter one in another
# conversation's text is a common phrase, not a copy. (docs/benchmarks.md, "Tuning constants")
HISTORY_MIN = 8
CANDIDATES = 16  # the latest occurrences of the tail's n-gram that are compared: a step's cost is bounded


class NgramIndex:
    """Where every n-gram (n = 1..ORDER) of a token stream ends, kept up to date as tokens arrive (and
    are cut), so a lookup costs the same at 32k tokens of context as at 500: the tail's n-gram gives its
    latest occurrence at once, each occurrence the one before it, and only the latest CANDIDATES are
    extended backwards into a full match. This is the context's index; a frozen stream (earlier replies)
    uses FrozenNgramIndex.

    Only ints are stored (an n-gram packed into one int, a chain of earlier positions per order), no
    container per n-gram: the garbage collector walks every live container now and then, and a list per
    n-gram of a 32k-token context made each step ten times slower than at 500 tokens."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.ids: list[int] = []
        self._latest: list[dict[int, int]] = [{} for _ in range(ORDER)]  # packed n-gram -> latest end
        self._before: list[list[int]] = [[] for _ in range(ORDER)]  # end p -> the same n-gram's end before p
        self._followed: Sequence[int] | None = None  # the list follow() last brought the index up to
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, tokens: Sequence[int]) -> None:
        ids, latest, before = self.ids, self._latest, self._before
        for token in tokens:
            token = int(token)
            ids.append(token)
            p = len(ids) - 1
            key = 0
            for n in range(ORDER):
                back = ids[p - n] if p >= n else SEPARATOR
                if back == SEPARATOR:  # no n-gram across a separator or the start: nothing before p
                    for m in range(n, ORDER):
                        before[m].append(-1)
                    break
                key = (key << _BITS) | back
                before[n].append(latest[n].get(key, -1))
                latest[n][key] = p

    def truncate(self, n: int) -> None:
        """Forget the tokens from position n on (a rewritten turn, a regenerated reply)."""
        ids, latest, before = self.ids, self._latest, self._before
        for p in range(len(ids) - 1, n - 1, -1):
            key = 0
            for order in range(ORDER):
                back = ids[p - order] if p >= order else SEPARATOR
                if back == SEPARATOR:
                    break
                key = (key << _BITS) | back
                if before[order][p] < 0:
                    del latest[order][key]
                else:
                    latest[order][key] = before[order][p]
        del ids[n:]
        for chain in before:
            del chain[n:]

    def follow(self, context: Sequence[int]) -> None:
        """Hold exactly `context`: index what it adds to the tokens held, after cutting where it differs.
        The engine's context list only grows inside a generation, so the same list again is trusted up to
        what was held (its last held token checked); any other list (a new turn, a test's) is compared in
        full, once."""
        held = len(self.ids)
        same_list = context is self._followed and len(context) >= held and (not held or context[held - 1] == self.ids[-1])
        if not same_list:
            common = common_prefix(context, self.ids)
            if common < held:
                self.truncate(common)
                held = common
        self.extend(context[held:])
        self._followed = context

    def latest(self, gram: Sequence[int]) -> Iterator[int]:
        """End positions of `gram` (at most ORDER tokens), newest first."""
        key = 0
        for token in reversed(gram):
            key = (key << _BITS) | token
        order = len(gram) - 1
        p = self._latest[order].get(key, -1)
        chain = self._before[order]
        while p >= 0:
            yield p
            p = chain[p]


_BITS = 32  # a token id packed per n-gram position: vocabularies are far below 2**32


class FrozenNgramIndex:
    """The same lookups over a stream that never changes (earlier replies, up to 64k tokens), built in one
    pass of numpy at load rather than a Python loop per token: each n-gram's hash, sorted once, and a
    binary search per lookup. Hash collisions are harmless: every candidate's tokens are compared."""

    _MULT = np.int64(1_000_003)

    def __init__(self, ids: np.ndarray):
        self.ids: list[int] = ids.tolist()
        self._sorted: list[tuple[np.ndarray, np.ndarray]] = []
        arr = ids.astype(np.int64)
        n_ids = len(arr)
        key = np.zeros(n_ids, dtype=np.int64)
        valid = np.ones(n_ids, dtype=bool)
        for n in range(1, ORDER + 1):
            # key[p] of the n-gram ending at p, from the (n-1)-gram's: the token n-1 places back joins it
            back = np.full(n_ids, SEPARATOR, dtype=np.int64)
            back[n - 1 :] = arr[: n_ids - n + 1]
            with np.errstate(over="ignore"):
                key = key * self._MULT + back + 2
            valid &= back != SEPARATOR
            ends = np.flatnonzero(valid)
            order = np.argsort(key[ends], kind="stable")  # equal keys stay oldest first
            self._sorted.append((key[ends][order], ends[order]))

    def __len__(self) -> int:
        return len(self.ids)

    def latest(self, gram: Sequence[int]) -> Iterator[int]:
        """End positions of `gram`, newest first."""
        key = np.int64(0)
        with np.errstate(over="ignore"):
            for token in reversed(gram):  # the same recurrence as __init__: the last token first
                key = key * self._MULT + np.int64(token + 2)
        keys, ends = self._sorted[len(gram) - 1]
        lo, hi = np.searchsorted(keys, key, side="left"), np.searchsorted(keys, key, side="right")
        # a lookup compares at most CANDIDATES of them: a frequent token's thousands are not listed
        return reversed(ends[max(lo, hi - 2 * CANDIDATES) : hi].tolist())


@dataclass
class Match:
    """The longest earlier occurrence of the context's tail found in an index: where it ends, how many
    tokens match (the evidence a policy weighs), and how many of the occurrences compared (`seen`) went
    on with the same next token (`agree`): a continuation that held every time it came up deserves trust."""

    end: int = -1
    length: int = 0
    agree: int = 0
    seen: int = 0


def find_match(index: NgramIndex | FrozenNgramIndex, tail: Sequence[int], before: int, max_len: int) -> Match:
    """The longest match of `tail`'s end among the latest CANDIDATES occurrences of its longest indexed
    n-gram that end before position `before` and have a token after them, latest first among equals."""
    ids = index.ids
    n_tail = len(tail)
    for order in range(min(ORDER, n_tail, max_len), 0, -1):
        gram = [int(t) for t in tail[n_tail - order :]]
        best = Match()
        compared: list[int] = []
        for p in index.latest(gram):
            if p >= before or ids[p + 1] == SEPARATOR:
                continue
            compared.append(p)
            if best.length < max_len:  # else the latest full-length match cannot be beaten: only counted
                length = order
                limit = min(max_len, n_tail, p + 1)
                while length < limit and ids[p - length] == tail[n_tail - 1 - length]:
                    length += 1
                if length > best.length:
                    best = Match(p, length)
            if len(compared) >= CANDIDATES:
                break
        if compared:
            following = ids[best.end + 1]
            best.seen = len(compared)
            best.agree = sum(ids[p + 1] == following for p in compared)
            return best
    return Match()


class NgramHistory:
    """Token streams of this user's earlier replies (chat transcripts, report runs), searched when the
    context has no match as long: llama.cpp's lookup caches (`--lookup-cache-dynamic`), without a
    separate file format. Streams are joined with separators, which no token matches, and only the
    latest `max_tokens` are kept."""

    def __init__(self, streams: Sequence[Sequence[int]], max_tokens: int = 1 << 16):
        parts: list[np.ndarray] = []
        total = 0
        for stream in reversed(streams):
            if total >= max_tokens:
                break
            arr = np.asarray(stream, dtype=np.int64)[-(max_tokens - total):]
            parts.append(np.append(arr, SEPARATOR))
            total += len(arr) + 1
        ids = np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)
        self.index = FrozenNgramIndex(ids)

    @property
    def ids(self) -> list[int]:
        return self.index.ids

    def __len__(self) -> int:
        return len(self.index)

    def find(self, tail: Sequence[int], k: int, max_len: int) -> tuple[list[int], Match]:
        """(continuation of up to k tokens, the match) for the end of `tail`; a continuation ends where
        its reply ended."""
        if len(self.index) < 2 or len(tail) == 0:
            return [], Match()
        match = find_match(self.index, tail, len(self.index) - 1, max_len)
        if match.length == 0:
            return [], match
        ids = self.index.ids
        follow = ids[match.end + 1 : match.end + 1 + k]
        if SEPARATOR in follow:
            follow = follow[: follow.index(SEPARATOR)]
        return follow, match


class PromptLookup(Estimating):
    """Prompt lookup decoding (Saxena 2023; llama.cpp's ngram-simple): find the latest earlier occurrence
    of the longest suffix of the context (up to max_ngram tokens, at least min_ngram) and propose what
    followed it. A match close to the end of the context is a loop, and its continuation runs on around
    the loop (what llama.cpp's ngram-mod drafts a token at a time), not just to the end of the context.
    Earlier replies (`history`) are searched too: used where the context has no match, or one shorter by
    more than HISTORY_LEAD, and only from HISTORY_MIN tokens on. The context is indexed as it grows
    (NgramIndex), so a step costs the same however long the conversation is.

    Its estimate (`offer`) is per length of the match a token continues (a_i = A(m + i) for an m-token
    match: see LookupAcceptance), so a 24-token match predicts a long accepted run and a 1-token match
    almost none. Proposals not sent are checked against what the target emits next: free evidence. The
    estimates belong to one conversation: carried over to other prompts at any weight, they were slower
    than starting empty (docs/decisions.md, "Lookup keeps nothing across processes"), so nothing is
    carried across processes; within a reply, the policy keeps them per phase (a thought, its answer)."""

    kind = kinds.PROMPT_LOOKUP
    backend = None  # nothing to evaluate: proposals cost no model time

    def __init__(self, min_ngram: int = 1, max_ngram: int = 32, draft_min: int = 0,
                 history: NgramHistory | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min n-gram ({min_ngram}) <= max n-gram ({max_ngram})")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.draft_min = draft_min
        self.history = history
        self.index = NgramIndex()
        self.last_match = 0  # n-gram length of the last proposal (0 = none found)
        self.last_from_history = False
        self.last = Match()  # the last lookup's match, with its agreement counts
        self.acceptance = LookupAcceptance()
        self._match: tuple[int, bool] | None = None  # this step's offered match: (length, from history)
        # proposed tokens not sent to the target, checked against what it emits: free evidence
        self._shadow: list[int] = []
        self._shadow_match: tuple[int, bool] = (0, False)  # match length the shadow's first token continues
        self.history_earned = HISTORY_FIRST
        self._from_history = False  # whether the last proposal looked at came from earlier replies

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self.index.follow(prompt_ids)

    def room(self) -> int:
        return 1 << 30

    def find(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """(continuation of up to k tokens, matched n-gram length), longest match first, latest first;
        the context before the history when their matches are as long."""
        self.index.follow(context)
        ids = self.index.ids
        end = len(ids) - 1
        self.last_from_history = False
        tail = ids[max(0, end + 1 - self.max_ngram) :]
        match = find_match(self.index, tail, end, self.max_ngram) if end >= 1 else Match()
        tokens: list[int] = []
        if match.length:
            # x[end + 1 + i] = x[match.end + 1 + i]: past the end of the context that is a token proposed
            # here, so the continuation repeats with the period end - match.end
            period = end - match.end
            start = match.end + 1
            tokens = ids[start : start + min(k, period)]
            while len(tokens) < k:
                tokens += tokens[: k - len(tokens)]
        if self.history is not None and match.length < self.max_ngram:
            h_tokens, h_match = self.history.find(tail, k, self.max_ngram)
            if (h_match.length > (match.length + HISTORY_LEAD if match.length else 0) and h_tokens
                    and h_match.length >= HISTORY_MIN):
                tokens, match = h_tokens, h_match
                self.last_from_history = True
        self.last = match
        if match.length < self.min_ngram:
            return [], 0
        return tokens, match.length

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        if k <= 0:
            return Draft()
        tokens, n = self.find(context, k)
        self.last_match = n
        if len(tokens) < max(1, self.draft_min):
            return Draft()
        source = "history" if self.last_from_history else self.kind.name
        evidence = Evidence(n, self.last.agree, self.last.seen, self.last_from_history)
        return Draft(tokens=tokens, q=[None] * len(tokens), source=source, evidence=evidence)

    # -- the estimate ----------------------------------------------------------------------------------

    def offer(self, draft: Draft | None, limit: int) -> Offer:
        if draft is None or not draft.tokens:
            return Offer([])
        evidence: Evidence = draft.evidence
        match, history, n_tokens = evidence.match_len, evidence.history, len(draft.tokens)
        if history != self._from_history:
            # a span followed in the other source says nothing about this one: it is a fresh match
            self.acceptance.after_miss = True
            self._from_history = history
        self.acceptance.agreement = agreement(evidence)
        self._match = (match, history)
        if history:  # another conversation's text earns its length in this one (see HISTORY_FIRST)
            n_tokens = min(n_tokens, self.history_earned)
        elif match < FRESH_TRUSTED and self.acceptance.fresh():
            n_tokens = min(n_tokens, FRESH_FIRST)
        return Offer(self.acceptance.rates(match, n_tokens, history), LOOKUP_MARGIN)

    def learn(self, draft: Draft | None, sent: int, accepted: int, emitted: Sequence[int]) -> None:
        match, self._match = self._match, None
        proposed = draft.tokens if draft is not None else []
        if not proposed or match is None:
            self._check_shadow(emitted)
            return
        length, history = match
        if sent:
            # a real verification supersedes any shadow over the same tokens
            self.acceptance.record(length, accepted, sent, history)
            if history:  # a draft from earlier replies taken whole doubles what the next may send
                self.history_earned = (min(2 * self.history_earned, 1 << 10) if accepted == sent
                                       else max(HISTORY_FIRST, accepted))
            self._shadow = []
        else:
            overlap = min(len(proposed), len(self._shadow))
            if self._shadow and list(proposed[:overlap]) == self._shadow[:overlap]:
                # the span being followed, proposed again: keep following the older shadow rather than
                # counting the same tokens twice (its match length has grown with it)
                self._check_shadow(emitted)
                return
        # Tokens proposed but not verified teach the estimate for free: compare them with what the target
        # emits next. For a one-hot proposal a match has exactly the acceptance probability.
        tail = list(proposed[sent:])
        if accepted == sent and tail:
            self._shadow, self._shadow_match = tail, (length + sent, history)
            self._check_shadow(emitted[accepted:])  # the step's own last token checks the tail's first

    def _check_shadow(self, emitted: Sequence[int]) -> None:
        for token in emitted:
            if not self._shadow:
                break
            hit = token == self._shadow[0]
            length, history = self._shadow_match
            self.acceptance.add(length, hit, history)
            self._shadow_match = (length + 1, history)
            self._shadow = self._shadow[1:] if hit else []

    def forwards(self, drafted: int, asked: int) -> Forwards:
        return FREE  # a look-up in its index: no model runs

    def reply_done(self) -> None:
        pass

    def carried(self) -> dict:
        return {}

    def estimates(self) -> dict:
        return {"lookup": self.acceptance}
