"""A drafter kind from another installed package: a tiny package whose entry point (group
`specchat.drafters`) names its DrafterKind is installed from its wheel into a folder with pip, and fresh
`specchat` processes with that folder on their path draft with it through prompt, chat and report,
nothing in specchat/ changed. And a plugin that cannot be loaded is left out with one line, never a
traceback."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import tiny_models
from real_models import specchat

from specchat import kinds

PLUGIN = "specchat_echo_plugin"
WORD = "echo-plugin"

MODULE = f'''
"""Proposes the last k tokens of the context again: cheap, often wrong, always exact (q one-hot)."""

from specchat.drafters import Draft, ModelDrafting
from specchat.kinds import DrafterKind


class Echo(ModelDrafting):
    backend = None

    def prefill(self, prompt_ids):
        pass

    def room(self):
        return 1 << 30

    def propose(self, context, k, params, rng):
        tokens = list(context[-k:]) if k > 0 else []
        return Draft(tokens, [None] * len(tokens), source=KIND.name)


def build(build):
    return Echo()


KIND = DrafterKind("{WORD}", "echo", "{PLUGIN}:build", cost="free", spec_types=("{WORD}",), word="{WORD}",
                   colour="yellow")
Echo.kind = KIND
'''

ENTRY_POINTS = f"""[specchat.drafters]
echo = {PLUGIN}:KIND
"""


def wheel(folder: Path, module: str, entry_points: str = ENTRY_POINTS) -> Path:
    """The package as a wheel, written here: no build backend needed (this machine has no `wheel`)."""
    info = "specchat_echo_plugin-0.1.dist-info"
    files = {
        f"{PLUGIN}.py": textwrap.dedent(module).encode(),
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: specchat-echo-plugin\nVersion: 0.1\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: specchat-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": entry_points.encode(),
    }

    def digest(data: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{name},sha256={digest(data)},{len(data)}\n" for name, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    path = folder / "specchat_echo_plugin-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
    return path


def install(tmp: Path, module: str) -> Path:
    """Install the package's wheel with pip into a folder of its own (no index, no dependencies: specchat is
    already here); returns the folder, for a PYTHONPATH."""
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel(tmp, module))], check=True, capture_output=True, timeout=300)
    assert (next(target.glob("*.dist-info")) / "entry_points.txt").exists()
    return target


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("plugin"), MODULE)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_models.write_model(tmp_path_factory.mktemp("tiny-plugin") / "llama.gguf", "llama")


def with_plugin(site: Path) -> dict:
    """The environment of a specchat process that has the package installed (beside this specchat)."""
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    if str(Path(kinds.__file__).parents[1]) not in paths:
        paths.append(str(Path(kinds.__file__).parents[1]))
    return {"PYTHONPATH": os.pathsep.join(paths)}


@pytest.mark.tiny
def test_an_installed_kind_drafts_through_prompt_chat_and_report(plugin_site, tiny_llama, tmp_path):
    env = with_plugin(plugin_site)
    result = specchat("prompt", " house garden", "-m", str(tiny_llama), "-md", WORD, "--temp", "0", "-n", "16",
                      "--json", "--draft-fixed", "2", home=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["drafter"] == WORD and record["stats"]["drafted"] > 0
    assert record["stats"]["drafted_by"] == {WORD: record["stats"]["drafted"]}
    # by llama.cpp's spelling too, chained with lookup and priced each step
    result = specchat("prompt", " house garden", "-m", str(tiny_llama), "--spec-type", f"ngram-simple,{WORD}",
                      "--temp", "0", "-n", "16", "--json", home=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["drafter"] == f"prompt-lookup + {WORD}"

    result = specchat("chat", "-m", str(tiny_llama), "-md", WORD, "--temp", "0", "-n", "12", "--draft-fixed", "2",
                      home=tmp_path, env=env, stdin="house garden\n/stats\n")
    assert result.returncode == 0, result.stderr
    assert WORD in result.stdout + result.stderr

    out = tmp_path / "report"
    result = specchat("report", "-m", str(tiny_llama), "-md", WORD, "--sweep", "0,2", "--limit", "1", "-n", "8",
                      "--out", str(out), home=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    doc = json.loads((out / "report.json").read_text())
    assert doc["drafter_kind"] == WORD and doc["summary"]["all"]["k=2"]["drafted"] > 0


def test_without_the_package_the_kind_is_unknown(tmp_path):
    result = specchat("prompt", "hi", "-m", str(tmp_path / "absent.gguf"), "--spec-type", WORD, home=tmp_path)
    assert result.returncode == 2 and f"'{WORD}' is not one of" in result.stderr, result.stderr


def test_a_broken_plugin_is_left_out_with_one_line(tmp_path):
    site = install(tmp_path, "raise ImportError('a missing dependency')\n")
    result = specchat("prompt", "hi", "-m", str(tmp_path / "absent.gguf"), "--spec-type", WORD, home=tmp_path,
                      env=with_plugin(site))
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and len(lines) == 2, result.stderr
    assert lines[0].startswith("specchat: warning: drafter plugin echo") and "a missing dependency" in lines[0]
    assert result.returncode == 2 and f"'{WORD}' is not one of" in lines[1]
