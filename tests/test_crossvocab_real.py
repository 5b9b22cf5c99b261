"""Cross-vocabulary drafting on real models: SmolLM2-135M (49k vocabulary) drafting for gemma-3-270m
(262k, SentencePiece) and for Qwen2.5-Coder-1.5B (152k, another BPE).

Greedy losslessness is the teacher-forced check of test_real.py: every emitted token within a small
tolerance of the target's best logit at its position, evaluated in one fresh batch.
"""

from __future__ import annotations

import json

import pytest
from real_models import (
    GREEDY, TOLERANCE, count_draft_prefills, prompt_ids_for, quiet_chat_session, run, specchat, teacher_forced_gaps,
)

from specchat import kinds
from specchat.backend import LlamaCppBackend
from specchat.config import load_config
from specchat.crossvocab import CrossVocabDrafter
from specchat.loader import LoadOptions, Selection, load
from specchat.runner import RunOptions
from specchat.sampling import SamplingParams
from specchat.sources import resolve
from specchat.vocab import check_compatible

pytestmark = pytest.mark.real

DRAFT = "smollm2-135m"
PROMPTS = {
    "gemma-3-270m": [
        "Write a short paragraph about the history of Paris.",
        "List the days of the week, one per line.",
    ],
    # one prompt: a 1.5B target is the suite's dearest model on 2 cores
    "qwen2.5-coder-1.5b": ["Write a Python function `is_palindrome(s)` that ignores case and punctuation."],
}


def backend(name: str, n_ctx: int = 1024) -> LlamaCppBackend:
    return LlamaCppBackend(resolve(load_config().model(name)), n_ctx=n_ctx, n_threads=2, name=name)


@pytest.fixture(scope="module")
def draft():
    b = backend(DRAFT)
    yield b
    b.close()


@pytest.fixture(scope="module", params=list(PROMPTS))
def target(request):
    b = backend(request.param)
    yield b
    b.close()


def test_the_pair_needs_a_cross_vocabulary_drafter(target, draft):
    assert check_compatible(target.vocab, draft.vocab) is not None  # llama.cpp's rule refuses it
    drafter = CrossVocabDrafter(draft, target)
    assert drafter.kind is kinds.DRAFT_MODEL
    assert 0.5 < drafter.map.shared_fraction < 1.0  # most of SmolLM2's tokens exist in the target too
    # the same text in each vocabulary: " world" is one token in all three
    world = draft.tokenize(" world", add_special=False)
    assert [int(drafter.map.to_target[t]) for t in world] == target.tokenize(" world", add_special=False)


@pytest.mark.parametrize("rule", ["slem", "tli"])
def test_greedy_cross_vocab_is_the_targets_greedy_choice(target, draft, rule):
    drafter = CrossVocabDrafter(draft, target, rule=rule, p_min=0.0)
    accepted = 0
    for text in PROMPTS[target.name]:
        prompt_ids = prompt_ids_for(target, text)
        finished, tokens = run(target, drafter, prompt_ids, GREEDY, k=4, max_tokens=32)
        assert len(finished.token_ids) >= 8
        gaps = teacher_forced_gaps(target, prompt_ids, finished.token_ids)
        assert gaps.max() <= TOLERANCE, f"{text[:30]}: token {int(gaps.argmax())} is {gaps.max():.3f} below the best"
        assert finished.stats.rollback_recoveries == 0
        accepted += finished.stats.accepted
    assert accepted > 5 and drafter.rules_run[rule] > 0  # another model's text, yet often the target's


def test_a_seed_reproduces_a_sampled_tli_run(target, draft):
    drafter = CrossVocabDrafter(draft, target, p_min=0.0)
    params = SamplingParams(temperature=0.8, seed=4321)
    assert drafter.rule_for(params) == "tli"
    prompt_ids = prompt_ids_for(target, PROMPTS[target.name][0])
    first, _ = run(target, drafter, prompt_ids, params, k=4, max_tokens=16)
    second, _ = run(target, drafter, prompt_ids, params, k=4, max_tokens=16)
    other, _ = run(target, drafter, prompt_ids, SamplingParams(temperature=0.8, seed=99), k=4, max_tokens=16)
    assert first.token_ids == second.token_ids and first.text == second.text
    assert other.token_ids != first.token_ids
    assert first.stats.drafted > 0


def test_a_two_turn_chat_reuses_the_drafts_cache(tmp_path):
    """The draft holds the conversation in its own tokens: turn 2 evaluates only the new text."""
    config = load_config()
    loaded = load(config, Selection("gemma-3-270m", DRAFT), LoadOptions(n_ctx=1024, n_threads=2, draft_p_min=0.0))
    try:
        assert isinstance(loaded.drafter, CrossVocabDrafter)
        run_opts = RunOptions(Selection("gemma-3-270m", DRAFT), LoadOptions(n_ctx=1024), SamplingParams(temperature=0.0),
                              4, 4, 16)
        session = quiet_chat_session(loaded, run_opts, tmp_path / "t.jsonl")
        drafter = loaded.drafter
        prefilled = count_draft_prefills(drafter)
        session.handle("Name three colours, then say why you chose them.")
        session.handle("Now name three animals.")
        first, second = session.turn_log
        assert second["prompt_evaluated"] < second["prompt_tokens"] // 2  # the target reused its cache
        # the draft too: turn 2's prefill reads about the new message, not the whole conversation again
        held = len(drafter._ids)
        assert len(prefilled) == 2 and prefilled[0] >= first["prompt_tokens"] - 2
        assert prefilled[1] <= second["prompt_tokens"] - first["prompt_tokens"] - first["generated"] + 8 < held
        assert loaded.drafter.rules_run["slem"] > 0
    finally:
        loaded.close()


# -- the command line ----------------------------------------------------------------------------------


def test_prompt_json_says_which_rule_ran(measured_home):
    result = specchat("prompt", "Write one sentence about the sea.", "--pair", "smollm2-gemma", "--json",
                      "--temp", "0.8", "--seed", "3", "-n", "16", "--draft-fixed", "3", "--draft-p-min", "0",
                      home=measured_home)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["drafter"] == DRAFT and doc["target"] == "gemma-3-270m"
    assert doc["cross_vocab"]["rule"] == "tli" and doc["cross_vocab"]["requested"] == "auto"
    assert 0.5 < doc["cross_vocab"]["shared_fraction"] < 1.0
    assert doc["stats"]["drafted"] > 0
    forced = specchat("prompt", "Say hi.", "--pair", "smollm2-gemma", "--json", "--temp", "0.8", "-n", "4",
                      "--cross-vocab", "slem", home=measured_home)
    assert json.loads(forced.stdout)["cross_vocab"]["rule"] == "slem"
    same = specchat("prompt", "Say hi.", "--pair", "smollm2-self", "--json", "-n", "4", home=measured_home)
    assert "cross_vocab" not in json.loads(same.stdout)  # same vocabulary: nothing to say


def test_report_runs_and_projects_a_cross_vocab_pair(tmp_path, measured_home):
    out = tmp_path / "rep"
    result = specchat("report", "--pair", "smollm2-gemma", "--limit", "2", "-n", "32", "--sweep", "0,3",
                      "--draft-p-min", "0", "--out", str(out), home=measured_home, timeout=600)
    assert result.returncode == 0, result.stderr
    doc = json.loads((out / "report.json").read_text())
    assert doc["drafter"] == f"{DRAFT} (cross-vocab SLEM)" and doc["cross_vocab"]["rule"] == "slem"
    assert doc["drafter_kind"] == "draft-model"
    row = doc["summary"]["all"]["k=3"]
    assert row["drafted"] > 0 and row["draft_cost_ratio"] is not None and row["projected_speedup"] is not None
    assert doc["projected"]["all"] is not None
    assert "Projected" in result.stdout


def test_models_shows_the_vocabulary_column(measured_home):
    result = specchat("models", home=measured_home, env={"COLUMNS": "400"})
    assert result.returncode == 0, result.stderr
    lines = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 4}
    assert "vocabulary" in result.stdout
    assert "different tokenizers:" in lines["smollm2-gemma"] and "% of the draft's tokens" in lines["smollm2-gemma"]
    assert "same vocabulary" in lines["smollm2-self"]


def test_hybrid_keeps_the_rule_in_json(measured_home):
    """--hybrid puts prompt lookup in front of the draft with another tokenizer: --json still says which
    rule that draft runs."""
    result = specchat("prompt", "Say hi.", "--pair", "smollm2-gemma", "--hybrid", "--json", "-n", "8", "--temp", "0",
                      home=measured_home)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["drafter"] == f"prompt-lookup + {DRAFT}" and doc["cross_vocab"]["rule"] == "slem"
