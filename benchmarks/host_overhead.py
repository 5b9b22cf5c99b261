"""specchat's own cost per step: generation time minus the time inside llama_decode, side by side.

    python benchmarks/host_overhead.py                 # all three parts (builds llama-bench once, ~10 min)
    python benchmarks/host_overhead.py --parts host    # only the host-overhead table

1. host: ms per verify step and per emitted token spent outside llama_decode (sampling, the rule, the
   drafter's bookkeeping, the policy), for the draft model, prompt lookup and target-only, at temp 0 and
   0.8 (llama.cpp's default sampler: top-k 40, top-p 0.95, min-p 0.05), on the Qwen2.5-Coder pair and on
   gemma-3-270m (drafting for itself). Fixed k = 4 and --draft-p-min 0, so every step drafts 4 tokens.
2. plain: plain decoding at temp 0.8 vs `llama-bench -n 128 -p 0` (tg128) from the same vendored
   llama.cpp, gemma-3-270m, same threads, alternating repetitions.
3. view: `specchat prompt` on a terminal (a pty: coloured live view) vs `--json`, same prompt, greedy.
4. context (`--parts context`, or just `--context 512,8k,32k`): host microseconds per step at each context
   length, side by side, for target-only, prompt lookup and a draft model, greedy, temp 0.8 and temp 0.8
   with --repeat-penalty 1.1, on a tiny random-weight pair (tests/tiny_models.py: SmolLM2's 49k
   vocabulary, 2 layers, so a 32k prefill takes seconds; the host's share is what is measured). Each
   context length runs in a process of its own; `--before REV` also runs REV's specchat (a temporary git
   worktree) in alternation with this checkout's, so before and after share the machine's state.
   `--evict-mb 64` reads 64 MB after every decode, so each step starts from equally cold caches.
5. cache (`--parts cache`): why the host time is what it is on a CPU. The same `sampling.process` call on
   the same row, timed as the 1st, 2nd and 8th call in a row: right after a llama_decode, after
   streaming 1 GB through the caches with no decode at all, after a 10 ms sleep, and warm.

The time inside llama_decode is measured by wrapping llama_cpp.llama_decode in this process, so the
script measures any version of specchat the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import select
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the specchat measured: this checkout's, or another one's (--before runs a worktree of REV through this)
sys.path.insert(0, os.environ.get("SPECCHAT_UNDER_TEST", str(ROOT)))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

import specchat  # noqa: E402
from specchat.lookup import PromptLookup  # noqa: E402
from specchat.policy import FixedPolicy  # noqa: E402

CODE_PROMPT = ("Write a Python function `merge_intervals(intervals)` that merges overlapping intervals, "
               "with a docstring and three doctests.")
SUMMARY_PROMPT = ("Summarise in two sentences: The Nile is the longest river in Africa. It flows north through "
                  "eleven countries and ends in a large delta in Egypt before reaching the Mediterranean Sea.")


class DecodeTimer:
    """Wraps llama_cpp.llama_decode: seconds spent inside it, and calls. With `evict_mb`, each decode is
    followed (inside the timed part) by a pass over that many MB, so the host work after it starts from
    equally cold caches whatever the decode did: a 20 ms decode at 32k context leaves the caches colder
    than a 1 ms one at 512, and a fixed piece of Python then takes 4x as long (see docs/benchmarks.md)."""

    def __init__(self, evict_mb: int = 0):
        self.seconds = 0.0
        self.calls = 0
        self._real = llama_cpp.llama_decode
        evict = np.ones(evict_mb << 18, dtype=np.float32) if evict_mb else None

        def timed(ctx, batch):
            t0 = time.perf_counter()
            try:
                return self._real(ctx, batch)
            finally:
                if evict is not None:
                    evict.sum()
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        llama_cpp.llama_decode = timed


def host_run(timer: DecodeTimer, pair, drafter, ids, temp: float, k: int, n: int) -> dict:
    params = specchat.SamplingParams(temperature=temp, seed=7, banned=pair.target.eog_tokens())
    policy = FixedPolicy(k if drafter is not None else 0)
    # the first decode of a context allocates its buffers: warm both models up outside the measurement
    for _ in specchat.generate(pair.target, drafter, ids, params, max_tokens=4, policy=policy):
        pass
    best = None
    for _ in range(3):
        finished = None
        events = specchat.generate(pair.target, drafter, ids, params, max_tokens=n, policy=policy)
        next(events)  # the prompt is evaluated when the generator starts: not part of the loop
        decode_before = timer.seconds
        t0 = time.perf_counter()
        for event in events:
            if isinstance(event, specchat.Finished):
                finished = event
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


def part_host(a) -> None:
    timer = DecodeTimer()
    print("## host overhead (outside llama_decode), fixed k = 4, -n", a.n, "(best of 3 runs)")
    print(f"{'model':<22}{'drafter':<16}{'temp':>5}{'steps':>7}{'host ms/step':>14}{'host ms/token':>15}"
          f"{'decode ms/step':>16}{'host share':>12}{'accepted':>10}")
    setups = []
    if "qwen" in a.models:
        setups.append(("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", CODE_PROMPT))
    if "gemma" in a.models:
        setups.append(("gemma-3-270m", "gemma-3-270m", SUMMARY_PROMPT))
    for target_name, draft_name, text in setups:
        pair = specchat.load_pair(target=target_name, draft=draft_name, n_ctx=2048, n_gpu_layers=0,
                                  n_gpu_layers_draft=0, n_threads=a.threads, draft_p_min=0.0)
        lookup = PromptLookup(1, 4)
        if pair.target.chat_template:
            ids = pair.chat_prompt([{"role": "user", "content": text}])
        else:
            ids = pair.target.tokenize(text + "\nAnswer:")
        for drafter_name, drafter in (("draft model", pair.drafter), ("prompt lookup", lookup), ("target only", None)):
            for temp in (0.0, 0.8):
                r = host_run(timer, pair, drafter, ids, temp, 4, a.n)
                share = r["host_ms_step"] / (r["host_ms_step"] + r["decode_ms_step"])
                acc = "-" if r["accept"] is None else f"{r['accept']:.0%}"
                print(f"{target_name:<22}{drafter_name:<16}{temp:>5}{r['steps']:>7}{r['host_ms_step']:>14.3f}"
                      f"{r['host_ms_token']:>15.3f}{r['decode_ms_step']:>16.1f}{share:>11.1%}{acc:>10}", flush=True)
        pair.close()


def llama_bench(binary: Path, model: Path, n: int, threads: int, ngl: int = 0, reps: int = 3) -> float:
    """llama-bench tg`n`: generation tok/s from an empty context, the mean of `reps` runs."""
    out = subprocess.run([str(binary), "-m", str(model), "-n", str(n), "-p", "0", "-t", str(threads), "-r", str(reps),
                          "-ngl", str(ngl), "-o", "json"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(json.loads(out.stdout)[0]["avg_ts"])


def plain_tps(pair, n: int, temp: float) -> float:
    ids = pair.target.tokenize("The")  # as tg128: generation from (almost) an empty context
    params = specchat.SamplingParams(temperature=temp, seed=3, banned=pair.target.eog_tokens())
    finished = None
    for event in specchat.generate(pair.target, None, ids, params, max_tokens=n):
        if isinstance(event, specchat.Finished):
            finished = event
    return finished.stats.tokens_per_second


def part_plain(a) -> None:
    from vs_llamacpp import build

    binary = build(a.jobs, "llama-bench")
    pair = specchat.load_pair(target="gemma-3-270m", draft=None, n_ctx=2048, n_gpu_layers=0, n_threads=a.threads)
    model = Path(pair.target.path)
    plain_tps(pair, 8, 0.8)  # warm-up
    ours, theirs = {0.0: [], 0.8: []}, []
    for rep in range(a.reps):
        order = ("bench", "ours") if rep % 2 == 0 else ("ours", "bench")
        for who in order:
            if who == "bench":
                theirs.append(llama_bench(binary, model, 128, a.threads))
            else:
                for temp in ours:
                    ours[temp].append(plain_tps(pair, 128, temp))
    ref = statistics.median(theirs)
    print(f"\n## plain decoding vs llama-bench tg128, gemma-3-270m, {a.threads} threads, {a.reps} alternating reps")
    print(f"llama-bench tg128: {ref:.1f} tok/s (runs: {', '.join(f'{x:.1f}' for x in theirs)})")
    for temp, values in ours.items():
        tps = statistics.median(values)
        print(f"specchat plain decoding, temp {temp}: {tps:.1f} tok/s = {tps / ref:.3f}x "
              f"(runs: {', '.join(f'{x:.1f}' for x in values)})")
    pair.close()


def run_tty(args: list[str], env: dict) -> float:
    """Run specchat with stdout on a pty (the live view); tok/s from its summary line."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait()
    os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))
    m = re.findall(r"(\d+) tokens · ([\d.]+) tok/s", text)
    if proc.returncode != 0 or not m:
        raise RuntimeError(f"tty run failed ({proc.returncode}): {proc.stderr.read().decode()[-1000:]} {text[-500:]}")
    return float(m[-1][1])


def part_view(a) -> None:
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "40"}
    env.pop("NO_COLOR", None)
    base = [sys.executable, "-m", "specchat.cli", "prompt", SUMMARY_PROMPT, "--pair", "gemma-lookup", "--temp", "0",
            "-n", "256", "--ignore-eos", "-t", str(a.threads), "-c", "2048", "--draft-fixed", "4"]
    tty, js = [], []
    for rep in range(a.reps):
        for who in (("tty", "json") if rep % 2 == 0 else ("json", "tty")):
            if who == "tty":
                tty.append(run_tty(base, env))
            else:
                out = subprocess.run([*base, "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
                js.append(json.loads(out.stdout)["stats"]["tokens_per_second"])
    t, j = statistics.median(tty), statistics.median(js)
    print(f"\n## live view (pty) vs --json, gemma-lookup, greedy, -n 256, --draft-fixed 4, {a.reps} alternating reps")
    print(f"live view: {t:.1f} tok/s (runs: {', '.join(f'{x:.1f}' for x in tty)})")
    print(f"--json:    {j:.1f} tok/s (runs: {', '.join(f'{x:.1f}' for x in js)})")
    print(f"live view / --json = {t / j:.3f}x")


def part_cache(a) -> None:
    from specchat.sampling import process

    calls = 8
    print(f"\n## one sampling.process call (temp 0.8, llama.cpp's default sampler), microseconds, median of {a.reps * 10}")
    print(f"{'model':<22}{'vocab':>8}  {'before the calls':<26}{'call 1':>8}{'call 2':>8}{'call 8':>8}")
    scan = np.ones(1 << 28, dtype=np.float32)  # 1 GiB, about what a decode of a 1.5B Q4 model reads
    models = {"qwen": "qwen2.5-coder-1.5b", "gemma": "gemma-3-270m"}
    for name in [models[m] for m in a.models.split(",")]:
        pair = specchat.load_pair(target=name, draft=None, n_ctx=2048, n_gpu_layers=0, n_threads=a.threads)
        target = pair.target
        params = specchat.SamplingParams(temperature=0.8, seed=1)
        ids = target.tokenize(CODE_PROMPT)
        target.eval(ids[:-1], [])
        keep = len(target.tokens)
        row = np.array(target.eval([ids[-1]], [0])[0])
        target.truncate(keep)

        def decode():
            nonlocal row
            row = target.eval([ids[-1]], [0], in_place=True)[0]

        def timed(before) -> np.ndarray:
            samples = []
            for _ in range(a.reps * 10):
                before()
                t = [time.perf_counter()]
                for _ in range(calls):
                    process(row, params, ())
                    t.append(time.perf_counter())
                samples.append(np.diff(t))
                target.truncate(keep)
            return 1e6 * np.median(samples, axis=0)  # one stall of this shared machine must not count

        for label, before in (("a llama_decode", decode), ("a 1 GiB scan, no decode", lambda: scan.sum()),
                              ("a 10 ms sleep", lambda: time.sleep(0.01)), ("nothing (warm)", lambda: None)):
            us = timed(before)
            print(f"{name:<22}{target.n_vocab:>8}  {label:<26}{us[0]:>8.0f}{us[1]:>8.0f}{us[-1]:>8.0f}", flush=True)
        pair.close()


CONTEXT_SAMPLERS = {"greedy": {"temperature": 0.0}, "temp 0.8": {"temperature": 0.8},
                    "temp 0.8 + repeat-penalty": {"temperature": 0.8, "repeat_penalty": 1.1}}
CONTEXT_DRAFTERS = ("target only", "prompt lookup", "draft model")


def context_tokens(length: int) -> list[int]:
    """A context of `length` tokens: random words, then 64 tokens of the tiny models' bigram cycle (what
    they predict, so drafts get accepted and the run looks like generation, not noise)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import bigram_chain, cycle_tokens, word_tokens

    rng = np.random.default_rng(length)
    tail = bigram_chain(int(cycle_tokens()[0]), 64)
    return rng.choice(word_tokens(), length - len(tail)).tolist() + tail


class StubModel:
    """A backend with no model (--stub): eval appends the tokens and lends fixed random rows over a 49k
    vocabulary at once. What is left of a step is specchat's own work, with caches as warm as they get,
    so its growth with the context is the code's alone."""

    name, path, memory = "stub", None, None

    def __init__(self, n_ctx: int, seed: int):
        self.rows = np.random.default_rng(seed).normal(0, 3, (17, 49152)).astype(np.float32)
        self.n_ctx, self.n_vocab = n_ctx, self.rows.shape[1]
        self.tokens: list[int] = []
        self.evaluated = self.rollback_recoveries = self.reevaluated = 0
        self.rollback_seconds = 0.0

    def eval(self, tokens, logits_at, *, in_place=False):
        self.tokens.extend(tokens)
        self.evaluated += len(tokens)
        return self.rows[: len(list(logits_at))]

    def truncate(self, n_keep: int) -> None:
        del self.tokens[n_keep:]

    def checkpoint(self, batch=None, *, turn=False) -> None:
        pass

    def is_eog(self, token: int) -> bool:
        return False

    def token_bytes(self, token: int) -> bytes:
        return b" w"


def context_child(a) -> None:
    """One context length, one specchat: the per-step host time of every drafter and sampler, as JSON."""
    from specchat.backend import LlamaCppBackend
    from specchat.drafters import DraftModel

    length = a.child_context
    ids = context_tokens(length)
    n_ctx = length + a.n + 64
    if a.stub:
        target, draft = StubModel(n_ctx, 1), StubModel(n_ctx, 1)
    else:
        target = LlamaCppBackend(a.models_dir / "target.gguf", n_ctx=n_ctx, n_threads=a.threads, n_gpu_layers=0)
        draft = LlamaCppBackend(a.models_dir / "draft.gguf", n_ctx=n_ctx, n_threads=a.threads, n_gpu_layers=0)
    timer = DecodeTimer(a.evict_mb)
    drafters = {"target only": None, "prompt lookup": PromptLookup(1, 4), "draft model": DraftModel(draft)}
    out = {}
    for drafter_name in CONTEXT_DRAFTERS:
        for sampler, settings in CONTEXT_SAMPLERS.items():
            params = specchat.SamplingParams(seed=7, **settings)
            policy = FixedPolicy(4 if drafters[drafter_name] is not None else 0)
            for _ in specchat.generate(target, drafters[drafter_name], ids, params, max_tokens=4, policy=policy):
                pass  # warm-up: the prompt is read once here, later runs reuse the cache
            best = None
            for _ in range(a.runs):
                events = specchat.generate(target, drafters[drafter_name], ids, params, max_tokens=a.n, policy=policy)
                next(events)
                decode_before = timer.seconds
                t0 = time.perf_counter()
                finished = [e for e in events if isinstance(e, specchat.Finished)][0]
                host = time.perf_counter() - t0 - (timer.seconds - decode_before)
                us = 1e6 * host / finished.stats.steps
                best = us if best is None else min(best, us)
            out[f"{drafter_name}|{sampler}"] = best
    print(json.dumps(out))


def part_context(a) -> None:
    """The per-step host time at each context length, each (context, specchat) in a process of its own,
    alternating before and after; the best of all runs per cell."""
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import write_pair

    lengths = [int(float(x[:-1]) * 1024) if x.lower().endswith("k") else int(x) for x in a.context.split(",")]
    work = Path(tempfile.mkdtemp(prefix="specchat-context-"))
    target, draft = write_pair(work, "llama")
    target.rename(work / "target.gguf")
    draft.rename(work / "draft.gguf")
    trees = {"after": str(ROOT)}
    if a.before:
        before = work / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before), a.before], check=True)
        trees = {"before": str(before), **trees}
    results: dict[tuple[str, int], dict] = {}
    try:
        for rep in range(a.reps):
            for length in lengths:
                for version in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
                    env = {**os.environ, "SPECCHAT_UNDER_TEST": trees[version]}
                    done = subprocess.run(
                        [sys.executable, __file__, "--child-context", str(length), "--models-dir", str(work),
                         "-n", str(a.n), "-t", str(a.threads), "--runs", str(a.runs), "--evict-mb", str(a.evict_mb),
                         *(["--stub"] if a.stub else [])],
                        env=env, capture_output=True, text=True, timeout=1800)
                    if done.returncode != 0:
                        raise RuntimeError(f"{version} at {length}: {done.stderr[-2000:]}")
                    got = json.loads(done.stdout.strip().splitlines()[-1])
                    cell = results.setdefault((version, length), got)
                    for key, value in got.items():
                        cell[key] = min(cell[key], value)
    finally:
        if a.before:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    names = [f"{x // 1024}k" if x % 1024 == 0 else str(x) for x in lengths]
    model = "no model (--stub: specchat's work alone)" if a.stub else "tiny llama pair (49k vocabulary)"
    print(f"## host us per step outside llama_decode by context length, {model}, "
          f"fixed k = 4, -n {a.n}, best of {a.runs} runs x {a.reps} processes"
          + (f", caches evicted after each decode ({a.evict_mb} MB)" if a.evict_mb else ""))
    header = f"{'drafter':<15}{'sampler':<27}{'specchat':<9}" + "".join(f"{n:>9}" for n in names)
    print(header + f"{'last/first':>12}")
    for drafter_name in CONTEXT_DRAFTERS:
        for sampler in CONTEXT_SAMPLERS:
            for version in trees:
                us = [results[(version, length)][f"{drafter_name}|{sampler}"] for length in lengths]
                print(f"{drafter_name:<15}{sampler:<27}{version:<9}" + "".join(f"{x:>9.0f}" for x in us)
                      + f"{us[-1] / us[0]:>11.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="host,plain,view")
    parser.add_argument("--models", default="qwen,gemma")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--context", help="context lengths for the context part, e.g. 512,8k,32k (runs only it "
                        "unless --parts names others)")
    parser.add_argument("--before", metavar="REV", help="context part: also measure REV's specchat, alternating")
    parser.add_argument("--runs", type=int, default=3, help="context part: runs per cell in each process")
    parser.add_argument("--evict-mb", type=int, default=0, help="context part: read this many MB after each decode "
                        "(inside the decode's time), so every step starts from equally cold caches")
    parser.add_argument("--stub", action="store_true", help="context part: no model, fixed rows (StubModel)")
    parser.add_argument("--child-context", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--models-dir", type=Path, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child_context:
        context_child(a)
        return
    if a.context and "--parts" not in sys.argv:
        a.parts = "context"
    a.context = a.context or "512,8k,32k"
    print(f"llama-cpp-python {llama_cpp.__version__} · {a.threads} threads · {time.strftime('%Y-%m-%d %H:%M')}")
    for part in a.parts.split(","):
        {"host": part_host, "plain": part_plain, "view": part_view, "context": part_context,
         "cache": part_cache}[part](a)


if __name__ == "__main__":
    main()
