"""specchat's command line: the Typer app, the one table of its commands, and `main`, which turns every
SpecchatError into one line and exit code 2. The app's command classes (Typer's `cls=`) show every alias of
a flag on its help page and carry a Ctrl-C past Typer to `main`; importing this module changes nothing
in Typer. The commands live in their own modules (prompt_command, models_view, report.command, chat,
rpc_command); nothing here touches a model."""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from . import __version__
from .chat import chat_command
from .errors import SpecchatError
from .models_view import models_command
from .prompt_command import prompt_command
from .report.command import report_command
from .rpc_command import rpc_server_command
from .runner import Terminated, clear_activity, current_activity


class _Interrupted(Exception):
    """Carries a KeyboardInterrupt (Ctrl-C, or Terminated) past Typer, which would turn it into a silent
    exit code 130."""

    def __init__(self, interrupt: KeyboardInterrupt):
        super().__init__()
        self.interrupt = interrupt


@contextmanager
def _one_flag_name_a_line():
    """While a help page renders, each of a flag's names on a line of its own. Typer joins a flag's names
    with ',' and Rich cuts what does not fit its column with '…' (`--draft,--model-draft,--spe…`), and
    Typer has no hook for that join: its rich_utils module's two highlighters, which every joined name
    passes through, are swapped for ones that break at the commas, and put back when the page is done."""
    from typer import rich_utils  # start-up: 0.4 s (rich.markdown, pygments); only a help page needs it

    def one_a_line(base):
        def highlight(text):
            if isinstance(text, str):
                return base(Text(text.replace(",", "\n"), overflow="fold"))
            return base(text)

        return highlight

    saved = rich_utils.highlighter, rich_utils.negative_highlighter
    rich_utils.highlighter, rich_utils.negative_highlighter = (one_a_line(base) for base in saved)
    try:
        yield
    finally:
        rich_utils.highlighter, rich_utils.negative_highlighter = saved


class _EveryAlias:
    """A help page that shows every alias of a flag (see _one_flag_name_a_line)."""

    def format_help(self, ctx, formatter) -> None:
        with _one_flag_name_a_line():
            super().format_help(ctx, formatter)


class SpecchatCommand(_EveryAlias, TyperCommand):
    """Each command of the app (`app.command(cls=...)`)."""


class SpecchatGroup(_EveryAlias, TyperGroup):
    """The app (`typer.Typer(cls=...)`): a KeyboardInterrupt inside a command is carried out as
    _Interrupted, for `main` to report (Typer would end with a silent 130)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            raise _Interrupted(e) from None


app = typer.Typer(
    cls=SpecchatGroup,
    name="specchat",
    help="Local speculative chat: a small draft proposes, a large target verifies, you see which tokens were accepted.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"specchat {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", "-V", help="Print the version and exit.", callback=_version, is_eager=True)] = False,
) -> None:
    """Local speculative chat: a small draft proposes, a large target verifies, you see which tokens were accepted."""


# Every command, in the order `specchat --help` lists them. Each lives in its own module and only
# delegates: loading, generating and showing are the runner's, the engine's and the views' work.
app.command("prompt", cls=SpecchatCommand)(prompt_command)
app.command("models", cls=SpecchatCommand)(models_command)
app.command("report", cls=SpecchatCommand)(report_command)
app.command("chat", cls=SpecchatCommand)(chat_command)
app.command("rpc-server", cls=SpecchatCommand)(rpc_server_command)


def report(message: str) -> None:
    """One line on stderr: no markup (messages quote things like `specchat[models]`), no wrapping."""
    Console(stderr=True, soft_wrap=True, highlight=False).print(message, markup=False)


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


def _on_termination_signals():
    """SIGTERM and SIGHUP end the command as Ctrl-C does (a reply is cut and saved, the screen left
    tidy). Returns the previous handlers, to put back."""
    saved = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is None:
            continue
        try:
            saved[sig] = signal.signal(sig, _raise_terminated)
        except (ValueError, OSError):  # not the main thread
            pass
    return saved


def main(argv: list[str] | None = None) -> None:
    """Entry point: every user error becomes one line on stderr and exit code 2, never a traceback."""
    command = typer.main.get_command(app)
    saved = _on_termination_signals()
    try:
        code = _run(command, argv)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    sys.exit(code if isinstance(code, int) else 0)


def _run(command, argv) -> int:
    clear_activity()
    try:
        code = command.main(args=argv, prog_name="specchat", standalone_mode=False)
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        report("specchat: aborted")
        code = 130
    except typer.TyperException as e:
        # the parser's own message ("Invalid value for '--temp': ...") without its usage banner
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        if message.strip():  # (no command at all: the help page was the answer)
            report(f"specchat: error: {' '.join(message.split())}")
        code = 2
    except SpecchatError as e:
        report(f"specchat: error: {e}")
        code = 2
    except (KeyboardInterrupt, _Interrupted) as caught:
        e = caught.interrupt if isinstance(caught, _Interrupted) else caught
        what = current_activity()
        how = f"stopped by {e.name}" if isinstance(e, Terminated) else "interrupted"
        report(f"\nspecchat: {how}" + (f" while {what}" if what else ""))
        code = 128 + e.signum if isinstance(e, Terminated) else 130
    except BrokenPipeError:
        code = 0
    return code


if __name__ == "__main__":
    main()
