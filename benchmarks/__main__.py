"""specchat's benchmark tool: one entry point, one suite per question, the options they share defined once.

    python -m benchmarks SUITE [options]      # run a suite; --json FILE keeps its results
    python -m benchmarks show FILE            # a saved result rendered again
    python -m benchmarks SUITE --help         # a suite's own options and what it measures

Every suite prints its tables as it goes and can save them as JSON (`--json`); llama.cpp's tools are built
once from the llama.cpp vendored in the installed llama-cpp-python (or taken from `--llama-dir`). The
figures quoted in docs/benchmarks.md each carry the command that reproduces them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from benchmarks import harness

SUITES = {
    "lookup": "prompt lookup vs llama.cpp's n-gram drafters on 50 prompts nobody tuned it on",
    "replay": "the lookup suite replayed on fixed replies (no noise): the policy and its constants",
    "chat": "`specchat chat` vs llama-server with each of its drafters, multi-turn",
    "plain": "plain decoding vs llama-bench",
    "host": "specchat's own time per step outside llama_decode (by drafter, sampler, context length)",
    "files": "generated files: hybrid targets, chains, heads, block drafters vs llama-speculative-simple",
    "rpc": "the target on an RPC worker: cost per evaluation and decoding speed by placement",
    "memory": "peak resident memory of `specchat prompt` with a long context",
    "gpu": "the GPU check (benchmarks/gpu_check.py): build, real-shaped models, every table",
}

# the options suites share: (flags, argparse keywords); a suite takes those its DEFAULTS name
SHARED = {
    "n": (("-n",), dict(type=int, help="tokens generated per run (per turn in chat)")),
    "threads": (("-t", "--threads"), dict(type=int, help="CPU threads of both sides")),
    "reps": (("--reps",), dict(type=int, help="runs of each figure; the median is reported")),
    "model": (("--model", "-m"), dict(help="target model: a name from models.toml or a .gguf path")),
    "llama_dir": (("--llama-dir",), dict(type=Path, help="a folder of already built llama.cpp tools (default: "
                                                        "build them once into the cache dir)")),
    "jobs": (("--jobs",), dict(type=int, help="build jobs for llama.cpp's tools")),
    "batch_invariant": (("--batch-invariant",), dict(action="store_true", help="both sides on a llama.cpp build whose "
                        "batch logits equal single-token ones, flash attention off: every greedy text is the "
                        "target's own, so the drafters are compared on one text (its speeds are not a user's)")),
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="suite", required=True, metavar="SUITE")
    show = sub.add_parser("show", help="render a result saved with --json")
    show.add_argument("file", type=Path)
    child = sub.add_parser("_child")  # harness.child: one function in a process of its own
    child.add_argument("function")
    child.add_argument("args", nargs=argparse.REMAINDER)
    for name, summary in SUITES.items():
        if name == "gpu":  # its own options: gpu_check.py's
            sub.add_parser(name, help=summary, add_help=False).add_argument("rest", nargs=argparse.REMAINDER)
            continue
        module = importlib.import_module(f"benchmarks.suites.{name}")
        p = sub.add_parser(name, help=summary, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        for key, default in module.DEFAULTS.items():
            flags, kwargs = SHARED[key]
            p.add_argument(*flags, dest=key, default=default, **kwargs)
        module.options(p)
        p.add_argument("--json", type=Path, metavar="FILE", help="save the results here")
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gpu_check

        gpu_check.main(argv[1:])
        return
    a = parser().parse_args(argv)
    if a.suite == "show":
        print(harness.render(json.loads(a.file.read_text())))
        return
    if a.suite == "_child":
        module, function = a.function.split(":")
        print(json.dumps(getattr(importlib.import_module(f"benchmarks.{module}"), function)(*a.args)))
        return
    for key in ("n", "threads", "reps", "jobs"):
        if getattr(a, key, 1) is not None and getattr(a, key, 1) < 1:
            raise SystemExit(f"benchmarks {a.suite}: --{key} must be at least 1")
    if getattr(a, "jobs", 1) is None:
        a.jobs = os.cpu_count() or 2
    module = importlib.import_module(f"benchmarks.suites.{a.suite}")
    result = harness.Result(a.suite, module.TITLE)
    print(harness.render(result.doc), flush=True)
    try:
        module.run(a, result)
    finally:
        result.save(a.json)


if __name__ == "__main__":
    main()
