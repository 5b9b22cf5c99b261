"""`specchat prompt`: one reply to one prompt, as coloured text on a terminal, plain text down a pipe, or
one JSON object (--json)."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated

import typer

from . import options as opt
from . import ui
from .config import load_config
from .drafters import run_info, run_label
from .engine import Finished, TokenEvent, check_fits, generate
from .loader import Loaded
from .runner import RunOptions, check_text, loading, measuring, read_prompt, run_options
from .reasoning import budget_for, prepare as prepare_reasoning, split_events
from .template import has_template, render
from .tree_drafts import tree_note


@opt.run_args()
def prompt_command(
    text: Annotated[str, typer.Argument(help="Prompt text, or - to read it from stdin.", show_default=False)],
    run: opt.RunArgs,
    system: Annotated[str | None, typer.Option("--system", help="System message (chat-template models).", rich_help_panel=opt.MODELS)] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the text as is, without the model's chat template.", rich_help_panel=opt.MODELS)] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: text, tokens, prompt_token_ids, stats.", rich_help_panel=opt.OUTPUT)] = False,
    show_stats: Annotated[bool, typer.Option("--stats", help="Print a speculation summary to stderr at the end.", rich_help_panel=opt.OUTPUT)] = False,
    no_color: opt.NoColor = False,
) -> None:
    """Generate one reply to TEXT and exit.

    Uses the model's chat template when it has one (SmolLM2-Instruct does), or the one --chat-template /
    --chat-template-file names, rendered as llama.cpp renders it; else completes the raw text.
    Without -m/--pair it runs the `default` pair: SmolLM2-135M-Instruct with prompt lookup.
    """
    config = load_config()
    run = run_options(config, run)
    if system is not None:
        check_text(system, "--system")
    text = read_prompt(text)
    err = ui.make_console(stderr=True, no_color=no_color)  # no_color=False still honours NO_COLOR
    with loading(config, run, err) as loaded:
        reasoning = None
        if raw or not has_template(loaded.target):
            prompt_ids = loaded.target.tokenize(text, add_special=True)
            stops = list(run.stop)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            rendered = render(loaded.target, messages)
            prompt_ids, stops = rendered.token_ids, rendered.stop + run.stop
            reasoning = prepare_reasoning(loaded.target, rendered.text, run.reasoning)
        check_fits(prompt_ids, loaded.target.n_ctx)  # before the view starts
        if tree_note(loaded.target, run.draft_tree):
            err.print(tree_note(loaded.target, run.draft_tree))
        with measuring(err) as notify:
            policy = run.policy(loaded, notify=notify)
        events = split_events(generate(
            loaded.target, loaded.drafter, prompt_ids, run.for_target(loaded.target), max_tokens=run.max_tokens, stop=stops,
            policy=policy, budget=budget_for(reasoning, run.reasoning, loaded.target),
            phases=reasoning.splitter() if reasoning is not None else None,
        ), reasoning)
        note = lambda: policy.last_note  # noqa: E731  why nothing was drafted, if so
        if as_json:
            finished = print_json(events, loaded, run, note)
            if show_stats and finished is not None:
                err.print(ui.summary_line(finished.stats, finished.finish_reason, loaded.drafter_label, note()))
        elif sys.stdout.isatty():
            # a terminal: coloured tokens, live footer, one-line summary (and the breakdown with --stats)
            out = ui.make_console(no_color=no_color)
            if ui.colour_on(out):
                out.print(ui.legend())
            finished = ui.show(events, ui.LiveView(out, label=run_label(loaded.drafter, run.params)))
            if finished is not None:
                out.print(ui.summary_line(finished.stats, finished.finish_reason, loaded.drafter_label, note()))
                if show_stats:
                    out.print(ui.breakdown(finished.stats))
                    if ui.phases_line(finished.split and finished.split.stats) is not None:
                        out.print(ui.phases_line(finished.split and finished.split.stats))
        else:
            # a pipe: the text only; numbers on stderr when asked for
            finished = ui.show(events, ui.PlainView(sys.stdout))
            if show_stats and finished is not None:
                err.print(ui.summary_line(finished.stats, finished.finish_reason, loaded.drafter_label, note()))
                err.print(ui.breakdown(finished.stats))
                if ui.phases_line(finished.split and finished.split.stats) is not None:
                    err.print(ui.phases_line(finished.split and finished.split.stats))


def print_json(events, loaded: Loaded, run: RunOptions, note=lambda: None) -> Finished:
    tokens = []
    finished = None
    for event in events:
        if isinstance(event, TokenEvent):
            tokens.append({"id": event.id, "text": event.text, "source": event.source,
                           **({"phase": event.phase} if event.phase != "answer" else {})})
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    doc = {
        "text": finished.text,
        **({"content": finished.split.content, "reasoning_content": finished.split.reasoning_content,
            "phases": {phase: stats.as_dict() for phase, stats in finished.split.stats.items()}}
           if finished.split is not None else {}),
        "tokens": tokens,
        "prompt_token_ids": finished.prompt_token_ids,
        "finish_reason": finished.finish_reason,
        "target": loaded.target_spec.name,
        "drafter": loaded.drafter_label,
        "params": {**dataclasses.asdict(run.params), "draft_max": run.draft_max, "draft_fixed": run.draft_fixed,
                   "draft_tree": run.draft_tree,
                   "reproducible": run.reproducible},
        "stats": finished.stats.as_dict(),
    }
    if note():  # the policy drafted nothing: why
        doc["draft_note"] = note()
    doc.update(run_info(loaded.drafter, run.params))  # (a draft with another tokenizer: which rule ran)
    json.dump(doc, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return finished
