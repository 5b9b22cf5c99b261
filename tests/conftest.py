"""Shared test setup: make `specchat` (repo root) and `fakes` (this folder) importable however pytest is run."""

from __future__ import annotations

import sys
from pathlib import Path

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
