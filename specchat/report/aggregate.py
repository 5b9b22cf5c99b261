"""Aggregation (pure): run records -> per category and setting, the metrics of README "Metrics", as
typed rows. `RunStats` computes them (merged, never redefined); speedups are against the same category's
target-only runs; the projection is the GPU-like one. Each row also reads like its report.json form."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from .. import kinds
from ..stats import RunStats
from .prompts import ALL, BASELINE
from .run import RunRecord


class _Row(Mapping):
    """A typed row that also reads like its report.json form: row["acceptance_rate"], dict(row)."""

    def as_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def __getitem__(self, key: str):
        return self.as_dict()[key]

    def __iter__(self):
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


def _plain(value):
    if isinstance(value, _Row):
        return value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# A draft position's acceptance counts in the projection only when at least this many steps drafted that
# far: a position seen once or twice is 0% or 100% by chance, and a projection from it sends absurd drafts.
MIN_POSITION_SAMPLES = 10


@dataclass(eq=False)
class SummaryRow(_Row):
    """One (category, setting): the merged RunStats and what is computed against target-only."""

    prompts: int
    runs: int
    stats: RunStats
    baseline_tokens_per_second: float | None
    baseline_end_to_end_tokens_per_second: float | None
    speedup_generation: float | None
    speedup_end_to_end: float | None
    draft_share: float | None
    drafted_per_step: float | None
    draft_cost_ratio: float | None
    projected_speedup: float | None

    def as_dict(self) -> dict:
        row = super().as_dict()
        del row["stats"]
        return {"prompts": self.prompts, "runs": self.runs, **self.stats.as_dict(counts=True), **row}


@dataclass(eq=False)
class Recommendation(_Row):
    setting: str
    speedup_end_to_end: float
    speedup_generation: float
    worth_it: bool


@dataclass(eq=False)
class Projection(_Row):
    """The best draft length where verifying costs one decode (PROJECTED, see PROJECTION_ASSUMPTION)."""

    k: int
    speedup: float
    tokens_per_step: float
    draft_cost_ratio: float
    break_even_cost_ratio: float
    per_position_acceptance: list[float]
    measured_positions: int  # the leading positions used: each drafted at least min_samples times
    min_samples: int = 1
    positions_left_out: int = 0  # positions further on, drafted fewer times: not used
    position_tries: list[int] = field(default_factory=list)  # steps that drafted that far, per used position
    cost_per: str = "token"  # what c is the price of: a drafted token, or a block drafter's one forward ("forward")


@dataclass(eq=False)
class Aggregate(_Row):
    categories: list[str]
    settings: list[str]
    summary: dict[str, dict[str, SummaryRow]]  # category -> setting -> row; category "all" holds every run
    recommended: dict[str, Recommendation]
    projected: dict[str, Projection | None]
    projection_assumption: str
    min_position_samples: int = MIN_POSITION_SAMPLES
    same_output_as_target_only: dict[str, dict[str, int]] = field(default_factory=dict)


# -- aggregation (pure) ------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _kinds(drafter_kind: str | None) -> list:
    return [kinds.by_name(name) for name in (drafter_kind or "").split(",") if name]


def per_forward(drafter_kind: str | None) -> bool:
    """Whether the drafter drafts a whole block in one forward (DFlash, DSpark): its cost is per draft, not
    per drafted token."""
    named = _kinds(drafter_kind)
    return bool(named) and all(kind is not None and kind.cost == "block" for kind in named)


def _drafts(stats: RunStats) -> int:
    """The steps that drafted anything."""
    return stats.position_tries[0] if stats.position_tries else 0


def draft_cost_ratio(stats: RunStats, baseline: RunStats | None, drafter_kind: str | None) -> float | None:
    """c = draft seconds per drafted token / target-only seconds per generated token (a block drafter: per
    draft, whatever its length). A free drafter's proposals (prompt lookup's) cost nothing (c = 0 by
    definition), and so does drafting nothing. `drafter_kind`: the drafter's kind name, a chain's joined
    with ","."""
    named = _kinds(drafter_kind)
    if stats.drafted == 0 or (named and all(kind is not None and kind.free for kind in named)):
        return 0.0
    if baseline is None or baseline.emitted == 0 or baseline.generate_seconds <= 0:
        return None
    units = _drafts(stats) if per_forward(drafter_kind) else stats.drafted
    if units == 0:
        return None
    return (stats.draft_seconds / units) / (baseline.generate_seconds / baseline.emitted)


def projected_speedup(tau: float | None, paid_per_step: float | None, c: float | None) -> float | None:
    """Speedup this acceptance would give where verifying k tokens costs about as much as verifying one
    (a GPU at batch 1): tau / (1 + c * what c is paid for per step: drafted tokens, a block drafter's drafts)
    — Leviathan et al.'s formula with the measured tau and draft cost in place of the i.i.d. acceptance
    model. PROJECTED, not measured."""
    if tau is None or paid_per_step is None or c is None:
        return None
    return tau / (1.0 + c * paid_per_step)


# what the projection assumes, printed wherever it is shown
PROJECTION_ASSUMPTION = (
    "PROJECTED, not measured: assumes verifying k+1 tokens costs the same as decoding one (a GPU at batch 1) "
    "and the draft/target cost ratio c measured here; acceptance per position as measured here"
)


def project_best_k(per_position: Sequence[float], c: float | None, tries: Sequence[int] | None = None,
                   min_samples: int = 1, forward: bool = False) -> Projection | None:
    """The best draft length where verification is free: maximise E(k) / (1 + c k) (`forward`, a block
    drafter: E(k) / (1 + c) for any k > 0, one draft forward whatever its length), E(k) = 1 + sum of the
    measured per-position acceptance (probability that drafts 1..i are all accepted) up to k. With `tries`
    (steps that drafted that far, per position) only the leading positions drafted at least `min_samples`
    times are used. None when no position qualifies, nothing was drafted, or c is unknown."""
    all_positions = len(per_position)
    if tries is not None:
        used = 0
        while used < min(len(tries), all_positions) and tries[used] >= min_samples:
            used += 1
        per_position = list(per_position[:used])
    if not per_position or c is None:
        return None
    expected = [1.0]
    for a in per_position:
        expected.append(expected[-1] + a)
    speedups = [e / (1.0 + c * (min(k, 1) if forward else k)) for k, e in enumerate(expected)]
    best = max(range(len(speedups)), key=lambda k: (speedups[k] > speedups[0] * 1.0001, speedups[k], -k))
    if speedups[best] <= speedups[0]:
        best = 0
    # the dearest draft that still pays at some k: speedup(k) > 1 iff c < (E(k) - 1) / k (a block: E(k) - 1)
    break_even = max((expected[k] - 1.0) / (1 if forward else k) for k in range(1, len(expected)))
    return Projection(k=best, speedup=speedups[best], tokens_per_step=expected[best], draft_cost_ratio=c,
                      break_even_cost_ratio=break_even, per_position_acceptance=list(per_position),
                      measured_positions=len(per_position), min_samples=min_samples if tries is not None else 1,
                      positions_left_out=all_positions - len(per_position),
                      position_tries=list(tries[: len(per_position)]) if tries is not None else [],
                      cost_per="forward" if forward else "token")


def summary_row(stats: RunStats, baseline: RunStats | None, *, drafter_kind: str | None, prompts: int, runs: int,
                is_baseline: bool = False) -> SummaryRow:
    """One (category, setting) row: the merged RunStats' own metrics, plus speedups against `baseline`
    (the same category's target-only runs)."""
    base_tps = baseline.tokens_per_second if baseline else None
    base_e2e = baseline.end_to_end_tokens_per_second if baseline else None
    per_step = stats.drafted / stats.steps if stats.steps else None
    c = draft_cost_ratio(stats, baseline, drafter_kind)
    # what c is paid per: a drafted token, or a block drafter's draft (one forward whatever its length)
    paid_per_step = _drafts(stats) / stats.steps if per_forward(drafter_kind) and stats.steps else per_step
    return SummaryRow(
        prompts=prompts, runs=runs, stats=stats,
        baseline_tokens_per_second=base_tps,
        baseline_end_to_end_tokens_per_second=base_e2e,
        speedup_generation=_ratio(stats.tokens_per_second, base_tps),
        speedup_end_to_end=_ratio(stats.end_to_end_tokens_per_second, base_e2e),
        draft_share=stats.draft_share,
        drafted_per_step=per_step,
        draft_cost_ratio=c,
        # plain decoding is the unit of the projection: exactly 1 by definition
        projected_speedup=1.0 if is_baseline else projected_speedup(stats.mean_accepted_length, paid_per_step, c),
    )


def recommend(rows: Mapping[str, Mapping]) -> Recommendation:
    """The setting with the best measured end-to-end speedup; target-only unless something beats 1.0.
    Ties go to the setting listed first (less drafting)."""
    best, best_value = BASELINE, 1.0
    for name, row in rows.items():
        value = row.get("speedup_end_to_end")
        if name != BASELINE and value is not None and value > best_value:
            best, best_value = name, value
    row = rows.get(best, {})
    return Recommendation(
        setting=best,
        speedup_end_to_end=row.get("speedup_end_to_end", 1.0) if best != BASELINE else 1.0,
        speedup_generation=row.get("speedup_generation", 1.0) if best != BASELINE else 1.0,
        worth_it=best != BASELINE,
    )


def aggregate(records: Sequence[RunRecord], *, drafter_kind: str | None = None,
              settings: Sequence[str] | None = None, min_samples: int = MIN_POSITION_SAMPLES) -> Aggregate:
    """Records -> typed rows per category and setting, the recommendation and projection per category;
    category "all" holds every record. Categories keep their first-seen order."""
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
    summary: dict[str, dict[str, SummaryRow]] = {}
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
        projection[cat] = project_best_k(pooled.per_position_acceptance, c, pooled.position_tries, min_samples,
                                         forward=per_forward(drafter_kind))
    return Aggregate(
        categories=categories,
        settings=names,
        summary=summary,
        recommended={cat: recommend(rows) for cat, rows in summary.items()},
        projected=projection,
        projection_assumption=PROJECTION_ASSUMPTION,
        min_position_samples=min_samples,
        same_output_as_target_only=matches,
    )
