"""`specchat report`, the command: parse, load, run, aggregate, write, print."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from .. import options as opt
from .. import runner  # (its functions are looked up when called: tests put fakes there)
from ..config import load_config
from ..costs import cost_cache_key, recalibrate
from ..drafters import members, own_backends, run_info, run_label
from ..errors import UserError
from ..loader import make_policy
from ..paths import cache_dir
from ..policy import FixedPolicy, Policy
from ..reasoning import budget_for, prepare as prepare_reasoning
from ..stats import RunStats
from ..template import has_template, render, render_text
from ..tree_drafts import tree_policy
from ..ui import phases_line
from .prompts import ALL, BASELINE, POLICY, PromptItem, Setting, load_prompts, parse_sweep, select_prompts
from .render import (TERMINAL_POSITIONS, build_doc, check_out_dir, number_text, rich_tables, speedup_text, table_specs,
                     usage_hint, write_outputs)
from .run import run_report, warm_up


# -- the command -------------------------------------------------------------------------------------

REPORT = "Report"


def phases_by_setting(records, settings) -> dict[str, dict[str, RunStats]]:
    """A thinking model's speculation in the thought and in the answer apart, per setting (merged over runs)."""
    out: dict[str, dict[str, RunStats]] = {}
    for setting in settings:
        runs = [r for r in records if r.setting == setting.name and r.phases]
        if runs:
            merged = {phase: RunStats() for phase in runs[0].phases}
            for r in runs:
                for phase, stats in r.phases.items():
                    merged[phase].merge(stats)
            out[setting.name] = merged
    return out


def projection_basis(pr: dict) -> str:
    """Which positions the projection stands on, and which it left out."""
    n = pr["measured_positions"]
    used = "position 1" if n == 1 else f"positions 1-{n}"
    text = f"from {used} (each drafted at least {pr.get('min_samples', 1)} times"
    left = pr.get("positions_left_out", 0)
    if left:
        text += f"; {left} further position{'s' if left != 1 else ''} drafted fewer times left out"
    return text + ")"


def measure_again(loaded, console) -> None:
    """--recalibrate: time the target (and a draft model or head, whose cost the policy reads too) afresh
    and replace what the cost cache held for them, observations included."""
    backends = {}
    for backend in (loaded.target, *own_backends(loaded.drafter)):
        backends.setdefault(cost_cache_key(backend), backend)  # a self-pair's draft costs what its target does

    notify = runner.measuring_notice(console)  # "measuring this machine again for M (about N s): as asked (--recalibrate)"
    for backend in backends.values():
        with runner.activity(f"measuring this machine again ({backend.name}); its saved costs were kept"):
            recalibrate(backend, cache_dir() / "costs.json", notify)


@opt.run_args(
    # report always runs target-only as its baseline: --no-spec would leave nothing to compare
    exclude=("no_spec",),
    defaults={"max_tokens": 128, "temp": 0.0, "seed": 0},
    help={
        "temp": "Temperature. Default 0 (greedy) so the runs compared are alike; a seeded temperature > 0 measures sampled acceptance.",
        "draft_max": "Most tokens the `policy` setting drafts per step (0 = no drafting); the policy picks k up to it.",
        "draft_fixed": "Also run a fixed draft length of N tokens (added to --sweep).",
        "lookup_history": "Keep this run's replies as a prompt-lookup source for later chats and prompts. The report never reads them itself, so it measures the same thing each time.",
    },
)
def report_command(
    run: opt.RunArgs,
    sweep: Annotated[str, typer.Option("--sweep", help="Settings to compare: comma-separated fixed draft lengths (0 = target-only) and/or `policy` (the adaptive default, up to --draft-max). Target-only always runs. Example: 0,2,4,6,8,policy.", rich_help_panel=opt.SPEC)] = POLICY,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="Prompt file: JSONL {\"id\", \"category\", \"turns\": [...]} (several turns run as a conversation) or one prompt per line. Default: the built-in set (36 prompts, 6 kinds of work).", rich_help_panel=REPORT, show_default=False)] = None,
    category: Annotated[list[str] | None, typer.Option("--category", help="Only prompts of this category (repeatable).", rich_help_panel=REPORT, show_default=False)] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Only the first N prompts (the built-in set interleaves categories).", rich_help_panel=REPORT, show_default=False)] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for report.json, report.md and report.png.", rich_help_panel=REPORT)] = Path("specchat-report"),
    recalibrate: Annotated[bool, typer.Option("--recalibrate", help="Measure what batches cost on this machine again before running (the models loaded), and save it for later runs too: after the machine changed, or when the costs were measured while it was busy.", rich_help_panel=REPORT)] = False,
    no_color: opt.NoColor = False,
) -> None:
    """Measure whether speculation pays for this target and drafter here, and at what setting.

    Each prompt runs target-only and with every --sweep setting: same seed, order alternated.
    Per category and overall: acceptance, tau, per-position acceptance, accepted-length histogram,
    tok/s, measured speedup (generation and end-to-end), draft share, a PROJECTED GPU-like speedup.
    Recommends the setting with the best measured end-to-end speedup.
    Writes report.json (every run), report.md and report.png to --out. Greedy (--temp 0) by default.
    """
    # start-up: rich.progress takes 20 ms to import; only a report's run needs it
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    if recalibrate and run.reproducible:
        raise UserError("--recalibrate measures this machine's costs and --reproducible uses fixed ones: drop one")
    settings = parse_sweep(sweep, () if run.draft_fixed is None else (run.draft_fixed,))
    items, source = load_prompts(prompts)
    items = select_prompts(items, category, limit)
    check_out_dir(out)
    config = load_config()
    keep_replies = run.lookup_history
    # every setting is explicit (--draft-fixed is one of them); the report never reads earlier replies
    run = runner.run_options(config, dataclasses.replace(run, draft_fixed=None, lookup_history=False))
    err = Console(stderr=True, no_color=no_color)
    console = Console(no_color=no_color)
    with runner.loading(config, run, err) as loaded:
        if recalibrate:
            measure_again(loaded, err)
        params = run.for_target(loaded.target)

        def render_messages(messages: list[dict]) -> tuple[list[int], list[str]]:
            rendered = render(loaded.target, messages)
            return rendered.token_ids, rendered.stop + run.stop

        def reasoning_for(messages: list[dict]):
            if not has_template(loaded.target):
                return None, lambda: None
            reasoning = prepare_reasoning(loaded.target, render_text(loaded.target, messages), run.reasoning)
            return reasoning, lambda: budget_for(reasoning, run.reasoning, loaded.target)

        def policy_for(setting: Setting) -> Policy:
            if setting.k is None:
                return tree_policy(make_policy(loaded, run.draft_max, None, reproducible=run.reproducible,
                                               notify=runner.measuring_notice(err)), run.draft_tree)
            return tree_policy(FixedPolicy(setting.k), run.draft_tree)  # (--draft-tree: trees in every setting)

        total = sum(len(i.turns) for i in items) * len(settings)
        progress = Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err, transient=True,
            disable=not err.is_terminal,
        )
        with progress:
            task = progress.add_task("warming up", total=total)
            warm_up(loaded.target, loaded.drafter, items[0], settings, params, render_messages, policy_for)

            def on_start(item: PromptItem, turn: int, setting: Setting) -> None:
                label = item.id + (f" turn {turn + 1}" if len(item.turns) > 1 else "")
                progress.update(task, description=f"{label} · {setting.name}")

            records = run_report(
                loaded.target, loaded.drafter, items, settings, params, max_tokens=run.max_tokens,
                render=render_messages, policy_for=policy_for, on_start=on_start, reasoning_for=reasoning_for,
                on_run=lambda *a: progress.advance(task),
            )
        rule = run_label(loaded.drafter, run.params)
        doc = build_doc(
            records, target=loaded.target_spec.name,
            drafter=loaded.drafter_label + (f" ({rule})" if rule else ""),
            drafter_kind=",".join(m.kind.name for m in members(loaded.drafter)) if loaded.drafter is not None else None,
            settings=settings,
            items=items, source=source, params=params, max_tokens=run.max_tokens, threads=loaded.target.n_threads,
        )
        doc.update(run_info(loaded.drafter, run.params))
        phases = phases_by_setting(records, settings)
        if phases:  # a thinking model: the thought and the answer apart
            doc["phases"] = {name: {phase: stats.as_dict() for phase, stats in by_phase.items()}
                             for name, by_phase in phases.items()}
    paths = write_outputs(doc, out)
    if keep_replies:
        from ..history import save_replies  # start-up: 50 ms with prompt lookup, which it imports

        save_replies((r.text for r in records if r.setting == BASELINE), target=loaded.target_spec.name)
    console.print(f"[bold]{doc['target']}[/] drafted by [bold]{doc['drafter']}[/] · {len(items)} prompts · "
                  f"{len(records)} runs · max {run.max_tokens} tokens · temp {run.params.temperature}")
    detail = table_specs(doc, max_positions=TERMINAL_POSITIONS, compact=True)
    overall = table_specs(doc, categories=[ALL], max_positions=TERMINAL_POSITIONS, compact=True)
    for table in rich_tables(detail[:2] + overall[2:]):  # positions and histogram: overall rows only
        console.print(table)
    rec = doc["recommended"][ALL]
    if rec["worth_it"]:
        console.print(f"Recommended overall: [bold green]{rec['setting']}[/] "
                      f"({speedup_text(rec['speedup_end_to_end'])} end-to-end, {speedup_text(rec['speedup_generation'])} "
                      f"generation; run with {usage_hint(rec['setting'])})")
    else:
        console.print("Recommended overall: [bold]target-only[/] — no setting beat plain decoding on this machine")
    pr = (doc.get("projected") or {}).get(ALL)
    if pr is not None:
        console.print(f"Projected on a GPU-like machine: draft k = {pr['k']}, {speedup_text(pr['speedup'])}; drafting pays "
                      f"where the draft costs < {number_text(pr['break_even_cost_ratio'])}x the target per token "
                      f"(c = {number_text(pr['draft_cost_ratio'])} here); {projection_basis(pr)} "
                      f"({doc['projection_assumption']})", markup=False)
    elif any(r["drafted"] for r in doc["summary"][ALL].values()):
        need = doc.get("min_position_samples", 1)
        console.print(f"No projection: no draft position was drafted {need} times or more (run more prompts than "
                      "--limit allows)", markup=False)
    for name, by_phase in phases.items():
        line = phases_line(by_phase)
        if line is not None:
            console.print(Text(f"{name}: ").append(line))
    for kind, path in paths.items():
        console.print(f"{kind:>8}: {path}")
