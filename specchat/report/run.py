"""Running a report: drive `engine.generate` for every prompt, turn and setting, and keep each event
stream as a typed `RunRecord`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..backend import Backend, BackendError
from ..drafters import Drafter, own_backends
from ..engine import Finished, TokenEvent, generate
from ..errors import UserError
from ..policy import Policy
from ..reasoning import Budget, Reasoning, split_events
from ..sampling import SamplingParams
from ..stats import RunStats
from .prompts import BASELINE, PromptItem, Setting


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
    # a reasoning model's reply: speculation in the thought and in the answer apart, and the two texts
    phases: dict[str, RunStats] | None = None
    reasoning_content: str = ""
    content: str | None = None

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
            "stats": self.stats.as_dict(counts=True),
            "text": self.text,
            **({"phases": {phase: stats.as_dict(counts=True) for phase, stats in self.phases.items()},
                "content": self.content, "reasoning_content": self.reasoning_content} if self.phases else {}),
        }


def record_from_dict(d: dict) -> RunRecord:
    return RunRecord(
        prompt_id=d["prompt_id"], category=d["category"], turn=d["turn"], setting=d["setting"], order=d["order"],
        stats=RunStats.from_dict(d["stats"]), finish_reason=d.get("finish_reason", ""), text=d.get("text", ""),
        sources=dict(d.get("sources", {})), matches_baseline=d.get("matches_baseline"),
        phases={phase: RunStats.from_dict(stats) for phase, stats in d["phases"].items()} if d.get("phases") else None,
        reasoning_content=d.get("reasoning_content", ""), content=d.get("content"),
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
    split = finished.split
    return RunRecord(
        prompt_id=prompt_id, category=category, turn=turn, setting=setting, order=order, stats=finished.stats,
        finish_reason=finished.finish_reason, text=finished.text, token_ids=list(finished.token_ids),
        sources=dict(sources), phases=split.stats if split is not None else None,
        reasoning_content=split.reasoning_content if split is not None else "",
        content=split.content if split is not None else None,
    )


# -- running -----------------------------------------------------------------------------------------

Render = Callable[[list[dict]], tuple[list[int], list[str]]]  # messages -> (prompt ids, stop strings)


def reset_caches(target: Backend, drafter: Drafter | None) -> None:
    """Empty every KV cache, so every run prefills its whole prompt (fair prefill timings)."""
    for backend in (target, *own_backends(drafter)):
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
    reasoning_for: Callable[[list[dict]], tuple[Reasoning | None, Callable[[], Budget | None]]] = lambda m: (None, lambda: None),
) -> list[RunRecord]:
    """Run every item's turns under every setting; target-only first on even items, last on odd ones.
    `reasoning_for(messages)`: how to split a thinking model's reply to them, and a fresh budget per run."""
    records: list[RunRecord] = []
    for index, item in enumerate(items):
        history: list[dict] = []
        order = list(settings) if index % 2 == 0 else list(reversed(settings))
        for turn, text in enumerate(item.turns):
            messages = [*history, {"role": "user", "content": text}]
            prompt_ids, stops = render(messages)
            reasoning, budget = reasoning_for(messages)
            by_setting: dict[str, RunRecord] = {}
            for position, setting in enumerate(order):
                on_start(item, turn, setting)
                reset_caches(target, drafter)
                events = split_events(generate(
                    target, None if setting.is_baseline else drafter, prompt_ids, params,
                    max_tokens=max_tokens, stop=stops, policy=policy_for(setting), budget=budget(),
                    phases=reasoning.splitter() if reasoning is not None else None,
                ), reasoning)
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
            answer = {"role": "assistant", "content": base.text if base.content is None else base.content}
            if base.reasoning_content:
                answer["reasoning_content"] = base.reasoning_content
            history = [*messages, answer]
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
