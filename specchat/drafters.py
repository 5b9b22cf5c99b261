"""The drafter interface, chains of drafters, and the drafters that run a model: a second (small) model
(`DraftModel`) and the heads that read the target's hidden states (`HeadDrafter`: MTP, EAGLE-3). Prompt
lookup lives in lookup.py, a draft model with another tokenizer in crossvocab.py; kinds.py lists them all.

A drafter proposes tokens with the distribution q each was drawn from, says what it expects of a draft
(`offer`: the probability that each position is accepted, given the ones before it) and is told after the
verify how many of its tokens were kept (`learn`): it owns its evidence. The policy (policy.py) prices
every offer with the measured costs and sends the best, never knowing what kind of drafter it talks to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from . import kinds
from .backend import Backend, BackendError, HeldPrefix, LlamaCppBackend, common_prefix, sync
from .heads import DraftingHead, Eagle3Head, MtpHead
from .kinds import DrafterKind
from .sampling import Dist, SamplingParams, draft_step, greedy_token, penalty_window, process, sample
from .vocab import check_compatible


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # q[i]: the processed distribution tokens[i] was drawn from; None = deterministic proposal (one-hot)
    q: list[Dist | None] = field(default_factory=list)
    # who drafted: a kind's name (kinds.py), or one of its `sources` (lookup's "history")
    source: str = ""
    # what the drafter needs back in `learn` (lookup's match); the policy does not read it
    evidence: Any = None
    drafter: Any = None  # the member of a chain that proposed it (set by the policy)
    planned: int = 0  # how many tokens the policy asked for (a lookup miss proposes fewer; set by the policy)

    def head(self, n: int) -> Draft:
        """The first n tokens, the rest of the draft unchanged."""
        return Draft(self.tokens[:n], self.q[:n], self.source, self.evidence, self.drafter, self.planned)


@dataclass
class Offer:
    """What a drafter expects of a draft: rates[i] = P(position i accepted | positions < i accepted), one
    per position it could send (fewer rates cap the draft); `margin`, how much better than plain decoding
    the draft must look to be sent (None: the policy's default)."""

    rates: list[float]
    margin: float | None = None


class Forwards(NamedTuple):
    """What a draft costs its drafter: `count` forwards of its own model, each a batch of `size` tokens
    (0 forwards: proposals that cost no model time, made every step and priced after)."""

    count: int
    size: int


FREE = Forwards(0, 0)


@runtime_checkable
class Drafter(Protocol):
    """What every kind of drafter implements, in full. What only some kinds can do is one of the small
    protocols below (`Suspendable`, `Retargetable`, `Labelled`), which such a drafter declares among its
    bases; nothing else about a drafter is looked up."""

    kind: DrafterKind
    # the drafter's own model, whose KV cache a caller resets and frees and whose cost a policy
    # measures; None for a drafter without one (prompt lookup)
    backend: Backend | None

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Called before generation starts, so prompt work is not billed to the first step."""

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """Up to k tokens that might follow `context`."""

    def room(self) -> int:
        """How many more tokens this drafter can look at (context size)."""

    def offer(self, draft: Draft | None, limit: int) -> Offer:
        """What it expects: of `draft` (a free drafter's proposal in hand), or of up to `limit` tokens it
        has not drafted yet (a drafter whose tokens cost time is priced before it runs)."""

    def forwards(self, drafted: int, asked: int) -> Forwards:
        """What its model runs for a draft of `drafted` tokens when `asked` for that many (a block drafter
        runs the block asked for, however many tokens it keeps): the policy prices drafts (drafted = asked)
        and learns its costs by this, so it must depend on the arguments alone. FREE where proposals
        cost no model time."""

    def learn(self, draft: Draft | None, sent: int, accepted: int, emitted: Sequence[int]) -> None:
        """The step's outcome: its proposal this step (None: not asked), how many of its tokens went to
        the target (0: another drafter's or none were sent) and were accepted, and the tokens emitted."""

    def reply_done(self) -> None:
        """A generation ended."""

    def carried(self) -> dict[str, Any]:
        """The estimates worth keeping for the next process (each with as_dict / absorb), by name."""


def is_free(drafter: Drafter) -> bool:
    """Whether the drafter's proposals cost no model time: it proposes every step, and is priced after."""
    return drafter.forwards(1, 1).count == 0


# -- what only some drafters can do ------------------------------------------------------------------


@runtime_checkable
class Suspendable(Protocol):
    """A drafter that makes the target do work for it every step (a head's hidden rows, a block drafter's
    layer inputs), which it can stop while no policy will ask it."""

    def suspend(self, suspended: bool) -> None:
        """Stop (True) or resume (False) that work."""


@runtime_checkable
class Retargetable(Protocol):
    """A drafter that holds the target but not its context (a draft with another tokenizer reads the
    target's texts). A drafter of a kind that reads the target's context (`reads_target`) is built again
    by its factory instead."""

    def retarget(self, target: Backend) -> None:
        """The target was loaded again (/rpc off): the same file, another backend."""


@runtime_checkable
class Labelled(Protocol):
    """A drafter with something to say about how it drafts under these sampling settings (a draft with
    another tokenizer: which rule runs)."""

    def run_label(self, params: SamplingParams) -> str:
        """A few words for the live view and the report's drafter line."""


@runtime_checkable
class Estimating(Protocol):
    """A drafter whose estimates of its own acceptance can be set aside and taken up again: the policy keeps
    one set per phase of a reasoning model's reply, since a thought and the answer that copies it draft
    differently."""

    def estimates(self) -> dict[str, Any]:
        """Its live estimates (each with as_dict / absorb), by name."""


@runtime_checkable
class SelfTimed(Protocol):
    """A drafter whose drafts cost host time but that has no model of its own to time (Medusa's heads, in
    numpy): it says what a forward costs (`Drafter.forwards`), and the policy follows that from there."""

    def draft_cost(self) -> Any:
        """A costs.CostModel of its forwards, by batch size."""

    def run_info(self, params: SamplingParams) -> dict[str, Any]:
        """Keys to add to --json's object and report.json."""


def run_label(drafter, params: SamplingParams) -> str:
    """What a drafter (or the members of a chain) says about how it drafts: '' where nothing."""
    if drafter is None:
        return ""
    return " + ".join(m.run_label(params) for m in members(drafter) if isinstance(m, Labelled))


def run_info(drafter, params: SamplingParams) -> dict[str, Any]:
    """The keys a drafter (or the members of a chain) adds to --json's object and report.json."""
    info: dict[str, Any] = {}
    for member in members(drafter) if drafter is not None else ():
        if isinstance(member, Labelled):
            info.update(member.run_info(params))
    return info


class Chain:
    """Several drafters for one target (`--spec-type draft-mtp,ngram-simple`, a pair's `draft = [...]`):
    every step the policy asks each for what it would send and sends the best (llama.cpp takes the first
    non-empty draft in a fixed order). Each token's q is its own drafter's, so the rule stays exact
    whichever drafter wins a step."""

    def __init__(self, members: Sequence[Drafter]):
        if len(members) < 2:
            raise ValueError("a chain needs at least two drafters")
        self.members = tuple(members)
        self.backend = None  # the members' own (see own_backends)

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        for member in self.members:
            member.prefill(prompt_ids)

    def room(self) -> int:
        return min(member.room() for member in self.members)


def members(drafter) -> tuple:
    """The drafters a policy chooses among: a chain's members, or the one drafter."""
    return drafter.members if isinstance(drafter, Chain) else (drafter,)


def own_backends(drafter) -> list[Backend]:
    """Every model a drafter (or chain) runs of its own: caches a caller resets, cuts and frees."""
    if drafter is None:
        return []
    return [m.backend for m in members(drafter) if m.backend is not None]


class IncompatibleDraft(BackendError):
    pass


MAX_POSITION = 8  # draft positions >= this share one acceptance estimate


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
        # Each position's prior is the estimate of the position before it (the first's: the fixed prior):
        # conditional acceptance stays about flat along a draft, so a position tried a few times is pulled
        # towards its neighbour, not back to the prior. Pulled to the prior instead, a position reached only
        # now and then reads far below its neighbours, and drafts never grow past the lengths already tried.
        per_position = np.empty(MAX_POSITION)
        mean, weight = self.prior_hits / self.prior_tries, self.prior_tries
        hits, tries = self.hits.tolist(), self.tries.tolist()
        for i in range(MAX_POSITION):
            mean = per_position[i] = (hits[i] + weight * mean) / (tries[i] + weight)
        return per_position[np.minimum(np.arange(n), MAX_POSITION - 1)]

    def record(self, accepted: int, tried: int) -> None:
        """`tried` drafts went to the target and the first `accepted` were kept: draft `accepted` (if sent)
        was wrong and those after it were never checked, so they say nothing. Counting them as tried would
        turn the estimates into P(all of 0..i kept), which best_length multiplies again as if conditional:
        long drafts priced far below what they earn."""
        if tried <= 0:
            return
        self.hits *= self.decay
        self.tries *= self.decay
        for i in range(min(tried, accepted + 1)):
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



class ModelDrafting(Estimating):
    """What every drafter that runs a model shares (a draft model, a head, a block drafter, a draft with another
    tokenizer): one acceptance estimate per draft position, learned from its verified drafts and kept across
    processes (it gets an optimistic prior so it is tried; its misses then teach it), and one way to draft
    (`DraftLoop`) that stops where the draft is unsure (`p_min`, llama.cpp's --spec-draft-p-min) and sends
    nothing shorter than `draft_min` (--spec-draft-n-min)."""

    def __init__(self, p_min: float = 0.0, draft_min: int = 0) -> None:
        self.acceptance = Acceptance(prior_hits=2.0, prior_tries=3.0)
        self.p_min = p_min
        self.draft_min = draft_min

    def offer(self, draft: Draft | None, limit: int) -> Offer:
        return Offer(self.acceptance.rates(limit if draft is None else len(draft.tokens)).tolist())

    def forwards(self, drafted: int, asked: int) -> Forwards:
        """One forward of its model per drafted token (free where its kind says its drafts cost nothing)."""
        return FREE if self.kind.free else Forwards(drafted, 1)

    def learn(self, draft: Draft | None, sent: int, accepted: int, emitted: Sequence[int]) -> None:
        self.acceptance.record(accepted, sent)

    def reply_done(self) -> None:
        pass

    def carried(self) -> dict[str, Any]:
        return self.estimates()

    def estimates(self) -> dict[str, Any]:
        return {"model": self.acceptance}

    def _draft(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator,
               row_at: RowAt, *, source: str | None = None, p_min: float | None = None) -> Draft:
        """Up to k tokens in the drafter's own vocabulary, drawn by the DraftLoop from the rows `row_at`
        gives; an empty draft where fewer than draft_min."""
        draft = Draft(source=source or self.kind.name)
        for token, q in DraftLoop(context, params, rng, self.p_min if p_min is None else p_min).tokens(k, row_at):
            draft.tokens.append(token)
            draft.q.append(q)
        return draft if len(draft.tokens) >= self.draft_min else Draft()


# row_at(i, token before) -> the row draft token i is drawn from, or None where the drafter has none
RowAt = Callable[[int, "int | None"], "np.ndarray | None"]
# pick(row, params, history, rng, p_min) -> (token, q or None, top probability), or None: nothing to draft
Pick = Callable[..., "tuple[int | None, Dist | None, float] | None"]


class DraftLoop:
    """How every drafter that runs a model drafts: token by token from its model's rows, each drawn by `pick`
    (draft_token: from the sampler chain's q, or greedy) under penalties that see the context and the tokens
    drafted before it, stopping before a token the draft is unsure of (its top probability under p_min).
    What differs between drafters is where each row comes from (`row_at`: its model evaluating the token
    before, or a block's rows) and when they have what they want (they stop iterating)."""

    def __init__(self, context: Sequence[int], params: SamplingParams, rng: np.random.Generator, p_min: float,
                 pick: Pick | None = None):
        self.history = penalty_window(context, params)
        self.params = params
        self.rng = rng
        self.p_min = p_min
        self.pick = pick or draft_token
        self.unsure: int | None = None  # the token the draft stopped before, unsure of it

    def tokens(self, k: int, row_at: RowAt) -> Iterator[tuple[int, Dist | None]]:
        """Up to k (token, q). The row of token i is asked for only when the caller asks for token i: a
        caller that stops has its model evaluate nothing more."""
        token = None
        for i in range(k):
            row = row_at(i, token)
            if row is None:
                return
            picked = self.pick(row, self.params, self.history, self.rng, self.p_min)
            if picked is None:
                return
            token, q, top = picked
            if top < self.p_min:
                self.unsure = token
                return
            yield token, q
            if self.params.has_penalty:
                self.history.append(token)


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


def own_rows(row: np.ndarray, backend: Backend) -> RowAt:
    """row_at for a model that drafts on its own outputs: `row` (the one after the context) first, then the
    row after each drafted token, evaluated in place."""
    return lambda i, token: row if i == 0 else backend.eval([token], [0], in_place=True)[0]


class DraftModel(ModelDrafting):
    """A second GGUF model sharing the target's vocabulary: proposes by sampling its own distribution."""

    kind = kinds.DRAFT_MODEL

    def __init__(self, backend: Backend, p_min: float = 0.0, draft_min: int = 0):
        super().__init__(p_min, draft_min)
        self.backend = backend
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
        draft = self._draft(context, k, params, rng, own_rows(row, self.backend))
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


class ReadsTarget(ModelDrafting, Suspendable):
    """A drafter whose model reads what the target hands over as it evaluates (a head: hidden rows or layer
    inputs; a block drafter: layer inputs), by position, and whose model's cache holds one entry per
    context token. The target hands them over through `capture(sink)` until `suspend`ed."""

    def __init__(self, head, target, sink: Callable[[int, np.ndarray], None],
                 capture: Callable[[Callable[[int, np.ndarray], None]], None], p_min: float, draft_min: int):
        super().__init__(p_min, draft_min)
        self.head = head
        self.backend = head  # the KV cache a caller resets, the cost a policy measures
        self.target = target
        self.held = HeldPrefix(head)  # how many of the context's entries the head holds
        self.suspended = False
        self._sink = sink
        self._capture = capture
        capture(sink)

    def suspend(self, suspended: bool) -> None:
        """A policy will not ask this drafter (it cannot pay here even if always right): the target stops
        extracting what it reads, until it is resumed. Positions evaluated meanwhile have zero rows until the
        target evaluates them again: a resumed drafter drafts worse there, never wrongly (each token is
        verified against its own q)."""
        if suspended == self.suspended:
            return
        self.suspended = suspended
        if suspended:
            self.target.stop_capture()
        else:
            self._capture(self._sink)

    def _kept(self, context: Sequence[int], end: int, shift: int = 0, redo_last: bool = False) -> int:
        """Cut the head's entries back to those that still hold context tokens shift..end-1 (entry i holds
        token i + shift), comparing only past what it is known to hold; how many it keeps. With
        `redo_last`, never the last of them (its row is wanted again)."""
        n = end - shift
        held = self.head.tokens
        known = min(self.held.known(context), n, len(held))
        common = known + common_prefix(held[known:], context[shift + known : end])
        if redo_last and common == n:
            common -= 1
        self.head.truncate(common)
        return common


class HeadDrafter(ReadsTarget):
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

    `row_of` is that pairing; a test that pairs wrongly through it sees the tiny heads' acceptance collapse.
    What the head reads, and its shift, the head declares (heads.DraftingHead); one that declares nothing
    reads the target's final hidden rows as they are, with shift 0 (MTP's pairing)."""

    def __init__(self, head, target, p_min: float = 0.0, draft_min: int = 0):
        declared = isinstance(head, DraftingHead)
        self.kind = head.drafts_as if declared else kinds.MTP
        self.shift = head.shift if declared else 0
        # what the target hands over per token (an EAGLE-3 head's encoder turns it into the rows it pairs)
        self.hidden = HiddenRows(head.n_embd_in if declared else head.n_embd)
        self._encode = head.encode if declared else None
        super().__init__(head, target, self.hidden.put, head.attach if declared else target.capture_hidden,
                         p_min, draft_min)

    def row_of(self, entry: int) -> int:
        """The target row paired with the head's entry `entry`: entry i holds context token i + shift, paired
        with the row of the token before it."""
        return entry + self.shift - 1

    def room(self) -> int:
        return self.head.n_ctx + self.shift

    def _catch_up(self, context: Sequence[int], end: int, logits: bool) -> np.ndarray | None:
        """Make the head hold the entries of context tokens shift..end-1, evaluating only what differs from
        what it holds; with `logits`, the last entry is evaluated (again), alone, for its row."""
        if end - self.shift <= 0:
            return None
        common = self._kept(context, end, self.shift, redo_last=logits)
        if common >= end - self.shift:
            return None
        seq = list(context[self.shift + common : end])
        first = self.row_of(common)
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
        first = self._catch_up(context, n, logits=True)

        def row_at(i: int, token: int | None) -> np.ndarray:
            # each further token goes in with the head's own output row of the step before
            return first if i == 0 else self.head.eval([token], [0], states=self.head.hidden)[0]

        try:
            return self._draft(context, k, params, rng, row_at)
        finally:
            self.head.truncate(n - self.shift)  # the draft entries carry the head's own rows, not the target's
            self.held.record(context, n - self.shift)


# -- the kinds table's factories (loader.Build -> drafter) ---------------------------------------------


def build_draft_model(build) -> Drafter:
    """A draft model from -md: the target's own tokens where the vocabularies match (llama.cpp's rule),
    else drafted in its own tokens and re-tokenised for the target (crossvocab.py)."""
    opts = build.opts
    build.status(f"loading draft {build.spec.name}")
    backend = LlamaCppBackend(
        build.path, n_ctx=opts.n_ctx, n_gpu_layers=opts.n_gpu_layers_draft, n_threads=build.threads,
        name=build.spec.name, flash_attn=opts.flash_attn,
        snapshots=0,  # drafts are evaluated one token a batch: snapshots of a batch cannot undo them
    )
    try:
        try:
            return DraftModel.checked(backend, build.target, p_min=opts.draft_p_min, draft_min=opts.draft_min)
        except IncompatibleDraft:
            from .crossvocab import CrossVocabDrafter  # its vocabulary maps load only when needed

            build.status(f"mapping {build.spec.name}'s vocabulary to {build.target_spec.name}'s")
            return CrossVocabDrafter(backend, build.target, rule=opts.cross_vocab, p_min=opts.draft_p_min,
                                     draft_min=opts.draft_min)
    except BackendError:
        backend.close()
        raise


def build_reader(build, status: str, make_head: Callable[[], Any], drafter: type[ReadsTarget]) -> ReadsTarget:
    """A drafter that reads the target (`drafter`) around the head `make_head` loads; the head closed again
    where the drafter cannot be made."""
    build.status(status)
    head = make_head()
    try:
        return drafter(head, build.target, p_min=build.opts.draft_p_min, draft_min=build.opts.draft_min)
    except BaseException:
        head.close()
        raise


def build_mtp(build) -> HeadDrafter:
    """The target's own MTP layers (-md mtp, --spec-type draft-mtp)."""
    return build_reader(build, f"creating the MTP context of {build.target_spec.name}",
                        lambda: MtpHead(build.target), HeadDrafter)


def build_eagle3(build) -> HeadDrafter:
    """An EAGLE-3 head trained for this target: it reads the target's layers."""
    return build_reader(build, f"loading EAGLE-3 head {build.spec.name}",
                        lambda: Eagle3Head(build.target, build.path, n_gpu_layers=build.opts.n_gpu_layers_draft),
                        HeadDrafter)
