"""`specchat chat`: the terminal chat. The conversation and its KV reuse are `conversation.py`, the
transcript file `transcript.py`, the slash commands `slash.py`; here are the session (what a line typed
at the prompt does), the input (prompt-toolkit, or one message per line from a pipe) and the command.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from . import options as opt
from . import rpc, slash, ui
from .backend import sync
from .config import load_config
from .conversation import Conversation, Turn
from .drafters import run_label
from .errors import BackendError, SpecchatError
from .loader import Loaded
from .paths import data_dir
from .runner import RunOptions, Terminated, check_text, loading, measuring, measuring_notice, run_options
from .sampling import SamplingParams
from .slash import KEYS
from .stats import RunStats
from .template import chat_format
from .transcript import Resumed, Transcript, read_transcript

try:
    import termios
except ImportError:  # not on Windows: keys typed ahead are echoed there
    termios = None


class ChatSession:
    """The chat without its input loop: what a line typed at the prompt does. Tests drive it directly.
    A turn is the conversation's (`Conversation.send`); the session adds the screen, the transcript and
    the switches the slash commands turn (/spec, /draft, /temp)."""

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
        # --ignore-eos bans this target's end tokens
        self.conversation = Conversation(loaded.target, system=system, params=run.for_target(loaded.target),
                                         max_tokens=run.max_tokens, stop=[*run.stop, *stop], reasoning=run.reasoning)
        self.transcript = transcript
        self.live = console.is_terminal if live is None else live
        self.show_stats = show_stats
        self._make_view = make_view
        self.draft_max = run.draft_max
        self.spec_on = loaded.drafter is not None
        self.policy = None
        self.policy_ready = False  # built by prepare_policy (after the header: it may measure first)
        self.last_stats: RunStats | None = None
        self.totals = RunStats()
        self.turn_log: list[dict] = []  # per turn: prompt tokens, tokens evaluated, generated
        self.done = False
        self.unsaved_warned = False

    # -- pieces ------------------------------------------------------------------------------------

    @property
    def params(self) -> SamplingParams:
        return self.conversation.params

    @property
    def drafter(self):
        return self.loaded.drafter if self.spec_on and self.draft_max > 0 else None

    @property
    def drafter_label(self) -> str:
        return self.loaded.drafter_label if self.drafter is not None else "target only"

    def rebuild_policy(self) -> None:
        self.policy_ready = True
        if self.loaded.drafter is None or self.draft_max == 0:
            self.policy = None
            return
        # the first run on a machine measures it: a visible line says so (and what a Ctrl-C then stops)
        with measuring(self.info):
            self.policy = self.run.policy(self.loaded, notify=measuring_notice(self.info), draft_max=self.draft_max)

    def set_thinking(self, on: bool | None) -> None:
        """-rea for the turns to come (/reasoning): the template's enable_thinking, or its default (None)."""
        target = self.loaded.target
        fmt = chat_format(target)
        kwargs = {k: v for k, v in fmt.kwargs.items() if k != "enable_thinking"}
        if on is not None:
            kwargs["enable_thinking"] = on
        target.chat_format = dataclasses.replace(fmt, kwargs=kwargs)

    def prepare_policy(self) -> None:
        if not self.policy_ready:
            self.rebuild_policy()

    def save(self, record: dict) -> None:
        """Append to the transcript; the first failure is one warning, and the chat goes on."""
        error = self.transcript.write(record)
        if error is not None and not self.unsaved_warned:
            self.unsaved_warned = True
            self.notice(f"transcript not saved: {error} (the chat goes on; /save FILE writes it elsewhere)",
                        "spec.error")

    def notice(self, message: str, style: str = "spec.notice") -> None:
        self.info.print(Text(message, style=style))

    def header(self) -> None:
        target = self.loaded.target_spec.name
        text = Text(f"specchat chat · {target} + {self.loaded.drafter_label} · -c {self.loaded.target.n_ctx} · "
                    f"temp {self.params.temperature:g} · -n {self.conversation.max_tokens}", style="bold")
        self.info.print(text)
        placement = self.loaded.target.placement
        if placement:
            self.notice(f"layers: {placement}")
        memory = self.loaded.memory_line()
        if memory:
            self.notice(memory)
        from .tree_drafts import tree_note

        if tree_note(self.loaded.target, self.run.draft_tree):
            self.notice(tree_note(self.loaded.target, self.run.draft_tree))
        if not self.conversation.templated:
            self.notice(f"{target} has no chat template: using the plain 'User: … / Assistant: …' format, "
                        "stopped at the next 'User:'")
        if ui.colour_on(self.info):
            self.info.print(ui.legend())
        if self.live:
            self.info.print(Text(KEYS + " · /help", style="spec.legend"))
        if self.transcript.path is not None:
            self.info.print(Text(f"transcript: {self.transcript.path}", style="spec.legend"))
        else:
            self.unsaved_warned = True
            self.notice(f"transcript not saved: {self.transcript.error} (the chat goes on; /save FILE writes it "
                        "elsewhere)", "spec.error")

    # -- one line of input ---------------------------------------------------------------------------

    def handle(self, line: str) -> None:
        """A slash command or a message. Whatever fails with a SpecchatError (a template that refuses the
        message, a model that cannot be loaded for /rpc off) is one line, and the chat goes on."""
        try:
            if line.startswith("/") and not line.startswith("//"):
                self.command(line)
            elif line.strip():
                self.turn(line[1:] if line.startswith("//") else line)
        except SpecchatError as e:
            self.notice(str(e), "spec.error")

    def command(self, line: str) -> None:
        name, _, arg = line.strip().partition(" ")
        cmd = slash.find(name)
        if cmd is None:
            self.notice(f"unknown command {name.lower()}; /help lists them", "spec.error")
            return
        cmd.run(self, arg.strip())

    def rpc_command(self, arg: str) -> None:
        target = self.loaded.target
        endpoints = tuple(target.rpc)
        if arg != "off":
            if arg:
                self.notice("/rpc takes off (or nothing, to show where the layers are)", "spec.error")
            else:
                self.notice(f"layers: {target.placement}" if endpoints else "the target runs on this machine (no --rpc)")
            return
        if not endpoints:
            self.notice("the target already runs on this machine")
            return
        self.notice(f"loading {target.name} on this machine…")
        try:
            local = self.loaded.target_here()
        except BackendError as e:  # (it did not fit here, say): the chat goes on as it was
            self.notice(f"/rpc off failed: {e}", "spec.error")
            return
        self.conversation.target = local
        self.rebuild_policy()
        self.notice(f"the target runs on this machine now ({local.n_layer} layers); the conversation is kept "
                    "and is evaluated again at the next turn")

    def _rpc_ready(self) -> bool:
        """Before a turn on RPC workers: are they still there? (ggml would abort on a dead one.)"""
        endpoints = tuple(self.loaded.target.rpc)
        if not endpoints:
            return True
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
        conv = self.conversation
        if not self._rpc_ready():
            return
        self.prepare_policy()
        conv.drafter = self.drafter
        conv.policy = self.policy if self.drafter is not None else None
        turn = conv.send(user)
        if turn.dropped:
            self.notice(f"context full (-c {conv.target.n_ctx}): dropped the {turn.dropped} oldest exchange"
                        f"{'s' if turn.dropped > 1 else ''} to make room")
        if len(turn.prepared.ids) >= conv.target.n_ctx:
            self.notice(f"this message does not fit: {len(turn.prepared.ids)} tokens, context {conv.target.n_ctx} (-c)",
                        "spec.error")
            return
        self.save({"role": "user", "content": user})
        evaluated_before = conv.target.evaluated
        stopped: KeyboardInterrupt | None = None
        try:
            with no_echo(), self._saved_if_a_worker_stops(turn):
                ui.show(turn, self._view())
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (Terminated)
            stopped = e
            turn.close()  # the turn keeps the reply so far
        except SpecchatError as e:
            # a failure mid-turn (a decode that failed): the turn is dropped (its message and the partial
            # reply are not part of the conversation; the transcript says so), and the chat goes on
            self.notice(f"the reply failed: {e} · the turn was dropped; the chat goes on", "spec.error")
            self.save({"role": "dropped", "content": str(e)})
            return
        try:
            self._keep(turn, evaluated_before)
        finally:
            if isinstance(stopped, Terminated):
                raise stopped  # the partial reply is saved: now end the chat

    @contextmanager
    def _saved_if_a_worker_stops(self, turn: Turn):
        """On RPC workers: if the process is ended while a worker does not answer (rpc.Watchdog, from its
        own thread: the turn's generator is blocked inside llama.cpp), the reply so far is saved first."""
        if not self.loaded.target.rpc:
            yield
            return

        def save_partial(line: str) -> None:
            if turn.message is None and turn.token_ids:
                self.save({"role": "assistant", "content": "".join(turn.pieces), "finish_reason": "interrupted",
                           "interrupted": True, "target": self.loaded.target_spec.name, "drafter": self.drafter_label})

        callbacks = rpc.watchdog().on_stop
        callbacks.append(save_partial)
        try:
            yield
        finally:
            callbacks.remove(save_partial)

    def _keep(self, turn: Turn, evaluated_before: int) -> None:
        if turn.message is None:
            # stopped before the first token: the message is not kept (the transcript's unanswered user
            # line is skipped by --resume); the cache's extra prompt tokens are cut at the next sync
            self.notice("stopped before the reply began; the message was not kept")
            self.save({"role": "dropped", "content": "stopped before the reply began"})
            return
        reason, stats = turn.finish_reason, turn.stats
        self.save({
            **turn.message,
            "finish_reason": reason,
            "interrupted": reason == "interrupted",
            "stats": stats.as_dict(),
            "target": self.loaded.target_spec.name,
            "drafter": self.drafter_label,
            "temperature": self.params.temperature,
        })
        self.last_stats = stats
        self.totals.merge(stats)
        self.turn_log.append({
            "prompt_tokens": len(turn.prepared.ids),
            "reused": turn.prepared.reused,
            "evaluated": self.conversation.target.evaluated - evaluated_before,
            "prompt_evaluated": stats.prompt_tokens_evaluated,
            "generated": len(turn.token_ids),
            "finish_reason": reason,
        })
        note = self.policy.last_note if self.drafter is not None else None
        if turn.split is not None and turn.split.thought_tokens and not self.live:
            # a pipe shows the answer only: say that there was a thought (/thought shows it)
            self.info.print(ui.thought_line(turn.split.thought_tokens, 0.0, bool(turn.split.content)), soft_wrap=True)
        self.info.print(ui.summary_line(stats, reason, self.drafter_label, note), soft_wrap=True)
        if self.show_stats:
            self.info.print(ui.breakdown(stats))
            if ui.phases_line(turn.split and turn.split.stats) is not None:
                self.info.print(ui.phases_line(turn.split and turn.split.stats))

    def _view(self):
        if self._make_view is not None:
            return self._make_view()
        return ui.make_view(self.console, self.out, live=self.live, label=run_label(self.drafter, self.params))

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
        if termios is None:
            raise OSError
        fd = stream.fileno()
        if not os.isatty(fd):
            raise OSError
        saved = termios.tcgetattr(fd)
    except (OSError, ValueError, AttributeError):
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _history(path: Path, warn: Callable[[str], None]):
    from prompt_toolkit.history import FileHistory, InMemoryHistory  # start-up: prompt_toolkit takes 0.45 s

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab"):
            pass
    except OSError as e:
        warn(f"input history not saved: {e.strerror or e}: {path}")
        return InMemoryHistory()
    return FileHistory(str(path))


def prompt_reader(no_color: bool, warn: Callable[[str], None] = lambda message: None,
                  default: str = "") -> Callable[[], str]:
    """A prompt-toolkit session: history file, multi-line input, slash-command completion.
    Raises EOFError to leave (Ctrl-D, or Ctrl-C on an empty line)."""
    # start-up: prompt_toolkit takes 0.45 s to import; only an interactive chat needs it
    from prompt_toolkit import PromptSession
    from prompt_toolkit.completion import Completer, Completion
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.output import ColorDepth
    from prompt_toolkit.styles import Style

    class SlashCompleter(Completer):
        def get_completions(self, document, complete_event):
            for text, start, meta in slash.completions(document.text_before_cursor):
                yield Completion(text, start_position=start, display_meta=meta or None)

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

    # input history across sessions; where the data directory cannot be written, this session's only
    history = _history(data_dir() / "history", warn)
    session = PromptSession(
        history=history,
        completer=SlashCompleter(),
        complete_while_typing=True,
        multiline=True,
        key_bindings=keys,
        prompt_continuation="… ",
        style=Style.from_dict({"prompt": "bold ansimagenta"}),
        color_depth=ColorDepth.DEPTH_1_BIT if no_color else None,
    )
    first = [default]  # an unanswered message from --resume, ready to send again

    def read() -> str:
        text, first[0] = first[0], ""
        return session.prompt([("class:prompt", "› ")], default=text)

    return read


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
        except Terminated:  # SIGTERM / SIGHUP while waiting for input: end the chat
            raise
        except KeyboardInterrupt:  # Ctrl-C outside our key binding (e.g. while the prompt starts)
            break
        session.handle(line)


# -- the command -----------------------------------------------------------------------------------


@opt.run_args()
def chat_command(
    run: opt.RunArgs,
    system: Annotated[str | None, typer.Option("--system", help="System message.", rich_help_panel=opt.MODELS)] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="Continue the conversation saved in this transcript (JSONL) and keep appending to it.", rich_help_panel=opt.OUTPUT, show_default=False)] = None,
    show_stats: Annotated[bool, typer.Option("--stats", help="After each reply, print the speculation breakdown (per-position acceptance, accepted lengths).", rich_help_panel=opt.OUTPUT)] = False,
    no_color: opt.NoColor = False,
) -> None:
    """Chat with a model; watch which tokens the draft got right.

    Replies stream coloured by where each token came from (legend at the start), above a live footer: tokens/s, acceptance, tokens per step, current draft length. Both KV caches are kept between turns, so a turn evaluates only its new tokens; when the context fills, the oldest exchanges are dropped, with a notice.

    Keys: Enter sends; Alt+Enter (or Esc then Enter) starts a new line; Tab completes /commands; Ctrl-C stops a reply, and at an empty prompt exits, as Ctrl-D does. Commands: /help /reset /stats /draft N /temp X /spec on|off /rpc off /system TEXT /save FILE /exit.

    Prompts are what llama.cpp (llama-server --jinja) renders for the same messages. The chat template comes from --chat-template / --chat-template-file, else models.toml, else the target's GGUF metadata; a model without one (a base model such as gemma-3-270m) gets a plain "User: / Assistant:" transcript. Each message is appended to a JSONL transcript in $XDG_DATA_HOME/specchat/transcripts as soon as it is final; --resume FILE continues one.
    """
    config = load_config()
    run = run_options(config, run)
    if system is not None:
        check_text(system, "--system")
    resumed = read_transcript(resume) if resume is not None else None
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    console = ui.make_console(no_color=no_color)
    info = console if sys.stdout.isatty() else ui.make_console(stderr=True, no_color=no_color)
    with loading(config, run, info) as loaded:
        if resumed is not None:
            transcript = Transcript(resume)
            transcript.records = resumed.records
            if resumed.torn is not None:
                transcript.drop_torn_tail(resumed.torn)
            system = system or resumed.system
        else:
            transcript = Transcript.new()  # a file of its own, or a warning in the header
        session = ChatSession(
            loaded, run, console=console, info=info, system=system, transcript=transcript,
            live=sys.stdout.isatty(), show_stats=show_stats,
        )
        try:
            if session.conversation.system and (resumed is None or session.conversation.system != resumed.system):
                session.save({"role": "system", "content": session.conversation.system})
            session.header()  # at once: a first run measures this machine next, and says so
            session.prepare_policy()
            if resumed is not None:
                restore(session, resumed)
            pending = resumed.pending if resumed is not None else None
            if interactive:
                read = prompt_reader(no_color, warn=lambda m: session.notice(m, "spec.error"), default=pending or "")
            else:
                read = line_reader(sys.stdin)
            loop(session, read)
        finally:
            if resumed is None and not session.transcript.records:
                session.transcript.discard()  # nothing was said: no empty file left behind
            elif session.transcript.saving:
                info.print(Text(f"transcript: {session.transcript.path}", style="spec.legend"))


def restore(session: ChatSession, resumed: Resumed | list[dict]) -> None:
    """Show the resumed conversation and evaluate it once; say what could not be paired, and which
    message had no reply."""
    if not isinstance(resumed, Resumed):
        resumed = Resumed(None, list(resumed), [])
    turns = resumed.turns
    if resumed.torn is not None:
        session.notice(resumed.torn.describe(session.transcript.path), "spec.error")
    for m in turns:
        who = "›" if m["role"] == "user" else " "
        style = "spec.user" if m["role"] == "user" else "spec.legend"
        session.info.print(Text(f"{who} {m['content']}", style=style))
    if resumed.skipped:
        session.notice(f"left out {len(resumed.skipped)} message{'s' if len(resumed.skipped) != 1 else ''} that "
                       f"could not be paired: {', '.join(resumed.skipped)}", "spec.error")
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
    k = resumed.exchanges
    session.notice(f"resumed {k} exchange{'s' if k != 1 else ''} ({n} tokens, {time.perf_counter() - started:.1f} s)")
    if resumed.pending is not None:
        session.notice(f"your last message had no reply: {shorten(resumed.pending)} · it is in the prompt "
                       "(Enter sends it)" if session.live else
                       f"your last message had no reply: {shorten(resumed.pending)} · send it again to answer it")


def shorten(text: str, width: int = 60) -> str:
    one_line = " ".join(text.split())
    return repr(one_line if len(one_line) <= width else one_line[: width - 1] + "…")
