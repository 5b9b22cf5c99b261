"""The draft-length policy: cost model, acceptance estimates, and the choice of k (0 included)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specchat.drafters import Acceptance, Draft
from specchat.engine import Finished, generate
from specchat.costs import (
    CostModel,
    CALIBRATION_BUDGET,
    CALIBRATION_REPS,
    CALIBRATION_SIZES,
    cached_cost_model,
    cost_cache_key,
)
from specchat.lookup import LOOKUP_BUCKETS, LOOKUP_MARGIN, PromptLookup
from specchat.policy import (DRAFT_MARGIN, PHASE_TRUST, PROBE_AFTER, PROBE_GIVE_UP, PROBE_TOKENS, AdaptivePolicy,
                             FixedPolicy, best_length)
from specchat.sampling import SamplingParams
from specchat.stats import StepStats

from fakes import FakeBackend, ScriptedDrafter, SetLookup, found, modelled, script_logits, sent

# SmolLM2-135M on 2 CPU cores (measured with llama-cpp-python 0.3.36): verifying 8 tokens costs ~4.6x one token
CPU = CostModel([1, 2, 4, 8, 16], [0.015, 0.025, 0.038, 0.069, 0.101])
# a GPU at batch 1: verifying 8 costs about as much as 1
GPU = CostModel([1, 2, 4, 8, 16], [0.020, 0.0202, 0.0205, 0.021, 0.022])


def step(drafted: int, accepted: int, verify: float = 0.0, draft: float = 0.0) -> StepStats:
    emitted = accepted + 1
    return StepStats(step=0, drafted=drafted, accepted=accepted, emitted=emitted,
                     draft_seconds=draft, verify_seconds=verify)


GREEDY = SamplingParams(temperature=0.0)
RNG = np.random.default_rng(0)


def test_cost_model_interpolates_and_extrapolates():
    assert CPU(1) == pytest.approx(0.015)
    assert CPU(3) == pytest.approx((0.025 + 0.038) / 2)
    assert CPU(12) == pytest.approx((0.069 + 0.101) / 2)
    slope = (0.101 - 0.069) / 8
    assert CPU(20) == pytest.approx(0.101 + 4 * slope)
    assert CPU(0) == 0.0


def test_cost_model_follows_the_machine_online_but_not_one_stall():
    model = CostModel([1, 2], [0.01, 0.02])
    for _ in range(60):
        model.update(1, 0.02)  # the machine got twice as slow
    assert model(1) == pytest.approx(0.02, rel=0.01)
    assert model(2) == pytest.approx(0.04, rel=0.01)  # batches with it
    before = model.scale
    model.update(1, 100.0)  # one 100 s stall moves the scale by at most weight * 4x
    assert model.scale <= before * 0.9 + 0.1 * 4.0 + 1e-9
    model.update(2, 100.0)  # nor, in a batch, the batches' factor by more than its weight * 2x
    assert model.batch <= 0.8 * 1.0 + 0.2 * 2.0 + 1e-9


def test_batches_dearer_than_calibrated_make_marginal_drafts_wait():
    model = CostModel([1, 2, 4, 8, 16], [0.015, 0.025, 0.038, 0.069, 0.101])
    a = np.full(8, 0.9)
    assert best_length(a, model)[0] > 0  # the calibration says 90% acceptance pays
    for _ in range(20):
        model.update(1, 0.015)  # plain steps cost what calibration said
        model.update(8, 0.069 * 1.4)  # batches of 8 cost 40% more than it said
    assert model.scale == pytest.approx(1.0) and model.batch == pytest.approx(1.4, rel=0.02)
    assert model(1) == pytest.approx(0.015) and model(8) == pytest.approx(0.069 * 1.4, rel=0.02)
    assert model.costs(8)[8] == pytest.approx(model(8))
    assert best_length(a, model)[0] < best_length(a, CostModel(model.sizes, model.seconds))[0]


def test_the_first_batch_larger_than_any_before_teaches_no_cost():
    """A batch larger than any before it grows llama.cpp's buffers and pays their first touch (gemma: 311 ms
    for the first 64-token batch of a process, 170 after): that one-off must not make batches look dearer."""
    cost = CostModel([1, 2, 4, 8, 16], [0.015, 0.025, 0.038, 0.069, 0.101])
    policy = AdaptivePolicy(PromptLookup(), cost, draft_max=15)

    def verified(drafted, seconds):
        policy.observe(StepStats(step=0, drafted=drafted, accepted=drafted, emitted=drafted + 1,
                                 draft_seconds=0.0, verify_seconds=seconds), [])

    verified(15, 0.101 * 1.8)  # the first 16-token batch: slow, and ignored
    assert cost.batch == 1.0
    verified(7, 0.069 * 1.8)  # a smaller one after it: its buffers were already touched, so it counts
    assert cost.batch > 1.1
    before = cost.batch
    verified(15, 0.101 * 1.8)  # a second 16-token batch as slow: now it is what batches cost
    assert cost.batch > before


def test_best_length_cpu_needs_high_acceptance_gpu_does_not():
    # 60% per-position acceptance: worth drafting on a GPU, a loss on this CPU
    a = np.full(8, 0.6)
    n_cpu, rate_cpu = best_length(a, CPU)
    n_gpu, rate_gpu = best_length(a, GPU)
    assert n_cpu == 0 and rate_cpu == pytest.approx(1 / 0.015)
    assert n_gpu >= 3
    expected = 1 + sum(0.6 ** j for j in range(1, n_gpu + 1))
    assert rate_gpu == pytest.approx(expected / GPU(n_gpu + 1))
    # a copied span (97% per position) pays even on the CPU, and long
    n, rate = best_length(np.full(16, 0.97), CPU)
    assert n >= 8 and rate > 1.5 / 0.015


def test_best_length_is_exactly_the_argmax_of_the_formula():
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = rng.uniform(0.3, 1.0, size=10)
        n, rate = best_length(a, CPU)
        rates = [(1 + np.cumprod(a)[:m].sum()) / CPU(m + 1) for m in range(11)]
        if max(rates[1:]) < rates[0] * DRAFT_MARGIN:
            assert n == 0  # not worth the risk of a wrong estimate
        else:
            assert rates[n] >= max(rates) / 1.01 - 1e-12
            assert all(r < max(rates) / 1.01 for r in rates[:n])  # the shortest such draft
        assert rate == pytest.approx(rates[n])


def _gain(a):
    n, rate = best_length(a, CPU, margin=1.0)
    return rate * CPU(1)  # the best predicted rate over plain decoding's


def test_a_lookup_draft_must_promise_more_than_a_model_draft():
    # an acceptance whose best draft is predicted 4-10% faster than plain decoding
    p = next(p for p in np.arange(0.50, 1.0, 0.002) if DRAFT_MARGIN < _gain(np.full(16, p)) < LOOKUP_MARGIN)
    a = np.full(16, p)
    assert best_length(a, CPU)[0] > 0  # a draft model's estimate: sent
    assert best_length(a, CPU, margin=LOOKUP_MARGIN) == (0, pytest.approx(1 / CPU(1)))  # lookup's: not
    lookup = SetLookup()
    policy = AdaptivePolicy(lookup, CPU, draft_max=16)
    for history in lookup.acceptance._table:  # every lookup estimate at p
        for state in history:
            state[:] = [p] * len(state)
    assert sent(policy, lookup, found(range(16), 8)) == 0
    for history in lookup.acceptance._table:
        for state in history:
            state[:] = [0.99] * len(state)
    assert sent(policy, lookup, found(range(16), 8)) > 0


def test_each_phase_of_a_reply_learns_its_own_estimates():
    """An answer whose drafts are never kept and a thought whose drafts all are: coming back to a phase, the
    drafter drafts from that phase's record, not from an average of the two; a phase entered for the first
    time starts from the one before it, discounted to PHASE_TRUST observations a position."""
    policy, drafter = modelled(GPU, CostModel([1, 2], [0.002, 0.004]))
    assert policy.phase == "answer"
    for _ in range(30):
        drafter.acceptance.record(0, 4)
    answer = drafter.acceptance.rates(4)
    policy.enter("thought")
    assert drafter.acceptance.tries.max() == pytest.approx(PHASE_TRUST)
    assert drafter.acceptance.hits.max() < 0.01  # the answer's record, as a prior
    for _ in range(30):
        drafter.acceptance.record(4, 4)
    thought = drafter.acceptance.rates(4)
    assert answer[0] < 0.2 and thought[0] > 0.9
    policy.enter("answer")
    assert drafter.acceptance.rates(4) == pytest.approx(answer, abs=1e-3)
    assert sent(policy, drafter, limit=8) == 0
    policy.enter("thought")
    assert drafter.acceptance.rates(4) == pytest.approx(thought, abs=1e-3)
    assert sent(policy, drafter, limit=8) > 0


def test_lookup_learns_each_phase_apart():
    lookup = SetLookup()
    policy = AdaptivePolicy(lookup, CPU, draft_max=16)
    for _ in range(40):  # matches in the answer that never go on as before
        lookup.acceptance.record(8, 0, 4)
    missing = lookup.acceptance.as_dict()
    policy.enter("thought")
    for _ in range(40):  # copied spans of the thought, every token right
        lookup.acceptance.record(8, 4, 4)
    copying = lookup.acceptance.as_dict()
    assert lookup.acceptance.rates(8, 2) == pytest.approx([0.99, 0.99], abs=0.01)  # inside a span
    policy.enter("answer")
    assert lookup.acceptance.as_dict() == missing != copying
    assert lookup.acceptance.rates(8, 1)[0] < 0.1  # after a miss
    policy.enter("thought")
    assert lookup.acceptance.as_dict() == copying


def test_draft_model_as_costly_as_the_target_is_never_used():
    """A self-pair on a CPU: each draft token costs a full target token, so no k can win."""
    policy, drafter = modelled(CPU, CostModel([1, 2], [0.015, 0.025]), draft_max=16)
    for _ in range(5):
        drafter.acceptance.record(4, 4)  # even when everything is accepted
    assert all(sent(policy, drafter) == 0 for _ in range(2 * PROBE_AFTER))  # not even a probe


def test_cheap_draft_model_is_used_while_it_is_accepted_and_dropped_when_not():
    cheap = CostModel([1, 2], [0.002, 0.004])  # a draft token costs a tenth of a target token
    policy, drafter = modelled(GPU, cheap)
    assert sent(policy, drafter, limit=8) > 0  # optimistic prior: try it
    plans = []
    for _ in range(80):
        plans.append(sent(policy, drafter, limit=8))
        policy.observe(step(plans[-1], 0), [9])  # every first draft rejected
    dropped = plans.index(0)
    assert 0 < dropped < 20
    # dropped, but tried again now and then with a short probe: a wrong estimate must be correctable
    assert plans[dropped : dropped + PROBE_AFTER] == [0] * PROBE_AFTER
    assert plans[dropped + PROBE_AFTER] == PROBE_TOKENS
    assert sent(policy, drafter, limit=0) == 0


def test_a_drafter_whose_probes_keep_nothing_is_given_up_and_suspended():
    """Probes that keep nothing PROBE_GIVE_UP times in a row: the drafter is given up for the run and
    suspended (a block drafter then stops having the target's layer rows extracted), and the note says why.
    A probe that keeps a token starts the count again."""

    def probes(kept_by_probe: dict[int, int]):
        policy, drafter = modelled(GPU, CostModel([1, 2], [0.002, 0.004]))
        suspended = []
        drafter.suspend = suspended.append
        plans = []
        for _ in range(30 * PROBE_AFTER):
            plans.append(sent(policy, drafter, limit=8))
            dropped = 0 in plans
            probe = len([n for n in plans[plans.index(0):] if n]) if dropped else 0
            kept = kept_by_probe.get(probe, 0) if plans[-1] and dropped else 0
            policy.observe(step(plans[-1], kept), [9])
        dropped = plans.index(0)
        return policy, suspended, [i for i, n in enumerate(plans) if n and i > dropped]

    policy, suspended, sent_at = probes({})
    assert len(sent_at) == PROBE_GIVE_UP and sent_at[-1] < 10 * PROBE_AFTER  # then never again
    member = policy.members[0]
    assert member.given_up and not member.possible and suspended[-1] is True
    policy.finish()
    assert all(sent(policy, drafter=member.drafter) == 0 for _ in range(3))
    for _ in range(3):
        policy.observe(step(0, 0), [9])
    assert "given up" in policy.decline_note()
    policy, suspended, sent_at = probes({2: 1})  # the second probe keeps one: the count starts again
    assert len(sent_at) >= PROBE_GIVE_UP + 2 and policy.members[0].given_up and suspended[-1] is True


def test_a_drafter_just_below_paying_is_probed_sooner_than_one_that_keeps_nothing():
    """A probe waits until its expected loss (its cost less the steps its expected kept tokens save) is
    PROBE_SHARE of the idle steps' time: on a CPU, a drafter estimated at 60% (not worth a draft here) is
    probed after PROBE_AFTER idle steps, one estimated at 0% only after its whole cost is covered."""

    def first_probe(rate: float) -> int:
        policy, drafter = modelled(CPU, CostModel([1, 2], [0.004, 0.008]))
        drafter.acceptance.hits[:] = 1000 * rate
        drafter.acceptance.tries[:] = 1000
        for idle in range(1, 200):
            n = sent(policy, drafter, limit=8)
            if n:
                assert n == PROBE_TOKENS
                return idle
            policy.observe(step(0, 0), [9])
        return 0

    assert first_probe(0.6) == PROBE_AFTER + 1
    assert first_probe(0.0) > 1.5 * PROBE_AFTER


def test_lookup_trim_learns_from_real_verifications():
    lookup = SetLookup()
    policy = AdaptivePolicy(lookup, CPU, draft_max=16)
    proposal = list(range(10, 22))
    policy.draft(lookup, [1, 2, 3], 16, GREEDY, RNG)
    assert sent(policy, lookup, found(proposal, 4)) == 0  # prior alone does not pay on this CPU
    for _ in range(30):  # spans copied from the prompt, always accepted whole
        n = sent(policy, lookup, found(proposal, 4))
        if n == 0:
            # drafting nothing: the shadow check sees the target emit the proposal's first token
            policy.observe(step(0, 0), [proposal[0]])
        else:
            policy.observe(step(n, n), proposal[: n + 1])
    # on this cost curve the rate is flat past ~4 tokens (within 1%), and the shortest such draft wins
    assert sent(policy, lookup, found(proposal, 4)) >= 4
    for _ in range(30):  # the text moved on: the same kind of match is now rejected at once
        n = sent(policy, lookup, found(proposal, 4))
        policy.observe(step(n, 0), [999])
    assert sent(policy, lookup, found(proposal, 4)) == 0


def test_shadow_learning_turns_drafting_on_without_ever_drafting():
    """With k = 0 the proposals are still checked against what the target emits: when they keep
    coming true, the policy starts drafting."""
    lookup = SetLookup()
    policy = AdaptivePolicy(lookup, CPU, draft_max=16)
    text = list(range(100, 160))
    drafted_at = None
    for i in range(40):
        n = sent(policy, lookup, found(text[i : i + 12], 3))
        if n:
            drafted_at = i
            break
        policy.observe(step(0, 0), [text[i]])
    assert drafted_at is not None and drafted_at < 30


def test_shadow_does_not_count_a_repeated_span_twice():
    lookup = SetLookup()
    policy = AdaptivePolicy(lookup, CPU, draft_max=16)
    text = list(range(100, 120))
    for i in range(5):
        sent(policy, lookup, found(text[i : i + 8], 2))
        policy.observe(step(0, 0), [text[i]])
    # context matches
    tries, hits = lookup.acceptance.tries[0].sum(axis=0), lookup.acceptance.hits[0].sum(axis=0)
    # one span followed for 5 tokens: each token checked once, against the match it continued (2, 3,
    # 4, 5, 6 tokens long), not five checks of the 2-token match
    buckets = {b: i for i, b in enumerate(LOOKUP_BUCKETS)}
    assert tries.sum() == pytest.approx(5, rel=0.05) and hits.sum() == pytest.approx(tries.sum())
    assert tries[buckets[2]] == pytest.approx(1) and tries[buckets[3]] == pytest.approx(1)
    assert tries[buckets[4]] == pytest.approx(2, rel=0.05) and tries[buckets[6]] == pytest.approx(1)


def test_fixed_policy():
    drafter = ScriptedDrafter(fallback=lambda context, k: list(range(1, k + 1)))
    assert sent(FixedPolicy(6), drafter, limit=4) == 4
    assert sent(FixedPolicy(6), drafter, limit=10) == 6
    assert sent(FixedPolicy(0), drafter, limit=10) == 0
    assert drafter.proposals[-1][1] == 6  # k = 0 asks nothing


def test_fixed_policy_sends_a_chains_first_nonempty_draft():
    """llama.cpp's rule for a chain at a fixed length: the first drafter, in the chain's order, that proposes."""
    from specchat.drafters import Chain

    empty, second, third = ScriptedDrafter(), ScriptedDrafter([[7, 8, 9]]), ScriptedDrafter([[4, 5]])
    draft = FixedPolicy(2).draft(Chain([empty, second, third]), [1], 8, GREEDY, RNG)
    assert draft.tokens == [7, 8] and draft.drafter is second and draft.planned == 2
    assert third.proposals == []  # not asked once an earlier one proposed


def test_cost_cache_round_trip(tmp_path):
    backend = FakeBackend(lambda ctx: np.zeros(8, dtype=np.float32), 8, name="fake-model")
    backend.eval([1, 2, 3], [])
    cache = tmp_path / "costs.json"
    first = cached_cost_model(backend, cache)
    assert backend.tokens == [1, 2, 3]  # calibration rolled itself back
    table = json.loads(cache.read_text())
    assert cost_cache_key(backend) in table
    assert first.measured and first.sizes == [n for n in CALIBRATION_SIZES if n <= backend.n_ctx - 3]
    evaluated = backend.evaluated
    second = cached_cost_model(backend, cache)
    assert backend.evaluated == evaluated  # read from the cache: nothing measured
    assert second.seconds == first.seconds and second.measured
    # an entry timed at other sizes (an older specchat's) is measured again, not trusted
    table[cost_cache_key(backend)]["sizes"] = [1, 2, 3, 4, 6, 8, 12, 17, 25, 33, 49, 65][: len(first.sizes)]
    cache.write_text(json.dumps(table))
    third = cached_cost_model(backend, cache)
    assert backend.evaluated > evaluated and third.sizes == first.sizes


def test_a_calibration_cut_short_under_a_smaller_budget_is_measured_again(tmp_path):
    """An entry an older specchat timed up to 28 under a 2 s budget is measured again (long lookup drafts are
    sent only at timed sizes); one that stopped there under today's budget (a slow machine) is kept."""
    backend = FakeBackend(lambda ctx: np.zeros(8, dtype=np.float32), 8, name="fake-model")
    cache = tmp_path / "costs.json"
    cached_cost_model(backend, cache)
    table = json.loads(cache.read_text())
    entry = table[cost_cache_key(backend)]
    assert entry["budget"] == CALIBRATION_BUDGET
    short = CALIBRATION_SIZES.index(28) + 1
    entry["sizes"], entry["seconds"] = entry["sizes"][:short], entry["seconds"][:short]
    cache.write_text(json.dumps(table))
    evaluated = backend.evaluated
    assert cached_cost_model(backend, cache).sizes[-1] == 28  # today's budget stopped there: kept
    assert backend.evaluated == evaluated
    del entry["budget"]  # an older specchat's entry
    cache.write_text(json.dumps(table))
    assert cached_cost_model(backend, cache).sizes[-1] == CALIBRATION_SIZES[-1]
    assert backend.evaluated > evaluated


def test_calibration_keeps_the_fastest_timing_of_each_size(monkeypatch):
    """A timing is only ever slowed down by the machine (another process, a page fault): of each size's
    timings the fastest is kept, so one stall does not decide the draft lengths."""
    backend = FakeBackend(lambda ctx: np.zeros(8, dtype=np.float32), 8)
    clock = {"now": 0.0, "evals": 0}
    real_eval = backend.eval

    def eval_(tokens, logits_at):  # n tokens take n ms, and every other evaluation stalls 50 ms more
        clock["evals"] += 1
        clock["now"] += len(tokens) * 1e-3 + (0.05 if clock["evals"] % 2 else 0.0)
        return real_eval(tokens, logits_at)

    monkeypatch.setattr(backend, "eval", eval_)
    monkeypatch.setattr("specchat.costs.time.perf_counter", lambda: clock["now"])
    model = CostModel.measure(backend, budget=60.0)
    assert CALIBRATION_REPS >= 2
    assert model.sizes == list(CALIBRATION_SIZES)
    assert model.seconds == pytest.approx([n * 1e-3 for n in model.sizes])


def test_a_calibration_timed_the_old_way_is_measured_again(tmp_path):
    """Entries an older specchat timed once per big size (no "version") are timed again."""
    backend = FakeBackend(lambda ctx: np.zeros(8, dtype=np.float32), 8, name="fake-model")
    cache = tmp_path / "costs.json"
    cached_cost_model(backend, cache)
    table = json.loads(cache.read_text())
    entry = table[cost_cache_key(backend)]
    evaluated = backend.evaluated
    cached_cost_model(backend, cache)
    assert backend.evaluated == evaluated  # today's entry: read, not measured
    del entry["version"]
    cache.write_text(json.dumps(table))
    cached_cost_model(backend, cache)
    assert backend.evaluated > evaluated
    assert "version" in json.loads(cache.read_text())[cost_cache_key(backend)]



def test_a_measured_cost_model_sends_only_the_sizes_it_timed():
    """On a CPU a batch of 16 can cost less than one of 15 or 17 (whole tiles of rows): with the costs
    known only at the timed sizes, best_length never picks a batch in between."""
    sizes = [1, 2, 3, 4, 8, 12, 16, 20, 24, 32]
    seconds = [0.011, 0.022, 0.028, 0.031, 0.038, 0.052, 0.056, 0.067, 0.090, 0.095]
    timed = CostModel(sizes, seconds, measured=True)
    curve = CostModel(sizes, seconds)
    rng = np.random.default_rng(3)
    for _ in range(200):
        a = rng.uniform(0.5, 1.0, size=int(rng.integers(1, 40)))
        n, rate = best_length(a, timed)
        assert n == 0 or n + 1 in sizes
        best = max((1 + np.cumprod(a)[:m].sum()) / timed(m + 1) for m in range(len(a) + 1) if m + 1 in sizes)
        assert rate >= best / 1.01 - 1e-12 or n == 0
    # a long copied span: the curve's optimum falls between timed sizes, the timed model's on one
    a = np.full(20, 0.98)
    assert best_length(a, timed)[0] + 1 in sizes
    assert timed.sendable(40).tolist() == [n in sizes for n in range(41)]
    assert curve.sendable(40).all()


def test_engine_with_adaptive_policy_stays_lossless_and_records_draft_lengths():
    """Copy-heavy text through the real engine: the policy changes k, never the tokens."""
    vocab = 32
    wanted = [5, 6, 7, 8, 9, 10, 11, 12] * 6
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 9, 10, 11, 12]
    logits = script_logits(vocab, len(prompt), wanted)
    target = FakeBackend(logits, vocab, n_ctx=512)
    reference = FakeBackend(logits, vocab, n_ctx=512)
    lookup = PromptLookup(1, 4)
    policy = AdaptivePolicy(lookup, GPU, draft_max=8)
    greedy = SamplingParams(temperature=0.0)
    events = list(generate(target, lookup, prompt, greedy, max_tokens=40, policy=policy))
    plain = list(generate(reference, None, prompt, greedy, max_tokens=40))
    finished, baseline = events[-1], plain[-1]
    assert isinstance(finished, Finished) and isinstance(baseline, Finished)
    assert finished.token_ids == baseline.token_ids == wanted[:40]
    stats = finished.stats
    assert sum(stats.draft_lengths.values()) == stats.steps
    assert stats.steps < baseline.stats.steps  # drafting happened and paid in steps
    assert max(stats.draft_lengths) <= 8


def test_per_step_overhead_favours_longer_drafts():
    a = np.full(16, 0.85)
    n_plain, _ = best_length(a, CPU)
    n_overhead, _ = best_length(a, CPU, overhead=0.02)  # e.g. a slow terminal drawing every token
    assert n_overhead > n_plain


def test_policy_measures_overhead_outside_draft_and_verify():
    import time as _time

    policy = AdaptivePolicy(PromptLookup(), CPU, draft_max=8)
    for _ in range(30):
        policy.observe(step(0, 0, verify=0.0), [1])
        _time.sleep(0.004)  # the consumer's time between steps
    assert 0.002 < policy.overhead < 0.02


def test_useless_draft_model_is_not_even_prefilled():
    """Self-pair on a CPU: drafting cannot pay even at 100% acceptance, so the draft never sees the prompt."""
    from fakes import make_draft_model

    vocab = 16
    logits = script_logits(vocab, 4, [5, 6, 7, 8, 9])
    target = FakeBackend(logits, vocab)
    drafter, draft_backend = make_draft_model(logits, vocab)
    policy = AdaptivePolicy(drafter, CPU, draft_max=8, draft_costs=[CostModel([1, 2], [0.015, 0.025])])
    assert not policy.drafting_possible
    events = list(generate(target, drafter, [1, 2, 3, 4], SamplingParams(temperature=0.0), max_tokens=5, policy=policy))
    assert events[-1].token_ids == [5, 6, 7, 8, 9]
    assert draft_backend.evaluated == 0
    cheap = AdaptivePolicy(drafter, GPU, draft_max=8, draft_costs=[CostModel([1, 2], [0.001, 0.002])])
    assert cheap.drafting_possible


# -- why nothing was drafted; --reproducible ------------------------------------------------------------

def linear() -> CostModel:
    """Verifying costs as much per token as decoding: no draft can ever pay."""
    return CostModel([1, 2, 4, 8, 16], [0.02, 0.04, 0.08, 0.16, 0.32])


def _lookup_run(cost: CostModel, n=40) -> tuple[Finished, AdaptivePolicy]:
    """A target that repeats 'abcd' after a prompt that already holds it: lookup always has a match."""
    wanted = [0, 1, 2, 3] * 20
    target = FakeBackend(script_logits(8, 8, wanted), 8)
    lookup = PromptLookup(1, 8)
    policy = AdaptivePolicy(lookup, cost, draft_max=16, learn_costs=False)
    events = list(generate(target, lookup, [0, 1, 2, 3, 0, 1, 2, 3], SamplingParams(temperature=0),
                           max_tokens=n, policy=policy))
    return [e for e in events if isinstance(e, Finished)][0], policy


def test_a_policy_that_declines_says_why_in_a_few_words():
    finished, declined = _lookup_run(linear())
    assert finished.stats.drafted == 0
    assert declined.last_note == ("draft off: lookup's proposals were too short to pay for a 4-token verify that "
                                  "costs 4.0 steps here")
    finished, drafting = _lookup_run(CostModel([1, 2, 4, 8, 16], [0.020, 0.0202, 0.0205, 0.021, 0.022]))
    assert finished.stats.drafted > 0 and drafting.last_note is None
    model, _ = modelled(linear(), CostModel([1], [0.02]))
    assert not model.drafting_possible
    model.observe(step(0, 0, 0.02), [1])  # one plain step, at the cost model's own pace
    model.finish()
    assert model.last_note.startswith("draft off: a scripted drafter token costs 1.00 steps and a 2-token verify "
                                      "2.0 steps here")
    from specchat import ui
    from specchat.stats import RunStats

    line = ui.summary_line(RunStats(steps=1, emitted=1), "length", "prompt-lookup", declined.last_note).plain
    assert line.splitlines()[1] == declined.last_note


def test_reproducible_policy_never_reads_the_clock_or_the_store(tmp_path, monkeypatch):
    """--reproducible: the same tokens give the same draft lengths whatever the timings and whatever
    earlier runs learned, and nothing is measured, read or written."""
    from types import SimpleNamespace

    import specchat.loader as loader_module
    import specchat.policy as policy_module

    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda *a, **k: pytest.fail("measured")))
    clock = iter(np.random.default_rng(0).uniform(0, 100, 100_000).cumsum())
    monkeypatch.setattr(policy_module.time, "perf_counter", lambda: next(clock))  # a wildly noisy machine

    def plans():
        target = FakeBackend(script_logits(8, 8, [0, 1, 2, 3] * 20), 8)
        loaded = SimpleNamespace(drafter=PromptLookup(1, 8), target=target, drafter_label="prompt-lookup")
        policy = loader_module.make_policy(loaded, 16, None, reproducible=True)
        events = list(generate(target, loaded.drafter, [0, 1, 2, 3, 0, 1, 2, 3], SamplingParams(temperature=0),
                               max_tokens=60, policy=policy))
        return [e.stats.drafted for e in events if hasattr(e, "totals")]

    first = plans()
    assert sum(first) > 0  # the adaptive policy drafts
    assert plans() == first and plans() == first
    assert not any(tmp_path.rglob("*.json"))  # no costs, no acceptance store


def test_a_batch_is_never_priced_below_one_token():
    """A cheap calibration of 2 tokens against dear one-token observations (a busy machine) must not make a
    one-token draft look cheaper than none: with acceptance near 0 nothing is sent."""
    model = CostModel([1, 2, 4, 8], [0.006, 0.0045, 0.008, 0.013], measured=True)
    assert model(2) >= model(1) and model.seconds_list(8)[2] >= model.seconds_list(8)[1]
    assert all(model.costs(8)[2:] >= model.costs(8)[1])
    model.batch = 0.5  # a batch factor learned low
    assert model(4) >= model(1) and min(model.seconds_list(8)[2:]) >= model.seconds_list(8)[1]
    drafting = [0.0003 * n for n in range(9)]  # a draft model at 5% of a target token
    assert best_length([0.04] * 8, model, drafting)[0] == 0


def test_a_draft_models_estimates_are_conditional_on_the_drafts_before_them():
    """Each draft is kept with probability 0.8 given the ones before it were: the estimate at every position
    is 0.8, not the 0.8**(i+1) of counting the drafts after a rejection as tried (which best_length would
    multiply again, pricing long drafts far below what they earn)."""
    rng = np.random.default_rng(3)
    acceptance = Acceptance(prior_hits=1.0, prior_tries=2.0, decay=1.0)
    for _ in range(4000):
        accepted = 0
        while accepted < 8 and rng.random() < 0.8:
            accepted += 1
        acceptance.record(accepted, 8)
    assert acceptance.rates(8) == pytest.approx([0.8] * 8, abs=0.03)
    assert acceptance.tries[7] < acceptance.tries[0] / 3  # the 8th draft is reached in 0.8**7 = 21% of steps
    assert best_length(acceptance.rates(8), GPU)[0] == 8  # nearly free verification: the whole draft


def test_a_position_seldom_reached_leans_on_the_one_before_it_not_on_the_prior():
    """Drafts of 2 kept at 97%, now and then one of 3: the third position's few tries must not read as the
    prior's 2/3 (the drafts would then never grow past 2), and a position never reached reads its
    neighbour's estimate. Enough evidence still moves a position off its neighbour."""
    acceptance = Acceptance(prior_hits=2.0, prior_tries=3.0)
    for step in range(200):
        acceptance.record(*((3, 3) if step % 50 == 0 else (2, 2)))
    rates = acceptance.rates(8)
    assert rates[0] > 0.95 and rates[1] > 0.95
    assert rates[2] > 0.9 and rates[3] == pytest.approx(rates[2]) and rates[7] == pytest.approx(rates[2])
    for _ in range(100):
        acceptance.record(2, 3)  # the third is now wrong every time
    assert acceptance.rates(8)[2] < 0.1 and acceptance.rates(8)[1] > 0.95


def test_a_draft_after_idle_steps_teaches_no_cost_and_one_after_a_draft_does():
    """A draft after idle steps also caught the drafter up on every token since its last one: taken for the
    draft's price, each probe after PROBE_AFTER idle steps made the drafter dearer, and it was never asked."""
    draft_cost = CostModel([1, 2], [0.002, 0.004])
    policy, drafter = modelled(GPU, draft_cost)
    member = policy.members[0]
    member.idle = PROBE_AFTER  # a probe
    assert sent(policy, drafter, limit=2) > 0
    policy.observe(step(2, 1, verify=0.02, draft=0.04), [1, 2])  # 10x the calibration: the catch-up
    assert draft_cost.scale == 1.0 and member.idle == 0
    assert sent(policy, drafter, limit=2) > 0
    policy.observe(step(2, 1, verify=0.02, draft=0.008), [1, 2])  # 2x: the drafter's own pace
    assert draft_cost.scale == pytest.approx(0.9 + 0.1 * 2.0)


def test_a_draft_is_priced_and_timed_by_the_forwards_its_drafter_reports():
    """The policy knows no kind of drafter: what a draft costs is what the drafter says it runs of its own
    model (here two forwards of the draft plus one slot, as a drafter of trees might), and a timed draft
    teaches the cost of one such forward."""
    from specchat.drafters import Forwards
    from specchat.policy import Member

    class TwoPasses(ScriptedDrafter):
        def forwards(self, drafted, asked):
            return Forwards(2, asked + 1) if asked else Forwards(0, 0)

    cost = CostModel([1, 2, 4, 8], [0.010, 0.012, 0.016, 0.024])
    member = Member(TwoPasses(), cost)
    assert not member.free
    assert member.draft_seconds(3) == pytest.approx([0.0, 2 * cost(2), 2 * cost(3), 2 * cost(4)])
    before = cost(4)
    member.learn_cost(2, 4 * before, Draft(tokens=[1, 2], planned=3))  # two forwards of 4, each twice the price
    assert cost(4) > before
    assert Member(ScriptedDrafter(), cost).draft_seconds(3) == pytest.approx([n * cost(1) for n in range(4)])
