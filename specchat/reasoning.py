"""Thinking in a reply: where a model's thought starts and ends, and which tokens belong to it.

A reasoning model writes its thought between two markers (`<think>` ... `</think>` for most families,
`<|START_THINKING|>` ... `<|END_THINKING|>` for Command-R, `<|channel>thought` ... `<channel|>` for Gemma 4,
gpt-oss's analysis channel), and a template may open the thought itself at the end of the prompt (the reply
then starts inside it). The markers are found as llama.cpp's chat layer finds them (common/chat.cpp and
chat-diff-analyzer.cpp): by rendering an assistant turn with a `reasoning_content` and reading the markers
around it (gpt-oss's channels are known by name, as llama.cpp gives them a parser of their own); a template
that drops the thought from history is read for the markers its source names. Whether the prompt opened
the thought is read from the rendered prompt itself.

The split is made on token ids, as llama.cpp's reasoning budget matches its start and end sequences: a
marker is the token sequence the model's tokenizer gives it (special tokens parsed), and a token that may
begin a marker is held back until the marker completes or cannot. Marker tokens belong to no phase: they
are shown neither as thought nor as answer.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from .engine import Finished, StepEvent, TokenEvent
from .jinja_chat import render_chat, specialized_handler
from .stats import RunStats
from .template import chat_format

Phase = Literal["thought", "answer"]
FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")  # --reasoning-format, as llama.cpp names them

# llama.cpp's probe texts (chat-diff-analyzer.cpp): unlikely to occur in any template
USER_MSG = "U_USER_MSG Hello END_U"
ASSISTANT_MSG = "A_ASST_MSG I can help END_A"
THINKING_CONTENT = "REASON_PART I am thinking END_R"

# a marker: <...> or [...] (llama.cpp's segmentize_markers), with a word after it on the same line where the
# opener is generic (Gemma 4's `<|channel>thought`)
_MARKER = r"(?:<[^<>\s]*>|\[[^\[\]\s]*\])"
_BEFORE = re.compile(rf"({_MARKER}(?:[A-Za-z_]+)?)\s*$")
_AFTER = re.compile(rf"^\s*({_MARKER})")

# gpt-oss writes its thought in the analysis channel and its answer in the final one (harmony); llama.cpp
# gives it a parser of its own (common_chat_params_init_gpt_oss)
HARMONY = ("<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant<|channel|>final<|message|>")

# markers read from a template's source where rendering shows none: the thought is dropped from history, or
# kept under another variable than reasoning_content (Gemma 4's, Apertus's)
KNOWN = (("<|channel>thought", "<channel|>"), ("<|inner_prefix|>", "<|inner_suffix|>"), ("<think>", "</think>"),
         ("<|START_THINKING|>", "<|END_THINKING|>"), ("<seed:think>", "</seed:think>"), ("<mm:think>", "</mm:think>"),
         ("<thinking>", "</thinking>"))

Render = Callable[[list[dict], bool, bool], str]  # (messages, add_generation_prompt, enable_thinking) -> prompt


@dataclass(frozen=True)
class Markers:
    """The text that opens and closes a thought; `answer_prefix`: text that opens the answer after it
    (gpt-oss's final channel), hidden like the markers."""

    start: str
    end: str
    answer_prefix: str = ""


def find_markers(source: str, render: Render) -> Markers | None:
    """The thinking markers of a chat template (its Jinja `source`), or None for a template that has none.

    `render` renders messages with the template; a template that fails on the probes is read from its
    source alone."""
    handler = specialized_handler(source)  # llama.cpp's dedicated parsers know these markers by name
    if handler == "gpt-oss":
        return Markers(*HARMONY)
    if handler == "kimi-k2":
        return Markers("<think>", "</think>")
    user = {"role": "user", "content": USER_MSG}
    start = end = ""
    try:
        with_thought = render([user, {"role": "assistant", "content": ASSISTANT_MSG,
                                      "reasoning_content": THINKING_CONTENT}], False, True)
    except Exception:  # a template that refuses the probe: judged by its source below
        with_thought = ""
    at = with_thought.find(THINKING_CONTENT)
    if at >= 0:
        before = _BEFORE.search(with_thought[:at])
        after = _AFTER.search(with_thought[at + len(THINKING_CONTENT):])
        start = before.group(1) if before else ""
        end = after.group(1) if after else ""
    if not start or not end:
        # templates that drop the thought from history (the DeepSeek R1 distills) still name their markers
        for open_, close in KNOWN:
            if open_ in source and close in source and (not end or end == close):
                start, end = start or open_, close
                break
    if not end:
        return None
    return Markers(start, end)


def opens_thought(prompt: str, markers: Markers | None) -> bool:
    """Whether a rendered prompt ends inside a thought (the template opened it: the reply starts thinking)."""
    if markers is None or not markers.start:
        return False
    tail = prompt.rstrip()
    return tail.endswith(markers.start) and not tail.endswith(markers.end)


def closes_thought(prompt: str, markers: Markers | None) -> bool:
    """Whether a rendered prompt ends with a thought already closed (thinking off: `<think></think>`): the
    reply is answer only, and llama.cpp's parser for it reads no thought."""
    return markers is not None and prompt.rstrip().endswith(markers.end)


@dataclass
class Split:
    """A reply's text by phase, as llama-server's `deepseek` format returns it."""

    reasoning_content: str = ""
    content: str = ""
    thought_tokens: int = 0
    answer_tokens: int = 0
    # speculation in each phase: a verify step counts where the reply was when it began
    stats: dict[str, RunStats] = field(default_factory=lambda: {"thought": RunStats(), "answer": RunStats()})

    def add(self, phase: Phase, text: str, tokens: int = 1) -> None:
        if phase == "thought":
            self.reasoning_content += text
            self.thought_tokens += tokens
        else:
            self.content += text
            self.answer_tokens += tokens


class PhaseSplitter:
    """Follows a reply token by token: which phase each token belongs to ("marker" for the tokens of a
    marker, shown as neither). Items travel with their token ids and come out in order, a token that may
    begin a marker held back until the marker completes or cannot.

    `start_ids` / `end_ids` / `answer_ids`: each marker as token sequences (a marker may tokenize more than
    one way); `inside`: the prompt opened the thought. An end marker with no thought open is answer text, as
    llama.cpp's parsers keep it."""

    def __init__(self, start_ids: Sequence[Sequence[int]], end_ids: Sequence[Sequence[int]], *,
                 inside: bool = False, answer_ids: Sequence[Sequence[int]] = ()):
        self.opening = [tuple(s) for s in start_ids if s]
        self.closing = [tuple(s) for s in end_ids if s]
        self.answer_opening = [tuple(s) for s in answer_ids if s]
        self.phase: Phase = "thought" if inside else "answer"
        self._held: list[tuple[int, object]] = []

    def _watched(self) -> list[tuple[tuple[int, ...], str]]:
        if self.phase == "thought":
            return [(s, "close") for s in self.closing]
        return [(s, "open") for s in self.opening] + [(s, "answer") for s in self.answer_opening]

    def feed(self, token: int, item: object) -> list[tuple[str, object]]:
        """(phase, item) pairs that are decided now, in order."""
        self._held.append((token, item))
        ids = tuple(t for t, _ in self._held)
        watched = self._watched()
        for seq, kind in watched:
            if ids[-len(seq):] == seq:  # a marker completed: what came before it is released first
                cut = len(self._held) - len(seq)
                out = [(self.phase, it) for _, it in self._held[:cut]] + [("marker", it) for _, it in self._held[cut:]]
                self._held = []
                self.phase = "thought" if kind == "open" else "answer"
                return out
        keep = 0  # the longest tail that is still a prefix of some marker
        for seq, _ in watched:
            for n in range(min(len(seq) - 1, len(ids)), keep, -1):
                if ids[-n:] == seq[:n]:
                    keep = n
                    break
        cut = len(self._held) - keep
        out = [(self.phase, it) for _, it in self._held[:cut]]
        self._held = self._held[cut:]
        return out

    def flush(self) -> list[tuple[str, object]]:
        out = [(self.phase, it) for _, it in self._held]
        self._held = []
        return out


def marker_ids(tokenize: Callable[[str], list[int]], markers: Markers) -> dict[str, list[list[int]]]:
    """Each marker as the token sequences the model may write it as: parsed as special tokens, and with the
    whitespace templates put around it (a tokenizer may fold a newline into the marker's token)."""
    def forms(text: str) -> list[list[int]]:
        seqs: list[list[int]] = []
        for variant in ((text, text + "\n", "\n" + text) if text else ()):
            ids = tokenize(variant)
            if ids and ids not in seqs:
                seqs.append(ids)
        return seqs

    return {"start": forms(markers.start), "end": forms(markers.end), "answer": forms(markers.answer_prefix)}


@dataclass
class Reasoning:
    """What a run needs to split its reply: the markers as ids, whether the prompt opened the thought, and
    --reasoning-format (`none`: no split, everything is answer)."""

    markers: Markers
    ids: dict[str, list[list[int]]]
    inside: bool = False
    format: str = "deepseek"

    def splitter(self) -> PhaseSplitter:
        return PhaseSplitter(self.ids["start"], self.ids["end"], inside=self.inside, answer_ids=self.ids["answer"])


@dataclass(frozen=True)
class ReasoningOptions:
    """--reasoning-format, --reasoning-budget and its message: how a run treats a thought."""

    format: str = "auto"
    budget: int = -1  # -1: no limit
    budget_message: str | None = None


@functools.lru_cache(maxsize=16)
def _markers_of(source: str, bos: str, eos: str) -> Markers | None:
    def render(messages, add_generation_prompt, enable_thinking):
        return render_chat(source, messages, bos_token=bos, eos_token=eos,
                           add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)

    return find_markers(source, render)


def prepare(backend, prompt_text: str, options: ReasoningOptions) -> Reasoning | None:
    """How to split this run's reply: None for a model whose template has no thinking markers (or a
    conversation without a template)."""
    source = chat_format(backend).source
    if not source:
        return None
    markers = _markers_of(source, backend.bos_text, backend.eos_text)
    if markers is None or closes_thought(prompt_text, markers):
        return None
    ids = marker_ids(lambda text: backend.tokenize(text, add_special=False, parse_special=True), markers)
    fmt = "deepseek" if options.format == "auto" else options.format
    return Reasoning(markers, ids, inside=opens_thought(prompt_text, markers), format=fmt)


def split_events(events: Iterable, reasoning: Reasoning | None, split: Split | None = None) -> Iterator:
    """The engine's events with each TokenEvent's `phase` set ("thought", "answer", or "marker" with its text
    left out), and Finished carrying the `Split` (built in `split` when given: a consumer stopped early still
    has the reply so far). Unchanged where `reasoning` is None or its format is `none`. Order is kept; a token
    that may begin a marker comes out with the ones after it."""
    if reasoning is None or reasoning.format == "none":
        yield from events
        return
    splitter = reasoning.splitter()
    split = split if split is not None else Split()
    legacy = reasoning.format == "deepseek-legacy"  # the split is made, the text left whole

    def decided(pairs):
        for phase, event in pairs:
            if phase != "marker":
                split.add(phase, event.text)
            if legacy:
                yield event
            elif phase == "marker":
                yield replace(event, text="", phase="marker")
            else:
                yield replace(event, phase=phase)

    step_phase, step = splitter.phase, None
    try:
        for event in events:
            if isinstance(event, StepEvent):
                phase_stats = split.stats[step_phase]
                phase_stats.add(event.stats)
                phase_stats.generate_seconds += (event.stats.draft_seconds + event.stats.verify_seconds
                                                 + event.stats.rollback_seconds)
            if isinstance(event, TokenEvent):
                if event.step != step:  # the step's first token: the step counts in the phase it began in
                    step_phase, step = splitter.phase, event.step
                yield from decided(splitter.feed(event.id, event))
            elif isinstance(event, Finished):
                yield from decided(splitter.flush())
                if event.tail:
                    split.add(splitter.phase, event.tail, 0)
                if legacy:
                    split.content = event.text
                elif split.thought_tokens:  # as llama.cpp returns them: no blank lines around either part
                    split.reasoning_content, split.content = split.reasoning_content.strip(), split.content.strip()
                yield replace(event, split=split)
            else:
                yield event
    finally:
        close = getattr(events, "close", None)  # the engine settles its caches when closed (Ctrl-C, a stop)
        if close is not None:
            close()


class Budget:
    """--reasoning-budget as llama.cpp's reasoning-budget sampler (common/reasoning-budget.cpp): a state
    machine over the emitted tokens. IDLE until a start marker; COUNTING the thought's tokens (a natural
    end marker: DONE); when the budget is spent, WAITING for a character's last byte, then FORCING the
    message and the end marker one token at a time; DONE until a new start marker re-arms it.

    It is a constraint on the target's distribution: one-hot on the forced token while FORCING, the model's
    own elsewhere. The engine verifies every position against that distribution (`lookahead` says where a
    step's positions are forced), so the rule keeps the output exactly the budgeted target's whatever was
    drafted; and while FORCING it sends the forced tokens themselves as the step's draft (all accepted)."""

    IDLE, COUNTING, WAITING, FORCING, DONE = "idle", "counting", "waiting", "forcing", "done"

    def __init__(self, start_ids: Sequence[Sequence[int]], end_ids: Sequence[Sequence[int]],
                 forced: Sequence[int], budget: int, *, inside: bool = False,
                 complete: Callable[[int], bool] = lambda token: True):
        self.starts = [tuple(s) for s in start_ids if s]
        self.ends = [tuple(s) for s in end_ids if s]
        self.forced_ids = list(forced)
        self.budget = budget
        self.complete = complete  # whether a token ends on a whole UTF-8 character
        self.recent: list[int] = []  # the last tokens, to match markers
        self.remaining = budget
        self.force_pos = 0
        self.state = self.IDLE
        self.forced_count = 0  # tokens this run forced
        if inside:
            self._arm()

    def _arm(self) -> None:
        self.recent = []
        self.remaining = self.budget
        self.state = self.COUNTING
        if self.remaining <= 0:
            self.state, self.force_pos = self.FORCING, 0

    def _ends_with(self, seqs) -> bool:
        return any(tuple(self.recent[-len(s):]) == s for s in seqs)

    def forced(self) -> int | None:
        """The token the budgeted distribution puts all its mass on at the next position, if any."""
        return self.forced_ids[self.force_pos] if self.state == self.FORCING else None

    def lookahead(self, drafts: Sequence[int]) -> list[int | None]:
        """The forced token (or None) at each verify position 0..k of a step that drafts `drafts`: position i
        follows the context and d<i. The state itself is left as it is."""
        probe = copy.copy(self)
        probe.recent = list(self.recent)
        out = [probe.forced()]
        for token in drafts:
            probe.accept(token)
            out.append(probe.forced())
        return out

    def constrain(self, drafts: Sequence[int], limit: int) -> tuple[int, list[int]]:
        """A drafter's proposal under the budget, as its q would be if the drafter knew the budget: (how many
        of `drafts` stand, the forced tokens that take the place of the rest). Up to the first position where
        the budget forces a token the draft did not propose, the draft stands; from there the forced tokens
        (one-hot, so q = None) replace it, `limit` tokens in all. The state itself is left as it is."""
        probe = copy.copy(self)
        probe.recent = list(self.recent)
        for i, token in enumerate(drafts):
            forced = probe.forced()
            if forced is not None and forced != token:
                return i, probe.forced_rest()[: max(0, limit - i)]
            probe.accept(token)
        return len(drafts), []

    def forced_rest(self) -> list[int]:
        """The forced tokens still to come (empty unless FORCING)."""
        return self.forced_ids[self.force_pos:] if self.state == self.FORCING else []

    def accept(self, token: int) -> None:
        self.recent = (self.recent + [token])[-16:]
        if self.state in (self.IDLE, self.DONE):
            if self._ends_with(self.starts):
                self._arm()
        elif self.state in (self.COUNTING, self.WAITING):
            if self._ends_with(self.ends):
                self.state = self.DONE
                self.recent = []
                return
            if self.state == self.COUNTING:
                self.remaining -= 1
                if self.remaining <= 0:
                    self.state = self.WAITING
            if self.state == self.WAITING and self.complete(token):
                self.state, self.force_pos = self.FORCING, 0
        elif self.state == self.FORCING:
            self.forced_count += 1
            self.force_pos += 1
            if self.force_pos >= len(self.forced_ids):
                self.state = self.DONE
                self.recent = []


def budget_for(reasoning: Reasoning | None, options: ReasoningOptions, target) -> Budget | None:
    """The run's Budget, or None without a budget (-1) or without thinking markers. The forced tokens are
    the message and the end marker, as llama-server tokenizes them (special tokens parsed)."""
    if reasoning is None or options.budget < 0 or not reasoning.ids["end"]:
        return None
    message = target.tokenize(options.budget_message, add_special=False, parse_special=True) \
        if options.budget_message else []
    forced = message + reasoning.ids["end"][0]

    def complete(token: int) -> bool:
        piece = target.token_bytes(token)
        try:
            piece.decode("utf-8")
            return True
        except UnicodeDecodeError as e:
            return e.reason != "unexpected end of data"

    return Budget(reasoning.ids["start"], reasoning.ids["end"], forced, options.budget, inside=reasoning.inside,
                  complete=complete)
