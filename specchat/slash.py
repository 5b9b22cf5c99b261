"""The chat's slash commands: one table that serves /help, Tab completion and dispatch.

Each command is a function of (session, argument); `ChatSession.command` looks the name up here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.text import Text

from . import ui
from .runner import REASONING
from .transcript import Transcript

if TYPE_CHECKING:
    from .chat import ChatSession

KEYS = "Enter sends · Alt+Enter (or Esc, Enter): new line · Tab completes /commands · Ctrl-C stops a reply · Ctrl-D exits"


@dataclass(frozen=True)
class SlashCommand:
    name: str
    arg: str  # what the argument looks like, for /help
    help: str
    run: Callable[[ChatSession, str], None]
    values: tuple[str, ...] = ()  # the argument's possible values, for completion
    aliases: tuple[str, ...] = ()


def _help(session: ChatSession, arg: str) -> None:
    for cmd in COMMANDS:
        session.info.print(Text.assemble((f"{cmd.name} {cmd.arg}".ljust(16), "spec.help.key"), " ", cmd.help))
    session.info.print(Text(KEYS, style="spec.legend"))
    if ui.colour_on(session.info):
        session.info.print(ui.legend())


def _reset(session: ChatSession, arg: str) -> None:
    session.conversation.reset()
    session.transcript = Transcript.new()
    session.unsaved_warned = False
    if session.transcript.path is None:
        session.notice(f"conversation reset · transcript not saved: {session.transcript.error}")
        session.unsaved_warned = True
        return
    if session.conversation.system:
        session.save({"role": "system", "content": session.conversation.system})
    session.notice(f"conversation reset · new transcript {session.transcript.path}")


def _stats(session: ChatSession, arg: str) -> None:
    if session.last_stats is None:
        session.notice("no reply yet")
        return
    session.info.print(ui.breakdown(session.last_stats))
    session.info.print(Text("session: ", style="bold").append(
        ui.summary_line(session.totals, _count(len(session.turn_log), "reply", "replies"))))


def _draft(session: ChatSession, arg: str) -> None:
    try:
        n = int(arg)
        if n < 0:
            raise ValueError
    except ValueError:
        session.notice("/draft takes a whole number ≥ 0 (0 = no drafting)", "spec.error")
        return
    if session.loaded.drafter is None and n > 0:
        session.notice("no drafter was loaded (--no-spec): restart without it to draft", "spec.error")
        return
    session.draft_max = n
    session.rebuild_policy()
    session.notice(f"draft max {n}" + (" (no drafting)" if n == 0 else ""))


def _temp(session: ChatSession, arg: str) -> None:
    try:
        params = dataclasses.replace(session.params, temperature=float(arg))
        params.check()
    except ValueError:
        session.notice(f"/temp takes a number ≥ 0, not {arg!r}" if arg else "/temp takes a number ≥ 0", "spec.error")
        return
    session.conversation.params = params
    session.notice(f"temperature {params.temperature:g}" + (" (greedy)" if params.greedy else ""))


def _spec(session: ChatSession, arg: str) -> None:
    if arg not in ("on", "off"):
        session.notice("/spec takes on or off", "spec.error")
        return
    if arg == "on" and session.loaded.drafter is None:
        session.notice("no drafter was loaded (--no-spec): restart without it to speculate", "spec.error")
        return
    session.spec_on = arg == "on"
    session.notice(f"speculation {arg}" + ("" if session.spec_on else " (target only)"))


def _rpc(session: ChatSession, arg: str) -> None:
    session.rpc_command(arg)


def _system(session: ChatSession, arg: str) -> None:
    conv = session.conversation
    if not arg:
        session.notice(f"system message: {conv.system!r}" if conv.system else "no system message")
        return
    conv.set_system(arg)
    session.save({"role": "system", "content": arg})
    session.notice("system message set; the next turn evaluates the conversation again")


def _save(session: ChatSession, arg: str) -> None:
    if not arg:
        session.notice("/save takes a file name", "spec.error")
        return
    try:
        session.transcript.save_as(Path(arg))
    except OSError as e:
        session.notice(f"cannot write {arg}: {e.strerror or e}", "spec.error")
        return
    session.notice(f"saved {_count(len(session.transcript.records), 'message', 'messages')} to {arg}")


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _thought(session: ChatSession, arg: str) -> None:
    last = next((m for m in reversed(session.conversation.turns) if m["role"] == "assistant"), None)
    if last is None or not last.get("reasoning_content"):
        session.notice("no thought yet" if last is None else "the last reply had no thought")
        return
    session.info.print(Text(last["reasoning_content"], style="spec.thought"))


def _reasoning(session: ChatSession, arg: str) -> None:
    if arg not in REASONING:
        session.notice("/reasoning takes on, off or auto", "spec.error")
        return
    session.set_thinking(REASONING[arg])
    session.notice(f"thinking {arg}" + (" (the template's default)" if arg == "auto" else "") + " from the next turn")


def _exit(session: ChatSession, arg: str) -> None:
    session.done = True


COMMANDS = (
    SlashCommand("/help", "", "this list", _help),
    SlashCommand("/reset", "", "forget the conversation (keeps the system message), new transcript", _reset),
    SlashCommand("/stats", "", "speculation breakdown of the last reply, and the session's totals", _stats),
    SlashCommand("/draft", "N", "most tokens drafted per step (0 = no drafting)", _draft),
    SlashCommand("/temp", "X", "sampling temperature (0 = greedy)", _temp),
    SlashCommand("/spec", "on|off", "speculation on, or off (target only)", _spec, values=("on", "off")),
    SlashCommand("/rpc", "off", "where the target's layers are; off: reload it on this machine (a worker is gone)",
                 _rpc, values=("off",)),
    SlashCommand("/thought", "", "show the last reply's thought in full (a reasoning model)", _thought),
    SlashCommand("/reasoning", "on|off|auto", "thinking on or off for the next turns (the template's enable_thinking)",
                 _reasoning, values=("on", "off", "auto")),
    SlashCommand("/system", "TEXT", "set the system message (without TEXT: show it)", _system),
    SlashCommand("/save", "FILE", "write the transcript to FILE (continue it later with --resume FILE)", _save),
    SlashCommand("/exit", "", "leave (also Ctrl-D, or Ctrl-C at an empty prompt)", _exit, aliases=("/quit", "/q")),
)
_BY_NAME = {name: cmd for cmd in COMMANDS for name in (cmd.name, *cmd.aliases)}


def find(name: str) -> SlashCommand | None:
    return _BY_NAME.get(name.lower())


def completions(text: str) -> list[tuple[str, int, str]]:
    """What Tab offers for the text before the cursor: (completion, start position, description)."""
    if not text.startswith("/") or "\n" in text:
        return []
    if " " not in text:
        return [(cmd.name, -len(text), f"{cmd.arg} {cmd.help}".strip())
                for cmd in COMMANDS if cmd.name.startswith(text.lower())]
    name, word = text.split(" ", 1)
    cmd = find(name)
    return [(value, -len(word), "") for value in (cmd.values if cmd else ()) if value.startswith(word)]
