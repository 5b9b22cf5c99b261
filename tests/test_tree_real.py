"""Draft trees on a real model (SmolLM2-135M): one llama_decode per tree, each node's logits those of its
own path, the kept branch a cache like any other; greedy generation with lookup's trees teacher-forced
exact, as the chains of test_real.py are."""

from __future__ import annotations

import numpy as np
import pytest

from real_models import GREEDY, TOLERANCE, model_path, prompt_ids_for, teacher_forced_gaps
from specchat.backend import LlamaCppBackend
from specchat.engine import Finished, TokenEvent, generate
from specchat.lookup import PromptLookup
from specchat.policy import FixedPolicy
from specchat.tree import ROOT, DraftTree
from specchat.tree_drafts import TreePolicy

pytestmark = pytest.mark.real

NOISE = 0.15  # batched vs single-token logits differ by up to ~0.12 here (DESIGN.md)


@pytest.fixture(scope="module")
def target():
    backend = LlamaCppBackend(model_path("smollm2-135m"), n_ctx=1024, n_threads=2, name="smollm2-135m", outputs=16)
    yield backend
    backend.close()


def test_a_tree_decodes_in_one_batch_with_each_nodes_own_path(target):
    prompt = target.tokenize("The capital of France is Paris. The capital of Italy is")
    assert target.tree_capacity() >= 4
    target.truncate(0)
    target.eval(prompt[:-1], [])
    # three branches off the root, one of them two deep with a fork
    tree = DraftTree([5, 6, 7, 8, 9, 10], [ROOT, 0, 0, ROOT, 3, ROOT])
    tree.tokens = [int(t) for t in target.tokenize(" Rome. The capital of Spain")[:6]]
    evaluated = target.evaluated
    rows = np.array(target.eval_tree(prompt[-1], tree))
    assert target.evaluated - evaluated == len(tree) + 1 and len(rows) == len(tree) + 1
    target.keep_branch([3, 4])  # a branch that is not leaf 0's
    assert target.tokens == prompt + [tree.tokens[3], tree.tokens[4]]
    after = np.array(target.eval([7], [0])[0])
    for node in range(-1, len(tree)):
        path = tree.path_tokens(node)
        target.truncate(0)
        chain = target.eval(prompt + path, [len(prompt) + len(path) - 1])[0]
        assert np.abs(chain - rows[node + 1]).max() < NOISE, node
    # the kept branch, then one more token: the same as evaluating that context afresh
    target.truncate(0)
    fresh = target.eval(prompt + [tree.tokens[3], tree.tokens[4], 7], [len(prompt) + 2])[0]
    assert np.abs(fresh - after).max() < NOISE
    assert target.rollback_recoveries == 0
    target.truncate(0)


def run(target, drafter, prompt_ids, policy, max_tokens=64):
    events = list(generate(target, drafter, prompt_ids, GREEDY, max_tokens=max_tokens, policy=policy))
    finished = events[-1]
    assert isinstance(finished, Finished)
    return finished, [e for e in events if isinstance(e, TokenEvent)]


def test_greedy_with_lookup_trees_is_the_targets_greedy_choice(target):
    trees = []
    real_eval_tree = target.eval_tree

    def counting(root, tree):
        trees.append(len(tree))
        return real_eval_tree(root, tree)

    target.eval_tree = counting
    try:
        for text in ["Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape.",
                     "Count from one to twenty in words, separated by commas."]:
            prompt_ids = prompt_ids_for(target, text)
            chain, _ = run(target, PromptLookup(1, 4), prompt_ids, FixedPolicy(6))
            finished, tokens = run(target, PromptLookup(1, 4), prompt_ids, TreePolicy(FixedPolicy(6), 12))
            gaps = teacher_forced_gaps(target, prompt_ids, finished.token_ids)
            assert gaps.max() <= TOLERANCE, f"token {int(gaps.argmax())} is {gaps.max():.3f} below the best logit"
            assert finished.stats.rollback_recoveries == 0
            # batch shapes differ between the two runs, so a near-tie could flip; none does on these prompts
            assert finished.token_ids == chain.token_ids
    finally:
        del target.eval_tree
    assert trees and max(trees) <= 12


def test_greedy_with_draft_model_trees_is_the_targets_greedy_choice(target):
    from specchat.drafters import DraftModel

    draft = LlamaCppBackend(model_path("smollm2-135m"), n_ctx=1024, n_threads=2, name="smollm2-135m-draft")
    try:
        drafter = DraftModel.checked(draft, target, p_min=0.0)
        prompt_ids = prompt_ids_for(target, "Write a Python function that returns the sum of the squares of a list.")
        chain, _ = run(target, drafter, prompt_ids, FixedPolicy(4), max_tokens=40)
        evaluated = target.evaluated
        finished, tokens = run(target, drafter, prompt_ids, TreePolicy(FixedPolicy(4), 8), max_tokens=40)
        assert finished.stats.nodes > finished.stats.drafted  # trees went
        gaps = teacher_forced_gaps(target, prompt_ids, finished.token_ids)
        assert gaps.max() <= TOLERANCE, f"token {int(gaps.argmax())} is {gaps.max():.3f} below the best logit"
        assert finished.stats.rollback_recoveries == 0 and target.evaluated > evaluated
        assert finished.token_ids == chain.token_ids
    finally:
        draft.close()
