"""A multi-turn conversation through the Python API alone (no terminal code): KV reuse across turns."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from fakes import CHATML, FakeBackend, ScriptedDrafter

import specchat
from specchat.engine import Finished, TokenEvent
from specchat.policy import FixedPolicy

N_VOCAB = 128


def letters(ctx: tuple[int, ...]) -> np.ndarray:
    row = np.zeros(N_VOCAB, dtype=np.float32)
    row[97 + len(ctx) % 26] = 10.0
    return row


def test_a_conversation_through_the_python_api_reuses_the_cache():
    target = FakeBackend(letters, N_VOCAB, eog=(0,), pieces=[bytes([i]) for i in range(N_VOCAB)], chat_template=CHATML)
    drafter = ScriptedDrafter(fallback=lambda ctx, k: [97 + (len(ctx) + i) % 26 for i in range(k)])
    chat = specchat.Conversation(target, drafter, system="Be brief.", params=specchat.SamplingParams(temperature=0),
                                 max_tokens=5, policy=FixedPolicy(3))
    first = list(chat.send("Hello"))
    assert isinstance(first[-1], Finished) and len([e for e in first if isinstance(e, TokenEvent)]) == 5
    assert {e.source for e in first if isinstance(e, TokenEvent)} & {"accepted", "bonus"}  # the drafter was used
    held = chat.ids
    evaluated = target.evaluated
    second = list(chat.prompt("And again"))
    reply = second[-1]
    assert isinstance(reply, Finished) and reply.text
    # the second turn starts from the first turn's ids and evaluates only what is new
    assert reply.prompt_token_ids[: len(held)] == held
    assert target.evaluated - evaluated < len(reply.prompt_token_ids) - len(held) + 10
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages[2]["content"] == first[-1].text


def test_the_library_does_not_import_the_terminal_code():
    import subprocess

    code = "import sys, specchat; specchat.Conversation; print(any(m in sys.modules for m in ('specchat.chat', 'prompt_toolkit', 'typer')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.real
def test_a_real_conversation_through_the_python_api():
    pair = specchat.load_pair("default", n_ctx=1024)
    try:
        chat = specchat.Conversation(pair.target, pair.drafter, params=specchat.SamplingParams(temperature=0),
                                     max_tokens=12, policy=pair.policy(draft_fixed=3))
        first = list(chat.send("Name a colour."))[-1]
        second = list(chat.send("Name another."))[-1]
        assert first.text and second.text
        # the second prompt holds the first turn's as it was: none of those tokens is evaluated again
        assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
        assert second.stats.prompt_tokens_evaluated <= len(second.prompt_token_ids) - len(first.prompt_token_ids)
    finally:
        pair.close()


def test_a_turn_stopped_early_keeps_its_reply_and_a_failed_turn_keeps_nothing():
    from specchat.errors import BackendError

    target = FakeBackend(letters, N_VOCAB, eog=(0,), pieces=[bytes([i]) for i in range(N_VOCAB)], chat_template=CHATML)
    chat = specchat.Conversation(target, params=specchat.SamplingParams(temperature=0), max_tokens=20)
    turn = chat.send("Hello")
    tokens = []
    for event in turn:
        if isinstance(event, TokenEvent):
            tokens.append(event.id)
            if len(tokens) == 3:
                break
    turn.close()  # the caller stopped reading: the reply so far is the conversation's
    assert turn.finish_reason == "interrupted" and turn.message == chat.messages[-1]
    assert chat.messages[-1]["content"] == bytes(tokens).decode()
    assert target.tokens == chat.ids[:-1]

    target.fail_after(2)
    with pytest.raises(BackendError):
        list(chat.send("Again"))
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]  # the failed turn left nothing
