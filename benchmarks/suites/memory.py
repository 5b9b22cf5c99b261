"""Peak resident memory of `specchat prompt` with a long context and a long prompt (goal: 1.0 GB or less).

    python -m benchmarks memory                  # gemma-3-270m, -c 8192, a ~7000-token prompt
    python -m benchmarks memory --ctx 4096 --prompt-tokens 3000

Runs the real CLI in a child process and reads its peak RSS from the kernel (getrusage of children), for
target-only and for prompt lookup. For scale: with Llama(logits_all=True) llama-cpp-python alone would
allocate n_ctx x n_vocab floats = 8192 x 262144 x 4 B = 8.6 GB.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from benchmarks import harness

TITLE = "peak resident memory"
DEFAULTS = {"n": 128, "threads": 2, "model": "gemma-3-270m"}
PARAGRAPH = (
    "The committee met on Tuesday to review the budget for the coming year. Members discussed the cost of "
    "repairing the old bridge, the new bus routes, the library's opening hours and the plan to plant trees "
    "along the river. After a long debate they agreed to publish the figures before the next meeting. "
)


def options(p) -> None:
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--prompt-tokens", type=int, default=7000, help="approximate prompt length")


def peak(prompt_file: str, *args: str) -> list:
    """In a process of its own (harness.child), so that the children's peak RSS is this one's: one
    specchat command reading the prompt from `prompt_file`; [MiB of its peak RSS, its JSON]."""
    with open(prompt_file) as stdin:
        out = subprocess.run(args, stdin=stdin, capture_output=True, text=True, cwd=harness.ROOT,
                             env=harness.specchat_env())
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return [resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, json.loads(out.stdout)]


def run(a, result: harness.Result) -> None:
    text = PARAGRAPH * max(1, a.prompt_tokens // 60) + "\nSummarise the minutes above in three sentences."
    rows = []
    with harness.scratch("specchat-memory-") as work:
        (work / "prompt.txt").write_text(text)
        for label, extra in (("target-only", ["--no-spec"]), ("prompt-lookup", ["-md", "prompt-lookup"])):
            rss, doc = harness.child("suites.memory:peak", str(work / "prompt.txt"), sys.executable, "-m",
                                     "specchat.cli", "prompt", "-", "--raw", "-m", a.model, "-c", str(a.ctx), "-n",
                                     str(a.n), "-t", str(a.threads), "--json", "--temp", "0", "-ngl", "0", *extra)
            stats = doc["stats"]
            rows.append([label, stats["prompt_tokens"], stats["generated_tokens"], rss, rss / 1024,
                         "meets" if rss <= 1024 else "MISSES"])
    result.table(f"{a.model} · -c {a.ctx} · -n {a.n}", ["run", "prompt tokens", "generated", "peak RSS MiB:.0f",
                                                      "GiB:.2f", "1.0 GB goal"], rows)
