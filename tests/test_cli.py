"""`specchat prompt` end to end, and every kind of bad input: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specchat.config import load_config
from specchat.sources import resolve


def specchat(*args: str, home, stdin: str | None = None, env: dict | None = None, timeout: int = 180):
    environment = {**os.environ, "SPECCHAT_HOME": str(home), **(env or {})}
    environment.pop("SPECCHAT_CONFIG", None) if env is None or "SPECCHAT_CONFIG" not in env else None
    return subprocess.run(
        [sys.executable, "-m", "specchat.cli", *args],
        input=stdin, capture_output=True, text=True, env=environment, timeout=timeout,
    )


def assert_user_error(result, *needles: str):
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("specchat: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""


@pytest.fixture(scope="module")
def smollm2_path():
    return resolve(load_config().model("smollm2-135m"))


# --- bad input ----------------------------------------------------------------------------------


def test_missing_model_file(tmp_path):
    assert_user_error(specchat("prompt", "hi", "-m", str(tmp_path / "nope.gguf"), home=tmp_path), "not found", "nope.gguf")


def test_non_gguf_file(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("this is not a model\n" * 10)
    assert_user_error(specchat("prompt", "hi", "-m", str(fake), home=tmp_path), "not a GGUF file")


@pytest.mark.real
def test_truncated_gguf_file(tmp_path, smollm2_path):
    truncated = tmp_path / "truncated.gguf"
    with smollm2_path.open("rb") as f:
        truncated.write_bytes(f.read(2 * 2**20))
    assert_user_error(specchat("prompt", "hi", "-m", str(truncated), home=tmp_path), "could not load", "truncated.gguf")


def test_bad_models_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[models.x]\npath = "a.gguf"\nhub = "o/r:Q4_K_M"\n')
    result = specchat("prompt", "hi", home=tmp_path, env={"SPECCHAT_CONFIG": str(bad)})
    assert_user_error(result, "bad.toml:", "models.x")


def test_toml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text('[pairs.mine]\ntarget = "smollm2-135m"\ndraft = \n')
    result = specchat("models", home=tmp_path, env={"SPECCHAT_CONFIG": str(bad)})
    assert_user_error(result, "broken.toml:3")


def test_unknown_pair(tmp_path):
    assert_user_error(specchat("prompt", "hi", "--pair", "no-such-pair", home=tmp_path), "no-such-pair", "default")


def test_unknown_model_name(tmp_path):
    assert_user_error(specchat("prompt", "hi", "-m", "no-such-model", home=tmp_path), "no-such-model")


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
def test_nonsense_option_values(tmp_path, args, needle):
    assert_user_error(specchat("prompt", "hi", *args, home=tmp_path), needle)


def test_empty_prompt(tmp_path):
    assert_user_error(specchat("prompt", "   ", home=tmp_path), "empty prompt")


def test_empty_prompt_from_stdin(tmp_path):
    assert_user_error(specchat("prompt", "-", home=tmp_path, stdin=""), "empty prompt")


@pytest.mark.real
def test_prompt_longer_than_context(tmp_path):
    long_text = "the cat sat on the mat. " * 200
    assert_user_error(specchat("prompt", long_text, "-c", "128", home=tmp_path), "prompt is", "-c")


# --- working runs -------------------------------------------------------------------------------


@pytest.mark.real
def test_prompt_json_schema_and_lossless_accounting(tmp_path):
    result = specchat(
        "prompt", "Repeat exactly: one two three four five, one two three four five.",
        "--json", "--temp", "0", "-n", "32", home=tmp_path,
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
def test_no_spec_runs_target_only_through_the_same_path(tmp_path):
    result = specchat("prompt", "Say hello.", "--json", "--no-spec", "--temp", "0", "-n", "12", home=tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["stats"]["drafted"] == 0
    assert {t["source"] for t in doc["tokens"]} == {"target"}
    assert doc["drafter"] == "none"


@pytest.mark.real
def test_prompt_from_stdin_plain_output(tmp_path):
    result = specchat("prompt", "-", "--temp", "0", "-n", "8", home=tmp_path, stdin="What is 2 + 2?")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "\x1b[" not in result.stdout  # not a terminal: plain text only


@pytest.mark.parametrize("value", ["nope", "", "SLEMX"])
def test_bad_cross_vocab_rule(tmp_path, value):
    assert_user_error(specchat("prompt", "hi", "--cross-vocab", value, home=tmp_path), "--cross-vocab", "slem")
