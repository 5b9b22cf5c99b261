"""A conversation whose KV caches carry over from turn to turn: the chat as a library object.

KV reuse. `Conversation` keeps the exact token ids the target has seen (every prompt as sent plus every
token generated) and the text they stand for, instead of re-tokenising old replies: BPE can tokenise a
reply's text differently from the ids that were generated, and one differing token early on would
invalidate the whole cache after it. A new turn renders the conversation with the new user message; when
that text starts with the text already held, only the difference (the template's end of the last turn,
the new message, the generation prompt) is tokenised and appended to the held ids. `engine.generate`
then syncs the target to the new prompt by common prefix, so the turn evaluates only its new tokens. If
the rendering does not extend what is held (a template that rewrites earlier turns, a changed system
message, turns dropped for room) the whole conversation is tokenised again and sync still reuses
whatever prefix survives.

Models without a chat template (gemma-3-270m is a base model) use template.FALLBACK: a plain
"User: ... / Assistant: ..." transcript that stops at the next "\\nUser:".

    conv = specchat.Conversation(pair.target, pair.drafter, params=specchat.SamplingParams(temperature=0))
    for event in conv.send("Name three rivers."):   # TokenEvent ..., StepEvent ..., Finished
        ...
    for event in conv.send("Which is longest?"):    # evaluates only this turn's new tokens
        ...

A turn that stops early (the caller closes it, or Ctrl-C) keeps the reply as far as it went, as the
terminal chat does; a turn that fails (a SpecchatError, such as a decode failure) keeps nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .backend import Backend
from .drafters import Drafter
from .engine import MAX_TOKENS, Finished, StepEvent, TokenEvent, generate
from .policy import Policy
from .reasoning import ReasoningOptions, Split, budget_for, prepare as prepare_reasoning, split_events
from .sampling import SamplingParams
from .stats import RunStats
from .template import FALLBACK_STOP, has_template, render_text, tokenize_rendered


@dataclass
class Prepared:
    """The prompt for one turn."""

    user: str
    ids: list[int]
    text: str
    reused: int  # leading ids carried over from the previous turn as they were (not re-tokenised)


class Conversation:
    """The messages of a chat and the exact ids the target holds for them. `send` starts a turn (a
    `Turn`, iterated for the engine's events); `prepare` / `fit` / `commit` are its steps. The sampling
    parameters, drafter, policy and token budget are read when a turn starts: the terminal chat changes
    them between turns (/temp, /spec, /draft)."""

    def __init__(self, target: Backend, drafter: Drafter | None = None, *, system: str | None = None,
                 params: SamplingParams | None = None, max_tokens: int = MAX_TOKENS, policy: Policy | None = None,
                 stop: Sequence[str] = (), reasoning: ReasoningOptions | None = None):
        self.target = target
        self.drafter = drafter
        self.params = params if params is not None else SamplingParams()
        self.max_tokens = max_tokens
        self.policy = policy
        self.extra_stop = list(stop)
        self.reasoning = reasoning if reasoning is not None else ReasoningOptions()
        self.rng = np.random.default_rng(self.params.seed)
        self.system = system or None
        self.turns: list[dict] = []  # user / assistant messages, alternating, oldest first
        self.templated = has_template(target)
        self._text = ""  # what the target has seen, as text ...
        self._ids: list[int] = []  # ... and as the exact ids

    @property
    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    @property
    def stops(self) -> list[str]:
        return [] if self.templated else list(FALLBACK_STOP)

    def forget_tokens(self) -> None:
        """The next turn tokenises the whole conversation again (the held prefix no longer applies)."""
        self._text, self._ids = "", []

    def set_system(self, system: str | None) -> None:
        self.system = system or None
        self.forget_tokens()

    def reset(self) -> None:
        self.turns = []
        self.forget_tokens()

    def prepare(self, user: str) -> Prepared:
        text = render_text(self.target, [*self.messages, {"role": "user", "content": user}], True)
        if self._ids and text.startswith(self._text):
            new = self.target.tokenize(text[len(self._text):], add_special=False, parse_special=self.templated)
            return Prepared(user, self._ids + new, text, len(self._ids))
        return Prepared(user, tokenize_rendered(self.target, text), text, 0)

    def fit(self, user: str, room: int) -> tuple[Prepared, int]:
        """Prepare the turn, dropping the oldest user/assistant pairs (never the system message) until
        the prompt plus `room` tokens for the reply fit the context. Returns (prompt, turns dropped)."""
        dropped = 0
        while True:
            prepared = self.prepare(user)
            if len(prepared.ids) + room <= self.target.n_ctx or not self.turns:
                return prepared, dropped
            self.turns = self.turns[2:]
            dropped += 1
            self.forget_tokens()

    def commit(self, prepared: Prepared, reply: str, generated: Sequence[int], split: Split | None = None) -> dict:
        """Record the turn. The held ids become exactly what the target saw: prompt + generated. A reasoning
        model's reply is recorded as its answer with the thought beside it (`reasoning_content`): the
        template decides what of it the next prompt shows."""
        content = reply if self.templated else reply.strip()
        message = {"role": "assistant", "content": content}
        if split is not None:
            message["content"] = split.content if self.reasoning.format != "deepseek-legacy" else content
            if split.reasoning_content:
                message["reasoning_content"] = split.reasoning_content
        self.turns += [{"role": "user", "content": prepared.user}, message]
        # Hold only the generated ids whose text is part of the reply: a reply cut at a stop string
        # ("\nAssistant:") generated that string's tokens too, and holding them would stop the next
        # rendering from extending the held text. Those few tokens are rolled back at the next sync.
        kept, seen = [], b""
        for token in generated:
            piece = seen + self.target.token_bytes(token)
            if not reply.encode("utf-8").startswith(piece):
                break
            kept.append(token)
            seen = piece
        self._ids = prepared.ids + kept
        self._text = prepared.text + seen.decode("utf-8", "replace")
        return message

    def restore(self, turns: Sequence[dict]) -> list[int]:
        """Load earlier turns (--resume); returns the ids that hold them, for one prefill."""
        self.turns = [{k: m[k] for k in ("role", "content", "reasoning_content") if k in m} for m in turns]
        self.forget_tokens()
        if self.turns:
            self._text = render_text(self.target, self.messages, False)
            self._ids = tokenize_rendered(self.target, self._text)
        return self.ids

    def room(self, max_tokens: int) -> int:
        """Tokens kept free for a reply when old turns must be dropped: the reply, at most half the context."""
        return min(max_tokens, max(1, self.target.n_ctx // 2))

    def send(self, user: str, *, max_tokens: int | None = None) -> Turn:
        """Start one turn: fit it into the context (the oldest exchanges are dropped when it is full) and
        return it; iterating it yields the engine's events (TokenEvent, StepEvent, then Finished) and
        records the reply (the engine raises PromptTooLong first when the message alone fills the context)."""
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        prepared, dropped = self.fit(user, self.room(max_tokens))
        return Turn(self, prepared, dropped, max_tokens)

    prompt = send  # the name simonw/llm uses for the same thing


class Turn:
    """One exchange in progress: iterate it (once) for the engine's events. The reply is recorded in the
    conversation when generation finishes, or when it stops early (`close()`, Ctrl-C) after at least one
    token, as far as it went; a turn that fails records nothing. Afterwards `message` is the recorded
    reply (None when nothing was), with `finish_reason` and `stats`."""

    def __init__(self, conversation: Conversation, prepared: Prepared, dropped: int, max_tokens: int):
        self.conversation = conversation
        self.prepared = prepared
        self.dropped = dropped  # oldest exchanges dropped to make room
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []  # emitted so far
        self.pieces: list[str] = []  # the text they made visible so far
        self.split: Split | None = None  # a reasoning model's reply so far, thought and answer apart
        self.stats: RunStats | None = None  # the run's totals as of the last step
        self.finish_reason: str | None = None
        self.message: dict | None = None
        self._events = self._run()

    def __iter__(self) -> Iterator:
        return self._events

    def close(self) -> None:
        """Stop the turn where it is (the cache is cut back to what was emitted)."""
        self._events.close()

    def _run(self) -> Iterator:
        conv = self.conversation
        reasoning = prepare_reasoning(conv.target, self.prepared.text, conv.reasoning) if conv.templated else None
        if reasoning is not None and reasoning.format != "none":
            self.split = Split()  # filled as the reply comes: a turn stopped early keeps its thought
        budget = budget_for(reasoning, conv.reasoning, conv.target)
        events = split_events(
            generate(conv.target, conv.drafter, self.prepared.ids, conv.params, max_tokens=self.max_tokens,
                     stop=conv.stops + conv.extra_stop, policy=conv.policy, rng=conv.rng, budget=budget,
                     phases=reasoning.splitter() if reasoning is not None else None),
            reasoning, self.split)
        try:
            for event in events:
                if isinstance(event, TokenEvent):
                    self.token_ids.append(event.id)
                    self.pieces.append(event.text)
                elif isinstance(event, StepEvent):
                    self.stats = event.totals
                elif isinstance(event, Finished):
                    self._record(event.text, event.token_ids, event.finish_reason, event.stats)
                yield event
        except (GeneratorExit, KeyboardInterrupt):
            events.close()  # first: the engine settles the cache and the run's totals
            if self.message is None and self.token_ids:
                stats = self.stats or RunStats(prompt_tokens=len(self.prepared.ids), emitted=len(self.token_ids))
                self._record("".join(self.pieces), self.token_ids, "interrupted", stats)
            raise
        finally:
            events.close()

    def _record(self, reply: str, ids: Sequence[int], reason: str, stats: RunStats) -> None:
        self.message = self.conversation.commit(self.prepared, reply, ids, self.split)
        self.finish_reason, self.stats = reason, stats
