"""Which of prompt lookup's tuning constants pull their weight: each set to a neutral value in turn, replayed
(lookup_replay.py: fixed target-only replies, each step billed at the calibrated batch costs) on the
development set (benchmarks/data/unseen_learning.jsonl, where the constants were tuned) and on the evaluation
set (unseen_prompts.jsonl, held out).

    python benchmarks/lookup_ablation.py                  # this machine's calibrated costs (costs.json)
    python benchmarks/lookup_ablation.py --flat           # a GPU at batch 1: k tokens cost about one

Per set: the geometric mean over prompts of specchat's speed relative to the better of llama.cpp's
ngram-simple and ngram-mod, from an empty history and with the other set's replies as the history (learned),
and relative to target-only; in brackets the worst prompt. A
constant whose neutral value scores the same on the evaluation set does nothing there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lookup_replay  # noqa: E402
from lookup_bound import replay_seconds  # noqa: E402
from lookup_unseen import CTX, DATA, MODEL, load_prompts  # noqa: E402

import specchat.lookup as lookup  # noqa: E402
from specchat.backend import LlamaCppBackend  # noqa: E402
from specchat.config import load_config  # noqa: E402
from specchat.costs import CostModel, cached_cost_model  # noqa: E402
from specchat.lookup import NgramHistory  # noqa: E402
from specchat.paths import cache_dir  # noqa: E402
from specchat.sources import resolve  # noqa: E402

# each constant at a value that switches its rule off (or to the plain policy's)
NEUTRAL = {
    "LOOKUP_MARGIN": 1.0,
    "HISTORY_FIRST": 1 << 10,
    "FRESH_FIRST": 1 << 10,
    "HISTORY_LEAD": 0,
    "HISTORY_MIN": 1,
}


def score(rows: list[dict], learned: list[dict], replies: dict, cost: CostModel, n: int, ours: float,
          theirs: float) -> dict:
    """(geomean, worst) of: to llama.cpp's better drafter from an empty history, the same with `learned`'s
    replies as the history, to target-only from empty."""
    history = NgramHistory([replies[r["id"]]["reply"][:n] for r in learned])
    ratios: dict[str, list[float]] = {"empty": [], "learned": [], "target": []}
    for r in rows:
        item = replies[r["id"]]
        prompt, reply = item["prompt"], item["reply"][:n]
        best = min(lookup_replay.ngram_simple_seconds(prompt, reply, cost, theirs),
                   lookup_replay.ngram_mod_seconds(prompt, reply, cost, theirs))
        seconds = replay_seconds(prompt, reply, cost, ours)
        ratios["empty"].append(best / seconds)
        ratios["learned"].append(best / replay_seconds(prompt, reply, cost, ours, history=history))
        ratios["target"].append(len(reply) * (cost(1) + ours) / seconds)
    return {key: (statistics.geometric_mean(v), min(v)) for key, v in ratios.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=200, help="reply tokens")
    ap.add_argument("--flat", action="store_true", help="bill batches as a GPU at batch 1 does (k tokens ~ one)")
    ap.add_argument("--overhead-ms", type=float, default=0.7, help="specchat's host time per step")
    ap.add_argument("--llama-overhead-ms", type=float, default=0.3, help="llama.cpp's host time per step")
    ap.add_argument("--replies", type=Path, default=cache_dir() / "lookup_replay_replies.json")
    a = ap.parse_args()
    if a.n < 1:
        ap.error("-n must be at least 1")
    evaluation = load_prompts(DATA / "unseen_prompts.jsonl", None, 4)
    development = load_prompts(DATA / "unseen_learning.jsonl", None, None)
    replies = lookup_replay.decode_replies(evaluation + development, a.replies, a.n, 2)
    if a.flat:
        cost = CostModel([1, 2, 4, 8, 16, 32, 64], [0.020, 0.0202, 0.0205, 0.021, 0.022, 0.024, 0.028], measured=True)
    else:
        target = LlamaCppBackend(resolve(load_config().model(MODEL)), n_ctx=CTX, n_threads=2, name=MODEL)
        cost = cached_cost_model(target, cache_dir() / "costs.json")
        target.close()
    ours, theirs = a.overhead_ms / 1e3, a.llama_overhead_ms / 1e3
    print(f"# lookup constants ablated · {MODEL} replies · 1 token {cost(1) * 1e3:.1f} ms, 8: {cost(8) * 1e3:.1f} ms "
          f"· dev {len(development)} prompts, eval {len(evaluation)} · geomean (worst)")
    print(f"{'':<22}" + "".join(f"{s + ' ' + k:>17}" for s in ("dev", "eval") for k in ("empty", "learned", "/target")))
    tuned = {name: getattr(lookup, name) for name in NEUTRAL}
    for label, change in [("as tuned", {}), *((f"{k}={v}", {k: v}) for k, v in NEUTRAL.items())]:
        for name, value in {**tuned, **change}.items():
            setattr(lookup, name, value)
        dev = score(development, evaluation, replies, cost, a.n, ours, theirs)
        ev = score(evaluation, development, replies, cost, a.n, ours, theirs)
        print(f"{label:<22}" + "".join(f"{f'{g:.3f}x ({w:.2f})':>17}" for d in (dev, ev) for g, w in d.values()),
              flush=True)
    for name, value in tuned.items():
        setattr(lookup, name, value)


if __name__ == "__main__":
    main()
