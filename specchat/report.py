"""`specchat report`: is this drafter worth it for this target, on this machine, and at what settings?

Every prompt of a set runs once per setting in one process: target-only (k = 0, drafter unused), then
each fixed draft length of `--draft-max` and/or the adaptive `policy`, same sampling settings and seed.
The order alternates (target-only first on even prompts, last on odd ones) so warm caches and background
load do not favour one side, and every run starts from an empty KV cache so prefill costs the same.
Multi-turn prompts run as a conversation that continues with the TARGET-ONLY reply, so every setting
sees the same history.

Three layers, each usable alone:
- prompts:     `parse_prompts` / `load_prompts` / `select_prompts` (pure; errors carry file:line);
- running:     `run_report` drives `engine.generate` and turns each event stream into a `RunRecord`;
- aggregation: `aggregate(records)` -> per category and overall, per setting, the metrics of
               README "Metrics", computed by `stats.RunStats` (merged, never redefined) plus speedups
               against the same category's target-only runs and the "projected" GPU-like speedup;
- rendering:   `table_specs` (plain strings) feeds both the Rich tables and report.md; `write_chart`.

The recommendation is the setting with the best measured END-TO-END speedup (prefill included, so a
draft model's own prefill is charged), target-only when nothing beats 1.0.
"""

from __future__ import annotations

import dataclasses

import json
import os
import platform
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer

from . import options as opt
from .backend import BackendError
from .engine import Finished, TokenEvent, generate
from .policy import FixedPolicy, Policy, make_policy
from .runner import UserError
from .sampling import SamplingParams
from .stats import RunStats

SCHEMA = "specchat.report/1"
BASELINE = "target-only"
POLICY = "policy"
ALL = "all"
DEFAULT_CATEGORY = "custom"  # prompts from a plain-text file, or JSONL lines without a category
POLICY_DRAFT_MAX = 64
TERMINAL_POSITIONS = 8  # per-position columns shown in the terminal (report.md and .json have all)


# -- settings ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One column of the sweep: a fixed draft length k (0 = target-only) or the adaptive policy (k None)."""

    name: str
    k: int | None

    @property
    def is_baseline(self) -> bool:
        return self.k == 0

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": "policy" if self.k is None else "fixed", "k": self.k}


def fixed(k: int) -> Setting:
    return Setting(BASELINE if k == 0 else f"k={k}", k)


def parse_draft_max(text: str) -> list[Setting]:
    """'0,2,4,policy' -> [target-only, k=2, k=4, policy]. Target-only is always run (it is what speedups
    are measured against); fixed lengths come sorted, the policy last."""
    ks: set[int] = {0}
    policy = False
    for raw in text.split(","):
        item = raw.strip()
        if item.lower() == POLICY:
            policy = True
            continue
        try:
            k = int(item)
        except ValueError:
            k = -1
        if k < 0:
            raise UserError(
                f"--draft-max: {item!r} is not a draft length (a whole number >= 0) or `policy`; "
                "example: --draft-max 0,2,4,policy"
            )
        ks.add(k)
    settings = [fixed(k) for k in sorted(ks)] + ([Setting(POLICY, None)] if policy else [])
    if len(settings) < 2:
        raise UserError("--draft-max: nothing to compare with target-only; give a length > 0 or `policy`")
    return settings


# -- prompt sets -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptItem:
    id: str
    category: str
    turns: tuple[str, ...]  # user messages; more than one = a conversation


def parse_prompts(text: str, source: str) -> list[PromptItem]:
    """A prompt file's text -> items. JSONL (first non-blank line starts with '{'):
    {"id": ..., "category": ..., "turns": ["...", ...]} per line ("prompt": "..." is accepted for one
    turn; id and category are optional). Otherwise one prompt per line, blank lines skipped.
    Errors are one line: `<source>:<line>: <what is wrong>`."""
    lines = text.splitlines()
    first = next((line.strip() for line in lines if line.strip()), "")
    items: list[PromptItem] = []
    if not first.startswith("{"):
        for n, line in enumerate(lines, 1):
            if line.strip():
                items.append(PromptItem(f"line-{n}", DEFAULT_CATEGORY, (line.strip(),)))
        return items
    seen: dict[str, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue

        def bad(message: str) -> UserError:
            return UserError(f"{source}:{n}: {message}")

        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise bad(f"not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise bad(f"expected a JSON object like {{\"id\", \"category\", \"turns\"}}, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"id", "category", "turns", "prompt"})
        if unknown:
            raise bad(f"unknown key {unknown[0]!r} (known: id, category, turns, prompt)")
        if "turns" in obj and "prompt" in obj:
            raise bad("give either \"turns\" or \"prompt\", not both")
        turns = obj.get("turns", [obj["prompt"]] if "prompt" in obj else None)
        if turns is None:
            raise bad("missing \"turns\": a list of user messages")
        if not isinstance(turns, list) or not turns:
            raise bad("\"turns\" must be a non-empty list of strings")
        for i, turn in enumerate(turns):
            if not isinstance(turn, str) or not turn.strip():
                raise bad(f"turn {i + 1} must be a non-empty string")
        pid = obj.get("id", f"line-{n}")
        if not isinstance(pid, (str, int)) or isinstance(pid, bool) or not str(pid).strip():
            raise bad("\"id\" must be a non-empty string or a number")
        pid = str(pid)
        if pid in seen:
            raise bad(f"duplicate id {pid!r} (first on line {seen[pid]})")
        seen[pid] = n
        category = obj.get("category", DEFAULT_CATEGORY)
        if not isinstance(category, str) or not category.strip():
            raise bad("\"category\" must be a non-empty string")
        if category.strip() == ALL:
            raise bad(f"category {ALL!r} is reserved for the overall rows")
        items.append(PromptItem(pid, category.strip(), tuple(turns)))
    return items


def builtin_text() -> str:
    return resources.files("specchat").joinpath("prompts/builtin.jsonl").read_text(encoding="utf-8")


def load_prompts(path: Path | None) -> tuple[list[PromptItem], str]:
    """(items, source label): the built-in set, or the user's file."""
    if path is None:
        return parse_prompts(builtin_text(), "builtin.jsonl"), "builtin"
    if not path.exists():
        raise UserError(f"--prompts {path}: no such file")
    if path.is_dir():
        raise UserError(f"--prompts {path}: is a directory, not a prompt file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"--prompts {path}: cannot read it ({e.strerror or e})") from None
    items = parse_prompts(text, str(path))
    if not items:
        raise UserError(f"--prompts {path}: no prompts in the file")
    return items, str(path)


def select_prompts(items: Sequence[PromptItem], categories: Sequence[str] | None, limit: int | None) -> list[PromptItem]:
    chosen = list(items)
    if categories:
        known = list(dict.fromkeys(i.category for i in items))
        missing = [c for c in categories if c not in known]
        if missing:
            raise UserError(f"--category {missing[0]!r}: no such category in this prompt set (have: {', '.join(known)})")
        chosen = [i for i in chosen if i.category in categories]
    if limit is not None:
        chosen = chosen[:limit]
    if not chosen:
        raise UserError("no prompts to run (check --category / --limit)")
    return chosen


# -- one run -----------------------------------------------------------------------------------------


@dataclass
class RunRecord:
    """One generation: a prompt's turn under one setting."""

    prompt_id: str
    category: str
    turn: int
    setting: str
    order: int  # position of this run among the settings of its turn (0 = ran first)
    stats: RunStats
    finish_reason: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)  # emitted tokens by where they came from
    matches_baseline: bool | None = None  # same tokens as target-only (None for target-only itself)

    def as_dict(self) -> dict:
        return {
            "prompt_id": self.prompt_id,
            "category": self.category,
            "turn": self.turn,
            "setting": self.setting,
            "order": self.order,
            "finish_reason": self.finish_reason,
            "matches_baseline": self.matches_baseline,
            "sources": dict(sorted(self.sources.items())),
            "stats": stats_dict(self.stats),
            "text": self.text,
        }


def stats_dict(stats: RunStats) -> dict:
    """RunStats.as_dict() plus the raw per-position counts, so rows can be re-added exactly."""
    return {**stats.as_dict(), "position_tries": list(stats.position_tries), "position_hits": list(stats.position_hits)}


def stats_from_dict(d: dict) -> RunStats:
    """The inverse of stats_dict (report.json's per-run `stats`): re-aggregate a saved report."""
    return RunStats(
        steps=d["steps"], drafted=d["drafted"], accepted=d["accepted"], emitted=d["generated_tokens"],
        decided=d.get("decided_tokens", d["generated_tokens"]),
        draft_seconds=d["draft_seconds"], verify_seconds=d["verify_seconds"], prefill_seconds=d["prefill_seconds"],
        generate_seconds=d["generate_seconds"], prompt_tokens=d["prompt_tokens"],
        prompt_tokens_evaluated=d["prompt_tokens_evaluated"], position_tries=list(d["position_tries"]),
        position_hits=list(d["position_hits"]),
        accepted_lengths=Counter({int(k): v for k, v in d["accepted_length_histogram"].items()}),
        draft_lengths=Counter({int(k): v for k, v in d["draft_lengths"].items()}),
        drafted_by=Counter(d.get("drafted_by", {})),
        rollback_recoveries=d.get("rollback_recoveries", 0),
    )


def record_from_dict(d: dict) -> RunRecord:
    return RunRecord(
        prompt_id=d["prompt_id"], category=d["category"], turn=d["turn"], setting=d["setting"], order=d["order"],
        stats=stats_from_dict(d["stats"]), finish_reason=d.get("finish_reason", ""), text=d.get("text", ""),
        sources=dict(d.get("sources", {})), matches_baseline=d.get("matches_baseline"),
    )


def record_from_events(events: Iterable, *, prompt_id: str, category: str, turn: int, setting: str, order: int) -> RunRecord:
    """Consume one `engine.generate` stream into a RunRecord (its RunStats is the stream's own)."""
    sources: Counter = Counter()
    finished: Finished | None = None
    for event in events:
        if isinstance(event, TokenEvent):
            sources[event.source] += 1
        elif isinstance(event, Finished):
            finished = event
    if finished is None:
        raise RuntimeError("generation ended without a Finished event")
    return RunRecord(
        prompt_id=prompt_id, category=category, turn=turn, setting=setting, order=order, stats=finished.stats,
        finish_reason=finished.finish_reason, text=finished.text, token_ids=list(finished.token_ids),
        sources=dict(sources),
    )


# -- aggregation (pure) ------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def draft_cost_ratio(stats: RunStats, baseline: RunStats | None, drafter_kind: str | None) -> float | None:
    """c = draft seconds per drafted token / target-only seconds per generated token. Prompt lookup's
    proposals are free (c = 0 by definition), and so is drafting nothing."""
    if stats.drafted == 0 or drafter_kind == "prompt-lookup":
        return 0.0
    if baseline is None or baseline.emitted == 0 or baseline.generate_seconds <= 0:
        return None
    return (stats.draft_seconds / stats.drafted) / (baseline.generate_seconds / baseline.emitted)


def projected_speedup(tau: float | None, drafted_per_step: float | None, c: float | None) -> float | None:
    """Speedup this acceptance would give where verifying k tokens costs about as much as verifying one
    (a GPU at batch 1): tau / (1 + c * drafted per step) — Leviathan et al.'s formula with the measured
    tau and draft cost in place of the i.i.d. acceptance model. PROJECTED, not measured."""
    if tau is None or drafted_per_step is None or c is None:
        return None
    return tau / (1.0 + c * drafted_per_step)


# what the projection assumes, printed wherever it is shown
PROJECTION_ASSUMPTION = (
    "PROJECTED, not measured: assumes verifying k+1 tokens costs the same as decoding one (a GPU at batch 1) "
    "and the draft/target cost ratio c measured here; acceptance per position as measured here"
)


def project_best_k(per_position: Sequence[float], c: float | None) -> dict | None:
    """The best draft length where verification is free: maximise E(k) / (1 + c k), E(k) = 1 + sum of the
    measured per-position acceptance (probability that drafts 1..i are all accepted) up to k. None when
    nothing was drafted or c is unknown."""
    if not per_position or c is None:
        return None
    expected = [1.0]
    for a in per_position:
        expected.append(expected[-1] + a)
    speedups = [e / (1.0 + c * k) for k, e in enumerate(expected)]
    best = max(range(len(speedups)), key=lambda k: (speedups[k] > speedups[0] * 1.0001, speedups[k], -k))
    if speedups[best] <= speedups[0]:
        best = 0
    # the dearest draft that still pays at some k: speedup(k) > 1 iff c < (E(k) - 1) / k
    break_even = max((expected[k] - 1.0) / k for k in range(1, len(expected)))
    return {"k": best, "speedup": speedups[best], "tokens_per_step": expected[best], "draft_cost_ratio": c,
            "break_even_cost_ratio": break_even, "per_position_acceptance": list(per_position),
            "measured_positions": len(per_position)}


def summary_row(stats: RunStats, baseline: RunStats | None, *, drafter_kind: str | None, prompts: int, runs: int,
                is_baseline: bool = False) -> dict:
    """One (category, setting) row: the merged RunStats' own metrics, plus speedups against `baseline`
    (the same category's target-only runs)."""
    row = {"prompts": prompts, "runs": runs, **stats_dict(stats)}
    base_tps = baseline.tokens_per_second if baseline else None
    base_e2e = baseline.end_to_end_tokens_per_second if baseline else None
    per_step = stats.drafted / stats.steps if stats.steps else None
    c = draft_cost_ratio(stats, baseline, drafter_kind)
    row.update(
        baseline_tokens_per_second=base_tps,
        baseline_end_to_end_tokens_per_second=base_e2e,
        speedup_generation=_ratio(stats.tokens_per_second, base_tps),
        speedup_end_to_end=_ratio(stats.end_to_end_tokens_per_second, base_e2e),
        draft_share=stats.draft_share,
        drafted_per_step=per_step,
        draft_cost_ratio=c,
        # plain decoding is the unit of the projection: exactly 1 by definition
        projected_speedup=1.0 if is_baseline else projected_speedup(stats.mean_accepted_length, per_step, c),
    )
    return row


def recommend(rows: dict[str, dict]) -> dict:
    """The setting with the best measured end-to-end speedup; target-only unless something beats 1.0.
    Ties go to the setting listed first (less drafting)."""
    best, best_value = BASELINE, 1.0
    for name, row in rows.items():
        value = row.get("speedup_end_to_end")
        if name != BASELINE and value is not None and value > best_value:
            best, best_value = name, value
    row = rows.get(best, {})
    return {
        "setting": best,
        "speedup_end_to_end": row.get("speedup_end_to_end", 1.0) if best != BASELINE else 1.0,
        "speedup_generation": row.get("speedup_generation", 1.0) if best != BASELINE else 1.0,
        "worth_it": best != BASELINE,
    }


def aggregate(records: Sequence[RunRecord], *, drafter_kind: str | None = None,
              settings: Sequence[str] | None = None) -> dict:
    """Records -> {"categories", "settings", "summary": {category: {setting: row}}, "recommended":
    {category: {...}}}; category "all" holds every record. Categories keep their first-seen order."""
    names = list(settings) if settings else list(dict.fromkeys([BASELINE, *(r.setting for r in records)]))
    categories = list(dict.fromkeys(r.category for r in records))
    merged: dict[tuple[str, str], RunStats] = {}
    prompt_ids: dict[tuple[str, str], set[str]] = {}
    runs: Counter = Counter()
    for r in records:
        for cat in (r.category, ALL):
            key = (cat, r.setting)
            merged.setdefault(key, RunStats()).merge(r.stats)
            prompt_ids.setdefault(key, set()).add(r.prompt_id)
            runs[key] += 1
    summary: dict[str, dict[str, dict]] = {}
    matches: dict[str, dict[str, int]] = {}
    for r in records:
        if r.matches_baseline is not None:
            m = matches.setdefault(r.setting, {"same": 0, "runs": 0})
            m["runs"] += 1
            m["same"] += int(r.matches_baseline)
    for cat in [*categories, ALL]:
        base = merged.get((cat, BASELINE))
        summary[cat] = {
            name: summary_row(
                merged.get((cat, name), RunStats()), base, drafter_kind=drafter_kind,
                prompts=len(prompt_ids.get((cat, name), ())), runs=runs[(cat, name)], is_baseline=name == BASELINE,
            )
            for name in names
        }
    # The projection pools every drafting setting of a category: fixed-k runs measure each position
    # without the policy's choices, and a longer k measures further positions.
    projection = {}
    for cat in [*categories, ALL]:
        pooled = RunStats()
        for name in names:
            if name != BASELINE and (cat, name) in merged:
                pooled.merge(merged[(cat, name)])
        c = draft_cost_ratio(pooled, merged.get((cat, BASELINE)), drafter_kind)
        projection[cat] = project_best_k(pooled.per_position_acceptance, c)
    return {
        "categories": categories,
        "settings": names,
        "summary": summary,
        "recommended": {cat: recommend(rows) for cat, rows in summary.items()},
        "projected": projection,
        "projection_assumption": PROJECTION_ASSUMPTION,
        "same_output_as_target_only": matches,
    }


# -- running -----------------------------------------------------------------------------------------

Render = Callable[[list[dict]], tuple[list[int], list[str]]]  # messages -> (prompt ids, stop strings)


def reset_caches(target, drafter) -> None:
    """Empty both KV caches, so every run prefills its whole prompt (fair prefill timings)."""
    target.truncate(0)
    backend = getattr(drafter, "backend", None)
    if backend is not None:
        backend.truncate(0)


def run_report(
    target,
    drafter,
    items: Sequence[PromptItem],
    settings: Sequence[Setting],
    params: SamplingParams,
    *,
    max_tokens: int,
    render: Render,
    policy_for: Callable[[Setting], Policy],
    on_run: Callable[[PromptItem, int, Setting, RunRecord], None] = lambda *a: None,
    on_start: Callable[[PromptItem, int, Setting], None] = lambda *a: None,
) -> list[RunRecord]:
    """Run every item's turns under every setting; target-only first on even items, last on odd ones."""
    records: list[RunRecord] = []
    for index, item in enumerate(items):
        history: list[dict] = []
        order = list(settings) if index % 2 == 0 else list(reversed(settings))
        for turn, text in enumerate(item.turns):
            messages = [*history, {"role": "user", "content": text}]
            prompt_ids, stops = render(messages)
            by_setting: dict[str, RunRecord] = {}
            for position, setting in enumerate(order):
                on_start(item, turn, setting)
                reset_caches(target, drafter)
                events = generate(
                    target, None if setting.is_baseline else drafter, prompt_ids, params,
                    max_tokens=max_tokens, stop=stops, policy=policy_for(setting),
                )
                try:
                    record = record_from_events(
                        events, prompt_id=item.id, category=item.category, turn=turn, setting=setting.name,
                        order=position,
                    )
                except BackendError as e:
                    raise UserError(f"prompt {item.id!r} turn {turn + 1}: {e}") from None
                records.append(record)
                by_setting[setting.name] = record
                on_run(item, turn, setting, record)
            base = by_setting[BASELINE]
            for name, record in by_setting.items():
                if name != BASELINE:
                    record.matches_baseline = record.token_ids == base.token_ids
            history = [*messages, {"role": "assistant", "content": base.text}]
    return records


def warm_up(target, drafter, item: PromptItem, settings: Sequence[Setting], params: SamplingParams, render: Render,
            policy_for: Callable[[Setting], Policy]) -> None:
    """A few untimed tokens down each code path: first decodes allocate buffers, a policy calibrates."""
    prompt_ids, stops = render([{"role": "user", "content": item.turns[0]}])
    for setting in settings:
        reset_caches(target, drafter)
        for _ in generate(target, None if setting.is_baseline else drafter, prompt_ids, params, max_tokens=4,
                          stop=stops, policy=policy_for(setting)):
            pass
    reset_caches(target, drafter)


# -- rendering ---------------------------------------------------------------------------------------


def usage_hint(setting: str) -> str:
    """How to run with a recommended setting."""
    if setting == BASELINE:
        return "--no-spec"
    if setting == POLICY:
        return "the default (adaptive policy)"
    return f"--draft-fixed {setting.removeprefix('k=')}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def _num(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _times(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


@dataclass
class TableSpec:
    title: str
    columns: list[str]
    rows: list[list[str]]
    highlight: set[int] = field(default_factory=set)  # row indexes to emphasise (recommended settings)
    grouped: bool = False  # the first column is a category: the terminal shows it as a heading row
    note: str = ""


def table_specs(agg: dict, *, categories: Sequence[str] | None = None, max_positions: int | None = None,
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
        rows.append([cat, str(summary[cat][BASELINE]["prompts"]), r["setting"], _times(r["speedup_end_to_end"]),
                     _times(r["speedup_generation"]), _pct(best["acceptance_rate"]), _num(best["mean_accepted_length"])])
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
                cat, name, str(row["generated_tokens"]), _pct(row["acceptance_rate"]), _num(row["mean_accepted_length"]),
                _num(row["tokens_per_second"], 1), _times(row["speedup_generation"]), _times(row["speedup_end_to_end"]),
                _pct(row["draft_share"]), _times(row["projected_speedup"]),
            ])
    specs.append(TableSpec(
        "Speed and acceptance (measured; target-only is the baseline row)",
        ["category", "setting", "tokens", "acc.", "τ", "tok/s", "gen ×", "e2e ×", "draft", "proj.*"],
        rows, highlight, grouped=True,
        note="gen × / e2e ×: measured speedup, generation phase / prefill included. draft: drafting's share "
             "of step time. * proj.: PROJECTED, not measured: the speedup this acceptance would give where "
             "verifying k tokens costs about as much as one (a GPU at batch 1), τ / (1 + c · drafted per "
             "step), c = draft cost per token / target-only cost per token (0 for prompt lookup).",
    ))

    projected = agg.get("projected") or {}
    rows = []
    for cat in [*agg["categories"], ALL]:
        pr = projected.get(cat)
        if pr is None:
            rows.append([cat, "–", "–", "–", "–", "–"])
        else:
            rows.append([cat, _num(pr["draft_cost_ratio"]), str(pr["k"]), _num(pr["tokens_per_step"]),
                         _times(pr["speedup"]), _num(pr["break_even_cost_ratio"])])
    specs.append(TableSpec(
        "Projected where verifying k tokens costs one decode (a GPU at batch 1)",
        ["category", "c", "best k", "τ at k", "proj. ×", "pays if c <"], rows, highlight={len(rows) - 1},
        note=agg.get("projection_assumption", PROJECTION_ASSUMPTION) + ". c = draft cost per drafted token / "
             "target-only cost per token (0 for prompt lookup); τ at k = 1 + the per-position acceptance summed to k; "
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
    from rich import box
    from rich.table import Table

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
    verdict = (f"**{rec['setting']}** ({_times(rec['speedup_end_to_end'])} end-to-end; "
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
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    summary, settings = doc["summary"], doc["settings"]
    fig = Figure(figsize=(12, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)

    spec_settings = [s for s in settings if s != BASELINE]
    for name in spec_settings:
        acc = summary[ALL][name]["per_position_acceptance"]
        if acc:
            left.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
    left.set_title("Per-position acceptance (all prompts)")
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
        **agg,
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


# -- the command -------------------------------------------------------------------------------------

REPORT = "Report"


def report_command(
    target: opt.Target = None,
    draft: opt.Draft = None,
    pair: opt.Pair = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="Prompt file: JSONL {\"id\", \"category\", \"turns\": [...]} (several turns run as a conversation) or one prompt per line. Default: the built-in set (36 prompts, 6 kinds of work).", rich_help_panel=REPORT, show_default=False)] = None,
    draft_max: Annotated[str, typer.Option("--draft-max", "--draft-n", help="Settings to sweep: comma-separated draft lengths (fixed k; 0 = target-only) and/or `policy` (the adaptive default, up to 64). Target-only always runs. Example: 0,2,4,6,8,policy.", rich_help_panel=opt.SPEC)] = POLICY,
    category: Annotated[list[str] | None, typer.Option("--category", help="Only prompts of this category (repeatable).", rich_help_panel=REPORT, show_default=False)] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Only the first N prompts (the built-in set interleaves categories).", rich_help_panel=REPORT, show_default=False)] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for report.json, report.md and report.png.", rich_help_panel=REPORT)] = Path("specchat-report"),
    max_tokens: opt.MaxTokens = 128,
    temp: Annotated[float, typer.Option("--temp", "--temperature", min=0.0, help="Temperature. Default 0 (greedy) so the runs compared are alike; a seeded temperature > 0 measures sampled acceptance.", rich_help_panel=opt.SAMPLING)] = 0.0,
    top_k: opt.TopK = 40,
    top_p: opt.TopP = 0.95,
    min_p: opt.MinP = 0.05,
    repeat_penalty: opt.RepeatPenalty = 1.0,
    repeat_last_n: opt.RepeatLastN = 64,
    frequency_penalty: opt.FrequencyPenalty = 0.0,
    presence_penalty: opt.PresencePenalty = 0.0,
    seed: opt.Seed = 0,
    draft_min: opt.DraftMin = 0,
    draft_p_min: opt.DraftPMin = 0.75,
    lookup_min: opt.LookupMin = 1,
    lookup_max: opt.LookupMax = 32,
    lookup_history: Annotated[bool, typer.Option("--lookup-history/--no-lookup-history", help="Keep this run's replies as a prompt-lookup source for later chats and prompts. The report never reads them itself, so it measures the same thing each time.", rich_help_panel=opt.SPEC)] = True,
    hybrid: opt.Hybrid = None,
    cross_vocab: opt.CrossVocab = "auto",
    ctx_size: opt.Ctx = 4096,
    ngl: opt.Ngl = None,
    ngld: opt.Ngld = None,
    threads: opt.Threads = None,
    rpc: opt.Rpc = None,
    no_color: opt.NoColor = False,
) -> None:
    """Measure whether speculation pays for this target and drafter here, and at what setting.

    Each prompt runs target-only and with every --draft-max setting: same seed, order alternated.
    Per category and overall: acceptance, tau, per-position acceptance, accepted-length histogram,
    tok/s, measured speedup (generation and end-to-end), draft share, a PROJECTED GPU-like speedup.
    Recommends the setting with the best measured end-to-end speedup.
    Writes report.json (every run), report.md and report.png to --out. Greedy (--temp 0) by default.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from .config import load_config
    from .runner import loading, run_options
    from .template import render

    settings = parse_draft_max(draft_max)
    items, source = load_prompts(prompts)
    items = select_prompts(items, category, limit)
    check_out_dir(out)
    config = load_config()
    longest = max((s.k or 0 for s in settings), default=0)
    run = run_options(
        config, target=target, draft=draft, pair=pair, no_spec=False, max_tokens=max_tokens, temp=temp,
        top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, seed=seed,
        draft_max=max(longest, POLICY_DRAFT_MAX if any(s.k is None for s in settings) else 0), draft_min=draft_min,
        draft_p_min=draft_p_min, draft_fixed=None, lookup_min=lookup_min, lookup_max=lookup_max,
        lookup_history=False, hybrid=hybrid, ctx_size=ctx_size,
        ngl=ngl, ngld=ngld, threads=threads, cross_vocab=cross_vocab, rpc=rpc,
    )
    err = Console(stderr=True, no_color=no_color)
    console = Console(no_color=no_color)
    with loading(config, run, err) as loaded:
        def render_messages(messages: list[dict]) -> tuple[list[int], list[str]]:
            rendered = render(loaded.target, messages)
            return rendered.token_ids, rendered.stop

        def policy_for(setting: Setting) -> Policy:
            if setting.k is None:
                return make_policy(loaded, POLICY_DRAFT_MAX, None)
            return FixedPolicy(setting.k)

        total = sum(len(i.turns) for i in items) * len(settings)
        progress = Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err, transient=True,
            disable=not err.is_terminal,
        )
        with progress:
            task = progress.add_task("warming up", total=total)
            warm_up(loaded.target, loaded.drafter, items[0], settings, run.params, render_messages, policy_for)

            def on_start(item: PromptItem, turn: int, setting: Setting) -> None:
                label = item.id + (f" turn {turn + 1}" if len(item.turns) > 1 else "")
                progress.update(task, description=f"{label} · {setting.name}")

            records = run_report(
                loaded.target, loaded.drafter, items, settings, run.params, max_tokens=run.max_tokens,
                render=render_messages, policy_for=policy_for, on_start=on_start,
                on_run=lambda *a: progress.advance(task),
            )
        from .crossvocab import rule_info, rule_label

        rule = rule_label(loaded.drafter, run.params)
        doc = build_doc(
            records, target=loaded.target_spec.name,
            drafter=loaded.drafter_label + (f" ({rule})" if rule else ""),
            drafter_kind=getattr(loaded.drafter, "kind", None), settings=settings, items=items, source=source,
            params=run.params, max_tokens=run.max_tokens, threads=getattr(loaded.target, "n_threads", None),
        )
        if rule:
            doc["cross_vocab"] = rule_info(loaded.drafter, run.params)
    paths = write_outputs(doc, out)
    if lookup_history:
        from .history import save_replies

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
                      f"({_times(rec['speedup_end_to_end'])} end-to-end, {_times(rec['speedup_generation'])} "
                      f"generation; run with {usage_hint(rec['setting'])})")
    else:
        console.print("Recommended overall: [bold]target-only[/] — no setting beat plain decoding on this machine")
    pr = (doc.get("projected") or {}).get(ALL)
    if pr is not None:
        console.print(f"Projected on a GPU-like machine: draft k = {pr['k']}, {_times(pr['speedup'])}; drafting pays "
                      f"where the draft costs < {_num(pr['break_even_cost_ratio'])}x the target per token "
                      f"(c = {_num(pr['draft_cost_ratio'])} here) ({doc['projection_assumption']})", markup=False)
    for kind, path in paths.items():
        console.print(f"{kind:>8}: {path}")
