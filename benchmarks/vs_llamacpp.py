"""specchat vs llama.cpp's own speculative decoding, side by side in one run.

    python benchmarks/vs_llamacpp.py            # builds llama-speculative-simple once (~10 min on 2 cores)

1. Draft model: gemma-3-270m drafting for itself, forced k = 6, greedy, same threads, same prompts:
   llama.cpp's `llama-speculative-simple` vs `specchat prompt --draft-fixed 6`.
2. Prompt lookup: llama.cpp `--spec-type ngram-simple` vs specchat's prompt lookup (its default policy
   and forced k = 6), one model, greedy.

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


def llama_cpp_version() -> str:
    return importlib.metadata.version("llama-cpp-python")


def build(jobs: int, target: str = "llama-speculative-simple") -> Path:
    """A llama.cpp tool (llama-speculative-simple, llama-bench) from the sdist of the installed
    llama-cpp-python, built once into the cache dir."""
    version = llama_cpp_version()
    work = cache_dir() / f"llama.cpp-{version}"
    binary = work / "build" / "bin" / target
    if binary.exists():
        return binary
    work.mkdir(parents=True, exist_ok=True)
    sdist = next(work.glob("llama_cpp_python-*.tar.gz"), None)
    if sdist is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", str(work)],
            check=True,
        )
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    source = work / "llama.cpp"
    if not source.exists():
        prefix = f"{sdist.name[: -len('.tar.gz')]}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(source, members=[m for m in members if m.name], filter="data")
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release",
         "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_CURL=OFF"],
        check=True,
    )
    subprocess.run(
        ["cmake", "--build", str(work / "build"), "--target", target, f"-j{jobs}"], check=True
    )
    return binary


def run_llamacpp(binary: Path, model: Path, prompt: str, *, n: int, threads: int, draft: int, ngram: bool) -> dict:
    args = [str(binary), "-m", str(model), "-p", prompt, "-n", str(n), "-t", str(threads), "-c", "2048",
            "--temp", "0", "--top-k", "1", "-s", "1", "--ignore-eos", "-ngl", "0"]
    if ngram:
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
    return {"tokens": int(m.group(1)), "seconds": float(m.group(2)), "tps": float(m.group(3)),
            "accept": float(accept.group(1)) / 100 if accept else None}


def run_specchat(model_name: str, prompt: str, *, n: int, threads: int, extra: list[str]) -> dict:
    args = [sys.executable, "-m", "specchat.cli", "prompt", prompt, "--raw", "-m", model_name, "-n", str(n),
            "-t", str(threads), "-c", "2048", "--temp", "0", "--json", "--ignore-eos", "-ngl", "0", *extra]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"specchat failed: {out.stderr[-2000:]}")
    stats = json.loads(out.stdout)["stats"]
    return {"tokens": stats["generated_tokens"], "seconds": stats["generate_seconds"],
            "tps": stats["tokens_per_second"], "accept": stats["acceptance_rate"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=128, help="tokens to generate per prompt")
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--reps", type=int, default=2, help="alternating repetitions per prompt")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs")
    parser.add_argument("--build-only", action="store_true")
    a = parser.parse_args()

    binary = build(a.jobs)
    if a.build_only:
        print(binary)
        return
    gemma = resolve(load_config().model("gemma-3-270m"))
    print(f"llama-cpp-python {llama_cpp_version()} · gemma-3-270m · threads {a.threads} · -n {a.n} · greedy · "
          f"{a.reps} alternating reps per prompt")
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
