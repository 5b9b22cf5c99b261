"""The protocols are the contract: the fakes and the real classes conform, and one definition per flag
reaches prompt, chat and report alike (both llama.cpp spellings)."""

from __future__ import annotations

import numpy as np
import pytest
import typer
from fakes import FakeBackend, ScriptedDrafter, make_draft_model

from specchat import cli, options
from specchat.backend import Backend, LlamaCppBackend
from specchat.drafters import Drafter, HybridDrafter, PromptLookup
from specchat.policy import (CostModel, DraftModelPolicy, FixedPolicy, HybridPolicy, LookupPolicy, Policy,
                             make_policy)

COST = CostModel([1, 2], [0.01, 0.02])


def test_the_fakes_and_the_real_classes_conform():
    target = FakeBackend(lambda ctx: np.zeros(8, dtype=np.float32), 8)
    assert isinstance(target, Backend)
    model, backend = make_draft_model(lambda ctx: np.zeros(8, dtype=np.float32), 8)
    assert isinstance(backend, Backend)
    for drafter in (ScriptedDrafter(), model, PromptLookup(), HybridDrafter(PromptLookup(), model)):
        assert isinstance(drafter, Drafter), drafter
    assert PromptLookup().backend is None and HybridDrafter(PromptLookup(), model).backend is backend
    for policy in (FixedPolicy(3), DraftModelPolicy(COST, draft_max=8, draft_cost=COST), LookupPolicy(COST, draft_max=8),
                   HybridPolicy(COST, draft_max=8, draft_cost=COST)):
        assert isinstance(policy, Policy), policy
    # a class without the protocol's members does not pass
    assert not isinstance(object(), Backend) and not isinstance(object(), Drafter)


def test_llamacpp_backend_declares_every_protocol_member():
    members = [name for name in dir(Backend) if not name.startswith("_")] + list(Backend.__annotations__)
    missing = [m for m in set(members) if not hasattr(LlamaCppBackend, m) and m not in LlamaCppBackend.__init__.__code__.co_names]
    assert not missing, missing


def test_one_policy_per_drafter_kind():
    kinds = {"draft-model": DraftModelPolicy, "prompt-lookup": LookupPolicy, "hybrid": HybridPolicy}
    for kind, cls in kinds.items():
        assert cls.kind == kind
    assert not LookupPolicy(COST, draft_max=8).tables() and LookupPolicy(COST, draft_max=8).drafting_possible
    assert FixedPolicy(0).drafting_possible
    assert make_policy(type("L", (), {"drafter": None})(), 8, None).plan(8) == 0


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
