"""Models whose cache cannot be cut (recurrent and hybrid architectures) on fakes: every rejected draft is
undone from a checkpoint, never by re-reading the conversation, and the output is still the target's.

`FakeBackend(memory="checkpoints")` computes its rows from the tokens its state has really seen, so a
cut that is not undone shows up as wrong rows (or as a counted recovery). The same paths on real llama.cpp
architectures are in test_hybrid_models.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import ALPHA, CHATML, FakeBackend, chi2_pvalue, first_two_emitted, make_draft_model

import specchat
from specchat.backend import BackendError
from specchat.engine import Finished, TokenEvent, generate
from specchat.costs import CostModel
from specchat.policy import FixedPolicy, best_length
from specchat.sampling import SamplingParams, process
from specchat.stats import StepStats

EV = 5
_rs = np.random.default_rng(21)
TABLE = _rs.normal(0, 0.8, (EV, EV)) + 2.0 * np.eye(EV)
DRAFT_TABLE = TABLE + _rs.normal(0, 0.9, (EV, EV))
PARITY = _rs.normal(0, 1.0, EV)  # the rows also depend on the context length: an extra token shows
PROMPT = [1, 3, 2, 4]
SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
GREEDY = SamplingParams(temperature=0.0)
DRAWS = 10_000


def context_logits(table):
    return lambda ctx: table[ctx[-1]] + (1 if len(ctx) % 2 else -1) * PARITY


def markov(table):
    return lambda ctx: table[ctx[-1]]


def recurrent_pair(draft_fn=context_logits(DRAFT_TABLE)):
    target = FakeBackend(context_logits(TABLE), EV, memory="checkpoints")
    drafter, draft = make_draft_model(draft_fn, EV, memory="checkpoints")
    return target, drafter, draft


def test_a_long_run_with_rejections_never_rereads_the_context():
    """Greedy on exact fakes: the text is plain greedy decoding's, drafts were rejected, and every cut of
    both caches went through a checkpoint: no recovery, only the kept tokens evaluated again."""
    target, drafter, draft = recurrent_pair(markov(TABLE))  # blind to the length: wrong at some positions
    events = list(generate(target, drafter, PROMPT, GREEDY, max_tokens=240, policy=FixedPolicy(4)))
    finished = events[-1]
    plain = list(generate(FakeBackend(context_logits(TABLE), EV), None, PROMPT, GREEDY, max_tokens=240))[-1]
    assert finished.token_ids == plain.token_ids and len(plain.token_ids) == 240
    sources = {e.source for e in events if isinstance(e, TokenEvent)}
    assert {"accepted", "resampled"} <= sources
    assert finished.stats.rollback_recoveries == 0
    assert target.rollback_recoveries == draft.rollback_recoveries == 0
    assert target.restores > 0 and draft.restores > 0
    # a restore evaluates again only what the step kept: at most the drafts and the step's first token
    assert target.reevaluated <= target.restores * 5
    assert target.tokens == (PROMPT + finished.token_ids)[:-1] == target.held


def test_without_checkpoints_the_cut_is_a_counted_recovery():
    """What the checkpoints prevent: the same run with them switched off re-reads the context on every
    rejection (each counted), and still gives the right text."""
    target, drafter, draft = recurrent_pair(markov(TABLE))
    target.checkpoint = lambda batch=None, turn=False: None
    draft.checkpoint = lambda batch=None, turn=False: None
    finished = list(generate(target, drafter, PROMPT, GREEDY, max_tokens=60, policy=FixedPolicy(4)))[-1]
    plain = list(generate(FakeBackend(context_logits(TABLE), EV), None, PROMPT, GREEDY, max_tokens=60))[-1]
    assert finished.token_ids == plain.token_ids
    assert finished.stats.rollback_recoveries > 5  # the draft model's recoveries count too
    assert draft.rollback_recoveries > 0


def expected_first_two(prompt, params):
    fn = context_logits(TABLE)
    p1 = np.asarray(process(np.asarray(fn(tuple(prompt))), params, prompt))
    joint = np.zeros((EV, EV))
    for a in range(EV):
        joint[a] = p1[a] * np.asarray(process(np.asarray(fn(tuple(prompt + [a]))), params, prompt + [a]))
    return joint


def test_the_checkpoint_path_is_lossless_when_sampling():
    """min(1, p/q) with a sampled draft model, k = 3, both caches recurrent: the first two emitted tokens
    (the second often from the step after a restore) follow the target's own joint distribution."""
    target, drafter, draft = recurrent_pair()
    rng = np.random.default_rng(7)
    counts = np.zeros((EV, EV), dtype=np.int64)
    for _ in range(DRAWS):
        a, b = first_two_emitted(generate(target, drafter, PROMPT, SAMPLED, max_tokens=8, policy=FixedPolicy(3),
                                          rng=rng))
        counts[a, b] += 1
    expected = expected_first_two(PROMPT, SAMPLED)
    pvalue = chi2_pvalue(counts, expected)
    assert pvalue > ALPHA, f"p={pvalue:.2e}\n{counts / DRAWS}\n{expected}"
    assert target.restores > 100 and draft.restores > 100  # the path under test ran


def test_the_check_sees_a_restore_that_forgets_the_kept_tokens():
    """The power of the check above: a backend that restores its checkpoint but drops the kept tokens
    (conditions the next step on a shorter context) fails it."""

    class Forgetful(FakeBackend):
        def _settle(self):
            saved = self._saved.get("step")
            if self.held != self.tokens and saved is not None:
                self.held = list(saved)
                self.tokens = list(saved)  # the bug: what was kept after the checkpoint is gone
                return
            super()._settle()

    target = Forgetful(context_logits(TABLE), EV, memory="checkpoints")
    drafter, _ = make_draft_model(context_logits(DRAFT_TABLE), EV)
    rng = np.random.default_rng(8)
    counts = np.zeros((EV, EV), dtype=np.int64)
    for _ in range(2_000):
        a, b = first_two_emitted(generate(target, drafter, PROMPT, SAMPLED, max_tokens=8, policy=FixedPolicy(3),
                                          rng=rng))
        counts[a, b] += 1
    assert chi2_pvalue(counts, expected_first_two(PROMPT, SAMPLED)) < 1e-6


def test_a_restore_that_fails_is_a_clear_error():
    target = FakeBackend(context_logits(TABLE), EV, memory="checkpoints", fail_restore=True)
    drafter, _ = make_draft_model(markov(TABLE), EV)
    with pytest.raises(BackendError, match="restoring the recurrent-state checkpoint of fake failed"):
        list(generate(target, drafter, PROMPT, GREEDY, max_tokens=100, policy=FixedPolicy(4)))
    # nothing half-done is kept: the state starts over and the next run reads the context again
    finished = list(generate(target, None, PROMPT, GREEDY, max_tokens=5))[-1]
    plain = list(generate(FakeBackend(context_logits(TABLE), EV), None, PROMPT, GREEDY, max_tokens=5))[-1]
    assert finished.token_ids == plain.token_ids


def _letters(skew: int):
    """A byte-vocabulary model whose next letter depends on the last token and the context length; with
    skew, every third position differs (a draft model that is mostly right)."""

    def fn(ctx):
        row = np.zeros(128, dtype=np.float32)
        row[97 + (ctx[-1] * 3 + len(ctx) + skew * (len(ctx) % 3 == 0)) % 7] = 10.0
        return row

    return fn


def test_a_two_turn_chat_evaluates_only_new_tokens():
    """Cache reuse across turns on a recurrent target: the second turn evaluates its new tokens and, at
    most, the few tokens the first turn's last step kept after a restore."""
    pieces = [bytes([i]) for i in range(128)]
    target = FakeBackend(_letters(0), 128, memory="checkpoints", pieces=pieces, chat_template=CHATML, eog=(0,))
    drafter, _ = make_draft_model(_letters(1), 128, memory="checkpoints", pieces=pieces, eog=(0,))
    chat = specchat.Conversation(target, drafter, params=GREEDY, max_tokens=30, policy=FixedPolicy(3))
    first = list(chat.send("Hello"))
    held = list(target.tokens)
    second = list(chat.send("And again"))[-1]
    assert {e.source for e in first if isinstance(e, TokenEvent)} >= {"accepted", "resampled"}
    assert isinstance(second, Finished) and second.prompt_token_ids[: len(held)] == held
    new = len(second.prompt_token_ids) - len(held)
    # the prompt's new tokens, plus what the first turn's last restore kept (at most its step's 4 tokens)
    assert new <= second.stats.prompt_tokens_evaluated <= new + 4
    assert target.restores > 0 and target.rollback_recoveries == 0


# -- the policy prices checkpoints ----------------------------------------------------------------------

GPU = CostModel([1, 2, 4, 8, 16], [0.020, 0.0202, 0.0205, 0.021, 0.022])  # verifying 8 ~ 1 token


def test_a_checkpoint_that_costs_more_than_drafting_gains_stops_drafting():
    """The same acceptance on the same machine: drafting pays without checkpoint costs, not when each
    drafting step pays 200 ms of copies and restores; in between it still pays, with a longer draft."""
    a = np.full(16, 0.8)
    assert best_length(a, GPU)[0] > 0
    assert best_length(a, GPU, rollback=0.2)[0] == 0
    n_cheap, rate_cheap = best_length(a, GPU, rollback=0.005)
    assert n_cheap >= best_length(a, GPU)[0] and rate_cheap < best_length(a, GPU)[1]


def test_the_policy_learns_the_checkpoint_cost_from_the_steps():
    from fakes import modelled, sent

    policy, drafter = modelled(GPU, CostModel([1], [0.001]))
    assert sent(policy, drafter, limit=8) > 0
    for _ in range(40):  # every drafting step spent 200 ms on its checkpoint; the drafts were good
        policy.observe(StepStats(step=0, drafted=4, accepted=3, emitted=4, draft_seconds=0.004,
                                 verify_seconds=0.021, rollback_seconds=0.2), [1, 2, 3, 9])
    assert policy.rollback == pytest.approx(0.2, rel=0.01)
    assert sent(policy, drafter, limit=8) == 0


@pytest.mark.tiny
def test_a_model_that_cannot_be_cut_gets_drafting_off(monkeypatch, tmp_path):
    """llama.cpp can neither cut nor copy its state: the pair loads without a drafter, and says why."""
    import tiny_models

    from specchat.backend import LlamaCppBackend
    from specchat.config import load_config
    from specchat.loader import LoadOptions, Selection, load
    from specchat.loader import make_policy
    from specchat.memory import MemoryKind

    target, draft = tiny_models.write_pair(tmp_path, "mamba2")
    monkeypatch.setattr(LlamaCppBackend, "_memory_kind", lambda self: MemoryKind("none", "mamba2"))
    loaded = load(load_config(), Selection(str(target), str(draft)), LoadOptions(n_ctx=256, n_threads=2))
    try:
        assert loaded.drafter is None and loaded.drafter_label == "none"
        assert "drafting off" in loaded.drafting_off and "mamba2" in loaded.drafting_off
        assert "\n" not in loaded.drafting_off
        assert isinstance(make_policy(loaded, 16, None), FixedPolicy)
        assert "cannot be cut back" in loaded.memory_line()
    finally:
        loaded.close()


@pytest.mark.tiny
@pytest.mark.parametrize("arch, reserved", [("llama", 17), ("qwen35", 1)])
def test_a_target_reserves_its_longest_verify_where_that_costs_no_recurrent_states(tmp_path, arch, reserved):
    """A drafting target reserves the logits rows of its longest verify (--draft-max + 1) at load, through
    n_seq_max (see backend.outputs_to_reserve); a recurrent or hybrid one would get a state per sequence
    for it, so it does not; a target that does not draft reserves nothing."""
    import llama_cpp
    import tiny_models

    from specchat.config import load_config
    from specchat.kinds import PROMPT_LOOKUP
    from specchat.loader import LoadOptions, Selection, load

    target, _ = tiny_models.write_pair(tmp_path, arch)
    for draft, expected in ((PROMPT_LOOKUP.word, reserved), (None, 1)):
        loaded = load(load_config(), Selection(str(target), draft), LoadOptions(n_ctx=256, n_threads=2, draft_max=16))
        try:
            assert loaded.target.reserved_outputs == expected, draft
            assert llama_cpp.llama_n_seq_max(loaded.target.llm.ctx) == expected
            assert llama_cpp.llama_n_ctx(loaded.target.llm.ctx) == 256  # one cache, not split per sequence
        finally:
            loaded.close()
