"""The benchmark tool (`python -m benchmarks`) without running a benchmark: every suite parses its options, the
shared ones come from one table, a result saved as JSON renders as it printed, and the harness's statistics."""

from __future__ import annotations

import json

import pytest

from benchmarks import harness
from benchmarks.__main__ import SHARED, SUITES, main, parser


@pytest.mark.parametrize("suite", [s for s in SUITES if s != "gpu"])
def test_every_suite_parses_its_options(suite, capsys):
    with pytest.raises(SystemExit) as done:
        parser().parse_args([suite, "--help"])
    assert done.value.code == 0
    assert "--json" in capsys.readouterr().out


def test_shared_options_come_from_one_table():
    import importlib

    for suite in (s for s in SUITES if s != "gpu"):
        module = importlib.import_module(f"benchmarks.suites.{suite}")
        assert set(module.DEFAULTS) <= set(SHARED), suite
        a = parser().parse_args([suite])
        for key, default in module.DEFAULTS.items():
            assert getattr(a, key) == default


def test_a_saved_result_renders_as_it_printed(tmp_path, capsys):
    result = harness.Result("demo", "a demo")
    result.note("two rows")
    result.table("speeds", ["run", "tok/s:.1f", "ratio:.2fx", "acc"], [["a", 10.0, 1.0, None], ["bb", 12.25, 1.225, "50%"]])
    printed = capsys.readouterr().out
    result.save(tmp_path / "r.json")
    main(["show", str(tmp_path / "r.json")])
    shown = capsys.readouterr().out
    assert printed.strip() in shown
    assert "12.2" in shown and "1.23x" in shown and " -" in shown
    assert json.loads((tmp_path / "r.json").read_text())["blocks"][1]["rows"][1][1] == 12.25


def test_median_run_keeps_the_fields_of_that_run():
    runs = [{"tps": 3.0, "n": 1}, {"tps": 1.0, "n": 2}, {"tps": 2.0, "n": 3}]
    assert harness.median_run(runs) == {"tps": 2.0, "n": 3}
    assert harness.median_run(runs[:2])["tps"] == 2.0
    assert harness.geomean([1.0, 4.0, float("nan")]) == pytest.approx(2.0)
    assert harness.rotate(("a", "b", "c"), 4) == ["b", "c", "a"]
