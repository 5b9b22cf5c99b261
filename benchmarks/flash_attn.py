"""What flash attention costs a verify batch on this machine, by context depth: llama.cpp's kernel on and off.

    python benchmarks/flash_attn.py                                   # SmolLM2, gemma-3-270m, Qwen2.5-Coder-1.5B
    python benchmarks/flash_attn.py --models smollm2-135m --depths 100,800,1800 --loads 3

Each load (`LlamaCppBackend`, as a chat's target, one setting) evaluates `depth` tokens of context and then
times batches of 1, 4 and 8 tokens after it (each rolled back, median of --reps). The settings alternate
load by load (on, off, on, off, ...) so a busy moment hits both; each cell is the median over --loads loads.
This is the measurement behind `-fa auto` meaning off for a model on the CPU alone (backend.flash_attn_for).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from specchat.backend import LlamaCppBackend  # noqa: E402
from specchat.config import load_config  # noqa: E402
from specchat.sources import resolve  # noqa: E402

BATCHES = (1, 4, 8)


def one_load(path: Path, flash_attn: str, depth: int, threads: int, reps: int) -> list[float]:
    """ms per batch size after `depth` tokens of context, on one fresh load."""
    backend = LlamaCppBackend(path, n_ctx=4096, n_threads=threads, flash_attn=flash_attn)
    try:
        rng = np.random.default_rng(depth)
        context = [int(t) for t in rng.integers(100, min(backend.n_vocab, 30000), depth)]
        backend.eval(context, [depth - 1])
        out = []
        for n in BATCHES:
            times = []
            for _ in range(reps):
                tokens = [int(t) for t in rng.integers(100, 30000, n)]
                started = time.perf_counter()
                backend.eval(tokens, range(n), in_place=True)
                times.append(time.perf_counter() - started)
                backend.truncate(depth)
            out.append(statistics.median(times) * 1000)
        return out
    finally:
        backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma-3-270m,qwen2.5-coder-1.5b")
    ap.add_argument("--depths", default="200,1800", help="tokens of context before the timed batches")
    ap.add_argument("--loads", type=int, default=2, help="fresh loads per setting (alternating)")
    ap.add_argument("--reps", type=int, default=5, help="timings of each batch on one load (median)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    try:
        depths = [int(d) for d in a.depths.split(",")]
    except ValueError:
        ap.error(f"--depths: comma-separated integers, got {a.depths!r}")
    if min(depths) < 1 or max(depths) > 4000 or a.loads < 1 or a.reps < 1:
        ap.error("--depths must lie in 1..4000, --loads and --reps at least 1")
    print(f"# flash attention on / off · {a.threads} threads · ms per batch after `depth` tokens · median of "
          f"{a.loads} loads x {a.reps} timings")
    print(f"{'model':<22}{'depth':>6}" + "".join(f"{f'on {n}':>9}{f'off {n}':>9}{'off/on':>8}" for n in BATCHES))
    for name in a.models.split(","):
        path = resolve(load_config().model(name), download=False)
        for depth in depths:
            runs: dict[str, list[list[float]]] = {"on": [], "off": []}
            for _ in range(a.loads):
                for setting in ("on", "off"):
                    runs[setting].append(one_load(path, setting, depth, a.threads, a.reps))
            cells = ""
            for j, _ in enumerate(BATCHES):
                on = statistics.median(r[j] for r in runs["on"])
                off = statistics.median(r[j] for r in runs["off"])
                cells += f"{on:>9.1f}{off:>9.1f}{off / on:>7.2f}x"
            print(f"{name:<22}{depth:>6}{cells}", flush=True)


if __name__ == "__main__":
    main()
