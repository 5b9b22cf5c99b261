"""Rendering: the tables as plain strings (`table_specs`) feed both the Rich tables and report.md; the chart;
report.json. Everything here reads the report document (a report.json-shaped mapping)."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich import box
from rich.table import Table

from ..errors import UserError
from ..sampling import SamplingParams
from .aggregate import PROJECTION_ASSUMPTION, aggregate
from .prompts import ALL, BASELINE, POLICY, PromptItem, Setting
from .run import RunRecord

SCHEMA = "specchat.report/1"
TERMINAL_POSITIONS = 8  # per-position columns shown in the terminal (report.md and .json have all)


# -- rendering ---------------------------------------------------------------------------------------


def usage_hint(setting: str) -> str:
    """How to run with a recommended setting."""
    if setting == BASELINE:
        return "--no-spec"
    if setting == POLICY:
        return "the default (adaptive policy)"
    return f"--draft-fixed {setting.removeprefix('k=')}"


# how the tables, report.md and the command's closing lines write a number ("–" where there is none)


def percent_text(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def number_text(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def speedup_text(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


@dataclass
class TableSpec:
    title: str
    columns: list[str]
    rows: list[list[str]]
    highlight: set[int] = field(default_factory=set)  # row indexes to emphasise (recommended settings)
    grouped: bool = False  # the first column is a category: the terminal shows it as a heading row
    note: str = ""


def table_specs(agg: Mapping, *, categories: Sequence[str] | None = None, max_positions: int | None = None,
                compact: bool = False) -> list[TableSpec]:
    """The report's tables as plain strings: recommendation, speed and acceptance, per-position
    acceptance, accepted-length histogram. `categories` limits the three detail tables (default: each
    category, then all); `compact` (the terminal) leaves the try counts out of the position cells."""
    summary, rec, settings = agg["summary"], agg["recommended"], agg["settings"]
    cats = list(categories) if categories is not None else [*agg["categories"], ALL]
    spec_settings = [s for s in settings if s != BASELINE]
    specs: list[TableSpec] = []

    rows = []
    for cat in [*agg["categories"], ALL]:
        r = rec[cat]
        best = summary[cat][r["setting"]]
        rows.append([cat, str(summary[cat][BASELINE]["prompts"]), r["setting"], speedup_text(r["speedup_end_to_end"]),
                     speedup_text(r["speedup_generation"]), percent_text(best["acceptance_rate"]), number_text(best["mean_accepted_length"])])
    specs.append(TableSpec(
        "Recommended setting per category (best measured end-to-end speedup)",
        ["category", "prompts", "setting", "e2e ×", "gen ×", "acc.", "τ"], rows, highlight={len(rows) - 1},
    ))

    rows, highlight = [], set()
    for cat in cats:
        for name in settings:
            row = summary[cat][name]
            if name == rec[cat]["setting"]:
                highlight.add(len(rows))
            rows.append([
                cat, name, str(row["generated_tokens"]), percent_text(row["acceptance_rate"]), number_text(row["mean_accepted_length"]),
                number_text(row["tokens_per_second"], 1), speedup_text(row["speedup_generation"]), speedup_text(row["speedup_end_to_end"]),
                percent_text(row["draft_share"]), speedup_text(row["projected_speedup"]),
            ])
    specs.append(TableSpec(
        "Speed and acceptance (measured; target-only is the baseline row)",
        ["category", "setting", "tokens", "acc.", "τ", "tok/s", "gen ×", "e2e ×", "draft", "proj.*"],
        rows, highlight, grouped=True,
        note="gen × / e2e ×: measured speedup, generation phase / prefill included. draft: drafting's share "
             "of step time. * proj.: PROJECTED, not measured: the speedup this acceptance would give where "
             "verifying k tokens costs about as much as one (a GPU at batch 1), τ / (1 + c · drafted per "
             "step), c = draft cost per token (a block drafter's: per draft, one forward whatever its length) / target-only "
             "cost per token (0 for prompt lookup).",
    ))

    projected = agg.get("projected") or {}
    rows = []
    for cat in [*agg["categories"], ALL]:
        pr = projected.get(cat)
        if pr is None:
            rows.append([cat, "–", "–", "–", "–", "–"])
        else:
            rows.append([cat, number_text(pr["draft_cost_ratio"]), str(pr["k"]), number_text(pr["tokens_per_step"]),
                         speedup_text(pr["speedup"]), number_text(pr["break_even_cost_ratio"])])
    specs.append(TableSpec(
        "Projected where verifying k tokens costs one decode (a GPU at batch 1)",
        ["category", "c", "best k", "τ at k", "proj. ×", "pays if c <"], rows, highlight={len(rows) - 1},
        note=agg.get("projection_assumption", PROJECTION_ASSUMPTION) + ". c = draft cost per drafted token (a "
             "block drafter's: per draft) / target-only cost per token (0 for prompt lookup); τ at k = 1 + the per-position acceptance summed to k; "
             "pays if c <: on hardware where the draft's cost ratio is below this, some k gains.",
    ))

    n_pos = max((len(summary[c][s]["per_position_acceptance"]) for c in cats for s in spec_settings), default=0)
    shown = n_pos if max_positions is None else min(n_pos, max_positions)
    rows = []
    for cat in cats:
        for name in spec_settings:
            row = summary[cat][name]
            acc, tries = row["per_position_acceptance"], row["position_tries"]
            cells = [("" if i >= len(acc) else f"{acc[i]:.0%}" if compact else f"{acc[i]:.0%} ({tries[i]})")
                     for i in range(shown)]
            rows.append([cat, name, *cells])
    note = "" if compact else "cell: acceptance (steps that drafted that far)."
    if shown < n_pos:
        note += f" Positions beyond {shown}: report.md / report.json."
    specs.append(TableSpec(
        "Per-position acceptance (draft i accepted / steps that drafted > i tokens)",
        ["category", "setting", *[str(i + 1) for i in range(shown)]], rows, grouped=True, note=note.strip(),
    ))

    longest = max((int(k) for c in cats for s in spec_settings for k in summary[c][s]["accepted_length_histogram"]),
                  default=0)
    rows = []
    for cat in cats:
        for name in spec_settings:
            row = summary[cat][name]
            hist = row["accepted_length_histogram"]
            rows.append([cat, name, str(row["draft_lengths"].get("0", 0)),
                         *[str(hist.get(str(i), 0)) for i in range(longest + 1)]])
    specs.append(TableSpec(
        "Accepted-length histogram (steps by number of drafts accepted)",
        ["category", "setting", "no draft", *[str(i) for i in range(longest + 1)]], rows, grouped=True,
        note="no draft: steps where nothing was proposed (also counted under 0).",
    ))
    return specs


def rich_tables(specs: Sequence[TableSpec]):
    """Rich tables for the terminal: narrow borders; a grouped table's categories become heading rows."""
    tables = []
    for spec in specs:
        table = Table(title=spec.title, title_justify="left", caption=spec.note or None, caption_justify="left",
                      box=box.SIMPLE_HEAD, pad_edge=False, min_width=60)
        columns = spec.columns[1:] if spec.grouped else spec.columns
        for i, column in enumerate(columns):
            table.add_column(column, justify="left" if column in ("category", "setting") else "right", no_wrap=i == 0)
        current = None
        for i, row in enumerate(spec.rows):
            if spec.grouped:
                if row[0] != current:
                    if current is not None:
                        table.add_section()
                    current = row[0]
                    table.add_row(f"[bold]{current}[/]")
                row = ["  " + row[1], *row[2:]]
            table.add_row(*row, style="bold green" if i in spec.highlight else None)
        tables.append(table)
    return tables


def markdown_table(spec: TableSpec) -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|")

    lines = [f"### {spec.title}", "", "| " + " | ".join(spec.columns) + " |",
             "|" + "|".join("---" if c in ("category", "setting") else "---:" for c in spec.columns) + "|"]
    for i, row in enumerate(spec.rows):
        cells = [cell(c) for c in row]
        if i in spec.highlight:  # the recommended setting (or the overall row)
            key = spec.columns.index("setting") if "setting" in spec.columns else 0
            cells = [f"**{c}**" if j == key else c for j, c in enumerate(cells)]
        lines.append("| " + " | ".join(cells) + " |")
    if spec.note:
        lines += ["", spec.note]
    return "\n".join(lines) + "\n"


def render_markdown(doc: dict) -> str:
    agg = doc
    p = doc["params"]
    rec = doc["recommended"][ALL]
    verdict = (f"**{rec['setting']}** ({speedup_text(rec['speedup_end_to_end'])} end-to-end; "
               f"run with {usage_hint(rec['setting'])})" if rec["worth_it"]
               else "**target-only**: no setting beat plain decoding on this machine")
    head = [
        f"# specchat report: {doc['target']} drafted by {doc['drafter']}",
        "",
        f"- created {doc['created']} on {doc['machine']['platform']} ({doc['machine']['cpu_count']} CPUs, "
        f"load average {doc['machine'].get('load_average')} at the end: other work on the machine skews timings)",
        f"- prompts: {doc['prompts']['count']} from {doc['prompts']['source']} "
        f"({', '.join(doc['categories'])}); {doc['prompts']['runs']} runs",
        f"- settings: {', '.join(doc['settings'])}; max tokens {p['max_tokens']}, temperature {p['temperature']}, "
        f"seed {p['seed']}",
        f"- overall recommendation: {verdict}",
        "",
        "Metrics: acceptance = accepted / drafted draft tokens; τ (mean accepted length) = "
        "tokens emitted per target verify step, the target's own token included (plain decoding = 1.0); "
        "per-position acceptance[i] = steps whose draft i was accepted / steps that drafted more than i; "
        "speedup = tok/s with the setting / tok/s target-only, same prompts in the same run, for the generation "
        "phase (gen) and prefill included (e2e). Draft share = drafting's part of step time.",
        "",
    ]
    parts = [markdown_table(spec) for spec in table_specs(agg)]
    same = doc.get("same_output_as_target_only") or {}
    if same:
        parts.append("Outputs identical to target-only (batched and single-token logits differ slightly, so greedy "
                     "runs can diverge at near-ties): "
                     + "; ".join(f"{name} {m['same']}/{m['runs']}" for name, m in same.items()) + "\n")
    return "\n".join(head) + "\n" + "\n".join(parts)


def write_chart(doc: dict, path: Path) -> None:
    """Two panels: per-position acceptance (overall, per setting) and measured speedup vs draft length
    per category."""
    # start-up: matplotlib takes 2 s to import; only --out's chart needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    summary, settings = doc["summary"], doc["settings"]
    fig = Figure(figsize=(12, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)

    spec_settings = [s for s in settings if s != BASELINE]
    enough = doc.get("min_position_samples", 1)
    for name in spec_settings:
        acc = summary[ALL][name]["per_position_acceptance"]
        tries = summary[ALL][name].get("position_tries") or [0] * len(acc)
        if acc:
            xs_pos = list(range(1, len(acc) + 1))
            (line,) = left.plot(xs_pos, acc, marker="o", label=name)
            # each point says how many steps drafted that far; hollow where too few to count
            for x, y, n in zip(xs_pos, acc, tries):
                if n < enough:
                    left.plot([x], [y], marker="o", markerfacecolor="white", color=line.get_color())
                left.annotate(str(n), (x, y), textcoords="offset points", xytext=(0, 6), ha="center",
                              fontsize=7, color=line.get_color())
    left.set_title(f"Per-position acceptance (all prompts; n = steps drafting that far, hollow: n < {enough})",
                   fontsize="medium")
    left.set_xlabel("draft position")
    left.set_ylabel("acceptance")
    left.set_ylim(0, 1.05)
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    if any(summary[ALL][s]["per_position_acceptance"] for s in spec_settings):
        left.legend(fontsize="small")

    xs = list(range(len(settings)))
    for cat in [*doc["categories"], ALL]:
        ys = [summary[cat][s]["speedup_end_to_end"] for s in settings]
        ys = [float("nan") if y is None else y for y in ys]
        style = {"color": "black", "linewidth": 2.5} if cat == ALL else {"linewidth": 1.2, "alpha": 0.85}
        right.plot(xs, ys, marker="o", label=cat, **style)
    gen = [summary[ALL][s]["speedup_generation"] for s in settings]
    right.plot(xs, [float("nan") if y is None else y for y in gen], linestyle="--", color="grey",
               label="all (generation only)")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xticks(xs, ["0" if s == BASELINE else s.removeprefix("k=") for s in settings])
    right.set_title("Measured speedup (end-to-end) vs draft length")
    right.set_xlabel("draft length k (0 = target-only)")
    right.set_ylabel("speedup ×")
    right.legend(fontsize="small", ncol=2)
    fig.suptitle(f"{doc['target']} drafted by {doc['drafter']}")
    fig.tight_layout()
    fig.savefig(path, format="png")


def check_out_dir(out: Path) -> None:
    """Fail before anything runs when the report could not be written."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".specchat-write-test-"):
            pass
    except OSError as e:
        raise UserError(f"--out {out}: cannot write there ({e.strerror or e})") from None


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def build_doc(records: Sequence[RunRecord], *, target: str, drafter: str, drafter_kind: str | None,
              settings: Sequence[Setting], items: Sequence[PromptItem], source: str, params: SamplingParams,
              max_tokens: int, threads: int | None = None) -> dict:
    agg = aggregate(records, drafter_kind=drafter_kind, settings=[s.name for s in settings])
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "threads": threads, "load_average": _load_average()},
        "target": target,
        "drafter": drafter,
        "drafter_kind": drafter_kind,
        "params": {**{k: v for k, v in dataclasses.asdict(params).items() if k != "banned"}, "max_tokens": max_tokens},
        "prompts": {"source": source, "count": len(items), "runs": len(records),
                    "items": [{"id": i.id, "category": i.category, "turns": len(i.turns)} for i in items]},
        "setting_defs": [s.as_dict() for s in settings],
        **agg.as_dict(),
        "runs": [r.as_dict() for r in records],
    }


def write_outputs(doc: dict, out: Path) -> dict[str, Path]:
    paths = {"json": out / "report.json", "markdown": out / "report.md", "chart": out / "report.png"}
    try:
        paths["json"].write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        paths["markdown"].write_text(render_markdown(doc), encoding="utf-8")
        write_chart(doc, paths["chart"])
    except OSError as e:
        raise UserError(f"--out {out}: cannot write the report ({e.strerror or e})") from None
    return paths
