"""The real same-family pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct
(the [qwen] extra: part packages joined once into the cache dir, checked against their sha256).

Greedy losslessness is the teacher-forced check of test_real.py (batched and single-token logits differ
slightly, so plain and speculative greedy output may diverge at near-ties).
"""

from __future__ import annotations

import json

import pytest
from real_models import (
    GREEDY, TOLERANCE, count_draft_prefills, prompt_ids_for, quiet_chat_session, run, teacher_forced_gaps,
)

from specchat.backend import LlamaCppBackend
from specchat.config import load_config
from specchat.drafters import DraftModel
from specchat.loader import LoadOptions, Selection, load
from specchat.policy import AdaptivePolicy
from specchat.loader import make_policy
from specchat.runner import RunOptions
from specchat.sampling import SamplingParams
from specchat.sources import resolve
from specchat.vocab import check_compatible

pytestmark = pytest.mark.real

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
CODE_PROMPTS = [
    "Write a Python function `is_palindrome(s)` that ignores case and punctuation.",
    "Rewrite this loop as a list comprehension: result = []\nfor x in data:\n    if x > 0:\n        result.append(x * 2)",
    "Explain in two sentences what a Python dictionary is.",
]


@pytest.fixture(scope="module")
def target():
    backend = LlamaCppBackend(resolve(load_config().model(TARGET)), n_ctx=2048, n_threads=2, name=TARGET)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def draft():
    backend = LlamaCppBackend(resolve(load_config().model(DRAFT)), n_ctx=2048, n_threads=2, name=DRAFT)
    yield backend
    backend.close()


def test_the_pair_is_compatible_by_llama_cpps_rule(target, draft):
    assert target.n_vocab == draft.n_vocab == 151936
    assert check_compatible(target.vocab, draft.vocab) is None
    assert "<|im_start|>" in (target.chat_template or "")


def test_greedy_with_the_real_draft_is_the_targets_choice(target, draft):
    drafter = DraftModel.checked(draft, target, p_min=0.0)
    accepted = 0
    for text in CODE_PROMPTS[:2]:  # code, where a same-family draft is right most of the time
        prompt_ids = prompt_ids_for(target, text)
        finished, tokens = run(target, drafter, prompt_ids, GREEDY, k=4, max_tokens=40)
        # a whole reply or 40 tokens: where the model ends a short answer depends on the build's numerics
        # ("...is an unordered collection of key-value pairs." ends at 12 tokens on an AVX-512 build)
        assert finished.finish_reason == "eog" and len(finished.token_ids) >= 8 or len(finished.token_ids) == 40
        gaps = teacher_forced_gaps(target, prompt_ids, finished.token_ids)
        assert gaps.max() <= TOLERANCE, f"{text[:30]}: token {int(gaps.argmax())} is {gaps.max():.3f} below the best"
        assert finished.stats.rollback_recoveries == 0
        accepted += finished.stats.accepted
    assert accepted > 15  # of 80 tokens


def test_a_seed_reproduces_a_sampled_run(target, draft):
    drafter = DraftModel.checked(draft, target, p_min=0.0)
    params = SamplingParams(temperature=0.8, seed=4321)
    prompt_ids = prompt_ids_for(target, CODE_PROMPTS[0])
    first, _ = run(target, drafter, prompt_ids, params, k=4, max_tokens=20)
    second, _ = run(target, drafter, prompt_ids, params, k=4, max_tokens=20)
    other, _ = run(target, drafter, prompt_ids, SamplingParams(temperature=0.8, seed=99), k=4, max_tokens=20)
    assert first.token_ids == second.token_ids and first.text == second.text
    assert other.token_ids != first.token_ids
    assert first.stats.accepted > 0


def test_a_long_sampled_run_with_rollbacks_on_both_caches(target, draft):
    drafter = DraftModel.checked(draft, target, p_min=0.0)
    params = SamplingParams(temperature=0.8, seed=11, banned=target.eog_tokens())  # --ignore-eos
    prompt_ids = prompt_ids_for(target, "Write a long Python module with several small utility functions.")
    recoveries = (target.rollback_recoveries, draft.rollback_recoveries)
    finished, _ = run(target, drafter, prompt_ids, params, k=4, max_tokens=128)
    assert len(finished.token_ids) == 128
    assert finished.stats.drafted > finished.stats.accepted > 0  # rejections: both caches were cut back
    assert (target.rollback_recoveries, draft.rollback_recoveries) == recoveries
    context = prompt_ids + finished.token_ids
    assert target.tokens == context[:-1]
    assert draft.tokens == context[: len(draft.tokens)]  # the draft's cache is a prefix of the conversation


@pytest.fixture(scope="module")
def loaded():
    """The pair as the loader gives it to a command, loaded once for the two tests below."""
    pair = load(load_config(), Selection(TARGET, DRAFT), LoadOptions(n_ctx=1024, n_threads=2, draft_p_min=0.0))
    yield pair
    pair.close()


def test_the_policy_measures_the_draft_models_cost(loaded):
    from specchat.paths import cache_dir
    from specchat.costs import cost_cache_key

    policy = make_policy(loaded, 16, None)
    draft_cost = policy.members[0].draft_cost
    assert isinstance(policy, AdaptivePolicy) and draft_cost is not None
    # measured, not assumed: each model timed on its own (no bound on the ratio: that would be a timed
    # assertion, and a loaded machine moves it; the policy benchmark reports it)
    assert draft_cost(1) > 0 and draft_cost.seconds != policy.verify_cost.seconds
    costs = json.loads((cache_dir() / "costs.json").read_text())  # both models timed and cached
    for backend in (loaded.target, loaded.drafter.backend):
        entry = costs[cost_cache_key(backend)]
        assert entry["name"] == backend.name and len(entry["sizes"]) == len(entry["seconds"]) >= 4


def test_a_two_turn_chat_evaluates_only_the_new_tokens_on_both_models(loaded, tmp_path):
    # a fresh conversation on both caches, whatever ran on the pair before
    loaded.target.truncate(0)
    loaded.drafter.backend.truncate(0)
    # a fixed k: on this CPU the adaptive policy would not run the draft at all
    run_opts = RunOptions(Selection(TARGET, DRAFT), LoadOptions(n_ctx=1024), SamplingParams(temperature=0.0),
                          4, 4, 24)
    session = quiet_chat_session(loaded, run_opts, tmp_path / "t.jsonl")
    drafter = loaded.drafter
    prefilled = count_draft_prefills(drafter)
    session.handle("Write a one-line Python expression that reverses a string s.")
    held = session.conversation.ids
    session.handle("Now do the same for a list.")
    first, second = session.turn_log
    message_tokens = len(loaded.target.tokenize("Now do the same for a list.", add_special=False))
    # the target: only the new message and a few template tokens
    assert second["prompt_evaluated"] <= message_tokens + 12 < len(held)
    # the draft: the same, and its cache was rolled back with the target's (no recovery needed)
    assert len(prefilled) == 2 and prefilled[0] >= first["prompt_tokens"] - 1
    assert prefilled[1] <= message_tokens + 12 + 4 < len(held)
    assert loaded.target.rollback_recoveries == 0 and drafter.backend.rollback_recoveries == 0
