"""Prompt lookup against llama.cpp's n-gram drafters, replayed on fixed replies: the unseen-prompt benchmark
(lookup_unseen.py) without the machine's noise, in seconds instead of an hour, for working on the policy.

    python benchmarks/lookup_replay.py                         # 40 prompts (4 per kind), learning set too
    python benchmarks/lookup_replay.py --learning-as-eval      # tune here, then check on the 40 above
    python benchmarks/lookup_replay.py -v                      # per prompt

gemma-3-270m's greedy target-only reply to every prompt of benchmarks/data (raw text, up to -n tokens, ending
where the model ends it) is decoded once and cached (--replies). Then, on those token streams, each step is
billed at this machine's calibrated batch costs (the policy's costs.json) plus a fixed host time per step:

- empty / learned: specchat's adaptive policy and PromptLookup step by step, from nothing, or with the
  learning set's replies as the reply history, as lookup_unseen.py runs them;
- ngram-simple: llama.cpp's (common/ngram-map.cpp): the latest earlier occurrence of the last 12 tokens,
  its next 48 drafted (at least 12 available);
- ngram-mod: llama.cpp's (common/ngram-mod.cpp): a table of 24-gram -> next token, filled from the prompt
  and then from the reply in chunks of 32 tokens; drafts a chain of up to 64, none when shorter than 48;
- bound: the fastest schedule with perfect foresight over lookup's proposals (lookup_bound.py).

Ratios are to the better of the two llama.cpp drafters per prompt (ngram-map-k and -k4v are rarely best,
and not replayed) and to target-only. A replay assumes every run emits the target-only text and that
batches cost what the calibration measured: it ranks policies, it does not predict a real run's speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lookup_bound import agreeing, bound_seconds, proposals, replay_seconds  # noqa: E402
from lookup_unseen import CTX, DATA, MODEL, load_prompts  # noqa: E402

from specchat.backend import LlamaCppBackend  # noqa: E402
from specchat.config import load_config  # noqa: E402
from specchat.lookup import NgramHistory  # noqa: E402
from specchat.engine import Finished, generate  # noqa: E402
from specchat.paths import cache_dir  # noqa: E402
from specchat.costs import CostModel, cached_cost_model  # noqa: E402
from specchat.policy import FixedPolicy
from specchat.sampling import SamplingParams  # noqa: E402
from specchat.sources import resolve  # noqa: E402


def ngram_simple_seconds(prompt: list[int], reply: list[int], cost: CostModel, overhead: float,
                         size_n: int = 12, size_m: int = 48) -> float:
    context, i, seconds = list(prompt), 0, 0.0
    while i < len(reply):
        drafts: list[int] = []
        n = len(context)
        if n > size_n + size_m + 1:
            pattern = context[n - size_n :]
            for j in range(n - size_n - 1, 0, -1):  # latest first, position 0 never
                if context[j : j + size_n] == pattern:
                    if min(size_m, n - (j + size_n)) >= size_n:
                        drafts = context[j + size_n : j + size_n + size_m]
                    break
        accepted = agreeing(drafts, reply, i)
        seconds += cost(len(drafts) + 1) + overhead
        context += reply[i : i + accepted + 1]
        i += accepted + 1
    return seconds


def ngram_mod_seconds(prompt: list[int], reply: list[int], cost: CostModel, overhead: float,
                      n_match: int = 24, n_max: int = 64, n_min: int = 48) -> float:
    table: dict[tuple[int, ...], int] = {}
    context = list(prompt)

    def add(upto: int, start: int) -> None:
        for s in range(start, upto):
            table[tuple(context[s : s + n_match])] = context[s + n_match]

    added = 0
    if len(context) >= n_match:
        add(len(context) - n_match, 0)
        added = len(context) - n_match
    i, seconds = 0, 0.0
    while i < len(reply):
        if added + 32 < len(context):  # new n-grams in chunks, as llama.cpp adds them
            add(len(context) - n_match, added)
            added = len(context) - n_match
        chain = context[len(context) - n_match :]
        for _ in range(n_max):
            token = table.get(tuple(chain[-n_match:]))
            if token is None:
                break
            chain.append(token)
        drafts = chain[n_match:] if len(chain) - n_match >= n_min else []
        accepted = agreeing(drafts, reply, i)
        seconds += cost(len(drafts) + 1) + overhead
        context += reply[i : i + accepted + 1]
        i += accepted + 1
    return seconds


def decode_replies(rows: list[dict], path: Path, n: int, threads: int) -> dict[str, dict]:
    """{id: {prompt, reply}}: target-only greedy replies, from `path` when it has them all."""
    cached = json.loads(path.read_text()) if path.exists() else {}
    if all(r["id"] in cached and cached[r["id"]]["n"] >= n for r in rows):
        return cached
    target = LlamaCppBackend(resolve(load_config().model(MODEL)), n_ctx=CTX, n_threads=threads, n_gpu_layers=0,
                             name=MODEL)
    params = SamplingParams(temperature=0.0, banned=())  # ends where the model ends it, like the benchmark
    for r in rows:
        if r["id"] in cached and cached[r["id"]]["n"] >= n:
            continue
        prompt = target.tokenize(r["prompt"], add_special=True)
        target.truncate(0)
        for event in generate(target, None, prompt, params, max_tokens=n, policy=FixedPolicy(0)):
            if isinstance(event, Finished):
                cached[r["id"]] = {"prompt": prompt, "reply": event.token_ids, "n": n}
        print(f"  decoded {r['id']}: {len(cached[r['id']]['reply'])} tokens", file=sys.stderr, flush=True)
    target.close()
    path.write_text(json.dumps(cached))
    return cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=200, help="reply tokens (llama.cpp's drafters overshoot -n 128 to ~190)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=4, help="prompts per kind")
    parser.add_argument("--learning-as-eval", action="store_true",
                        help="replay the learning set, with the evaluation set as what was learned")
    parser.add_argument("--replies", type=Path, default=cache_dir() / "lookup_replay_replies.json")
    parser.add_argument("--overhead-ms", type=float, default=0.7, help="specchat's host time per step")
    parser.add_argument("--llama-overhead-ms", type=float, default=0.3, help="llama.cpp's host time per step")
    parser.add_argument("-v", "--verbose", action="store_true")
    a = parser.parse_args()
    evaluation = load_prompts(DATA / "unseen_prompts.jsonl", None, a.limit)
    learning = load_prompts(DATA / "unseen_learning.jsonl", None, None)
    if a.learning_as_eval:
        evaluation, learning = learning, evaluation
    a.replies.parent.mkdir(parents=True, exist_ok=True)
    replies = decode_replies(evaluation + learning, a.replies, a.n, a.threads)
    target = LlamaCppBackend(resolve(load_config().model(MODEL)), n_ctx=CTX, n_threads=a.threads, n_gpu_layers=0,
                             name=MODEL)
    cost = cached_cost_model(target, cache_dir() / "costs.json")
    target.close()
    ours, theirs = a.overhead_ms / 1e3, a.llama_overhead_ms / 1e3

    def replay(item: dict, history: NgramHistory | None) -> float:
        return replay_seconds(item["prompt"], item["reply"][: a.n], cost, ours, history=history)

    history = NgramHistory([replies[r["id"]]["reply"][: a.n] for r in learning])
    print(f"# lookup replay · {MODEL} · 1 token {cost(1) * 1e3:.1f} ms, 8: {cost(8) * 1e3:.1f} ms, "
          f"largest timed {cost.sizes[-1]}: {cost(cost.sizes[-1]) * 1e3:.1f} ms · overhead {a.overhead_ms} ms "
          f"(llama.cpp {a.llama_overhead_ms}) · {len(evaluation)} prompts, {len(learning)} learned")
    rows = []
    for r in evaluation:
        item = replies[r["id"]]
        prompt, reply = item["prompt"], item["reply"][: a.n]
        simple = ngram_simple_seconds(prompt, reply, cost, theirs)
        mod = ngram_mod_seconds(prompt, reply, cost, theirs)
        best = min(simple, mod)
        empty = replay(item, None)
        learned_seconds = replay(item, history)  # lookup's estimates are one conversation's: only replies carry
        plain = len(reply) * (cost(1) + ours)
        bound = bound_seconds(proposals(prompt, reply), reply, cost, ours)
        rows.append({"id": r["id"], "kind": r["kind"], "empty": best / empty, "learned": best / learned_seconds,
                     "empty/target": plain / empty, "learned/target": plain / learned_seconds, "bound": best / bound})
        if a.verbose:
            x = rows[-1]
            print(f"  {r['id']:<18}{len(reply):>4} tok  simple {len(reply) / simple:6.1f}  mod {len(reply) / mod:6.1f}  "
                  f"empty {x['empty']:.2f}x  learned {x['learned']:.2f}x  bound {x['bound']:.2f}x  (of the better drafter)")
    kinds = list(dict.fromkeys(x["kind"] for x in rows))
    print(f"\n{'':<14}" + "".join(f"{k[:12]:>13}" for k in kinds) + f"{'overall':>10}{'worst':>7}{'<0.9':>6}{'<0.97':>6}")
    for key in ("empty", "learned", "empty/target", "learned/target", "bound"):
        per_kind = [statistics.geometric_mean([x[key] for x in rows if x["kind"] == k]) for k in kinds]
        values = [x[key] for x in rows]
        print(f"{key:<14}" + "".join(f"{v:>12.2f}x" for v in per_kind) + f"{statistics.geometric_mean(values):>9.2f}x"
              f"{min(values):>6.2f}x{sum(v < 0.9 for v in values):>6}{sum(v < 0.97 for v in values):>6}")
    print("(empty, learned, bound: to the better llama.cpp drafter per prompt; /target: to target-only)")


if __name__ == "__main__":
    main()
