"""The benchmark tool's harness: what every suite shares, written once.

- llama.cpp's tools (llama-speculative-simple, llama-bench, llama-server, libllama) built once from the
  llama.cpp vendored in the sdist of the installed llama-cpp-python, so both sides run the same kernels;
- models: a name from models.toml, or the tiny generated files' own text;
- runs: `specchat prompt --json` / `specchat chat`, llama-speculative-simple, llama-bench, llama-server, and
  specchat's host time around llama_decode measured in-process;
- statistics: medians and geometric means;
- results: a suite returns one JSON document (its tables as columns and rows, its notes), saved with --json
  and rendered as text by `render` (`python -m benchmarks show FILE` renders a saved one again).

specchat and llama_cpp are imported inside the functions that use them: gpu_check.py imports this module on
the lent GPU machine before the wheels specchat needs are installed there.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
TESTS = ROOT / "tests"  # tiny_models.py: the generated files' writer


# ------------------------------------------------------------------------------------------ llama.cpp's tools


def llama_cpp_version() -> str:
    return importlib.metadata.version("llama-cpp-python")


def sdist(folder: Path) -> Path:
    """The installed llama-cpp-python's sdist (76 MB), downloaded once into `folder`."""
    version = llama_cpp_version()
    found = next(folder.glob(f"llama_cpp_python-{version}.tar.gz"), None)
    if found is None:
        folder.mkdir(parents=True, exist_ok=True)
        # --no-binary on the one package: ":all:" would build cmake and ninja from source too
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={version}", "-d", str(folder)], check=True)
        found = next(folder.glob(f"llama_cpp_python-{version}.tar.gz"))
    return found


def work_dir() -> Path:
    """Where the tools are built: the cache dir's llama.cpp-VERSION/."""
    from specchat.paths import cache_dir

    return cache_dir() / f"llama.cpp-{llama_cpp_version()}"


# every build of llama.cpp's tools; `cmake_args` come after these, so a caller's -D wins
CMAKE_BASE = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_CURL=OFF")


def configure(work: Path, variant: str = "build", cmake_args: tuple[str, ...] = (),
              capture: bool = False) -> subprocess.CompletedProcess:
    """cmake's configure step of work/llama.cpp into work/variant (the source unpacked from the sdist first
    where work has none). `capture`: return cmake's output instead of raising on failure."""
    source = work / "llama.cpp"
    if not source.exists():
        archive = sdist(work)
        prefix = f"{archive.name[: -len('.tar.gz')]}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(source, members=[m for m in members if m.name], filter="data")
    command = ["cmake", "-S", str(source), "-B", str(work / variant), *CMAKE_BASE, *cmake_args]
    if capture:
        return subprocess.run(command, capture_output=True, text=True)
    return subprocess.run(command, check=True)


def build(jobs: int, target: str = "llama-speculative-simple", variant: str = "build",
          cmake_args: tuple[str, ...] = (), *, work: Path | None = None, also: tuple[str, ...] = ()) -> Path:
    """A llama.cpp tool built once: in work/build/, or with `cmake_args` in work/variant/ (work: the cache
    dir's unless given; a source already in work/llama.cpp is used as it is). `also`: more targets of the
    same build (e.g. `llama`, the shared libllama). Returns the tool's path."""
    work = work or work_dir()
    binary = work / variant / "bin" / target
    if all((binary.parent / t).exists() or (binary.parent / f"lib{t}.so").exists() for t in (target, *also)):
        return binary
    configure(work, variant, cmake_args)
    subprocess.run(["cmake", "--build", str(work / variant), "--target", target, *also, f"-j{jobs}"], check=True)
    return binary


# A build whose batch logits equal single-token ones, bit for bit: no llamafile sgemm and no repacked
# weights, so every matmul takes ggml's own kernels; shared libraries, so that specchat loads its libllama
INVARIANT = "build-invariant"
INVARIANT_CMAKE = ("-DGGML_LLAMAFILE=OFF", "-DGGML_CPU_REPACK=OFF", "-DBUILD_SHARED_LIBS=ON")


def use_invariant(binary: Path) -> None:
    """Make this process's children run on the batch-invariant build of `binary`: specchat loads that build's
    libllama, and every side takes the tiled K-quant matmul for every token count, not only for batches of 8
    or more as by default (one kernel for all, so a row's result does not depend on how many rows came with
    it). Flash attention must be off on every side as well (its CPU kernel is not batch-invariant)."""
    os.environ.update(LLAMA_CPP_LIB_PATH=str(binary.parent), GGML_CPU_TILED_MM_FORCE="1")


def tool(a, target: str) -> Path:
    """llama.cpp's `target` for a suite's options: from --llama-dir if given, else built once (the
    batch-invariant build with --batch-invariant, which this process's children then load)."""
    invariant = getattr(a, "batch_invariant", False)
    if a.llama_dir:
        binary = a.llama_dir / target
        if not binary.exists():
            raise SystemExit(f"--llama-dir {a.llama_dir}: no {target} there")
    elif invariant:
        binary = build(a.jobs, target, variant=INVARIANT, cmake_args=INVARIANT_CMAKE)
    else:
        binary = build(a.jobs, target)
    if invariant:
        use_invariant(binary)
    return binary


# ------------------------------------------------------------------------------------------ models


def model_file(name: str) -> Path:
    """A model of models.toml (or a path), downloaded once."""
    from specchat.config import load_config
    from specchat.sources import resolve

    if Path(name).suffix == ".gguf":
        return Path(name)
    return resolve(load_config().model(name))


def tiny_models():
    """tests/tiny_models.py, the generated files' writer (tests/ is no package)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import tiny_models as module

    return module


def own_text(model: Path, n_tokens: int) -> str:
    """`n_tokens` of the tiny models' own text (their bigram chain), as text of `model`'s vocabulary."""
    import llama_cpp

    tm = tiny_models()
    chain = tm.bigram_chain(int(tm.cycle_tokens()[0]), n_tokens)
    llm = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    try:
        return llm.detokenize(chain).decode("utf-8", "replace").strip()
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------ runs


def specchat_env(home: Path | None = None, **more: str) -> dict:
    """The environment of a specchat child: this checkout's code, and SPECCHAT_HOME where given."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", **more}
    if home is not None:
        env["SPECCHAT_HOME"] = str(home)
    return env


def run_specchat(model: str | Path, prompt: str, *, n: int, threads: int, extra: Sequence[str] = (),
                 env: dict | None = None, ctx: int = 2048, ignore_eos: bool = True) -> dict:
    """One greedy `specchat prompt --raw --json` process; its generation figures and text."""
    args = [sys.executable, "-m", "specchat.cli", "prompt", prompt, "--raw", "-m", str(model), "-n", str(n),
            "-t", str(threads), "-c", str(ctx), "--temp", "0", "--json", "-ngl", "0",
            *(["--ignore-eos"] if ignore_eos else []), *extra]
    out = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env or specchat_env())
    if out.returncode != 0:
        raise RuntimeError(f"specchat failed: {out.stderr[-2000:]}")
    doc = json.loads(out.stdout)
    stats = doc["stats"]
    return {"tokens": stats["generated_tokens"], "seconds": stats["generate_seconds"],
            "tps": stats["tokens_per_second"], "accept": stats["acceptance_rate"], "drafted": stats["drafted"],
            "accepted": stats["accepted"], "steps": stats["steps"], "drafted_by": stats.get("drafted_by") or {},
            "rereads": stats.get("rollback_recoveries", 0), "draft_lengths": stats.get("draft_lengths"),
            "pieces": [t["text"] for t in doc["tokens"]], "ids": [t["id"] for t in doc["tokens"]],
            "text": doc["text"], "finish_reason": doc.get("finish_reason")}


def run_chat(home: Path, model: str, turns: list[str], *, n: int, threads: int, ctx: int,
             flags: Sequence[str] = ()) -> list[dict]:
    """One `specchat chat` process over the turns (piped on stdin, greedy, --ignore-eos); per turn, from its
    transcript: tok/s, tokens, drafted, accepted, the reply."""
    transcripts = home / "share" / "transcripts"
    before = set(transcripts.glob("*.jsonl")) if transcripts.exists() else set()
    args = [sys.executable, "-m", "specchat.cli", "chat", "-m", model, "--temp", "0", "-n", str(n), "--ignore-eos",
            "-t", str(threads), "-c", str(ctx), "--no-color", *flags]
    out = subprocess.run(args, input="\n".join(turns) + "\n", capture_output=True, text=True,
                         env=specchat_env(home), cwd=ROOT, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"specchat chat failed ({out.returncode}):\n{out.stderr[-3000:]}")
    (path,) = set(transcripts.glob("*.jsonl")) - before
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    replies = [r for r in records if r.get("role") == "assistant"]
    if len(replies) != len(turns):
        raise RuntimeError(f"specchat answered {len(replies)} of {len(turns)} turns:\n{out.stderr[-2000:]}")
    return [{"tps": r["stats"]["tokens_per_second"], "n": r["stats"]["generated_tokens"],
             "drafted": r["stats"]["drafted"], "accepted": r["stats"]["accepted"], "text": r["content"]}
            for r in replies]


def run_llamacpp(binary: Path, model: Path, prompt: str, *, n: int, threads: int, spec_type: str,
                 draft: Path | None = None, k: int | None = None, ctx: int = 2048, ignore_eos: bool = True,
                 extra: Sequence[str] = ()) -> dict:
    """One greedy llama-speculative-simple run with `--spec-type spec_type` at its defaults, or with exactly
    k drafts a step (p-min 0) where k is given; `draft`: the -md file. `extra` goes last (a repeated option's
    last value wins). A run llama.cpp refuses gives {"error": why}. Without ignore_eos it stops at an
    end-of-generation token: its `decoded` count then includes that token."""
    args = [str(binary), "-m", str(model), "-p", prompt, "-n", str(n), "-t", str(threads), "-c", str(ctx),
            "--temp", "0", "--top-k", "1", "-s", "1", "-ngl", "0", *(["--ignore-eos"] if ignore_eos else []),
            "--spec-type", spec_type]
    if draft is not None:
        args += ["-md", str(draft), "-ngld", "0", "-td", str(threads)]
    if k is not None:
        args += ["--spec-draft-n-max", str(k), "--spec-draft-n-min", str(k), "--spec-draft-p-min", "0"]
    out = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    if out.returncode != 0 or not m:
        why = next((line.split("what():", 1)[1].strip() for line in log.splitlines() if "what():" in line), None)
        if why:
            return {"error": why}
        raise RuntimeError(f"llama.cpp failed ({out.returncode}):\n{log[-3000:]}")
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    start = out.stdout.find(prompt)  # stdout: the prompt (after a <bos> mark), then the generated text
    return {"tokens": int(m.group(1)), "seconds": float(m.group(2)), "tps": float(m.group(3)),
            "drafted": int(drafted.group(1)) if drafted else 0, "accepted": int(accepted.group(1)) if accepted else 0,
            "text": out.stdout[start + len(prompt):] if start >= 0 else ""}


def llama_bench(binary: Path, model: Path, n: int, threads: int, ngl: int = 0, reps: int = 3) -> float:
    """llama-bench tg`n`: generation tok/s from an empty context, the mean of `reps` runs."""
    out = subprocess.run([str(binary), "-m", str(model), "-n", str(n), "-p", "0", "-t", str(threads), "-r", str(reps),
                          "-ngl", str(ngl), "-o", "json"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(json.loads(out.stdout)[0]["avg_ts"])


def same_tokens(pieces: list[str], text: str) -> int:
    """How many of specchat's tokens (their text pieces) `text` starts with: where two greedy runs part.
    A batch's logits differ slightly from one token's, so a near-tie can go either way, and after it the
    two texts differ: their speeds then measure different work."""
    at = 0
    for i, piece in enumerate(pieces):
        if text[at : at + len(piece)] != piece:
            return i
        at += len(piece)
    return len(pieces)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server (one slot, prompt cache on), with `spec_type` its drafter ("none": plain)."""

    def __init__(self, binary: Path, model: Path, spec_type: str, threads: int, ctx: int, flags: Sequence[str] = ()):
        self.spec_type = spec_type
        self.retokenized = 0  # prompt_ids turns whose rendering did not extend the held text
        self.port = free_port()
        args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-c", str(ctx),
                "-t", str(threads), "-tb", str(threads), "-ngl", "0", "-np", "1"]
        if spec_type != "none":
            args += ["--spec-type", spec_type]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([*args, *flags], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"llama-server --spec-type {spec_type} did not start:\n"
                                   f"{self.log.read().decode(errors='replace')[-3000:]}")
            time.sleep(0.3)

    def post(self, route: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{route}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as r:
            return json.loads(r.read())

    @staticmethod
    def _reply(doc: dict, text: str) -> dict:
        t = doc["timings"]
        return {"tps": t["predicted_per_second"], "n": t["predicted_n"], "drafted": t.get("draft_n", 0),
                "accepted": t.get("draft_n_accepted", 0), "text": text}

    def chat(self, messages: list[dict], n: int) -> dict:
        doc = self.post("/v1/chat/completions", {"messages": messages, "max_tokens": n, "temperature": 0.0,
                                                  "top_k": 1, "seed": 1, "ignore_eos": True, "cache_prompt": True})
        return self._reply(doc, doc["choices"][0]["message"]["content"])

    def conversation(self, turns: list[str], n: int, prompt_ids: bool = False) -> list[dict]:
        """The turns as a user's client sends them: /v1/chat/completions with the whole conversation as text,
        rendered and tokenized again every turn. With `prompt_ids`, the way specchat's Conversation holds a
        chat: the exact ids the model saw, the server's own rendering of the new turn tokenized as a
        difference and appended, sent to /completion as token ids."""
        messages: list[dict] = []
        out = []
        held_text, held_ids = "", []
        for user in turns:
            messages.append({"role": "user", "content": user})
            if prompt_ids:
                text = self.post("/apply-template", {"messages": messages})["prompt"]
                if held_ids and text.startswith(held_text):
                    ids = held_ids + self.post("/tokenize", {"content": text[len(held_text):], "add_special": False,
                                                            "parse_special": True})["tokens"]
                else:
                    self.retokenized += bool(held_ids)
                    ids = self.post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
                doc = self.post("/completion", {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                                "seed": 1, "ignore_eos": True, "cache_prompt": True,
                                                "return_tokens": True})
                reply = self._reply(doc, doc["content"])
                held_text, held_ids = text + doc["content"], ids + doc["tokens"]
            else:
                reply = self.chat(messages, n)
            messages.append({"role": "assistant", "content": reply["text"]})
            out.append(reply)
        return out

    def close(self) -> None:
        stop(self.proc)


def stop(proc: subprocess.Popen) -> None:
    """Ends a server process: asked first, killed after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class DecodeTimer:
    """Wraps llama_cpp.llama_decode in this process: seconds spent inside it, and calls. With `evict_mb`,
    each decode is followed (inside the timed part) by a pass over that many MB, so the host work after it
    starts from equally cold caches whatever the decode did."""

    def __init__(self, evict_mb: int = 0):
        import llama_cpp
        import numpy as np

        self.seconds = 0.0
        self.calls = 0
        real = llama_cpp.llama_decode
        evict = np.ones(evict_mb << 18, dtype=np.float32) if evict_mb else None

        def timed(ctx, batch):
            t0 = time.perf_counter()
            try:
                return real(ctx, batch)
            finally:
                if evict is not None:
                    evict.sum()
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        llama_cpp.llama_decode = timed


def host_run(timer: DecodeTimer, target, drafter, ids: list[int], k: int, n: int, runs: int = 3, **sampling) -> dict:
    """specchat's own time per step outside llama_decode (sampling, the rule, the drafter, the policy) at a
    fixed k: the best of `runs` generations of n tokens, after a warm-up that allocates the buffers.
    `sampling`: SamplingParams fields (temperature, repeat_penalty, ...)."""
    import specchat
    from specchat.policy import FixedPolicy

    params = specchat.SamplingParams(seed=7, banned=target.eog_tokens(), **sampling)
    policy = FixedPolicy(k if drafter is not None else 0)
    for _ in specchat.generate(target, drafter, ids, params, max_tokens=4, policy=policy):
        pass
    best = None
    for _ in range(runs):
        events = specchat.generate(target, drafter, ids, params, max_tokens=n, policy=policy)
        next(events)  # the prompt is evaluated when the generator starts: not part of the loop
        decode_before = timer.seconds
        t0 = time.perf_counter()
        finished = [e for e in events if isinstance(e, specchat.Finished)][-1]
        wall = time.perf_counter() - t0
        decoded = timer.seconds - decode_before
        stats = finished.stats
        host = wall - decoded
        row = {"steps": stats.steps, "tokens": stats.emitted, "host_ms_step": 1e3 * host / stats.steps,
               "host_ms_token": 1e3 * host / stats.emitted, "decode_ms_step": 1e3 * decoded / stats.steps,
               "tps": stats.emitted / wall, "accept": stats.acceptance_rate}
        if best is None or row["host_ms_step"] < best["host_ms_step"]:
            best = row
    return best


def child(function: str, *args: str, env: dict | None = None) -> dict:
    """`module:function` of this package run in a process of its own (`python -m benchmarks _child`), with
    string arguments; its JSON answer."""
    out = subprocess.run([sys.executable, "-m", "benchmarks", "_child", function, *args], capture_output=True,
                         text=True, timeout=1800, cwd=ROOT, env=env or specchat_env())
    if out.returncode != 0:
        raise RuntimeError(f"{function} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def scratch(prefix: str, keep: bool = False):
    """A scratch folder, removed afterwards unless `keep`."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        if not keep:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------ statistics


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def median_run(runs: list[dict], key: str = "tps") -> dict:
    """The run of median `key` (its other fields kept: drafted, accepted, n of that same run); an even count
    takes the mean of the middle two as `key`."""
    ordered = sorted(runs, key=lambda r: r[key])
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return {**ordered[mid], key: (ordered[mid - 1][key] + ordered[mid][key]) / 2}


def geomean(values) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return statistics.geometric_mean(values) if values else float("nan")


def rate(accepted: int, drafted: int) -> str:
    return f"{accepted / drafted:.0%}" if drafted else "-"


def rotate(items: Sequence, by: int) -> list:
    """`items` starting at position `by` (mod len): who runs first changes from prompt to prompt."""
    by %= len(items)
    return list(items[by:]) + list(items[:by])


# ------------------------------------------------------------------------------------------ results


def machine() -> str:
    """The CPU this runs on, and its cores."""
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"


class Result:
    """One suite's output as JSON: a header, tables (columns and rows of plain values) and notes, in order.
    A column is "name" or "name:FORMAT" (a format spec, and "x" after it for a ratio: ".2fx")."""

    def __init__(self, suite: str, title: str, **meta):
        self.doc = {"suite": suite, "title": title, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
                    "llama_cpp_python": llama_cpp_version(), "command": " ".join(sys.argv[1:]), "meta": meta,
                    "blocks": []}

    def table(self, title: str, columns: list[str], rows: list[list]) -> None:
        self._add({"table": title, "columns": columns, "rows": rows})

    def note(self, line: str) -> None:
        self._add({"note": line})

    def _add(self, block: dict) -> None:
        self.doc["blocks"].append(block)
        print(spaced(self.doc["blocks"], len(self.doc["blocks"]) - 1), flush=True)

    def keep(self, key: str, value) -> None:
        """Raw figures for the JSON only (not rendered)."""
        self.doc["meta"][key] = value

    def save(self, path: Path | None) -> None:
        if path is not None:
            path.write_text(json.dumps(self.doc, indent=1, ensure_ascii=False, default=str))


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) or not fmt:
        return str(value)
    ratio = fmt.endswith("x")
    text = format(value, fmt[:-1] if ratio else fmt)
    return text + "x" if ratio else text


def render_block(block: dict) -> str:
    if "note" in block:
        return block["note"]
    names = [c.split(":", 1)[0] for c in block["columns"]]
    fmts = [c.split(":", 1)[1] if ":" in c else "" for c in block["columns"]]
    cells = [[_cell(v, f) for v, f in zip(row, fmts)] for row in block["rows"]]
    numeric = [all(not isinstance(row[i], str) for row in block["rows"]) for i in range(len(names))]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([f"## {block['table']}", line(names), *map(line, cells)])


def spaced(blocks: list[dict], i: int) -> str:
    """Block i's text after the blank line that parts it from the one before (none between two notes)."""
    gap = "" if i and "note" in blocks[i] and "note" in blocks[i - 1] else "\n"
    return gap + render_block(blocks[i])


def render(doc: dict) -> str:
    """The text of a result document: its header, then each table and note, as they were printed."""
    head = (f"# {doc['title']} · {doc['date']} · {doc['machine']} · llama-cpp-python {doc['llama_cpp_python']}\n"
            f"$ python -m benchmarks {doc['command']}")
    return "\n".join([head, *(spaced(doc["blocks"], i) for i in range(len(doc["blocks"])))])
