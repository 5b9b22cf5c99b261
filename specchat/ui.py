"""What the user sees: tokens coloured by where they came from, a live footer, a summary per reply.

One Rich theme names every style by what it means (`spec.accepted` is a draft token the target
accepted, `spec.resampled` the target's correction at a rejection, `spec.bonus` the extra target token
after a fully accepted draft, `spec.target` a token from plain decoding). The views only consume engine
events (TokenEvent / StepEvent / Finished); they never touch a model.

`LiveView` (a terminal): the reply streams above a transient footer held in a `rich.live.Live` region.
Live redraws its region by moving the cursor up, which only works for whole rows, so the reply is
committed above the region row by row: every finished line, and every wrapped row but the last two of
the line being written (greedy word wrap never moves a row break once a later row has started). The
region holds those last rows and the footer; when the reply ends, the footer is erased and the rows are
printed for good.

A reasoning model's thought (TokenEvents whose phase is "thought", reasoning.split_events) streams in its own
style in the live region, its last THOUGHT_ROWS rows under a "thinking" label, and folds to one line
(`thought_line`) when the answer starts or the reply ends.

`PlainView` (a pipe): the answer only, written as it comes, nothing else on stdout.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import TextIO

from rich.cells import cell_len
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text
from rich.theme import Theme

from . import kinds
from .engine import Finished, StepEvent, TokenEvent
from .stats import RunStats, StepStats

THEME = Theme(
    {
        # the tokens, by source (engine.Source)
        "spec.accepted": "green",  # drafted, and accepted by the target
        "spec.resampled": "bold red",  # the target's correction at the first rejected draft token
        "spec.bonus": "bold cyan",  # the target's extra token after every draft token was accepted
        "spec.target": "default",  # plain decoding: no draft at this step
        # around the tokens
        "spec.footer": "dim",
        "spec.footer.value": "bold",
        "spec.summary": "dim",
        "spec.legend": "dim",
        "spec.notice": "yellow",
        "spec.error": "bold red",
        "spec.prompt": "bold magenta",
        "spec.user": "bold",
        "spec.help.key": "bold",
        # a reasoning model's thought: apart from the answer while it streams, one line once it is done
        "spec.thought": "dim italic",
        "spec.thought.label": "dim bold",
    }
)

THOUGHT_ROWS = 4  # rows of a streaming thought kept in view (the rest scrolls away; /thought shows it all)

SOURCE_STYLE = {
    "accepted": "spec.accepted",
    "resampled": "spec.resampled",
    "bonus": "spec.bonus",
    "target": "spec.target",
}

LEGEND_ITEMS = (
    ("accepted", "accepted draft"),
    ("resampled", "resampled by the target"),
    ("bonus", "bonus (all accepted)"),
    ("target", "target only"),
)

# live rows kept below the committed text: the row being written and the one before it
PENDING_ROWS = 2
_WORD = re.compile(r"\s*\S+\s*")


def row_starts(line: str, width: int) -> list[int]:
    """Offsets where rows 2..n of `line` begin when the console word-wraps it at `width` cells (a word
    longer than a row is folded), as Rich wraps text it prints."""
    starts: list[int] = []
    position = 0  # cells used on the current row
    for m in _WORD.finditer(line):
        start, word = m.start(), m.group()
        length = cell_len(word.rstrip())
        if width - position >= length:
            position += cell_len(word)
        elif length > width:  # fold: fill rows of `width` cells
            if start:
                starts.append(start)
            row = 0
            for i, ch in enumerate(word):
                w = cell_len(ch)
                if row + w > width:
                    starts.append(start + i)
                    row = 0
                row += w
            position = row
        else:
            starts.append(start)
            position = cell_len(word)
    return starts
# at most this many redraws per second: the view runs between two decodes, so each redraw delays the
# next one; what arrives in between is only appended to the reply (O(1) per token)
REFRESH_PER_SECOND = 12


def make_console(*, file: TextIO | None = None, stderr: bool = False, no_color: bool = False, **kw) -> Console:
    """A console with the spec theme. no_color=False leaves the choice to Rich, which honours NO_COLOR."""
    return Console(file=file, stderr=stderr, theme=THEME, no_color=True if no_color else None, highlight=False, **kw)


def colour_on(console: Console) -> bool:
    return console.color_system is not None and not console.no_color


def legend() -> Text:
    """One line: each source's name in its own style."""
    text = Text("tokens: ", style="spec.legend")
    for i, (source, label) in enumerate(LEGEND_ITEMS):
        if i:
            text.append("  ")
        text.append("■ " + label, style=SOURCE_STYLE[source])
    return text


# -- numbers -----------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def footer(totals: RunStats | None, last: StepStats | None, *, label: str = "") -> Text:
    """tokens/s · acceptance rate · mean accepted length · current draft length · tokens generated."""
    text = Text(style="spec.footer")
    if totals is None or totals.steps == 0:
        text.append("evaluating the prompt…")
        return text

    def item(value: str, unit: str) -> None:
        if len(text):
            text.append(" · ")
        text.append(value, style="spec.footer.value")
        text.append(unit)

    item(f"{totals.tokens_per_second or 0.0:.1f}", " tok/s")
    item(_pct(totals.acceptance_rate), " accepted")
    item(f"{totals.mean_accepted_length or 0.0:.2f}", " tokens/step")
    item(str(last.drafted if last is not None else 0), " drafted now")
    # which drafter drafted this step (in a chain, the one the policy chose; lookup says when it matched an
    # earlier reply rather than this conversation)
    if last is not None and last.drafted and last.source:
        name, style = kinds.source_style(last.source)
        text.append(" (")
        text.append(name, style=style)
        text.append(")")
    item(str(totals.emitted), " tokens")
    if label:
        text.append(f" · {label}")
    return text


def summary_line(stats: RunStats, finish_reason: str, drafter_label: str = "", note: str | None = None) -> Text:
    """One line at the end of a reply; `note` (why the policy drafted nothing) goes on a second line."""
    tps = stats.tokens_per_second or 0.0
    tau = stats.mean_accepted_length or 0.0
    parts = [
        f"{stats.emitted} tokens",
        f"{tps:.1f} tok/s",
        f"accepted {_pct(stats.acceptance_rate)} of {stats.drafted}" if stats.drafted else "nothing drafted",
        f"{tau:.2f} tokens/step",
        f"prompt {stats.prompt_tokens} ({stats.prompt_tokens_evaluated} evaluated)",
    ]
    if drafter_label:
        parts.append(drafter_label)
    parts.append(finish_reason)
    text = Text(" · ".join(parts), style="spec.summary")
    if note and not stats.drafted:
        text.append("\n" + note, style="spec.notice")
    return text


def phases_line(by_phase: dict[str, RunStats] | None) -> Text | None:
    """Speculation in the thought and in the answer apart (a reasoning model's reply), or None."""
    if not by_phase or not by_phase["thought"].steps:
        return None
    parts = []
    for phase, stats in by_phase.items():
        if stats.steps:
            accepted = f"accepted {_pct(stats.acceptance_rate)} of {stats.drafted}" if stats.drafted else "nothing drafted"
            parts.append(f"{phase}: {stats.emitted} tokens · {stats.tokens_per_second or 0.0:.1f} tok/s · {accepted} · "
                         f"{stats.mean_accepted_length or 0.0:.2f} tokens/step")
    return Text(" | ".join(parts), style="spec.summary")


def thought_line(tokens: int, seconds: float, answered: bool = True) -> Text:
    """A finished thought, folded to one line."""
    line = Text("▸ thought", style="spec.thought.label")
    line.append(f" for {tokens} token{'s' if tokens != 1 else ''} · {seconds:.1f} s", style="spec.thought")
    if not answered:
        line.append(" · no answer yet", style="spec.thought")
    return line


def _bar(n: int, most: int, width: int = 20) -> str:
    return "█" * max(1, round(width * n / most)) if n and most else ""


def breakdown(stats: RunStats) -> Text:
    """--stats / /stats: per-position acceptance, the accepted-length histogram, where time went."""
    out = Text()
    out.append("per-position acceptance\n", style="bold")
    if not stats.position_tries:
        out.append("  (nothing drafted)\n", style="spec.footer")
    for i, (hits, tries) in enumerate(zip(stats.position_hits, stats.position_tries)):
        out.append(f"  {i + 1:>3}  {hits / tries:>4.0%}  ({hits}/{tries})  ")
        out.append(_bar(hits, tries, 20) + "\n", style="spec.accepted")
    out.append("accepted draft tokens per step (steps)\n", style="bold")
    most = max(stats.accepted_lengths.values(), default=0)
    for n, steps in sorted(stats.accepted_lengths.items()):
        out.append(f"  {n:>3}  {steps:>5}  ")
        out.append(_bar(steps, most) + "\n", style="spec.bonus")
    drafted = ", ".join(f"{k}: {v}" for k, v in sorted(stats.draft_lengths.items()))
    out.append(f"draft lengths (k: steps)  {drafted or '-'}\n")
    if stats.steps:
        out.append(f"per step  {stats.nodes_per_step:.2f} draft nodes verified · {stats.mean_accepted_length:.2f} tokens\n")
    if stats.drafted_by:
        out.append("drafted tokens by source  ")
        for i, (source, n) in enumerate(sorted(stats.drafted_by.items())):
            name, style = kinds.source_style(source)
            out.append((", " if i else "") + name, style=style)
            out.append(f" {n}")
        out.append("\n")
    share = stats.draft_share
    out.append(
        f"time  prefill {stats.prefill_seconds:.2f} s ({stats.prompt_tokens_evaluated} of "
        f"{stats.prompt_tokens} prompt tokens evaluated) · generation {stats.generate_seconds:.2f} s · "
        f"drafting {_pct(share)} of step time · end to end {stats.end_to_end_tokens_per_second or 0.0:.1f} tok/s"
    )
    if stats.rollback_seconds:
        out.append(f" · recurrent-state checkpoints {stats.rollback_seconds * 1000:.0f} ms")
    if stats.rollback_recoveries:
        out.append(f" · {stats.rollback_recoveries} cache cuts repaired by re-reading the context")
    return out


# -- views -------------------------------------------------------------------------------------------


class PlainView:
    """Text only, as it comes (stdout is a pipe or a file)."""

    def __init__(self, file: TextIO):
        self.file = file
        self.finished: Finished | None = None
        self.totals: RunStats | None = None
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self._thought = False  # a thought came, and no answer text yet: its blank lines are skipped

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def start(self) -> None:
        pass

    def feed(self, event) -> None:
        if isinstance(event, TokenEvent):
            self.token_ids.append(event.id)
            text = event.text
            if event.phase == "thought":
                self._thought = True
            elif event.phase == "answer" and self._thought and not self.parts:
                text = text.lstrip()
            if text and event.phase == "answer":
                self.parts.append(text)
                self.file.write(text)
                self.file.flush()
        elif isinstance(event, StepEvent):
            self.totals = event.totals
        elif isinstance(event, Finished):
            self.finished = event
            self.totals = event.stats
            thinking = event.split is not None and not event.split.content and event.split.reasoning_content
            if event.tail and not thinking:
                self.parts.append(event.tail)
                self.file.write(event.tail)

    def end(self, notice: str | None = None) -> None:
        if notice:
            self.file.write(f" [{notice}]")
        self.file.write("\n")
        self.file.flush()


class LiveView:
    """Coloured tokens above a live footer (see the module doc for how rows are committed)."""

    def __init__(self, console: Console, *, label: str = "", show_footer: bool = True):
        self.console = console
        self.label = label
        self.show_footer = show_footer
        self.reply = Text()  # the whole reply, styled
        self.token_ids: list[int] = []
        self.finished: Finished | None = None
        self.totals: RunStats | None = None
        self.last_step: StepStats | None = None
        self._pending = Text()  # the reply's rows not yet printed above the live region
        self._live: Live | None = None
        self._last_refresh = 0.0
        self.thought = Text()  # the thought streaming now (the live region shows its last rows)
        self.last_thought = Text()  # the whole of the last thought, once folded
        self.thought_tokens = 0
        self._thought_started: float | None = None

    @property
    def text(self) -> str:
        return self.reply.plain

    def start(self) -> None:
        self._live = Live(
            self._renderable(),
            console=self.console,
            auto_refresh=False,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
            vertical_overflow="visible",
        )
        self._live.start(refresh=True)

    def feed(self, event) -> None:
        if isinstance(event, TokenEvent):
            self.token_ids.append(event.id)
            if event.phase == "thought":
                if self._thought_started is None:
                    self._thought_started = time.perf_counter()
                self.thought_tokens += 1
                self.thought.append(event.text, style="spec.thought")
                return
            text = event.text
            if self._thought_started is not None and event.phase == "answer":
                if not text.strip():
                    return  # the blank lines between a thought and its answer
                self._fold_thought()
                text = text.lstrip()
            if text:
                self._append(text, SOURCE_STYLE.get(event.source, "spec.target"))
        elif isinstance(event, StepEvent):
            self.totals, self.last_step = event.totals, event.stats
            now = time.perf_counter()
            if now - self._last_refresh >= 1.0 / REFRESH_PER_SECOND:
                self._last_refresh = now
                self._commit()
                self._refresh()
        elif isinstance(event, Finished):
            self.finished = event
            self.totals = event.stats
            if event.tail:
                self._append(event.tail, "spec.target")

    def end(self, notice: str | None = None) -> None:
        """Erase the footer, print what is left of the reply (and a notice such as 'interrupted')."""
        if self._thought_started is not None:
            self._fold_thought(answered=False)
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()
        rest = self._pending
        self._pending = Text()
        if not rest.plain and not notice and self.reply.plain:
            return  # the reply ended with a newline and is all on screen already
        if notice:
            rest.append((" " if rest.plain and not rest.plain.endswith("\n") else "") + f"[{notice}]", style="spec.notice")
        self.console.print(rest, soft_wrap=False)

    # -- internals -----------------------------------------------------------------------------------

    def _append(self, text: str, style: str) -> None:
        self.reply.append(text, style=style)
        self._pending.append(text, style=style)

    def _fold_thought(self, answered: bool = True) -> None:
        """The thought is over: one line for it above the live region, and the answer goes on below."""
        line = thought_line(self.thought_tokens, time.perf_counter() - self._thought_started, answered)
        self.last_thought, self._thought_started = self.thought, None
        self.thought = Text()
        self._print(line)

    def _thought_tail(self) -> Text:
        """The label and the last THOUGHT_ROWS rows of the thought as it streams."""
        width = max(1, self.console.width)
        rows = []
        # only the end can be in view: a long thought is not wrapped again in full at every refresh
        for line in self.thought.plain[-(THOUGHT_ROWS + 1) * width:].split("\n"):
            starts = [0, *row_starts(line, width)] if cell_len(line) > width else [0]
            rows += [line[a:b] for a, b in zip(starts, [*starts[1:], len(line)])]
        shown = Text("thinking · ", style="spec.thought.label").append(f"{self.thought_tokens} tokens", style="spec.thought")
        for row in rows[-THOUGHT_ROWS:]:
            shown.append("\n" + row, style="spec.thought")
        return shown

    def _renderable(self):
        parts = []
        if self._thought_started is not None:
            parts.append(self._thought_tail())
        if self._pending.plain:
            parts.append(self._pending)
        if self.show_footer:
            parts.append(footer(self.totals, self.last_step, label=self.label))
        return Group(*parts)

    def _commit(self) -> None:
        """Print finished lines and all but the last PENDING_ROWS wrapped rows above the live region."""
        pending = self._pending
        plain = pending.plain
        cut = plain.rfind("\n") + 1  # through the last newline: whole lines
        width = max(1, self.console.width)
        last_line = plain[cut:]
        if cell_len(last_line) > width:
            breaks = row_starts(last_line, width)  # offsets where rows 2..n start
            if len(breaks) >= PENDING_ROWS:
                cut += breaks[-PENDING_ROWS]
        if cut <= 0:
            return
        done, self._pending = pending[:cut], pending[cut:]
        if done.plain.endswith("\n"):
            done = done[:-1]
        self._print(done)

    def _print(self, text: Text) -> None:
        if self._live is not None:
            # the live render hook clears the region, prints above it, and redraws it
            self._live.update(self._renderable(), refresh=False)
        self.console.print(text, soft_wrap=False)

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._renderable(), refresh=True)


def make_view(console: Console, plain_file: TextIO, *, label: str = "", live: bool | None = None):
    """LiveView on a terminal, PlainView otherwise."""
    if live is None:
        live = console.is_terminal
    return LiveView(console, label=label) if live else PlainView(plain_file)


def show(events: Iterable, view) -> Finished | None:
    """Feed every event to the view; always close the view (a Ctrl-C leaves the screen tidy)."""
    view.start()
    notice = None
    try:
        for event in events:
            view.feed(event)
    except KeyboardInterrupt:
        notice = "interrupted"
        raise
    finally:
        view.end(notice)
    return view.finished
