"""Speculation metrics, as defined in README "Metrics", aggregated from per-step records.

The engine, the live footer, `--json` and the acceptance report all read these numbers from here, so a
metric is defined once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepStats:
    """One target verify step: `drafted` proposals, the first `accepted` of them kept, then one token
    from the target (correction or bonus). `emitted` can be smaller than accepted + 1 when generation
    stopped inside the step (EOG, stop string, max tokens)."""

    step: int
    drafted: int
    accepted: int
    emitted: int
    draft_seconds: float
    verify_seconds: float
    # length the policy asked for before the drafter ran (a prompt-lookup miss drafts fewer)
    planned: int = 0
    # tokens the step decided: `emitted` plus an end-of-generation token that ended it (not shown)
    decided: int | None = None
    # who drafted: a drafter kind's name (kinds.py) or one of its sources ("history": lookup's earlier
    # replies); "" when nothing was
    source: str = ""
    # the target's checkpoint work for this step (a recurrent model without snapshots; see backend.py),
    # not part of verify_seconds: the policy learns it apart from what batches cost
    rollback_seconds: float = 0.0
    # draft nodes the target verified (a tree's node count; 0: the `drafted` tokens of a chain). A tree
    # step's `drafted` is its depth, `accepted` the length of the path it kept
    nodes: int = 0


@dataclass
class RunStats:
    """Accumulates StepStats; `as_dict()` is the `stats` object of `specchat prompt --json`."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    decided: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rollback_seconds: float = 0.0
    prefill_seconds: float = 0.0
    generate_seconds: float = 0.0
    prompt_tokens: int = 0
    prompt_tokens_evaluated: int = 0  # < prompt_tokens when the KV cache was reused (chat turns)
    position_tries: list[int] = field(default_factory=list)  # steps that drafted > i tokens
    position_hits: list[int] = field(default_factory=list)  # ... whose draft i was accepted
    accepted_lengths: Counter = field(default_factory=Counter)  # accepted drafts per step -> steps
    draft_lengths: Counter = field(default_factory=Counter)  # drafted tokens per step -> steps
    drafted_by: Counter = field(default_factory=Counter)  # drafted tokens per source (StepStats.source)
    rollback_recoveries: int = 0  # cache cuts that failed and were repaired by re-evaluating (all models)
    nodes: int = 0  # draft nodes verified (tree nodes; a chain's drafted tokens)

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.emitted += s.emitted
        self.decided += s.emitted if s.decided is None else s.decided
        self.draft_seconds += s.draft_seconds
        self.verify_seconds += s.verify_seconds
        self.rollback_seconds += s.rollback_seconds
        self.nodes += s.nodes or s.drafted
        while len(self.position_tries) < s.drafted:
            self.position_tries.append(0)
            self.position_hits.append(0)
        for i in range(s.drafted):
            self.position_tries[i] += 1
            if i < s.accepted:
                self.position_hits[i] += 1
        self.accepted_lengths[s.accepted] += 1
        self.draft_lengths[s.drafted] += 1
        if s.drafted:
            self.drafted_by[s.source or "unnamed"] += s.drafted

    def snapshot(self) -> RunStats:
        """A copy that later steps leave alone (what each StepEvent carries)."""
        # (every step makes one: a copy of the fields, not dataclasses.replace's call of __init__, which was
        # a large share of the engine's own time per step on a fast decode)
        copy = object.__new__(RunStats)
        copy.__dict__.update(self.__dict__)
        copy.position_tries, copy.position_hits = self.position_tries[:], self.position_hits[:]
        copy.accepted_lengths, copy.draft_lengths = self.accepted_lengths.copy(), self.draft_lengths.copy()
        copy.drafted_by = self.drafted_by.copy()
        return copy

    def merge(self, other: RunStats) -> None:
        for name in ("steps", "drafted", "accepted", "emitted", "decided", "draft_seconds", "verify_seconds",
                     "rollback_seconds", "prefill_seconds", "generate_seconds", "prompt_tokens", "prompt_tokens_evaluated",
                     "rollback_recoveries", "nodes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for i, (tries, hits) in enumerate(zip(other.position_tries, other.position_hits)):
            if i >= len(self.position_tries):
                self.position_tries.append(0)
                self.position_hits.append(0)
            self.position_tries[i] += tries
            self.position_hits[i] += hits
        self.accepted_lengths.update(other.accepted_lengths)
        self.draft_lengths.update(other.draft_lengths)
        self.drafted_by.update(other.drafted_by)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """tau: tokens decided per verify step, the target's own token included (plain decoding = 1.0).
        A final end-of-generation token counts: the step did produce it."""
        return self.decided / self.steps if self.steps else None

    @property
    def nodes_per_step(self) -> float | None:
        """Draft nodes the target verified per step (a chain's: its drafted tokens)."""
        return self.nodes / self.steps if self.steps else None

    @property
    def per_position_acceptance(self) -> list[float]:
        return [h / t for h, t in zip(self.position_hits, self.position_tries)]

    @property
    def tokens_per_second(self) -> float | None:
        return self.emitted / self.generate_seconds if self.generate_seconds > 0 else None

    @property
    def end_to_end_tokens_per_second(self) -> float | None:
        total = self.prefill_seconds + self.generate_seconds
        return self.emitted / total if total > 0 else None

    @property
    def draft_share(self) -> float | None:
        """Fraction of step time spent drafting (the rest is the target's verify)."""
        total = self.draft_seconds + self.verify_seconds
        return self.draft_seconds / total if total > 0 else None

    def as_dict(self, *, counts: bool = False) -> dict:
        """The metrics under their README names (transcripts, report.json). `counts`: also the raw
        per-position counts, so that saved runs can be read back (`from_dict`) and re-added exactly."""
        out = {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "generated_tokens": self.emitted,
            "decided_tokens": self.decided,  # generated + a final end-of-generation token
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position_acceptance": self.per_position_acceptance,
            "accepted_length_histogram": {str(k): v for k, v in sorted(self.accepted_lengths.items())},
            "draft_lengths": {str(k): v for k, v in sorted(self.draft_lengths.items())},
            "drafted_by": dict(sorted(self.drafted_by.items())),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_evaluated": self.prompt_tokens_evaluated,
            "prefill_seconds": self.prefill_seconds,
            "generate_seconds": self.generate_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "rollback_seconds": self.rollback_seconds,
            "tokens_per_second": self.tokens_per_second,
            "end_to_end_tokens_per_second": self.end_to_end_tokens_per_second,
            "rollback_recoveries": self.rollback_recoveries,
            "nodes_verified": self.nodes,
            "nodes_per_step": self.nodes_per_step,
            "tokens_per_step": self.mean_accepted_length,
        }
        if counts:
            out["position_tries"], out["position_hits"] = list(self.position_tries), list(self.position_hits)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> RunStats:
        """The inverse of as_dict(counts=True); the keys added since the first report.json are optional."""
        return cls(
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
            rollback_seconds=d.get("rollback_seconds", 0.0),
            nodes=d.get("nodes_verified", d["drafted"]),
        )
