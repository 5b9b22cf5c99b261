"""Plain decoding (no drafting) against `llama-bench -n N -p 0` (tgN) from the same vendored llama.cpp.

    python -m benchmarks plain                       # gemma-3-270m, tg128, 2 threads, 4 alternating reps
    python -m benchmarks plain --model smollm2-135m --reps 6

specchat decodes N tokens after "The" (as tgN: from an almost empty context) in this process, greedy and at
temperature 0.8 (llama.cpp's default sampler: top-k 40, top-p 0.95, min-p 0.05), alternating with llama-bench
runs (each the mean of its own 3); the table holds medians and every run.
"""

from __future__ import annotations

from benchmarks import harness
from benchmarks.harness import median

TITLE = "plain decoding vs llama-bench"
DEFAULTS = {"n": 128, "threads": 2, "reps": 4, "model": "gemma-3-270m", "llama_dir": None, "jobs": None}
TEMPS = (0.0, 0.8)


def options(p) -> None:
    pass


def plain_tps(target, n: int, temp: float) -> float:
    import specchat

    ids = target.tokenize("The")
    params = specchat.SamplingParams(temperature=temp, seed=3, banned=target.eog_tokens())
    finished = [e for e in specchat.generate(target, None, ids, params, max_tokens=n) if isinstance(e, specchat.Finished)]
    return finished[-1].stats.tokens_per_second


def run(a, result: harness.Result) -> None:
    import specchat

    binary = harness.tool(a, "llama-bench")
    pair = specchat.load_pair(target=a.model, draft=None, n_ctx=2048, n_gpu_layers=0, n_threads=a.threads)
    try:
        plain_tps(pair.target, 8, 0.8)  # warm-up
        ours: dict[float, list[float]] = {t: [] for t in TEMPS}
        theirs: list[float] = []
        for rep in range(a.reps):
            for who in harness.rotate(("bench", "ours"), rep):
                if who == "bench":
                    theirs.append(harness.llama_bench(binary, harness.model_file(a.model), a.n, a.threads))
                else:
                    for temp in TEMPS:
                        ours[temp].append(plain_tps(pair.target, a.n, temp))
    finally:
        pair.close()
    ref = median(theirs)
    rows = [[f"llama-bench tg{a.n}", ref, 1.0, ", ".join(f"{x:.1f}" for x in theirs)]]
    rows += [[f"specchat plain, temp {t}", median(v), median(v) / ref, ", ".join(f"{x:.1f}" for x in v)]
             for t, v in ours.items()]
    result.table(f"plain decoding vs llama-bench tg{a.n}, {a.model}, {a.threads} threads, {a.reps} alternating reps",
                 ["run", "tok/s:.1f", "ratio:.3fx", "runs"], rows)
