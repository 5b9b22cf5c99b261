"""Draft trees through the engine and the fake backend: one target batch per tree, the kept path in the
cache, sources per token, statistics; losslessness through the whole loop (chi-square on the first two
tokens, as test_engine.py does for chains) with a control that must fail; lookup's trees and TreePolicy."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import ALPHA, FakeBackend, ScriptedDrafter, chi2_pvalue, first_two_emitted, markov_logits
from specchat import engine
from specchat.backend import BackendError
from specchat.engine import Finished, StepEvent, TokenEvent, generate
from specchat.lookup import PromptLookup
from specchat.policy import FixedPolicy
from specchat.sampling import SamplingParams, sample
from specchat.tree import ROOT, DraftTree
from specchat.tree_drafts import GAIN_PRIOR, TreeDraft, TreePolicy, best_first, lookup_tree, main_branch
from test_engine import (
    ENGINE_DRAFT, ENGINE_DRAWS, ENGINE_TARGET, EV, PENALTY_PARAMS, PENALTY_PROMPT, expected_first_two,
)

GREEDY = SamplingParams(temperature=0.0)


class TreeDrafter(ScriptedDrafter):
    """Proposes a tree every step: `shape` [(token, parent)] (chosen, q = None), or with `q_fn` children
    drawn from q_fn(context + path) (`widths` per level; `replace`: with replacement, as SpecInfer)."""

    def __init__(self, shape=None, *, q_fn=None, widths=(3, 2)):
        super().__init__()
        self.shape, self.tree_q, self.widths = shape, q_fn, widths

    def propose(self, context, k, params, rng):
        self.proposals.append((list(context), k))
        if k <= 0:
            return TreeDraft()
        if self.shape is not None:
            tree = DraftTree([t for t, _ in self.shape], [p for _, p in self.shape])
        else:
            tree = DraftTree()
            frontier = [ROOT]
            for width in self.widths[:k]:
                nxt = []
                for node in frontier:
                    q = np.asarray(self.tree_q(tuple(context) + tuple(tree.path_tokens(node))), dtype=np.float64)
                    for _ in range(width):
                        nxt.append(tree.add(sample(q, rng), node, q))
                frontier = nxt
        chain = [tree.tokens[i] for i in main_branch(tree)]
        return TreeDraft(chain, [tree.q[i] for i in main_branch(tree)], tree=tree)


SHAPE = [(0, ROOT), (0, 0), (2, 0), (1, ROOT), (4, ROOT), (4, 4), (3, 5)]


def engine_first_two(target, drafter, prompt, params, n, seed, k=3):
    rng = np.random.default_rng(seed)
    counts = np.zeros((EV, EV), dtype=np.int64)
    for _ in range(n):
        got = first_two_emitted(generate(target, drafter, prompt, params, max_tokens=8, policy=FixedPolicy(k), rng=rng))
        counts[got] += 1
    return counts


def test_engine_fixed_tree_with_penalties_is_lossless():
    target = FakeBackend(markov_logits(ENGINE_TARGET), EV)
    expected = expected_first_two(markov_logits(ENGINE_TARGET), PENALTY_PROMPT, PENALTY_PARAMS)
    counts = engine_first_two(target, TreeDrafter(SHAPE), PENALTY_PROMPT, PENALTY_PARAMS, ENGINE_DRAWS, seed=21)
    assert target.tree_calls and target.rollback_recoveries == 0
    pvalue = chi2_pvalue(counts, expected)
    assert pvalue > ALPHA, f"p={pvalue:.2e}\n{counts / ENGINE_DRAWS}\n{expected}"


def test_engine_sampled_tree_is_lossless():
    """Children drawn from the draft model's q with replacement (SpecInfer), penalties on."""
    target = FakeBackend(markov_logits(ENGINE_TARGET), EV)
    draft_fn = markov_logits(ENGINE_DRAFT)

    def q_fn(ctx):
        from specchat.sampling import process
        return np.asarray(process(np.asarray(draft_fn(ctx)), PENALTY_PARAMS, list(ctx)))

    expected = expected_first_two(markov_logits(ENGINE_TARGET), PENALTY_PROMPT, PENALTY_PARAMS)
    counts = engine_first_two(target, TreeDrafter(q_fn=q_fn), PENALTY_PROMPT, PENALTY_PARAMS, ENGINE_DRAWS, seed=22)
    pvalue = chi2_pvalue(counts, expected)
    assert pvalue > ALPHA, f"p={pvalue:.2e}\n{counts / ENGINE_DRAWS}\n{expected}"


def test_engine_control_penalties_reading_other_branches_fail(monkeypatch):
    """The same check fails for an engine whose rows' penalties read every node before them in the batch
    (other branches included) rather than their own path."""
    target = FakeBackend(markov_logits(ENGINE_TARGET), EV)

    def node_order_history(recent, tree):
        return lambda i: list(recent) + tree.tokens[:i]

    monkeypatch.setattr(engine, "path_history", node_order_history)
    expected = expected_first_two(markov_logits(ENGINE_TARGET), PENALTY_PROMPT, PENALTY_PARAMS)
    counts = engine_first_two(target, TreeDrafter(SHAPE), PENALTY_PROMPT, PENALTY_PARAMS, 3_000, seed=23)
    assert chi2_pvalue(counts, expected) < 1e-12


# -- bookkeeping --------------------------------------------------------------------------------------------


def run(target, drafter, prompt, params, **kw):
    events = list(generate(target, drafter, prompt, params, **kw))
    assert isinstance(events[-1], Finished)
    return ([e for e in events if isinstance(e, TokenEvent)], [e for e in events if isinstance(e, StepEvent)],
            events[-1])


def scripted(wanted, prompt_len, v=8):
    def fn(ctx):
        row = np.zeros(v, dtype=np.float32)
        i = len(ctx) - prompt_len
        row[wanted[i] if i < len(wanted) else 0] = 10.0
        return row
    return fn


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, seed=3)], ids=["greedy", "sampled"])
def test_a_tree_step_keeps_its_path_in_the_cache_and_says_where_tokens_came_from(params):
    prompt = [5, 6, 7]
    wanted = [4, 3, 1, 2, 2, 2, 2]
    target = FakeBackend(scripted(wanted, len(prompt)), 8)
    # step 0: the branch 4 -> 3 is right, 1 is the correction after it (3 has a child, 6, that is wrong)
    shape = [(1, ROOT), (2, 0), (4, ROOT), (3, 2), (6, 3), (5, 2)]
    drafter = TreeDrafter(shape)
    tokens, steps, fin = run(target, drafter, prompt, params, max_tokens=3, policy=FixedPolicy(3))
    assert [(t.id, t.source) for t in tokens] == [(4, "accepted"), (3, "accepted"), (1, "resampled")]
    assert target.tree_calls[0] == (7, [t for t, _ in shape], [p for _, p in shape])
    assert target.kept_branches[0] == [4, 3]
    assert target.tokens == prompt + [4, 3]  # the context minus its last token
    s = steps[0].stats
    assert (s.drafted, s.accepted, s.nodes, s.emitted) == (3, 2, 6, 3)
    totals = steps[-1].totals
    assert totals.nodes == 6 and totals.as_dict()["nodes_per_step"] == 6.0 and totals.as_dict()["tokens_per_step"] == 3.0


def test_a_tree_walked_to_a_leaf_ends_with_a_bonus_and_generation_goes_on():
    prompt = [5, 6, 7]
    wanted = [4, 3, 6, 1, 1, 2, 2, 2, 2, 2]
    target = FakeBackend(scripted(wanted, len(prompt)), 8)
    drafter = TreeDrafter([(1, ROOT), (4, ROOT), (3, 1), (6, 2)])
    tokens, steps, fin = run(target, drafter, prompt, GREEDY, max_tokens=10, policy=FixedPolicy(3))
    assert [(t.id, t.source) for t in tokens[:4]] == [(4, "accepted"), (3, "accepted"), (6, "accepted"), (1, "bonus")]
    assert fin.token_ids == wanted[:10]
    assert target.tokens == prompt + wanted[:9] and target.rollback_recoveries == 0


@pytest.mark.parametrize("kind", ["fixed-tree", "draft-model"])
def test_greedy_with_trees_equals_plain_greedy(kind):
    from fakes import make_draft_model

    rng = np.random.default_rng(4)
    table = rng.normal(0, 1, (EV, EV))
    prompt = [1, 2, 3]
    plain = run(FakeBackend(markov_logits(table), EV), None, prompt, GREEDY, max_tokens=20)[2].token_ids
    target = FakeBackend(markov_logits(table), EV)
    if kind == "fixed-tree":
        drafter, policy = TreeDrafter(SHAPE), FixedPolicy(3)
    else:  # the draft model's runners-up beside its chain
        drafter, draft_backend = make_draft_model(markov_logits(table + rng.normal(0, 1.0, (EV, EV))), EV)
        policy = TreePolicy(FixedPolicy(3), 7)
    got = run(target, drafter, prompt, GREEDY, max_tokens=20, policy=policy)[2].token_ids
    assert got == plain and len(target.tree_calls) > 2 and target.rollback_recoveries == 0
    if kind == "draft-model":
        assert "eval" not in vars(draft_backend)  # the row recorder is gone


def test_a_recurrent_target_verifies_the_main_branch_as_a_chain():
    prompt = [5, 6, 7]
    wanted = [4, 3, 1, 2, 2, 2]
    target = FakeBackend(scripted(wanted, len(prompt)), 8, memory="checkpoints")
    tokens, steps, fin = run(target, TreeDrafter([(4, ROOT), (3, 0), (1, ROOT)]), prompt, GREEDY, max_tokens=4,
                             policy=FixedPolicy(3))
    assert target.tree_calls == [] and fin.token_ids == wanted[:4]
    assert steps[0].stats.nodes == 0 and steps[0].stats.drafted == 2


def test_a_tree_wider_than_the_target_sequences_goes_as_a_chain():
    prompt = [5, 6, 7]
    target = FakeBackend(scripted([4, 3, 1, 2], len(prompt)), 8)
    target.tree_sequences = 1
    run(target, TreeDrafter([(4, ROOT), (3, 0), (1, ROOT)]), prompt, GREEDY, max_tokens=3, policy=FixedPolicy(3))
    assert target.tree_calls == [] and target.calls[-1][0][:3] == [7, 4, 3]


def test_a_decode_that_fails_on_a_tree_leaves_the_cache_usable():
    prompt = [5, 6, 7]
    wanted = [4, 3, 1, 2, 2, 2]
    target = FakeBackend(scripted(wanted, len(prompt)), 8)
    target.fail_after(1)  # the prefill works, the tree's decode fails
    with pytest.raises(BackendError):
        run(target, TreeDrafter([(4, ROOT), (3, 0), (1, ROOT)]), prompt, GREEDY, max_tokens=4, policy=FixedPolicy(3))
    assert target.tokens == prompt[:-1]
    assert run(target, None, prompt, GREEDY, max_tokens=3)[2].token_ids == wanted[:3]


# -- lookup's trees --------------------------------------------------------------------------------------


def test_best_first_scores_paths_by_count():
    tree = best_first([(3.0, [1, 2, 3]), (1.0, [1, 4]), (2.0, [5, 6])], nodes=4, depth=3)
    # scores: 1: 4/6, 1-2: 3/6, 5: 2/6, 5-6: 2/6, 1-2-3: 3/6, 1-4: 1/6
    assert sorted(zip(tree.tokens, tree.parents)) == sorted([(1, ROOT), (2, 0), (3, 1), (5, ROOT)])
    assert main_branch(tree) == [0, 1, 2] and tree.tokens[:3] == [1, 2, 3]
    assert best_first([(1.0, [1, 2, 3])], nodes=8, depth=2).tokens == [1, 2]


def test_lookup_tree_branches_where_the_tail_was_followed_differently():
    context = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 0, 8, 9, 1, 2]
    lookup = PromptLookup(1, 8)
    chain = lookup.propose(context, 3, GREEDY, np.random.default_rng(0))
    assert chain.tokens == [0, 8, 9]  # after the latest occurrence of [9, 1, 2]
    draft = lookup_tree(lookup, context, chain, nodes=6)
    tree = draft.tree
    assert draft.tokens == chain.tokens and [tree.tokens[i] for i in main_branch(tree)] == [0, 8, 9]
    # [9, 1, 2] was followed by 4, 9, 1 before (match of 3: weight 3), [1, 2] by 3, 9, 1 (weight 2): a path
    # scores what its first token does, so the whole 4-branch comes before the 3
    assert {tree.tokens[i] for i in tree.children(ROOT)} == {0, 4} and len(tree) == 6
    wider = lookup_tree(lookup, context, chain, nodes=8).tree
    assert {wider.tokens[i] for i in wider.children(ROOT)} == {0, 3, 4} and len(wider) == 8
    assert tree.depth() == wider.depth() == 3
    # no wider than asked, and a chain stays a chain
    assert lookup_tree(lookup, context, chain, nodes=3) is chain


def test_tree_policy_through_the_engine_with_lookup_is_greedy_exact():
    rng = np.random.default_rng(7)
    table = rng.normal(0, 1, (EV, EV))
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 0, 1, 2, 3, 1, 2]
    plain = run(FakeBackend(markov_logits(table), EV), None, prompt, GREEDY, max_tokens=24)[2].token_ids
    target = FakeBackend(markov_logits(table), EV)
    tokens, steps, fin = run(target, PromptLookup(1, 8), prompt, GREEDY, max_tokens=24,
                             policy=TreePolicy(FixedPolicy(3), 8))
    assert fin.token_ids == plain and target.tree_calls and target.rollback_recoveries == 0
    assert max(len(c[1]) for c in target.tree_calls) <= 8
    with pytest.raises(ValueError):
        TreePolicy(FixedPolicy(3), -1)


# -- the flags --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["--draft-tree", "-1"], "--draft-tree"),
    (["--draft-tree", "300"], "--draft-tree"),
    (["--draft-tree", "many"], "--draft-tree"),
    (["--draft-tree", "3", "--draft-fixed", "5"], "--draft-tree 3"),
    (["--draft-tree", "4", "--no-spec"], "--no-spec"),
])
def test_bad_draft_tree_values_are_one_line(cli, tmp_path, args, needle):
    from fakes import assert_user_error

    assert_user_error(cli("prompt", "hi", *args, home=tmp_path), needle)


def test_tree_note_says_when_a_target_keeps_to_chains():
    from specchat.tree_drafts import tree_note, tree_policy

    kv, recurrent = FakeBackend(markov_logits(ENGINE_TARGET), EV), FakeBackend(markov_logits(ENGINE_TARGET), EV, memory="checkpoints")
    assert tree_note(kv, 8) is None and tree_note(recurrent, 0) is None
    assert "chains" in tree_note(recurrent, 8) and "\n" not in tree_note(recurrent, 8)
    kv.tree_sequences = 1
    assert "one sequence" in tree_note(kv, 8)
    inner = FixedPolicy(3)
    assert tree_policy(inner, 0) is inner and tree_policy(inner, 8).nodes == 8


# -- trees from a draft model ------------------------------------------------------------------------------


def policy_first_two(target, drafter, prompt, params, policy, n, seed):
    rng = np.random.default_rng(seed)
    counts = np.zeros((EV, EV), dtype=np.int64)
    for _ in range(n):
        got = first_two_emitted(generate(target, drafter, prompt, params, max_tokens=8, policy=policy, rng=rng))
        counts[got] += 1
    return counts


def test_engine_draft_model_tree_with_penalties_is_lossless():
    """The draft model's sampled chain (q known) with its runners-up as chosen leaves beside it: mixed
    siblings, penalties on."""
    from fakes import make_draft_model

    target = FakeBackend(markov_logits(ENGINE_TARGET), EV)
    drafter, _ = make_draft_model(markov_logits(ENGINE_DRAFT), EV)
    expected = expected_first_two(markov_logits(ENGINE_TARGET), PENALTY_PROMPT, PENALTY_PARAMS)
    counts = policy_first_two(target, drafter, PENALTY_PROMPT, PENALTY_PARAMS, TreePolicy(FixedPolicy(2), 5),
                              ENGINE_DRAWS, seed=24)
    assert target.tree_calls and max(len(c[1]) for c in target.tree_calls) == 5
    pvalue = chi2_pvalue(counts, expected)
    assert pvalue > ALPHA, f"p={pvalue:.2e}\n{counts / ENGINE_DRAWS}\n{expected}"


def test_model_tree_branches_where_the_draft_is_unsure():
    from specchat.tree_drafts import model_tree
    from specchat.drafters import Draft

    sure = np.array([10.0, 0, 0, 0, 0])  # the draft is certain of token 0
    unsure = np.array([1.0, 0.9, 0.8, -5, -5])  # three tokens about as likely
    tree = model_tree(Draft([0, 0, 0], [None] * 3), [sure, unsure, sure], nodes=5).tree
    assert tree.tokens[:3] == [0, 0, 0] and tree.parents[:3] == [ROOT, 0, 1]
    # the two runners-up of the unsure position hang beside the chain's second token
    assert sorted(zip(tree.tokens[3:], tree.parents[3:])) == [(1, 0), (2, 0)]
    assert getattr(model_tree(Draft([0], [None]), [sure], nodes=1), "tree", None) is None


# -- pricing: a tree goes where it pays against its own chain ------------------------------------------------


class PricedInner:
    """A priced inner policy: sends lookup's chain of 3 every step; has the target's verify costs."""

    last_note = None
    drafting_possible = True

    def __init__(self, cost):
        self.verify_cost, self.seen = cost, []

    def draft(self, drafter, context, limit, params, rng):
        draft = drafter.propose(context, min(3, limit), params, rng)
        draft.drafter, draft.planned = drafter, 3
        return draft

    def observe(self, step, emitted):
        self.seen.append(step)

    def finish(self):
        pass


BRANCHING = [1, 2, 3, 1, 2, 4, 1, 2, 0, 1, 2, 3, 1, 2]


def priced_run(cost, table_seed=7, max_tokens=30):
    from specchat.costs import CostModel

    table = np.random.default_rng(table_seed).normal(0, 1, (EV, EV))
    target = FakeBackend(markov_logits(table), EV)
    inner = PricedInner(CostModel(*cost))
    policy = TreePolicy(inner, 8)
    fin = run(target, PromptLookup(1, 8), BRANCHING, GREEDY, max_tokens=max_tokens, policy=policy)[2]
    return policy, inner, target, fin


def test_a_tree_whose_batch_costs_far_more_than_its_chain_is_held_back_and_probed():
    policy, inner, target, fin = priced_run(([1, 4, 9], [1.0, 1.2, 3.0]))  # 9 tokens cost 2.5x 4
    assert policy.trees_sent == len(target.tree_calls) <= 1 + fin.stats.steps // 16
    assert all(s.nodes == 0 for s in inner.seen)


def test_a_tree_as_cheap_as_its_chain_goes_and_the_inner_policy_sees_the_chain():
    policy, inner, target, fin = priced_run(([1, 64], [1.0, 1.01]), max_tokens=30)  # a GPU-like flat cost
    assert policy.trees_sent == len(target.tree_calls) >= 2
    assert all(s.nodes == 0 and s.drafted <= 3 for s in inner.seen)  # every step told as its chain
    assert fin.stats.nodes > fin.stats.drafted


def test_probes_back_off_while_trees_gain_nothing():
    from specchat.costs import CostModel
    from specchat.stats import StepStats

    policy = TreePolicy(PricedInner(CostModel([1, 4, 9], [1.0, 1.2, 3.0])), 8)
    sent = []
    for i in range(400):
        if policy._pays(3, 8):  # the tree's path kept what its chain would have: no gain
            sent.append(i)
            policy._sent = TreeDraft([1, 2, 3], [None] * 3, tree=DraftTree([1, 2, 3, 4], [ROOT, 0, 1, 0]))
            policy.observe(StepStats(i, 3, 1, 2, 0.0, 0.01, nodes=8), [1, 9])
        else:
            policy.observe(StepStats(i, 3, 1, 2, 0.0, 0.01), [1, 9])
    gaps = np.diff(sent).tolist()
    assert sent[0] == 16 and gaps == [33, 65, 129], sent  # declined 16 times, then 32, 64, 128
    assert policy.gain < GAIN_PRIOR and all(s.nodes == 0 for s in policy.inner.seen)
