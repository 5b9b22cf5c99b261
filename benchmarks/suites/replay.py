"""Prompt lookup replayed on fixed replies: the `lookup` suite without the machine's noise, in seconds, for
working on the policy and its constants.

    python -m benchmarks replay                   # the 40 evaluation prompts (4 per kind), the learning set as history
    python -m benchmarks replay --learning-as-eval  # tune on the learning set, then check on the 40 above
    python -m benchmarks replay --ablate          # each lookup constant at a neutral value, dev and eval sets
    python -m benchmarks replay --ablate --flat   # the same on a GPU's costs at batch 1 (k tokens cost about one)

gemma-3-270m's greedy target-only reply to every prompt of benchmarks/data (raw text, up to -n tokens, ending
where the model ends it) is decoded once and cached in the cache dir. Then, on those token streams, each step
is billed at this machine's calibrated batch costs (the policy's costs.json) plus a fixed host time per step:

- empty / learned: specchat's adaptive policy and PromptLookup step by step (costs given, not learned from a
  clock), from no history or with the other set's replies as the history;
- ngram-simple / ngram-mod: ports of llama.cpp's two drafters (ngram-simple: the latest earlier 12-gram,
  its next 48 drafted; ngram-mod: a table of 24-gram -> next token filled in chunks of 32, chains of 48-64);
- bound: the fastest schedule with perfect foresight over lookup's proposals (any timed-size prefix at each
  position): no draft-length policy for this lookup can beat it.

Ratios are to the better of the two llama.cpp drafters per prompt and to target-only. A replay assumes every
run emits the target-only text and that batches cost what the calibration measured: it ranks policies, it
does not predict a real run's speed.
"""

from __future__ import annotations

import json
import statistics
import sys

from benchmarks import harness
from benchmarks.harness import geomean
from benchmarks.suites.lookup import CTX, load_prompts

TITLE = "prompt lookup replayed on fixed replies"
DEFAULTS = {"n": 200, "threads": 2, "model": "gemma-3-270m"}
# each constant at a value that switches its rule off (or to the plain policy's)
NEUTRAL = {"LOOKUP_MARGIN": 1.0, "HISTORY_FIRST": 1 << 10, "FRESH_FIRST": 1 << 10, "HISTORY_LEAD": 0,
           "HISTORY_MIN": 1}


def options(p) -> None:
    p.add_argument("--limit", type=int, default=4, help="evaluation prompts per kind")
    p.add_argument("--learning-as-eval", action="store_true", help="replay the learning set, with the "
                   "evaluation set as what was learned")
    p.add_argument("--ablate", action="store_true", help="the constants ablated (see above)")
    p.add_argument("--flat", action="store_true", help="bill batches as a GPU at batch 1 does (k tokens ~ one)")
    p.add_argument("--overhead-ms", type=float, default=0.7, help="specchat's host time per step")
    p.add_argument("--llama-overhead-ms", type=float, default=0.3, help="llama.cpp's host time per step")
    p.add_argument("-v", "--verbose", action="store_true", help="every prompt")


def agreeing(proposal: list[int], reply: list[int], at: int) -> int:
    """How many of the proposal's tokens the reply continues with from position `at`."""
    n = 0
    for token, actual in zip(proposal, reply[at:]):
        if token != actual:
            break
        n += 1
    return n


def bound_seconds(prompt: list[int], reply: list[int], cost, overhead: float) -> float:
    """The fastest schedule: T[i] = min over sendable d of cost(d + 1) + overhead + T[i + accepted + 1]."""
    import numpy as np

    from specchat.lookup import PromptLookup

    lookup = PromptLookup(1, 32)
    props = [lookup.find(np.asarray(prompt + reply[:i], dtype=np.int64), 64)[0] for i in range(len(reply))]
    n = len(reply)
    costs, sendable = cost.costs(65), cost.sendable(65)
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        right = agreeing(props[i], reply, i)
        t = costs[1] + overhead + best[i + 1]
        for d in range(1, min(len(props[i]), n - i - 1, 63) + 1):
            if sendable[d + 1]:
                t = min(t, costs[d + 1] + overhead + best[min(n, i + min(d, right) + 1)])
        best[i] = t
    return best[0]


def policy_seconds(prompt: list[int], reply: list[int], cost, overhead: float, history=None) -> float:
    """The adaptive policy's time on this reply: the engine's draft / observe loop, each step billed at the
    calibrated cost of its batch. `history`: earlier replies lookup may copy from."""
    from specchat.costs import CostModel
    from specchat.lookup import PromptLookup
    from specchat.policy import AdaptivePolicy
    from specchat.sampling import SamplingParams
    from specchat.stats import StepStats

    lookup = PromptLookup(1, 32, history=history)
    # the costs as given and the host time fixed: a replay has no clock to learn them from
    policy = AdaptivePolicy(lookup, CostModel(cost.sizes, cost.seconds, measured=True), draft_max=64,
                            learn_costs=False)
    policy.overhead = overhead
    context, i, seconds = list(prompt), 0, 0.0
    lookup.prefill(context)
    greedy = SamplingParams(temperature=0.0)
    while i < len(reply):
        drafts = policy.draft(lookup, context, len(reply) - i - 1, greedy, None).tokens
        accepted = agreeing(drafts, reply, i)
        emitted = reply[i : i + accepted + 1]
        step_seconds = cost(len(drafts) + 1)
        seconds += step_seconds + overhead
        policy.observe(StepStats(step=0, drafted=len(drafts), accepted=accepted, emitted=len(emitted),
                                 draft_seconds=0.0, verify_seconds=step_seconds), emitted)
        context += emitted
        i += len(emitted)
    policy.finish()
    return seconds


def ngram_simple_seconds(prompt: list[int], reply: list[int], cost, overhead: float, size_n: int = 12,
                         size_m: int = 48) -> float:
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


def ngram_mod_seconds(prompt: list[int], reply: list[int], cost, overhead: float, n_match: int = 24,
                      n_max: int = 64, n_min: int = 48) -> float:
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


def decode_replies(a, rows: list[dict]) -> dict[str, dict]:
    """{id: {prompt, reply}}: target-only greedy replies, kept in the cache dir once decoded."""
    from specchat.backend import LlamaCppBackend
    from specchat.engine import Finished, generate
    from specchat.paths import cache_dir
    from specchat.policy import FixedPolicy
    from specchat.sampling import SamplingParams

    path = cache_dir() / "lookup_replay_replies.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    missing = [r for r in rows if r["id"] not in cached or cached[r["id"]]["n"] < a.n]
    if missing:
        target = LlamaCppBackend(harness.model_file(a.model), n_ctx=CTX, n_threads=a.threads, n_gpu_layers=0,
                                 name=a.model)
        params = SamplingParams(temperature=0.0, banned=())  # ends where the model ends it, like `lookup`
        for r in missing:
            prompt = target.tokenize(r["prompt"], add_special=True)
            target.truncate(0)
            for event in generate(target, None, prompt, params, max_tokens=a.n, policy=FixedPolicy(0)):
                if isinstance(event, Finished):
                    cached[r["id"]] = {"prompt": prompt, "reply": event.token_ids, "n": a.n}
            print(f"  decoded {r['id']}: {len(cached[r['id']]['reply'])} tokens", file=sys.stderr, flush=True)
        target.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached))
    return cached


def score(a, rows: list[dict], learned: list[dict], replies: dict, cost) -> list[dict]:
    """Per prompt: specchat's speed from an empty history and with `learned`'s replies as the history, to the
    better llama.cpp drafter, and to target-only; the bound to the better drafter."""
    from specchat.lookup import NgramHistory

    ours, theirs = a.overhead_ms / 1e3, a.llama_overhead_ms / 1e3
    history = NgramHistory([replies[r["id"]]["reply"][: a.n] for r in learned])
    out = []
    for r in rows:
        prompt, reply = replies[r["id"]]["prompt"], replies[r["id"]]["reply"][: a.n]
        best = min(ngram_simple_seconds(prompt, reply, cost, theirs), ngram_mod_seconds(prompt, reply, cost, theirs))
        empty = policy_seconds(prompt, reply, cost, ours)
        learned_s = policy_seconds(prompt, reply, cost, ours, history)
        plain = len(reply) * (cost(1) + ours)
        out.append({"id": r["id"], "kind": r["kind"], "tokens": len(reply), "empty": best / empty,
                    "learned": best / learned_s, "empty/target": plain / empty, "learned/target": plain / learned_s,
                    **({} if a.ablate else {"bound": best / bound_seconds(prompt, reply, cost, ours)})})
    return out


def costs(a):
    from specchat.backend import LlamaCppBackend
    from specchat.costs import CostModel, cached_cost_model
    from specchat.paths import cache_dir

    if a.flat:
        return CostModel([1, 2, 4, 8, 16, 32, 64], [0.020, 0.0202, 0.0205, 0.021, 0.022, 0.024, 0.028], measured=True)
    target = LlamaCppBackend(harness.model_file(a.model), n_ctx=CTX, n_threads=a.threads, n_gpu_layers=0, name=a.model)
    try:
        return cached_cost_model(target, cache_dir() / "costs.json")
    finally:
        target.close()


def ablate(a, result: harness.Result, evaluation, development, replies, cost) -> None:
    import specchat.lookup as lookup

    tuned = {name: getattr(lookup, name) for name in NEUTRAL}
    rows = []
    try:
        for label, change in [("as tuned", {}), *((f"{k}={v}", {k: v}) for k, v in NEUTRAL.items())]:
            for name, value in {**tuned, **change}.items():
                setattr(lookup, name, value)
            row = [label]
            for got in (score(a, development, evaluation, replies, cost), score(a, evaluation, development, replies, cost)):
                for key in ("empty", "learned", "empty/target"):
                    row += [geomean(x[key] for x in got), min(x[key] for x in got)]
            rows.append(row)
            print(f"{label}: done", file=sys.stderr, flush=True)
    finally:
        for name, value in tuned.items():
            setattr(lookup, name, value)
    result.table(f"lookup constants ablated · dev {len(development)} prompts, eval {len(evaluation)} · geomean "
                 "(worst)", ["constant", *(c for s in ("dev", "eval") for k in ("empty", "learned", "/target")
                                           for c in (f"{s} {k}:.3fx", "(worst):.2f"))], rows)


def run(a, result: harness.Result) -> None:
    evaluation = load_prompts(harness.DATA / "unseen_prompts.jsonl", None, a.limit)
    learning = load_prompts(harness.DATA / "unseen_learning.jsonl", None, None)
    if a.learning_as_eval:
        evaluation, learning = learning, evaluation
    replies = decode_replies(a, evaluation + learning)
    cost = costs(a)
    result.note(f"{a.model} replies · 1 token {cost(1) * 1e3:.1f} ms, 8: {cost(8) * 1e3:.1f} ms"
                f"{' (--flat)' if a.flat else ''} · host time {a.overhead_ms} ms a step (llama.cpp "
                f"{a.llama_overhead_ms}) · {len(evaluation)} prompts, {len(learning)} learned")
    if a.ablate:
        ablate(a, result, evaluation, learning, replies, cost)
        return
    rows = score(a, evaluation, learning, replies, cost)
    result.keep("prompts", rows)
    if a.verbose:
        result.table("per prompt", ["id", "tokens", "empty:.2fx", "learned:.2fx", "bound:.2fx"],
                     [[x["id"], x["tokens"], x["empty"], x["learned"], x["bound"]] for x in rows])
    kinds = list(dict.fromkeys(x["kind"] for x in rows))
    table = []
    for key in ("empty", "learned", "empty/target", "learned/target", "bound"):
        values = [x[key] for x in rows]
        table.append([key, *(statistics.geometric_mean([x[key] for x in rows if x["kind"] == k]) for k in kinds),
                      statistics.geometric_mean(values), min(values), sum(v < 0.9 for v in values),
                      sum(v < 0.97 for v in values)])
    result.table("geometric means per kind (empty, learned, bound: to the better llama.cpp drafter per prompt; "
                 "/target: to target-only)", ["", *(f"{k}:.2fx" for k in kinds), "overall:.2fx", "worst:.2fx", "<0.9",
                                               "<0.97"], table)
