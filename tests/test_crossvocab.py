"""Cross-vocabulary drafting (crossvocab.py) on fakes with two genuinely different tokenizers over the
same text: the target's splits "abc" as "abc" and "cab" as "c" + "ab", the draft's as "a" "b" "c" and
"ca" + "b"; the draft has no "ab", "bc", "abc", the target no "ca", "cc", "ba".

Losslessness is checked by chi-square on the first and second emitted tokens (test_sampling.py's
method), with as many draws as catch a 3% error in one token's probability (power 0.9; `draws` below).
The rule itself (`sampling.verify`) carries the 1% claim in test_sampling.py; what these checks add is
the cross-vocabulary plumbing around it, whose bugs move a token's probability by far more: the
deliberately wrong variants below (TLI's q not renormalised over the shared vocabulary; a drafter that
changes a committed token) move one by 7-25%, and fail the same checks at the same number of draws.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from fakes import ALPHA, POWER, FakeBackend, chi2_pvalue, detection_power, first_two_emitted
from specchat import crossvocab
from specchat.crossvocab import CrossVocabDrafter, restrict_to_shared
from specchat.engine import Finished, generate
from specchat.policy import FixedPolicy
from specchat.sampling import Dist, SamplingParams, process

T_PIECES = [b"a", b"b", b"c", b"ab", b"bc", b"abc", b"<end>"]
D_PIECES = [b"a", b"b", b"c", b"ca", b"cc", b"ba", b"<end>"]
TV, DV = len(T_PIECES), len(D_PIECES)
END = 6  # end of generation in both (the same name, so it maps)
PROMPT_TEXT = "cab"

_rs = np.random.default_rng(2025)
# the target is a Markov chain over its own tokens and never ends (so two tokens always follow)
T_TABLE = _rs.normal(0, 0.6, (TV, TV))
T_TABLE[:, END] = -np.inf
# the draft: a Markov chain over its tokens, a rough guess of the target's text
D_TABLE = _rs.normal(0, 1.0, (DV, DV))
D_TABLE[:, END] = -1.0

SETTINGS = {
    "temp1": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "temp0.7-topk4": SamplingParams(temperature=0.7, top_k=4, top_p=1.0, min_p=0.0),
    "temp1.3-topp-minp": SamplingParams(temperature=1.3, top_k=0, top_p=0.85, min_p=0.05),
    "penalties": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5,
                                presence_penalty=0.5),
}


def target_fn(ctx):
    return T_TABLE[ctx[-1]]


def draft_fn(ctx):
    return D_TABLE[ctx[-1]]


def make_pair(rule="auto", cls=CrossVocabDrafter, **kw):
    target = FakeBackend(target_fn, TV, pieces=T_PIECES, eog=[END], name="target")
    draft = FakeBackend(draft_fn, DV, pieces=D_PIECES, eog=[END], name="draft", vocab_type=2)
    return target, cls(draft, target, rule=rule, **kw), draft


def prompt_ids(target):
    return target.tokenize(PROMPT_TEXT, add_special=False)


# -- the vocabulary map and the boundary ---------------------------------------------------------------


def test_the_two_tokenizers_really_differ():
    target, drafter, draft = make_pair()
    assert target.tokenize("cab") == [2, 3] and draft.tokenize("cab") == [3, 1]
    assert target.tokenize("abc") == [5] and draft.tokenize("abc") == [0, 1, 2]
    vmap = drafter.map
    # a, b, c and the end token are shared; ca, cc, ba are the draft's alone
    assert vmap.to_target.tolist() == [0, 1, 2, -1, -1, -1, END]
    assert vmap.shared_fraction == pytest.approx(4 / 7)
    assert vmap.target_special == {END: END}


def test_the_draft_reads_the_committed_text_in_its_own_tokens():
    target, drafter, draft = make_pair()
    ids = prompt_ids(target)
    drafter.prefill(ids)
    assert drafter._ids == [3, 1]  # "ca" "b"
    assert draft.tokens == [3]  # all but the last, as DraftModel.prefill
    # committed "cab" + "c" + "ab": the draft's last token is re-read with the new text ("b" + "cab")
    assert drafter._fold(ids + [2, 3])
    assert b"".join(draft.token_bytes(t) for t in drafter._ids) == b"cabcab"
    # a changed context (a new conversation) rewinds to the last point both still share
    assert drafter._fold([0])
    assert drafter._ids == [0] and drafter._committed == [0]


def test_an_unfinished_character_drafts_nothing_until_it_is_complete():
    e = "é".encode()
    t_pieces = [b"a", e[:1], e[1:], b"<end>"]
    d_pieces = [b"a", e, b"b", b"<end>"]
    target = FakeBackend(lambda c: np.zeros(4), 4, pieces=t_pieces, eog=[3])
    draft = FakeBackend(lambda c: np.array([0.0, 5.0, 0.0, -5.0]), 4, pieces=d_pieces, eog=[3])
    drafter = CrossVocabDrafter(draft, target)
    greedy = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(0)
    assert drafter.propose([0, 1], 3, greedy, rng).tokens == []  # "a" + half of "é"
    proposal = drafter.propose([0, 1, 2], 3, greedy, rng)  # "aé": the draft proposes "é" (two target tokens)
    assert drafter._ids == [0, 1]
    assert proposal.tokens[:2] == [1, 2]


def test_special_tokens_are_mapped_or_rendered_as_text():
    t_pieces = [b"a", b"b", b"<bos>", b"<turn>", b"<end>"]
    d_pieces = [b"a", b"b", b"<end>", b"<s>", b"<turn>"]  # the last: plain text that happens to look so
    target = FakeBackend(const_row(5, 0), 5, pieces=t_pieces, eog=[2, 3, 4], bos=2, add_bos=True)
    # the draft adds no BOS of its own; its "<end>" is special (eog) like the target's
    draft = FakeBackend(const_row(5, 2), 5, pieces=d_pieces, eog=[2, 3], bos=3, add_bos=False)
    drafter = CrossVocabDrafter(draft, target)
    drafter._fold([2, 0, 3, 1])  # <bos> a <turn> b
    # BOS goes nowhere (the draft adds none), <turn> (no counterpart) is read as its name, in text
    assert b"".join(draft.token_bytes(t) for t in drafter._ids) == b"a<turn>b"
    # the draft's <end> has the target's counterpart: proposed, and it ends the draft
    proposal = drafter.propose([2, 0, 3, 1], 4, SamplingParams(temperature=0.0), np.random.default_rng(0))
    assert proposal.tokens == [4]


def test_a_draft_token_the_target_cannot_express_ends_the_draft():
    target = FakeBackend(const_row(3, 0), 3, pieces=[b"a", b"b", b"<end>"], eog=[2])
    # the draft says "a" then its own special token, which the target does not have
    draft = FakeBackend(lambda c: np.array([5.0, 0.0, 0.0, -9.0]) if len(c) < 2 else np.array([0.0, 0.0, 5.0, -9.0]),
                        4, pieces=[b"a", b"b", b"<tool>", b"<end>"], eog=[2, 3])
    drafter = CrossVocabDrafter(draft, target)
    proposal = drafter.propose([1], 4, SamplingParams(temperature=0.0), np.random.default_rng(0))
    assert proposal.tokens == [0]  # "a", then nothing for <tool>


def const_row(n, best):
    row = np.zeros(n)
    row[best] = 5.0
    return lambda ctx: row


def test_greedy_cross_vocab_is_the_targets_greedy_output():
    for rule in ("slem", "tli"):
        target, drafter, _ = make_pair(rule)
        ids = prompt_ids(target)
        plain = run(target, None, ids, SamplingParams(temperature=0.0), k=0, n=24)
        spec = run(target, drafter, ids, SamplingParams(temperature=0.0), k=4, n=24)
        assert spec.token_ids == plain.token_ids, rule
        assert spec.stats.drafted > 0


def test_auto_is_tli_when_sampling_over_a_large_shared_vocabulary():
    target, drafter, _ = make_pair()
    assert drafter.rule_for(SamplingParams(temperature=0.8)) == "tli"  # 4 of 7 shared >= 50%
    assert drafter.rule_for(SamplingParams(temperature=0.0)) == "slem"
    small = dataclasses.replace(drafter.map, to_target=np.array([0, -1, -1, -1, -1, -1, -1]))
    assert CrossVocabDrafter(drafter.backend, target, small).rule_for(SamplingParams(temperature=0.8)) == "slem"
    with pytest.raises(ValueError, match="--cross-vocab"):
        CrossVocabDrafter(drafter.backend, target, rule="exact")


def test_restrict_to_shared_renormalises_and_adds_duplicates():
    q = Dist(np.array([0, 1, 3, 4]), np.array([0.1, 0.2, 0.3, 0.4]), 5)
    to_target = np.array([7, 7, -1, 2, -1])  # draft 0 and 1 have the same text
    r = restrict_to_shared(q, to_target, 9)
    assert r.ids.tolist() == [2, 7] and r.probs == pytest.approx([0.3 / 0.6, 0.3 / 0.6])
    assert restrict_to_shared(Dist(np.array([4]), np.array([1.0]), 5), to_target, 9) is None


def test_the_vocabulary_map_is_cached_per_pair_of_files(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    target, drafter, draft = make_pair()
    for name, model in (("t.gguf", target), ("d.gguf", draft)):
        (tmp_path / name).write_bytes(b"GGUF" + name.encode())
        model.path = tmp_path / name
    first = crossvocab.cached_vocab_map(target, draft)
    assert list((tmp_path / ".cache" / "vocab-maps").glob("*.npz"))
    monkeypatch.setattr(crossvocab, "build_vocab_map", lambda *a: pytest.fail("rebuilt"))
    again = crossvocab.cached_vocab_map(target, draft)
    assert again.to_target.tolist() == first.to_target.tolist() and again.target_special == first.target_special


# -- losslessness -----------------------------------------------------------------------------------------


def run(target, drafter, ids, params, k, n) -> Finished:
    events = list(generate(target, drafter, ids, params, max_tokens=n, policy=FixedPolicy(k)))
    return events[-1]


def expected_marginals(target, ids, params) -> tuple[np.ndarray, np.ndarray]:
    """P(first token), P(second token) under plain sampling from the target."""
    p1 = np.asarray(process(np.asarray(target_fn(tuple(ids)), dtype=np.float32), params, ids))
    p2 = np.zeros(TV)
    for a in np.flatnonzero(p1):
        ctx = [*ids, int(a)]
        p2 += p1[a] * np.asarray(process(np.asarray(target_fn(tuple(ctx)), dtype=np.float32), params, ctx))
    return p1, p2


def first_two(target, drafter, ids, params, k, n, seed) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    c1, c2 = np.zeros(TV, dtype=np.int64), np.zeros(TV, dtype=np.int64)
    for _ in range(n):
        gen = generate(target, drafter, ids, params, max_tokens=k + 2, policy=FixedPolicy(k), rng=rng)
        got = first_two_emitted(gen)
        c1[got[0]] += 1
        c2[got[1]] += 1
    return c1, c2


# the smallest error in one token's probability the checks must catch (power 0.9): 10k draws a check
# here (2% needs 20k-25k, 1% 80k-90k); the wrong variants below move a token by 7% (second token) to 25%
# (first), which 10k draws catch with power > 0.999 (test_the_draw_counts_catch_a_three_percent_error;
# at 10k draws the two wrong variants fail with p < 1e-48 over seeds 100-105)
CROSS_DELTA = 0.03
WRONG_DELTA = 0.07  # the smallest error of the wrong variants below


def draws(p1, p2) -> int:
    """Fewest draws (a multiple of 2.5k) catching a CROSS_DELTA error in either token with power 0.9."""
    n = 5_000
    while min(detection_power(n, p1, CROSS_DELTA), detection_power(n, p2, CROSS_DELTA)) < POWER:
        n += 2_500
    return n


def check(rule, setting, k, seed, cls=CrossVocabDrafter, n=None) -> tuple[float, float, int]:
    target, drafter, _ = make_pair(rule, cls)
    ids = prompt_ids(target)
    params = SETTINGS[setting]
    p1, p2 = expected_marginals(target, ids, params)
    n = n or draws(p1, p2)
    c1, c2 = first_two(target, drafter, ids, params, k, n, seed)
    assert sum(drafter.rules_run.values()) > 0 and set(drafter.rules_run) == {rule}
    return chi2_pvalue(c1, p1), chi2_pvalue(c2, p2), n


# TLI's q depends on every sampler setting, so it is checked under each; SLEM's proposals are one-hot
# (q = None), so a dense and a penalised setting suffice. 10k draws apiece, ~3 s each on 2 cores.
CASES = [("tli", name) for name in SETTINGS] + [("slem", "temp1.3-topp-minp"), ("slem", "penalties")]


@pytest.mark.parametrize("rule, setting", CASES)
def test_cross_vocab_rule_is_lossless(rule, setting):
    """The first and second tokens (k = 2: the second is the draft's second position, or the token
    after a rejection) are distributed as plain sampling from the target would give."""
    first, second, n = check(rule, setting, k=2, seed=sum(map(ord, rule + setting)))
    assert first > ALPHA and second > ALPHA, (rule, setting, n, first, second)


def test_the_draw_counts_catch_a_three_percent_error():
    target, _, _ = make_pair()
    ids = prompt_ids(target)
    for params in SETTINGS.values():
        p1, p2 = expected_marginals(target, ids, params)
        n = draws(p1, p2)
        assert n <= 12_500
        assert detection_power(n, p1, delta=CROSS_DELTA) >= POWER and detection_power(n, p2, delta=CROSS_DELTA) >= POWER
        # an error the size of the wrong variants' is caught every time, as with 20k-25k draws
        assert detection_power(n, p1, delta=WRONG_DELTA) > 0.999 and detection_power(n, p2, delta=WRONG_DELTA) > 0.999


def test_tli_without_renormalising_fails_the_check(monkeypatch):
    """q restricted to the shared tokens but not renormalised: q(d) is understated, p/q overstated, and
    the draft's tokens come out too often."""

    def unnormalised(q, to_target, n_target):
        r = restrict_to_shared(q, to_target, n_target)
        if r is None:
            return None
        ids = np.arange(q.n_vocab) if q.ids is None else q.ids
        keep = to_target[ids] >= 0
        return Dist(r.ids, r.probs * q.probs[keep].sum(), r.n_vocab)

    monkeypatch.setattr(crossvocab, "restrict_to_shared", unnormalised)
    first, second, n = check("tli", "temp1", k=2, seed=5)  # as many draws as the checks above
    assert first < ALPHA or second < ALPHA, (first, second)


class ChangesACommittedToken(CrossVocabDrafter):
    """Wrong on purpose: re-tokenises the last committed token together with the draft's text and
    writes the target's tokenisation back over it ("c" + "ab..." read as "cab..."), so the target goes on
    from tokens it never emitted."""

    def propose(self, context, k, params, rng):
        draft = super().propose(context, k, params, rng)
        if draft.tokens:
            text = b"".join(self.target.token_bytes(t) for t in [context[-1], *draft.tokens])
            merged = self.target.tokenize(text.decode(), add_special=False)
            if merged[0] != context[-1]:
                context[-1] = merged[0]
        return draft


def test_changing_a_committed_token_fails_the_check():
    first, second, n = check("slem", "temp1", k=2, seed=6, cls=ChangesACommittedToken)  # as many draws as the checks
    assert first < ALPHA or second < ALPHA, (first, second)


# -- the rule when the draft is one member of a chain (--hybrid) --------------------------------------


def test_a_hybrid_chain_keeps_the_cross_vocab_rule_label_and_json(cli, monkeypatch):
    """`--hybrid` puts prompt lookup in front of the draft: the chain still says which rule its
    cross-vocabulary member runs, in the live label and in --json's `cross_vocab`."""
    from specchat.drafters import Chain, run_info, run_label
    from specchat.loader import Loaded
    from specchat.lookup import PromptLookup

    def hybrid_pair():
        target, drafter, _ = make_pair()
        return target, Chain([PromptLookup(1, 32), drafter])

    target, chain = hybrid_pair()
    assert run_label(chain, SamplingParams(temperature=0.0)) == "cross-vocab SLEM"
    assert run_info(chain, SamplingParams(temperature=0.8))["cross_vocab"]["rule"] == "tli"

    def load(config, selection, opts, status=lambda m: None):
        target, chain = hybrid_pair()
        return Loaded(target, chain, dataclasses.make_dataclass("Spec", ["name"])("target"), None,
                      "prompt-lookup + draft")

    monkeypatch.setattr("specchat.runner.load", load)
    result = cli("prompt", "cab", "--raw", "--json", "-n", "8", "--draft-fixed", "2", "--temp", "0")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["cross_vocab"]["rule"] == "slem" and doc["cross_vocab"]["requested"] == "auto"
