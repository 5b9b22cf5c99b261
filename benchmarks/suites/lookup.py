"""Prompt lookup on prompts nobody tuned it on: specchat vs llama.cpp's four n-gram drafters.

    python -m benchmarks lookup --single                    # 50 prompts, one pass (~25 s a prompt on 2 cores)
    python -m benchmarks lookup --single --batch-invariant  # both tools write the target's own text
    python -m benchmarks lookup --limit 1 --reps 1          # one prompt per kind, a quick look

Prompts: benchmarks/data/unseen_prompts.jsonl (Spec-Bench and HumanEvalFix items, 5 per kind; see
data/README.md), learned state from data/unseen_learning.jsonl (other items, same sources). gemma-3-270m (a
base model, raw text), greedy, -ngl 0, context 4096; replies may end at an end-of-generation token on both
sides (short replies count, and count that token as llama.cpp's `decoded` does).

Per prompt: llama-speculative-simple once per drafter (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod,
their defaults) to learn how many tokens each decodes (it stops only after the step that passes -n); then
--reps interleaved repetitions of the four drafters and of specchat at each of those counts, in three settings:
empty (the default: prompt lookup + adaptive policy, a fresh SPECCHAT_HOME holding only this machine's cost
calibration), learned (a copy of a home in which the learning set ran first, its replies in the reply
history) and target-only (--no-spec). "best" is the drafter of highest median tok/s; specchat's ratios are
taken at its token count. Short replies get more reps (--min-seconds, --max-reps), judged from the untimed
counting runs. --single: the counting runs are the timed ones and specchat runs once per setting.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import geomean, median

TITLE = "prompt lookup on unseen prompts vs llama.cpp's n-gram drafters"
DEFAULTS = {"n": 128, "threads": 2, "reps": 3, "model": "gemma-3-270m", "llama_dir": None, "jobs": None,
            "batch_invariant": False}
DRAFTERS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
MODES = ("empty", "learned", "target")
CTX = 4096


def options(p) -> None:
    p.add_argument("--single", action="store_true", help="one pass: 7 processes a prompt (see above)")
    p.add_argument("--min-seconds", type=float, default=2.0, help="more reps for short replies: about this much "
                   "decoding per setting")
    p.add_argument("--max-reps", type=int, default=15, help="the most reps a short reply gets")
    p.add_argument("--kinds", help="comma-separated kinds (default: all)")
    p.add_argument("--limit", type=int, help="prompts per kind (the first N)")
    p.add_argument("--learn-limit", type=int, help="learning prompts per kind (default: all)")
    p.add_argument("--keep", action="store_true", help="keep the scratch SPECCHAT_HOMEs")


def load_prompts(path: Path, kinds: list[str] | None, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if kinds:
        unknown = set(kinds) - {r["kind"] for r in rows}
        if unknown:
            raise SystemExit(f"unknown kinds {sorted(unknown)}; known: {sorted({r['kind'] for r in rows})}")
        rows = [r for r in rows if r["kind"] in kinds]
    if limit is not None:
        seen: dict[str, int] = {}
        kept = []
        for r in rows:
            seen[r["kind"]] = seen.get(r["kind"], 0) + 1
            if seen[r["kind"]] <= limit:
                kept.append(r)
        rows = kept
    return rows


@contextmanager
def in_home(home: Path):
    """specchat.paths under SPECCHAT_HOME=home in this process (to find its files, never to run a model)."""
    old = os.environ.get("SPECCHAT_HOME")
    os.environ["SPECCHAT_HOME"] = str(home)
    try:
        yield
    finally:
        if old is None:
            del os.environ["SPECCHAT_HOME"]
        else:
            os.environ["SPECCHAT_HOME"] = old


class Homes:
    """The SPECCHAT_HOMEs of the three settings, and a fresh copy of one per run."""

    def __init__(self, a, work: Path, common: list[str]):
        from specchat.paths import cache_dir

        self.a, self.work, self.common = a, work, common
        seed = work / "seed"
        with in_home(seed):
            costs = cache_dir() / "costs.json"
        costs.parent.mkdir(parents=True, exist_ok=True)
        mine = cache_dir() / "costs.json"  # the machine's own: the default build's costs (not the invariant one's)
        if mine.exists() and not a.batch_invariant:
            shutil.copy2(mine, costs)
        self.run("Question: What is 2 + 2?\nAnswer:", 8, seed, common, ignore_eos=True)  # measures what is missing
        for p in list(seed.rglob("*")):  # keep the calibration only: nothing learned
            if p.is_file() and p != costs:
                p.unlink()
        self.homes = {"empty": seed, "target": seed, "learned": self.learned(seed)}

    def run(self, prompt: str, n: int, home: Path, extra: list[str], ignore_eos: bool = False) -> dict:
        """harness.run_specchat, counting a reply's end-of-generation token as llama.cpp's `decoded` does."""
        r = harness.run_specchat(self.a.model, prompt, n=n, threads=self.a.threads, extra=extra,
                                 env=harness.specchat_env(home), ctx=CTX, ignore_eos=ignore_eos)
        if r["finish_reason"] == "eog" and r["seconds"] > 0:
            r["tps"] = (r["tokens"] + 1) / r["seconds"]
        return r

    def learned(self, seed: Path) -> Path:
        """The seed plus what the learning set teaches: each learning prompt run with the default policy, then
        their replies saved to the reply history the way `specchat report` saves its replies."""
        from specchat.history import save_replies

        home = self.work / "learned"
        shutil.copytree(seed, home)
        learning = load_prompts(harness.DATA / "unseen_learning.jsonl", None, self.a.learn_limit)
        texts = [self.run(r["prompt"], self.a.n, home, self.common)["text"] for r in learning]
        with in_home(home):
            if save_replies(texts, target=self.a.model, kind="report") is None:
                raise SystemExit("could not save the learning set's replies")
        return home

    def timed(self, mode: str, prompt: str, n: int) -> dict:
        home = Path(tempfile.mkdtemp(prefix="run-", dir=self.work))
        shutil.rmtree(home)
        shutil.copytree(self.homes[mode], home)
        try:
            return self.run(prompt, n, home, [*self.common, *(["--no-spec"] if mode == "target" else [])])
        finally:
            shutil.rmtree(home, ignore_errors=True)


def run_prompt(i: int, row: dict, a, binary: Path, model: Path, homes: Homes) -> dict:
    prompt = row["prompt"]

    def llama(t):
        return harness.run_llamacpp(binary, model, prompt, n=a.n, threads=a.threads, spec_type=t, ctx=CTX,
                                    ignore_eos=False, extra=homes.common)

    first = {t: llama(t) for t in DRAFTERS}
    lengths = {t: r["tokens"] for t, r in first.items()}
    seconds = median(r["seconds"] for r in first.values())
    reps = a.max_reps if not seconds > 0 else max(a.reps, min(a.max_reps, math.ceil(a.min_seconds / seconds)))
    ref: dict[str, list[float]] = {t: [] for t in DRAFTERS}
    ours: dict[str, dict[int, list[dict]]] = {m: {n: [] for n in sorted(set(lengths.values()))} for m in MODES}
    if a.single:  # the counting runs are the timed ones; specchat at the best drafter's count only
        for t in DRAFTERS:
            ref[t].append(first[t]["tps"])
        n_best = lengths[max(DRAFTERS, key=lambda t: ref[t][0])]
        for m in harness.rotate(MODES, i):
            ours[m] = {n_best: [homes.timed(m, prompt, n_best)]}
        reps = 1
    else:
        for rep in range(reps):
            for group in harness.rotate(("llama", "specchat"), i + rep):
                if group == "llama":
                    for t in DRAFTERS:
                        ref[t].append(llama(t)["tps"])
                    continue
                for n in ours["empty"]:
                    for m in harness.rotate(MODES, i + rep):
                        ours[m][n].append(homes.timed(m, prompt, n))
    med = {t: median(v) for t, v in ref.items()}
    best = max(DRAFTERS, key=lambda t: med[t])
    n_best = lengths[best]
    result = {"id": row["id"], "kind": row["kind"], "lengths": lengths, "llama_tps": med, "best": best, "n": n_best,
              "llama_eos": lengths[best] <= a.n, "timed_reps": reps}
    for m in MODES:
        runs = ours[m][n_best]
        mid = sorted(runs, key=lambda r: r["tps"])[len(runs) // 2]  # the median run's counts
        result[m] = {"tps": median(r["tps"] for r in runs), "reps": [r["tps"] for r in runs],
                     "tokens": mid["tokens"], "accepted": mid["accepted"], "drafted": mid["drafted"],
                     "steps": mid["steps"], "text": mid["text"],
                     # every run: a text can part from the best drafter's at a near-tie (`same`: how many tokens
                     # of its text the run's starts with)
                     "same": [harness.same_tokens(r["pieces"], first[best]["text"]) for r in runs]}
    for m in ("empty", "learned"):
        result[m]["vs_best"] = result[m]["tps"] / med[best]
        result[m]["vs_target"] = result[m]["tps"] / result["target"]["tps"]
    result["target"]["vs_best"] = result["target"]["tps"] / med[best]
    return result


def row_of(r: dict) -> list:
    e, l_ = r["empty"], r["learned"]
    return [r["kind"], r["id"], r["n"], "e" if r["llama_eos"] else "", *(r["llama_tps"][t] for t in DRAFTERS),
            r["best"].removeprefix("ngram-"), e["tps"], e["vs_best"], l_["tps"], l_["vs_best"], r["target"]["tps"],
            e["vs_target"], f"{e['accepted']}/{e['drafted']}/{e['steps']}", min(e["same"]), r["timed_reps"]]


COLUMNS = ["kind", "id", "n", "e", *(f"{t.removeprefix('ngram-')}:.1f" for t in DRAFTERS), "best", "empty:.1f",
           "/best:.2fx", "learned:.1f", "/best:.2fx", "target:.1f", "e/tgt:.2fx", "a/d/s", "same", "reps"]


def targets(results: list[dict], m: str) -> list:
    """Geometric mean and worst prompt against the best llama.cpp drafter and against target-only."""
    if not results:
        return [m, 0, None, None, "", None, None, ""]
    worst = min(results, key=lambda r: r[m]["vs_best"])
    worst_t = min(results, key=lambda r: r[m]["vs_target"])
    return [m, len(results), geomean(r[m]["vs_best"] for r in results), worst[m]["vs_best"], worst["id"],
            geomean(r[m]["vs_target"] for r in results), worst_t[m]["vs_target"], worst_t["id"]]


def summary(result: harness.Result, results: list[dict]) -> None:
    kinds = list(dict.fromkeys(r["kind"] for r in results))
    result.table("per kind, geometric means", ["kind", "prompts", "empty/best:.2fx", "learned/best:.2fx",
                                               "empty/target:.2fx", "best/target:.2fx"],
                 [[k, len(rs), geomean(r["empty"]["vs_best"] for r in rs), geomean(r["learned"]["vs_best"] for r in rs),
                   geomean(r["empty"]["vs_target"] for r in rs), geomean(1 / r["target"]["vs_best"] for r in rs)]
                  for k in kinds for rs in [[r for r in results if r["kind"] == k]]])
    # a greedy text can part from llama.cpp's at a near-tie: the targets again on the prompts where every run
    # of that setting wrote the best drafter's text
    rows = []
    for m in ("empty", "learned"):
        rows.append(targets(results, m))
        same = [r for r in results if all(s >= r[m]["tokens"] - 1 for s in r[m]["same"])]
        rows.append(targets(same, m + ", texts not parted"))
    result.table(f"overall, {len(results)} prompts", ["setting", "prompts", "vs best:.2fx", "worst:.2fx", "prompt",
                                                      "vs target:.2fx", "worst:.2fx", "prompt"], rows)


def run(a, result: harness.Result) -> None:
    prompts = load_prompts(harness.DATA / "unseen_prompts.jsonl",
                           [k.strip() for k in a.kinds.split(",")] if a.kinds else None, a.limit)
    binary = harness.tool(a, "llama-speculative-simple")
    common = ["-fa", "off"] if a.batch_invariant else []  # arguments both tools get
    model = harness.model_file(a.model)
    result.note(f"{a.model} · threads {a.threads} · -n {a.n} · ctx {CTX} · greedy · "
                f"{'one pass' if a.single else f'{a.reps}+ interleaved reps'} · {len(prompts)} prompts"
                + (" · batch-invariant build, -fa off on both sides" if a.batch_invariant else ""))
    results = []
    with harness.scratch("specchat-lookup-", keep=a.keep) as work:
        homes = Homes(a, work, common)
        try:
            for i, row in enumerate(prompts):
                started = time.perf_counter()
                results.append(run_prompt(i, row, a, binary, model, homes))
                print(f"{row['id']}: {results[-1]['empty']['vs_best']:.2f}x of {results[-1]['best']} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
        finally:
            result.keep("results", results)
            if results:
                result.note("tok/s (medians); n = tokens the best llama.cpp drafter decoded (e: its reply ended); "
                            "ratios at equal -n; a/d/s = accepted/drafted/steps; same = tokens of specchat's text "
                            "the best drafter's text starts with (fewest over runs)")
                result.table("per prompt", COLUMNS, [row_of(r) for r in results])
                summary(result, results)
