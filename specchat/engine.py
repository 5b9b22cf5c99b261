"""The draft/verify loop: one generator that yields every token as it is decided.

Invariant between steps: `context` is the prompt plus every emitted token; the target's cache holds
context[:-1]. A step evaluates [context[-1], d1..dk] in ONE target batch, which yields p1..p(k+1);
`sampling.verify` keeps a prefix of the drafts and adds one target token; the cache is cut back to the
kept tokens. k = 0 is plain decoding through the same code.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .backend import Backend, BackendError, sync
from .detok import Detokenizer, StopMatcher
from .drafters import Draft, Drafter
from .policy import FixedPolicy, Policy
from .sampling import (
    SamplingParams, greedy_rows, greedy_token, lazy_rows, process, process_rows, verify, verify_greedy,
)
from .stats import RunStats, StepStats

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


@dataclass(frozen=True)
class StepEvent:
    """Emitted after the tokens of each verify step."""

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
) -> Iterator[Event]:
    """Yield TokenEvent and StepEvent as generation goes, then one Finished.

    The target's output distribution is exactly what plain sampling from it would give (see
    sampling.verify); the drafter and policy only change how many target evaluations it takes.
    """
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise ValueError("empty prompt: nothing to condition on")
    check_fits(prompt_ids, target.n_ctx)
    if policy is None:
        policy = FixedPolicy(0 if drafter is None else 8)
    rng = rng if rng is not None else np.random.default_rng(params.seed)
    stats = RunStats(prompt_tokens=len(prompt_ids))
    # every model whose cache this run cuts: the target and a draft model's
    draft_backend = getattr(drafter, "backend", None)  # a test's scripted drafter may not say
    backends = [target] + ([draft_backend] if draft_backend is not None else [])
    recoveries_before = sum(b.rollback_recoveries for b in backends)

    started = time.perf_counter()
    evaluated_before = target.evaluated
    sync(target, prompt_ids[:-1], logits_last=False, turn=True)
    if drafter is not None and policy.drafting_possible:
        drafter.prefill(prompt_ids)
    stats.prompt_tokens_evaluated = target.evaluated - evaluated_before + 1  # the last one goes with step 1
    stats.prefill_seconds = time.perf_counter() - started

    context = list(prompt_ids)
    generated: list[int] = []
    detok = Detokenizer(target.token_bytes)
    stopper = StopMatcher(list(stop))
    pieces: list[str] = []
    finish: str | None = None
    gen_started = time.perf_counter()
    try:
        while finish is None:
            if len(generated) >= max_tokens:
                finish = "length"
                break
            room = target.n_ctx - len(context)
            if room <= 0:
                finish = "context"
                break
            # drafts beyond the token budget could never be emitted
            limit = min(max_tokens - len(generated) - 1, room - 1)
            if drafter is not None:
                limit = min(limit, drafter.room() - len(context) - 1)
            k = policy.plan(max(0, limit)) if drafter is not None else 0

            t0 = time.perf_counter()
            draft = drafter.propose(context, k, params, rng) if k > 0 else Draft()
            proposed = draft.tokens
            n_send = policy.trim(draft) if proposed else 0
            drafts, q = proposed[:n_send], draft.q[:n_send]
            t1 = time.perf_counter()
            rollback_before = target.rollback_seconds
            if drafts:  # a recurrent target copies its state now if it cannot otherwise cut this batch back
                target.checkpoint(len(drafts) + 1)
            rows = target.eval([context[-1], *drafts], range(len(drafts) + 1), in_place=True)
            # p_i is conditioned on context + d<i: penalties must see the drafts before position i
            # (the history list is built only when a penalty will read it: this is the per-token path)
            history = (lambda i: context + drafts[:i]) if params.has_penalty else (lambda i: ())
            # row 0 alone (k = 0, or a rejection at the first draft, needs no more), then the rest at once
            if params.greedy:
                argmax = lazy_rows(len(rows), lambda i: greedy_token(rows[i], params, history(i)),
                                   lambda start: greedy_rows(rows, params, history, start))
                n_accepted, next_token = verify_greedy(argmax, drafts)
            else:
                p = lazy_rows(len(rows), lambda i: process(rows[i], params, history(i)),
                              lambda start: process_rows(rows, params, history, start))
                n_accepted, next_token = verify(p, q, drafts, rng)
            # the cache holds context[:-1] + [context[-1]] + drafts: keep through the accepted ones
            target.truncate(len(context) + n_accepted)
            t2 = time.perf_counter()
            rollback = target.rollback_seconds - rollback_before

            if not drafts:
                sources = ["target"]
            else:
                sources = ["accepted"] * n_accepted + ["resampled" if n_accepted < len(drafts) else "bonus"]
            emitted: list[int] = []
            for token, source in zip([*drafts[:n_accepted], next_token], sources):
                if target.is_eog(token):
                    finish = "eog"
                    break
                context.append(token)
                generated.append(token)
                emitted.append(token)
                text, hit = stopper.feed(detok.push(token))
                pieces.append(text)
                yield TokenEvent(token, text, source, stats.steps)
                if hit:
                    finish = "stop"
                    break
                if len(generated) >= max_tokens:
                    finish = "length"
                    break
            # a token that ended generation inside the step still counts as accepted, not as emitted
            step = StepStats(
                step=stats.steps,
                drafted=len(drafts),
                accepted=n_accepted,
                emitted=len(emitted),
                decided=len(emitted) + (finish == "eog"),
                draft_seconds=t1 - t0,
                verify_seconds=t2 - t1 - rollback,
                planned=k,
                rollback_seconds=rollback,
                source=draft.source if drafts else "",
            )
            stats.add(step)
            policy.observe(step, proposed, emitted)
            stats.generate_seconds = time.perf_counter() - gen_started
            yield StepEvent(step, stats)
    except GeneratorExit:
        finish = "interrupted"
        raise
    except KeyboardInterrupt:
        finish = "interrupted"
        raise
    finally:
        # Whatever happened (stop, Ctrl-C, consumer gone), leave the target's cache holding exactly
        # the kept conversation minus its last token, so the next turn can reuse it.
        target.truncate(len(context) - 1)
        stats.generate_seconds = time.perf_counter() - gen_started
        stats.rollback_recoveries = sum(b.rollback_recoveries for b in backends) - recoveries_before
        policy.finish()
    tail = "" if finish == "stop" else detok.flush() + stopper.flush()
    pieces.append(tail)
    yield Finished(
        text="".join(pieces),
        token_ids=generated,
        finish_reason=finish,
        stats=stats,
        prompt_token_ids=prompt_ids,
        tail=tail,
    )
