"""Who proposes the draft tokens: a second (small) model, or n-gram lookup over the text so far."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from .backend import Backend, BackendError, HeldPrefix, check_compatible, common_prefix, sync
from .sampling import Dist, SamplingParams, draft_step, greedy_token, penalty_window, process, sample


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # q[i]: the processed distribution tokens[i] was drawn from; None = deterministic proposal (one-hot)
    q: list[Dist | None] = field(default_factory=list)
    # how good the source looked: prompt lookup's matched n-gram length, a draft model's top probability
    confidence: float = 0.0
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


def longest_match(hay: np.ndarray, n_hay: int, ids: np.ndarray, max_len: int,
                  usable: np.ndarray | None = None) -> tuple[int, int]:
    """(position in hay, length) of the longest run ending at a position p < n_hay that equals the tail of
    `ids`, latest p among equals; (-1, 0) when ids[-1] occurs nowhere. One pass: the positions that
    match ids[-1] are found once, then only the survivors are extended backwards. Negative hay values
    (separators) never match a token; `usable` (a mask over hay) excludes positions with nothing after them."""
    last = len(ids) - 1
    starts = np.flatnonzero(hay[:n_hay] == ids[last])
    if usable is not None:
        starts = starts[usable[starts]]
    if len(starts) == 0:
        return -1, 0
    length = 1
    best = starts
    max_len = min(max_len, len(ids))
    while length < max_len and len(starts) > 1:
        starts = starts[starts >= length]
        starts = starts[hay[starts - length] == ids[last - length]]
        if len(starts) == 0:
            break
        length += 1
        best = starts
    if len(starts) == 1 and length < max_len:
        # one candidate left: its whole match in one comparison of two slices, not a numpy round per
        # token (a 32-token match inside a copied span would cost ~6 calls a token, each slow after a decode)
        p = int(starts[0])
        span = min(max_len, p + 1)
        differs = np.flatnonzero(hay[p - span + 1 : p + 1][::-1] != ids[last - span + 1 : last + 1][::-1])
        return p, int(differs[0]) if len(differs) else span
    return int(best[-1]), length


class NgramHistory:
    """Token streams of this user's earlier replies (chat transcripts, report runs), searched when the
    context has no match as long: llama.cpp's lookup caches (`--lookup-cache-dynamic`), without a
    separate file format. Streams are joined with -1 separators, which no token matches, and only the
    latest `max_tokens` are kept so a step's search stays well under a millisecond."""

    def __init__(self, streams: Sequence[Sequence[int]], max_tokens: int = 1 << 16):
        parts: list[np.ndarray] = []
        total = 0
        for stream in reversed(streams):
            if total >= max_tokens:
                break
            arr = np.asarray(stream, dtype=np.int64)[-(max_tokens - total):]
            parts.append(np.append(arr, -1))
            total += len(arr) + 1
        self.ids = np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)
        self._continues = np.append(self.ids[1:] >= 0, False)  # a match at the end of a reply proposes nothing

    def __len__(self) -> int:
        return len(self.ids)

    def find(self, ids: np.ndarray, k: int, max_len: int) -> tuple[list[int], int]:
        if len(self.ids) < 2 or len(ids) == 0:
            return [], 0
        pos, length = longest_match(self.ids, len(self.ids) - 1, ids, max_len, self._continues)
        if length == 0:
            return [], 0
        follow = self.ids[pos + 1 : pos + 1 + k]
        cut = np.flatnonzero(follow < 0)  # a continuation ends where its reply ended
        if len(cut):
            follow = follow[: cut[0]]
        return follow.tolist(), length


class PromptLookup:
    """Prompt lookup decoding (Saxena 2023; llama.cpp's ngram-simple): find the latest earlier occurrence
    of the longest suffix of the context (up to max_ngram tokens, at least min_ngram) and propose what
    followed it. The match length is the evidence the policy weighs: a 24-token match predicts a long
    accepted run, a 1-token one hardly anything. With a `history`, earlier replies are searched too and
    win when their match is longer."""

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
        self.last_match = 0  # n-gram length of the last proposal (0 = none found)
        self.last_from_history = False

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        pass

    def room(self) -> int:
        return 1 << 30

    def find(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """(continuation of up to k tokens, matched n-gram length), longest match first, latest first;
        the context before the history when their matches are as long."""
        ids = context if isinstance(context, np.ndarray) else np.asarray(context, dtype=np.int64)
        self.last_from_history = False
        tokens, length = [], 0
        end = len(ids) - 1
        if end >= self.min_ngram:
            pos, length = longest_match(ids, end, ids, self.max_ngram)
            tokens = ids[pos + 1 : pos + 1 + k].tolist() if length else []
        if self.history is not None and length < self.max_ngram:
            h_tokens, h_length = self.history.find(ids, k, self.max_ngram)
            if h_length > length and h_tokens:
                tokens, length = h_tokens, h_length
                self.last_from_history = True
        if length < self.min_ngram:
            return [], 0
        return tokens, length

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        if k <= 0:
            return Draft()
        tokens, n = self.find(context, k)
        self.last_match = n
        if len(tokens) < max(1, self.draft_min):
            return Draft()
        source = "history" if self.last_from_history else "prompt-lookup"
        return Draft(tokens=tokens, q=[None] * len(tokens), confidence=float(n), source=source)


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
        # (match length, tokens found, limit, from history) -> (source, k): the policy's `choose`
        self.choose: Callable[[int, int, int, bool], tuple[str, int]] | None = None

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self.model.prefill(prompt_ids)

    def room(self) -> int:
        return self.model.room()

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        if k <= 0:
            return Draft()
        tokens, n = self.lookup.find(context, k)
        self.lookup.last_match = n
        if self.choose is not None:
            source, k = self.choose(n, len(tokens), k, self.lookup.last_from_history)
        else:
            source = "prompt-lookup" if tokens else "draft-model"
        if source == "prompt-lookup" and tokens:
            origin = "history" if self.lookup.last_from_history else "prompt-lookup"
            return Draft(tokens=tokens[:k], q=[None] * min(k, len(tokens)), confidence=float(n), source=origin)
        if source == "draft-model" and k > 0:
            return self.model.propose(context, k, params, rng)
        return Draft()
