"""Where specchat keeps its files: XDG base directories, or everything under $SPECCHAT_HOME (tests)."""

from __future__ import annotations

import os
from pathlib import Path


def _base(xdg_var: str, fallback: str) -> Path:
    home = os.environ.get("SPECCHAT_HOME")
    if home:
        return Path(home).expanduser() / fallback.rsplit("/", 1)[-1]
    root = os.environ.get(xdg_var) or str(Path.home() / fallback)
    return Path(root).expanduser() / "specchat"


def config_dir() -> Path:
    """models.toml overrides live here ($XDG_CONFIG_HOME/specchat)."""
    return _base("XDG_CONFIG_HOME", ".config")


def data_dir() -> Path:
    """Chat transcripts and input history ($XDG_DATA_HOME/specchat)."""
    return _base("XDG_DATA_HOME", ".local/share")


def cache_dir() -> Path:
    """Measured cost models and assembled model files ($XDG_CACHE_HOME/specchat)."""
    return _base("XDG_CACHE_HOME", ".cache")
