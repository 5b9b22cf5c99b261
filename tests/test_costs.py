"""The calibration as a prior: what runs observe moves the costs, is saved back into costs.json, and a
calibration it contradicts is measured again; `specchat report --recalibrate` measures on request."""

from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

from specchat.costs import (
    AGAIN_ASKED,
    AGAIN_CONTRADICTED,
    AGAIN_OUTDATED,
    CALIBRATION_BUDGET,
    CALIBRATION_SIZES,
    CALIBRATION_VERSION,
    MAX_REDOS,
    OBSERVED_WINDOW,
    STALE_STEPS,
    CostModel,
    cached_cost_model,
    cost_cache_key,
    recalibrate,
)
from specchat.engine import StepEvent, generate
from specchat.loader import make_policy
from specchat.lookup import PromptLookup
from specchat.policy import AdaptivePolicy
from specchat.sampling import SamplingParams

from fakes import FakeBackend, assert_user_error, script_logits


def quiet(n: int) -> float:
    """SmolLM2-135M on two quiet cores, about: one token 10.1 ms, 8 tokens 30 ms."""
    return 0.0101 * (1 + 0.28 * (n - 1))


def busy(n: int) -> float:
    """The same machine's calibration taken while it was busy: 1.6x for one token, 2.4x for 8 (15.9 and
    73 ms), the factor growing with the batch."""
    return quiet(n) * (1.6 + 0.8 * min(n - 1, 7) / 7)


def backend(name: str = "fake-model") -> FakeBackend:
    return FakeBackend(lambda ctx: np.zeros(8, dtype=np.float32), 8, name=name)


def write_entry(cache, model_backend, cost) -> None:
    """costs.json holding a calibration of `model_backend` timed at `cost(n)` for every size."""
    entry = {"name": model_backend.name, "sizes": list(CALIBRATION_SIZES), "seconds": [cost(n) for n in CALIBRATION_SIZES],
             "measured": 0.0, "budget": CALIBRATION_BUDGET, "version": CALIBRATION_VERSION}
    cache.write_text(json.dumps({cost_cache_key(model_backend): entry}))


def saved_entry(cache, model_backend) -> dict:
    return json.loads(cache.read_text())[cost_cache_key(model_backend)]


@pytest.fixture
def no_measuring(monkeypatch):
    """CostModel.measure fails the test: the costs must come from the file."""
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda *a, **k: pytest.fail("measured")))


@pytest.fixture
def measures(monkeypatch):
    """CostModel.measure returns the costs in `measures.cost` (quiet by default) and counts its calls;
    with `measures.notify` set it first calls its notify with an estimate of 1 s."""
    record = SimpleNamespace(calls=0, cost=quiet, notify=False)

    def measure(cls, backend, *args, notify=None, **kw):
        record.calls += 1
        if notify is not None and record.notify:
            notify(1.0)
        sizes = list(CALIBRATION_SIZES)
        return cls(sizes, [record.cost(n) for n in sizes], measured=True)

    monkeypatch.setattr(CostModel, "measure", classmethod(measure))
    return record


def test_a_poisoned_calibration_comes_down_with_what_runs_observe_and_the_file_says_so(tmp_path, no_measuring):
    cache, fake = tmp_path / "costs.json", backend()
    write_entry(cache, fake, busy)
    model = cached_cost_model(fake, cache)
    assert model(1) == pytest.approx(busy(1)) and model(8) == pytest.approx(busy(8))
    steps = STALE_STEPS - 8  # too few to call the calibration contradicted: this is the combination alone
    for _ in range(steps):
        model.update(1, quiet(1))
    for _ in range(6):
        model.update(8, quiet(8))
    model.save()
    entry = saved_entry(cache, fake)
    assert entry["observed"]["1"] == [pytest.approx(quiet(1))] * steps
    assert entry["observed"]["8"] == [pytest.approx(quiet(8))] * 6
    assert entry["seconds"] == pytest.approx([busy(n) for n in CALIBRATION_SIZES])  # the calibration is kept as it was
    again = cached_cost_model(fake, cache)  # the next process
    assert again.prior == pytest.approx(entry["seconds"])
    assert again(1) < 0.75 * busy(1) and again(8) < 0.7 * busy(8)
    assert again(64) < 0.7 * busy(64)  # a size never sent comes down with the ones that were
    assert again(1) > quiet(1) and again(8) > quiet(8)  # the calibration still counts for something


def test_observations_win_as_they_accumulate(tmp_path, measures):
    """Without a redo (MAX_REDOS spent) the observations alone bring a busy calibration to what the
    steps cost, and the window is bounded."""
    cache, fake = tmp_path / "costs.json", backend()
    write_entry(cache, fake, busy)
    table = json.loads(cache.read_text())
    table[cost_cache_key(fake)]["redone"] = MAX_REDOS
    cache.write_text(json.dumps(table))
    model = cached_cost_model(fake, cache)
    for _ in range(3 * OBSERVED_WINDOW):
        model.update(1, quiet(1))
        model.update(8, quiet(8))
    model.save()
    entry = saved_entry(cache, fake)
    assert len(entry["observed"]["1"]) == OBSERVED_WINDOW and len(entry["observed"]["8"]) == OBSERVED_WINDOW
    later = cached_cost_model(fake, cache)
    assert measures.calls == 0
    assert later(1) == pytest.approx(quiet(1), rel=0.1) and later(8) == pytest.approx(quiet(8), rel=0.1)
    assert later(16) < 0.6 * busy(16)


def test_single_slow_outliers_barely_move_the_costs(tmp_path, no_measuring):
    cache, fake = tmp_path / "costs.json", backend()
    write_entry(cache, fake, quiet)
    model = cached_cost_model(fake, cache)
    rng = np.random.default_rng(0)
    for i in range(40):
        model.update(1, quiet(1) * rng.uniform(1.0, 1.05))
        if i % 4 == 0:
            model.update(8, quiet(8) * rng.uniform(1.0, 1.05))
    for _ in range(3):  # three stalls: another process took the cores for half a second
        model.update(1, 0.5)
        model.update(8, 0.5)
    model.save()
    later = cached_cost_model(fake, cache)
    assert later(1) == pytest.approx(quiet(1), rel=0.05)
    assert later(8) == pytest.approx(quiet(8), rel=0.05)


def test_a_contradicted_calibration_is_measured_again_once(tmp_path, measures):
    cache, fake = tmp_path / "costs.json", backend()
    write_entry(cache, fake, busy)
    model = cached_cost_model(fake, cache)
    assert measures.calls == 0
    for _ in range(STALE_STEPS):
        # a chat's steps cost more than bare timings (sampling, the context): SmolLM2 8.5-9.5 ms against 6.7
        model.update(1, quiet(1) * 1.4)
    model.save()
    redone = cached_cost_model(fake, cache)  # the next load measures it again
    assert measures.calls == 1
    entry = saved_entry(cache, fake)
    assert entry["seconds"] == pytest.approx([quiet(n) for n in CALIBRATION_SIZES])
    assert entry["redone"] == 1 and len(entry["observed"]["1"]) == STALE_STEPS  # what was observed is kept
    assert redone(8) / redone(1) == pytest.approx(quiet(8) / quiet(1))  # a quiet machine's batch/one-token ratio
    assert model(8) / model(1) == pytest.approx(busy(8) / busy(1))  # (the busy one's was 1.5x that)
    for _ in range(STALE_STEPS):
        redone.update(1, quiet(1) * 1.4)
    redone.save()
    assert "redone" not in saved_entry(cache, fake)  # the redo holds
    cached_cost_model(fake, cache)
    assert measures.calls == 1  # and is not measured again


def test_the_notice_before_a_measurement_says_whether_it_is_the_first_and_why_not(tmp_path, measures):
    """notify(model, seconds, again): '' for a first calibration; why, for a saved one measured again."""
    cache, fake, told = tmp_path / "costs.json", backend(), []
    measures.notify = True

    def notify(*args):
        told.append(args)

    cached_cost_model(fake, cache, notify)
    assert told == [("fake-model", 1.0, "")]
    model = cached_cost_model(fake, cache, notify)  # saved: not measured, nothing told
    assert len(told) == 1
    for _ in range(STALE_STEPS):
        model.update(1, quiet(1) * 0.5)
    model.save()
    cached_cost_model(fake, cache, notify)
    assert told[1] == ("fake-model", 1.0, AGAIN_CONTRADICTED)
    table = json.loads(cache.read_text())
    table[cost_cache_key(fake)]["version"] = CALIBRATION_VERSION - 1  # timed as an older specchat timed
    cache.write_text(json.dumps(table))
    cached_cost_model(fake, cache, notify)
    assert told[2] == ("fake-model", 1.0, AGAIN_OUTDATED)
    recalibrate(fake, cache, notify)
    assert told[3] == ("fake-model", 1.0, AGAIN_ASKED) and measures.calls == 4


def test_a_redo_on_a_busy_machine_keeps_the_faster_readings_and_stops(tmp_path, measures):
    cache, fake = tmp_path / "costs.json", backend()
    write_entry(cache, fake, lambda n: busy(n) if n <= 8 else quiet(n))
    measures.cost = lambda n: busy(n) * 1.1 if n <= 8 else quiet(n) * 2  # busy again, and worse
    model = cached_cost_model(fake, cache)
    for _ in range(STALE_STEPS):
        model.update(1, quiet(1))
    model.save()
    for redo in range(1, MAX_REDOS + 2):
        cached_cost_model(fake, cache)
        assert measures.calls == min(redo, MAX_REDOS)
    entry = saved_entry(cache, fake)
    assert entry["seconds"] == pytest.approx([busy(n) if n <= 8 else quiet(n) for n in CALIBRATION_SIZES])


def test_an_honest_calibration_is_never_measured_again(tmp_path, no_measuring):
    """A run's steps cost more than the calibration's bare timings (sampling, a longer context): they never
    call an honest calibration into question, and they bring its costs up to what the loop pays."""
    cache, fake = tmp_path / "costs.json", backend()
    write_entry(cache, fake, quiet)
    for _ in range(3):
        model = cached_cost_model(fake, cache)
        for _ in range(2 * STALE_STEPS):
            model.update(1, quiet(1) * 1.1)
            model.update(8, quiet(8) * 1.15)
        model.save()
    later = cached_cost_model(fake, cache)
    assert later(1) == pytest.approx(quiet(1) * 1.1, rel=0.02)
    assert later(8) == pytest.approx(quiet(8) * 1.15, rel=0.02)


def test_the_policy_saves_the_steps_timings_when_a_generation_finishes(tmp_path, no_measuring):
    cache, target = tmp_path / "costs.json", FakeBackend(script_logits(8, 8, [0, 1, 2, 3] * 20), 8)
    write_entry(cache, target, busy)
    lookup = PromptLookup(1, 8)
    policy = AdaptivePolicy(lookup, cached_cost_model(target, cache), draft_max=16)
    events = list(generate(target, lookup, [0, 1, 2, 3, 0, 1, 2, 3], SamplingParams(temperature=0),
                           max_tokens=40, policy=policy))
    # every step's batch is timed, bar the first of each new largest size (a buffer's first touch)
    expected, largest = {}, 1
    for step in (e.stats for e in events if isinstance(e, StepEvent)):
        n = step.drafted + 1
        if n > largest:
            largest = n
            continue
        expected[str(n)] = expected.get(str(n), 0) + 1
    observed = saved_entry(cache, target)["observed"]
    assert {n: len(v) for n, v in observed.items()} == expected and expected


def test_a_policy_that_learns_no_costs_changes_nothing(tmp_path, no_measuring, monkeypatch):
    """--reproducible: make_policy's fixed costs read no file and write none; and a policy told not to
    learn costs (learn_costs False) leaves a costs.json it was given untouched."""
    import specchat.loader as loader_module

    cache, target = tmp_path / "costs.json", FakeBackend(script_logits(8, 8, [0, 1, 2, 3] * 20), 8)
    write_entry(cache, target, busy)
    before = cache.read_bytes()
    prompt = [0, 1, 2, 3, 0, 1, 2, 3]
    lookup = PromptLookup(1, 8)
    policy = AdaptivePolicy(lookup, cached_cost_model(target, cache), draft_max=16, learn_costs=False)
    list(generate(target, lookup, prompt, SamplingParams(temperature=0), max_tokens=40, policy=policy))
    assert cache.read_bytes() == before
    monkeypatch.setattr(loader_module, "cache_dir", lambda: tmp_path)  # where make_policy would look
    loaded = SimpleNamespace(drafter=PromptLookup(1, 8), target=target, drafter_label="prompt-lookup")
    policy = make_policy(loaded, 16, None, reproducible=True)
    target.truncate(0)
    list(generate(target, loaded.drafter, prompt, SamplingParams(temperature=0), max_tokens=40, policy=policy))
    assert cache.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["costs.json"]


def test_a_malformed_observed_section_is_ignored(tmp_path, no_measuring):
    cache, fake = tmp_path / "costs.json", backend()
    write_entry(cache, fake, quiet)
    table = json.loads(cache.read_text())
    table[cost_cache_key(fake)]["observed"] = {"1": ["x", -1, None, float("nan")], "two": [0.1], "8": "slow"}
    cache.write_text(json.dumps(table).replace("NaN", "1e999"))
    model = cached_cost_model(fake, cache)
    assert model(1) == pytest.approx(quiet(1)) and model(8) == pytest.approx(quiet(8))
    model.update(1, quiet(1))
    model.save()
    assert saved_entry(cache, fake)["observed"] == {"1": [pytest.approx(quiet(1))]}

def test_a_cleared_cache_is_not_written_back(tmp_path, no_measuring):
    """The cache file was deleted while the model ran (to have the next run measure afresh): saving does not
    bring it back."""
    cache, fake = tmp_path / "costs.json", backend()
    write_entry(cache, fake, quiet)
    model = cached_cost_model(fake, cache)
    model.update(1, quiet(1))
    cache.unlink()
    model.save()
    assert not cache.exists()


# -- specchat report --recalibrate ---------------------------------------------------------------------------


def test_report_recalibrate_measures_the_loaded_models_again(cli, tmp_path, monkeypatch, measures):
    """--recalibrate times the target again before any run and replaces its entry, observations included."""
    import specchat.report.command as command
    import specchat.runner as runner
    from specchat.errors import UserError

    target = FakeBackend(script_logits(8, 8, [0, 1, 2, 3] * 20), 8, name="smollm2-135m")
    cache = tmp_path / ".cache" / "costs.json"
    cache.parent.mkdir()
    write_entry(cache, target, busy)
    table = json.loads(cache.read_text())
    table[cost_cache_key(target)]["observed"] = {"1": [0.02] * 3}
    cache.write_text(json.dumps(table))

    @contextmanager
    def loading(config, run, console):
        yield SimpleNamespace(target=target, drafter=PromptLookup(1, 8))

    def warm_up(*args, **kw):  # the runs are not this test's business: stop where they would start
        raise UserError("stopped before the runs")

    monkeypatch.setattr(runner, "loading", loading)
    monkeypatch.setattr(command, "warm_up", warm_up)
    result = cli("report", "--recalibrate", "--limit", "1", env={"NO_COLOR": "1"})
    assert_user_error(result, "stopped before the runs")
    assert measures.calls == 1
    entry = saved_entry(cache, target)
    assert entry["seconds"] == pytest.approx([quiet(n) for n in CALIBRATION_SIZES])
    assert "observed" not in entry
    result = cli("report", "--limit", "1", env={"NO_COLOR": "1"})  # without the flag: nothing measured
    assert_user_error(result, "stopped before the runs")
    assert measures.calls == 1


@pytest.mark.parametrize("args, needles", [
    (["--recalibrate=yes"], ["--recalibrate"]),
    (["--recalibrate", "--reproducible"], ["--recalibrate", "--reproducible"]),
])
def test_report_recalibrate_bad_uses_are_one_line_exit_2(cli, tmp_path, monkeypatch, args, needles, no_measuring):
    monkeypatch.chdir(tmp_path)
    assert_user_error(cli("report", *args, env={"NO_COLOR": "1"}), *needles)

