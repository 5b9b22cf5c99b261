"""Drafting heads: specchat's MTP and EAGLE-3 drafting against llama.cpp's on the same generated files.

    python benchmarks/heads.py                     # both heads, k = 3, 128 tokens
    python benchmarks/heads.py --k 1 --n 200
    python benchmarks/heads.py --llama-bin PATH    # llama-speculative-simple (default /work/llama-build/bin/...)

tests/tiny_models.py writes a qwen35 target (hybrid, recurrent-state snapshots) with one MTP block, and a
4-layer llama target with an EAGLE-3 head; both at their TARGET_CONTEXT, so the context moves some of
the target's argmaxes away from the bigram map and the heads miss now and then. Greedy, --ignore-eos,
--threads (2) threads, draft p-min 0 and exactly k drafts a step on both sides (llama.cpp: --spec-draft-n-max k
--spec-draft-n-min k; specchat: a fixed policy of k). Each row is one fresh process.

- per step: llama-speculative-simple (-v) logs "accepted a/d draft tokens" and the n_past after each step;
  specchat's StepEvents give the same. Steps are paired by the position the draft started at (llama.cpp
  decodes the whole prompt first and samples one token, specchat drafts from the prompt's last token, so
  specchat's first step has no partner). Printed: how many paired steps agree exactly, the first ones
  side by side, and the totals.
- tok/s: generation tokens per second, specchat's own stats and llama.cpp's "decoded ... speed"; specchat
  target-only on the same file as the baseline; the median of --reps runs of each, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import tiny_models  # noqa: E402

N_PROMPT = 64

RUNNER = r"""
import json, sys
from specchat.backend import LlamaCppBackend
from specchat.drafters import HeadDrafter
from specchat.engine import Finished, StepEvent, generate
from specchat.heads import Eagle3Head, MtpHead
from specchat.policy import FixedPolicy
from specchat.sampling import SamplingParams
kind, target_path, head_path, prompt, n, k, threads = sys.argv[1:8]
n, k = int(n), int(k)
target = LlamaCppBackend(target_path, n_ctx=2048, n_threads=int(threads), n_gpu_layers=0, mtp=kind == "mtp")
head = drafter = None
if kind == "mtp":
    head = MtpHead(target)
elif kind == "eagle3":
    head = Eagle3Head(target, head_path, n_gpu_layers=0)
if head is not None:
    drafter = HeadDrafter(head, target, p_min=0.0)
ids = target.tokenize(prompt, add_special=True)
params = SamplingParams(temperature=0.0, banned=target.eog_tokens())
steps, n_past = [], len(ids) - 1
for event in generate(target, drafter, ids, params, max_tokens=n, policy=FixedPolicy(k if head else 0)):
    if isinstance(event, StepEvent):
        s = event.stats
        steps.append((n_past, s.drafted, s.accepted))
        n_past += s.emitted
    elif isinstance(event, Finished):
        stats = event.stats
print(json.dumps({"tps": stats.tokens_per_second, "tokens": stats.emitted, "drafted": stats.drafted,
                  "accepted": stats.accepted, "steps": steps, "recoveries": stats.rollback_recoveries,
                  "text": event.text}))
if head is not None:
    head.close()
target.close()
"""


THREADS = 2


def run_specchat(home: Path, kind: str, target: Path, head: Path | None, prompt: str, n: int, k: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECCHAT_HOME": str(home)}
    out = subprocess.run([sys.executable, "-c", RUNNER, kind, str(target), str(head or ""), prompt, str(n), str(k),
                          str(THREADS)],
                         capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"specchat failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llamacpp(binary: Path, kind: str, target: Path, head: Path | None, prompt: str, n: int, k: int,
                 extra: tuple[str, ...] = ()) -> dict:
    """One llama-speculative-simple run with -v; `extra` goes last (a repeated option's last value wins)."""
    args = [str(binary), "-m", str(target), "-p", prompt, "-n", str(n), "-t", str(THREADS), "-c", "2048", "--temp", "0",
            "--top-k", "1", "-s", "1", "--ignore-eos", "-ngl", "0", "-v", "--spec-type", f"draft-{kind}",
            "--spec-draft-n-max", str(k), "--spec-draft-n-min", str(k), "--spec-draft-p-min", "0"]
    if head is not None:
        args += ["-md", str(head), "-ngld", "0", "-td", str(THREADS)]
    out = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"llama.cpp failed ({out.returncode}):\n{log[-3000:]}")
    n_input = int(re.search(r"encoded\s+(\d+) tokens", log).group(1))
    steps, n_past = [], n_input
    for accepted, drafted, after in re.findall(
            r"accepted (\d+)/(\d+) draft tokens.*?\n.*?clear kv cache from any extra tokens, n_past = (\d+)", log):
        steps.append((n_past, int(drafted), int(accepted)))
        n_past = int(after)
    return {"tps": float(m.group(3)), "tokens": int(m.group(1)),
            "drafted": int(re.search(r"n_drafted\s*=\s*(\d+)", log).group(1)),
            "accepted": int(re.search(r"n_accept\s*=\s*(\d+)", log).group(1)), "steps": steps}


def own_text(target: Path) -> str:
    """N_PROMPT tokens of the models' own text (the bigram chain)."""
    import llama_cpp

    chain = tiny_models.bigram_chain(int(tiny_models.cycle_tokens()[0]), N_PROMPT)
    llm = llama_cpp.Llama(str(target), vocab_only=True, verbose=False)
    try:
        return llm.detokenize(chain).decode("utf-8", "replace").strip()
    finally:
        llm.close()


def compare(ours: list, theirs: list, end: int) -> tuple[int, int, list]:
    """(steps paired by start position that agree, steps paired, the pairs side by side). A step that
    starts within k of the end is left out: specchat drafts nothing past -n, llama.cpp drafts k anyway."""
    by_pos = {p: (d, a) for p, d, a in theirs}
    pairs = [(p, (d, a), by_pos[p]) for p, d, a in ours if p in by_pos and p < end]
    agree = sum(x == y for _, x, y in pairs)
    return agree, len(pairs), pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, default=Path("/work/llama-build/bin/llama-speculative-simple"))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--show", type=int, default=8, help="paired steps printed side by side (and every one that differs)")
    ap.add_argument("--reps", type=int, default=3, help="runs of each; tok/s is their median (the machine is shared)")
    ap.add_argument("--threads", type=int, default=2, help="-t for both (1 is steadier on a busy machine)")
    a = ap.parse_args()
    global THREADS
    THREADS = a.threads
    if not a.llama_bin.exists():
        sys.exit(f"no {a.llama_bin}: build llama-speculative-simple from the sdist (see DESIGN notes) or pass --llama-bin")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        mtp_target = tiny_models.write_model(work / "qwen35-mtp.gguf", "qwen35",
                                             context=tiny_models.TARGET_CONTEXT["qwen35"], mtp=True)
        llama_target = tiny_models.write_model(work / "llama4.gguf", "llama", context=tiny_models.TARGET_CONTEXT["llama"],
                                               n_layer=tiny_models.EAGLE3_TARGET_LAYERS)
        eagle = tiny_models.write_eagle3(work / "eagle3.gguf")
        print(f"greedy, k = {a.k} (p-min 0, exactly k drafts a step), {a.n} tokens, {THREADS} threads, prompt: "
              f"{N_PROMPT} tokens of the models' own text")
        for kind, target, head in (("mtp", mtp_target, None), ("eagle3", llama_target, eagle)):
            prompt = own_text(target)
            runs = {"ours": [], "alone": [], "theirs": []}
            for _ in range(a.reps):  # interleaved, so a busy moment hits all three alike
                runs["ours"].append(run_specchat(work, kind, target, head, prompt, a.n, a.k))
                runs["alone"].append(run_specchat(work, "target", target, None, prompt, a.n, 0))
                runs["theirs"].append(run_llamacpp(a.llama_bin, kind, target, head, prompt, a.n, a.k))
            ours, alone, theirs = (dict(r[0], tps=statistics.median(x["tps"] for x in r)) for r in runs.values())
            n_prompt = ours["steps"][0][0] + 1
            agree, paired, pairs = compare(ours["steps"], theirs["steps"], n_prompt + a.n - a.k - 1)
            print(f"\n== {kind}: {target.name}" + (f" + {head.name}" if head else " (its own MTP layers)"))
            print(f"  per step (drafted/accepted), paired by start position: {agree} of {paired} agree")
            print("    n_past  specchat  llama.cpp")
            for i, (pos, x, y) in enumerate(pairs):
                if i >= a.show and x == y:
                    continue
                print(f"    {pos:6d}  {x[1]}/{x[0]:<7d} {y[1]}/{y[0]}{'' if x == y else '   <- differs'}")
            for name, r in (("specchat", ours), ("llama.cpp", theirs)):
                rate = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
                print(f"  {name:9s}  accepted {r['accepted']:4d} of {r['drafted']:4d} drafted ({rate:5.1%}), "
                      f"{len(r['steps'])} steps, {r['tps']:7.1f} tok/s")
            print(f"  specchat target-only: {alone['tps']:7.1f} tok/s (medians of {a.reps}) · head vs target-only "
                  f"{ours['tps'] / alone['tps']:.2f}x · specchat vs llama.cpp {ours['tps'] / theirs['tps']:.2f}x · "
                  f"re-reads {ours['recoveries']}")


if __name__ == "__main__":
    main()
