"""llama.cpp RPC workers: `specchat rpc-server` on 127.0.0.1 (a random free port) holding the target's
layers, and every way a worker can fail the client: not there, busy, too little memory, killed mid-reply,
silent mid-reply (stopped), gone between chat turns.

Each worker is a `specchat rpc-server` child process. Tests whose worker dies run the client in a child
process too, or make sure nothing in this process touches the dead worker: ggml's RPC client aborts the
process that does.
"""

from __future__ import annotations

import io
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specchat import rpc
from specchat.config import ConfigError, load_config
from specchat.rpc import RpcError, parse_endpoints

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.3  # batch vs single-token logit noise is <= ~0.12 here (see test_real.py)
MODEL = "smollm2-135m"


def _rpc_build() -> bool:
    try:
        import llama_cpp
    except ImportError:
        return False
    return bool(llama_cpp.llama_supports_rpc())


# CI (.ci/run) installs an RPC build and sets SPECCHAT_REQUIRE_RPC: there a missing RPC backend fails
needs_rpc = pytest.mark.skipif(
    not _rpc_build() and not os.environ.get("SPECCHAT_REQUIRE_RPC"),
    reason=f"llama-cpp-python without RPC: {rpc.REINSTALL}",
)


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}


def specchat(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specchat.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env(), cwd=ROOT, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Worker:
    """A `specchat rpc-server` child on 127.0.0.1."""

    def __init__(self, threads: int = 2):
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specchat.cli", "rpc-server", "--port", str(self.port), "-t", str(threads)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                rpc.probe(self.endpoint, timeout=2)
                return
            except RpcError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker did not start: {self.proc.stderr.read()}")
                time.sleep(0.2)

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def worker():
    w = Worker()
    yield w
    w.stop(signal.SIGKILL)


def model_path():
    from specchat.sources import resolve

    try:
        return resolve(load_config().model(MODEL), download=False)
    except Exception as e:  # the [models] extra is not installed
        pytest.skip(f"{MODEL} unavailable: {e}")


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("specchat: error: "), lines[0]
    return lines[0]


# -- no worker needed --------------------------------------------------------------------------------


def test_endpoints_parse_and_bad_syntax_is_one_line():
    assert parse_endpoints("127.0.0.1:50052, 10.0.0.2:6000") == ("127.0.0.1:50052", "10.0.0.2:6000")
    assert parse_endpoints(["a:1", "b:2,c:3"]) == ("a:1", "b:2", "c:3")
    assert parse_endpoints(None) == ()
    for bad in ("127.0.0.1", "host:", ":50052", "h:0", "h:70000", "h:x1", "a:1,a:1", "a:1,"):
        with pytest.raises(RpcError):
            parse_endpoints(bad)
    line = error_line(specchat("prompt", "hi", "--rpc", "localhost", timeout=60))
    assert "HOST:PORT" in line


def test_models_toml_rpc_key(tmp_path, monkeypatch):
    path = tmp_path / "models.toml"
    path.write_text('[models.remote]\npath = "x.gguf"\nrpc = "127.0.0.1:50052,10.0.0.2:50052"\n'
                    '[pairs.far]\ntarget = "remote"\ndraft = "prompt-lookup"\nrpc = ["127.0.0.1:6000"]\n')
    monkeypatch.setenv("SPECCHAT_CONFIG", str(path))
    config = load_config()
    assert config.model("remote").rpc == ("127.0.0.1:50052", "10.0.0.2:50052")
    assert config.pair("far").rpc == ("127.0.0.1:6000",)
    from specchat.loader import select

    assert select(config, pair="far", target=None, draft=None, no_spec=False).rpc == ("127.0.0.1:6000",)
    path.write_text('[models.remote]\npath = "x.gguf"\nrpc = "nohost"\n')
    with pytest.raises(ConfigError, match=r"models\.toml:3: models\.remote\.rpc: bad RPC endpoint"):
        load_config()


def test_a_build_without_rpc_gets_one_line_with_the_reinstall_command(monkeypatch):
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_supports_rpc", lambda: False)
    monkeypatch.setattr(rpc, "_libs", None)
    with pytest.raises(RpcError, match="built without RPC; reinstall it: CMAKE_ARGS=.*-DGGML_RPC=on.*--no-cache-dir") as e:
        rpc.register(["127.0.0.1:1"])
    assert "\n" not in str(e.value)


def test_rpc_option_off_means_local():
    from specchat.runner import rpc_endpoints

    assert rpc_endpoints(None) is None
    assert rpc_endpoints("off") == ()
    assert rpc_endpoints("h:1,h:2") == ("h:1", "h:2")


def test_placement_counts_layers_like_llamacpp():
    dev = [rpc.RpcDevice("RPC0", "127.0.0.1:50052", 0)]
    # 30 repeating layers + the output layer; -ngl takes the output layer first, then from the top
    assert rpc.placement(30, -1, dev) == "31/31 layers on RPC (RPC0 127.0.0.1:50052)"
    assert rpc.placement(30, 99, dev) == "31/31 layers on RPC (RPC0 127.0.0.1:50052)"
    assert rpc.placement(30, 15, dev) == "15/31 layers on RPC (RPC0 127.0.0.1:50052), 16 on this CPU"
    assert rpc.placement(30, 0, dev) == "all 31 layers on this CPU (-ngl 0)"


@pytest.mark.real
@needs_rpc
def test_unreachable_worker_is_one_line_within_seconds():
    started = time.monotonic()
    line = error_line(specchat("prompt", "hi", "-m", MODEL, "--rpc", f"127.0.0.1:{free_port()}", timeout=60))
    assert "unreachable" in line and "specchat rpc-server" in line
    assert time.monotonic() - started < 30  # mostly Python start-up on a loaded machine


@pytest.mark.real
@needs_rpc
def test_silent_listener_is_one_line_after_the_probe_timeout():
    """Something listens but never answers (or a worker busy with another client): no hang."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        with pytest.raises(RpcError, match="did not answer within"):
            rpc.probe(f"127.0.0.1:{port}", timeout=1.0)
        started = time.monotonic()
        line = error_line(specchat("prompt", "hi", "-m", MODEL, "--rpc", f"127.0.0.1:{port}", timeout=60))
        assert "one client at a time" in line
        assert time.monotonic() - started < 30


@needs_rpc
def test_busy_port_and_non_loopback_warning():
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("0.0.0.0", 0))
        holder.listen(1)
        port = str(holder.getsockname()[1])
        line = error_line(specchat("rpc-server", "--port", port, timeout=60))
        assert "in use" in line and "--port" in line
        result = specchat("rpc-server", "--host", "0.0.0.0", "--port", port, timeout=60)
        assert result.returncode == 2
        assert "WARNING" in result.stderr and "no authentication" in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("specchat: error: cannot listen")


@needs_rpc
def test_worker_stops_cleanly_on_sigint_and_sigterm():
    for sig in (signal.SIGINT, signal.SIGTERM):
        w = Worker(threads=1)
        assert w.stop(sig) == 0
        assert "stopped" in w.proc.stderr.read()


# -- a live worker -----------------------------------------------------------------------------------


@pytest.mark.real
@needs_rpc
def test_greedy_reply_over_rpc_is_the_targets_and_the_worker_did_the_work(worker):
    from specchat.backend import LlamaCppBackend
    from specchat.lookup import PromptLookup
    from specchat.engine import Finished, generate
    from specchat.policy import FixedPolicy
    from specchat.sampling import SamplingParams
    from specchat.template import render

    path = model_path()
    remote = LlamaCppBackend(path, n_ctx=1024, n_threads=2, rpc=[worker.endpoint], name=MODEL)
    try:
        n = remote.n_layer + 1
        assert remote.placement == f"{n}/{n} layers on RPC ({remote.rpc_devices[0].name} {worker.endpoint})"
        text = "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape."
        prompt_ids = render(remote, [{"role": "user", "content": text}]).token_ids
        cpu_before = worker.cpu()
        events = list(generate(remote, PromptLookup(1, 4), prompt_ids, SamplingParams(temperature=0.0),
                               max_tokens=40, policy=FixedPolicy(4)))
        worker_cpu = worker.cpu() - cpu_before
        finished = events[-1]
        assert isinstance(finished, Finished) and len(finished.token_ids) > 10
        assert finished.stats.drafted > 0 and finished.stats.rollback_recoveries == 0
    finally:
        remote.close()
    # ~40 forward passes of a 135M model: the worker spent real CPU time on them
    assert worker_cpu > 0.3, f"worker CPU {worker_cpu:.2f} s"
    # teacher-forced on a local copy of the target: every emitted token is that position's best choice
    local = LlamaCppBackend(path, n_ctx=1024, n_threads=2, name=MODEL)
    try:
        assert local.placement is None
        sequence = list(prompt_ids) + finished.token_ids
        first = len(prompt_ids) - 1
        rows = local.eval(sequence[:-1], range(first, len(sequence) - 1))
        gaps = rows.max(axis=1) - rows[np.arange(len(finished.token_ids)), finished.token_ids]
        assert gaps.max() <= TOLERANCE, f"token {int(gaps.argmax())} is {gaps.max():.3f} below the best logit"
    finally:
        local.close()


def test_cost_model_is_keyed_per_endpoint_set():
    from types import SimpleNamespace

    from specchat.costs import cost_cache_key

    import hashlib

    base = dict(path="/nonexistent/x.gguf", name="x", n_threads=2, n_gpu_layers=-1)
    local = cost_cache_key(SimpleNamespace(**base, rpc=()))
    one = cost_cache_key(SimpleNamespace(**base, rpc=("127.0.0.1:1",)))
    other = cost_cache_key(SimpleNamespace(**base, rpc=("127.0.0.1:2",)))
    assert len({local, one, other}) == 3
    # keys of local models did not change: the key from before RPC existed
    before_rpc = hashlib.sha1(b"/nonexistent/x.gguf|threads=2|ngl=-1").hexdigest()[:16]
    assert before_rpc == local


@pytest.mark.real
@needs_rpc
def test_ngl_counts_the_layers_placed_on_the_worker(worker):
    from specchat.backend import LlamaCppBackend

    remote = LlamaCppBackend(model_path(), n_ctx=256, n_threads=2, rpc=[worker.endpoint], n_gpu_layers=15, name=MODEL)
    try:
        n = remote.n_layer + 1
        assert remote.placement == f"15/{n} layers on RPC ({remote.rpc_devices[0].name} {worker.endpoint}), {n - 15} on this CPU"
        before = worker.cpu()
        remote.eval(remote.tokenize("The capital of France is") * 8, [0])
        assert worker.cpu() > before  # the worker's layers ran there
    finally:
        remote.close()


@pytest.mark.real
@needs_rpc
def test_worker_with_too_little_memory_is_one_line(worker):
    # cap the worker's address space a little above what it uses now: the model's buffers cannot fit
    size_kb = int(next(l for l in Path(f"/proc/{worker.proc.pid}/status").read_text().splitlines()
                       if l.startswith("VmSize")).split()[1])
    limit = (size_kb + 32 * 1024) * 1024
    resource.prlimit(worker.proc.pid, resource.RLIMIT_AS, (limit, limit))
    started = time.monotonic()
    line = error_line(specchat("prompt", "hi", "-m", MODEL, "--rpc", worker.endpoint, "-n", "4"))
    assert "could not load" in line and "RPC workers" in line and "memory" in line
    assert time.monotonic() - started < 60
    assert worker.proc.poll() is None  # the worker survives a client it could not serve


# `specchat` as `python -m specchat.cli` does, with the watchdog's slack set first (argv[1])
WITH_SLACK = """
import sys
from specchat import cli, rpc
rpc.DEADLINE_SLACK = float(sys.argv.pop(1))
cli.main(sys.argv[1:])
"""


def busy_client(worker: Worker, slack: float | None = None) -> subprocess.Popen:
    """A `specchat prompt` on the worker with a long reply ahead, returned once the weights arrived and
    decoding is under way (the worker is busy). `slack`: the watchdog's, in place of rpc.DEADLINE_SLACK."""
    command = ["prompt", "Count from one to one thousand in words.", "-m", MODEL, "--rpc", worker.endpoint,
               "--no-spec", "--temp", "0", "-n", "3000", "--ignore-eos", "-c", "4096"]
    launch = ["-m", "specchat.cli"] if slack is None else ["-c", WITH_SLACK, str(slack)]
    client = subprocess.Popen(
        [sys.executable, *launch, *command],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT,
    )
    # the first streamed text, not the worker's CPU time: a worker busy receiving the weights, killed then,
    # is refused at the load's next connection ("unreachable"), not lost mid-reply
    deadline = time.monotonic() + 90
    while not select.select([client.stdout], [], [], 0.1)[0]:
        if client.poll() is not None or time.monotonic() > deadline:
            client.kill()
            raise AssertionError(f"the client never started its reply: {client.communicate()[1]}")
    os.read(client.stdout.fileno(), 1)  # (the text wrapper has buffered nothing: communicate reads the rest)
    return client


@pytest.mark.real
@needs_rpc
def test_worker_killed_mid_reply_is_one_line_exit_2(worker):
    client = busy_client(worker)
    try:
        worker.proc.kill()
        killed = time.monotonic()
        out, err = client.communicate(timeout=30)
        assert time.monotonic() - killed < 10
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    lines = [line for line in err.splitlines() if line.strip()]
    assert client.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("specchat: error: lost the RPC worker"), err
    assert worker.endpoint in lines[0]


@pytest.mark.real
@needs_rpc
def test_chat_goes_on_locally_after_the_worker_is_gone(tmp_path):
    from specchat import chat, ui
    from specchat.loader import LoadOptions, Selection, load
    from specchat.runner import RunOptions
    from specchat.sampling import SamplingParams
    from specchat.transcript import load_transcript

    model_path()
    w = Worker()
    try:
        opts = LoadOptions(n_ctx=1024, rpc=(w.endpoint,))
        loaded = load(load_config(), Selection(MODEL, "prompt-lookup"), opts)
        run = RunOptions(Selection(MODEL, "prompt-lookup"), opts, SamplingParams(temperature=0.0), 8, 4, 12)
        info = io.StringIO()
        session = chat.ChatSession(
            loaded, run, console=ui.make_console(file=io.StringIO()), info=ui.make_console(file=info, width=300),
            out=io.StringIO(), transcript=chat.Transcript(tmp_path / "t.jsonl"), live=False,
        )
        try:
            session.header()
            assert "layers: " in info.getvalue() and w.endpoint in info.getvalue()
            session.handle("What is the capital of France?")
            assert len(session.turn_log) == 1
            # what a worker lost mid-reply prints, after the one line: how to go on from the transcript
            assert f"--resume {tmp_path / 't.jsonl'} --rpc off" in rpc.abort_hint
            w.stop(signal.SIGKILL)
            session.handle("And of Italy?")  # refused before anything touches the dead worker
            assert len(session.turn_log) == 1
            assert "is unreachable: /rpc off continues on this machine" in info.getvalue()
            session.handle("/rpc off")
            assert session.loaded.target.rpc == () and "runs on this machine now" in info.getvalue()
            session.handle("And of Italy?")
            assert len(session.turn_log) == 2
        finally:
            loaded.close()
        records = [r["role"] for r in load_transcript(tmp_path / "t.jsonl").records]
        assert records == ["user", "assistant", "user", "assistant"]
    finally:
        w.stop(signal.SIGKILL)


# -- a worker that stops answering: rpc.Watchdog ----------------------------------------------------------

# A child that waits on a "worker" (a socket that listens and never answers) as a decode would: blocked in
# one call that the main thread's Python signal handlers cannot end (the SIGTERM handler here does nothing,
# as Python's own waits for the call to return).
WAITING = """
import signal, socket, sys, time
from specchat import rpc
rpc.DEADLINE_SLACK = float(sys.argv[1])
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
endpoint = "127.0.0.1:%d" % listener.getsockname()[1]
if sys.argv[2] == "gone":
    listener.close()
signal.signal(signal.SIGTERM, lambda *a: None)
dog = rpc.watchdog()
dog.on_stop.append(lambda line: print("saved:", line, flush=True))
with dog.waiting_on([endpoint], 1):
    print("waiting", flush=True)
    time.sleep(120)
print("returned", flush=True)
"""


def waiting_child(slack: float, worker: str = "silent") -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", WAITING, str(slack), worker], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    assert child.stdout.readline().strip() == "waiting", child.stderr.read()
    return child


@pytest.mark.parametrize("worker, says", [("silent", "stopped answering: no reply in"),
                                          ("gone", "lost the RPC worker")])
def test_a_worker_that_does_not_answer_ends_the_command_after_the_deadline(worker, says):
    started = time.monotonic()
    child = waiting_child(1.0, worker)
    out, err = child.communicate(timeout=30)
    assert time.monotonic() - started < 15
    lines = [line for line in err.splitlines() if line.strip()]
    assert child.returncode == 2 and len(lines) == 1, err
    assert lines[0].startswith("specchat: error: ") and says in lines[0] and "127.0.0.1:" in lines[0]
    assert out.startswith("saved:") and "returned" not in out  # the chat's callback ran first


def test_sigterm_while_a_worker_does_not_answer_acts_at_once():
    child = waiting_child(600.0)
    time.sleep(0.5)
    child.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    out, err = child.communicate(timeout=30)
    assert time.monotonic() - sent < 3
    assert child.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM while waiting" in err and "returned" not in out


def test_the_deadline_grows_with_the_slowest_step():
    dog = rpc.Watchdog(exit=lambda code: None)
    assert dog.deadline(1) == rpc.DEADLINE_SLACK
    with dog.waiting_on(["127.0.0.1:1"], 4):
        time.sleep(0.2)
    assert dog.slowest >= 0.2 and dog.slowest_per_token >= 0.05
    assert dog.deadline(1) >= rpc.DEADLINE_SLACK + rpc.DEADLINE_FACTOR * 0.2
    assert dog.deadline(400) >= rpc.DEADLINE_SLACK + rpc.DEADLINE_FACTOR * 0.05 * 400


@pytest.mark.real
@needs_rpc
def test_worker_stopped_mid_reply_ends_the_command_with_one_line(worker):
    """SIGSTOP after the worker loaded its layers: llama.cpp's call would block for good; the watchdog
    ends the command a few seconds past the slowest step (exit 2, one line naming the worker). The slack
    is 2 s here, not the default 10 s: the same watchdog, sooner (the suite's time)."""
    client = busy_client(worker, slack=2.0)
    try:
        worker.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = client.communicate(timeout=120)
        assert time.monotonic() - stopped < 2.0 + 10
    finally:
        worker.proc.send_signal(signal.SIGCONT)
        if client.poll() is None:
            client.kill()
            client.wait()
    lines = [line for line in err.splitlines() if line.strip()]
    assert client.returncode == 2, err
    assert len(lines) == 1 and "stopped answering" in lines[0] and worker.endpoint in lines[0], err


@pytest.fixture(scope="module")
def head_files(tmp_path_factory):
    """Tiny generated targets with their heads: a hybrid with an MTP layer; a llama target with an EAGLE-3 head."""
    import tiny_models

    directory = tmp_path_factory.mktemp("rpc-heads")
    mtp = tiny_models.write_model(directory / "qwen35-mtp.gguf", "qwen35", context=tiny_models.TARGET_CONTEXT["qwen35"],
                                  mtp=True)
    llama = tiny_models.write_model(directory / "llama4.gguf", "llama", context=tiny_models.TARGET_CONTEXT["llama"],
                                    n_layer=tiny_models.EAGLE3_TARGET_LAYERS)
    eagle3 = tiny_models.write_eagle3(directory / "eagle3.gguf")
    return {"mtp": (mtp, "mtp"), "eagle3": (llama, str(eagle3))}


@pytest.mark.real
@needs_rpc
@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_rpc_off_moves_a_head_with_the_target_and_keeps_the_load_options(tmp_path, head_files, kind):
    """/rpc off after the worker died, with a drafting head: the target is loaded here with the options it
    was loaded with (-fa, its MTP layers), the head is built again on it, and the next turn drafts."""
    import tiny_models

    from specchat import chat, ui
    from specchat.drafters import members
    from specchat.loader import LoadOptions, Selection, load
    from specchat.runner import RunOptions
    from specchat.sampling import SamplingParams
    from specchat.transcript import load_transcript

    target_path, draft = head_files[kind]
    probe_backend = tiny_models.load(target_path)
    try:
        ids = tiny_models.bigram_chain(int(tiny_models.cycle_tokens()[0]), 12)
        text = b"".join(probe_backend.token_bytes(t) for t in ids).decode("utf-8", "replace")
    finally:
        probe_backend.close()
    w = Worker()
    try:
        opts = LoadOptions(n_ctx=512, rpc=(w.endpoint,), flash_attn="off")
        selection = Selection(str(target_path), draft)
        loaded = load(load_config(), selection, opts)
        run = RunOptions(selection, opts, SamplingParams(temperature=0.0), 4, 3, 24)
        info = io.StringIO()
        session = chat.ChatSession(
            loaded, run, console=ui.make_console(file=io.StringIO()), info=ui.make_console(file=info, width=300),
            out=io.StringIO(), transcript=chat.Transcript(tmp_path / "t.jsonl"), live=False,
        )
        try:
            session.handle(text)
            assert len(session.turn_log) == 1 and session.last_stats.drafted > 0
            old_head = members(loaded.drafter)[0]
            w.stop(signal.SIGKILL)
            session.handle("/rpc off")
            assert "runs on this machine now" in info.getvalue(), info.getvalue()
            target = loaded.target
            assert target.rpc == () and target.flash_attn == "off" and target.mtp_loaded == (kind == "mtp")
            head = members(loaded.drafter)[0]
            assert head is not old_head and head.kind is old_head.kind and head.head.target is target
            session.handle(text)
            assert len(session.turn_log) == 2 and session.last_stats.drafted > 0
            assert target.rollback_recoveries == 0
        finally:
            loaded.close()
        records = [r["role"] for r in load_transcript(tmp_path / "t.jsonl").records]
        assert records == ["user", "assistant", "user", "assistant"]
    finally:
        w.stop(signal.SIGKILL)


def test_rpc_flag_on_prompt_chat_and_report():
    for command in ("prompt", "chat", "report"):
        result = specchat(command, "--help", timeout=60)
        assert result.returncode == 0 and "--rpc" in result.stdout, command
    assert "rpc-server" in specchat("--help", timeout=60).stdout
