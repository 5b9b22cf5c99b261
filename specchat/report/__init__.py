"""`specchat report`: is this drafter worth it for this target, on this machine, and at what settings?

Every prompt of a set runs once per setting in one process: target-only (k = 0, drafter unused), then
each fixed draft length of `--sweep` and/or the adaptive `policy`, same sampling settings and seed.
The order alternates (target-only first on even prompts, last on odd ones) so warm caches and background
load do not favour one side, and every run starts from an empty KV cache so prefill costs the same.
Multi-turn prompts run as a conversation that continues with the TARGET-ONLY reply, so every setting
sees the same history.

One module per layer, each usable alone:
- prompts.py:   the settings swept (`parse_sweep`), `parse_prompts` / `load_prompts` / `select_prompts`
                (pure; errors carry file:line);
- run.py:       `run_report` drives `engine.generate` and turns each event stream into a `RunRecord`;
- aggregate.py: `aggregate(records)` -> typed rows per category and overall, per setting: the metrics of
                README "Metrics", computed by `stats.RunStats` (merged, never redefined) plus speedups
                against the same category's target-only runs and the "projected" GPU-like speedup;
- render.py:    `table_specs` (plain strings) feeds both the Rich tables and report.md; `write_chart`;
- command.py:   the Typer command.

The recommendation is the setting with the best measured END-TO-END speedup (prefill included, so a
draft model's own prefill is charged), target-only when nothing beats 1.0.
"""

from __future__ import annotations

from .aggregate import (PROJECTION_ASSUMPTION, Aggregate, Projection, Recommendation, SummaryRow, aggregate,
                        draft_cost_ratio, project_best_k, projected_speedup, recommend, summary_row)
from .prompts import (ALL, BASELINE, DEFAULT_CATEGORY, POLICY, PromptItem, Setting, builtin_text, fixed,
                      load_prompts, parse_prompts, parse_sweep, select_prompts)
from .render import (SCHEMA, TERMINAL_POSITIONS, TableSpec, build_doc, check_out_dir, markdown_table, render_markdown,
                     rich_tables, table_specs, usage_hint, write_chart, write_outputs)
from .run import RunRecord, record_from_dict, record_from_events, reset_caches, run_report, warm_up

__all__ = [
    "ALL", "BASELINE", "DEFAULT_CATEGORY", "POLICY", "PROJECTION_ASSUMPTION", "SCHEMA", "TERMINAL_POSITIONS",
    "Aggregate", "Projection", "PromptItem", "Recommendation", "RunRecord", "Setting", "SummaryRow", "TableSpec",
    "aggregate", "build_doc", "builtin_text", "check_out_dir", "draft_cost_ratio", "fixed", "load_prompts",
    "markdown_table", "parse_prompts", "parse_sweep", "project_best_k", "projected_speedup", "recommend",
    "record_from_dict", "record_from_events", "render_markdown", "reset_caches", "rich_tables", "run_report",
    "select_prompts", "summary_row", "table_specs", "usage_hint", "warm_up",
    "write_chart", "write_outputs",
]
