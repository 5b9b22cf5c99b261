"""specchat's command line. Each command parses its options, builds the pieces, and hands off: the
engine generates, the view shows, the report aggregates. Nothing here touches a model directly."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated

import typer
from rich.console import Console

from . import options as opt
from . import ui
from .config import load_config
from .crossvocab import rule_info, rule_label
from .engine import Finished, TokenEvent, check_fits, generate
from .loader import Loaded
from .runner import (
    USER_ERRORS, RunOptions, Terminated, check_text, current_activity, loading, measuring, read_prompt, run_options,
)

app = typer.Typer(
    name="specchat",
    help="Local speculative chat: a small draft proposes, a large target verifies, you see which tokens were accepted.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"specchat {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", "-V", help="Print the version and exit.", callback=_version, is_eager=True)] = False,
) -> None:
    """Local speculative chat: a small draft proposes, a large target verifies, you see which tokens were accepted."""


def _wrap_flag_names() -> None:
    """Typer joins a flag's names with ',' and Rich cuts what does not fit its column with '…'
    (`--draft,--model-draft,--spe…`): one name per line, so every alias shows at any width."""
    from rich.text import Text
    from typer import rich_utils

    for name in ("highlighter", "negative_highlighter"):
        base = getattr(rich_utils, name)
        if getattr(base, "specchat_wraps", False):
            continue

        def wrapped(text, base=base):
            if isinstance(text, str):
                return base(Text(text.replace(",", "\n"), overflow="fold"))
            return base(text)

        wrapped.specchat_wraps = True
        setattr(rich_utils, name, wrapped)


_wrap_flag_names()


@app.command()
@opt.run_args()
def prompt(
    text: Annotated[str, typer.Argument(help="Prompt text, or - to read it from stdin.", show_default=False)],
    run: opt.RunArgs,
    system: Annotated[str | None, typer.Option("--system", help="System message (chat-template models).", rich_help_panel=opt.MODELS)] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the text as is, without the model's chat template.", rich_help_panel=opt.MODELS)] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: text, tokens, prompt_token_ids, stats.", rich_help_panel=opt.OUTPUT)] = False,
    show_stats: Annotated[bool, typer.Option("--stats", help="Print a speculation summary to stderr at the end.", rich_help_panel=opt.OUTPUT)] = False,
    no_color: opt.NoColor = False,
) -> None:
    """Generate one reply to TEXT and exit.

    Uses the model's chat template when it has one (SmolLM2-Instruct does), else completes the raw text.
    Without -m/--pair it runs the `default` pair: SmolLM2-135M-Instruct with prompt lookup.
    """
    config = load_config()
    run = run_options(config, run)
    if system is not None:
        check_text(system, "--system")
    text = read_prompt(text)
    err = ui.make_console(stderr=True, no_color=no_color)  # no_color=False still honours NO_COLOR
    with loading(config, run, err) as loaded:
        from .template import render

        if raw or not loaded.target.chat_template:
            prompt_ids = loaded.target.tokenize(text, add_special=True)
            stops = list(run.stop)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            rendered = render(loaded.target, messages)
            prompt_ids, stops = rendered.token_ids, rendered.stop + run.stop
        check_fits(prompt_ids, loaded.target.n_ctx)  # before the view starts
        with measuring(err) as notify:
            policy = run.policy(loaded, notify=notify)
        events = generate(
            loaded.target, loaded.drafter, prompt_ids, run.for_target(loaded.target), max_tokens=run.max_tokens, stop=stops,
            policy=policy,
        )
        note = lambda: getattr(policy, "last_note", None)  # noqa: E731  why nothing was drafted, if so
        if as_json:
            finished = print_json(events, loaded, run, note)
            if show_stats and finished is not None:
                err.print(ui.summary_line(finished.stats, finished.finish_reason, loaded.drafter_label, note()))
        elif sys.stdout.isatty():
            # a terminal: coloured tokens, live footer, one-line summary (and the breakdown with --stats)
            out = ui.make_console(no_color=no_color)
            if ui.colour_on(out):
                out.print(ui.legend())
            finished = ui.show(events, ui.LiveView(out, label=rule_label(loaded.drafter, run.params)))
            if finished is not None:
                out.print(ui.summary_line(finished.stats, finished.finish_reason, loaded.drafter_label, note()))
                if show_stats:
                    out.print(ui.breakdown(finished.stats))
        else:
            # a pipe: the text only; numbers on stderr when asked for
            finished = ui.show(events, ui.PlainView(sys.stdout))
            if show_stats and finished is not None:
                err.print(ui.summary_line(finished.stats, finished.finish_reason, loaded.drafter_label, note()))
                err.print(ui.breakdown(finished.stats))


def print_json(events, loaded: Loaded, run: RunOptions, note=lambda: None) -> Finished:
    tokens = []
    finished = None
    for event in events:
        if isinstance(event, TokenEvent):
            tokens.append({"id": event.id, "text": event.text, "source": event.source})
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    doc = {
        "text": finished.text,
        "tokens": tokens,
        "prompt_token_ids": finished.prompt_token_ids,
        "finish_reason": finished.finish_reason,
        "target": loaded.target_spec.name,
        "drafter": loaded.drafter_label,
        "params": {**dataclasses.asdict(run.params), "draft_max": run.draft_max, "draft_fixed": run.draft_fixed,
                   "reproducible": run.reproducible},
        "stats": finished.stats.as_dict(),
    }
    if note():  # the policy drafted nothing: why
        doc["draft_note"] = note()
    cross = rule_info(loaded.drafter, run.params)
    if cross is not None:  # a draft with another tokenizer: which rule ran
        doc["cross_vocab"] = cross
    json.dump(doc, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return finished


@app.command()
def models() -> None:
    """List the models and pairs from models.toml (and your overrides): where each comes from, whether
    its file is here, and for pairs whether draft and target are compatible."""
    from .models_view import models_tables

    config = load_config()
    console = Console()
    for table in models_tables(config):
        console.print(table)


from .report.command import report_command  # noqa: E402

app.command("report")(report_command)

from .chat import chat_command  # noqa: E402

app.command("chat")(chat_command)

from .rpc_command import rpc_server_command  # noqa: E402

app.command("rpc-server")(rpc_server_command)


def report(message: str) -> None:
    """One line on stderr: no markup (messages quote things like `specchat[models]`), no wrapping."""
    Console(stderr=True, soft_wrap=True, highlight=False).print(message, markup=False)


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


def _on_termination_signals():
    """SIGTERM and SIGHUP end the command as Ctrl-C does (a reply is cut and saved, the screen left
    tidy). Returns the previous handlers, to put back."""
    import signal

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
    import signal

    command = typer.main.get_command(app)
    saved = _on_termination_signals()
    try:
        code = _run(command, argv)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    sys.exit(code if isinstance(code, int) else 0)


class _Interrupted(Exception):
    """Carries a KeyboardInterrupt (Ctrl-C, or Terminated) past Typer, which would turn it into a silent
    exit code 130."""

    def __init__(self, interrupt: KeyboardInterrupt):
        super().__init__()
        self.interrupt = interrupt


def _run(command, argv) -> int:
    from .runner import _activity

    _activity.clear()
    invoke = command.invoke

    def invoke_reporting_interrupts(ctx):
        try:
            return invoke(ctx)
        except KeyboardInterrupt as e:
            raise _Interrupted(e) from None

    command.invoke = invoke_reporting_interrupts
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
    except USER_ERRORS as e:
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
