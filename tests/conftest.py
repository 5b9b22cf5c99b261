"""Shared test setup: make `specchat` (repo root) and `fakes` (this folder) importable however pytest is run."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS.parent), str(_TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


@pytest.fixture
def rng() -> np.random.Generator:
    """A fixed-seed generator, so a test that samples is reproducible."""
    return np.random.default_rng(20240601)


@pytest.fixture(autouse=True, scope="session")
def _isolated_home(tmp_path_factory):
    """Keep the user's real config, transcripts and cost cache out of the tests (one home per session,
    so the measured cost models are shared between tests)."""
    import os

    saved = {k: os.environ.get(k) for k in ("SPECCHAT_HOME", "SPECCHAT_CONFIG")}
    home = tmp_path_factory.mktemp("specchat-home")
    os.environ["SPECCHAT_HOME"] = str(home)
    os.environ.pop("SPECCHAT_CONFIG", None)
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def measured_home(_isolated_home):
    """The session's home, for `specchat` subprocesses on real models that are not about a first run: the
    machine is measured (seconds of calibration per model) and the split models are joined (gigabytes
    read and hashed) once a session, not once a test. Tests about a first run, or about what a home
    holds, keep their own."""
    return _isolated_home


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """`specchat ARGS` in this process: (returncode, stdout, stderr), as a subprocess would give them."""
    from specchat import cli as cli_module

    def run(*args: str, home=None, stdin: str | None = None, env: dict | None = None):
        monkeypatch.setenv("SPECCHAT_HOME", str(home or tmp_path))
        monkeypatch.delenv("SPECCHAT_CONFIG", raising=False)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8"))
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            cli_module.main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=info.value.code, stdout=out.out, stderr=out.err)

    return run
