"""Chains of drafters: each chain against each of its drafters alone and against llama.cpp's
`llama-speculative-simple` with the same `--spec-type` list, on the same generated files, side by side.

    python benchmarks/chains.py                     # 128 tokens, 3 reps, 2 threads
    python benchmarks/chains.py --n 200 --reps 5
    python benchmarks/chains.py --llama-bin PATH    # an already built llama-speculative-simple

tests/tiny_models.py writes a qwen35 target (hybrid: attention and recurrent layers, state snapshots) with one
MTP block, and a qwen35 draft of the same tokenizer without it, at the target's TARGET_CONTEXT (the context
moves some argmaxes off the bigram map, so every drafter misses now and then). The prompt is the models' own
text twice over, so prompt lookup has something to copy and the heads have something to predict.

Greedy, --ignore-eos, the same threads on both sides. specchat runs its adaptive policy (each step the draft
with the best expected rate among the chain's drafters, or none), after one untimed run that calibrates the
machine; llama.cpp runs its defaults for each --spec-type (a chain takes its first non-empty draft, n-gram
types first). Each row is one fresh process; tok/s is the median of --reps runs, interleaved so that a busy
moment hits every row alike. `choices` is how many tokens each drafter drafted in specchat's median run.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_models  # noqa: E402
from vs_llamacpp import build  # noqa: E402

# (label, --spec-type, whether -md names the draft file); the chains last
SETTINGS = (
    ("target only", None, False),
    ("draft-mtp", "draft-mtp", False),
    ("ngram-simple", "ngram-simple", False),
    ("draft-simple", "draft-simple", True),
    ("draft-mtp,ngram-simple", "draft-mtp,ngram-simple", False),
    ("draft-simple,draft-mtp,ngram-simple", "draft-simple,draft-mtp,ngram-simple", True),
)


def run_specchat(home: Path, target: Path, draft: Path, prompt: str, spec_type: str | None, uses_draft: bool,
                 n: int, threads: int, extra: tuple[str, ...] = ()) -> dict:
    args = [sys.executable, "-m", "specchat.cli", "prompt", prompt, "--raw", "-m", str(target), "--temp", "0", "-n", str(n),
            "--ignore-eos", "--json", "-t", str(threads), "-ngl", "0", "--no-lookup-history"]
    args += ["--spec-type", spec_type] if spec_type else ["--no-spec"]
    if uses_draft:
        args += ["-md", str(draft)]
    args += list(extra)
    env = {**os.environ, "SPECCHAT_HOME": str(home), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"specchat failed: {out.stderr[-3000:]}")
    doc = json.loads(out.stdout)
    stats = doc["stats"]
    return {"tps": stats["tokens_per_second"], "drafted": stats["drafted"], "accepted": stats["accepted"],
            "by": stats.get("drafted_by", {}), "tokens": [t["id"] for t in doc["tokens"]]}


def run_llamacpp(binary: Path, target: Path, draft: Path, prompt: str, spec_type: str | None, uses_draft: bool,
                 n: int, threads: int, extra: tuple[str, ...] = ()) -> dict:
    args = [str(binary), "-m", str(target), "-p", prompt, "-n", str(n), "-t", str(threads), "-c", "2048", "--temp", "0",
            "--top-k", "1", "-s", "1", "--ignore-eos", "-ngl", "0"]
    if spec_type:
        args += ["--spec-type", spec_type]
    else:  # llama-speculative-simple always drafts: a target-only row is specchat's alone
        return {}
    if uses_draft:
        args += ["-md", str(draft), "-ngld", "0", "-td", str(threads)]
    args += list(extra)
    out = subprocess.run(args, capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    if out.returncode != 0 or not m:  # (a chain llama.cpp cannot build: say why in the table)
        why = next((line.split("what():", 1)[1].strip() for line in log.splitlines() if "what():" in line),
                   f"exit {out.returncode}")
        return {"error": why}
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    return {"tps": float(m.group(3)), "drafted": int(drafted.group(1)) if drafted else 0,
            "accepted": int(accepted.group(1)) if accepted else 0}


def own_text(target: Path, n_tokens: int) -> str:
    """The models' own text (the bigram chain), twice: lookup can copy the second half."""
    import llama_cpp

    chain = tiny_models.bigram_chain(int(tiny_models.cycle_tokens()[0]), n_tokens)
    llm = llama_cpp.Llama(str(target), vocab_only=True, verbose=False)
    try:
        text = llm.detokenize(chain).decode("utf-8", "replace").strip()
    finally:
        llm.close()
    return f"{text} {text}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, default=None, help="llama-speculative-simple (default: build it once)")
    ap.add_argument("--n", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--reps", type=int, default=3, help="runs of each row; tok/s is their median")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    a = ap.parse_args()
    for name in ("n", "reps", "threads", "prompt_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    binary = a.llama_bin or build(a.threads)
    if not binary.exists():
        ap.error(f"--llama-bin {binary}: no such file")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        context = tiny_models.TARGET_CONTEXT["qwen35"]
        target = tiny_models.write_model(work / "qwen35-mtp.gguf", "qwen35", context=context, mtp=True)
        draft = tiny_models.write_model(work / "qwen35.gguf", "qwen35", context=context)
        prompt = own_text(target, a.prompt_tokens)
        home = work / "home"
        run_specchat(home, target, draft, prompt, "draft-simple,draft-mtp,ngram-simple", True, 16, a.threads)  # calibrate
        runs: dict[str, dict[str, list[dict]]] = {label: {"ours": [], "theirs": []} for label, _, _ in SETTINGS}
        failed: dict[str, str] = {}  # llama.cpp's reason, where it cannot run a setting
        for _ in range(a.reps):
            for label, spec_type, uses_draft in SETTINGS:
                runs[label]["ours"].append(run_specchat(home, target, draft, prompt, spec_type, uses_draft, a.n, a.threads))
                theirs = run_llamacpp(binary, target, draft, prompt, spec_type, uses_draft, a.n, a.threads)
                if theirs.get("error"):
                    failed[label] = theirs["error"]
                elif theirs:
                    runs[label]["theirs"].append(theirs)
        print(f"# chains · tiny qwen35 target with an MTP layer + a qwen35 draft · greedy · {a.n} tokens · "
              f"{a.threads} threads · median of {a.reps} · prompt {2 * a.prompt_tokens} tokens of the models' own text")
        print(f"{'setting':<38}{'specchat':>10}{'acc':>6}{'llama.cpp':>11}{'acc':>6}{'ratio':>7}  choices (tokens drafted)")
        medians: dict[str, float] = {}
        reference = runs["target only"]["ours"][0]["tokens"]
        for label, _, _ in SETTINGS:
            ours = runs[label]["ours"]
            med = statistics.median(r["tps"] for r in ours)
            medians[label] = med
            mid = min(ours, key=lambda r: abs(r["tps"] - med))
            acc = f"{mid['accepted'] / mid['drafted']:.0%}" if mid["drafted"] else "-"
            line = f"{label:<38}{med:>10.1f}{acc:>6}"
            if runs[label]["theirs"]:
                theirs = runs[label]["theirs"]
                t_med = statistics.median(r["tps"] for r in theirs)
                t_mid = min(theirs, key=lambda r: abs(r["tps"] - t_med))
                t_acc = f"{t_mid['accepted'] / t_mid['drafted']:.0%}" if t_mid["drafted"] else "-"
                line += f"{t_med:>11.1f}{t_acc:>6}{med / t_med:>6.2f}x"
            elif label in failed:
                line += f"{'n/a':>11}{'':>6}{'':>7}"
            else:
                line += f"{'':>11}{'':>6}{'':>7}"
            same = sum(x == y for x, y in zip(mid["tokens"], reference))
            choices = ", ".join(f"{k} {v}" for k, v in sorted(mid["by"].items())) or "-"
            print(line + f"  {choices}" + ("" if same == len(reference) else f"  (text parts at token {same})"))
        for label, why in failed.items():
            print(f"llama.cpp cannot run {label}: {why}")
        for chain, alone in (("draft-mtp,ngram-simple", ("draft-mtp", "ngram-simple")),
                             ("draft-simple,draft-mtp,ngram-simple", ("draft-simple", "draft-mtp", "ngram-simple"))):
            best = max(alone, key=lambda label: medians[label])
            print(f"{chain}: {medians[chain] / medians[best]:.2f}x of its best drafter alone ({best}), "
                  f"{medians[chain] / medians['target only']:.2f}x of target-only")


if __name__ == "__main__":
    main()
