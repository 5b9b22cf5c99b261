"""What one plain decoding step costs a drafting target, against a target loaded for plain decoding.

    python benchmarks/plain_step.py                       # smollm2-135m, 128 tokens, 6 rounds
    python benchmarks/plain_step.py --model gemma-3-270m --rounds 4

A target that may verify drafts is loaded with room for its longest verify batch (`outputs`, see
backend.outputs_to_reserve), where plain decoding (--no-spec) loads with one row. Where nothing is drafted
(a first turn that copies nothing), every step of a drafting target is a one-token decode like plain
decoding's, and must cost the same: llama-server runs at the plain speed there. Each round loads every
setting afresh in turn and times -n one-token greedy decodes after a 64-token prompt; reported is the
median ms per decode per setting, and its ratio to plain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specchat.backend import LlamaCppBackend  # noqa: E402
from specchat.config import load_config  # noqa: E402
from specchat.sources import resolve  # noqa: E402


def one_round(path: Path, outputs: int, n: int, threads: int) -> float:
    backend = LlamaCppBackend(path, n_ctx=2048, n_threads=threads, outputs=outputs)
    try:
        prompt = backend.tokenize("The history of the printing press begins with", add_special=True, parse_special=False)
        prompt = (prompt * 16)[:64]
        row = backend.eval(prompt, [len(prompt) - 1])[0]
        times = []
        for _ in range(n):
            token = int(row.argmax())
            started = time.perf_counter()
            row = backend.eval([token], [0])[0]
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    path = resolve(load_config().model(a.model), download=False)
    settings = {"plain (1 row)": 1, "drafting (65 rows reserved)": 65}
    runs: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(a.rounds):
        for name, outputs in settings.items():
            runs[name].append(one_round(path, outputs, a.n, a.threads))
    plain = statistics.median(runs["plain (1 row)"])
    print(f"# one-token decode · {a.model} · {a.threads} threads · {a.n} steps after a 64-token prompt · "
          f"median of {a.rounds} fresh loads")
    for name, values in runs.items():
        med = statistics.median(values)
        print(f"{name:<30}{med * 1e3:>8.2f} ms  {med / plain:>5.2f}x   runs: "
              + " ".join(f"{v * 1e3:.2f}" for v in values))


if __name__ == "__main__":
    main()
