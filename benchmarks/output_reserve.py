"""A process's first reply with and without the target's logits rows reserved at load (backend.outputs_to_reserve).

    python benchmarks/output_reserve.py                  # 6 unseen prompts, 4 fresh processes per setting
    python benchmarks/output_reserve.py --reps 6 --ids code-editing-1,chat-3

llama.cpp sizes its output buffer to the largest batch's logits rows so far and reallocates it at each
growth; each reallocation is fresh memory that the next decode faults in again (1 MiB a row at gemma's 262k
vocabulary). Prompt lookup's verify batches grow as a copy goes on (8, 16, 40, 48, 64 rows), so a one-shot
`specchat prompt` paid every growth. Since this change a drafting target reserves --draft-max + 1 rows when
its context is created, once.

Each run is a fresh process (gemma-3-270m, 2 threads, greedy, -n 177, prompt lookup with the adaptive
policy, the machine's cached cost calibration), as `specchat prompt` runs: `outputs=1` is the old load,
`outputs=65` the new one. The settings alternate, run by run. Reported: generation seconds (median, and
the runs), steps, the minor page faults taken while generating (median: memory touched for the first
time), and whether both settings emitted the same tokens (they may not past gemma's 1024-token window
cache: reserved, it is the full-size one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from lookup_unseen import CTX, DATA, MODEL, load_prompts  # noqa: E402

RUNNER = r"""
import json, resource, sys
from specchat.backend import LlamaCppBackend
from specchat.config import load_config
from specchat.lookup import PromptLookup
from specchat.engine import Finished, generate
from specchat.paths import cache_dir
from specchat.costs import cached_cost_model
from specchat.policy import DRAFT_MAX, AdaptivePolicy
from specchat.sampling import SamplingParams
from specchat.sources import resolve
model, ctx, outputs, prompt, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
target = LlamaCppBackend(resolve(load_config().model(model)), n_ctx=ctx, n_threads=2, n_gpu_layers=0, name=model,
                         outputs=outputs)
lookup = PromptLookup(1, 32)
policy = AdaptivePolicy(lookup, cached_cost_model(target, cache_dir() / "costs.json"), draft_max=DRAFT_MAX)
ids = target.tokenize(prompt, add_special=True)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for event in generate(target, lookup, ids, SamplingParams(temperature=0.0, banned=()), max_tokens=n,
                      policy=policy):
    if isinstance(event, Finished):
        s = event.stats
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(json.dumps({"seconds": s.generate_seconds, "steps": s.steps, "tokens": event.token_ids, "faults": faults,
                          "reserved": target.reserved_outputs}))
"""


def run(prompt: str, outputs: int, n: int) -> dict:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    out = subprocess.run([sys.executable, "-c", RUNNER, MODEL, str(CTX), str(outputs), prompt, str(n)],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise SystemExit(f"run failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", default="code-editing-1,summarisation-3,qa-context-2,maths-1,extraction-3,chat-4")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("-n", type=int, default=177)
    a = parser.parse_args()
    rows = {r["id"]: r for r in load_prompts(DATA / "unseen_prompts.jsonl", None, None)}
    ids = a.ids.split(",")
    unknown = [i for i in ids if i not in rows]
    if unknown:
        raise SystemExit(f"unknown prompt ids: {', '.join(unknown)}")
    print(f"# first reply of a fresh process · {MODEL} · 2 threads · greedy · -n {a.n} · prompt lookup, adaptive "
          f"policy · {a.reps} processes per setting, alternating")
    print(f"{'prompt':<18}{'outputs=1 s':>12}{'outputs=65 s':>14}{'ratio':>8}{'steps':>8}{'faults 1':>10}"
          f"{'faults 65':>10}  same   runs (1 | 65)")
    ratios = []
    for pid in ids:
        runs: dict[int, list[dict]] = {1: [], 65: []}
        for rep in range(a.reps):
            for outputs in ((1, 65) if rep % 2 == 0 else (65, 1)):
                runs[outputs].append(run(rows[pid]["prompt"], outputs, a.n))
        old = statistics.median(r["seconds"] for r in runs[1])
        new = statistics.median(r["seconds"] for r in runs[65])
        same = all(r["tokens"] == runs[1][0]["tokens"] for r in runs[1] + runs[65])
        ratios.append(old / new)
        spread = " | ".join(" ".join(f"{r['seconds']:.2f}" for r in runs[o]) for o in (1, 65))
        faults = {o: int(statistics.median(r["faults"] for r in runs[o])) for o in runs}
        print(f"{pid:<18}{old:>12.3f}{new:>14.3f}{old / new:>7.2f}x{runs[65][0]['steps']:>8}{faults[1]:>10}"
              f"{faults[65]:>10}  {'yes' if same else 'NO':<5}  {spread}")
    print(f"geometric mean speed-up of the reservation: {statistics.geometric_mean(ratios):.3f}x over {len(ids)} "
          f"prompts (reserved rows in the new runs: {runs[65][0]['reserved']})")


if __name__ == "__main__":
    main()
