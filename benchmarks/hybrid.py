"""Hybrid and recurrent targets: specchat against llama.cpp's own speculative decoding on the same files.

    python benchmarks/hybrid.py                        # all four architectures, this checkout only
    python benchmarks/hybrid.py --before d299ce1       # and the code as it was at that commit, side by side
    python benchmarks/hybrid.py --llama-bin PATH       # an already built llama-speculative-simple

For each architecture (llama as the dense control; lfm2 and qwen35, whose recurrent state keeps snapshots;
mamba2, which has none), tests/tiny_models.py writes a target (4 layers, width 512: a few ms a token, so
the loops' own costs do not drown in the machine's jitter) whose blocks make the context matter, and a
cleaner one-layer draft of the same architecture (same embeddings and successor map). The prompt is ~600
tokens of the models' own repetitive text. Greedy, --ignore-eos, 2 threads, 128 tokens. Each row is the
median of --reps fresh processes, the runs of one architecture interleaved:

- specchat: a draft model at forced k = 4 (draft p-min 0, as llama.cpp's default) and with the adaptive
  policy; prompt lookup at forced k = 4 and with the policy; target only. Reported: generation tokens/s,
  drafted/accepted, the cache cuts that had to re-read the conversation (target + draft model), and the
  tokens each model evaluated (a re-read shows up there as thousands).
- llama.cpp: `llama-speculative-simple --spec-type draft-simple --spec-draft-n-max 4 --spec-draft-n-min 4`
  and `--spec-type ngram-simple` (its defaults), built from the sdist of the installed llama-cpp-python.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import tiny_models  # noqa: E402

N_PROMPT = 600

# One run in a fresh process, importing specchat from the directory on PYTHONPATH: the same script serves
# the code before and after a change (it uses only what both have).
RUNNER = r"""
import json, sys, time
from specchat.config import load_config
from specchat.lookup import PromptLookup
from specchat.engine import generate, Finished
from specchat.loader import LoadOptions, Selection, load
from specchat.policy import FixedPolicy
from specchat.loader import make_policy
from specchat.sampling import SamplingParams
target, draft, mode, prompt, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
drafter_ref = None if mode == "target" else ("prompt-lookup" if mode.startswith("lookup") else draft)
opts = LoadOptions(n_ctx=2048, n_threads=2, n_gpu_layers=0, n_gpu_layers_draft=0, draft_p_min=0.0,
                   lookup_history=False)
loaded = load(load_config(), Selection(target, drafter_ref), opts)
policy = FixedPolicy(0)
if mode.endswith("k4"):
    policy = FixedPolicy(4)
elif mode.endswith("policy"):
    policy = make_policy(loaded, 64, None, remember=False)
ids = loaded.target.tokenize(prompt, add_special=True)
backends = [loaded.target] + ([loaded.drafter.backend] if loaded.drafter is not None and loaded.drafter.backend is not None else [])
params = SamplingParams(temperature=0.0, banned=loaded.target.eog_tokens())
finished = [e for e in generate(loaded.target, loaded.drafter, ids, params, max_tokens=n, policy=policy)][-1]
s = finished.stats
print(json.dumps({
    "tps": s.tokens_per_second, "tokens": s.emitted, "steps": s.steps, "drafted": s.drafted, "accepted": s.accepted,
    "rereads": sum(b.rollback_recoveries for b in backends),
    "evaluated": [b.evaluated for b in backends], "prompt": len(ids),
    "memory": [getattr(getattr(b, "memory", None), "kind", "?") for b in backends],
}))
"""

MODES = ("draft-k4", "draft-policy", "lookup-k4", "lookup-policy", "target")


def run_specchat(code: Path, home: Path, target: Path, draft: Path, mode: str, prompt: str, n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "SPECCHAT_HOME": str(home)}
    out = subprocess.run([sys.executable, "-c", RUNNER, str(target), str(draft), mode, prompt, str(n)],
                         capture_output=True, text=True, timeout=900, env=env, cwd=code)
    if out.returncode != 0:
        raise RuntimeError(f"specchat ({code}) failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llamacpp(binary: Path, target: Path, draft: Path, spec: str, prompt: str, n: int,
                 extra: tuple[str, ...] = ()) -> dict:
    """One llama-speculative-simple run; `extra` goes last (a repeated option's last value wins: -ngl, -t)."""
    args = [str(binary), "-m", str(target), "-p", prompt, "-n", str(n), "-t", "2", "-c", "2048", "--temp", "0",
            "--top-k", "1", "-s", "1", "--ignore-eos", "-ngl", "0", "--spec-type", spec]
    if spec == "draft-simple":
        args += ["-md", str(draft), "-ngld", "0", "-td", "2", "--spec-draft-n-max", "4", "--spec-draft-n-min", "4",
                 "--spec-draft-p-min", "0"]
    out = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"llama.cpp failed ({out.returncode}):\n{log[-3000:]}")
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    return {"tps": float(m.group(3)), "tokens": int(m.group(1)),
            "drafted": int(drafted.group(1)) if drafted else None, "accepted": int(accepted.group(1)) if accepted else None}


def repetitive_prompt(target: Path, arch: str) -> str:
    """~N_PROMPT tokens of the models' own text: the bigram chain, the cycle repeated with a few detours."""
    import llama_cpp

    chain = tiny_models.bigram_chain(int(tiny_models.cycle_tokens()[0]), N_PROMPT)
    llm = llama_cpp.Llama(str(target), vocab_only=True, verbose=False)
    try:
        return llm.detokenize(chain).decode("utf-8", "replace").strip()
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default=",".join(tiny_models.ARCHS))
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--before", help="a git revision: run its code too, side by side")
    ap.add_argument("--llama-bin", type=Path, help="llama-speculative-simple (default: build it once)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=4)
    a = ap.parse_args()

    binary = a.llama_bin
    if binary is None:
        from vs_llamacpp import build

        binary = build(2)
    work = Path(tempfile.mkdtemp(prefix="specchat-hybrid-"))
    codes = {"after": ROOT}
    if a.before:
        before = work / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), a.before], check=True,
                       capture_output=True)
        codes = {"before": before, **codes}
    try:
        for arch in a.archs.split(","):
            models = work / "models"
            size = dict(n_embd=a.n_embd, n_layer=a.n_layer)
            target = tiny_models.write_model(models / f"{arch}-target.gguf", arch,
                                             context=tiny_models.TARGET_CONTEXT[arch], **size)
            draft = tiny_models.write_model(models / f"{arch}-draft.gguf", arch, context=tiny_models.DRAFT_CONTEXT[arch],
                                            n_embd=a.n_embd, n_layer=1 if arch in ("llama", "mamba2") else 2)
            prompt = repetitive_prompt(target, arch)
            print(f"\n## {arch}: {a.n_layer} layers x {a.n_embd} target, a smaller draft, prompt {N_PROMPT} tokens, "
                  f"-n {a.n}, median of {a.reps}")
            print(f"{'run':<30}{'tok/s':>8}{'drafted':>9}{'accepted':>9}{'re-reads':>9}  evaluated (target, draft)")
            runs: dict[tuple, list] = {}
            for _ in range(a.reps):
                for label, code in codes.items():
                    for mode in a.modes.split(","):
                        r = run_specchat(code, work / f"home-{label}", target, draft, mode, prompt, a.n)
                        runs.setdefault(("specchat", label, mode), []).append(r)
                for spec in ("draft-simple", "ngram-simple"):
                    runs.setdefault(("llama.cpp", spec), []).append(run_llamacpp(binary, target, draft, spec, prompt, a.n))
            median = {key: sorted(rs, key=lambda r: r["tps"])[len(rs) // 2] for key, rs in runs.items()}
            for label in codes:
                for mode in a.modes.split(","):
                    r = median[("specchat", label, mode)]
                    print(f"{'specchat ' + label + ' ' + mode:<30}{r['tps']:>8.1f}{r['drafted']:>9}{r['accepted']:>9}"
                          f"{r['rereads']:>9}  {r['evaluated']}  memory {'/'.join(r['memory'])}")
            for spec, mode in (("draft-simple", "draft-k4"), ("ngram-simple", "lookup-policy")):
                r = median[("llama.cpp", spec)]
                ours = median[("specchat", "after", mode)]
                print(f"{'llama.cpp ' + spec:<30}{r['tps']:>8.1f}{r['drafted'] or '-':>9}{r['accepted'] or '-':>9}"
                      f"{'':>9}  specchat {mode} / llama.cpp = {ours['tps'] / r['tps']:.2f}x", flush=True)
    finally:
        if a.before:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "before")],
                           capture_output=True)


if __name__ == "__main__":
    main()
