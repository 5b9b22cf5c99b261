"""How many tokens to draft at each step, and from which drafter (k = 0 means plain decoding).

Drafting pays only when the tokens it is expected to add outweigh what verifying them costs. On a GPU
at batch 1 verifying 8 tokens costs about as much as 1; on two CPU cores it costs 3-5x, so the same
drafter that doubles speed there loses here. `AdaptivePolicy` decides from measurements on this machine:

    expected tokens(n) = 1 + sum_{j<=n} prod_{i<=j} a_i      a_i = P(draft i accepted | drafts < i accepted)
    rate(n)            = expected tokens(n) / (verify_cost(n + 1) + draft_cost(n))

and picks the n with the best rate, n = 0 included. verify_cost comes from costs.py (a calibration per
model file, followed online); the a_i come from each drafter's own estimate (`Drafter.offer`). With
several drafters (a chain), every drafter is priced each step and the best rate is sent: a free drafter
(prompt lookup) proposes first and its proposal is priced, one whose tokens cost time is priced before it
runs. `FixedPolicy` sends a fixed k, from the first drafter of a chain that proposes anything (llama.cpp's
rule).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from .costs import CostModel, write_atomic
from .drafters import Draft, Drafter, Estimating, Forwards, Suspendable, is_free, members
from .sampling import SamplingParams
from .stats import StepStats

# Draft only when the predicted rate beats plain decoding by this much: the acceptance estimates come
# from a handful of observations, and on a CPU a wrong guess costs several tokens' worth of time.
DRAFT_MARGIN = 1.04
DRAFT_MAX = 64  # --draft-max's default: the policy decides below it; long lookup matches use it
# A drafter whose tokens cost time and that has not drafted for this many steps gets one short draft
# anyway (PROBE_TOKENS, priced as any draft in the stats): an estimate that rules a drafter out is never
# corrected otherwise (docs/decisions.md, "Probes"). A probe whose expected loss (its cost less the steps
# its expected kept tokens save) is more than PROBE_SHARE of the idle steps' time (a recurrent target whose
# checkpoints cost several steps) waits that much longer.
PROBE_AFTER = 32
PROBE_TOKENS = 2
PROBE_SHARE = 0.03
# A drafter whose probes kept nothing this many times in a row is given up for the process: suspended (a
# block drafter or a head no longer has the target extract its layer rows) and never caught up again: kept
# ready, a hopeless block drafter costs a tiny target a tenth of its time (its features captured on every
# verify, each probe injecting every token since the last). A new process probes again.
PROBE_GIVE_UP = 3
# observations per position that a phase entered for the first time takes over from the phase before it:
# the answer starts from what the thought taught, as a prior its own evidence soon outweighs
PHASE_TRUST = 2.0


@runtime_checkable
class Policy(Protocol):
    # why the last generation drafted nothing, in a few words for the summary line (None: it drafted, or
    # nothing can be said)
    last_note: str | None

    def draft(self, drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator) -> Draft:
        """The tokens to send to the target now (an empty Draft: plain decoding), at most `limit`, from
        the drafter or one member of a chain."""

    def observe(self, step: StepStats, emitted: Sequence[int]) -> None:
        """The step's outcome: what was sent and accepted, and the tokens emitted."""

    def enter(self, phase: str) -> None:
        """The reply is in this phase now ("thought" or "answer" of a reasoning model's reply): estimates
        learned in one phase are kept apart from the other's."""

    def finish(self) -> None:
        """A generation ended: keep what was learned (the adaptive policy saves its estimates)."""

    @property
    def drafting_possible(self) -> bool:
        """False when no draft could pay here: the engine then does not even prefill the drafter."""


class FixedPolicy:
    """Always the same k: --draft-fixed, and --no-spec (k = 0). A chain sends the first non-empty draft, free
    drafters (lookup) first, then in the chain's order: llama.cpp's rule (n-gram types before the others)."""

    drafting_possible = True
    last_note = None

    def __init__(self, k: int):
        self.k = k

    def draft(self, drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator) -> Draft:
        k = max(0, min(self.k, limit))
        if k == 0:
            return Draft()
        for member in sorted(members(drafter), key=lambda m: not is_free(m)):
            proposal = member.propose(context, k, params, rng)
            if proposal.tokens:
                proposal.drafter, proposal.planned = member, k
                return proposal
        return Draft(planned=k)

    def observe(self, step: StepStats, emitted: Sequence[int]) -> None:
        pass

    def enter(self, phase: str) -> None:
        pass

    def finish(self) -> None:
        pass


def best_length(
    a: Sequence[float], verify_cost: CostModel, draft_seconds: Sequence[float] | None = None,
    overhead: float = 0.0, margin: float = DRAFT_MARGIN, rollback: float = 0.0,
) -> tuple[int, float]:
    """argmax over n of expected tokens(n) / (verify(n+1) + draft_seconds[n] + per-step overhead), over the
    n whose batch n + 1 the cost model may send: (n, tokens per second). Within 1% of the best, the
    shortest draft wins: the same speed for less work. `draft_seconds[n]`: what drafting n tokens costs
    (at least len(a) + 1 entries; None: nothing, a free drafter's).

    It runs every step between two decodes, when the CPU caches hold model weights and each numpy call
    costs several microseconds whatever its size: for the at most 64 positions a Python loop is cheaper
    (the same sums, in the same order, as 1 + cumsum(cumprod(a))).

    `rollback`: what a step that drafts anything costs on top (a recurrent target's checkpoint: the copy,
    and on a rejection the restore and the kept tokens evaluated again), as observed."""
    a = a.tolist() if isinstance(a, np.ndarray) else list(a)
    n_max = len(a)
    table, sendable = verify_cost.seconds_list(n_max + 1), verify_cost.sendable_list(n_max + 1)
    rates = [0.0] * (n_max + 1)
    accepted = 0.0  # expected accepted drafts among the first n
    run = 1.0  # P(drafts 0..n-1 all accepted)
    for n in range(n_max + 1):
        if n:
            run *= a[n - 1]
            accepted += run
        if sendable[n + 1]:
            drafting = draft_seconds[n] if draft_seconds is not None else 0.0
            rates[n] = (1.0 + accepted) / (table[n + 1] + drafting + overhead + (rollback if n else 0.0))
    if max(rates[1:], default=0.0) < rates[0] * margin:
        return 0, rates[0]  # a predicted gain this small is inside the estimates' error
    threshold = max(rates) / 1.01
    best = next(n for n, rate in enumerate(rates) if rate >= threshold)
    return best, rates[best]


class AcceptanceStore:
    """Acceptance estimates kept across processes: one JSON file in the cache dir, one entry per
    (target file, drafter). Written atomically at the end of each generation; a missing, corrupt or
    foreign file (or entry) is ignored and overwritten, never an error."""

    # 6: one entry per (target file, drafter) whatever chain the drafter is in
    VERSION = 6
    # observations a saved estimate counts as (per position), however many it had: what other prompts
    # taught is a prior, and two of this run's own misses outweigh it (with 8, a store learned on prompts
    # the reply copied sent 24-token drafts into a reply that copied nothing, one miss after another)
    TRUST = 2.0

    def __init__(self, path: Path, key: str, label: str = ""):
        self.path = path
        self.key = key
        self.label = label

    def _read(self) -> dict:
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            return {}
        if not isinstance(doc, dict) or doc.get("version") != self.VERSION or not isinstance(doc.get("entries"), dict):
            return {}
        return doc["entries"]

    def load(self) -> dict[str, dict]:
        entry = self._read().get(self.key)
        tables = entry.get("tables") if isinstance(entry, dict) else None
        return tables if isinstance(tables, dict) else {}

    def save(self, tables: dict[str, dict]) -> None:
        entries = self._read()
        entries[self.key] = {"label": self.label, "updated": time.time(), "tables": tables}
        if len(entries) > 64:  # forget the pairs not used for the longest time
            for old in sorted(entries, key=lambda k: entries[k].get("updated", 0) if isinstance(entries[k], dict) else 0)[:-64]:
                del entries[old]
        write_atomic(self.path, json.dumps({"version": self.VERSION, "entries": entries}))


@dataclass
class Member:
    """One drafter as the policy prices it: what its model's forwards cost (None: free, or not timed),
    which forwards a draft of each length runs (what the drafter reports: `Drafter.forwards`), and whether
    it could pay at all (a draft token that costs about a target token cannot, even if always right)."""

    drafter: Drafter
    draft_cost: CostModel | None
    store: AcceptanceStore | None = None
    possible: bool = True
    idle: int = 0  # steps since it last drafted (a drafter whose tokens cost time; see PROBE_AFTER)
    failed_probes: int = 0  # drafts after idle steps that kept nothing, in a row (see PROBE_GIVE_UP)
    given_up: bool = False
    proposed: bool = False  # whether it proposed anything this generation (free drafters)
    # the drafter's estimates as each phase of a reply left them, by phase (see AdaptivePolicy.enter)
    phases: dict[str, dict[str, dict]] = field(default_factory=dict, repr=False)
    # proposals that cost no model time: made every step, priced after (see Drafter.forwards)
    free: bool = field(init=False)
    # the forwards of a draft of 0..n tokens, by n (what the drafter reports depends on n alone), and the
    # largest batch among the first n + 1 of them: read every step, so asked once
    _forwards: list[Forwards] = field(init=False, default_factory=list, repr=False)
    _largest: list[int] = field(init=False, default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.free = is_free(self.drafter)

    @property
    def label(self) -> str:
        return self.drafter.kind.label

    def draft_seconds(self, n_max: int) -> list[float] | None:
        """What drafting 0..n_max tokens costs, from the forwards the drafter says each runs; None for a
        drafter whose time is not measured (a free one's)."""
        if self.draft_cost is None:
            return None
        shapes, largest = self._forwards, self._largest
        for n in range(len(shapes), n_max + 1):
            shapes.append(self.drafter.forwards(n, n))
            largest.append(max(shapes[-1].size, largest[-1] if largest else 0))
        table = self.draft_cost.seconds_list(largest[n_max])
        return [count * table[size] if count else 0.0 for count, size in shapes[: n_max + 1]]

    def learn_cost(self, drafted: int, seconds: float, proposal: Draft | None = None) -> None:
        """A draft of `drafted` tokens took `seconds` of the drafter's time: each of its forwards (of the
        draft asked for, `proposal.planned`: a block drafter runs the whole block whatever it kept) took
        an equal share."""
        asked = proposal.planned if proposal is not None and proposal.planned else drafted
        count, size = self.drafter.forwards(drafted, asked)
        if count:
            self.draft_cost.update(size, seconds / count)


class AdaptivePolicy:
    """The default: each step, the draft (drafter and length) with the best expected tokens per second, or
    none (see module doc). It holds the costs (the target's, each drafter's), the per-step overhead, and
    each drafter's estimates kept across processes; the drafters hold their own evidence."""

    def __init__(self, drafter, verify_cost: CostModel, *, draft_max: int,
                 draft_costs: Sequence[CostModel | None] | None = None,
                 stores: Sequence[AcceptanceStore | None] | None = None, learn_costs: bool = True):
        drafters = members(drafter)
        draft_costs = list(draft_costs) if draft_costs is not None else [None] * len(drafters)
        stores = list(stores) if stores is not None else [None] * len(drafters)
        # free drafters first: they propose before anything is priced, and win ties (their drafts cost nothing)
        self.members = sorted((Member(d, c, s) for d, c, s in zip(drafters, draft_costs, stores)),
                              key=lambda m: not m.free)
        self.verify_cost = verify_cost
        self.draft_max = draft_max
        # False (--reproducible): the costs stay as given, nothing is learned from the clock, so the
        # draft lengths depend only on the tokens
        self.learn_costs = learn_costs
        self._steps = self._sent = 0  # this generation's steps: all, and those that drafted
        self.last_note: str | None = None  # why the last generation drafted nothing (see decline_note)
        # Seconds per step spent outside drafting and verifying (bookkeeping, the consumer drawing
        # tokens). Paid once per step whatever k is, so it favours longer drafts.
        self.overhead = 0.0
        # Seconds a drafting step spends on the target's recurrent-state checkpoints (0 for a KV cache)
        self.rollback = 0.0
        self._last_observed: float | None = None
        # The largest batch evaluated so far. A batch larger than any before it grows llama.cpp's output
        # and compute buffers, and the first touch of that memory is paid inside the decode (nearly twice the
        # batch's cost): learnt from, that one-off makes every later batch look dearer, and the drafts shorter.
        self._largest_batch = 1
        # this step's proposals, by member, and the member whose draft was sent
        self._proposals: dict[int, Draft] = {}
        self._chosen: Member | None = None
        self.phase = "answer"  # the reply's phase the drafters' live estimates belong to
        for member in self.members:
            self._judge(member)
            carried = member.drafter.carried()
            if member.store is not None and carried:  # start from the estimates an earlier process saved
                saved = member.store.load()
                for name, estimate in carried.items():
                    if name in saved:
                        estimate.absorb(saved[name], AcceptanceStore.TRUST)
        self.drafting_possible = any(m.possible for m in self.members)

    def _judge(self, member: Member) -> None:
        """Whether the member could pay here at all; one that cannot is never asked, so it is suspended
        (a head's rows are not extracted), and resumed if it can again."""
        member.possible = self._could_pay(member)
        if isinstance(member.drafter, Suspendable):
            member.drafter.suspend(not member.possible)

    def _could_pay(self, member: Member) -> bool:
        """Whether a draft of this member could beat plain decoding even if it were always right."""
        if member.given_up:
            return False
        if member.draft_cost is None:
            return True
        n_max = max(1, self.draft_max)
        return best_length(np.ones(n_max), self.verify_cost, member.draft_seconds(n_max))[0] > 0

    # --- each step

    def _price(self, member: Member, offer) -> tuple[int, float]:
        """(tokens to send, expected tokens per second) of the member's offer."""
        margin = DRAFT_MARGIN if offer.margin is None else offer.margin
        return best_length(offer.rates, self.verify_cost, member.draft_seconds(len(offer.rates)), self.overhead,
                           margin, self.rollback)

    def _probe_due(self, member: Member, limit: int) -> bool:
        """Whether a member its estimate rules out has been idle long enough for a probe (see PROBE_SHARE)."""
        if member.idle < PROBE_AFTER:
            return False
        n = min(PROBE_TOKENS, limit)
        drafting = member.draft_seconds(n)
        one = self.verify_cost(1)
        cost = self.verify_cost(n + 1) - one + (drafting[n] if drafting else 0.0) + self.rollback
        budget = PROBE_SHARE * member.idle * one
        if cost <= budget:
            return True
        # what it is expected to lose: its cost less the steps its tokens save, by the member's own estimates.
        # A drafter just below paying probes more often than one that keeps nothing, so its estimates climb
        # past the bar sooner.
        kept, run = 0.0, 1.0
        for rate in member.drafter.offer(None, n).rates[:n]:
            run *= rate
            kept += run
        return cost - kept * one <= budget

    def draft(self, drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator) -> Draft:
        self._proposals, self._chosen = {}, None
        limit = min(limit, self.draft_max)
        if limit <= 0:
            return Draft()
        best: tuple[float, int, Member] | None = None  # (rate, tokens, member)
        probe: Member | None = None
        for member in self.members:
            if member.free:
                proposal = member.drafter.propose(context, limit, params, rng)
                self._proposals[id(member)] = proposal
                if not proposal.tokens:
                    continue
                member.proposed = True
                n, rate = self._price(member, member.drafter.offer(proposal, limit))
            elif member.possible:
                n, rate = self._price(member, member.drafter.offer(None, limit))
            else:
                n, rate = 0, 0.0
            if n and (best is None or rate > best[0]):
                best = (rate, n, member)
            elif not n and not member.free and member.possible and probe is None and self._probe_due(member, limit):
                probe = member
        if best is None and probe is not None:
            best = (0.0, min(PROBE_TOKENS, limit), probe)
        asked = limit if self._proposals else 0  # what the free drafters were asked for
        if best is None:
            return Draft(planned=asked)
        _, n, member = best
        self._chosen = member
        if member.free:
            sent = self._proposals[id(member)].head(n)
        else:
            sent = member.drafter.propose(context, n, params, rng)
            self._proposals[id(member)] = sent
            asked = n
        sent.drafter, sent.planned = member.drafter, asked
        return sent

    def observe(self, step: StepStats, emitted: Sequence[int]) -> None:
        self._steps += 1
        self._sent += step.drafted > 0
        self._observe_costs(step)
        chosen, self._chosen = self._chosen, None
        for member in self.members:
            mine = member is chosen and step.drafted > 0
            sent, accepted = (step.drafted, step.accepted) if mine else (0, 0)
            member.drafter.learn(self._proposals.get(id(member)), sent, accepted, emitted)
            if member.free:
                continue
            caught_up, member.idle = member.idle > 0, 0 if mine else member.idle + 1
            if mine and caught_up:  # a probe, or a draft the estimates brought back
                member.failed_probes = 0 if accepted else member.failed_probes + 1
                if member.failed_probes >= PROBE_GIVE_UP:
                    member.given_up = True
                    self._judge(member)
                    continue
            # A draft after idle steps also caught the drafter up on every token since its last (a draft
            # model's batch, a head's rows, a block drafter's injections): priced as the draft, one probe
            # after 32 idle steps made a drafter look several times dearer, and it was never asked again.
            # Steps that follow a draft pay only the last step's tokens: the steady state a price assumes.
            if mine and not caught_up and self.learn_costs and member.draft_cost is not None:
                member.learn_cost(step.drafted, step.draft_seconds, self._proposals.get(id(member)))
                self._judge(member)
        self._proposals = {}

    def enter(self, phase: str) -> None:
        """Each drafter's estimates are set aside for the phase left and those of the phase entered taken up
        again (a first entry starts from the phase before it, discounted to PHASE_TRUST observations). A
        thought and its answer draft differently: an answer that restates its thought is lookup's best case,
        the thought itself may copy nothing, and one set of estimates would average the two."""
        if phase == self.phase:
            return
        for member in self.members:
            if not isinstance(member.drafter, Estimating):
                continue
            live = member.drafter.estimates()
            member.phases[self.phase] = {name: estimate.as_dict() for name, estimate in live.items()}
            saved = member.phases.get(phase)
            for name, estimate in live.items():
                if saved is not None and name in saved:
                    estimate.absorb(saved[name], float("inf"))
                else:
                    estimate.absorb(estimate.as_dict(), PHASE_TRUST)
        self.phase = phase

    # --- memory across runs

    def finish(self) -> None:
        self.last_note = self.decline_note()
        self._steps = self._sent = 0
        for member in self.members:
            member.drafter.reply_done()
            tables = {name: e.as_dict() for name, e in member.drafter.carried().items() if e.tries.sum() > 0}
            if member.store is not None and tables:  # lookup keeps nothing across processes: no file written
                member.store.save(tables)
            member.proposed = False
        # the steps' timings, for the next process (nothing where no cost was learned)
        self.verify_cost.save(*(member.draft_cost for member in self.members))

    def _steps_cost(self, n: int) -> float:
        """What a batch of n tokens costs here, in one-token steps."""
        one = self.verify_cost(1)
        return self.verify_cost(n) / one if one > 0 else float("nan")

    def decline_note(self) -> str | None:
        """Why this generation sent no draft, in a few words, from the costs measured here (None when it
        drafted, or ran no step)."""
        if self._steps == 0 or self._sent > 0:
            return None
        return "draft off: " + "; ".join(self._why_not(m) for m in self.members)

    def _why_not(self, member: Member) -> str:
        verify4 = f"a 4-token verify that costs {self._steps_cost(4):.1f} steps here"
        if member.free:
            if not member.proposed:
                return f"{member.label} found nothing to propose"
            return f"{member.label}'s proposals were too short to pay for {verify4}"
        if member.given_up:
            return f"{member.label} kept nothing in {PROBE_GIVE_UP} probes in a row: given up for this run"
        if not member.possible:
            drafting = member.draft_seconds(1)
            per_token = drafting[1] / self.verify_cost(1) if drafting else 0.0
            return (f"a {member.label} token costs {per_token:.2f} steps and a 2-token verify "
                    f"{self._steps_cost(2):.1f} steps here, so no draft can pay")
        a = float(member.drafter.offer(None, 1).rates[0])
        return f"{member.label} acceptance estimate {a:.0%} is too low for {verify4}"

    # --- learning the costs

    def _observe_overhead(self, step: StepStats) -> None:
        now = time.perf_counter()
        if self._last_observed is not None:
            extra = now - self._last_observed - step.verify_seconds - step.draft_seconds
            # a gap longer than a few token times is a pause (the user typing), not overhead
            if 0.0 <= extra < 3 * self.verify_cost(1):
                self.overhead = 0.9 * self.overhead + 0.1 * extra
        self._last_observed = now

    def _observe_costs(self, step: StepStats) -> None:
        if not self.learn_costs:
            return
        self._observe_overhead(step)
        if step.drafted:
            self.rollback = 0.8 * self.rollback + 0.2 * step.rollback_seconds
        n = step.drafted + 1
        if n > self._largest_batch:  # a first touch of grown buffers, not what batches of n cost
            self._largest_batch = n
            return
        self.verify_cost.update(n, step.verify_seconds)
