"""Losslessness of draft-tree verification (specchat/tree.py), and its unit tests.

The claim: whatever tree a drafter sends, the tokens emitted are distributed exactly as plain sampling from
the target. The fake target's distribution depends on the whole path (so a walk that reads the wrong row,
or penalties that read another branch's tokens, show up), and the check is on the first TWO tokens jointly
(the second from the next level of the tree when the walk went on, else drawn from the target as the next
step would): 100 cells, draw counts from draws_for as in test_sampling.py. Every kind of tree is checked:
candidates chosen without the target's randomness (a fixed lookup-like tree, the top candidates of a draft
distribution), children drawn from q with replacement (SpecInfer) and without. The controls are rules that
look plausible and are wrong; each must fail the same check.
"""

from __future__ import annotations

import bisect
import zlib
from functools import lru_cache
from itertools import accumulate

import numpy as np
import pytest

from fakes import ALPHA, chi2_pvalue, draws_for
from sampling_cases import DRAFT_FAR, DRAFT_NEAR, HISTORY, TARGET, V, sp
from specchat import sampling
from specchat.sampling import Dist, SamplingParams, lazy_rows, process, residual, sample, verify
from specchat.tree import DraftTree, ROOT, ends_at_leaf, path_history, verify_tree, verify_tree_greedy, without
from test_sampling import Uniforms, _draw


def shift(path: tuple[int, ...]) -> int:
    return (3 * len(path) + sum(path)) % V


@lru_cache(maxsize=None)
def p_at(params: SamplingParams, path: tuple[int, ...]) -> Dist:
    """The target's processed distribution after context HISTORY + path (penalties read the path)."""
    return process(np.roll(TARGET, shift(path)), params, HISTORY + list(path))


@lru_cache(maxsize=None)
def q_at(params: SamplingParams, draft: str, path: tuple[int, ...]) -> Dist:
    logits = {"near": DRAFT_NEAR, "far": DRAFT_FAR}[draft]
    return process(np.roll(logits, shift(path)), params, HISTORY + list(path))


@lru_cache(maxsize=None)
def dense(d: Dist) -> np.ndarray:
    return np.asarray(d)


def joint(params: SamplingParams) -> np.ndarray:
    """P(first two tokens) under plain sampling from the target."""
    first = dense(p_at(params, ()))
    out = np.zeros((V, V))
    for a in np.flatnonzero(first):
        out[a] = first[a] * dense(p_at(params, (int(a),)))
    return out


# -- the trees ------------------------------------------------------------------------------------------

FIXED_SHAPE = [(3, ROOT), (1, ROOT), (0, ROOT), (5, 0), (6, 0), (3, 1), (1, 3), (8, 2)]


def fixed_tree(params, draft, rng) -> DraftTree:
    """A lookup-like tree: the same candidates every time, none drawn from anything."""
    return DraftTree([t for t, _ in FIXED_SHAPE], [parent for _, parent in FIXED_SHAPE])


def top_tree(params, draft, rng, widths=(3, 2)) -> DraftTree:
    """The top candidates of the draft's q at each node (chosen, not sampled: q = None)."""
    tree = DraftTree()
    frontier = [ROOT]
    for width in widths:
        nxt = []
        for node in frontier:
            q = dense(q_at(params, draft, tuple(tree.path_tokens(node))))
            for t in np.argsort(-q, kind="stable")[:width]:
                if q[t] > 0:
                    nxt.append(tree.add(int(t), node))
        frontier = nxt
    return tree


_cdfs: dict[int, tuple[list[int], list[float]]] = {}


def draw(q: Dist, rng) -> int:
    """sample(q, rng) for the lru-cached q of q_at (its CDF kept as lists: numpy's cumsum per draw was
    most of these tests' time)."""
    lists = _cdfs.get(id(q))
    if lists is None:
        ids, probs = q.lists()
        lists = _cdfs[id(q)] = (list(ids), list(accumulate(probs)))
    ids, cdf = lists
    i = bisect.bisect_right(cdf, rng.random() * cdf[-1])
    return ids[i] if i < len(ids) else ids[max(j for j, x in enumerate(q.lists()[1]) if x > 0)]


def sampled_tree(params, draft, rng, widths=(3, 2), replace=True) -> DraftTree:
    """Children drawn from the draft's q at each node: independently (SpecInfer) or without replacement."""
    tree = DraftTree()
    frontier = [ROOT]
    for width in widths:
        nxt = []
        for node in frontier:
            q = q_at(params, draft, tuple(tree.path_tokens(node)))
            drawn: list[int] = []
            for _ in range(width):
                q_c = q if replace or not drawn else without(q, drawn)
                if not replace and len(drawn) >= len(q.lists()[0]):
                    break
                t = draw(q, rng) if q_c is q else sample(q_c, rng)
                drawn.append(t)
                nxt.append(tree.add(t, node, q_c))
        frontier = nxt
    return tree


def without_tree(params, draft, rng) -> DraftTree:
    return sampled_tree(params, draft, rng, replace=False)


def target_rows(params, tree: DraftTree):
    return lazy_rows(len(tree) + 1, lambda i: p_at(params, tuple(tree.path_tokens(i - 1))))


def first_two(params, tree: DraftTree, rng, verify_fn=verify_tree) -> tuple[int, int]:
    path, token = verify_fn(target_rows(params, tree), tree, rng)
    emitted = tree_tokens(tree, path) + [token]
    if len(emitted) < 2:  # the next step: plain sampling stands in for whatever it drafts
        emitted.append(sample(p_at(params, (emitted[0],)), rng))
    return emitted[0], emitted[1]


def tree_tokens(tree, path):
    return [tree.tokens[i] for i in path]


def run(params, make, draft, n, seed, verify_fn=verify_tree) -> np.ndarray:
    rng = np.random.default_rng(seed)
    u = Uniforms(rng)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(n):
        tree = make(params, draft, rng)
        a, b = first_two(params, tree, u, verify_fn)
        counts[a, b] += 1
    return counts


PENALTY = sp(temperature=1.0, repeat_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.3)
TREE_CASES = [
    ("fixed-temp0.8-top-p0.9", sp(temperature=0.8, top_p=0.9), fixed_tree, "near"),
    ("fixed-penalties", PENALTY, fixed_tree, "near"),
    ("top-candidates-temp1.0", sp(temperature=1.0), top_tree, "near"),
    ("top-candidates-far-temp1.5", sp(temperature=1.5), top_tree, "far"),
    ("specinfer-temp1.0", sp(temperature=1.0), sampled_tree, "near"),
    ("specinfer-top-k4", sp(temperature=1.0, top_k=4), sampled_tree, "near"),
    ("without-replacement-temp0.7", sp(temperature=0.7), without_tree, "near"),
    ("without-replacement-far-penalties", PENALTY, without_tree, "far"),
    ("llama-defaults-specinfer", SamplingParams(temperature=0.8), sampled_tree, "near"),
]


@pytest.mark.parametrize("name, params, make, draft", TREE_CASES, ids=[c[0] for c in TREE_CASES])
def test_tree_first_two_tokens_are_the_target_distribution(name, params, make, draft):
    want = joint(params)
    n = draws_for(want)
    counts = run(params, make, draft, n, seed=zlib.crc32(name.encode()))
    pvalue = chi2_pvalue(counts, want)
    assert pvalue > ALPHA, f"{name}: {n} draws, p={pvalue:.2e}"


def test_tree_cases_exercise_what_they_claim():
    """Trees branch, go two deep, and their walks reach the second level and reject children often."""
    rng = np.random.default_rng(0)
    for name, params, make, draft in TREE_CASES:
        depths, rejected_some = [], 0
        for _ in range(300):
            tree = make(params, draft, rng)
            assert len(tree.children(ROOT)) >= 2 and tree.depth() >= 2, name
            path, _ = verify_tree(target_rows(params, tree), tree, rng)
            depths.append(len(path))
            rejected_some += not path or tree.children(ROOT).index(path[0]) > 0
        assert 0 < np.mean(depths) < tree.depth() and max(depths) >= 2, (name, np.mean(depths))
        assert rejected_some > 30, name
    # the penalty cases: the path's own tokens change the target (frequency counts them)
    tree = fixed_tree(PENALTY, "near", rng)
    gaps = []
    for node in range(len(tree)):
        path = tuple(tree.path_tokens(node))
        blind = process(np.roll(TARGET, shift(path)), PENALTY, HISTORY)
        gaps.append(np.abs(dense(p_at(PENALTY, path)) - np.asarray(blind)).max())
    assert max(gaps) > 0.05 and sorted(gaps)[len(gaps) // 2] > 0.01, gaps


# -- controls: wrong rules must fail the same check ------------------------------------------------------

CONTROL_DRAWS = 20_000


def verify_tree_min_p_over_q_on_top_candidates(params, draft):
    """llama.cpp's old tree rule at temperature > 0: the top candidates of q, never sampled from it, tested
    with min(1, p/q) and the residual max(0, p - q), as if they had been."""
    def verify_fn(p, tree, rng):
        node, path = ROOT, []
        while True:
            r = Dist.of(p[node + 1])
            q = q_at(params, draft, tuple(tree.path_tokens(node)))
            for child in tree.children(node):
                token = tree.tokens[child]
                if rng.random() * q.prob(token) < r.prob(token):
                    path.append(child)
                    node = child
                    break
                r = residual(r, q)
            else:
                return path, sample(r, rng)
    return verify_fn


def test_control_min_p_over_q_on_unsampled_top_candidates_fails():
    params = sp(temperature=1.0)
    counts = run(params, top_tree, "near", CONTROL_DRAWS, seed=11,
                 verify_fn=verify_tree_min_p_over_q_on_top_candidates(params, "near"))
    assert chi2_pvalue(counts, joint(params)) < 1e-12


def test_control_without_replacement_tested_against_the_unconditioned_q_fails():
    """Children drawn without replacement but each tested against the q of the first draw."""
    params = sp(temperature=0.7)

    def make(params, draft, rng):
        tree = sampled_tree(params, draft, rng, widths=(4, 2), replace=False)
        for i, parent in enumerate(tree.parents):
            tree.q[i] = q_at(params, draft, tuple(tree.path_tokens(parent)))
        return tree

    counts = run(params, make, "far", CONTROL_DRAWS, seed=12)
    assert chi2_pvalue(counts, joint(params)) < 1e-12


def test_control_no_residual_between_siblings_fails(monkeypatch):
    """Trying the next sibling against the same p (no residual after a rejection) over-weights the
    candidates: the real walk with sampling.residual patched to return p."""
    import specchat.tree as tree_mod

    params = sp(temperature=1.0)
    monkeypatch.setattr(tree_mod, "residual", lambda p, q: p)
    counts = run(params, fixed_tree, "near", CONTROL_DRAWS, seed=13)
    assert chi2_pvalue(counts, joint(params)) < 1e-12


def test_control_penalties_reading_node_order_instead_of_the_path_fail():
    """A row whose penalties read every node before it in the batch (other branches' tokens) instead of
    its own path: the target's distribution is no longer the one plain sampling sees."""
    params = PENALTY

    def verify_fn(p, tree, rng):
        wrong = lazy_rows(len(tree) + 1, lambda i: process(np.roll(TARGET, shift(tuple(tree.path_tokens(i - 1)))),
                                                           params, HISTORY + tree.tokens[: max(0, i - 1) + (i > 0)]))
        return verify_tree(wrong, tree, rng)

    counts = run(params, fixed_tree, "near", CONTROL_DRAWS, seed=14, verify_fn=verify_fn)
    assert chi2_pvalue(counts, joint(params)) < 1e-12


# -- the same walk as the chain rule ----------------------------------------------------------------------


@pytest.mark.parametrize("q_kind", ["fixed", "sampled"])
def test_a_chain_walks_exactly_as_sampling_verify(q_kind):
    """Same rows, same uniforms: verify_tree on a one-branch tree decides what sampling.verify decides."""
    params = sp(temperature=0.9)
    rng = np.random.default_rng(5)
    for _ in range(2000):
        k = int(rng.integers(0, 5))
        drafts, q, path = [], [], ()
        for _ in range(k):
            q_i = q_at(params, "near", path)
            d = sample(q_i, rng) if q_kind == "sampled" else int(rng.integers(V))
            drafts.append(d)
            q.append(q_i if q_kind == "sampled" else None)
            path += (d,)
        p = [p_at(params, tuple(drafts[:i])) for i in range(k + 1)]
        seed = int(rng.integers(2**32))
        got_chain = verify(p, q, drafts, np.random.default_rng(seed))
        tree = DraftTree.chain(drafts, q)
        nodes, token = verify_tree(p, tree, np.random.default_rng(seed))
        assert (len(nodes), token) == got_chain
        assert nodes == list(range(len(nodes)))


# -- unit tests ------------------------------------------------------------------------------------------


def test_tree_structure():
    tree = DraftTree([3, 5, 0, 5, 8, 3], [ROOT, ROOT, ROOT, 0, 0, 1])
    assert tree.children(ROOT) == [0, 1, 2] and tree.children(0) == [3, 4] and tree.children(2) == []
    assert tree.path(4) == [0, 4] and tree.path_tokens(4) == [3, 8] and tree.path(ROOT) == []
    assert tree.depths() == [1, 1, 1, 2, 2, 2] and tree.depth() == 2
    assert tree.leaves() == [2, 3, 4, 5]
    assert tree.leaf_sets() == [[1, 2], [3], [0], [1], [2], [3]]
    assert not tree.is_chain() and DraftTree.chain([1, 2, 3]).is_chain()
    assert DraftTree.chain([1, 2]).parents == [ROOT, 0]
    assert ends_at_leaf(tree, [0, 3]) and not ends_at_leaf(tree, [0]) and not ends_at_leaf(tree, [])
    assert ends_at_leaf(DraftTree(), [])
    with pytest.raises(ValueError):
        DraftTree([1, 2], [ROOT, 1])
    with pytest.raises(ValueError):
        DraftTree([1, 2], [ROOT])
    assert path_history([7, 7], tree)(0) == [7, 7] and path_history([7], tree)(5) == [7, 3, 8]


def test_without_replacement():
    q = Dist.of(np.array([0.5, 0.3, 0.2, 0.0]))
    np.testing.assert_allclose(np.asarray(without(q, [0])), [0.0, 0.6, 0.4, 0.0])
    np.testing.assert_allclose(np.asarray(without(q, [0, 2])), [0.0, 1.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        without(q, [0, 1, 2])


def test_greedy_walk():
    tree = DraftTree([3, 5, 0, 5, 8, 3], [ROOT, ROOT, ROOT, 0, 0, 1])
    # argmax per row: row 0 root, row i + 1 after node i
    assert verify_tree_greedy([5, 9, 3, 9, 9, 9, 9], tree) == ([1, 5], 9)
    assert verify_tree_greedy([3, 8, 9, 9, 9, 4, 9], tree) == ([0, 4], 4)
    assert verify_tree_greedy([3, 1, 9, 9, 9, 9, 9], tree) == ([0], 1)
    assert verify_tree_greedy([7, 9, 9, 9, 9, 9, 9], tree) == ([], 7)


def test_certain_target_follows_its_branch_and_rows_are_lazy():
    tree = DraftTree([3, 5, 0, 5, 8], [ROOT, ROOT, ROOT, 0, 0])
    made = []
    certain = {0: 5, 2: 4}  # row -> the only token the target can draw

    def row(i):
        made.append(i)
        return sampling.one_hot(certain.get(i, 1), V)

    for _ in range(20):
        made.clear()
        assert verify_tree(lazy_rows(len(tree) + 1, row), tree, np.random.default_rng(0)) == ([1], 4)
        assert made == [0, 2]  # the rows of other branches are never processed
