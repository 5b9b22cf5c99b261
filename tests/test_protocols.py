"""The protocols are the contract: the fakes and the real classes conform, and one definition per flag
reaches prompt, chat and report alike (both llama.cpp spellings)."""

from __future__ import annotations

import types
import typing

import numpy as np
import pytest
import typer
from fakes import FakeBackend, ScriptedDrafter, make_draft_model

from specchat import cli, options
from specchat.backend import Backend
from specchat.costs import CostModel
from specchat.drafters import Chain, Drafter
from specchat.loader import make_policy
from specchat.lookup import PromptLookup
from specchat.policy import AdaptivePolicy, FixedPolicy, Policy
from specchat.vocab import VocabInfo

COST = CostModel([1, 2], [0.01, 0.02])


def test_the_fakes_and_the_real_classes_conform():
    target = FakeBackend(lambda ctx: np.zeros(8, dtype=np.float32), 8)
    assert isinstance(target, Backend)
    model, backend = make_draft_model(lambda ctx: np.zeros(8, dtype=np.float32), 8)
    assert isinstance(backend, Backend)
    for drafter in (ScriptedDrafter(), model, PromptLookup()):
        assert isinstance(drafter, Drafter), drafter
    assert PromptLookup().backend is None
    for policy in (FixedPolicy(3), AdaptivePolicy(model, COST, draft_max=8, draft_costs=[COST]),
                   AdaptivePolicy(PromptLookup(), COST, draft_max=8),
                   AdaptivePolicy(Chain([PromptLookup(), model]), COST, draft_max=8, draft_costs=[None, COST])):
        assert isinstance(policy, Policy), policy
    # a class without the protocol's members does not pass
    assert not isinstance(object(), Backend) and not isinstance(object(), Drafter)


# --- what a Backend is, checked on an instance: the fake and llama.cpp over a tiny model -----------------


def assert_backend_contract(backend) -> None:
    """Every member Backend declares, with its declared type, and eval / truncate as the engine uses them."""
    assert isinstance(backend, Backend)
    for name, hint in typing.get_type_hints(Backend).items():
        kind = hint if isinstance(hint, types.UnionType) else (typing.get_origin(hint) or hint)
        assert isinstance(getattr(backend, name), kind), (name, hint, getattr(backend, name))
    assert all(isinstance(t, int) for t in backend.eog_tokens()) and backend.eog_tokens()
    assert isinstance(backend.vocab, VocabInfo) and backend.vocab.n_vocab == backend.n_vocab
    for name in ("bos_text", "eos_text"):
        assert isinstance(getattr(backend, name), str), name
    for name in ("chat_template", "placement"):
        assert isinstance(getattr(backend, name), (str, type(None))), name
    assert isinstance(backend.token_bytes(3), bytes) and isinstance(backend.is_eog(3), bool)

    # eval appends and returns float32 rows, one per index asked for; rows lent in place are as writeable
    # as a copy (LlamaCppBackend's view of llama.cpp's buffer is, so that numpy does not copy it)
    evaluated = backend.evaluated
    rows = backend.eval([1, 2, 3], [0, 2], in_place=True)
    assert backend.tokens == [1, 2, 3] and backend.evaluated == evaluated + 3
    assert isinstance(rows, np.ndarray) and rows.dtype == np.float32 and rows.shape == (2, backend.n_vocab)
    assert rows.flags.writeable and np.isfinite(rows).all()
    backend.checkpoint(2)
    copied = backend.eval([4], [0])
    assert copied.dtype == np.float32 and copied.shape == (1, backend.n_vocab) and copied.flags.writeable
    assert backend.eval([5], []).shape == (0, backend.n_vocab)
    # truncate keeps a prefix, and the next eval reads only what follows it
    backend.truncate(2)
    assert backend.tokens == [1, 2]
    before = backend.evaluated
    again = backend.eval([3], [0])
    assert backend.tokens == [1, 2, 3] and backend.evaluated == before + 1
    backend.eval([4], [0], in_place=True)
    assert np.isfinite(again).all()  # a row that was not lent in place is the caller's own
    backend.truncate(0)
    assert backend.tokens == []


def test_the_fake_backend_keeps_the_backend_contract():
    assert_backend_contract(FakeBackend(lambda ctx: np.arange(8, dtype=np.float32) * len(ctx), 8, eog=(7,)))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import tiny_models

    return tiny_models.write_model(tmp_path_factory.mktemp("tiny-llama") / "llama.gguf", "llama")


@pytest.mark.tiny
def test_llamacpp_backend_keeps_the_backend_contract(tiny_llama):
    import tiny_models

    backend = tiny_models.load(tiny_llama)
    try:
        assert_backend_contract(backend)
    finally:
        backend.close()


def test_the_fake_lends_writeable_rows_and_catches_a_caller_that_writes_or_keeps_them():
    """Rows lent in place are the real backend's logits buffer: writeable, valid until the next eval,
    never to be written. The fake lends them the same way and checks both rules at its next eval."""
    backend = FakeBackend(lambda ctx: np.arange(4, dtype=np.float32), 4)
    lent = backend.eval([1, 2], [0, 1], in_place=True)
    assert lent.flags.writeable
    kept = backend.eval([3], [0])
    assert np.isnan(lent).all() and not np.isnan(kept).any()  # a caller that kept them reads NaN
    lent = backend.eval([1], [0], in_place=True)
    lent[0, 0] = 1.0
    with pytest.raises(AssertionError, match="wrote into rows fake lent in place"):
        backend.check_lent_rows()
    with pytest.raises(AssertionError, match="wrote into rows fake lent in place"):
        backend.eval([2], [0])


def test_one_policy_for_every_drafter_kind():
    """The policy prices what each drafter offers; it never asks what kind of drafter it is."""
    import inspect

    from specchat import policy as policy_module

    source = inspect.getsource(policy_module)
    for word in ("prompt-lookup", "draft-model", "mtp", "eagle3", "history"):
        assert f'"{word}"' not in source, word
    assert not PromptLookup().carried() and AdaptivePolicy(PromptLookup(), COST, draft_max=8).drafting_possible
    assert FixedPolicy(0).drafting_possible
    policy = make_policy(type("L", (), {"drafter": None})(), 8, None)
    assert isinstance(policy, FixedPolicy) and policy.k == 0


# --- one definition per flag -------------------------------------------------------------------------


def captured_run_args(monkeypatch, argv: list[str]) -> options.RunArgs:
    """The RunArgs a command receives for `argv`, stopping before anything is loaded."""
    seen = []

    def stop(config, args):
        seen.append(args)
        raise typer.Exit(0)

    for module in ("specchat.prompt_command", "specchat.chat", "specchat.runner"):
        monkeypatch.setattr(f"{module}.run_options", stop, raising=False)
    monkeypatch.setattr("specchat.report.command.check_out_dir", lambda out: None)
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("command", [["prompt", "hi"], ["chat"], ["report"]])
def test_every_command_takes_the_shared_flags_in_both_spellings(monkeypatch, command):
    old = captured_run_args(monkeypatch, [*command, "--draft-max", "5", "--draft-min", "2", "--draft-p-min", "0.5",
                                          "-md", "x", "-ngld", "3", "--stop", "END", "--ignore-eos",
                                          "--draft-fixed", "2"])
    new = captured_run_args(monkeypatch, [*command, "--spec-draft-n-max", "5", "--spec-draft-n-min", "2",
                                          "--spec-draft-p-min", "0.5", "--spec-draft-model", "x", "--spec-draft-ngl", "3",
                                          "--stop", "END", "--ignore-eos", "--draft-fixed", "2"])
    assert old == new
    assert (new.draft_max, new.draft_min, new.draft_p_min, new.draft, new.ngld) == (5, 2, 0.5, "x", 3)
    assert new.stop == ["END"] and new.ignore_eos
    assert new.draft_fixed == (None if command == ["report"] else 2)  # report adds it to --sweep instead


def test_defaults_are_the_library_defaults_and_report_differs_where_it_says(monkeypatch):
    prompt = captured_run_args(monkeypatch, ["prompt", "hi"])
    chat = captured_run_args(monkeypatch, ["chat"])
    report = captured_run_args(monkeypatch, ["report"])
    assert prompt == chat == options.RunArgs()
    assert (report.temp, report.seed, report.max_tokens) == (0.0, 0, 128)
    assert {f: getattr(report, f) for f in ("draft_max", "draft_p_min", "ctx_size")} == {
        f: getattr(prompt, f) for f in ("draft_max", "draft_p_min", "ctx_size")}


def test_every_drafter_class_implements_the_whole_contract():
    """Each kind's drafter has every member of the contract (nothing is looked up in case it exists), and
    what only some can do it declares: the capability protocols among its bases."""
    from specchat.crossvocab import CrossVocabDrafter
    from specchat.dflash import BlockDrafter
    from specchat.drafters import DraftModel, HeadDrafter, Labelled, Retargetable, Suspendable

    methods = [name for name, value in vars(Drafter).items() if callable(value) and not name.startswith("_")]
    assert {"propose", "offer", "forwards", "learn"} <= set(methods)
    for cls in (PromptLookup, DraftModel, CrossVocabDrafter, HeadDrafter, BlockDrafter):
        assert all(callable(getattr(cls, name, None)) for name in methods), cls
    assert issubclass(HeadDrafter, Suspendable) and issubclass(BlockDrafter, Suspendable)
    assert issubclass(CrossVocabDrafter, Retargetable) and issubclass(CrossVocabDrafter, Labelled)
    assert not any(issubclass(cls, (Suspendable, Retargetable, Labelled)) for cls in (PromptLookup, DraftModel))
