"""The chat session without a terminal: KV reuse across turns, Ctrl-C, context overflow, transcripts,
slash commands. Fake backends count every token evaluated; one real-model test proves the same on
SmolLM2 (ChatML template) and gemma-3-270m (no template: the fallback format)."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from fakes import CHATML, FakeBackend, ScriptedDrafter

from specchat import chat, ui
from specchat.errors import UserError
from specchat.engine import TokenEvent
from specchat.loader import Loaded, LoadOptions, Selection
from specchat.runner import RunOptions
from specchat.sampling import SamplingParams
from specchat.template import render
from specchat.transcript import load_transcript

N_VOCAB = 128
EOG = 0


def ascii_logits(ctx: tuple[int, ...]) -> np.ndarray:
    """A space after ':' (the fallback format's 'Assistant:'), else a letter that depends on the length."""
    row = np.zeros(N_VOCAB, dtype=np.float32)
    row[32 if ctx[-1] == ord(":") else 97 + len(ctx) % 26] = 10.0
    return row


def fake_target(template: str | None = None, n_ctx: int = 4096) -> FakeBackend:
    pieces = [bytes([i]) for i in range(N_VOCAB)]
    target = FakeBackend(ascii_logits, N_VOCAB, n_ctx=n_ctx, eog=(EOG,), pieces=pieces, chat_template=template)
    target.bos_text = target.eos_text = ""  # what template.render asks a real backend for
    return target


def make_session(tmp_path, *, template=None, drafter=None, n_ctx=4096, max_tokens=6, system=None, make_view=None,
                 draft_fixed=3):
    target = fake_target(template, n_ctx)
    loaded = Loaded(target, drafter, SimpleNamespace(name="fake"), None, "scripted" if drafter else "none")
    run = RunOptions(Selection("fake", None), LoadOptions(n_ctx=n_ctx), SamplingParams(temperature=0.0), 8,
                     draft_fixed, max_tokens)
    info_buf = io.StringIO()
    session = chat.ChatSession(
        loaded, run,
        console=ui.make_console(file=io.StringIO()),
        info=ui.make_console(file=info_buf, width=200),
        out=io.StringIO(),
        system=system,
        transcript=chat.Transcript(tmp_path / "t.jsonl"),
        live=False,
        make_view=make_view,
    )
    return session, target, info_buf


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


SUFFIX = {  # what turn 2 adds after turn 1's reply (the fake tokenizer: one token per character)
    None: "\nUser: second\nAssistant:",
    CHATML: "<|im_end|>\n<|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\n",
}


@pytest.mark.parametrize("template", [None, CHATML], ids=["fallback", "chatml"])
def test_turn_two_evaluates_only_its_new_tokens(tmp_path, template):
    session, target, _ = make_session(tmp_path, template=template, system="Be brief.")
    session.handle("first question")
    first = session.turn_log[0]
    held = session.conversation.ids
    assert first["evaluated"] >= first["prompt_tokens"]  # turn 1 evaluates its whole prompt
    assert target.tokens == held[:-1]  # the cache holds the conversation (its last token goes with the next step)

    session.handle("second")
    second = session.turn_log[1]
    prompt2 = session.conversation.ids[: second["prompt_tokens"]]
    assert prompt2[: len(held)] == held  # the reply's ids carried over exactly, not re-tokenised
    assert second["reused"] == len(held)
    new = second["prompt_tokens"] - len(held)
    # the last reply token (not yet in the cache) + the new user message and template tokens
    assert second["prompt_evaluated"] == new + 1
    assert new == len(SUFFIX[template])
    assert target.tokens == session.conversation.ids[:-1]


def test_held_ids_equal_a_fresh_rendering(tmp_path):
    """With a tokenizer that round-trips (the fake's), the carried-over ids equal what a full render
    of the conversation would give, so reuse changes nothing the model sees."""
    for template in (None, CHATML):
        session, target, _ = make_session(tmp_path, template=template)
        session.handle("hi")
        session.handle("more")
        conv = session.conversation
        assert conv.prepare("x").ids == render(target, [*conv.messages, {"role": "user", "content": "x"}]).token_ids


def test_prompt_lookup_sees_the_whole_conversation(tmp_path):
    drafter = ScriptedDrafter()
    session, target, _ = make_session(tmp_path, drafter=drafter)
    session.handle("alpha beta")
    turn1 = session.conversation.ids
    session.handle("gamma")
    context, _ = drafter.proposals[-1]
    assert context[: len(turn1)] == turn1  # turn 1's prompt and reply are in what the drafter searches


def test_cuts_that_fail_mid_chat_are_repaired_counted_and_shown(tmp_path):
    """Every cut of the target's cache fails (as LlamaCppBackend's do when llama_memory_seq_rm refuses):
    the chat says the same, each turn counts its repairs in the transcript and /stats, and the cache ends
    holding the conversation."""

    def right_then_wrong(ctx, k):  # the target's next letter, then a '!' it never picks: every step is cut
        return [97 + len(ctx) % 26, ord("!")]

    def chat(fail: bool):
        session, target, _ = make_session(tmp_path / ("failing" if fail else "healthy"),
                                          drafter=ScriptedDrafter(fallback=right_then_wrong), max_tokens=8)
        if fail:
            target.fail_cuts()
        for message in ("first question", "second"):
            session.handle(message)
        return session, target

    (tmp_path / "healthy").mkdir()
    (tmp_path / "failing").mkdir()
    healthy, _ = chat(fail=False)
    session, target = chat(fail=True)
    assert session.conversation.messages == healthy.conversation.messages
    recorded = [r["stats"]["rollback_recoveries"] for r in lines(tmp_path / "failing" / "t.jsonl") if "stats" in r]
    assert len(recorded) == 2 and all(n >= 3 for n in recorded)  # 8 tokens, 2 per step, each step cut
    assert sum(recorded) <= target.rollback_recoveries
    assert "cache cuts repaired by re-reading the context" in ui.breakdown(session.last_stats).plain
    assert "cache cuts repaired" not in ui.breakdown(healthy.last_stats).plain
    # the second turn read the whole conversation again, not only its new tokens
    assert session.turn_log[1]["evaluated"] > healthy.turn_log[1]["evaluated"] + healthy.turn_log[0]["prompt_tokens"]
    assert target.tokens == session.conversation.ids[:-1]


def interrupt_after(n_tokens: int):
    """A view that raises KeyboardInterrupt (Ctrl-C) when the n-th token arrives."""

    class View(ui.PlainView):
        def feed(self, event):
            super().feed(event)
            if isinstance(event, TokenEvent) and len(self.token_ids) == n_tokens:
                raise KeyboardInterrupt

    return lambda: View(io.StringIO())


def test_ctrl_c_mid_reply_keeps_the_session_consistent(tmp_path):
    views = [interrupt_after(3), lambda: ui.PlainView(io.StringIO())]
    session, target, info = make_session(tmp_path, max_tokens=20, make_view=lambda: views.pop(0)())
    session.handle("tell me a long story")
    assert session.turn_log[0]["generated"] == 3
    conv = session.conversation
    assert conv.turns[-1]["role"] == "assistant"
    assert len(conv.turns[-1]["content"]) == 2  # ' ' + 2 letters; the fallback format strips the reply
    assert target.tokens == conv.ids[:-1]  # cache == kept history
    record = lines(tmp_path / "t.jsonl")[-1]
    assert record["interrupted"] is True and record["finish_reason"] == "interrupted"
    assert "interrupted" in info.getvalue()

    session.handle("next")  # the next turn works and reuses everything kept
    second = session.turn_log[1]
    assert second["finish_reason"] == "length" and second["generated"] == 20
    assert second["reused"] == second["prompt_tokens"] - (second["prompt_evaluated"] - 1)
    assert target.tokens == session.conversation.ids[:-1]


def test_ctrl_c_inside_the_model_keeps_the_session_consistent(tmp_path):
    session, target, _ = make_session(tmp_path, max_tokens=20)
    real_eval = target.eval
    calls = {"n": 0}

    def eval_then_interrupt(tokens, logits_at, **kw):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real_eval(tokens, logits_at, **kw)

    target.eval = eval_then_interrupt
    session.handle("story")
    assert session.turn_log[0]["finish_reason"] == "interrupted"
    assert target.tokens == session.conversation.ids[:-1]
    target.eval = real_eval
    session.handle("again")
    assert session.turn_log[1]["finish_reason"] == "length"
    assert target.tokens == session.conversation.ids[:-1]


def test_ctrl_c_before_the_first_token_drops_the_message(tmp_path):
    session, target, info = make_session(tmp_path, make_view=interrupt_after(1))
    session.handle("hello")
    # one token did arrive: the reply is kept; now interrupt during the prompt
    session._make_view = None
    real_eval = target.eval

    def interrupt(tokens, logits_at, **kw):
        raise KeyboardInterrupt

    target.eval = interrupt
    session.handle("never answered")
    target.eval = real_eval
    assert [m["content"] for m in session.conversation.turns if m["role"] == "user"] == ["hello"]
    assert "not kept" in info.getvalue()
    session.handle("answered")
    assert target.tokens == session.conversation.ids[:-1]
    system, turns, _ = load_transcript(tmp_path / "t.jsonl")
    assert [m["content"] for m in turns if m["role"] == "user"] == ["hello", "answered"]


def test_context_full_drops_the_oldest_turns_and_goes_on(tmp_path):
    session, target, info = make_session(tmp_path, n_ctx=160, max_tokens=10, system="S")
    for i in range(8):
        session.handle(f"message number {i}")
    assert "dropped the" in info.getvalue()
    conv = session.conversation
    assert conv.messages[0] == {"role": "system", "content": "S"}
    users = [m["content"] for m in conv.turns if m["role"] == "user"]
    assert users[-1] == "message number 7" and "message number 0" not in users
    assert all(t["prompt_tokens"] + 10 <= 160 for t in session.turn_log)
    assert target.tokens == conv.ids[:-1]
    assert len(lines(tmp_path / "t.jsonl")) == 16  # the transcript keeps every message


def test_transcript_is_written_every_turn_and_resumes(tmp_path):
    session, target, _ = make_session(tmp_path, system="Sys")
    session.transcript.write({"role": "system", "content": "Sys"})
    session.handle("one")
    records = lines(tmp_path / "t.jsonl")
    assert [r["role"] for r in records] == ["system", "user", "assistant"]
    assert records[2]["stats"]["generated_tokens"] == 6 and records[2]["finish_reason"] == "length"
    session.handle("two")
    assert len(lines(tmp_path / "t.jsonl")) == 5

    system, turns, all_records = load_transcript(tmp_path / "t.jsonl")
    assert system == "Sys" and [m["content"] for m in turns][::2] == ["one", "two"]
    resumed, target2, _ = make_session(tmp_path, system=system)
    ids = resumed.conversation.restore(turns)
    resumed.prefill()
    assert target2.evaluated == len(ids) - 1
    resumed.handle("three")
    # the resumed history was evaluated once, at prefill: the turn pays only for its new tokens
    log = resumed.turn_log[0]
    assert log["reused"] == len(ids) and log["prompt_evaluated"] == log["prompt_tokens"] - len(ids) + 1


def test_a_turn_that_cannot_start_is_one_line_and_the_chat_goes_on(tmp_path):
    session, _, info = make_session(tmp_path, template="{{ raise_exception('roles must alternate') }}")
    session.handle("hello")
    assert "the model's chat template refused this conversation: roles must alternate" in info.getvalue()
    assert session.conversation.turns == [] and not session.transcript.records  # nothing was kept
    session.handle("/temp 0.5")  # the chat goes on
    assert session.params.temperature == 0.5


def test_load_transcript_errors(tmp_path):
    with pytest.raises(UserError, match="no such transcript"):
        load_transcript(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role": "user", "content": "hi"}\nnot json\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2"):
        load_transcript(bad)


def test_slash_commands(tmp_path):
    session, target, info = make_session(tmp_path, drafter=ScriptedDrafter())
    session.handle("/temp nope")
    assert "/temp takes a number" in info.getvalue() and session.params.temperature == 0.0
    session.handle("/temp -1")
    assert session.params.temperature == 0.0
    session.handle("/temp 0.7")
    assert session.params.temperature == 0.7
    session.handle("/draft x")
    assert "/draft takes" in info.getvalue()
    session.handle("/draft 0")
    assert session.drafter is None
    session.handle("/draft 4")
    assert session.drafter is not None and session.draft_max == 4
    session.handle("/spec off")
    assert session.drafter is None and session.drafter_label == "target only"
    session.handle("/spec maybe")
    assert "on or off" in info.getvalue()
    session.handle("/spec on")
    assert session.drafter is not None
    session.handle("/stats")
    assert "no reply yet" in info.getvalue()
    session.handle("hello")
    session.handle("/stats")
    assert "per-position acceptance" in info.getvalue() and "session:" in info.getvalue()
    session.handle("/system Talk like a pirate.")
    assert session.conversation.messages[0] == {"role": "system", "content": "Talk like a pirate."}
    session.handle("/save " + str(tmp_path / "saved.jsonl"))
    system, turns, _ = load_transcript(tmp_path / "saved.jsonl")
    assert system == "Talk like a pirate." and turns[0]["content"] == "hello"
    session.handle("/frobnicate")
    assert "unknown command /frobnicate" in info.getvalue()
    session.handle("/help")
    assert "/draft N" in info.getvalue()
    old = session.transcript.path
    session.handle("/reset")
    assert session.conversation.turns == [] and session.transcript.path != old
    assert session.conversation.system == "Talk like a pirate."
    session.handle("/exit")
    assert session.done


def test_no_drafter_commands_explain(tmp_path):
    session, _, info = make_session(tmp_path)
    session.handle("/spec on")
    session.handle("/draft 3")
    assert info.getvalue().count("--no-spec") == 2


def test_loop_reads_lines_until_eof(tmp_path):
    session, _, _ = make_session(tmp_path)
    chat.loop(session, chat.line_reader(io.StringIO("hi\n\n/temp 0.5\nthere\n")))
    assert len(session.turn_log) == 2 and session.params.temperature == 0.5


def test_resume_missing_file_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from specchat.cli import main

    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        main(["chat", "--resume", str(tmp_path / "nope.jsonl")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such transcript" in err


# -- real models -----------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_real_model_turn_two_does_not_reevaluate_turn_one(tmp_path, monkeypatch, name):
    pytest.importorskip("llama_cpp")
    from specchat.config import load_config
    from specchat.loader import load

    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    config = load_config()
    try:
        loaded = load(config, Selection(name, "prompt-lookup"), LoadOptions(n_ctx=1024))
    except Exception as e:  # the [models] extra is not installed
        pytest.skip(f"{name} unavailable: {e}")
    try:
        run = RunOptions(Selection(name, "prompt-lookup"), LoadOptions(n_ctx=1024), SamplingParams(temperature=0.0),
                         8, 4, 16)
        session = chat.ChatSession(
            loaded, run, console=ui.make_console(file=io.StringIO()), info=ui.make_console(file=io.StringIO()),
            out=io.StringIO(), transcript=chat.Transcript(tmp_path / "t.jsonl"), live=False,
        )
        session.handle("What is the capital of France? Answer in one sentence.")
        held = session.conversation.ids
        session.handle("And of Italy?")
        first, second = session.turn_log
        print(name, session.turn_log)
        assert second["reused"] == len(held)  # the generated ids carried over verbatim
        # at most the tokens after the held ones (fewer when the cache still holds a stop string's
        # tokens that the new turn's text begins with)
        assert second["prompt_evaluated"] <= second["prompt_tokens"] - len(held) + 1
        # turn 2 pays for its message and a few template tokens, none of turn 1's
        message_tokens = len(loaded.target.tokenize("And of Italy?", add_special=False))
        assert second["prompt_evaluated"] <= message_tokens + 12
        assert second["prompt_evaluated"] < len(held)
        # the cache holds the kept conversation (and possibly a stop string's tokens after it)
        kept = session.conversation.ids
        assert loaded.target.tokens[: len(kept) - 1] == kept[:-1]
    finally:
        loaded.close()
