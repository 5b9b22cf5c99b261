"""The draft/verify loop: one generator that yields every token as it is decided.

Invariant between steps: `context` is the prompt plus every emitted token; the target's cache holds
context[:-1]. A step evaluates [context[-1], d1..dk] in ONE target batch, which yields p1..p(k+1);
`sampling.verify` keeps a prefix of the drafts and adds one target token; the cache is cut back to the
kept tokens. k = 0 is plain decoding through the same code.

`generate` is the loop (plan, draft, verify, emit, record); `verify_step` is one verify and its cut;
`Reply` holds what was emitted, its text and the token budget. Per step, nothing here reads more of the
context than the penalty window (see `penalty_history`), so a step costs the same at any context length.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from .backend import Backend, BackendError, sync
from .detok import Detokenizer, StopMatcher
from .drafters import Draft, Drafter, own_backends
from .policy import FixedPolicy, Policy
from .sampling import (
    Dist, SamplingParams, greedy_rows, greedy_token, lazy_rows, penalty_window, process, process_rows, verify,
    verify_greedy,
)
from .stats import RunStats, StepStats
from .tree import DraftTree, ends_at_leaf, path_history, verify_tree, verify_tree_greedy

if TYPE_CHECKING:
    from .reasoning import Budget, PhaseSplitter, Split

MAX_TOKENS = 256  # most tokens one generation emits unless told (-n)

Source = Literal["accepted", "resampled", "bonus", "target"]


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token. `text` is the text this token made visible: '' while a multi-byte character
    or a possible stop string is held back, more than the token's own piece when held text is released."""

    id: int
    text: str
    source: Source
    step: int
    phase: str = "answer"  # "thought", "answer", or "marker" (a thinking marker's token): reasoning.split_events


@dataclass(frozen=True)
class StepEvent:
    """Emitted after the tokens of each verify step. `totals` is the run's statistics as of this step
    (a snapshot: later steps do not change it)."""

    stats: StepStats
    totals: RunStats


@dataclass
class Finished:
    text: str
    token_ids: list[int]
    finish_reason: Literal["eog", "length", "stop", "context", "interrupted"]
    stats: RunStats
    prompt_token_ids: list[int] = field(default_factory=list)
    tail: str = ""  # text held back until the end (an unfinished character, a partial stop string)
    split: Split | None = None  # thought and answer apart, for a reasoning model (reasoning.split_events)


Event = TokenEvent | StepEvent | Finished


class PromptTooLong(BackendError):
    pass


def check_fits(prompt_ids: Sequence[int], n_ctx: int) -> None:
    """Refuse a prompt that leaves no room to generate."""
    if len(prompt_ids) >= n_ctx:
        raise PromptTooLong(
            f"prompt is {len(prompt_ids)} tokens but the context is {n_ctx} (-c {n_ctx}); "
            "raise -c or shorten the prompt"
        )


def generate(
    target: Backend,
    drafter: Drafter | None,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    max_tokens: int = MAX_TOKENS,
    stop: Sequence[str] = (),
    policy: Policy | None = None,
    rng: np.random.Generator | None = None,
    budget: Budget | None = None,
    phases: PhaseSplitter | None = None,
) -> Iterator[Event]:
    """Yield TokenEvent and StepEvent as generation goes, then one Finished.

    The target's output distribution is exactly what plain sampling from it would give (see
    sampling.verify); the drafter and policy only change how many target evaluations it takes.
    `budget` (--reasoning-budget) constrains that distribution: where it forces a token, p is one-hot on it.
    `phases` follows a reasoning model's reply (thought or answer) for the policy, which learns each apart.
    """
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise ValueError("empty prompt: nothing to condition on")
    check_fits(prompt_ids, target.n_ctx)
    if policy is None:
        policy = FixedPolicy(0 if drafter is None else 8)
    rng = rng if rng is not None else np.random.default_rng(params.seed)
    stats = RunStats(prompt_tokens=len(prompt_ids))
    backends = [target, *own_backends(drafter)]  # every model whose cache this run cuts
    recoveries_before = sum(b.rollback_recoveries for b in backends)

    def recoveries() -> int:
        return sum(b.rollback_recoveries for b in backends) - recoveries_before

    started = time.perf_counter()
    evaluated_before = target.evaluated
    sync(target, prompt_ids[:-1], logits_last=False, turn=True)
    if drafter is not None and policy.drafting_possible:
        drafter.prefill(prompt_ids)
    stats.prompt_tokens_evaluated = target.evaluated - evaluated_before + 1  # the last one goes with step 1
    stats.prefill_seconds = time.perf_counter() - started

    reply = Reply(target, prompt_ids, max_tokens, stop)
    gen_started = time.perf_counter()
    try:
        while (limit := reply.draft_limit(drafter)) is not None:
            t0 = time.perf_counter()
            forcing = budget is not None and budget.forced() is not None
            if forcing:  # the forced tokens are known: sent as the draft, each accepted (p and q one-hot on it)
                rest = budget.forced_rest()[: max(0, limit)]
                draft = Draft(rest, [None] * len(rest))
            elif drafter is not None:
                if phases is not None:
                    policy.enter(phases.phase)
                draft = policy.draft(drafter, reply.context, max(0, limit), params, rng)
            else:
                draft = Draft()
            own = 0 if forcing else len(draft.tokens)  # the drafter's tokens among those sent
            if not forcing and budget is not None and draft.tokens:  # the budget constrains q as it does p
                own, tail = budget.constrain(draft.tokens, max(0, limit))
                if tail or own < len(draft.tokens):
                    head = draft.head(own)
                    head.tokens, head.q = head.tokens + tail, head.q + [None] * len(tail)
                    draft = head
            drafts = draft.tokens
            tree = None if budget is not None else tree_to_verify(target, draft)
            t1 = time.perf_counter()
            if tree is not None:  # a draft tree: verified in one batch
                verified = verify_tree_step(target, reply.context, tree, params, rng)
            else:
                forced = budget.lookahead(drafts) if budget is not None else None
                verified = verify_step(target, reply.context, drafts, draft.q, params, rng, forced)
            t2 = time.perf_counter()
            n_before = len(reply.generated)
            decided = verified.tokens(drafts)
            if own < len(drafts):  # forced tokens are the budget's: shown as the target's own
                decided = [(token, source if i < own else "target") for i, (token, source) in enumerate(decided)]
            if budget is None and phases is None:
                yield from reply.emit(decided, stats.steps)
            else:
                for event in reply.emit(decided, stats.steps):
                    if budget is not None:
                        budget.accept(event.id)  # the budget's state follows every emitted token
                    if phases is not None:
                        phases.feed(event.id, None)
                    yield event
            emitted = reply.generated[n_before:]
            drafted = own  # forced tokens are the budget's, not a drafter's
            if tree is not None:  # a tree's positions tried: its depth (its nodes: StepStats.nodes)
                drafted = tree.depth()
            # a token that ended generation inside the step still counts as accepted, not as emitted
            step = StepStats(
                step=stats.steps,
                drafted=drafted,
                accepted=min(verified.accepted, drafted),
                emitted=len(emitted),
                decided=len(emitted) + (reply.finish == "eog"),
                draft_seconds=t1 - t0,
                verify_seconds=t2 - t1 - verified.rollback_seconds,
                planned=draft.planned,
                rollback_seconds=verified.rollback_seconds,
                source=draft.source if drafted else "",
                nodes=len(tree) if tree is not None else 0,
            )
            stats.add(step)
            if not forcing:  # a forced step teaches the policy nothing about its drafters
                policy.observe(step, emitted)
            stats.generate_seconds = time.perf_counter() - gen_started
            stats.rollback_recoveries = recoveries()
            yield StepEvent(step, stats.snapshot())
    except (GeneratorExit, KeyboardInterrupt):
        reply.finish = "interrupted"
        raise
    finally:
        # Whatever happened (stop, Ctrl-C, consumer gone), leave the target's cache holding exactly
        # the kept conversation minus its last token, so the next turn can reuse it.
        target.truncate(len(reply.context) - 1)
        stats.generate_seconds = time.perf_counter() - gen_started
        stats.rollback_recoveries = recoveries()
        policy.finish()
    tail = reply.close()
    yield Finished(
        text=reply.text(),
        token_ids=reply.generated,
        finish_reason=reply.finish,
        stats=stats,
        prompt_token_ids=prompt_ids,
        tail=tail,
    )


@dataclass(frozen=True)
class Verified:
    """What one verify step decided: the first `accepted` drafts, then the target's own `token` (the
    correction at a rejection, the bonus after all of them)."""

    accepted: int
    token: int
    rollback_seconds: float  # the target's checkpoint work inside the step

    def tokens(self, drafts: Sequence[int]) -> list[tuple[int, Source]]:
        """The decided tokens with where each came from."""
        if not drafts:
            return [(self.token, "target")]
        kept: list[tuple[int, Source]] = [(d, "accepted") for d in drafts[: self.accepted]]
        return kept + [(self.token, "resampled" if self.accepted < len(drafts) else "bonus")]


def verify_step(target: Backend, context: list[int], drafts: list[int], q: Sequence[Dist | None],
                params: SamplingParams, rng: np.random.Generator, forced: Sequence[int | None] | None = None) -> Verified:
    """Evaluate [context[-1], d1..dk] in one target batch, apply the rule to p1..p(k+1), and cut the
    target's cache back to context + the accepted drafts. `forced[i]`: a token the target's distribution
    at position i is constrained to (a reasoning budget), else None."""
    rollback_before = target.rollback_seconds
    if drafts:  # a recurrent target copies its state now if it cannot otherwise cut this batch back
        target.checkpoint(len(drafts) + 1)
    rows = target.eval([context[-1], *drafts], range(len(drafts) + 1), in_place=True)
    p = target_rows(rows, params, penalty_history(context, drafts, params))
    if forced is not None and any(t is not None for t in forced):
        p = ForcedRows(p, forced, target.n_vocab, params.greedy)
    if params.greedy:
        accepted, token = verify_greedy(p, drafts)
    else:
        accepted, token = verify(p, q, drafts, rng)
    # the cache holds context[:-1] + [context[-1]] + drafts: keep through the accepted ones
    target.truncate(len(context) + accepted)
    return Verified(accepted, token, target.rollback_seconds - rollback_before)


@dataclass(frozen=True)
class TreeVerified(Verified):
    """What one tree verify decided: the kept path's tokens, then the target's token (a bonus after a
    leaf, else the correction where the walk stopped)."""

    path_tokens: tuple[int, ...] = ()
    bonus: bool = False

    def tokens(self, drafts: Sequence[int]) -> list[tuple[int, Source]]:
        kept: list[tuple[int, Source]] = [(t, "accepted") for t in self.path_tokens]
        return kept + [(self.token, "bonus" if self.bonus else "resampled")]


def tree_to_verify(target: Backend, draft: Draft) -> DraftTree | None:
    """The draft's tree when it branches and the target can decode it in one batch; else None (the draft's
    `tokens`, its main branch, go as a chain)."""
    tree = getattr(draft, "tree", None)
    if tree is None or len(tree) == 0 or tree.is_chain():
        return None
    capacity = getattr(target, "tree_capacity", None)
    if capacity is None or len(tree.leaves()) > capacity():  # (0 while a head reads the target's rows)
        return None
    return tree


def verify_tree_step(target: Backend, context: list[int], tree: DraftTree, params: SamplingParams,
                     rng: np.random.Generator) -> TreeVerified:
    """Evaluate [context[-1]] + the tree's nodes in one target batch, walk the tree (tree.verify_tree),
    and keep the context plus the accepted path in the target's cache."""
    rows = target.eval_tree(context[-1], tree)
    history = path_history(penalty_window(context, params), tree) if params.has_penalty else (lambda i: ())
    path: list[int] = []
    try:
        if params.greedy:
            p = lazy_rows(len(rows), lambda i: greedy_token(rows[i], params, history(i)))
            path, token = verify_tree_greedy(p, tree)
        else:
            p = lazy_rows(len(rows), lambda i: process(rows[i], params, history(i)))
            path, token = verify_tree(p, tree, rng)
    finally:
        target.keep_branch(path)
    return TreeVerified(len(path), token, 0.0, tuple(tree.tokens[i] for i in path), ends_at_leaf(tree, path))


class ForcedRows:
    """The target's rows with a constraint applied: one-hot on the forced token where there is one (its
    argmax, greedy). Rows are still made on first use."""

    def __init__(self, rows, forced: Sequence[int | None], n_vocab: int, greedy: bool):
        self.rows, self.forced, self.n_vocab, self.greedy = rows, forced, n_vocab, greedy

    def __getitem__(self, i: int):
        token = self.forced[i]
        if token is None:
            return self.rows[i]
        return token if self.greedy else Dist.single(token, self.n_vocab)

    def __len__(self) -> int:
        return len(self.rows)


def penalty_history(context: Sequence[int], drafts: list[int], params: SamplingParams):
    """history(i): what the penalties of verify row i read. p_i is conditioned on context + d<i, and a
    penalty reads only its last repeat_last_n tokens: the window of the context plus d<i, so a row costs
    the same at any context length (nothing is built without a penalty: this is the per-token path)."""
    if not params.has_penalty:
        return lambda i: ()
    recent = penalty_window(context, params)
    return lambda i: recent + drafts[:i]


def target_rows(rows: np.ndarray, params: SamplingParams, history):
    """The target's processed rows as the rule reads them (argmax tokens when greedy), each made on first
    use: row 0 alone (k = 0, or a rejection at the first draft, needs no more), then the rest at once."""
    if params.greedy:
        return lazy_rows(len(rows), lambda i: greedy_token(rows[i], params, history(i)),
                         lambda start: greedy_rows(rows, params, history, start))
    return lazy_rows(len(rows), lambda i: process(rows[i], params, history(i)),
                     lambda start: process_rows(rows, params, history, start))


class Reply:
    """The generation so far: the context it extends (prompt + emitted tokens), its text, and once it is
    over, why (`finish`)."""

    def __init__(self, target: Backend, prompt_ids: list[int], max_tokens: int, stop: Sequence[str]):
        self.target = target
        self.max_tokens = max_tokens
        self.context = list(prompt_ids)
        self.generated: list[int] = []
        self.finish: str | None = None
        self._detok = Detokenizer(target.token_bytes)
        self._stopper = StopMatcher(list(stop))
        self._pieces: list[str] = []

    def draft_limit(self, drafter: Drafter | None) -> int | None:
        """The most drafts the next step could use (drafts beyond the token budget or the context could
        never be emitted), or None when generation is over (finish says why)."""
        if self.finish is None and len(self.generated) >= self.max_tokens:
            self.finish = "length"
        room = self.target.n_ctx - len(self.context)
        if self.finish is None and room <= 0:
            self.finish = "context"
        if self.finish is not None:
            return None
        limit = min(self.max_tokens - len(self.generated) - 1, room - 1)
        if drafter is not None:
            limit = min(limit, drafter.room() - len(self.context) - 1)
        return limit

    def emit(self, decided: list[tuple[int, Source]], step: int) -> Iterator[TokenEvent]:
        """Append the step's tokens in order, each as a TokenEvent, until one ends generation."""
        for token, source in decided:
            if self.target.is_eog(token):
                self.finish = "eog"
                return
            self.context.append(token)
            self.generated.append(token)
            text, hit = self._stopper.feed(self._detok.push(token))
            self._pieces.append(text)
            yield TokenEvent(token, text, source, step)
            if hit:
                self.finish = "stop"
                return
            if len(self.generated) >= self.max_tokens:
                self.finish = "length"
                return

    def close(self) -> str:
        """The text held back until the end (none after a stop string)."""
        tail = "" if self.finish == "stop" else self._detok.flush() + self._stopper.flush()
        self._pieces.append(tail)
        return tail

    def text(self) -> str:
        return "".join(self._pieces)
