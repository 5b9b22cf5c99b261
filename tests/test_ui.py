"""The renderer on recorded event streams, captured from a Rich console: no model, no terminal."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from fakes import FakeBackend, ScriptedDrafter, split_char_vocab

from specchat import ui
from specchat.engine import Finished, StepEvent, TokenEvent, generate
from specchat.sampling import SamplingParams
from specchat.stats import RunStats, StepStats

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def recorded() -> list:
    """What the engine yields for: step 0 plain (target), step 1 two drafts accepted + bonus,
    step 2 one accepted then a correction; a character split over two tokens in step 2."""
    totals = RunStats(prompt_tokens=5, prompt_tokens_evaluated=5)
    events: list = []

    def step(i, tokens, drafted, accepted):
        for tid, text, source in tokens:
            events.append(TokenEvent(tid, text, source, i))
        s = StepStats(step=i, drafted=drafted, accepted=accepted, emitted=len(tokens), draft_seconds=0.001,
                      verify_seconds=0.01, planned=drafted)
        totals.add(s)
        totals.generate_seconds += 0.011
        events.append(StepEvent(s, totals))

    step(0, [(10, "Hello", "target")], 0, 0)
    step(1, [(11, " wor", "accepted"), (12, "ld", "accepted"), (13, ",", "bonus")], 2, 2)
    step(2, [(14, " caf", "accepted"), (15, "", "resampled"), (16, "é!", "accepted")], 3, 1)
    events.append(Finished("Hello world, café!", list(range(10, 17)), "length", totals, [1, 2, 3, 4, 5], ""))
    return events


def capture(width: int = 80, **kw):
    buf = io.StringIO()
    console = ui.make_console(file=buf, force_terminal=True, color_system="standard", width=width, **kw)
    return console, buf


def styles_of(view: ui.LiveView) -> list[tuple[str, str]]:
    plain = view.reply.plain
    return [(plain[s.start:s.end], str(s.style)) for s in view.reply.spans]


def test_tokens_are_styled_by_source():
    console, buf = capture()
    view = ui.LiveView(console)
    finished = ui.show(recorded(), view)
    assert finished is not None and finished.finish_reason == "length"
    assert view.text == "Hello world, café!"
    assert styles_of(view) == [
        ("Hello", "spec.target"),
        (" wor", "spec.accepted"),
        ("ld", "spec.accepted"),
        (",", "spec.bonus"),
        (" caf", "spec.accepted"),
        ("é!", "spec.accepted"),  # the resampled token completed no character: nothing to show for it
    ]
    out = buf.getvalue()
    assert "\x1b[32m wor" in out  # accepted: green
    assert "\x1b[1m\x1b[36m," in out or "\x1b[1;36m," in out  # bonus: bold cyan
    assert "é!" in out


def test_resampled_token_in_red():
    console, buf = capture()
    view = ui.LiveView(console)
    ui.show([TokenEvent(1, "ab", "accepted", 0), TokenEvent(2, "X", "resampled", 0)], view)
    assert styles_of(view)[-1] == ("X", "spec.resampled")
    assert re.search(r"\x1b\[(1;31|1m\x1b\[31)mX", buf.getvalue())


def test_theme_names_every_source():
    for source, style in ui.SOURCE_STYLE.items():
        assert style == f"spec.{source}"
        assert style in ui.THEME.styles
    for name in ("spec.footer", "spec.footer.value", "spec.summary", "spec.notice"):
        assert name in ui.THEME.styles
    legend = ui.legend()
    assert "\n" not in legend.plain
    assert {str(s.style) for s in legend.spans} >= set(ui.SOURCE_STYLE.values())


def test_footer_is_live_and_transient():
    console, buf = capture()
    view = ui.LiveView(console, label="prompt-lookup")
    events = recorded()
    view.start()
    for event in events[:-1]:
        view.feed(event)
    text = ui.footer(view.totals, view.last_step, label="prompt-lookup").plain
    # tokens/s, acceptance rate, tokens per step, current draft length, tokens generated
    assert re.fullmatch(r"[\d.]+ tok/s · 60% accepted · 2\.33 tokens/step · 3 drafted now · 7 tokens · prompt-lookup", text), text
    view.end()
    out = buf.getvalue()
    assert "tok/s" in out  # it was drawn ...
    assert out.count("\x1b[2K") >= 1  # ... and erased (Live clears its lines) at the end


def test_footer_before_first_step():
    assert "prompt" in ui.footer(None, None).plain


def test_no_color_keeps_text_drops_colour(monkeypatch):
    console, buf = capture(no_color=True)
    view = ui.LiveView(console, show_footer=False)
    ui.show(recorded(), view)
    out = buf.getvalue()
    assert "café" in ANSI.sub("", out)
    assert not re.search(r"\x1b\[[0-9;]*3[0-7]m", out)  # no foreground colour codes
    assert not ui.colour_on(console)


def test_no_color_env_is_honoured(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    console = ui.make_console(file=io.StringIO(), force_terminal=True)
    assert console.no_color and not ui.colour_on(console)
    monkeypatch.delenv("NO_COLOR")
    console = ui.make_console(file=io.StringIO(), force_terminal=True, color_system="standard")
    assert ui.colour_on(console)


def test_plain_view_is_text_only():
    out = io.StringIO()
    view = ui.PlainView(out)
    finished = ui.show(recorded(), view)
    assert out.getvalue() == "Hello world, café!\n"
    assert finished.text == view.text + "" == "Hello world, café!"
    assert view.token_ids == list(range(10, 17))


def test_make_view_picks_by_terminal():
    console, _ = capture()
    assert isinstance(ui.make_view(console, io.StringIO()), ui.LiveView)
    pipe = ui.make_console(file=io.StringIO())
    assert isinstance(ui.make_view(pipe, io.StringIO()), ui.PlainView)


def test_long_reply_is_committed_row_by_row(monkeypatch):
    """Only the last rows stay in the live region; everything else is printed above it, in order.
    (Every step redraws here; test_redraws_are_batched_between_refreshes covers the rate limit.)"""
    monkeypatch.setattr(ui, "REFRESH_PER_SECOND", 1e12)
    console, buf = capture(width=20)
    view = ui.LiveView(console)
    words = [f"word{i} " for i in range(60)] + ["end\n", "second line\n", "tail"]
    view.start()
    committed_before = 0
    for i, w in enumerate(words):
        view.feed(TokenEvent(i, w, "accepted" if i % 2 else "target", i))
        view.feed(StepEvent(StepStats(i, 1, i % 2, 1, 0.0, 0.01), RunStats(steps=i + 1, emitted=i + 1)))
        pending = view._pending.plain
        assert len(pending.split("\n")) <= 2
        assert len(view._pending.wrap(console, 20)) <= ui.PENDING_ROWS + 1
        committed = len(view.reply.plain) - len(pending)
        assert committed >= committed_before
        committed_before = committed
        assert view.reply.plain.endswith(pending)
    view.end()
    visible = ANSI.sub("", buf.getvalue())
    # every word reached the screen in order
    positions = [m.start() if (m := re.search(rf"word{i}(?!\d)", visible)) else -1 for i in range(60)]
    assert all(p >= 0 for p in positions) and positions == sorted(positions)
    assert "second line" in visible and visible.rstrip().endswith("tail")


def test_interrupted_view_says_so():
    console, buf = capture()
    view = ui.LiveView(console)

    def events():
        yield TokenEvent(1, "partial", "target", 0)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ui.show(events(), view)
    assert "partial [interrupted]" in ANSI.sub("", buf.getvalue())
    assert view.text == "partial"


def test_summary_and_breakdown():
    totals = recorded()[-1].stats
    line = ui.summary_line(totals, "length", "prompt-lookup").plain
    assert line.startswith("7 tokens · ") and "accepted 60% of 5" in line
    assert "2.33 tokens/step" in line and "prompt 5 (5 evaluated)" in line and line.endswith("prompt-lookup · length")
    text = ui.breakdown(totals).plain
    assert "per-position acceptance" in text
    assert re.search(r"1\s+100%\s+\(2/2\)", text)  # position 1: accepted in both steps that drafted it
    assert re.search(r"3\s+0%\s+\(0/1\)", text)
    assert "accepted draft tokens per step" in text


def test_character_split_over_tokens_through_the_engine():
    """A real engine stream: 'é' is two tokens; the view shows it whole, never a replacement char."""
    n = 30
    first, second = 5, 6
    pieces = split_char_vocab(n, first, second)
    script = [first, second, 0, first, second]

    def logits(ctx):
        row = np.zeros(n, dtype=np.float32)
        k = len(ctx) - 3
        row[script[k] if k < len(script) else 1] = 10.0
        return row

    target = FakeBackend(logits, n, pieces=pieces)
    drafter = ScriptedDrafter([[first, second], None, [first, 9]])
    console, buf = capture()
    view = ui.LiveView(console)
    from specchat.policy import FixedPolicy

    finished = ui.show(
        generate(target, drafter, [2, 3, 4], SamplingParams(temperature=0.0), max_tokens=6, policy=FixedPolicy(2)),
        view,
    )
    assert finished is not None
    assert view.text == finished.text
    assert "é" in view.text and "\ufffd" not in view.text
    assert "é" in buf.getvalue()


def test_redraws_are_batched_between_refreshes(monkeypatch):
    """Steps that arrive faster than REFRESH_PER_SECOND only append text: no redraw, no commit, so the
    view does not delay the next decode; the next step after the interval shows all of it."""
    console, buf = capture(width=40)
    view = ui.LiveView(console)
    view.start()
    refreshes = []
    monkeypatch.setattr(view, "_refresh", lambda: refreshes.append(view.reply.plain))
    clock = [100.0]
    monkeypatch.setattr(ui.time, "perf_counter", lambda: clock[0])
    for i in range(30):  # 30 steps within 1/REFRESH_PER_SECOND of each other
        view.feed(TokenEvent(i, f"w{i} ", "target", i))
        view.feed(StepEvent(StepStats(i, 0, 0, 1, 0.0, 0.001), RunStats(steps=i + 1, emitted=i + 1)))
        clock[0] += 0.2 / ui.REFRESH_PER_SECOND / 30
    assert len(refreshes) == 1  # the first step only
    clock[0] += 1.0 / ui.REFRESH_PER_SECOND
    view.feed(TokenEvent(30, "last", "target", 30))
    view.feed(StepEvent(StepStats(30, 0, 0, 1, 0.0, 0.001), RunStats(steps=31, emitted=31)))
    assert len(refreshes) == 2 and refreshes[-1].endswith("w29 last")
    view.end()
    assert "w0 w1" in ANSI.sub("", buf.getvalue()) and "last" in ANSI.sub("", buf.getvalue())


def test_row_starts_wraps_like_the_console():
    from specchat.ui import row_starts

    assert row_starts("hello world", 20) == []
    assert row_starts("hello world", 8) == [6]  # "hello " then "world"
    assert row_starts("abcdefghij", 4) == [4, 8]  # a word longer than a row is folded
    assert row_starts("ab abcdefghij", 4) == [3, 7, 11]
    assert row_starts("世界世界", 4) == [2]  # two cells per character
    from rich.console import Console

    console = Console(width=8, file=io.StringIO(), color_system=None)
    console.print("hello world again", soft_wrap=False)
    rows = console.file.getvalue().splitlines()
    starts = row_starts("hello world again", 8)
    text = "hello world again"
    assert [r.rstrip() for r in rows] == [text[a:b].rstrip() for a, b in zip([0, *starts], [*starts, len(text)])]
