"""Hybrid and recurrent architectures in the real llama.cpp: tiny random-weight GGUF files of llama (the
dense control), lfm2 and qwen35 (recurrent-state snapshots) and mamba2 (checkpoints), written by
tiny_models.py. A rejected draft is undone without re-reading the conversation, in the target and in a
draft model, and the text is still the target's greedy choice."""

from __future__ import annotations

import pytest
import tiny_models

from specchat import Conversation
from specchat.drafters import DraftModel
from specchat.lookup import PromptLookup
from specchat.engine import Finished, TokenEvent, generate
from specchat.policy import FixedPolicy
from specchat.sampling import SamplingParams

pytestmark = pytest.mark.tiny

GREEDY = SamplingParams(temperature=0.0)
MEMORY = {"llama": "kv", "lfm2": "snapshots", "qwen35": "snapshots", "mamba2": "checkpoints"}
N = 240


# prompt lookup needs text that repeats: a target whose context moves fewer argmaxes (measured: 240 tokens
# after prompt(), k = 4, 10-20% of the drafts rejected)
LOOKUP_CONTEXT = {"llama": 1.0, "lfm2": 0.9, "qwen35": 0.9, "mamba2": 0.9}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arch -> (target, draft, a target for prompt lookup)."""
    directory = tmp_path_factory.mktemp("tiny-models")
    out = {}
    for arch in tiny_models.ARCHS:
        lookup = tiny_models.write_model(directory / f"{arch}-lookup.gguf", arch,
                                         context=tiny_models.TARGET_CONTEXT[arch] * LOOKUP_CONTEXT[arch])
        out[arch] = (*tiny_models.write_pair(directory, arch), lookup)
    return out


backend = tiny_models.load


def prompt(n: int = 60) -> list[int]:
    """The models' own text (the bigram chain), so lookup finds matches and the draft agrees mostly."""
    return tiny_models.bigram_chain(int(tiny_models.cycle_tokens()[0]), n)


teacher_forced_gaps = tiny_models.teacher_forced_gaps


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_memory_kind_is_what_llama_cpp_supports(files, arch):
    target = backend(files[arch][0])
    draft = backend(files[arch][1], snapshots=0)
    try:
        assert target.memory.kind == MEMORY[arch] and target.memory.arch == arch
        # a draft model's drafts are single-token batches: it never asks for snapshots
        assert draft.memory.kind == ("kv" if arch == "llama" else "checkpoints")
        if arch != "llama":
            assert target.memory.state_bytes > 0 and "recurrent" in target.memory.describe()
    finally:
        target.close()
        draft.close()


@pytest.mark.parametrize("drafter_kind", ["draft-model", "prompt-lookup"])
@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_greedy_speculation_never_rereads_the_context(files, arch, drafter_kind):
    """Forced k = 4 over 240 tokens with rejections: every emitted token is the target's argmax (teacher
    forced), neither cache was ever rebuilt, and the text is plain greedy decoding's."""
    target_path, draft_path, lookup_path = files[arch]
    if drafter_kind == "prompt-lookup":
        target_path = lookup_path
    target = backend(target_path)
    draft = backend(draft_path, snapshots=0) if drafter_kind == "draft-model" else None
    drafter = DraftModel(draft) if draft is not None else PromptLookup(1, 8)
    ids = prompt()
    try:
        events = list(generate(target, drafter, ids, GREEDY, max_tokens=N, policy=FixedPolicy(4)))
        finished = events[-1]
        assert isinstance(finished, Finished) and len(finished.token_ids) == N
        stats = finished.stats
        assert stats.drafted > (100 if draft else 30) and 0 < stats.accepted < stats.drafted  # accepted and rejected
        assert stats.rollback_recoveries == 0
        assert target.rollback_recoveries == 0 and (draft is None or draft.rollback_recoveries == 0)
        gaps = teacher_forced_gaps(target_path, ids, finished.token_ids)
        assert gaps.max() < 0.05, (int(gaps.argmax()), float(gaps.max()))
        plain = backend(target_path)
        try:
            alone = list(generate(plain, None, ids, GREEDY, max_tokens=N))[-1]
        finally:
            plain.close()
        assert finished.token_ids == alone.token_ids
        if MEMORY[arch] == "checkpoints":  # undone from a copy: only the kept tokens evaluated again
            assert 0 < target.reevaluated <= 5 * stats.steps and target.rollback_seconds > 0
        if draft is not None and arch != "llama":
            assert draft.reevaluated > 0
    finally:
        target.close()
        if draft is not None:
            draft.close()


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_chat_turns_and_an_interrupted_reply_never_reread_the_conversation(files, arch):
    """A chat on a recurrent target and draft: turn two reuses turn one's cache; a reply closed mid-step
    (Ctrl-C, not recorded by the API) is cut back to where it started, from the copy taken there; each
    next turn evaluates only its new tokens (plus, at most, the few a restore kept)."""
    target_path, draft_path, _ = files[arch]
    target, draft = backend(target_path), backend(draft_path, snapshots=0)
    try:
        chat = Conversation(target, DraftModel(draft), params=GREEDY, max_tokens=40, policy=FixedPolicy(4))
        list(chat.send(" house garden river"))
        for user in (" again", None, " last"):
            if user is None:  # an interrupted reply
                gen = chat.send(" more words")
                for _ in zip(range(7), (e for e in gen if isinstance(e, TokenEvent))):
                    pass
                gen.close()
                continue
            held = chat.ids
            reply = list(chat.send(user))[-1]
            assert isinstance(reply, Finished) and reply.prompt_token_ids[: len(held)] == held
            assert reply.stats.prompt_tokens_evaluated <= len(reply.prompt_token_ids) - len(held) + 5
        assert target.rollback_recoveries == 0 and draft.rollback_recoveries == 0
    finally:
        target.close()
        draft.close()
