"""`specchat models`: the configured models and pairs as Rich tables."""

from __future__ import annotations

from rich.table import Table

from .backend import BackendError, check_compatible, read_vocab
from .config import PROMPT_LOOKUP, Config, ConfigError
from .sources import SourceError, describe, is_present, resolve


def models_tables(config: Config) -> list[Table]:
    models = Table(title="Models", title_justify="left")
    for column in ("name", "source", "file", "description"):
        models.add_column(column, overflow="fold")
    present: dict[str, bool] = {}
    for name, spec in config.models.items():
        present[name] = is_present(spec)
        models.add_row(name, describe(spec), "[green]present[/]" if present[name] else "[dim]not downloaded[/]",
                       spec.description)

    pairs = Table(title="Pairs", title_justify="left")
    for column in ("name", "target", "drafter", "compatible", "description"):
        pairs.add_column(column, overflow="fold")
    vocabs: dict[str, object] = {}
    for name, pair in config.pairs.items():
        drafter = f"{PROMPT_LOOKUP} + {pair.draft}" if pair.lookup else pair.draft
        pairs.add_row(name, pair.target, drafter, _compatibility(config, pair, vocabs), pair.description)
    return [models, pairs]


def _compatibility(config: Config, pair, vocabs: dict) -> str:
    """Checked with llama.cpp's rule when both files are here (reads vocabularies only, no weights)."""
    if pair.draft == PROMPT_LOOKUP:
        return "[green]yes[/] (any model)"
    try:
        specs = [config.model(pair.target), config.model(pair.draft)]
        if not all(is_present(s) for s in specs):
            return "[dim]unknown until downloaded[/]"
        infos = []
        for spec in specs:
            if spec.name not in vocabs:
                vocabs[spec.name] = read_vocab(resolve(spec, download=False))
            infos.append(vocabs[spec.name])
    except (ConfigError, SourceError, BackendError) as e:
        return f"[red]error[/]: {e}"
    problem = check_compatible(*infos)
    return "[green]yes[/]" if problem is None else f"[red]no[/]: {problem}"
