"""`specchat chat`: a conversation whose KV caches carry over from turn to turn.

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

The transcript is JSONL, one line per message, appended and flushed as each message is final, in
data_dir()/transcripts/. `--resume FILE` reads one back and keeps appending to it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.console import Console
from rich.text import Text

from . import options as opt
from . import ui
from .backend import Backend, sync
from .engine import Finished, PromptTooLong, generate
from .loader import Loaded
from .paths import data_dir
from .policy import make_policy
from .runner import RunOptions, UserError, loading, run_options
from .stats import RunStats
from .template import FALLBACK_STOP, render_text

# -- the conversation and its tokens ---------------------------------------------------------------


@dataclass
class Prepared:
    """The prompt for one turn."""

    user: str
    ids: list[int]
    text: str
    reused: int  # leading ids carried over from the previous turn as they were (not re-tokenised)


class Conversation:
    def __init__(self, target: Backend, system: str | None = None):
        self.target = target
        self.system = system or None
        self.turns: list[dict] = []  # user / assistant messages, alternating, oldest first
        self.templated = bool(target.chat_template)
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

    def _tokenize_all(self, text: str) -> list[int]:
        if self.templated:  # the template writes BOS itself where the model wants one
            return self.target.tokenize(text, add_special=False, parse_special=True)
        return self.target.tokenize(text, add_special=True)

    def prepare(self, user: str) -> Prepared:
        text = render_text(self.target, [*self.messages, {"role": "user", "content": user}], True)
        if self._ids and text.startswith(self._text):
            new = self.target.tokenize(text[len(self._text):], add_special=False, parse_special=self.templated)
            return Prepared(user, self._ids + new, text, len(self._ids))
        return Prepared(user, self._tokenize_all(text), text, 0)

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

    def commit(self, prepared: Prepared, reply: str, generated: Sequence[int]) -> dict:
        """Record the turn. The held ids become exactly what the target saw: prompt + generated."""
        content = reply if self.templated else reply.strip()
        message = {"role": "assistant", "content": content}
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
        self.turns = [dict(role=m["role"], content=m["content"]) for m in turns]
        self.forget_tokens()
        if self.turns:
            self._text = render_text(self.target, self.messages, False)
            self._ids = self._tokenize_all(self._text)
        return self.ids


# -- the transcript --------------------------------------------------------------------------------


def transcripts_dir() -> Path:
    return data_dir() / "transcripts"


def new_transcript_path() -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = transcripts_dir() / f"{stamp}.jsonl"
    n = 1
    while path.exists():
        n += 1
        path = transcripts_dir() / f"{stamp}-{n}.jsonl"
    return path


class Transcript:
    """Appends one JSON line per message and flushes it at once: a killed process loses nothing."""

    def __init__(self, path: Path):
        self.path = Path(path).expanduser()
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        record = {**record, "time": datetime.now().astimezone().isoformat(timespec="seconds")}
        self.records.append(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()

    def save_as(self, path: Path) -> None:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for record in self.records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")


def load_transcript(path: Path) -> tuple[str | None, list[dict], list[dict]]:
    """(system message, user/assistant turns in pairs, all records) from a transcript file.
    A user message without its reply (the process died mid-turn) is left out."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"--resume: no such transcript: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--resume: cannot read {path}: {e}") from None
    system, turns, records, pending = None, [], [], None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            role, content = record["role"], record["content"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"--resume: {path}:{n}: not a transcript line (want a JSON object with role and content)") from None
        if not isinstance(content, str):
            raise UserError(f"--resume: {path}:{n}: content must be a string")
        records.append(record)
        if role == "system":
            system = content or None
        elif role == "user":
            pending = {"role": "user", "content": content}
        elif role == "assistant" and pending is not None:
            turns += [pending, {"role": "assistant", "content": content}]
            pending = None
    return system, turns, records


# -- the session -----------------------------------------------------------------------------------

COMMANDS = {  # name: (argument, what it does)
    "/help": ("", "this list"),
    "/reset": ("", "forget the conversation (keeps the system message), new transcript"),
    "/stats": ("", "speculation breakdown of the last reply, and the session's totals"),
    "/draft": ("N", "most tokens drafted per step (0 = no drafting)"),
    "/temp": ("X", "sampling temperature (0 = greedy)"),
    "/spec": ("on|off", "speculation on, or off (target only)"),
    "/rpc": ("off", "where the target's layers are; off: reload it on this machine (a worker is gone)"),
    "/system": ("TEXT", "set the system message (without TEXT: show it)"),
    "/save": ("FILE", "write the transcript to FILE (continue it later with --resume FILE)"),
    "/exit": ("", "leave (also Ctrl-D, or Ctrl-C at an empty prompt)"),
}
KEYS = "Enter sends · Alt+Enter (or Esc, Enter): new line · Tab completes /commands · Ctrl-C stops a reply · Ctrl-D exits"


class ChatSession:
    """The chat without its input loop: what a line typed at the prompt does. Tests drive it directly."""

    def __init__(
        self,
        loaded: Loaded,
        run: RunOptions,
        *,
        console: Console,
        info: Console,
        out=None,
        system: str | None = None,
        stop: Sequence[str] = (),
        transcript: Transcript,
        live: bool | None = None,
        show_stats: bool = False,
        make_view: Callable | None = None,
    ):
        self.loaded = loaded
        self.run = run
        self.console = console  # replies
        self.info = info  # notices and summaries (stderr when stdout is a pipe)
        self.out = out if out is not None else sys.stdout
        self.conversation = Conversation(loaded.target, system)
        self.extra_stop = list(stop)
        self.transcript = transcript
        self.live = console.is_terminal if live is None else live
        self.show_stats = show_stats
        self._make_view = make_view
        self.params = run.params
        self.max_tokens = run.max_tokens
        self.draft_max = run.draft_max
        self.spec_on = loaded.drafter is not None
        self.rng = np.random.default_rng(run.params.seed)
        self.policy = None
        self.last: Finished | None = None
        self.last_stats: RunStats | None = None
        self.totals = RunStats()
        self.turn_log: list[dict] = []  # per turn: prompt tokens, tokens evaluated, generated
        self.done = False
        self._rebuild_policy()

    # -- pieces ------------------------------------------------------------------------------------

    @property
    def drafter(self):
        return self.loaded.drafter if self.spec_on and self.draft_max > 0 else None

    @property
    def drafter_label(self) -> str:
        return self.loaded.drafter_label if self.drafter is not None else "target only"

    def _rebuild_policy(self) -> None:
        if self.loaded.drafter is None or self.draft_max == 0:
            self.policy = None
            return
        fixed = self.run.draft_fixed
        self.policy = make_policy(self.loaded, self.draft_max, None if fixed is None else min(fixed, self.draft_max))

    def notice(self, message: str, style: str = "spec.notice") -> None:
        self.info.print(Text(message, style=style))

    def header(self) -> None:
        target = self.loaded.target_spec.name
        text = Text(f"specchat chat · {target} + {self.loaded.drafter_label} · -c {self.loaded.target.n_ctx} · "
                    f"temp {self.params.temperature:g} · -n {self.max_tokens}", style="bold")
        self.info.print(text)
        placement = getattr(self.loaded.target, "placement", None)
        if placement:
            self.notice(f"layers: {placement}")
        if not self.conversation.templated:
            self.notice(f"{target} has no chat template: using the plain 'User: … / Assistant: …' format, "
                        "stopped at the next 'User:'")
        if ui.colour_on(self.info):
            self.info.print(ui.legend())
        if self.live:
            self.info.print(Text(KEYS + " · /help", style="spec.legend"))
        self.info.print(Text(f"transcript: {self.transcript.path}", style="spec.legend"))

    # -- one line of input ---------------------------------------------------------------------------

    def handle(self, line: str) -> None:
        if line.startswith("/") and not line.startswith("//"):
            self.command(line)
        elif line.strip():
            self.turn(line[1:] if line.startswith("//") else line)

    def command(self, line: str) -> None:
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        name = name.lower()
        if name in ("/exit", "/quit", "/q"):
            self.done = True
        elif name == "/help":
            for cmd, (arg_help, what) in COMMANDS.items():
                self.info.print(Text.assemble((f"{cmd} {arg_help}".ljust(16), "spec.help.key"), " ", what))
            self.info.print(Text(KEYS, style="spec.legend"))
            if ui.colour_on(self.info):
                self.info.print(ui.legend())
        elif name == "/reset":
            self.conversation.reset()
            self.transcript = Transcript(new_transcript_path())
            if self.conversation.system:
                self.transcript.write({"role": "system", "content": self.conversation.system})
            self.notice(f"conversation reset · new transcript {self.transcript.path}")
        elif name == "/stats":
            if self.last_stats is None:
                self.notice("no reply yet")
                return
            self.info.print(ui.breakdown(self.last_stats))
            self.info.print(Text("session: ", style="bold").append(ui.summary_line(self.totals, f"{len(self.turn_log)} replies")))
        elif name == "/draft":
            try:
                n = int(arg)
                if n < 0:
                    raise ValueError
            except ValueError:
                self.notice("/draft takes a whole number ≥ 0 (0 = no drafting)", "spec.error")
                return
            if self.loaded.drafter is None and n > 0:
                self.notice("no drafter was loaded (--no-spec): restart without it to draft", "spec.error")
                return
            self.draft_max = n
            self._rebuild_policy()
            self.notice(f"draft max {n}" + (" (no drafting)" if n == 0 else ""))
        elif name == "/temp":
            try:
                params = dataclasses.replace(self.params, temperature=float(arg))
                params.check()
            except ValueError:
                self.notice(f"/temp takes a number ≥ 0, not {arg!r}" if arg else "/temp takes a number ≥ 0", "spec.error")
                return
            self.params = params
            self.notice(f"temperature {params.temperature:g}" + (" (greedy)" if params.greedy else ""))
        elif name == "/spec":
            if arg not in ("on", "off"):
                self.notice("/spec takes on or off", "spec.error")
                return
            if arg == "on" and self.loaded.drafter is None:
                self.notice("no drafter was loaded (--no-spec): restart without it to speculate", "spec.error")
                return
            self.spec_on = arg == "on"
            self.notice(f"speculation {arg}" + ("" if self.spec_on else " (target only)"))
        elif name == "/rpc":
            self.rpc_command(arg)
        elif name == "/system":
            if not arg:
                self.notice(f"system message: {self.conversation.system!r}" if self.conversation.system else "no system message")
                return
            self.conversation.set_system(arg)
            self.transcript.write({"role": "system", "content": arg})
            self.notice("system message set; the next turn evaluates the conversation again")
        elif name == "/save":
            if not arg:
                self.notice("/save takes a file name", "spec.error")
                return
            try:
                self.transcript.save_as(Path(arg))
            except OSError as e:
                self.notice(f"cannot write {arg}: {e.strerror or e}", "spec.error")
                return
            self.notice(f"saved {len(self.transcript.records)} messages to {arg}")
        else:
            self.notice(f"unknown command {name}; /help lists them", "spec.error")

    def rpc_command(self, arg: str) -> None:
        target = self.loaded.target
        endpoints = tuple(getattr(target, "rpc", ()))
        if arg != "off":
            if arg:
                self.notice("/rpc takes off (or nothing, to show where the layers are)", "spec.error")
            else:
                self.notice(f"layers: {target.placement}" if endpoints else "the target runs on this machine (no --rpc)")
            return
        if not endpoints:
            self.notice("the target already runs on this machine")
            return
        from . import rpc
        from .backend import BackendError, LlamaCppBackend

        gone = rpc.unreachable(endpoints)
        self.notice(f"loading {target.name} on this machine…")
        try:
            local = LlamaCppBackend(target.path, n_ctx=target.n_ctx, n_threads=target.n_threads, name=target.name)
        except BackendError as e:
            self.notice(str(e), "spec.error")
            return
        if gone:
            rpc.abandon(target)  # its buffers live on a dead worker: freeing them would abort
        else:
            target.close()
        self.loaded.target = self.conversation.target = local
        self._rebuild_policy()
        self.notice(f"the target runs on this machine now ({local.n_layer} layers); the conversation is kept "
                    "and is evaluated again at the next turn")

    def _rpc_ready(self) -> bool:
        """Before a turn on RPC workers: are they still there? (ggml would abort on a dead one.)"""
        endpoints = tuple(getattr(self.loaded.target, "rpc", ()))
        if not endpoints:
            return True
        from . import rpc

        gone = rpc.unreachable(endpoints)
        if gone:
            self.notice(f"RPC worker {', '.join(gone)} is unreachable: /rpc off continues on this machine "
                        "(the conversation is kept), /exit ends", "spec.error")
            return False
        rpc.abort_hint = (f"the transcript is saved: `specchat chat --resume {self.transcript.path} --rpc off` "
                          "continues on this machine")
        return True

    # -- one turn ----------------------------------------------------------------------------------

    def turn(self, user: str) -> None:
        conv, target = self.conversation, self.loaded.target
        if not self._rpc_ready():
            return
        prepared, dropped = conv.fit(user, min(self.max_tokens, max(1, target.n_ctx // 2)))
        if dropped:
            self.notice(f"context full (-c {target.n_ctx}): dropped the {dropped} oldest exchange"
                        f"{'s' if dropped > 1 else ''} to make room")
        if len(prepared.ids) >= target.n_ctx:
            self.notice(f"this message does not fit: {len(prepared.ids)} tokens, context {target.n_ctx} (-c)", "spec.error")
            return
        self.transcript.write({"role": "user", "content": user})
        evaluated_before = target.evaluated
        events = generate(
            target, self.drafter, prepared.ids, self.params, max_tokens=self.max_tokens,
            stop=conv.stops + self.extra_stop, policy=self.policy if self.drafter is not None else None, rng=self.rng,
        )
        view = self._view()
        finished: Finished | None = None
        try:
            with no_echo():
                finished = ui.show(events, view)
        except KeyboardInterrupt:
            # the generator's finally cuts the target's cache back to prompt + the tokens we saw
            events.close()
        except PromptTooLong as e:
            events.close()
            self.notice(str(e), "spec.error")
            return
        if finished is not None:
            reply, ids, reason, stats = finished.text, finished.token_ids, finished.finish_reason, finished.stats
        else:
            reply, ids, reason = view.text, list(view.token_ids), "interrupted"
            stats = view.totals or RunStats(prompt_tokens=len(prepared.ids), emitted=len(ids))
            if not ids:
                # stopped before the first token: the message is not kept (the transcript's unanswered
                # user line is skipped by --resume); the cache's extra prompt tokens are cut at next sync
                self.notice("stopped before the reply began; the message was not kept")
                return
        message = conv.commit(prepared, reply, ids)
        self.transcript.write({
            **message,
            "finish_reason": reason,
            "interrupted": reason == "interrupted",
            "stats": stats.as_dict(),
            "target": self.loaded.target_spec.name,
            "drafter": self.drafter_label,
            "temperature": self.params.temperature,
        })
        self.last, self.last_stats = finished, stats
        self.totals.merge(stats)
        self.turn_log.append({
            "prompt_tokens": len(prepared.ids),
            "reused": prepared.reused,
            "evaluated": target.evaluated - evaluated_before,
            "prompt_evaluated": stats.prompt_tokens_evaluated,
            "generated": len(ids),
            "finish_reason": reason,
        })
        self.info.print(ui.summary_line(stats, reason, self.drafter_label), soft_wrap=True)
        if self.show_stats:
            self.info.print(ui.breakdown(stats))

    def _view(self):
        if self._make_view is not None:
            return self._make_view()
        from .crossvocab import rule_label

        return ui.make_view(self.console, self.out, live=self.live, label=rule_label(self.drafter, self.params))

    def prefill(self) -> None:
        """After --resume: evaluate the restored conversation once, now rather than at the first turn."""
        ids = self.conversation.ids
        if ids:
            sync(self.loaded.target, ids[:-1], logits_last=False)
            if self.drafter is not None:
                self.drafter.prefill(ids)


# -- input -----------------------------------------------------------------------------------------


@contextmanager
def no_echo(stream=None):
    """While a reply streams, keys typed ahead are not echoed into it (the terminal still buffers them
    for the next prompt, and Ctrl-C still interrupts)."""
    stream = stream if stream is not None else sys.stdin
    try:
        import termios

        fd = stream.fileno()
        if not os.isatty(fd):
            raise OSError
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def prompt_reader(no_color: bool) -> Callable[[], str]:
    """A prompt-toolkit session: history file, multi-line input, slash-command completion.
    Raises EOFError to leave (Ctrl-D, or Ctrl-C on an empty line)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.completion import Completer, Completion
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.output import ColorDepth
    from prompt_toolkit.styles import Style

    class SlashCompleter(Completer):
        def get_completions(self, document, complete_event):
            text = document.text_before_cursor
            if not text.startswith("/") or "\n" in text:
                return
            if " " not in text:
                for name, (arg_help, what) in COMMANDS.items():
                    if name.startswith(text.lower()):
                        yield Completion(name, start_position=-len(text), display_meta=f"{arg_help} {what}".strip())
            elif text.startswith("/spec ") or text.startswith("/rpc "):
                word = text.split(" ", 1)[1]
                for value in ("on", "off") if text.startswith("/spec ") else ("off",):
                    if value.startswith(word):
                        yield Completion(value, start_position=-len(word))

    keys = KeyBindings()

    # Enter sends. Ctrl-J (a bare newline) sends too: what was typed ahead while the model loaded
    # arrives with Enter turned into newline by the terminal's cooked mode.
    @keys.add("enter")
    @keys.add("c-j")
    def _send(event):
        event.current_buffer.validate_and_handle()

    @keys.add("escape", "enter")  # Alt+Enter, or Esc then Enter
    def _newline(event):
        event.current_buffer.insert_text("\n")

    @keys.add("c-c")
    def _interrupt(event):
        buffer = event.current_buffer
        if buffer.text:
            buffer.reset()
        else:
            event.app.exit(exception=EOFError())

    history = data_dir() / "history"
    history.parent.mkdir(parents=True, exist_ok=True)
    session = PromptSession(
        history=FileHistory(str(history)),
        completer=SlashCompleter(),
        complete_while_typing=True,
        multiline=True,
        key_bindings=keys,
        prompt_continuation="… ",
        style=Style.from_dict({"prompt": "bold ansimagenta"}),
        color_depth=ColorDepth.DEPTH_1_BIT if no_color else None,
    )
    return lambda: session.prompt([("class:prompt", "› ")])


def line_reader(stream) -> Callable[[], str]:
    """stdin is not a terminal: one message per line."""

    def read() -> str:
        line = stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    return read


def loop(session: ChatSession, read: Callable[[], str]) -> None:
    while not session.done:
        try:
            line = read()
        except EOFError:
            break
        except KeyboardInterrupt:  # Ctrl-C outside our key binding (e.g. while the prompt starts)
            break
        session.handle(line)


# -- the command -----------------------------------------------------------------------------------


def chat_command(
    target: opt.Target = None,
    draft: opt.Draft = None,
    pair: opt.Pair = None,
    system: Annotated[str | None, typer.Option("--system", help="System message.", rich_help_panel=opt.MODELS)] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="Continue the conversation saved in this transcript (JSONL) and keep appending to it.", rich_help_panel=opt.OUTPUT, show_default=False)] = None,
    no_spec: opt.NoSpec = False,
    max_tokens: opt.MaxTokens = 256,
    temp: opt.Temp = 0.8,
    top_k: opt.TopK = 40,
    top_p: opt.TopP = 0.95,
    min_p: opt.MinP = 0.05,
    repeat_penalty: opt.RepeatPenalty = 1.0,
    repeat_last_n: opt.RepeatLastN = 64,
    frequency_penalty: opt.FrequencyPenalty = 0.0,
    presence_penalty: opt.PresencePenalty = 0.0,
    seed: opt.Seed = None,
    stop: opt.Stop = None,
    draft_max: opt.DraftMax = None,
    draft_min: opt.DraftMin = 0,
    draft_p_min: opt.DraftPMin = 0.75,
    draft_fixed: opt.DraftFixed = None,
    lookup_min: opt.LookupMin = 1,
    lookup_max: opt.LookupMax = 32,
    lookup_history: opt.LookupHistory = True,
    hybrid: opt.Hybrid = None,
    cross_vocab: opt.CrossVocab = "auto",
    ctx_size: opt.Ctx = 4096,
    ngl: opt.Ngl = None,
    ngld: opt.Ngld = None,
    threads: opt.Threads = None,
    rpc: opt.Rpc = None,
    show_stats: Annotated[bool, typer.Option("--stats", help="After each reply, print the speculation breakdown (per-position acceptance, accepted lengths).", rich_help_panel=opt.OUTPUT)] = False,
    no_color: opt.NoColor = False,
) -> None:
    """Chat with a model; watch which tokens the draft got right.

    Replies stream coloured by where each token came from (legend at the start), above a live footer: tokens/s, acceptance, tokens per step, current draft length. Both KV caches are kept between turns, so a turn evaluates only its new tokens; when the context fills, the oldest exchanges are dropped, with a notice.

    Keys: Enter sends; Alt+Enter (or Esc then Enter) starts a new line; Tab completes /commands; Ctrl-C stops a reply, and at an empty prompt exits, as Ctrl-D does. Commands: /help /reset /stats /draft N /temp X /spec on|off /rpc off /system TEXT /save FILE /exit.

    The chat template comes from the target's GGUF metadata; a model without one (a base model such as gemma-3-270m) gets a plain "User: / Assistant:" transcript. Each message is appended to a JSONL transcript in $XDG_DATA_HOME/specchat/transcripts as soon as it is final; --resume FILE continues one.
    """
    from .config import load_config

    config = load_config()
    run = run_options(
        config, target=target, draft=draft, pair=pair, no_spec=no_spec, max_tokens=max_tokens, temp=temp,
        top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, seed=seed, draft_max=draft_max,
        draft_min=draft_min, draft_p_min=draft_p_min, draft_fixed=draft_fixed, lookup_min=lookup_min,
        lookup_max=lookup_max, lookup_history=lookup_history, hybrid=hybrid, ctx_size=ctx_size, ngl=ngl, ngld=ngld,
        threads=threads, cross_vocab=cross_vocab, rpc=rpc,
    )
    resumed = load_transcript(resume) if resume is not None else None
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    console = ui.make_console(no_color=no_color)
    info = console if sys.stdout.isatty() else ui.make_console(stderr=True, no_color=no_color)
    if resumed is not None:
        transcript = Transcript(resume)
        transcript.records = resumed[2]
        system = system or resumed[0]
    else:
        transcript = Transcript(new_transcript_path())
    with loading(config, run, info) as loaded:
        session = ChatSession(
            loaded, run, console=console, info=info, system=system, stop=stop or [], transcript=transcript,
            live=sys.stdout.isatty(), show_stats=show_stats,
        )
        if session.conversation.system and (resumed is None or session.conversation.system != resumed[0]):
            transcript.write({"role": "system", "content": session.conversation.system})
        session.header()
        if resumed is not None:
            restore(session, resumed[1])
        read = prompt_reader(no_color) if interactive else line_reader(sys.stdin)
        try:
            loop(session, read)
        finally:
            info.print(Text(f"transcript: {session.transcript.path}", style="spec.legend"))


def restore(session: ChatSession, turns: list[dict]) -> None:
    """Show the resumed conversation and evaluate it once."""
    for m in turns:
        who = "›" if m["role"] == "user" else " "
        style = "spec.user" if m["role"] == "user" else "spec.legend"
        session.info.print(Text(f"{who} {m['content']}", style=style))
    session.conversation.restore(turns)
    n = len(session.conversation.ids)
    if n >= session.loaded.target.n_ctx:
        session.conversation.reset()
        session.notice(f"the saved conversation ({n} tokens) does not fit -c {session.loaded.target.n_ctx}: starting empty")
        return
    started = time.perf_counter()
    if session.info.is_terminal:
        with session.info.status(f"evaluating the resumed conversation ({n} tokens)…"):
            session.prefill()
    else:
        session.prefill()
    session.notice(f"resumed {len(turns) // 2} exchanges ({n} tokens, {time.perf_counter() - started:.1f} s)")
