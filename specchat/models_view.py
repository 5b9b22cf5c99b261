"""`specchat models`: the configured models and pairs as Rich tables."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .backend import BackendError
from . import kinds
from .config import Config, ConfigError, load_config
from .crossvocab import file_vocab_map, vocabulary_note
from .gguf_header import gguf_arch, gguf_nextn_layers
from .memory import arch_memory
from .sources import SourceError, describe, header_file, is_present, joined, resolve
from .vocab import check_compatible, read_vocab


def models_command() -> None:
    """List the models and pairs from models.toml (and your overrides): where each comes from, whether
    its file is here, and for pairs whether draft and target are compatible."""
    console = Console()
    for table in models_tables(load_config()):
        console.print(table)


def models_tables(config: Config) -> list[Table]:
    models = Table(title="Models", title_justify="left")
    for column in ("name", "source", "file", "memory", "layers", "description"):
        models.add_column(column, overflow="fold")
    present: dict[str, bool] = {}
    for name, spec in config.models.items():
        present[name] = is_present(spec)
        # names and descriptions are the user's text, shown as written ("the [models] extra")
        models.add_row(escape(name), escape(describe(spec)),
                       "[green]present[/]" if present[name] else "[dim]not downloaded[/]",
                       _memory(spec) if present[name] else "[dim]?[/]",
                       escape(_layers(spec.rpc)), escape(spec.description))

    pairs = Table(title="Pairs", title_justify="left")
    for column in ("name", "target", "drafter", "vocabulary", "target layers", "description"):
        pairs.add_column(column, overflow="fold")
    vocabs: dict[str, object] = {}
    for name, pair in config.pairs.items():
        rpc = pair.rpc or (config.models[pair.target].rpc if pair.target in config.models else ())
        drafter = pair.draft
        pairs.add_row(escape(name), escape(pair.target), escape(drafter), _compatibility(config, pair, vocabs),
                      escape(_layers(rpc)), escape(pair.description))
    return [models, pairs]


# how a rejected draft is undone (README "Hybrid and recurrent models")
MEMORY_WORDS = {"kv": "KV cache", "snapshots": "recurrent, snapshots", "checkpoints": "recurrent, checkpoints"}


def _memory(spec) -> str:
    """The model's architecture and how its cache is cut after a rejected draft (from the file's header)."""
    try:
        path = header_file(spec)
        by_suffix = kinds.for_suffix(path.name)  # a drafter's file that is not a GGUF (Medusa heads)
        if by_suffix is not None:
            return escape(by_suffix.describe_file(path) or by_suffix.label)
        arch = gguf_arch(path)
    except (SourceError, ConfigError):
        return "[dim]?[/]"
    if arch is None:
        return "[dim]?[/]"
    purpose = kinds.for_file(arch).describe_file(path)  # a head's: the target it was trained for
    if purpose is not None:
        return escape(f"{arch} · {purpose}")
    text = f"{arch} · {MEMORY_WORDS[arch_memory(arch)]}"
    nextn = gguf_nextn_layers(path)
    if nextn:  # the model drafts for itself: -md mtp
        text += f" · {nextn} MTP layer{'s' if nextn > 1 else ''} (-md mtp)"
    return escape(text)


def _layers(rpc: tuple[str, ...]) -> str:
    """Where a model's offloaded layers go (-ngl counts them): this machine, or its RPC workers."""
    return f"RPC {', '.join(rpc)}" if rpc else "this machine"


def _file_kind(config: Config, ref: str):
    """The kind of a drafter file that is not a GGUF model (Medusa heads: they draft the target's tokens), or None."""
    try:
        spec = config.model(ref)
    except ConfigError:
        return None
    return kinds.for_suffix(spec.file or spec.ref)


def _compatibility(config: Config, pair, vocabs: dict) -> str:
    """llama.cpp's rule when both files are here (reads vocabularies only, no weights): the same
    vocabulary, or different tokenizers (drafted across vocabularies) and how much of the draft's the
    target shares (the map is cached, see crossvocab.py)."""
    own = {d: kinds.by_word(d) or _file_kind(config, d) for d in pair.drafts}  # drafters that are not models
    model = next((d for d in pair.drafts if own[d] is None), None)
    if model is None:  # drafters without a model of their own draft the target's tokens
        return "the target's own (" + ", ".join(own[d].label for d in pair.drafts) + " drafts in it)"
    try:
        specs = [config.model(pair.target), config.model(model)]
        if not all(is_present(s) for s in specs):
            return "[dim]unknown until downloaded[/]"
        if not all(joined(s) for s in specs):  # its vocabulary is read from the whole file
            return "[dim]checked on first use (its split file is joined then)[/]"
        infos, files = [], []
        for spec in specs:
            files.append(resolve(spec, download=False))
            if spec.name not in vocabs:
                vocabs[spec.name] = read_vocab(files[-1])
            infos.append(vocabs[spec.name])
        if check_compatible(*infos) is None:
            return f"[green]{escape(vocabulary_note(None))}[/]"
        return f"[yellow]{escape(vocabulary_note(file_vocab_map(*files)))}[/]"
    except (ConfigError, SourceError, BackendError) as e:
        return f"[red]error[/]: {escape(str(e))}"
