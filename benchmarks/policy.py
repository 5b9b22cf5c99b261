"""The default draft-length policy vs target-only vs fixed k, side by side in one process.

    python benchmarks/policy.py                 # both PyPI models, prompt lookup and a self-pair
    python benchmarks/policy.py --per-category 1 -n 64 --models smollm2-135m --drafters prompt-lookup
    python benchmarks/policy.py --models qwen2.5-coder-1.5b --drafters model=qwen2.5-coder-0.5b,prompt-lookup
    python benchmarks/policy.py --models qwen2.5-coder-1.5b --drafters hybrid=qwen2.5-coder-0.5b

For every prompt of the report's built-in set (six kinds of work) it runs each setting back to back,
rotating the order per prompt, greedy, same seed, and prints generation tokens/s per category and the
ratio to target-only measured in the same rotation. Goals: policy >= 0.97x target-only in every
category; >= 1.3x on summarisation and qa for gemma-3-270m + prompt lookup. Acceptance estimates are
kept between runs as in the CLI: set SPECCHAT_HOME to a scratch folder to start from nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specchat.backend import LlamaCppBackend  # noqa: E402
from specchat.config import load_config  # noqa: E402
from specchat.drafters import Chain, DraftModel  # noqa: E402
from specchat.lookup import PromptLookup
from specchat.engine import Finished, generate  # noqa: E402
from specchat.loader import Loaded  # noqa: E402
from specchat.paths import cache_dir  # noqa: E402
from specchat.policy import FixedPolicy  # noqa: E402
from specchat.loader import make_policy
from specchat.report import load_prompts  # noqa: E402
from specchat.sampling import SamplingParams  # noqa: E402
from specchat.sources import resolve  # noqa: E402
from specchat.template import render  # noqa: E402


def prompt_ids(target, text: str) -> list[int]:
    """What `specchat chat` sends: the model's template, or the fallback transcript for a base model."""
    return render(target, [{"role": "user", "content": text}]).token_ids


def timed_run(target, drafter, ids, policy, n: int) -> tuple[float, list[int], float | None]:
    target.truncate(0)
    if drafter is not None and drafter.backend is not None:  # prompt lookup has no model
        drafter.backend.truncate(0)
    params = SamplingParams(temperature=0.0, banned=target.eog_tokens())
    finished = None
    for event in generate(target, drafter, ids, params, max_tokens=n, policy=policy):
        if isinstance(event, Finished):
            finished = event
    s = finished.stats
    return s.emitted / s.generate_seconds, finished.token_ids, s.acceptance_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=96)
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--per-category", type=int, default=2, help="prompts per category")
    parser.add_argument("--models", default="smollm2-135m,gemma-3-270m")
    parser.add_argument("--drafters", default="prompt-lookup,self")
    parser.add_argument("--fixed", default="4,8")
    parser.add_argument("--reps", type=int, default=2, help="rounds over every setting per prompt (median kept)")
    a = parser.parse_args()

    items, _ = load_prompts(None)
    by_cat: dict[str, list] = defaultdict(list)
    for item in items:
        if len(by_cat[item.category]) < a.per_category:
            by_cat[item.category].append(item)
    chosen = [item for cat in by_cat.values() for item in cat]
    print(f"# policy benchmark · {time.strftime('%Y-%m-%d %H:%M')} · {platform.processor() or platform.machine()} · "
          f"{os.cpu_count()} cores · threads {a.threads} · -n {a.n} --ignore-eos · greedy · "
          f"{len(chosen)} prompts ({a.per_category} per category) · {a.reps} rotating rounds, median")
    config = load_config()
    for model in a.models.split(","):
        path = resolve(config.model(model))
        target = LlamaCppBackend(path, n_ctx=2048, n_threads=a.threads, n_gpu_layers=0, name=model)
        draft_backend = None
        for kind in a.drafters.split(","):
            if kind == "self":
                draft_backend = draft_backend or LlamaCppBackend(path, n_ctx=2048, n_threads=a.threads, n_gpu_layers=0,
                                                                 name=model + "-draft")
                drafter = DraftModel.checked(draft_backend, target, p_min=0.75)
                label = "self-pair"
            elif kind.startswith(("model=", "hybrid=")):  # a real draft model, e.g. model=qwen2.5-coder-0.5b
                name = kind.split("=", 1)[1]
                other = LlamaCppBackend(resolve(config.model(name)), n_ctx=2048, n_threads=a.threads, n_gpu_layers=0,
                                        name=name)
                drafter = DraftModel.checked(other, target, p_min=0.75)
                label = name
                if kind.startswith("hybrid="):  # prompt lookup where it matches, the model otherwise
                    drafter, label = Chain([PromptLookup(1, 32), drafter]), f"prompt-lookup + {name}"
            else:
                drafter = PromptLookup(1, 32)
                label = "prompt-lookup"
            loaded = Loaded(target, drafter, config.model(model), None, label)
            settings = {"target-only": None, **{f"k={k}": int(k) for k in a.fixed.split(",")}, "policy": "policy"}
            tps: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
            # greedy runs can still part from target-only's text (a batch's logits flip a near-tie): then
            # their speeds time different work. Counted per setting: prompts whose text stayed the same.
            same_text: dict[str, int] = defaultdict(int)
            for i, item in enumerate(chosen):
                ids = prompt_ids(target, item.turns[0])
                speeds: dict[str, list[float]] = defaultdict(list)
                texts: dict[str, list[int]] = {}
                for rep in range(a.reps):
                    names = list(settings)
                    shift = (i + rep) % len(names)
                    names = names[shift:] + names[:shift]  # rotate who goes first
                    for name in names:
                        setting = settings[name]
                        if setting is None:
                            speed, text, _ = timed_run(target, None, ids, FixedPolicy(0), a.n)
                        elif setting == "policy":
                            # a fresh policy per run, as one `specchat prompt` gets it: costs are cached,
                            # acceptance estimates start from what earlier runs saved (SPECCHAT_HOME)
                            speed, text, _ = timed_run(target, drafter, ids, make_policy(loaded, 64, None), a.n)
                        else:
                            speed, text, _ = timed_run(target, drafter, ids, FixedPolicy(setting), a.n)
                        speeds[name].append(speed)
                        texts.setdefault(name, text)
                for name, values in speeds.items():
                    tps[item.category][name].append(statistics.median(values))
                    same_text[name] += texts[name] == texts["target-only"]
            print(f"\n## {model} + {label}   (tok/s, and ratio to target-only)")
            names = list(settings)
            print(f"{'category':<15}" + "".join(f"{n:>20}" for n in names))
            overall: dict[str, list[float]] = defaultdict(list)
            for cat, runs in tps.items():
                row = f"{cat:<15}"
                for name in names:
                    value = statistics.mean(runs[name])
                    ratios = [x / y for x, y in zip(runs[name], runs["target-only"])]
                    overall[name].extend(ratios)
                    row += f"{value:>11.1f} ({statistics.mean(ratios):4.2f}x)" if name != "target-only" else f"{value:>20.1f}"
                print(row)
            print(f"{'overall':<15}" + "".join(
                f"{'':>20}" if n == "target-only" else f"{'':>11}({statistics.geometric_mean(overall[n]):4.2f}x)"
                for n in names))
            print("same text as target-only (prompts): " + ", ".join(
                f"{n} {same_text[n]}/{len(chosen)}" for n in names if n != "target-only"))
        target.close()
        if draft_backend is not None:
            draft_backend.close()
    print(f"\ncost cache: {cache_dir() / 'costs.json'}")


if __name__ == "__main__":
    main()
