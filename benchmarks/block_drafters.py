"""Block drafters (DFlash, DSpark): specchat against llama.cpp's `llama-speculative-simple --spec-type
draft-dflash` / `draft-dspark`, built from the same vendored source, on the same generated files, side by side.

    python benchmarks/block_drafters.py                     # 128 tokens, 3 reps, 2 threads
    python benchmarks/block_drafters.py --n 256 --reps 5
    python benchmarks/block_drafters.py --llama-bin PATH    # an already built llama-speculative-simple

tests/tiny_models.py writes a llama target (write_dflash_target: its greedy text leaves its bigram cycles at
2-3% of positions) and a DFlash and a DSpark draft for it (write_dflash), built so that llama.cpp's own
draft-dflash accepts most of each block. The prompt is the target's own text (the drafts predict it; prompt
lookup would copy it, so neither side looks anything up). Greedy, --ignore-eos, the same threads on both sides.

Rows: target only (specchat --no-spec), each drafter at a fixed block (specchat --draft-fixed k, llama.cpp
--spec-draft-n-max k: llama.cpp clamps to the file's block, 7 for DFlash's 8-slot blocks, 8 for anchor-first
DSpark), and specchat's adaptive policy (against llama.cpp at the file's whole block), also with a draft
written for another target (another seed: its drafts are nearly never right). specchat's runs follow
one untimed run that calibrates the machine; each row is one fresh process; tok/s is the median of --reps runs,
interleaved so that a busy moment hits every row alike. acc = accepted / drafted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chains import own_text, run_llamacpp, run_specchat, tiny_models  # noqa: E402
from vs_llamacpp import build  # noqa: E402


def settings(block: int) -> list[tuple[str, str | None, str | None, tuple[str, ...], tuple[str, ...]]]:
    """(label, which draft file, --spec-type, specchat's extra flags, llama.cpp's extra flags)."""
    rows: list = [("target only", None, None, (), ())]
    for which, spec_type, whole in (("dflash", "draft-dflash", block - 1), ("dspark", "draft-dspark", block)):
        for k in sorted({3, whole}):
            rows.append((f"{spec_type} k={k}", which, spec_type, ("--draft-fixed", str(k)),
                         ("--spec-draft-n-max", str(k), "--spec-draft-p-min", "0")))
        rows.append((f"{spec_type} policy", which, spec_type, (), ("--spec-draft-n-max", str(whole))))
    # a draft trained for another target (another seed's bigram map): it is nearly never right, and the policy
    # must then cost nothing against target-only
    rows.append(("draft-dflash policy, a draft for another target", "other", "draft-dflash", (),
                 ("--spec-draft-n-max", str(block - 1))))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, default=None, help="llama-speculative-simple (default: build it once)")
    ap.add_argument("--n", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--reps", type=int, default=3, help="runs of each row; tok/s is their median")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--flash-attn", choices=("on", "off", "auto"), default=None,
                    help="-fa for both tools (default: each its own: specchat's auto is off on the CPU alone, "
                         "llama.cpp's is on): the same kernel on both sides")
    a = ap.parse_args()
    for name in ("n", "reps", "threads", "prompt_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    binary = a.llama_bin or build(a.threads)
    if not binary.exists():
        ap.error(f"--llama-bin {binary}: no such file")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        target = tiny_models.write_dflash_target(work / "llama.gguf")
        drafts = {"dflash": tiny_models.write_dflash(work / "dflash.gguf"),
                  "dspark": tiny_models.write_dflash(work / "dspark.gguf", markov=3.0),
                  "other": tiny_models.write_dflash(work / "other.gguf", seed=1)}
        prompt = own_text(target, a.prompt_tokens // 2)
        home = work / "home"
        rows = settings(tiny_models.DFLASH_BLOCK)
        fa = ("-fa", a.flash_attn) if a.flash_attn else ()
        for which, draft in drafts.items():  # calibrate the target and each draft once (untimed)
            run_specchat(home, target, draft, prompt, "draft-dspark" if which == "dspark" else "draft-dflash", True,
                         16, a.threads, fa)
        runs: dict[str, dict[str, list[dict]]] = {label: {"ours": [], "theirs": []} for label, *_ in rows}
        for _ in range(a.reps):
            for label, which, spec_type, ours, theirs in rows:
                draft = drafts.get(which, target)
                runs[label]["ours"].append(run_specchat(home, target, draft, prompt, spec_type, which is not None,
                                                        a.n, a.threads, (*ours, *fa)))
                if spec_type is not None:
                    result = run_llamacpp(binary, target, draft, prompt, spec_type, True, a.n, a.threads, (*theirs, *fa))
                    if result.get("error"):
                        raise SystemExit(f"llama.cpp cannot run {label}: {result['error']}")
                    runs[label]["theirs"].append(result)
        print(f"# block drafters · tiny llama target (n_embd {tiny_models.dflash_target_width()}) + DFlash / DSpark "
              f"drafts (block {tiny_models.DFLASH_BLOCK}) · greedy · {a.n} tokens · {a.threads} threads · median of "
              f"{a.reps} · prompt: the target's own text · -fa {a.flash_attn or 'each tool its own default'}")
        print(f"{'setting':<48}{'specchat':>10}{'acc':>6}{'llama.cpp':>11}{'acc':>6}{'ratio':>7}")
        reference = runs["target only"]["ours"][0]["tokens"]
        plain = statistics.median(r["tps"] for r in runs["target only"]["ours"])
        for label, *_ in rows:
            ours = runs[label]["ours"]
            med = statistics.median(r["tps"] for r in ours)
            mid = min(ours, key=lambda r: abs(r["tps"] - med))
            acc = f"{mid['accepted'] / mid['drafted']:.0%}" if mid["drafted"] else "-"
            line = f"{label:<48}{med:>10.1f}{acc:>6}"
            if runs[label]["theirs"]:
                theirs = runs[label]["theirs"]
                t_med = statistics.median(r["tps"] for r in theirs)
                t_mid = min(theirs, key=lambda r: abs(r["tps"] - t_med))
                t_acc = f"{t_mid['accepted'] / t_mid['drafted']:.0%}" if t_mid["drafted"] else "-"
                line += f"{t_med:>11.1f}{t_acc:>6}{med / t_med:>6.2f}x"
            else:
                line += f"{'':>11}{'':>6}{'':>7}"
            same = sum(x == y for x, y in zip(mid["tokens"], reference))
            line += f"  {med / plain:.2f}x of target only"
            print(line + ("" if same == len(reference) else f"  (text parts at token {same})"))


if __name__ == "__main__":
    main()
