"""How close prompt lookup's draft-length policy comes to the best any policy could do, replayed without noise.

    python benchmarks/lookup_bound.py                      # both PyPI models, the report's prompts
    python benchmarks/lookup_bound.py --models gemma-3-270m --prompts vs-llamacpp -n 190

For each prompt the target's greedy reply is decoded once (target-only, a real run). Then, on that token
stream, with the batch costs this machine measured (the policy's cost cache) and a fixed per-step overhead:

- policy: the real AdaptivePolicy and PromptLookup step by step. A step costs the measured cost of its
  batch; its drafts are accepted as far as they match the reply. Estimates are carried from prompt to
  prompt as `specchat prompt` carries them, after one warm-up pass over every prompt (a process that has
  seen the prompts before, as in the benchmarks).
- bound: the fastest schedule with perfect foresight. At every position it may send any prefix of
  lookup's proposal of a timed batch size, or nothing (dynamic programming over positions). No policy
  choosing draft lengths for this lookup can beat it on this machine.
- fixed k = 8: always send up to 8 of lookup's tokens.

Ratios are to target-only (reply length x (cost of one token + overhead)). The replay assumes every run
emits the target-only text (greedy; a real batch can flip a near-tie) and that batches cost what
calibration measured, so it compares policies without the machine's noise, not speeds of real runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specchat.backend import LlamaCppBackend  # noqa: E402
from specchat.config import load_config  # noqa: E402
from specchat.lookup import NgramHistory, PromptLookup  # noqa: E402
from specchat.engine import Finished, generate  # noqa: E402
from specchat.paths import cache_dir  # noqa: E402
from specchat.costs import CostModel, cached_cost_model  # noqa: E402
from specchat.policy import AdaptivePolicy, FixedPolicy
from specchat.report import load_prompts  # noqa: E402
from specchat.sampling import SamplingParams  # noqa: E402
from specchat.sources import resolve  # noqa: E402
from specchat.stats import StepStats  # noqa: E402
from specchat.template import render  # noqa: E402


def agreeing(proposal: list[int], reply: list[int], at: int) -> int:
    """How many of the proposal's tokens the reply continues with from position `at`."""
    n = 0
    for token, actual in zip(proposal, reply[at:]):
        if token != actual:
            break
        n += 1
    return n


def proposals(prompt: list[int], reply: list[int], k_max: int = 64) -> list[tuple[list[int], int]]:
    """Lookup's proposal (tokens, matched length) at every position of the reply."""
    lookup = PromptLookup(1, 32)
    return [lookup.find(np.asarray(prompt + reply[:i], dtype=np.int64), k_max) for i in range(len(reply))]


def bound_seconds(props, reply: list[int], cost: CostModel, overhead: float) -> float:
    """The fastest schedule: T[i] = min over sendable d of cost(d + 1) + overhead + T[i + accepted + 1]."""
    n = len(reply)
    costs, sendable = cost.costs(65), cost.sendable(65)
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        tokens, _ = props[i]
        right = agreeing(tokens, reply, i)
        t = costs[1] + overhead + best[i + 1]
        for d in range(1, min(len(tokens), n - i - 1, 63) + 1):
            if sendable[d + 1]:
                t = min(t, costs[d + 1] + overhead + best[min(n, i + min(d, right) + 1)])
        best[i] = t
    return best[0]


def replay_seconds(prompt: list[int], reply: list[int], cost: CostModel, overhead: float, fixed: int | None = None,
                   history: NgramHistory | None = None) -> float:
    """The policy's time on this reply (the adaptive one, or a fixed k): the engine's draft / observe loop,
    each step billed at the measured cost of its batch. `history`: earlier replies lookup may copy from."""
    lookup = PromptLookup(1, 32, history=history)
    policy = FixedPolicy(fixed) if fixed is not None else ReplayedPolicy(lookup, cost, overhead)
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


class ReplayedPolicy(AdaptivePolicy):
    """The adaptive policy with a fixed per-step overhead (a replay has no wall clock to learn it from)."""

    def __init__(self, lookup: PromptLookup, cost: CostModel, overhead: float):
        super().__init__(lookup, CostModel(cost.sizes, cost.seconds, measured=True), draft_max=64)
        self.overhead = overhead

    def _observe_overhead(self, step: StepStats) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=96, help="reply tokens per prompt")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--models", default="smollm2-135m,gemma-3-270m")
    parser.add_argument("--prompts", choices=("report", "vs-llamacpp"), default="report",
                        help="report: the policy benchmark's (2 per category, chat template); "
                             "vs-llamacpp: vs_llamacpp.py's five, raw")
    parser.add_argument("--overhead-ms", type=float, default=0.5, help="host time per step")
    a = parser.parse_args()
    overhead = a.overhead_ms / 1e3
    config = load_config()
    print(f"# lookup bound · -n {a.n} · threads {a.threads} · {a.prompts} prompts · overhead {a.overhead_ms} ms/step · "
          "ratios to target-only, replayed on the target-only reply")
    for model in a.models.split(","):
        target = LlamaCppBackend(resolve(config.model(model)), n_ctx=2048, n_threads=a.threads, n_gpu_layers=0, name=model)
        cost = cached_cost_model(target, cache_dir() / "costs.json")
        if a.prompts == "report":
            items, _ = load_prompts(None)
            chosen: dict[str, list] = defaultdict(list)
            for item in items:
                if len(chosen[item.category]) < 2:
                    chosen[item.category].append(item)
            cases = [(cat, render(target, [{"role": "user", "content": item.turns[0]}]).token_ids)
                     for cat, its in chosen.items() for item in its]
        else:
            from vs_llamacpp import LOOKUP_PROMPTS

            cases = [(cat, target.tokenize(text, add_special=True)) for cat, text in LOOKUP_PROMPTS.items()]
        params = SamplingParams(temperature=0.0, banned=target.eog_tokens())
        replies = []
        for _, prompt in cases:
            target.truncate(0)
            finished = None
            for event in generate(target, None, prompt, params, max_tokens=a.n, policy=FixedPolicy(0)):
                if isinstance(event, Finished):
                    finished = event
            replies.append(finished.token_ids)
        target.close()

        ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for (cat, prompt), reply in zip(cases, replies):
            plain = len(reply) * (cost(1) + overhead)
            ratios[cat]["policy"].append(plain / replay_seconds(prompt, reply, cost, overhead))
            fixed = replay_seconds(prompt, reply, cost, overhead, fixed=8)
            ratios[cat]["k=8"].append(plain / fixed)
            ratios[cat]["bound"].append(plain / bound_seconds(proposals(prompt, reply), reply, cost, overhead))
        print(f"\n## {model} + prompt-lookup (1 token: {cost(1) * 1e3:.1f} ms; 8: {cost(8) * 1e3:.1f} ms; "
              f"16: {cost(16) * 1e3:.1f} ms)")
        names = ("policy", "k=8", "bound")
        print(f"{'category':<15}" + "".join(f"{n:>9}" for n in names) + f"{'policy/bound':>14}")
        overall: dict[str, list[float]] = defaultdict(list)
        for cat, by in ratios.items():
            means = {n: statistics.mean(by[n]) for n in names}
            for n in names:
                overall[n] += by[n]
            print(f"{cat:<15}" + "".join(f"{means[n]:>8.2f}x" for n in names) + f"{means['policy'] / means['bound']:>13.0%}")
        gm = {n: statistics.geometric_mean(overall[n]) for n in names}
        print(f"{'overall':<15}" + "".join(f"{gm[n]:>8.2f}x" for n in names) + f"{gm['policy'] / gm['bound']:>13.0%}")


if __name__ == "__main__":
    main()
