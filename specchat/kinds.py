"""The table of drafter kinds: everything specchat knows about a way of drafting, in one entry.

An entry says how a user names the kind (llama.cpp's `--spec-type` names, a `-md` / models.toml word that
needs no file, or the GGUF architecture of a `-md` file), how to build it (`factory`, "module:function",
imported only when a drafter of that kind is built), what sort of cost its drafts have (`cost`: for
what reads only the kind's name, a report and --reproducible's fixed costs; the policy prices each draft
by what the drafter itself reports, drafters.Drafter.forwards), and how the terminal shows its tokens. Adding a way of drafting is one module (the drafter, see drafters.Drafter) plus one
entry: here, from an installed package (an entry point in the group `specchat.drafters` naming a
DrafterKind, or a function that returns one, found the first time the table is read), or a `register()`
call from anywhere (a test).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console


@dataclass(frozen=True)
class DrafterKind:
    name: str  # specchat's own name; what StepStats.source says and acceptance.json is keyed by
    label: str  # what the terminal calls its drafts
    # the factory: "module:function" (or a callable), called as factory(build) -> Drafter (loader.Build)
    factory: str | Callable[..., Any]
    # "free" (proposals cost nothing) | "model" | "head" (one or a few layers on the target), both a forward per
    # token | "block" (one forward for the whole draft, whatever its length)
    cost: str = "model"
    spec_types: tuple[str, ...] = ()  # llama.cpp's --spec-type names for it
    word: str | None = None  # the -md / models.toml `draft` word that means it without a file ("mtp")
    archs: tuple[str, ...] = ()  # a -md file of one of these GGUF architectures is this kind
    needs_file: bool = False  # built from a -md file (a draft model, a head trained for the target)
    reads_target: bool = False  # it reads the target's own context: it cannot outlive the target's backend
    colour: str = "cyan"  # the footer's style for its name
    target_options: dict[str, Any] = field(default_factory=dict)  # how the target must be loaded for it
    # other names its drafts carry in StepStats.source (lookup's "history": earlier replies), with labels
    sources: dict[str, str] = field(default_factory=dict)
    # what a -md file of one of its `archs` is for, as `specchat models` says it: "module:function" (or a
    # callable) of the file's path, imported only when a table shows such a file; None: its memory kind
    describes: str | Callable[..., str] | None = None
    # a -md file that is not a GGUF is this kind by its name's ending (".safetensors": Medusa heads)
    suffixes: tuple[str, ...] = ()
    usage: str = ""  # how a user gives it, for --spec-type's help ("-md names the head")

    @property
    def free(self) -> bool:
        return self.cost == "free"

    def build(self, build) -> Any:
        return _resolve(self.factory)(build)

    def describe_file(self, path) -> str | None:
        return _resolve(self.describes)(path) if self.describes is not None else None


def _resolve(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    if isinstance(ref, str):
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)
    return ref


KINDS: dict[str, DrafterKind] = {}  # specchat's own; read through table(), which adds the installed ones

ENTRY_POINT_GROUP = "specchat.drafters"
_installed_read = False


def register(kind: DrafterKind) -> DrafterKind:
    """Add (or replace) a kind; its names must not be another kind's."""
    for other in KINDS.values():
        if other.name == kind.name:
            continue
        clash = (set(other.spec_types) & set(kind.spec_types)) | ({other.word} & {kind.word} - {None})
        if clash:
            raise ValueError(f"drafter kind {kind.name}: {', '.join(sorted(clash))} already names {other.name}")
    KINDS[kind.name] = kind
    return kind


PROMPT_LOOKUP = register(DrafterKind(
    "prompt-lookup", "lookup", "specchat.history:build_lookup", cost="free",
    # llama.cpp's n-gram drafters are all answered by specchat's one lookup (indexed, with its own policy)
    spec_types=("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"),
    word="prompt-lookup", colour="green", sources={"history": "lookup: earlier replies"},
    usage="all = -md prompt-lookup",
))
DRAFT_MODEL = register(DrafterKind(
    "draft-model", "draft model", "specchat.drafters:build_draft_model", spec_types=("draft-simple",),
    needs_file=True, colour="magenta", usage="a draft model, -md",
))
MTP = register(DrafterKind(
    "mtp", "MTP head", "specchat.drafters:build_mtp", cost="head", spec_types=("draft-mtp",), word="mtp",
    reads_target=True, colour="blue", target_options={"mtp": True},  # llama.cpp loads the MTP layers
    usage="the target's own MTP layers, = -md mtp",
))
EAGLE3 = register(DrafterKind(
    "eagle3", "EAGLE-3 head", "specchat.drafters:build_eagle3", cost="head", spec_types=("draft-eagle3",),
    archs=("eagle3",), needs_file=True, reads_target=True, colour="blue",
    describes="specchat.heads:describe_eagle3_file", usage="-md names the head",
))
DFLASH = register(DrafterKind(
    # DFlash and DSpark drafts are one architecture (dflash); the file says which (a Markov head: DSpark)
    "dflash", "DFlash", "specchat.dflash:build_dflash", cost="block", spec_types=("draft-dflash", "draft-dspark"),
    archs=("dflash",), needs_file=True, reads_target=True, colour="blue", sources={"dspark": "DSpark"},
    describes="specchat.dflash:describe_file", usage="-md names the block draft",
))

MEDUSA = register(DrafterKind(
    # K heads on the target's final hidden state, in numpy on the host (medusa.py); a safetensors file
    "medusa", "Medusa heads", "specchat.medusa:build_medusa", cost="head", spec_types=("draft-medusa",),
    needs_file=True, reads_target=True, colour="blue", suffixes=(".safetensors",),
    describes="specchat.medusa:describe_file", usage="-md names a .safetensors head file",
))

# What drafts when no drafter is named (-m alone), and what --hybrid (a pair's `lookup`) puts in front of
# another drafter: prompt lookup needs no second model and costs nothing where the text does not repeat.
DEFAULT = HYBRID_FRONT = PROMPT_LOOKUP


def table() -> dict[str, DrafterKind]:
    """Every kind: specchat's own and, from the first call on, those installed packages offer."""
    global _installed_read
    if not _installed_read:
        _installed_read = True
        register_installed()
    return KINDS


def register_installed() -> list[str]:
    """Register the kinds of the installed packages' `specchat.drafters` entry points; one that cannot be
    loaded, is not a DrafterKind or clashes with a kind's names is left out with a line on stderr (a
    broken plugin must not stop specchat). Returns the names registered."""
    # start-up: importlib.metadata takes 50 ms; paid when the table is first read, not by `import specchat`
    from importlib.metadata import entry_points

    added = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            kind = point.load()
            if callable(kind) and not isinstance(kind, DrafterKind):
                kind = kind()
            if not isinstance(kind, DrafterKind):
                raise TypeError(f"{point.value} is not a specchat.kinds.DrafterKind")
            if kind.name in KINDS and KINDS[kind.name] is not kind:
                raise ValueError(f"drafter kind {kind.name} is already specchat's")
            added.append(register(kind).name)
        except Exception as e:  # (any failure of someone else's code)
            _warn(f"specchat: warning: drafter plugin {point.name} ({point.value}) left out: {e}")
    return added


def _warn(line: str) -> None:
    """One line on stderr, as the CLI writes its messages (no markup: a plugin's error may hold brackets)."""
    Console(stderr=True, soft_wrap=True, highlight=False).print(line, markup=False)


def by_name(name: str) -> DrafterKind | None:
    return table().get(name)


def by_spec_type(spec_type: str) -> DrafterKind | None:
    spec_type = spec_type.strip().lower()
    return next((k for k in table().values() if spec_type in k.spec_types), None)


def by_word(word: str) -> DrafterKind | None:
    """The kind a `-md` / `draft` word names without a file (prompt-lookup, mtp), or None: a model ref."""
    return next((k for k in table().values() if k.word is not None and k.word == word), None)


def for_file(arch: str | None) -> DrafterKind:
    """The kind a -md file drafts as, by its GGUF architecture: a head trained for the target, else a model."""
    return next((k for k in table().values() if arch in k.archs), DRAFT_MODEL)


def for_suffix(name: str) -> DrafterKind | None:
    """The kind a -md file that is not a GGUF drafts as, by its name's ending (None: a GGUF)."""
    return next((k for k in table().values() if k.suffixes and name.lower().endswith(k.suffixes)), None)


def spec_type_help() -> str:
    """Each of specchat's own kinds' --spec-type names and how it is given, for the option's help (the
    installed kinds are read later: looking them up would cost every start-up)."""
    return ", ".join(f"{' / '.join(k.spec_types)} ({k.usage})" for k in KINDS.values() if k.spec_types)


def words() -> tuple[str, ...]:
    return tuple(k.word for k in table().values() if k.word is not None)


def spec_types() -> tuple[str, ...]:
    return tuple(t for k in table().values() for t in k.spec_types)


def source_style(source: str) -> tuple[str, str]:
    """(what the terminal calls a StepStats.source, the style it shows it in)."""
    for kind in table().values():
        if source == kind.name:
            return kind.label, kind.colour
        if source in kind.sources:
            return kind.sources[source], kind.colour
    return source, ""
