"""cProfile of the per-token loop: where the Python time goes around llama_decode.

    python benchmarks/profile_loop.py [--model gemma-3-270m] [--temp 0.8] [-n 256]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import specchat  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--temp", type=float, default=0.8)
    parser.add_argument("-n", type=int, default=256)
    parser.add_argument("--top", type=int, default=14)
    a = parser.parse_args()
    pair = specchat.load_pair(target=a.model, draft="prompt-lookup", n_ctx=2048, n_gpu_layers=0)
    ids = pair.chat_prompt([{"role": "user", "content": "Summarise: The Nile is the longest river in Africa. "
                             "It flows north through eleven countries and ends in a delta in Egypt."}])
    params = specchat.SamplingParams(temperature=a.temp, seed=1, banned=pair.target.eog_tokens())
    policy = pair.policy()
    profiler = cProfile.Profile()
    profiler.enable()
    for event in specchat.generate(pair.target, pair.drafter, ids, params, max_tokens=a.n, policy=policy):
        if isinstance(event, specchat.Finished):
            stats = event.stats
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(a.top)
    print(f"{a.model} temp={a.temp}: {stats.emitted} tokens, {stats.steps} steps, "
          f"{stats.tokens_per_second:.1f} tok/s (under the profiler)")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
