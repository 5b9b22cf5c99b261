"""Peak resident memory of `specchat prompt` on gemma-3-270m with an 8192-token context and a long prompt.

    python benchmarks/memory.py            # goal (issue 5): <= 1.0 GB

Runs the real CLI in a child process and reads its peak RSS from the kernel (getrusage of children),
for target-only and for prompt lookup. For scale: with Llama(logits_all=True) llama-cpp-python alone
would allocate n_ctx x n_vocab floats = 8192 x 262144 x 4 B = 8.6 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PARAGRAPH = (
    "The committee met on Tuesday to review the budget for the coming year. Members discussed the cost of "
    "repairing the old bridge, the new bus routes, the library's opening hours and the plan to plant trees "
    "along the river. After a long debate they agreed to publish the figures before the next meeting. "
)


def peak_rss_mb(args: list[str]) -> tuple[float, dict]:
    """Run one child and return its peak RSS in MiB (ru_maxrss of that child alone) and its JSON output."""
    script = (
        "import resource, subprocess, sys, json;"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
        "sys.stderr.write(p.stderr);"
        "print(json.dumps({'rc': p.returncode, 'out': p.stdout,"
        " 'rss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))"
    )
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=ROOT)
    result = json.loads(out.stdout)
    if result["rc"] != 0:
        raise RuntimeError(out.stderr[-2000:])
    return result["rss_kib"] / 1024, json.loads(result["out"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=7000, help="approximate prompt length")
    parser.add_argument("-n", type=int, default=128)
    a = parser.parse_args()
    text = PARAGRAPH * max(1, a.prompt_tokens // 60) + "\nSummarise the minutes above in three sentences."
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    print(f"# memory benchmark · {time.strftime('%Y-%m-%d %H:%M')} · gemma-3-270m · -c {a.c} · -n {a.n}")
    for label, extra in (("target-only", ["--no-spec"]), ("prompt-lookup", ["-md", "prompt-lookup"])):
        cmd = [sys.executable, "-m", "specchat.cli", "prompt", "-", "--raw", "-m", "gemma-3-270m", "-c", str(a.c),
               "-n", str(a.n), "--json", "--temp", "0", "-ngl", "0", *extra]
        rss, doc = peak_rss_mb(["sh", "-c", " ".join(cmd) + f" < {f.name}"])
        stats = doc["stats"]
        verdict = "meets" if rss <= 1024 else "MISSES"
        print(f"{label:<14} prompt {stats['prompt_tokens']} tokens · generated {stats['generated_tokens']} · "
              f"peak RSS {rss:.0f} MiB ({rss / 1024:.2f} GiB) — {verdict} the 1.0 GB goal")
    os.unlink(f.name)


if __name__ == "__main__":
    main()
