"""specchat vs llama.cpp's own speculative decoding, side by side in one run.

    python benchmarks/vs_llamacpp.py            # builds llama-speculative-simple once (~10 min on 2 cores)

1. Draft model: gemma-3-270m drafting for itself, forced k = 6, greedy, same threads, same prompts:
   llama.cpp's `llama-speculative-simple` vs `specchat prompt --draft-fixed 6`.
2. Prompt lookup: llama.cpp `--spec-type ngram-simple` vs specchat's prompt lookup (its default policy
   and forced k = 6), one model, greedy.
3. (first; `--only lookup` runs just this) specchat's default vs the BEST of llama.cpp's ngram-simple,
   ngram-map-k and ngram-mod per prompt, on five kinds of work (maths, QA over a context, summarisation,
   code editing, conversation), with target-only alongside; then the draft-length trace of a fresh
   process on a prompt type seen before, and of one that has learned nothing.

llama.cpp is built from the llama.cpp vendored in the sdist of the INSTALLED llama-cpp-python version,
so both sides run the same kernels. Prints generation tokens/s of each and the ratio specchat/llama.cpp.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specchat.config import load_config  # noqa: E402
from specchat.paths import cache_dir  # noqa: E402
from specchat.sources import resolve  # noqa: E402

PROMPTS = [
    # a held-out maths prompt that repeats its own numbers (prompt lookup's best case)
    "Question: A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Show each step.\nAnswer:",
    # copying from the context: summarisation-like
    "Text: The Nile is the longest river in Africa. It flows north through eleven countries and ends in a "
    "large delta in Egypt before reaching the Mediterranean Sea. Its waters feed farms along its banks.\n"
    "Repeat the text above word for word, then give it a title.\nRepeated text:",
    # open generation (little to copy)
    "Write a short story about a robot who learns to paint.\nStory:",
]

# issue 10's set: one prompt per kind of work, none of them written for prompt lookup
LOOKUP_PROMPTS = {
    "maths": "Problem: A train leaves at 9:40 and travels 156 km at 78 km per hour. A second train leaves at "
             "10:10 and travels 156 km at 104 km per hour. Which train arrives first, and by how many minutes?\n"
             "Solution: Step 1:",
    "qa-context": "Context: The Hubble Space Telescope was launched into low Earth orbit in 1990 and remains in "
                  "operation. It has a 2.4-metre mirror, and its four main instruments observe in the ultraviolet, "
                  "visible and near-infrared regions of the spectrum. Hubble's orbit outside the distortion of "
                  "Earth's atmosphere allows it to capture extremely high-resolution images.\n"
                  "Question: When was the Hubble Space Telescope launched, how large is its mirror, and why are its "
                  "images sharp? Answer using the context.\nAnswer:",
    "summarisation": "Article: The city council voted on Tuesday to extend the bicycle lane network by forty "
                     "kilometres over the next three years. The plan adds protected lanes on six main roads, new "
                     "parking for two thousand bicycles near train stations, and a bicycle-sharing scheme in the "
                     "northern districts. Supporters said the plan will cut traffic and pollution; opponents said "
                     "it will remove parking spaces for cars and hurt small shops.\nSummary of the article:",
    "code-editing": "Rename the variable `total` to `running_sum` in this Python function and return the code.\n"
                    "```python\ndef add_all(values):\n    total = 0\n    for value in values:\n"
                    "        total = total + value\n    print(total)\n    return total\n```\nEdited code:\n```python\n",
    "conversation": "User: Hi! I am planning a trip to Lisbon in May. What should I pack?\nAssistant: Lisbon in "
                    "May is mild and sunny.\nUser: What about evenings, is it cold?\nAssistant:",
}
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")  # llama.cpp's n-gram drafters, at their defaults


def llama_cpp_version() -> str:
    return importlib.metadata.version("llama-cpp-python")


def build(jobs: int, target: str = "llama-speculative-simple", variant: str = "build",
          cmake_args: tuple[str, ...] = (), *, work: Path | None = None, also: tuple[str, ...] = ()) -> Path:
    """A llama.cpp tool (llama-speculative-simple, llama-bench) from the sdist of the installed
    llama-cpp-python, built once into the cache dir: in `build/`, or with `cmake_args` in `variant/`.
    `work`: another folder than the cache dir's (a source already in work/llama.cpp is used as it is);
    `also`: more targets of the same build (e.g. `llama`, the shared libllama)."""
    if work is None:
        work = cache_dir() / f"llama.cpp-{llama_cpp_version()}"
    binary = work / variant / "bin" / target
    if all((binary.parent / t).exists() or (binary.parent / f"lib{t}.so").exists() for t in (target, *also)):
        return binary
    configure(work, variant, cmake_args)
    subprocess.run(
        ["cmake", "--build", str(work / variant), "--target", target, *also, f"-j{jobs}"], check=True
    )
    return binary


# every build of llama.cpp's tools; `cmake_args` come after these, so a caller's -D wins
CMAKE_BASE = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_CURL=OFF")


def configure(work: Path, variant: str = "build", cmake_args: tuple[str, ...] = (),
              capture: bool = False) -> subprocess.CompletedProcess:
    """cmake's configure step of work/llama.cpp into work/variant (the source unpacked from the sdist first
    where work has none). `capture`: return cmake's output instead of raising on failure."""
    source = work / "llama.cpp"
    if not source.exists():
        work.mkdir(parents=True, exist_ok=True)
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"), None)
        if sdist is None:
            # --no-binary on the one package: ":all:" would build cmake and ninja from source too
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                 f"llama-cpp-python=={llama_cpp_version()}", "-d", str(work)],
                check=True,
            )
            sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        prefix = f"{sdist.name[: -len('.tar.gz')]}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(source, members=[m for m in members if m.name], filter="data")
    command = ["cmake", "-S", str(source), "-B", str(work / variant), *CMAKE_BASE, *cmake_args]
    if capture:
        return subprocess.run(command, capture_output=True, text=True)
    return subprocess.run(command, check=True)


# A build whose batch logits equal single-token ones, bit for bit (lookup_unseen.py and chat_server.py
# --batch-invariant): no llamafile sgemm and no repacked weights, so every matmul takes ggml's own kernels;
# shared libraries, so that specchat loads its libllama (LLAMA_CPP_LIB_PATH)
INVARIANT = "build-invariant"
INVARIANT_CMAKE = ("-DGGML_LLAMAFILE=OFF", "-DGGML_CPU_REPACK=OFF", "-DBUILD_SHARED_LIBS=ON")


def build_invariant(jobs: int, target: str = "llama-speculative-simple", also: tuple[str, ...] = ()) -> Path:
    """`target` (and `also`) of the batch-invariant build, built once into the cache dir's build-invariant/."""
    return build(jobs, target, variant=INVARIANT, cmake_args=INVARIANT_CMAKE, also=also)


def use_invariant(binary: Path) -> None:
    """Make this process's children run on the batch-invariant build of `binary`: specchat loads that build's
    libllama, and every side takes the tiled K-quant matmul for every token count, not only for batches of 8
    or more as by default (one kernel for all, so a row's result does not depend on how many rows came with
    it). Flash attention must be off on every side as well (its CPU kernel is not batch-invariant)."""
    os.environ.update(LLAMA_CPP_LIB_PATH=str(binary.parent), GGML_CPU_TILED_MM_FORCE="1")


def run_llamacpp(binary: Path, model: Path, prompt: str, *, n: int, threads: int, draft: int, ngram: bool | str,
                 ctx: int = 2048, ignore_eos: bool = True, extra: tuple[str, ...] = ()) -> dict:
    """One greedy llama-speculative-simple run. Without ignore_eos it stops at an end-of-generation token:
    its `decoded` count then includes that token (and any accepted draft tokens after it in the step)."""
    args = [str(binary), "-m", str(model), "-p", prompt, "-n", str(n), "-t", str(threads), "-c", str(ctx),
            "--temp", "0", "--top-k", "1", "-s", "1", "-ngl", "0", *(["--ignore-eos"] if ignore_eos else []), *extra]
    if isinstance(ngram, str):
        args += ["--spec-type", ngram]  # its own defaults (ngram-simple: 12-gram lookup, up to 48 drafted)
    elif ngram:
        args += ["--spec-type", "ngram-simple"]  # llama.cpp's defaults: 12-gram lookup, up to 48 drafted
    else:
        args += ["--spec-type", "draft-simple", "-md", str(model), "-ngld", "0", "-td", str(threads), "--spec-draft-n-max", str(draft),
                 "--spec-draft-n-min", str(draft), "--spec-draft-p-min", "0"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"llama.cpp failed ({out.returncode}):\n{log[-3000:]}")
    accept = re.search(r"accept\s+=\s+([\d.]+)%", log)
    # stdout is the prompt (after a <bos> mark) and then the generated text
    start = out.stdout.find(prompt)
    text = out.stdout[start + len(prompt):] if start >= 0 else ""
    return {"tokens": int(m.group(1)), "seconds": float(m.group(2)), "tps": float(m.group(3)),
            "accept": float(accept.group(1)) / 100 if accept else None, "text": text}


def run_specchat(model_name: str, prompt: str, *, n: int, threads: int, extra: list[str], env: dict | None = None,
                 ctx: int = 2048, ignore_eos: bool = True) -> dict:
    args = [sys.executable, "-m", "specchat.cli", "prompt", prompt, "--raw", "-m", model_name, "-n", str(n),
            "-t", str(threads), "-c", str(ctx), "--temp", "0", "--json", "-ngl", "0",
            *(["--ignore-eos"] if ignore_eos else []), *extra]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"specchat failed: {out.stderr[-2000:]}")
    doc = json.loads(out.stdout)
    stats = doc["stats"]
    return {"tokens": stats["generated_tokens"], "seconds": stats["generate_seconds"],
            "tps": stats["tokens_per_second"], "accept": stats["acceptance_rate"], "drafted": stats["drafted"],
            "accepted": stats["accepted"], "steps": stats["steps"], "pieces": [t["text"] for t in doc["tokens"]],
            "text": doc["text"], "finish_reason": doc.get("finish_reason"), "draft_lengths": stats.get("draft_lengths")}


def same_tokens(pieces: list[str], text: str) -> int:
    """How many of specchat's tokens (their text pieces) `text` starts with: where two greedy runs part.

    Greedy outputs of two speculative runs need not be the same text: a batch's logits differ slightly
    from one token's, so a near-tie can go either way, and after it the two texts differ. Their speeds
    then measure different work (one text may repeat itself, which lookup copies)."""
    at = 0
    for i, piece in enumerate(pieces):
        if text[at : at + len(piece)] != piece:
            return i
        at += len(piece)
    return len(pieces)


TRACE = """
import json, sys
from specchat.config import load_config
from specchat.loader import LoadOptions, Selection, load
from specchat.engine import StepEvent, generate
from specchat.loader import make_policy
from specchat.sampling import SamplingParams
loaded = load(load_config(), Selection("gemma-3-270m", "prompt-lookup"), LoadOptions(n_ctx=2048, n_threads=int(sys.argv[2]), n_gpu_layers=0))
ids = loaded.target.tokenize(sys.argv[1], add_special=True)
trace, emitted = [], 0
params = SamplingParams(temperature=0.0, banned=loaded.target.eog_tokens())
for ev in generate(loaded.target, loaded.drafter, ids, params, max_tokens=int(sys.argv[3]), policy=make_policy(loaded, 64, None)):
    if isinstance(ev, StepEvent):
        trace.append((emitted, ev.stats.drafted, ev.stats.accepted))
        emitted = ev.totals.emitted
print(json.dumps(trace))
"""


def draft_trace(prompt: str, *, n: int, threads: int, env: dict) -> list[tuple[int, int, int]]:
    """(tokens emitted before the step, drafted, accepted) per step of one fresh process."""
    out = subprocess.run([sys.executable, "-c", TRACE, prompt, str(threads), str(n)], capture_output=True,
                         text=True, timeout=600, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"trace failed: {out.stderr[-2000:]}")
    return [tuple(x) for x in json.loads(out.stdout)]


def lookup_vs_ngram(binary: Path, gemma: Path, a) -> None:
    """specchat's default (prompt lookup + policy, fresh process per run, estimates kept in a scratch cache
    dir between runs) vs the best of llama.cpp's three n-gram drafters per prompt.

    llama.cpp's loop stops only after the step that passes -n, so it decodes up to -n + its draft length
    (168-193 tokens for -n 128), and later tokens of a reply are often easier to predict. So each
    llama.cpp drafter is compared with a specchat run that generates exactly as many tokens: the counts
    come from one untimed llama.cpp run per drafter first.

    Both sides are greedy, but their texts can still part (see same_tokens), so each pair's texts are
    compared too: the ratio is printed for all prompts and, separately, against the best drafter whose
    text is specchat's over every compared token (the same work, timed on both sides)."""
    import tempfile

    home = tempfile.mkdtemp(prefix="specchat-bench-")
    env = {**os.environ, "SPECCHAT_HOME": home, "PYTHONPATH": str(ROOT)}
    print(f"\n## specchat default vs the best of llama.cpp {', '.join(NGRAM_TYPES)} (fresh SPECCHAT_HOME {home})")
    print("llama.cpp tok/s per drafter (tokens it decoded); specchat tok/s over the same number of tokens")
    print(f"{'prompt':<15}" + "".join(f"{t:>19}" for t in NGRAM_TYPES) + f"{'best':>14}{'specchat':>10}{'ratio':>8}"
          f"{'no-spec':>9}{'vs no-spec':>11}")
    ratios, same_ratios, agreement = [], [], []
    for i, (kind, prompt) in enumerate(LOOKUP_PROMPTS.items()):
        first = {t: run_llamacpp(binary, gemma, prompt, n=a.n, threads=a.threads, draft=0, ngram=t) for t in NGRAM_TYPES}
        lengths = {t: r["tokens"] for t, r in first.items()}
        ref = {t: [] for t in NGRAM_TYPES}
        mine = {n: [] for n in set(lengths.values())}
        pieces: dict[int, list[str]] = {}
        plain, counts = [], []
        for rep in range(a.reps):
            order = [0, 1] if (i + rep) % 2 == 0 else [1, 0]
            for who in order:
                if who == 0:
                    for t in NGRAM_TYPES:
                        ref[t].append(run_llamacpp(binary, gemma, prompt, n=a.n, threads=a.threads, draft=0, ngram=t)["tps"])
                else:
                    for n in mine:
                        r = run_specchat("gemma-3-270m", prompt, n=n, threads=a.threads, extra=[], env=env)
                        mine[n].append(r["tps"])
                        pieces.setdefault(n, r["pieces"])
                        counts.append(f"{r['accepted']}/{r['drafted']} in {r['steps']}")
                    plain.append(run_specchat("gemma-3-270m", prompt, n=a.n, threads=a.threads, extra=["--no-spec"], env=env)["tps"])
        med = {t: statistics.median(v) for t, v in ref.items()}
        best = max(med, key=med.get)
        ours, base = statistics.median(mine[lengths[best]]), statistics.median(plain)
        ratios.append(ours / med[best])
        same = {t: same_tokens(pieces[lengths[t]], first[t]["text"]) for t in NGRAM_TYPES}
        # the last token may be cut differently at the end of the text: one short still counts as the same
        alike = [t for t in NGRAM_TYPES if same[t] >= lengths[t] - 1]
        if alike:
            best_alike = max(alike, key=med.get)
            same_ratios.append(statistics.median(mine[lengths[best_alike]]) / med[best_alike])
        agreement.append(f"{kind}: " + ", ".join(f"{t} {same[t]}/{lengths[t]}" for t in NGRAM_TYPES))
        print(f"{kind:<15}" + "".join(f"{med[t]:>13.1f} ({lengths[t]:>3})" for t in NGRAM_TYPES) + f"{med[best]:>14.1f}"
              f"{ours:>10.1f}{ours / med[best]:>7.2f}x{base:>9.1f}{ours / base:>10.2f}x   accepted/drafted in steps: {', '.join(counts)}")
    print(f"geometric mean specchat / best llama.cpp n-gram drafter = {statistics.geometric_mean(ratios):.2f}x")
    print("tokens of specchat's text that each llama.cpp drafter's text starts with (of the tokens compared):")
    for line in agreement:
        print("  " + line)
    if same_ratios:
        print(f"on the same text (the best drafter whose text is specchat's, {len(same_ratios)} of "
              f"{len(LOOKUP_PROMPTS)} prompts): geometric mean {statistics.geometric_mean(same_ratios):.2f}x")
    # a fresh process on a prompt type seen before: how soon it drafts at its steady length
    kind = "summarisation"
    trace = draft_trace(LOOKUP_PROMPTS[kind], n=a.n, threads=a.threads, env=env)
    print(f"\ndraft-length trace, fresh process, {kind} (seen before in this run); (emitted before step: drafted/accepted)")
    print("  " + " ".join(f"{e}:{d}/{acc}" for e, d, acc in trace if e < 48))
    cold = {**env, "SPECCHAT_HOME": tempfile.mkdtemp(prefix="specchat-cold-")}
    trace = draft_trace(LOOKUP_PROMPTS[kind], n=a.n, threads=a.threads, env=cold)
    print("same, nothing learned before (empty cache dir):")
    print("  " + " ".join(f"{e}:{d}/{acc}" for e, d, acc in trace if e < 48))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=128, help="tokens to generate per prompt")
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--reps", type=int, default=2, help="alternating repetitions per prompt")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--only", choices=("all", "lookup", "classic"), default="all",
                        help="lookup: specchat's default vs llama.cpp's n-gram drafters on LOOKUP_PROMPTS; "
                             "classic: the draft-model and ngram-simple comparisons on PROMPTS")
    a = parser.parse_args()

    binary = build(a.jobs)
    if a.build_only:
        print(binary)
        return
    gemma = resolve(load_config().model("gemma-3-270m"))
    print(f"llama-cpp-python {llama_cpp_version()} · gemma-3-270m · threads {a.threads} · -n {a.n} · greedy · "
          f"{a.reps} alternating reps per prompt")
    if a.only in ("all", "lookup"):
        lookup_vs_ngram(binary, gemma, a)
    if a.only == "lookup":
        return
    cases = [
        ("draft model k=6 (self-pair)",
         lambda p: run_llamacpp(binary, gemma, p, n=a.n, threads=a.threads, draft=6, ngram=False),
         {"specchat k=6": ["-md", "gemma-3-270m", "--draft-fixed", "6", "--draft-p-min", "0"]}),
        ("prompt lookup (ngram-simple)",
         lambda p: run_llamacpp(binary, gemma, p, n=a.n, threads=a.threads, draft=6, ngram=True),
         {"specchat k=6": ["-md", "prompt-lookup", "--draft-fixed", "6"],
          "specchat policy": ["-md", "prompt-lookup"],
          "specchat no-spec": ["--no-spec"]}),
    ]
    for title, llama_run, ours in cases:
        print(f"\n## {title}")
        header = f"{'prompt':<8}{'llama.cpp tok/s':>17}" + "".join(f"{name + ' tok/s':>24}" for name in ours)
        print(header)
        ratios: dict[str, list[float]] = {name: [] for name in ours}
        for i, prompt in enumerate(PROMPTS):
            ref, mine = [], {name: [] for name in ours}
            for rep in range(a.reps):
                order = [0, 1] if (i + rep) % 2 == 0 else [1, 0]  # alternate who runs first
                for who in order:
                    if who == 0:
                        ref.append(llama_run(prompt)["tps"])
                    else:
                        for name, extra in ours.items():
                            mine[name].append(run_specchat("gemma-3-270m", prompt, n=a.n, threads=a.threads, extra=extra)["tps"])
            ref_tps = statistics.median(ref)
            row = f"{i:<8}{ref_tps:>17.1f}"
            for name in ours:
                tps = statistics.median(mine[name])
                ratios[name].append(tps / ref_tps)
                row += f"{tps:>14.1f} ({tps / ref_tps:4.2f}x)"
            print(row)
        for name, values in ratios.items():
            print(f"{name}: geometric-mean ratio vs llama.cpp = {statistics.geometric_mean(values):.2f}x")


if __name__ == "__main__":
    main()
