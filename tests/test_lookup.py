"""Prompt lookup as evidence: longest matches up to 32+, earlier replies as a source, estimates kept
across processes, and the hybrid drafter (lookup or the draft model, chosen per step)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specchat.lookup import (

    CANDIDATES,

    HISTORY_LEAD,

    HISTORY_MIN,

    ORDER,

    FrozenNgramIndex,

    NgramHistory,

    NgramIndex,

    PromptLookup,

    find_match,

)

from specchat.drafters import Chain, Draft, own_backends
from specchat.engine import generate
from specchat.history import earlier_replies, reply_history, save_replies
from specchat.costs import CALIBRATION_SIZES, CostModel
from specchat.lookup import (
    FRESH_FIRST,
    FRESH_TRUSTED,
    HISTORY_FIRST,
    LOOKUP_BUCKETS,
    LOOKUP_MARGIN,
    LookupAcceptance,
    _bucket,
    agreement,
)
from specchat.policy import AcceptanceStore, AdaptivePolicy, FixedPolicy, best_length
from specchat.sampling import SamplingParams
from specchat.stats import StepStats

from fakes import (
    ALPHA, Alternating, FakeBackend, ScriptedDrafter, SetLookup, chi2_pvalue, detection_power, first_two_emitted, found,
    make_draft_model, markov_logits, sent,
)

CPU = CostModel([1, 2, 4, 8, 16, 32, 64], [0.015, 0.025, 0.038, 0.069, 0.101, 0.19, 0.37])
GPU = CostModel([1, 2, 4, 8, 16, 32, 64], [0.020, 0.0202, 0.0205, 0.021, 0.022, 0.024, 0.028])
GREEDY = SamplingParams(temperature=0.0)


def step(drafted, accepted, source="prompt-lookup"):
    return StepStats(step=0, drafted=drafted, accepted=accepted, emitted=accepted + 1, draft_seconds=0.0,
                     verify_seconds=0.0, source=source)


# -- lookup on hand-made token streams -------------------------------------------------------------------


def test_longest_match_beats_a_later_shorter_one():
    span = list(range(100, 124))  # 24 tokens
    context = [1, *span, 7, 8, 9, 2, span[-1], 50, 51, 3, *span]
    # span[-1] also occurs later (followed by 50) but only as a 1-gram: the 24-token match wins
    tokens, length = PromptLookup(1, 32).find(context, 5)
    assert length == 24 and tokens == [7, 8, 9, 2, span[-1]]
    # capped at 4 (the old default) the same stream cannot tell it from a short match
    assert PromptLookup(1, 4).find(context, 5)[1] == 4


def _brute_force_match(hay, n_hay, ids, max_len, usable=None):
    """Every position p < n_hay, its trailing match with ids counted one token at a time."""
    best = (-1, 0)
    for p in range(n_hay):
        if usable is not None and not usable[p]:
            continue
        length = 0
        while length < min(max_len, len(ids), p + 1) and hay[p - length] == ids[len(ids) - 1 - length]:
            length += 1
        if length and length >= best[1]:
            best = (p, length)  # the latest among equals
    return best


def _compared(index, gram_of, before):
    """How many earlier occurrences (ending before `before`, with a token after them) the n-gram has."""
    return sum(1 for p in index.latest(gram_of) if p < before and index.ids[p + 1] >= 0)


def test_index_match_is_the_brute_force_answer_on_repetitive_streams():
    """Exact whenever the tail's n-gram has at most CANDIDATES earlier occurrences; beyond that (a stream
    of a few symbols) the match found is still a real one, among the latest occurrences."""
    rng = np.random.default_rng(7)
    exact = 0
    for _ in range(400):
        vocab = int(rng.integers(2, 8))
        base = rng.integers(0, vocab, int(rng.integers(1, 20)))
        ids = np.concatenate([base] * int(rng.integers(1, 5)) + [rng.integers(0, vocab, 30)])[: int(rng.integers(2, 120))]
        hay = rng.integers(-1, vocab, int(rng.integers(1, 150)))  # an earlier-replies stream, -1 separators
        usable = np.append(hay[1:] >= 0, False)
        cases = [(NgramIndex(ids.tolist()), ids, max_len, None) for max_len in (1, 3, 32)]
        cases.append((FrozenNgramIndex(hay), ids, 32, usable))
        for index, tail, max_len, mask in cases:
            n_hay = len(index.ids) - 1
            match = find_match(index, tail.tolist(), n_hay, max_len)
            best = _brute_force_match(np.asarray(index.ids), n_hay, tail, max_len, mask)
            if best[1] == 0:
                assert match.length == 0
                continue
            order = min(ORDER, best[1])
            if _compared(index, tail[-order:].tolist(), n_hay) <= CANDIDATES:
                assert (match.end, match.length) == best
                exact += 1
            else:
                assert 0 < match.length <= best[1]
                assert index.ids[match.end - match.length + 1 : match.end + 1] == tail[-match.length:].tolist()
            assert 1 <= match.agree <= match.seen <= CANDIDATES
    assert exact > 500  # most cases are compared exactly


def test_index_follows_a_context_that_grows_and_is_rewritten():
    index = NgramIndex()
    ends = lambda index, gram: list(index.latest(gram))  # noqa: E731
    index.follow([1, 2, 3, 1, 2])
    assert ends(index, [1, 2]) == [4, 1]
    index.follow([1, 2, 3, 1, 2, 9, 1, 2])  # grows
    assert ends(index, [1, 2]) == [7, 4, 1] and ends(index, [2, 9]) == [5]
    index.follow([1, 2, 3, 7, 1, 2])  # rewritten from position 3 (a regenerated reply)
    assert index.ids == [1, 2, 3, 7, 1, 2]
    assert ends(index, [1, 2]) == [5, 1] and ends(index, [2, 9]) == [] and ends(index, [3, 7]) == [3]
    fresh = NgramIndex([1, 2, 3, 7, 1, 2])
    grams = [[1], [2], [1, 2], [7, 1, 2], [3, 7, 1, 2], [2, 3, 7, 1]]
    assert all(ends(index, g) == ends(fresh, g) for g in grams)


def test_among_equal_matches_the_latest_wins():
    context = [5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6]
    assert PromptLookup(1, 32).find(context, 1) == ([3], 2)


def test_match_is_capped_at_max_ngram_and_reaches_32():
    span = list(range(200, 240))  # 40 tokens
    context = [*span, 9, *span]
    tokens, length = PromptLookup(1, 32).find(context, 3)
    assert length == 32 and tokens == [9, *span[:2]]
    assert find_match(NgramIndex(context), context, len(context) - 1, 64).length == 40


def test_matches_across_turns_of_a_conversation():
    # turn 1's reply is quoted again in turn 2: the context holds both turns, the match spans the boundary
    turn1 = [10, 11, 12, 13, 14, 15, 16, 17]
    turn2_user = [90, 91, 12, 13, 14]
    tokens, length = PromptLookup(1, 32).find([1, *turn1, 2, *turn2_user], 4)
    assert length == 3 and tokens == [15, 16, 17, 2]


def test_history_match_wins_only_when_longer_by_a_lead_and_stops_at_the_reply_end():
    assert HISTORY_LEAD == 4 and HISTORY_MIN == 8
    history = NgramHistory([list(range(30, 45)), [60, 61, 62]])
    lookup = PromptLookup(1, 32, history=history)
    # the context has a 1-token match for 42; the history a 9-token one (34..42): more than 4 longer, it wins
    tokens, length = lookup.find([42, 99, 34, 35, 36, 37, 38, 39, 40, 41, 42], 8)
    assert (tokens, length) == ([43, 44], 9) and lookup.last_from_history  # cut at the end of the reply
    # a 7-token one (36..42) is long enough to win over the context's 1-token match, but not to be followed
    # at all: the context's own continuation stays
    tokens, length = lookup.find([42, 99, 36, 37, 38, 39, 40, 41, 42], 8)
    assert length == 1 and tokens[0] == 99 and not lookup.last_from_history
    # as long in the context: the context wins (it is this conversation)
    tokens, length = lookup.find([61, 62, 7, 61, 62], 4)
    assert (tokens, length) == ([7, 61, 62, 7], 2) and not lookup.last_from_history  # around the loop
    # nothing in the context: a history match of HISTORY_MIN tokens is used (35..42: 8 tokens) ...
    draft = lookup.propose([1, 35, 36, 37, 38, 39, 40, 41, 42], 4, GREEDY, np.random.default_rng(0))
    assert draft.source == "history" and draft.tokens == [43, 44] and draft.evidence.match_len == 8
    # ... a shorter one is not (36..42: 7 tokens; 40, 41, 42: 3): it is a common phrase, not a copy
    for context in ([1, 36, 37, 38, 39, 40, 41, 42], [1, 40, 41, 42]):
        assert lookup.find(context, 4) == ([], 0) and not lookup.last_from_history
    # the separator never matches, so a reply's first token cannot continue the one before it
    assert history.find([44], 4, 32)[0] == []


def test_history_keeps_the_latest_tokens():
    history = NgramHistory([[1] * 10, [2] * 10, [3] * 10], max_tokens=15)
    assert 1 not in history.ids and 3 in history.ids and len(history) <= 17


def test_replies_saved_by_a_report_and_transcripts_feed_the_history(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    transcripts = tmp_path / "share" / "transcripts"
    transcripts.mkdir(parents=True)
    (transcripts / "a.jsonl").write_text(
        json.dumps({"role": "user", "content": "hi"}) + "\n"
        + "not json\n" + json.dumps({"role": "assistant", "content": 5}) + "\n"  # skipped, not fatal
        + json.dumps({"role": "assistant", "content": "abcab"}) + "\n", encoding="utf-8")
    assert save_replies(["qrstuvwxyz", ""], target="t") is not None
    assert sorted(earlier_replies()) == ["abcab", "qrstuvwxyz"]
    target = FakeBackend(lambda ctx: np.zeros(26), 26)  # one letter per token
    history = reply_history(target)
    lookup = PromptLookup(1, 32, history=history)
    # "qrstuvwx" (HISTORY_MIN tokens) -> the saved report reply "qrstuvwxyz" goes on with "yz", where it ends
    assert lookup.find(target.tokenize("qrstuvwx", add_special=False), 3) == (target.tokenize("yz", add_special=False), 8)


def test_no_history_files_means_no_history(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    assert reply_history(FakeBackend(lambda ctx: np.zeros(4), 4)) is None


# -- the policy reads match length ------------------------------------------------------------------------


def match_bucket(length: int) -> int:
    return LOOKUP_BUCKETS[_bucket(length)]


def test_match_buckets():
    assert [match_bucket(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 23, 24, 31, 32, 90)] == \
        [1, 1, 2, 3, 4, 4, 6, 6, 8, 8, 12, 12, 16, 16, 24, 24, 32, 32]


def test_draft_position_i_of_an_m_token_match_continues_an_m_plus_i_match():
    acc = LookupAcceptance()
    for _ in range(50):
        acc.after_miss = False
        acc.add(2, False)  # 2-token matches inside a span: wrong
        acc.after_miss = False
        acc.add(30, True)  # 24-31: right
    acc.after_miss = False
    rates = acc.rates(2, 30)
    assert rates[0] < 0.1  # position 0 continues the 2-token match
    assert rates[28] > 0.9  # position 28 continues a 30-token one
    # a verified step: drafts 0..2 accepted, draft 3 rejected, draft 4+ never reached
    acc = LookupAcceptance()
    acc.record(8, accepted=3, tried=6)
    assert acc.tries[0].sum() == pytest.approx(4, rel=0.1) and acc.hits[0].sum() == pytest.approx(3, rel=0.1)
    # the first was a fresh match (the run's first lookup); the next three followed a correct token
    assert acc.tries[0, acc.FRESH].sum() == pytest.approx(1) and acc.tries[0, acc.IN_SPAN].sum() == pytest.approx(3, rel=0.1)
    assert acc.after_miss  # the last one checked was wrong


def test_a_fresh_short_match_does_not_borrow_the_record_of_copied_spans():
    acc = LookupAcceptance()
    for _ in range(30):
        acc.after_miss = False
        for m in range(4, 12):
            acc.add(m, True)  # inside spans: always right
        acc.add(12, False)  # the span ends
        acc.add(4, False)  # a fresh 4-token match right after: wrong
    acc.after_miss = True
    assert acc.rates(4, 1)[0] < 0.2
    acc.after_miss = False
    assert acc.rates(4, 1)[0] > 0.8


def test_long_matches_learn_long_drafts_short_ones_do_not():
    lookup = SetLookup()
    policy = AdaptivePolicy(lookup, GPU, draft_max=64)
    long_tokens, short_tokens = list(range(64)), list(range(64))
    for _ in range(30):
        n = sent(policy, lookup, found(long_tokens, 24), limit=64)
        policy.observe(step(n, n), long_tokens[: n + 1])  # long matches: all accepted
        n = sent(policy, lookup, found(short_tokens, 1), limit=64)
        policy.observe(step(n, min(n, 1)), short_tokens[:2])  # 1-grams: one token at most
    assert sent(policy, lookup, found(long_tokens, 24), limit=64) >= 32
    assert sent(policy, lookup, found(short_tokens, 1), limit=64) <= 4


# -- estimates kept across processes ---------------------------------------------------------------------


def trained_policy(store, match_len=20):
    lookup = SetLookup()
    policy = AdaptivePolicy(lookup, CPU, draft_max=64, stores=[store])
    tokens = list(range(64))
    for _ in range(40):
        n = sent(policy, lookup, found(tokens, match_len), limit=64)
        policy.observe(step(n, n), tokens[: n + 1])
    return policy, lookup


def model_policy(store=None) -> tuple[AdaptivePolicy, ScriptedDrafter]:
    model = ScriptedDrafter(fallback=lambda context, k: list(range(1, k + 1)))
    return AdaptivePolicy(model, GPU, draft_max=8, draft_costs=[CostModel([1, 2], [0.001, 0.002])], stores=[store]), model


def trained_model_policy(store, accepted: int, rounds: int = 40):
    """A draft-model policy whose drafts of 8 were accepted `accepted` tokens deep, `rounds` times."""
    policy, model = model_policy(store)
    for _ in range(rounds):
        assert sent(policy, model, limit=8) > 0  # it drafts (the prior and what it saw say so)
        policy.observe(step(8, accepted, source="draft-model"), [])
    return policy, model


def test_a_fresh_process_starts_from_what_earlier_runs_learned_of_a_draft_model(tmp_path):
    path = tmp_path / "acceptance.json"
    _, cold = model_policy()
    policy, _ = trained_model_policy(AcceptanceStore(path, "target|draft"), accepted=8)
    policy.finish()
    _, warm = model_policy(AcceptanceStore(path, "target|draft"))
    assert (warm.acceptance.rates(8) > cold.acceptance.rates(8)).all()
    # discounted: at most TRUST observations per position carry over
    assert 0 < warm.acceptance.tries.max() <= AcceptanceStore.TRUST + 1e-9
    # another target or drafter does not see them
    _, other = model_policy(AcceptanceStore(path, "other|draft"))
    assert other.acceptance.tries.sum() == 0


def test_a_draft_models_saved_estimates_are_not_trusted_blindly(tmp_path):
    path = tmp_path / "acceptance.json"
    trained_model_policy(AcceptanceStore(path, "k"), accepted=8)[0].finish()
    _, warm = trained_model_policy(AcceptanceStore(path, "k"), accepted=0, rounds=0)
    assert warm.acceptance.rates(1)[0] > 0.75
    # this conversation is different: the model's first token is now rejected every time
    _, model = trained_model_policy(AcceptanceStore(path, "k"), accepted=0, rounds=6)
    assert model.acceptance.rates(1)[0] < 0.4


def test_lookup_estimates_belong_to_one_conversation(tmp_path):
    """What lookup learned on other prompts is not carried into the next process: replayed on unseen
    prompts, it never made runs faster than the measured priors (AdaptivePolicy.CARRIED). Within one
    process (a chat's turns) the policy keeps what it learned."""
    path = tmp_path / "acceptance.json"
    tokens = list(range(64))
    fresh = SetLookup()
    cold = sent(AdaptivePolicy(fresh, CPU, draft_max=64), fresh, found(tokens, 4), limit=64)
    trained, lookup = trained_policy(AcceptanceStore(path, "target|prompt-lookup"), match_len=4)
    assert sent(trained, lookup, found(tokens, 4), limit=64) > cold  # this conversation's evidence counts
    trained.finish()
    assert not path.exists()  # lookup keeps nothing: no file written
    again = SetLookup()
    warm = AdaptivePolicy(again, CPU, draft_max=64, stores=[AcceptanceStore(path, "target|prompt-lookup")])
    assert again.acceptance.tries.sum() == 0
    assert sent(warm, again, found(tokens, 4), limit=64) == cold
    # in a chain, the model keeps its estimates and lookup keeps none
    chained, model = SetLookup(), ScriptedDrafter()
    chain = AdaptivePolicy(Chain([chained, model]), CPU, draft_max=64,
                           draft_costs=[None, CostModel([1, 2], [0.001, 0.002])],
                           stores=[AcceptanceStore(path, "target|lookup"), AcceptanceStore(path, "target|model")])
    chained.acceptance.record(4, 3, 4)
    model.acceptance.record(2, 3)
    chain.finish()
    assert AcceptanceStore(path, "target|lookup").load() == {}
    assert "model" in AcceptanceStore(path, "target|model").load()


def _table(first: int) -> bytes:
    row = [[[0] * 10, [0] * 10], [[0] * 10, [0] * 10]]
    row[0][0][0] = first
    return json.dumps(row).encode()


HITS_BAD, HITS_NEG, TRIES_ONE = _table(5), _table(-1), _table(1)  # more hits than tries; a negative count


@pytest.mark.parametrize("content", [
    b"\x00\xff garbage",
    b"[1, 2, 3]",
    b'{"version": 99, "entries": {}}',
    b'{"version": 1, "entries": {"k": {"tables": {"16,1,0": {"hits": [1, 0, 0, 0, 0, 0, 0, 0], "tries": [1, 0, 0, 0, 0, 0, 0, 0]}}}}}',
    b'{"version": 2, "entries": []}',
    b'{"version": 2, "entries": {"k": {"tables": {"lookup": {"hits": [1, 2], "tries": [1, 2]}}}}}',
    b'{"version": 3, "entries": {"k": {"tables": {"lookup": {"hits": [[5, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], "tries": [[1, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]}}}}}',
    b'{"version": 3, "entries": {"k": {"tables": {"lookup": {"hits": ' + HITS_BAD + b', "tries": ' + TRIES_ONE + b'}}}}}',
    b'{"version": 3, "entries": {"k": {"tables": {"lookup": {"hits": ' + HITS_NEG + b', "tries": ' + TRIES_ONE + b'}}}}}',
    b'{"version": 3, "entries": {"k": {"tables": {"lookup": "x", "model": {"hits": "NaN"}}}}}',
    b'{"version": 3, "entries": {"k": "not a table"}}',
    b'{"version": 1, "entries": {"k": {"tables": {"16,1,0": {"hits": [1, 2], "tries": [1, 2]}}}}}',
    b'{"version": 1, "entries": {"k": {"tables": {"16,1,0": {"hits": [5, 0, 0, 0, 0, 0, 0, 0], "tries": [1, 0, 0, 0, 0, 0, 0, 0]}}}}}',
    b'{"version": 1, "entries": {"k": {"tables": {"16,1,0": {"hits": [-1, 0, 0, 0, 0, 0, 0, 0], "tries": [1, 0, 0, 0, 0, 0, 0, 0]}}}}}',
    b'{"version": 1, "entries": {"k": {"tables": {"banana": {}, "99,1,0": {"hits": [0], "tries": [0]}, "model": "x"}}}}',
    b'{"version": 1, "entries": {"k": {"tables": {"16,1,0": {"hits": ["NaN", 0, 0, 0, 0, 0, 0, 0], "tries": [1, 0, 0, 0, 0, 0, 0, 0]}}}}}',
    # today's version, malformed draft-model tables: more hits than tries, a negative count, NaN, wrong shape
    b'{"version": 6, "entries": {"k": {"tables": {"model": {"hits": [5, 0, 0, 0, 0, 0, 0, 0], "tries": [1, 0, 0, 0, 0, 0, 0, 0]}}}}}',
    b'{"version": 6, "entries": {"k": {"tables": {"model": {"hits": [-1, 0, 0, 0, 0, 0, 0, 0], "tries": [1, 0, 0, 0, 0, 0, 0, 0]}}}}}',
    b'{"version": 6, "entries": {"k": {"tables": {"model": {"hits": ["NaN", 0, 0, 0, 0, 0, 0, 0], "tries": [1, 0, 0, 0, 0, 0, 0, 0]}}}}}',
    b'{"version": 6, "entries": {"k": {"tables": {"model": {"hits": [1, 2], "tries": [1, 2]}}}}}',
    b'{"version": 6, "entries": {"k": {"tables": "x"}}}',
])
def test_a_corrupt_or_foreign_cache_file_is_ignored_and_replaced(tmp_path, content):
    path = tmp_path / "acceptance.json"
    path.write_bytes(content)
    _, model = trained_model_policy(AcceptanceStore(path, "k"), accepted=3, rounds=0)
    assert model.acceptance.tries.sum() == 0  # nothing malformed was taken in
    policy, _ = trained_model_policy(AcceptanceStore(path, "k"), accepted=3, rounds=2)
    policy.finish()
    doc = json.loads(path.read_text())
    assert doc["version"] == AcceptanceStore.VERSION and "k" in doc["entries"]
    _, again = trained_model_policy(AcceptanceStore(path, "k"), accepted=3, rounds=0)
    assert again.acceptance.tries.sum() > 0


def test_an_unwritable_cache_is_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    store = AcceptanceStore(blocker / "acceptance.json", "k")  # its parent is a file
    policy, _ = trained_model_policy(store, accepted=3)
    policy.finish()  # no exception
    assert store.load() == {}


def test_engine_saves_estimates_when_a_generation_ends(tmp_path):
    path = tmp_path / "acceptance.json"
    wanted = [1, 2, 3, 4, 5, 6] * 6
    target = FakeBackend(lambda ctx: np.eye(8)[wanted[len(ctx) % len(wanted)]] * 9, 8)
    model, _ = make_draft_model(lambda ctx: np.eye(8)[wanted[len(ctx) % len(wanted)]] * 9, 8)
    # cost models of their own: the engine teaches them the fakes' microsecond timings, which must not reach GPU
    policy = AdaptivePolicy(model, CostModel(GPU.sizes, GPU.seconds), draft_max=4,
                            draft_costs=[CostModel([1, 2], [0.001, 0.002])], stores=[AcceptanceStore(path, "k")])
    for _ in generate(target, model, wanted[:12], GREEDY, max_tokens=20, policy=policy):
        pass
    saved = AcceptanceStore(path, "k").load()
    assert saved["model"]["tries"][0] > 0


# -- a chain of lookup and a draft model (llama.cpp: a draft model with --spec-type ngram-*) -----------------


def chain_policy(verify, draft_cost, model_hits=None):
    lookup, model = SetLookup(), ScriptedDrafter(fallback=lambda context, k: list(range(1, k + 1)))
    policy = AdaptivePolicy(Chain([lookup, model]), verify, draft_max=16, draft_costs=[None, draft_cost])
    if model_hits is not None:
        for _ in range(40):
            model.acceptance.record(int(8 * model_hits), 8)
    return policy, lookup, model


def chosen(policy, lookup, proposal: Draft):
    """(the drafter whose draft the policy sends, how many tokens), lookup having found `proposal`."""
    lookup.next = proposal
    draft = policy.draft(None, [1, 2, 3], 16, GREEDY, np.random.default_rng(0))
    return draft.drafter, len(draft.tokens)


def test_a_chain_chooses_lookup_on_a_long_match_even_where_the_model_is_cheap():
    policy, lookup, _ = chain_policy(GPU, CostModel([1, 2], [0.001, 0.002]), model_hits=0.9)
    for _ in range(20):  # long matches have been accepted
        lookup.acceptance.record(16, 8, 8)
    who, k = chosen(policy, lookup, found(range(16), 20))
    assert who is lookup and k >= 8


def test_a_chain_chooses_the_model_without_a_match():
    policy, lookup, model = chain_policy(GPU, CostModel([1, 2], [0.001, 0.002]), model_hits=0.8)
    who, k = chosen(policy, lookup, Draft())
    assert who is model and k > 0
    # a poor 1-token match loses to a good model too
    for _ in range(20):
        lookup.acceptance.record(1, 0, 4)
    assert chosen(policy, lookup, found(range(4), 1))[0] is model


def test_a_chain_drafts_nothing_when_neither_pays():
    # a CPU: verifying costs grow fast; a model half as costly as the target; short matches rejected
    policy, lookup, _ = chain_policy(CPU, CostModel([1, 2], [0.0075, 0.015]), model_hits=0.3)
    for _ in range(20):
        lookup.acceptance.record(1, 0, 4)
    assert chosen(policy, lookup, found(range(4), 1)) == (None, 0)
    assert chosen(policy, lookup, Draft()) == (None, 0)


MV = 6
_rs = np.random.default_rng(7)
TARGET = _rs.normal(0, 1.0, (MV, MV)) + 1.5 * np.eye(MV)
DRAFT = TARGET + _rs.normal(0, 0.8, (MV, MV))


def test_a_chain_through_the_engine_reports_both_sources():
    target = FakeBackend(markov_logits(TARGET), MV)
    model, _ = make_draft_model(markov_logits(DRAFT), MV)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    finished = None
    for event in generate(target, Chain([PromptLookup(1, 32), model]), [1, 2, 3, 1, 2], params, max_tokens=60,
                          policy=Alternating(3)):
        finished = event
    assert set(finished.stats.drafted_by) == {"prompt-lookup", "draft-model"}
    assert finished.stats.drafted == sum(finished.stats.drafted_by.values())


def first_two_counts(make_drafter, prompt, params, n, seed):
    rng = np.random.default_rng(seed)
    counts = np.zeros((MV, MV), dtype=np.int64)
    target = FakeBackend(markov_logits(TARGET), MV)
    drafter = make_drafter()
    for _ in range(n):
        target.truncate(0)
        for backend in own_backends(drafter):
            backend.truncate(0)
        got = first_two_emitted(generate(target, drafter, prompt, params, max_tokens=6, policy=Alternating(2), rng=rng))
        counts[got[0], got[1]] += 1
    return counts


def expected_first_two(prompt, params):
    from specchat.sampling import process

    fn = markov_logits(TARGET)
    p1 = np.asarray(process(np.asarray(fn(tuple(prompt))), params, prompt))
    joint = np.zeros((MV, MV))
    for a in range(MV):
        ctx = [*prompt, a]
        joint[a] = p1[a] * np.asarray(process(np.asarray(fn(tuple(ctx))), params, ctx))
    return joint


CHAIN_DRAWS = 20_000  # 36 joint cells: power >= 0.85 against a 3% error in one of them


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05, repeat_penalty=1.2),
])
def test_a_chain_of_lookup_and_a_model_is_lossless(params):
    """Lookup (one-hot q) on some steps, the sampled draft model on others, within one generation."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    def make():
        model, _ = make_draft_model(markov_logits(DRAFT), MV)
        return Chain([PromptLookup(1, 32), model])

    expected = expected_first_two(prompt, params)
    assert detection_power(CHAIN_DRAWS, expected, delta=0.03) >= 0.85
    counts = first_two_counts(make, prompt, params, CHAIN_DRAWS, seed=21)
    pvalue = chi2_pvalue(counts, expected)
    assert pvalue > ALPHA, f"p={pvalue:.2e}\n{counts / CHAIN_DRAWS}\n{expected}"


def test_the_chain_check_catches_a_lookup_treated_as_sampled():
    """Power: the same check fails when lookup's one-hot proposal is verified as if q were uniform."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    uniform = np.full(MV, 1.0 / MV)

    class WrongQ(PromptLookup):
        def propose(self, context, k, params, rng):
            draft = super().propose(context, k, params, rng)
            draft.q = [uniform] * len(draft.tokens)
            return draft

    def make():
        model, _ = make_draft_model(markov_logits(DRAFT), MV)
        return Chain([WrongQ(1, 32), model])

    counts = first_two_counts(make, prompt, params, 3_000, seed=22)
    assert chi2_pvalue(counts, expected_first_two(prompt, params)) < 1e-6


def test_a_fixed_length_chain_sends_lookups_match_first():
    model, _ = make_draft_model(markov_logits(DRAFT), MV)
    chain = Chain([PromptLookup(1, 32), model])
    draft = FixedPolicy(3).draft(chain, [1, 2, 3, 1, 2], 3, GREEDY, np.random.default_rng(0))
    assert draft.source == "prompt-lookup" and draft.tokens == [3, 1, 2]
    draft = FixedPolicy(3).draft(chain, [1, 2, 3, 4, 5], 3, GREEDY, np.random.default_rng(0))
    assert draft.source == "draft-model" and len(draft.tokens) == 3


# -- the pieces wired together ------------------------------------------------------------------------------


def test_selection_follows_the_pair_and_the_flag():
    from specchat.config import load_config
    from specchat.loader import select

    cfg = load_config()
    chain = ("prompt-lookup", "qwen2.5-coder-0.5b")
    assert select(cfg, pair="qwen-coder-hybrid", target=None, draft=None, no_spec=False).drafts == chain
    assert select(cfg, pair="qwen-coder-hybrid", target=None, draft=None, no_spec=False,
                  hybrid=False).drafts == chain[1:]
    assert select(cfg, pair="qwen-coder", target=None, draft=None, no_spec=False, hybrid=True).drafts == chain
    # -md prompt-lookup leaves nothing to fall back on; --no-spec leaves no drafter at all
    assert select(cfg, pair="qwen-coder-hybrid", target=None, draft="prompt-lookup", no_spec=False).drafts == chain[:1]
    assert select(cfg, pair="qwen-coder-hybrid", target=None, draft=None, no_spec=True).draft is None


@pytest.mark.real
def test_hybrid_pair_runs_and_says_which_source_drafted(measured_home):
    """SmolLM2 drafting for itself as a hybrid, on text that repeats: the label names both sources, the
    stats count drafted tokens per source, and the draft model's estimates (never lookup's) are saved for
    the next process."""
    from real_models import specchat

    text = "Repeat exactly, three times: the quick brown fox jumps over the lazy dog."
    args = ("prompt", text, "-m", "smollm2-135m", "-md", "smollm2-135m", "--hybrid", "--json", "--temp", "0", "-n", "48")
    result = specchat(*args, home=measured_home)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["drafter"] == "prompt-lookup + smollm2-135m"
    by = doc["stats"]["drafted_by"]
    assert sum(by.values()) == doc["stats"]["drafted"] and set(by) <= {"prompt-lookup", "draft-model", "history"}
    path = measured_home / ".cache" / "acceptance.json"
    entries = json.loads(path.read_text())["entries"] if path.exists() else {}
    assert not [e for e in entries.values() if "prompt-lookup" in e["label"]]  # lookup keeps nothing
    mine = [e for e in entries.values() if "draft-model smollm2-135m" in e["label"]]
    if by.get("draft-model"):  # the model drafted: what it showed is kept
        assert mine and "model" in mine[0]["tables"]
    else:
        assert not mine


def test_a_draft_from_earlier_replies_earns_its_length_in_this_conversation():
    """Estimates learned elsewhere say history drafts are always right; this run has not seen one yet:
    the first may send HISTORY_FIRST tokens, each taken whole doubles that, a miss brings it back."""
    lookup = SetLookup()
    policy = AdaptivePolicy(lookup, GPU, draft_max=64)
    for state in lookup.acceptance._table[1]:  # every history estimate near certain
        state[:] = [0.999] * len(state)
    tokens = list(range(64))
    n = sent(policy, lookup, found(tokens, 32, history=True), limit=64)
    assert n == HISTORY_FIRST
    lengths = [n]
    for _ in range(3):  # taken whole
        policy.observe(step(n, n, "history"), tokens[: n + 1])
        n = sent(policy, lookup, found(tokens, 32, history=True), limit=64)
        lengths.append(n)
    assert lengths == [HISTORY_FIRST, 2 * HISTORY_FIRST, 4 * HISTORY_FIRST, 8 * HISTORY_FIRST]
    policy.observe(step(n, 3, "history"), tokens[:3] + [999])  # a miss at the fourth
    assert sent(policy, lookup, found(tokens, 32, history=True), limit=64) == HISTORY_FIRST
    # the conversation's own text is not held back: the same evidence from the context sends more
    assert sent(policy, lookup, found(tokens, 32), limit=64) > HISTORY_FIRST


def test_a_continuation_that_held_each_time_is_trusted_more_than_a_fresh_match():
    lookup = PromptLookup(1, 32)
    loop = [7, 8, 9, 10, 11]
    draft = lookup.propose([1, 2, *loop, *loop, *loop, 3, 7], 8, GREEDY, np.random.default_rng(0))
    assert draft.tokens == [8, 9, 10, 11, 3, 7, 8, 9] and (draft.evidence.agree, draft.evidence.seen) == (3, 3)
    assert agreement(draft.evidence) == LookupAcceptance.AGREED
    once = lookup.propose([1, 2, *loop, 3, 7], 8, GREEDY, np.random.default_rng(0)).evidence
    assert (once.agree, once.seen) == (1, 1) and agreement(once) == LookupAcceptance.SINGLE
    split = lookup.propose([7, 8, 1, 7, 9, 2, 7], 8, GREEDY, np.random.default_rng(0)).evidence
    assert (split.agree, split.seen) == (1, 2)  # 7 went on with 9 and with 8
    assert agreement(split) == LookupAcceptance.CONTESTED
    acc = LookupAcceptance()
    fresh = acc.rates(1, 1)[0]
    acc.agreement = acc.AGREED
    assert acc.rates(1, 1)[0] > fresh
    acc.agreement = acc.CONTESTED
    assert acc.rates(1, 1)[0] < fresh
    for _ in range(10):  # repeated continuations that fail teach their own estimate, not the fresh one
        acc.agreement, acc.after_miss = acc.AGREED, True
        acc.add(1, False)
    assert acc.agreement == acc.SINGLE  # the agreement is about the proposal's first token only
    assert acc.rates(1, 1)[0] == pytest.approx(fresh)


def test_a_branch_holds_a_long_match_back_in_a_span():
    """Inside a copied span, a next token on which the n-gram's earlier occurrences disagree (a list whose
    items differ) is estimated apart from one they agree on, and taught apart."""
    acc = LookupAcceptance()
    acc.after_miss = False
    agreed = acc.rates(6, 1)[0]
    acc.agreement = acc.CONTESTED
    assert acc.rates(6, 1)[0] < agreed
    for _ in range(20):
        acc.after_miss, acc.agreement = False, acc.CONTESTED
        acc.add(6, False)
    acc.after_miss, acc.agreement = False, acc.SINGLE
    assert acc.rates(6, 1)[0] == pytest.approx(agreed)  # the plain in-span estimate learned nothing
    acc.agreement = acc.CONTESTED
    assert acc.rates(6, 1)[0] < 0.15


# gemma-3-270m on two CPU cores, as calibrated (ms): a batch of 48 costs the least per token
GEMMA = CostModel(list(CALIBRATION_SIZES), [s / 1000 for s in (10.5, 23.5, 31.1, 34.4, 50.1, 54.7, 59.4, 42.5, 61.5,
                                                               65.0, 75.6, 83.8, 96.5, 105.8, 122.3, 142.6, 169.9, 199.7)],
                  measured=True)


def test_a_lookup_draft_is_as_long_as_its_estimates_earn_and_no_longer():
    """The length of a lookup draft is the policy's best_length over lookup's estimates, with no rule on
    top: a stretch of long copies to the cheapest batch (SPAN_LONG / SPAN_FACTOR / SPAN_MAX) and a bar on
    short matches before the reply has copied (UNCOPIED_MIN) were tuned on the development prompts and
    lost on the held-out ones (docs/benchmarks.md "Tuning constants")."""
    tokens = list(range(64))
    for match_len, in_span, verify in ((13, True, GEMMA), (9, True, GEMMA), (13, False, GEMMA), (1, False, GPU)):
        lookup = SetLookup()
        policy = AdaptivePolicy(lookup, CostModel(verify.sizes, verify.seconds, measured=True), draft_max=64)
        lookup.acceptance.after_miss = not in_span
        capped = not in_span and match_len < FRESH_TRUSTED  # a short fresh match: FRESH_FIRST at most
        rates = lookup.acceptance.rates(match_len, FRESH_FIRST if capped else 64)
        expected = best_length(rates, verify, None, 0.0, LOOKUP_MARGIN)[0]
        assert sent(policy, lookup, found(tokens, match_len), limit=64) == expected
    # a fresh 1-token match in a reply that has copied nothing drafts where a GPU's costs make it pay
    assert expected > 0


def test_a_short_fresh_match_sends_a_few_tokens_however_good_its_record():
    """A fresh match shorter than FRESH_TRUSTED sends at most FRESH_FIRST tokens even where fresh matches have
    been coming true: one wrong 24-token draft costs seven plain steps on two CPU cores. Inside the span, or
    where the n-gram's earlier occurrences agreed, the estimates decide alone."""
    lookup = SetLookup()
    policy = AdaptivePolicy(lookup, CostModel(GEMMA.sizes, GEMMA.seconds, measured=True), draft_max=64)
    acc = lookup.acceptance
    for _ in range(60):  # fresh 4-token matches and what follows them: always right
        acc.after_miss = True
        for m in range(4, 40):
            acc.add(m, True)
    tokens = list(range(64))
    acc.after_miss = True
    assert sent(policy, lookup, found(tokens, 4), limit=64) == FRESH_FIRST
    acc.after_miss = False
    assert sent(policy, lookup, found(tokens, 4), limit=64) > FRESH_FIRST
    acc.after_miss = True
    loop = found(tokens, 4)
    loop.evidence.agree = loop.evidence.seen = 3
    assert sent(policy, lookup, loop, limit=64) > FRESH_FIRST  # a loop: trusted at once
    acc.after_miss = True
    assert sent(policy, lookup, found(tokens, FRESH_TRUSTED), limit=64) > FRESH_FIRST
    # a span followed in earlier replies says nothing about a match in the context: that one is fresh
    sent(policy, lookup, found(tokens, 4, history=True), limit=64)
    acc.after_miss = False  # the history's proposal came true
    assert sent(policy, lookup, found(tokens, 4), limit=64) == FRESH_FIRST
    assert acc.after_miss
