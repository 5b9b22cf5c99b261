"""`specchat prompt` end to end, and every kind of bad input: one line on stderr, exit code 2, no traceback.

Most run in-process (`cli.main` with captured output); the ones that must prove there is no crash and no
llama.cpp log line on stderr, and the working runs, are a real subprocess."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from fakes import assert_user_error
from real_models import specchat

from specchat.config import load_config
from specchat.sources import resolve


@pytest.fixture(scope="module")
def smollm2_path():
    return resolve(load_config().model("smollm2-135m"))


# --- bad input ----------------------------------------------------------------------------------


def test_missing_model_file(cli, tmp_path):
    assert_user_error(cli("prompt", "hi", "-m", str(tmp_path / "nope.gguf"), home=tmp_path), "not found", "nope.gguf")


def test_non_gguf_file(cli, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("this is not a model\n" * 10)
    assert_user_error(cli("prompt", "hi", "-m", str(fake), home=tmp_path), "not a GGUF file")


@pytest.mark.real
def test_truncated_gguf_file(tmp_path, smollm2_path):
    truncated = tmp_path / "truncated.gguf"
    with smollm2_path.open("rb") as f:
        truncated.write_bytes(f.read(2 * 2**20))
    assert_user_error(specchat("prompt", "hi", "-m", str(truncated), home=tmp_path), "could not load", "truncated.gguf")


def test_bad_models_toml(cli, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[models.x]\npath = "a.gguf"\nhub = "o/r:Q4_K_M"\n')
    result = cli("prompt", "hi", home=tmp_path, env={"SPECCHAT_CONFIG": str(bad)})
    assert_user_error(result, "bad.toml:", "models.x")


def test_toml_syntax_error_names_the_line(cli, tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text('[pairs.mine]\ntarget = "smollm2-135m"\ndraft = \n')
    result = cli("models", home=tmp_path, env={"SPECCHAT_CONFIG": str(bad)})
    assert_user_error(result, "broken.toml:3")


def test_unknown_pair(cli, tmp_path):
    assert_user_error(cli("prompt", "hi", "--pair", "no-such-pair", home=tmp_path), "no-such-pair", "default")


def test_unknown_model_name(cli, tmp_path):
    assert_user_error(cli("prompt", "hi", "-m", "no-such-model", home=tmp_path), "no-such-model")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--temp", "-1"], "--temp"),
        (["--temp", "warm"], "--temp"),
        (["-n", "0"], "--max-tokens"),
        (["-n", "-5"], "--max-tokens"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-k", "-3"], "--top-k"),
        (["--min-p", "2"], "--min-p"),
        (["--repeat-penalty", "0"], "--repeat-penalty"),
        (["--draft-max", "-1"], "--draft-max"),
        (["--draft-min", "5", "--draft-max", "2"], "--draft-min"),
        (["--draft-p-min", "1.5"], "--draft-p-min"),
        (["-c", "0"], "--ctx-size"),
        (["-ngl", "-7"], "-ngl"),
        (["--seed", "-4"], "--seed"),
        (["--lookup-min", "4", "--lookup-max", "2"], "--lookup-min"),
        (["--lookup-max", "0"], "--lookup-max"),
        (["--lookup-max", "5000"], "--lookup-max"),
        (["--hybrid", "-md", "prompt-lookup"], "--hybrid"),
        (["--hybrid=yes"], "--hybrid"),
        (["--threads", "0"], "--threads"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_nonsense_option_values(cli, tmp_path, args, needle):
    assert_user_error(cli("prompt", "hi", *args, home=tmp_path), needle)


def test_empty_prompt(cli, tmp_path):
    assert_user_error(cli("prompt", "   ", home=tmp_path), "empty prompt")


def test_empty_prompt_from_stdin(cli, tmp_path):
    assert_user_error(cli("prompt", "-", home=tmp_path, stdin=""), "empty prompt")


@pytest.mark.real
def test_prompt_longer_than_context(tmp_path):
    long_text = "the cat sat on the mat. " * 200
    assert_user_error(specchat("prompt", long_text, "-c", "128", home=tmp_path), "prompt is", "-c")


# --- working runs -------------------------------------------------------------------------------


@pytest.mark.real
def test_prompt_json_schema_and_lossless_accounting(measured_home):
    result = specchat(
        "prompt", "Repeat exactly: one two three four five, one two three four five.",
        "--json", "--temp", "0", "-n", "32", home=measured_home,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert set(doc) >= {"text", "tokens", "prompt_token_ids", "stats", "finish_reason"}
    assert doc["text"] == "".join(t["text"] for t in doc["tokens"])
    assert {t["source"] for t in doc["tokens"]} <= {"accepted", "resampled", "bonus", "target"}
    stats = doc["stats"]
    for key in ("steps", "drafted", "accepted", "acceptance_rate", "mean_accepted_length",
                "per_position_acceptance", "prefill_seconds", "generate_seconds", "tokens_per_second", "draft_lengths"):
        assert key in stats
    accepted_tokens = sum(t["source"] == "accepted" for t in doc["tokens"])
    assert accepted_tokens <= stats["accepted"]
    assert stats["generated_tokens"] == len(doc["tokens"])
    # SmolLM2-Instruct: the ChatML template was applied to what the target evaluated
    assert doc["prompt_token_ids"][0] == 1  # <|im_start|>
    assert doc["drafter"] == "prompt-lookup"


@pytest.mark.real
def test_no_spec_runs_target_only_through_the_same_path(measured_home):
    result = specchat("prompt", "Say hello.", "--json", "--no-spec", "--temp", "0", "-n", "12", home=measured_home)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["stats"]["drafted"] == 0
    assert {t["source"] for t in doc["tokens"]} == {"target"}
    assert doc["drafter"] == "none"


@pytest.mark.real
def test_prompt_from_stdin_plain_output(measured_home):
    result = specchat("prompt", "-", "--temp", "0", "-n", "8", home=measured_home, stdin="What is 2 + 2?")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "\x1b[" not in result.stdout  # not a terminal: plain text only


@pytest.mark.parametrize("value", ["nope", "", "SLEMX"])
def test_bad_cross_vocab_rule(cli, tmp_path, value):
    assert_user_error(cli("prompt", "hi", "--cross-vocab", value, home=tmp_path), "--cross-vocab", "slem")


@pytest.mark.parametrize("value", ["yes", "", "1"])
def test_bad_flash_attn_value(cli, tmp_path, value):
    assert_user_error(cli("prompt", "hi", "-fa", value, home=tmp_path), "--flash-attn", "auto")


# --- bad input, second round ---------------------------------------------------------------------------


def test_prompt_that_is_not_utf8(cli, tmp_path):
    # what Python makes of the bytes b"caf\xe9" in argv (surrogateescape)
    assert_user_error(cli("prompt", "caf\udce9"), "not valid UTF-8", "0xe9")
    assert_user_error(cli("prompt", "hi", "--system", "x\udcff"), "--system", "not valid UTF-8")


def test_prompt_bytes_that_are_not_utf8_end_to_end(tmp_path):
    environment = {**os.environ, "SPECCHAT_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "specchat.cli", "prompt", b"caf\xe9"], capture_output=True,
                            text=True, env=environment, timeout=120)
    assert_user_error(result, "not valid UTF-8", "0xe9")
    stdin = subprocess.run([sys.executable, "-m", "specchat.cli", "prompt", "-"], input=b"caf\xe9", capture_output=True,
                           env=environment, timeout=120)
    assert stdin.returncode == 2 and b"on stdin is not valid UTF-8" in stdin.stderr and b"Traceback" not in stdin.stderr


def test_empty_stop_string(cli):
    assert_user_error(cli("prompt", "hi", "--stop", ""), "--stop", "empty")


@pytest.mark.parametrize("threads", ["100000", "513"])
def test_threads_beyond_ggml_limit(cli, threads):
    assert_user_error(cli("prompt", "hi", "-t", threads), "--threads", "1..512")


def test_hub_path_outside_the_repo_is_refused_at_once(cli):
    started = time.perf_counter()
    assert_user_error(cli("prompt", "hi", "-m", "owner/repo:../../etc/passwd"), "not a file name inside the repository")
    assert time.perf_counter() - started < 5


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hub_without_network_is_one_line_within_seconds(tmp_path):
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HOME": str(tmp_path / "hf")}
    for ref in ("bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", "owner/repo:model.gguf"):
        started = time.perf_counter()
        result = specchat("prompt", "hi", "-m", ref, home=tmp_path, env=env, timeout=60)
        assert time.perf_counter() - started < 10
        assert_user_error(result, ref, "not in the local Hugging Face cache", "-m /path/to/model.gguf")
        assert "Retrying" not in result.stderr


@pytest.mark.real
def test_context_too_big_for_memory_names_the_trained_context(tmp_path):
    # a subprocess: llama.cpp must not print its own log lines, nor the process crash. 10M tokens of SmolLM2's
    # KV cache are ~230 GB, which no test machine has; llama.cpp fills its cell bookkeeping (~50 bytes a
    # cell) before the buffer fails, so a -c ten times larger costs 5 GB of written memory for the same line
    assert_user_error(specchat("prompt", "hi", "-c", "9999999", home=tmp_path),
                      "cannot allocate the KV cache for -c 9999999", "trained for 8192")


@pytest.mark.real
def test_threads_beyond_the_limit_do_not_reach_llama_cpp(tmp_path):
    assert_user_error(specchat("prompt", "hi", "-t", "100000", home=tmp_path), "1..512")


@pytest.mark.real
def test_models_prints_no_llama_log_and_text_as_written(tmp_path):
    # the user's own home: a fresh one would join the split models' files first (a notice on stderr)
    result = subprocess.run([sys.executable, "-m", "specchat.cli", "models"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "250"}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "llama" not in result.stderr and "n_ctx" not in result.stderr, result.stderr
    assert "the [models] extra" in result.stdout


# --- the help page --------------------------------------------------------------------------------


def test_help_shows_one_flag_name_a_line_at_a_narrow_width_and_leaves_typer_as_it_was(cli, monkeypatch):
    """Typer joins a flag's names with ','; specchat's commands break them one a line (a name is never cut
    with '…', even where the help text beside it is), for the help page only: Typer's highlighters are its
    own again afterwards."""
    from typer import rich_utils

    before = rich_utils.highlighter, rich_utils.negative_highlighter
    monkeypatch.setenv("COLUMNS", "60")
    result = cli("prompt", "--help")
    assert result.returncode == 0
    assert not re.search(r"--[\w-]+,-", result.stdout), result.stdout
    # a flag's names stand at the start of the table's first column (help text that mentions a flag is further in)
    names = [line.split()[1] for line in result.stdout.splitlines() if re.match(r"│ {1,3}--", line)]
    assert not [name for name in names if "…" in name], result.stdout
    assert names[names.index("--draft"):names.index("--draft") + 3] == ["--draft", "--model-draft", "--spec-draft-model"]
    assert (rich_utils.highlighter, rich_utils.negative_highlighter) == before


def test_importing_the_cli_patches_nothing_and_loads_no_help_renderer():
    """`import specchat.cli` leaves typer.rich_utils unloaded (0.4 s that only a help page needs)."""
    code = "import sys, specchat.cli; print('typer.rich_utils' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
