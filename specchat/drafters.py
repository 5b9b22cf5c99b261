"""Who proposes the draft tokens: a second (small) model, or n-gram lookup over the text so far."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from .backend import Backend, BackendError, HeldPrefix, common_prefix, sync
from .sampling import Dist, SamplingParams, draft_step, greedy_token, penalty_window, process, sample
from .vocab import check_compatible


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # q[i]: the processed distribution tokens[i] was drawn from; None = deterministic proposal (one-hot)
    q: list[Dist | None] = field(default_factory=list)
    # a draft model's lowest top probability over its tokens (how sure it was)
    confidence: float = 0.0
    # prompt lookup's evidence: the matched n-gram length, and of the earlier occurrences compared, how
    # many (`agree` of `seen`) went on with the same token as this draft
    match_len: int = 0
    agree: int = 0
    seen: int = 0
    # who drafted: "draft-model", "prompt-lookup" (the context), "history" (earlier replies), "mtp" / "eagle3" (a head)
    source: str = "draft-model"


@runtime_checkable
class Drafter(Protocol):
    kind: str  # "draft-model" | "prompt-lookup" | "hybrid" | "mtp" | "eagle3"
    # the drafter's own model, whose KV cache a caller resets and frees and whose cost a policy
    # measures; None for a drafter without one (prompt lookup)
    backend: Backend | None

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Called before generation starts, so prompt work is not billed to the first step."""

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """Up to k tokens that might follow `context`."""

    def room(self) -> int:
        """How many more tokens this drafter can look at (context size)."""


class IncompatibleDraft(BackendError):
    pass


class DraftModel:
    """A second GGUF model sharing the target's vocabulary: proposes by sampling its own distribution."""

    kind = "draft-model"

    def __init__(self, backend: Backend, p_min: float = 0.0, draft_min: int = 0):
        self.backend = backend
        self.p_min = p_min
        self.draft_min = draft_min
        self.held = HeldPrefix(backend)  # how much of the engine's context the cache holds

    @classmethod
    def checked(cls, backend: Backend, target: Backend, **kw) -> DraftModel:
        problem = check_compatible(target.vocab, backend.vocab)
        if problem:
            raise IncompatibleDraft(
                f"draft {backend.name} cannot draft for target {target.name}: {problem}; "
                "use a draft from the target's model family, or --draft prompt-lookup"
            )
        return cls(backend, **kw)

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        if len(prompt_ids) >= self.backend.n_ctx:
            return  # the prompt alone fills the draft's context: propose() will decline to draft
        sync(self.backend, prompt_ids[:-1], logits_last=False, turn=True)

    def room(self) -> int:
        return self.backend.n_ctx

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        k = min(k, self.backend.n_ctx - len(context))
        if k <= 0:
            return Draft()
        row = sync(self.backend, context, logits_last=True, known=self.held.known(context))
        if k > 1:  # the drafts evaluated next are cut after the verify (a recurrent model copies its state)
            self.backend.checkpoint()
        draft = draft_loop(row, k, context, params, rng, self.p_min, self.draft_min, Draft(),
                           lambda token: self.backend.eval([token], [0], in_place=True)[0])
        self.held.record(context, len(context))
        return draft



class HiddenRows:
    """The target's final hidden row for every position it evaluated, as its decodes hand them over
    (Backend.capture_hidden): the latest evaluation of a position wins, which is the one of the tokens its
    cache holds now. Grows with the context (n_embd floats a token)."""

    def __init__(self, n_embd: int):
        self.n_embd = n_embd
        self.rows = np.zeros((0, n_embd), dtype=np.float32)
        self.known = 0  # positions below this have a row

    def put(self, p0: int, rows: np.ndarray) -> None:
        end = p0 + len(rows)
        if end > len(self.rows):
            grown = np.zeros((max(end, 2 * len(self.rows), 64), self.n_embd), dtype=np.float32)
            grown[: len(self.rows)] = self.rows
            self.rows = grown
        self.rows[p0:end] = rows
        self.known = max(self.known, end) if p0 <= self.known else self.known

    def states(self, positions: range) -> np.ndarray:
        """Rows at `positions`; a zero row where there is none (position -1, like llama.cpp's first
        pending row, or one the target never handed over)."""
        out = np.zeros((len(positions), self.n_embd), dtype=np.float32)
        lo, hi = max(positions.start, 0), min(positions.stop, self.known)
        if lo < hi:
            out[lo - positions.start : hi - positions.start] = self.rows[lo:hi]
        return out


class HeadDrafter:
    """A drafting head that reads the target's hidden states: the target's own MTP layers (`MtpHead`) or an
    EAGLE-3 head (`Eagle3Head`), paired as llama.cpp pairs them (common/speculative.cpp).

    MTP (common_speculative_impl_draft_mtp): the head's entry at position j is the token x_j with the
    target's final hidden row h_{j-1} (a zero row at j = 0), and it predicts x_{j+1}. EAGLE-3
    (common_speculative_impl_draft_eagle3): its entry at position P is x_{P+1} with g_P, the encoded layer
    inputs of x_P; token 0 has no entry (`shift` = 1). Both: the token x_j goes with the row of x_{j-1}.
    The target's cache holds context[:-1], so every row up to that of x_{n-2} exists when a draft starts:
    the head catches up on the entries it lacks, ending with x_{n-1}'s (llama.cpp's deferred boundary,
    completed once the token after the verify is known), whose logits give d1; each further draft token
    goes in with the head's own output row of the step before. Draft entries are cut after proposing: once
    verified, the target's rows replace the head's own.

    `pair_offset` (tests only) pairs x_j with the row of x_{j-1-pair_offset}: a wrong pairing, which the tiny
    heads punish with a collapse in acceptance."""

    def __init__(self, head, target, p_min: float = 0.0, draft_min: int = 0, pair_offset: int = 0):
        self.head = head
        self.kind = getattr(head, "kind", "mtp") or "mtp"  # the policy: "mtp" / "eagle3", both like a draft model
        self.backend = head  # the KV cache a caller resets, the cost a policy measures
        self.p_min = p_min
        self.draft_min = draft_min
        self.pair_offset = pair_offset
        self.shift = getattr(head, "shift", 0)
        # what the target hands over per token (an EAGLE-3 head's encoder turns it into the rows it pairs)
        self.hidden = HiddenRows(getattr(head, "n_embd_in", head.n_embd))
        self._encode = getattr(head, "encode", None)
        self.held = HeldPrefix(head)  # how many of the context's entries the head holds
        if hasattr(head, "attach"):
            head.attach(self.hidden.put)
        else:
            target.capture_hidden(self.hidden.put)

    def room(self) -> int:
        return self.head.n_ctx + self.shift

    def _catch_up(self, context: Sequence[int], end: int, logits: bool) -> np.ndarray | None:
        """Make the head hold the entries of context tokens shift..end-1, evaluating only what differs from
        what it holds; with `logits`, the last entry is evaluated (again), alone, for its row."""
        n = end - self.shift
        if n <= 0:
            return None
        held = self.head.tokens
        known = min(self.held.known(context), n, len(held))
        common = known + common_prefix(held[known:], context[self.shift + known : end])
        if logits and common == n:
            common -= 1
        self.head.truncate(common)
        if common >= n:
            return None
        seq = list(context[self.shift + common : end])
        # entry i holds context token i + shift, paired with the row of the token before it
        first = common + self.shift - 1 - self.pair_offset
        states = self.hidden.states(range(first, first + len(seq)))
        if self._encode is not None:
            states = self._encode(states)
        if not logits:
            self.head.eval(seq, [], states=states)
            return None
        if len(seq) > 1:  # the entries before the last, then the last alone: its hidden row comes back
            self.head.eval(seq[:-1], [], states=states[:-1])
        return self.head.eval([seq[-1]], [0], states=states[-1:])[0]

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        if 1 < len(prompt_ids) < self.head.n_ctx:
            self._catch_up(prompt_ids, len(prompt_ids) - 1, logits=False)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        n = len(context)
        k = min(k, self.head.n_ctx - (n - self.shift))
        if k <= 0 or n <= self.shift:
            return Draft()
        row = self._catch_up(context, n, logits=True)
        try:
            return draft_loop(row, k, context, params, rng, self.p_min, self.draft_min, Draft(source=self.kind),
                              lambda token: self.head.eval([token], [0], states=self.head.hidden)[0])
        finally:
            self.head.truncate(n - self.shift)  # the draft entries carry the head's own rows, not the target's
            self.held.record(context, n - self.shift)


def reads_target(drafter) -> bool:
    """Whether a drafter reads the target's own context (a head, alone or in a hybrid): it cannot outlive
    the target's backend."""
    return isinstance(drafter, HeadDrafter) or isinstance(getattr(drafter, "model", None), HeadDrafter)


def draft_loop(row: np.ndarray, k: int, context: Sequence[int], params: SamplingParams, rng: np.random.Generator,
               p_min: float, draft_min: int, draft: Draft, next_row: Callable[[int], np.ndarray]) -> Draft:
    """Up to k tokens drawn one at a time from a model's rows (a draft model's, a head's): `row` follows
    the context, `next_row(token)` evaluates a drafted token and returns the row after it. Stops before a
    token whose top probability is under p_min (llama.cpp's --spec-draft-p-min); fewer than draft_min
    tokens make an empty draft."""
    history = penalty_window(context, params)
    confidence = 1.0
    for i in range(k):
        token, q, top = draft_token(row, params, history, rng, p_min)
        if top < p_min:  # the draft itself is unsure of this token
            break
        confidence = min(confidence, top)
        draft.tokens.append(token)
        draft.q.append(q)
        if params.has_penalty:
            history.append(token)
        if i < k - 1:
            row = next_row(token)
    if len(draft.tokens) < draft_min:
        return Draft()
    draft.confidence = confidence
    return draft


def draft_token(row: np.ndarray, params: SamplingParams, history, rng: np.random.Generator,
                p_min: float) -> tuple[int, Dist | None, float]:
    """(token, the distribution q it was drawn from (None: greedy, one-hot), the draft's top probability
    when p_min asks for it, else 1.0), as a draft model picks each token."""
    if p_min > 0:  # the token and llama.cpp's confidence from one pass over the row
        token, q, top = draft_step(row, params, history)
    elif params.greedy:
        token, q, top = greedy_token(row, params, history), None, 1.0
    else:
        token, q, top = None, process(row, params, history), 1.0
    if q is not None:
        token = sample(q, rng)
    return token, q, top


SEPARATOR = -1  # between the replies of an n-gram history: matches no token, ends every continuation
ORDER = 4  # n-grams up to this length are indexed; longer matches extend a 4-gram's, token by token
# Where the context has a match, an earlier reply's replaces it only when it is longer by more than this: a
# slightly longer match in another conversation's text took the place of the context's own continuation
# (the one the reply was copying) and cost 2-13% of the speed on 4 of 16 replayed prompts; with 4,
# state learned from other prompts was never slower than an empty cache in total (lookup_replay.py).
HISTORY_LEAD = 4
# ... and only a match of at least this many tokens is followed there at all: a shorter one in another
# conversation's text is a common phrase, not a copy. Replayed on the 40 evaluation prompts with the 16
# learning replies as the history (benchmarks/lookup_replay.py), history drafts of shorter matches kept 8
# of 30 tokens sent (the other way round: 3 of 30), those of 8+ kept 15 of 25 (10 of 16). The bar left the
# geometric means as they were (1.33x / 1.27x -> 1.33x / 1.28x of llama.cpp's n-gram drafters) and lifted
# the worst 32-token reply from 0.95x to 0.97x of target-only. In real runs of qa-context-1, a history
# draft of a match under 4 tokens early in the reply changed its batches, and with them (batched logits
# differ a little) the reply: it parted from the one an empty cache writes, and ran 0.68-0.81x of
# llama.cpp's best drafter where the empty cache's ran 0.92x. (Both part from llama.cpp's text at its fourth
# token, so on the default build that prompt times another text than llama.cpp's; on a build whose batches
# compute what single tokens do, the texts agree and it runs 1.26x: docs/benchmarks.md, "Texts pinned".)
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


class PromptLookup:
    """Prompt lookup decoding (Saxena 2023; llama.cpp's ngram-simple): find the latest earlier occurrence
    of the longest suffix of the context (up to max_ngram tokens, at least min_ngram) and propose what
    followed it. A match close to the end of the context is a loop, and its continuation runs on around
    the loop (what llama.cpp's ngram-mod drafts a token at a time), not just to the end of the context.

    The evidence goes with the draft for the policy to weigh: the match length (a 24-token match predicts
    a long accepted run, a 1-token one hardly anything), how often the continuation held before (`agree`
    of `seen`), and whether the match is in this conversation or in earlier replies (`history`, searched
    too: used where the context has no match, or one shorter by more than HISTORY_LEAD, and only from
    HISTORY_MIN tokens on). The context is
    indexed as it grows (NgramIndex), so a step costs the same however long the conversation is."""

    kind = "prompt-lookup"
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
        return self.draft(tokens, n)

    def draft(self, tokens: list[int], match_len: int) -> Draft:
        """The last lookup's tokens as a Draft, with its evidence."""
        source = "history" if self.last_from_history else "prompt-lookup"
        return Draft(tokens=tokens, q=[None] * len(tokens), match_len=match_len, agree=self.last.agree,
                     seen=self.last.seen, source=source)


class HybridDrafter:
    """Prompt lookup where it has a match, the draft model otherwise (what llama.cpp's server does with
    a draft model and `--spec-type ngram-*` together). Lookup is tried first because it costs nothing;
    `choose` (the policy's) then says whether to send the match, ask the model for k tokens instead,
    or draft nothing. Without a chooser a match of min_ngram or more wins."""

    kind = "hybrid"

    def __init__(self, lookup: PromptLookup, model: DraftModel):
        self.lookup = lookup
        self.model = model
        self.backend = model.backend  # the KV cache a caller must reset, the cost a policy measures
        # (lookup's draft, limit) -> (source, k): the policy's `choose` (see use_policy)
        self.choose: Callable[[Draft, int], tuple[str, int]] | None = None

    def use_policy(self, policy) -> None:
        """Let `policy` choose between lookup's match and the model each step. A chat swaps policies
        (/draft), so this is a method, not a constructor argument."""
        self.choose = policy.choose

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self.lookup.prefill(prompt_ids)
        self.model.prefill(prompt_ids)

    def room(self) -> int:
        return self.model.room()

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        if k <= 0:
            return Draft()
        tokens, n = self.lookup.find(context, k)
        self.lookup.last_match = n
        found = self.lookup.draft(tokens, n) if tokens else Draft()
        if self.choose is not None:
            source, k = self.choose(found, k)
        else:
            source = "prompt-lookup" if tokens else "draft-model"
        if source == "prompt-lookup" and tokens:
            found.tokens, found.q = found.tokens[:k], found.q[:k]
            return found
        if source == "draft-model" and k > 0:
            return self.model.propose(context, k, params, rng)
        return Draft()
