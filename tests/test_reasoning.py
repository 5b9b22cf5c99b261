"""Reasoning models: thinking markers read from templates, the reply split into thought and answer token by
token, the --reasoning-budget state machine (llama.cpp's reasoning-budget sampler), and the budget's
losslessness through the whole loop (chi-square on fakes, with a control that must fail)."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from fakes import (
    ALPHA, FakeBackend, chi2_pvalue, detection_power, first_two_emitted, make_draft_model, markov_logits,
    script_logits,
)
from specchat import engine
from specchat.engine import Finished, StepEvent, TokenEvent, generate
from specchat.jinja_chat import render_chat
from specchat.policy import FixedPolicy
from specchat.reasoning import (
    HARMONY, Budget, Markers, PhaseSplitter, Reasoning, Split, find_markers, opens_thought, split_events,
)
from specchat.sampling import SamplingParams, process

# -- markers ------------------------------------------------------------------------------------------------

# the shapes of real templates (llama.cpp's models/templates): Qwen3 keeps reasoning_content in its last
# turn and opens nothing; the R1 distills drop the thought from history and open it in the prompt;
# Command-R7B has its own markers; gpt-oss writes channels
QWEN3 = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
R1_DISTILL = (
    "{{ bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{%- else %}<｜Assistant｜>{{ m.content.split('</think>')[-1] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)
COMMAND_R = (
    "{%- for m in messages %}<|START_OF_TURN_TOKEN|>{{ m.role }}"
    "{%- if m.reasoning_content %}<|START_THINKING|>{{ m.reasoning_content }}<|END_THINKING|>{% endif %}"
    "{{ m.content }}<|END_OF_TURN_TOKEN|>{% endfor %}"
    "{%- if add_generation_prompt %}<|START_OF_TURN_TOKEN|>assistant{% endif %}"
)
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def _render(source):
    return lambda messages, gen, thinking: render_chat(source, messages, add_generation_prompt=gen,
                                                       enable_thinking=thinking)


@pytest.mark.parametrize("source, markers, inside", [
    (QWEN3, Markers("<think>", "</think>"), False),
    (R1_DISTILL, Markers("<think>", "</think>"), True),
    (COMMAND_R, Markers("<|START_THINKING|>", "<|END_THINKING|>"), False),
    ("{{ '<|channel|>analysis<|message|>' }}" + PLAIN, Markers(*HARMONY), False),
], ids=["qwen3", "r1-distill", "command-r", "gpt-oss"])
def test_markers_are_read_from_the_template(source, markers, inside):
    found = find_markers(source, _render(source))
    assert found == markers
    prompt = _render(source)([{"role": "user", "content": "hi"}], True, True)
    assert opens_thought(prompt, found) is inside


def test_a_template_without_thinking_has_no_markers():
    assert find_markers(PLAIN, _render(PLAIN)) is None
    assert opens_thought("<|im_start|>assistant\n<think>\n", None) is False


def test_thinking_off_closes_the_thought_in_the_prompt():
    prompt = _render(QWEN3)([{"role": "user", "content": "hi"}], True, False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and not opens_thought(prompt, Markers("<think>", "</think>"))


# -- the split, token by token ------------------------------------------------------------------------------

OPEN, CLOSE = [90, 91], [92]  # a marker of two tokens and one of one


def _phases(tokens, inside=False):
    splitter = PhaseSplitter([OPEN], [CLOSE], inside=inside)
    out = []
    for t in tokens:
        out += splitter.feed(t, t)
    return out + splitter.flush(), splitter


def test_markers_are_held_until_they_complete_and_belong_to_no_phase():
    out, _ = _phases([1, 90, 91, 2, 3, 92, 4])
    assert out == [("answer", 1), ("marker", 90), ("marker", 91), ("thought", 2), ("thought", 3),
                   ("marker", 92), ("answer", 4)]


def test_a_marker_prefix_that_does_not_complete_is_released_in_order():
    out, _ = _phases([1, 90, 5, 90, 90, 91, 6])
    assert out == [("answer", 1), ("answer", 90), ("answer", 5), ("answer", 90), ("marker", 90), ("marker", 91),
                   ("thought", 6)]


def test_a_prompt_that_opened_the_thought_starts_in_it():
    out, _ = _phases([2, 92, 4], inside=True)
    assert out == [("thought", 2), ("marker", 92), ("answer", 4)]


def test_an_end_marker_with_no_thought_open_is_answer_text():
    # as llama.cpp's parsers keep it: "I should recall it.</think>The capital is Paris." stays content
    out, _ = _phases([2, 3, 92, 4])
    assert out == [("answer", 2), ("answer", 3), ("answer", 92), ("answer", 4)]


def test_split_events_sets_phases_and_the_split_like_llama_server():
    pieces = {1: "Hi", 90: "<th", 91: "ink>", 2: "\nLet me see.", 3: " Two.\n", 92: "</think>", 4: "\n\nTwo", 5: "."}
    ids = [90, 91, 2, 3, 92, 4, 5]
    events = [TokenEvent(t, pieces[t], "accepted", 0) for t in ids]
    finished = Finished("".join(pieces[t] for t in ids), ids, "eog", None)
    reasoning = Reasoning(Markers("<think>", "</think>"), {"start": [OPEN], "end": [CLOSE], "answer": []})
    out = list(split_events([*events, finished], reasoning))
    tokens = [e for e in out if isinstance(e, TokenEvent)]
    assert [(e.id, e.phase, e.text) for e in tokens] == [
        (90, "marker", ""), (91, "marker", ""), (2, "thought", "\nLet me see."), (3, "thought", " Two.\n"),
        (92, "marker", ""), (4, "answer", "\n\nTwo"), (5, "answer", ".")]
    assert all(e.source == "accepted" for e in tokens)  # where each token came from is kept
    split = out[-1].split
    assert (split.reasoning_content, split.content) == ("Let me see. Two.", "Two.")
    assert (split.thought_tokens, split.answer_tokens) == (2, 2)
    # deepseek-legacy: the split is made, the text is left whole
    legacy = Reasoning(reasoning.markers, reasoning.ids, format="deepseek-legacy")
    out = list(split_events([*events, finished], legacy))
    assert [e.text for e in out if isinstance(e, TokenEvent)] == [pieces[t] for t in ids]
    assert out[-1].split.content == finished.text and out[-1].split.reasoning_content == "\nLet me see. Two.\n"
    # none: nothing is split
    assert list(split_events([*events, finished], Reasoning(reasoning.markers, reasoning.ids, format="none"))) \
        == [*events, finished]


def test_split_add_counts_by_phase():
    split = Split()
    split.add("thought", "a")
    split.add("answer", "b", 2)
    assert (split.reasoning_content, split.content, split.thought_tokens, split.answer_tokens) == ("a", "b", 1, 2)


# -- the budget: llama.cpp's state machine ------------------------------------------------------------------

END = [92]
MESSAGE = [7, 8]


def _feed(budget, tokens):
    forced = []
    for t in tokens:
        forced.append(budget.forced())
        budget.accept(t)
    return forced


def test_budget_counts_the_thought_then_forces_the_message_and_the_end():
    budget = Budget([OPEN], [END], MESSAGE + END, 3)
    assert budget.state == Budget.IDLE
    _feed(budget, [1, 90, 91])  # the thought opens: counting starts
    assert budget.state == Budget.COUNTING
    assert _feed(budget, [2, 3, 4]) == [None, None, None]
    assert budget.state == Budget.FORCING and budget.forced() == 7 and budget.forced_rest() == [7, 8, 92]
    assert _feed(budget, [7, 8, 92]) == [7, 8, 92]
    assert budget.state == Budget.DONE and budget.forced() is None and budget.forced_count == 3
    _feed(budget, [5, 6, 90, 91])  # a new thought re-arms it
    assert budget.state == Budget.COUNTING and budget.remaining == 3


def test_budget_natural_end_and_zero_and_inside():
    budget = Budget([OPEN], [END], END, 5, inside=True)
    _feed(budget, [2, 92])
    assert budget.state == Budget.DONE and budget.forced_count == 0
    zero = Budget([OPEN], [END], END, 0, inside=True)
    assert zero.state == Budget.FORCING and zero.forced() == 92


def test_budget_waits_for_the_end_of_a_character():
    budget = Budget([OPEN], [END], END, 1, inside=True, complete=lambda t: t != 50)
    _feed(budget, [50])  # the budget is spent on the first byte of a character
    assert budget.state == Budget.WAITING and budget.forced() is None
    _feed(budget, [51])
    assert budget.forced() == 92


def test_lookahead_says_which_positions_are_forced_and_changes_nothing():
    budget = Budget([OPEN], [END], MESSAGE + END, 2, inside=True)
    # position 2 is forced; a draft there other than 7 is rejected, so what follows it is never verified
    assert budget.lookahead([1, 2, 3, 4]) == [None, None, 7, 8, 92]
    assert budget.state == Budget.COUNTING and budget.remaining == 2 and budget.recent == []
    assert budget.lookahead([1, 2, 7, 8, 92]) == [None, None, 7, 8, 92, None]


# -- the budget through the loop ----------------------------------------------------------------------------

V = 4
THINK_END = 3  # the end marker: one token (token 2 opens a thought)
_rs = np.random.default_rng(21)
TARGET = _rs.normal(0, 1.0, (V, V))
TARGET[:, THINK_END] -= 1.0  # the model ends its thought itself now and then
DRAFT = TARGET + _rs.normal(0, 0.7, (V, V))
PARAMS = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
PROMPT = [0, 1, 2]
BUDGET = 1
DRAWS = 10_000


def _budget():
    return Budget([[2]], [[THINK_END]], [THINK_END], BUDGET, inside=True)


def expected_first_two() -> np.ndarray:
    """P(t1, t2) under the budgeted target: its own distribution, one-hot where the budget forces (t2 is
    the end marker unless t1 was)."""
    fn = markov_logits(TARGET)
    joint = np.zeros((V, V))
    for seq in itertools.product(range(V), repeat=2):
        budget, ctx, prob = _budget(), list(PROMPT), 1.0
        for t in seq:
            forced = budget.forced()
            if forced is not None:
                p_t = float(t == forced)
            else:
                p_t = float(np.asarray(process(np.asarray(fn(tuple(ctx))), PARAMS, ctx))[t])
            prob *= p_t
            if prob == 0:
                break
            budget.accept(t)
            ctx.append(t)
        joint[seq] = prob
    return joint


def first_two_counts(seed: int, n: int) -> np.ndarray:
    target = FakeBackend(markov_logits(TARGET), V)
    drafter, _ = make_draft_model(markov_logits(DRAFT), V)
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(n):  # three drafts: the second and third fall where the budget may force
        gen = generate(target, drafter, PROMPT, PARAMS, max_tokens=4, policy=FixedPolicy(3), rng=rng,
                       budget=_budget())
        counts[first_two_emitted(gen)] += 1
    return counts


def test_a_budgeted_reply_is_the_budgeted_targets_whatever_is_drafted():
    expected = expected_first_two()
    assert detection_power(DRAWS, expected, delta=0.03) >= 0.85
    counts = first_two_counts(31, DRAWS)
    pvalue = chi2_pvalue(counts, expected)
    assert pvalue > ALPHA, f"p={pvalue:.2e}"


def test_the_budget_check_fails_where_drafts_are_verified_against_the_unbudgeted_target(monkeypatch):
    """The control: the forced tokens are still sent while forcing, but a draft that runs into a forced
    position is verified against the model's own distribution there. The same check must see it."""
    verify_step = engine.verify_step
    monkeypatch.setattr(engine, "verify_step", lambda *args: verify_step(*args[:6]))
    counts = first_two_counts(32, 2_000)
    assert chi2_pvalue(counts, expected_first_two()) < 1e-12


def test_a_greedy_budget_forces_the_end_and_the_cache_follows():
    target = FakeBackend(markov_logits(np.eye(V) * 5.0), V)  # repeats its last token forever
    drafter, _ = make_draft_model(markov_logits(np.eye(V) * 5.0), V)
    budget = Budget([[9]], [[THINK_END]], [0, THINK_END], 2, inside=True)
    events = list(generate(target, drafter, [0, 1, 1], SamplingParams(temperature=0.0), max_tokens=6,
                           policy=FixedPolicy(4), budget=budget))
    tokens = [(e.id, e.source) for e in events if isinstance(e, TokenEvent)]
    # two thought tokens of its own, then the message and the end marker forced, then it goes on
    assert [t for t, _ in tokens] == [1, 1, 0, THINK_END, THINK_END, THINK_END]
    assert budget.forced_count == 2 and events[-1].stats.emitted == 6
    assert target.tokens == [0, 1, 1, 1, 1, 0, THINK_END, THINK_END, THINK_END][:-1]


def test_a_draft_that_runs_into_the_forced_end_carries_it_in_the_same_step():
    """The budget constrains q as it constrains p: where a draft reaches a forced position, the forced tokens
    take the place of the rest of it and are kept in that same step, shown as the target's; the drafter is
    credited with its own tokens only."""
    target = FakeBackend(markov_logits(np.eye(V) * 5.0), V)
    drafter, _ = make_draft_model(markov_logits(np.eye(V) * 5.0), V)
    budget = Budget([[9]], [[THINK_END]], [0, THINK_END], 2, inside=True)
    events = list(generate(target, drafter, [0, 1, 1], SamplingParams(temperature=0.0), max_tokens=6,
                           policy=FixedPolicy(4), budget=budget))
    first = [e for e in events if isinstance(e, StepEvent)][0].stats
    tokens = [(e.id, e.source, e.step) for e in events if isinstance(e, TokenEvent)]
    assert tokens[:5] == [(1, "accepted", 0), (1, "accepted", 0), (0, "target", 0), (THINK_END, "target", 0),
                          (THINK_END, "target", 0)]
    assert (first.drafted, first.accepted, first.emitted) == (2, 2, 5)
    assert budget.constrain([1, 1, 1], 3) == (3, [])  # nothing forced: the draft stands


class PhaseRecorder(FixedPolicy):
    def __init__(self, k):
        super().__init__(k)
        self.phases: list[str] = []

    def enter(self, phase):
        self.phases.append(phase)


def test_the_policy_is_told_the_phase_before_each_draft():
    """The engine follows the reply with a PhaseSplitter and tells the policy where each step drafts from:
    after the start marker the thought, after the end marker the answer (a marker counts once it completes)."""
    reply = [5, 2, 6, 6, THINK_END, 7, 7, 7]
    target = FakeBackend(script_logits(9, 3, reply), 9)
    drafter, _ = make_draft_model(script_logits(9, 3, reply), 9)
    policy = PhaseRecorder(1)
    events = list(generate(target, drafter, PROMPT, SamplingParams(temperature=0.0), max_tokens=len(reply),
                           policy=policy, phases=PhaseSplitter([[2]], [[THINK_END]])))
    assert [e.id for e in events if isinstance(e, TokenEvent)] == reply
    # steps of two tokens (one draft, accepted, and the bonus): they begin after 0, 2, 4 and 6 tokens
    assert policy.phases == ["answer", "thought", "thought", "answer"]


# -- the chat and the views with a thinking model (fakes) ---------------------------------------------------

import io  # noqa: E402
import json  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from specchat import chat, ui  # noqa: E402
from specchat.loader import Loaded, LoadOptions, Selection  # noqa: E402
from specchat.runner import RunOptions  # noqa: E402
from specchat.transcript import load_transcript  # noqa: E402

# a DeepSeek-R1-distill-shaped ChatML template: the prompt opens the thought, history keeps the answer only
THINKING_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content.split('</think>')[-1] if m.role == 'assistant' else m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
CHAT_VOCAB, CHAT_EOG = 128, 0
THOUGHT, ANSWER = "Two and two.", "Four."


def thinking_logits(ctx: tuple[int, ...]) -> np.ndarray:
    """Writes THOUGHT, then </think>, then ANSWER, then stops: one byte a token, after the opened thought."""
    text = bytes(ctx).decode("latin-1")
    written = text[text.rfind("<think>\n") + len("<think>\n"):]
    reply = f"{THOUGHT}\n</think>\n\n{ANSWER}"
    row = np.zeros(CHAT_VOCAB, dtype=np.float32)
    row[ord(reply[len(written)]) if len(written) < len(reply) else CHAT_EOG] = 10.0
    return row


def thinking_session(tmp_path, *, budget: int = -1, live=False, make_view=None):
    target = FakeBackend(thinking_logits, CHAT_VOCAB, eog=(CHAT_EOG,), pieces=[bytes([i]) for i in range(CHAT_VOCAB)],
                         chat_template=THINKING_CHATML)
    target.bos_text = target.eos_text = ""
    loaded = Loaded(target, None, SimpleNamespace(name="fake"), None, "none")
    from specchat.reasoning import ReasoningOptions

    run = RunOptions(Selection("fake", None), LoadOptions(n_ctx=4096), SamplingParams(temperature=0.0), 8, None, 64,
                     reasoning=ReasoningOptions(budget=budget, budget_message=" Enough." if budget >= 0 else None))
    info = io.StringIO()
    session = chat.ChatSession(loaded, run, console=ui.make_console(file=io.StringIO()),
                               info=ui.make_console(file=info, width=200), out=io.StringIO(), live=live,
                               transcript=chat.Transcript(tmp_path / "t.jsonl"), make_view=make_view)
    return session, info


def test_a_thinking_reply_is_kept_apart_from_its_answer(tmp_path):
    session, info = thinking_session(tmp_path)
    session.handle("What is two and two?")
    reply = session.conversation.turns[-1]
    assert reply == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    assert session.out.getvalue() == ANSWER + "\n"  # a pipe gets the answer only
    assert f"▸ thought for {len(THOUGHT) + 1} tokens" in info.getvalue()
    saved = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert saved[-1]["content"] == ANSWER and saved[-1]["reasoning_content"] == THOUGHT
    before = len(info.getvalue())
    session.handle("/thought")
    assert info.getvalue()[before:].strip() == THOUGHT
    # the next turn: the template shows the answer only, and the turn still answers
    session.handle("And three and three?")
    assert session.conversation.turns[-1]["content"] == ANSWER
    # --resume gives the thought back to the history
    _, turns, _ = load_transcript(tmp_path / "t.jsonl")
    assert turns[1] == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}


def test_reasoning_off_and_on_switch_the_templates_enable_thinking(tmp_path):
    session, info = thinking_session(tmp_path)
    session.handle("/reasoning off")
    assert session.loaded.target.chat_format.kwargs == {"enable_thinking": False}
    session.handle("/reasoning auto")
    assert session.loaded.target.chat_format.kwargs == {}
    session.handle("/reasoning maybe")
    assert "/reasoning takes on, off or auto" in info.getvalue()


def test_a_budgeted_thought_is_cut_with_the_message_and_answered(tmp_path):
    session, _ = thinking_session(tmp_path, budget=4)
    session.handle("What is two and two?")
    reply = session.conversation.turns[-1]
    assert reply["reasoning_content"] == THOUGHT[:4] + " Enough."
    assert reply["content"]  # the model answers after the forced end


def test_the_live_view_folds_a_thought_to_one_line(tmp_path):
    out = io.StringIO()
    console = ui.make_console(file=out, width=80, force_terminal=True)
    view = ui.LiveView(console, show_footer=False)
    events = [TokenEvent(1, "Let me think.", "target", 0, "thought"), TokenEvent(2, "", "target", 0, "marker"),
              TokenEvent(3, "\n\n", "target", 1, "answer"), TokenEvent(4, "Four.", "accepted", 1, "answer")]
    ui.show(iter([*events, Finished("", [1, 2, 3, 4], "eog", None)]), view)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the text, without colours and cursor moves
    assert "▸ thought for 1 token" in shown and "Four." in shown and "Let me think." not in shown
    assert shown.index("▸ thought") < shown.index("Four.")
    assert view.last_thought.plain == "Let me think." and view.text == "Four."


# -- a real model with a reasoning template -----------------------------------------------------------------


@pytest.mark.real
def test_smollm2_with_a_thinking_template_is_split_and_budgeted(cli, tmp_path):
    """SmolLM2 writes no </think> of its own: with the thought opened by the template and a budget of 8, the
    end is forced after 8 tokens with the message, and --json splits the reply as llama-server would."""
    template = tmp_path / "think.jinja"
    template.write_text(THINKING_CHATML)
    result = cli("prompt", "Why is the sky blue?", "-m", "smollm2-135m", "--chat-template-file", str(template),
                 "--reasoning-budget", "8", "--reasoning-budget-message", " Enough thinking.", "--json", "--temp", "0",
                 "-n", "40", "--draft-fixed", "3")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    phases = [t.get("phase", "answer") for t in doc["tokens"]]
    assert phases[:8] == ["thought"] * 8 and "marker" in phases
    assert doc["reasoning_content"].endswith("Enough thinking.")
    assert doc["reasoning_content"] == "".join(t["text"] for t in doc["tokens"] if t.get("phase") == "thought").strip()
    assert doc["content"] == "".join(t["text"] for t in doc["tokens"] if "phase" not in t).strip()
    # speculation per phase: every step counted once, in the phase it began in
    thought, answer = doc["phases"]["thought"], doc["phases"]["answer"]
    assert thought["steps"] > 0 and thought["steps"] + answer["steps"] == doc["stats"]["steps"]
    assert thought["drafted"] + answer["drafted"] == doc["stats"]["drafted"]
    # --reasoning-format none: no split
    result = cli("prompt", "Why is the sky blue?", "-m", "smollm2-135m", "--chat-template-file", str(template),
                 "--reasoning-format", "none", "--json", "--temp", "0", "-n", "8", "--draft-fixed", "3")
    doc = json.loads(result.stdout)
    assert "reasoning_content" not in doc and all("phase" not in t for t in doc["tokens"])


@pytest.mark.parametrize("args, says", [
    (["-rea", "maybe"], "-rea/--reasoning must be one of on, off, auto"),
    (["--reasoning-format", "xml"], "--reasoning-format must be one of auto, none, deepseek, deepseek-legacy"),
    (["--reasoning-budget", "-2"], "--reasoning-budget"),
    (["--reasoning-effort", " "], "--reasoning-effort: empty"),
    (["--reasoning-preserve", "--no-reasoning-preserve"], "not both"),
])
def test_bad_reasoning_flags_are_one_line_and_exit_2(cli, args, says):
    result = cli("prompt", "hi", *args)
    assert result.returncode == 2
    assert says in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_reasoning_flags_become_the_templates_variables():
    from specchat.options import RunArgs
    from specchat.runner import template_options

    _, kwargs = template_options(RunArgs(reasoning="off", reasoning_effort="high", reasoning_preserve=True))
    assert kwargs == {"enable_thinking": False, "reasoning_effort": "high", "preserve_reasoning": True}
    # --chat-template-kwargs wins key by key
    _, kwargs = template_options(RunArgs(reasoning="on", chat_template_kwargs='{"enable_thinking": false}'))
    assert kwargs == {"enable_thinking": False}
    assert template_options(RunArgs(reasoning_effort="default"))[1] is None


def test_ctrl_c_during_the_thought_keeps_it(tmp_path):
    class StopAt(ui.PlainView):
        def feed(self, event):
            super().feed(event)
            if isinstance(event, TokenEvent) and len(self.token_ids) == 5:
                raise KeyboardInterrupt

    views = [lambda: StopAt(io.StringIO()), lambda: ui.PlainView(io.StringIO())]
    session, _ = thinking_session(tmp_path, make_view=lambda: views.pop(0)())
    session.handle("What is two and two?")
    kept = session.conversation.turns[-1]
    assert kept == {"role": "assistant", "content": "", "reasoning_content": THOUGHT[:5]}
    record = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[-1])
    assert record["interrupted"] is True and record["reasoning_content"] == THOUGHT[:5]
    assert session.loaded.target.tokens == session.conversation.ids[:-1]  # the cache holds what was kept
    session.handle("Go on.")  # the chat goes on
    assert session.conversation.turns[-1]["content"] == ANSWER


def test_report_counts_the_thought_and_the_answer_apart(tmp_path):
    from specchat.report import prompts as rp_prompts
    from specchat.report.command import phases_by_setting
    from specchat.report.run import record_from_dict, run_report
    from specchat.reasoning import prepare, ReasoningOptions
    from specchat.template import render, render_text

    session, _ = thinking_session(tmp_path)
    target = session.loaded.target
    seen = []

    def render_messages(messages):
        seen.append([dict(m) for m in messages])
        return render(target, messages).token_ids, []

    def reasoning_for(messages):
        return prepare(target, render_text(target, messages), ReasoningOptions()), lambda: None

    items = [rp_prompts.PromptItem("sum", "maths", ("What is two and two?", "And three and three?"))]
    settings = rp_prompts.parse_sweep("2")
    records = run_report(target, None, items, settings, SamplingParams(temperature=0.0), max_tokens=64,
                         render=render_messages, policy_for=lambda s: FixedPolicy(0), reasoning_for=reasoning_for)
    assert all(r.phases is not None and r.content == ANSWER and r.reasoning_content == THOUGHT for r in records)
    first = records[0]
    assert first.phases["thought"].emitted + first.phases["answer"].emitted == first.stats.emitted
    assert first.phases["thought"].steps + first.phases["answer"].steps == first.stats.steps
    # the second turn gets the answer and the thought apart, as a chat would
    assert seen[1][1] == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    again = record_from_dict(json.loads(json.dumps(first.as_dict())))
    assert again.phases["thought"].emitted == first.phases["thought"].emitted and again.content == ANSWER
    merged = phases_by_setting(records, settings)
    assert merged["target-only"]["thought"].emitted == sum(r.phases["thought"].emitted for r in records
                                                           if r.setting == "target-only")


# -- the markers of the real templates llama.cpp ships (tests/reference/templates) ---------------------------

from pathlib import Path  # noqa: E402

TEMPLATES = Path(__file__).resolve().parent / "reference" / "templates"
THINK = Markers("<think>", "</think>")
EXPECTED_MARKERS = {
    "Qwen-Qwen3-0.6B": THINK, "Qwen3.5-4B": THINK, "Qwen-QwQ-32B": THINK, "GLM-4.6": THINK, "GLM-4.7-Flash": THINK,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": THINK, "deepseek-ai-DeepSeek-V3.1": THINK,
    "deepseek-ai-DeepSeek-V3.2": THINK, "deepseek-ai-DeepSeek-V4": THINK, "Kimi-K2-Thinking": THINK,
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": THINK, "openbmb-MiniCPM5-1B": THINK, "LFM2.5-8B-A1B": THINK,
    "poolside-Laguna-XS-2.1": THINK, "HuggingFaceTB-SmolLM3-3B": THINK, "moonshotai-Kimi-K2": THINK,
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": Markers("<|START_THINKING|>", "<|END_THINKING|>"),
    "openai-gpt-oss-120b": Markers(*HARMONY),
    "google-gemma-4-31B-it": Markers("<|channel>thought", "<channel|>"),
    "ByteDance-Seed-OSS": Markers("<seed:think>", "</seed:think>"),
    "mistralai-Ministral-3-14B-Reasoning-2512": Markers("[THINK]", "[/THINK]"),
    # no thinking
    "meta-llama-Llama-3.3-70B-Instruct": None, "Qwen-Qwen2.5-7B-Instruct": None, "google-gemma-2-2b-it": None,
    "microsoft-Phi-3.5-mini-instruct": None, "mistralai-Mistral-Nemo-Instruct-2407": None,
    "LFM2.5-Instruct": None,  # names </think> only to strip it from history; llama.cpp splits nothing
}
# templates that open the thought at the end of the prompt (thinking at its default)
OPENS = {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "Qwen-QwQ-32B", "deepseek-ai-DeepSeek-V3.1", "GLM-4.7-Flash",
         "deepseek-ai-DeepSeek-V3.2", "deepseek-ai-DeepSeek-V4", "Qwen3.5-4B", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
         "openbmb-MiniCPM5-1B", "poolside-Laguna-XS-2.1"}


@pytest.mark.parametrize("name", sorted(EXPECTED_MARKERS))
def test_markers_of_the_templates_llamacpp_ships(name):
    source = (TEMPLATES / f"{name}.jinja").read_text()
    render = lambda messages, gen, thinking: render_chat(source, messages, bos_token="<s>", eos_token="</s>",  # noqa: E731
                                                         add_generation_prompt=gen, enable_thinking=thinking)
    markers = find_markers(source, render)
    assert markers == EXPECTED_MARKERS[name]
    if markers is not None:
        prompt = render_chat(source, [{"role": "user", "content": "hi"}], bos_token="<s>", eos_token="</s>")
        assert opens_thought(prompt, markers) is (name in OPENS)


# -- the split against llama-server's own (tests/reference: record_templates.py's reasoning_split) ---------

RECORDED = json.loads((Path(__file__).resolve().parent / "reference" / "llamacpp_prompts.smollm2-135m.json")
                      .read_text(encoding="utf-8"))
# where specchat's split is not llama.cpp's, and why
SPLIT_EXCEPTIONS = {
    "Apriel-1.6-15b-Thinker-fixed": "llama.cpp's handler puts a fixed 'Here are my reasoning steps:' preamble and "
                                    "everything after it in reasoning_content; no markers to read",
    "llama-cpp-rwkv-world": "llama.cpp's handler ignores the <think> the template opens, and drops a leading one",
    "GLM-4.7-Flash/tagged/off": "with thinking off the template closes the thought; llama.cpp's handler still "
                                "reads a thought the model writes anyway (most others do not)",
    "Spark2.5/tagged/off": "as GLM-4.7-Flash", "poolside-Laguna-S-2.1/tagged/off": "as GLM-4.7-Flash",
    "poolside-Laguna-XS-2.1/tagged/off": "as GLM-4.7-Flash", "poolside-Laguna-XS.2/tagged/off": "as GLM-4.7-Flash",
}
SPLIT_CASES = [(name, key) for name, cases in sorted(RECORDED["reasoning_split"].items())
               for key, want in cases.items() if "error" not in want]


@pytest.mark.parametrize("name, key", SPLIT_CASES, ids=[f"{n}/{k}" for n, k in SPLIT_CASES])
def test_the_split_equals_llamacpp_on_its_recorded_replies(name, key):
    """A reply llama-server was made to write (SmolLM2 under a grammar), split as its `deepseek` format split
    it; one character a token here, so that markers span several tokens as they may."""
    if name in SPLIT_EXCEPTIONS or f"{name}/{key}" in SPLIT_EXCEPTIONS:
        pytest.skip(SPLIT_EXCEPTIONS.get(name) or SPLIT_EXCEPTIONS[f"{name}/{key}"])
    from specchat.reasoning import closes_thought

    source = (TEMPLATES / f"{name}.jinja").read_text()
    reply, mode = key.split("/")
    render = lambda messages, gen, thinking: render_chat(  # noqa: E731
        source, messages, bos_token=RECORDED["bos_token"], eos_token=RECORDED["eos_token"], add_generation_prompt=gen,
        enable_thinking=thinking)
    markers = find_markers(source, render)
    prompt = render([{"role": "user", "content": "What is the capital of France?"}], True,
                    None if mode == "default" else False)
    text = RECORDED["replies"][reply]
    thought, answer = "", text
    if markers is not None and not closes_thought(prompt, markers):
        chars = lambda s: [list(map(ord, s))] if s else []  # noqa: E731
        reasoning = Reasoning(markers, {"start": chars(markers.start), "end": chars(markers.end),
                                        "answer": chars(markers.answer_prefix)}, inside=opens_thought(prompt, markers))
        events = [TokenEvent(ord(ch), ch, "target", 0) for ch in text]
        *_, finished = split_events([*events, Finished(text, [ord(c) for c in text], "eog", None)], reasoning)
        thought, answer = finished.split.reasoning_content, finished.split.content
    want = RECORDED["reasoning_split"][name][key]
    assert (thought.strip(), answer.strip()) == (want["reasoning_content"].strip(), want["content"].strip())
