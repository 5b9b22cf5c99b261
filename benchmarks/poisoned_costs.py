"""A calibration taken while the machine was busy, then chats: does it still slow them down?

    python benchmarks/poisoned_costs.py                  # 4 chats in a row per setup, 2 turns of 128 tokens
    python benchmarks/poisoned_costs.py --chats 6 -n 96
    python benchmarks/poisoned_costs.py --pair gemma-lookup             # gemma-3-270m, where lookup pays more
    python benchmarks/poisoned_costs.py --before-code /tmp/specchat-before   # "before" from another checkout

SmolLM2-135M-Instruct with prompt lookup (the default pair), greedy, two-turn chats whose replies copy
their prompt. First an honest calibration of this machine (the fastest of --calibrations), then four cost caches (costs.json), each in
its own SPECCHAT_HOME: honest and poisoned (the honest costs scaled the way a busy machine read them,
1.6x for one token growing to 2.4x for 8 and more: SmolLM2 15.9 / 73 ms busy, 10.1 / 30 quiet), each for
"before" and "after". Then --chats rounds; in each, one chat per cache, in rotating order, each chat a
fresh process that starts from what its cache holds (and what the chats before it saved there).

"after" is this checkout: runs save their verify timings into costs.json and a calibration they contradict
is measured again at the next start. "before" is the same code with both turned off (CostModel.save does
nothing, no calibration is judged), which is what specchat did before: the first calibration kept for
good, only the in-process scale factors following the machine. --before-code DIR runs "before" from
another checkout instead (e.g. `git archive <commit> specchat | tar -x -C DIR`).

Prints generation tok/s per chat (both turns) and the ratio poisoned / honest per round, for the first chat
and the later ones. A ratio near 1.00x after the first chat: the poisoned calibration no longer slows the
chats. Greedy texts can still part between runs (batched logits flip a near-tie): `same` says whether the
poisoned chat wrote the honest one's text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TEXT = ("The comittee met on tuesday to discus the new budjet. Every departmant was asked to send a short "
        "report on it's spending before the end of the month, and to list the projects it wants to keep. "
        "The chairman sayd that the libary and the sports hall will be repaired first, becuase both "
        "buildings are old and the roofs leak when it rains. Mrs Patel, who runs the youth club, asked "
        "wether there will be mony left for new computers next year. The chairman promissed to anser "
        "her question at the next meeting, after the acounts have been checked.")
TURNS = [
    f"Fix the spelling mistakes in this text and write the whole corrected text out:\n\n{TEXT}",
    "Now write the corrected text again, one sentence per line, and add a title above it.",
]
SETUPS = ("before honest", "before poisoned", "after honest", "after poisoned")


def busy_factor(n: int) -> float:
    """How a busy machine's calibration read a batch of n tokens, relative to a quiet one's (1.6x at one
    token, 2.4x at 8 and beyond, log-linear in between)."""
    t = min(max(n - 1, 0), 7) / 7
    return math.exp((1 - t) * math.log(1.6) + t * math.log(2.4))


# -- one chat, in its own process -----------------------------------------------------------------------


def chat(mode: str, n: int, pair_name: str) -> dict:
    """One two-turn chat from what SPECCHAT_HOME's cache holds; prints what it measured as JSON."""
    import specchat
    from specchat.engine import Finished
    from specchat.sampling import SamplingParams

    try:
        import specchat.costs as costs
    except ImportError:  # --before-code: a checkout from before costs.py
        costs = None
    if mode == "before" and hasattr(costs, "verdict"):  # this checkout with the learning turned off
        costs.CostModel.save = lambda self, *others: None
        costs.verdict = lambda entry: None
    pair = specchat.load_pair(pair_name, lookup_history=False)
    started = time.perf_counter()
    policy = pair.policy()
    start_seconds = time.perf_counter() - started  # a calibration measured again shows here
    one, eight = policy.verify_cost(1), policy.verify_cost(8)
    conv = specchat.Conversation(pair.target, pair.drafter, params=SamplingParams(temperature=0.0), max_tokens=n,
                                 policy=policy)
    tokens, seconds, texts, turns = 0, 0.0, [], []
    for text in TURNS:
        for event in conv.send(text):
            if isinstance(event, Finished):
                s = event.stats
                tokens += s.emitted
                seconds += s.generate_seconds
                texts.append(event.token_ids)
                turns.append({"tokens": s.emitted, "tps": s.emitted / s.generate_seconds, "drafted": s.drafted,
                              "accepted": s.accepted, "steps": s.steps})
    pair.close()
    return {"tps": tokens / seconds, "tokens": tokens, "turns": turns, "start_seconds": start_seconds,
            "cost_1_ms": one * 1000, "cost_8_ms": eight * 1000,
            "text": hashlib.sha1(json.dumps(texts).encode()).hexdigest()[:12]}


def run_chat(home: Path, mode: str, n: int, code: Path, pair: str) -> dict:
    env = {**os.environ, "SPECCHAT_HOME": str(home), "PYTHONPATH": str(code)}
    env.pop("SPECCHAT_CONFIG", None)
    args = [sys.executable, __file__, "--chat", mode, "-n", str(n), "--code", str(code), "--pair", pair]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"chat in {home} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def calibrate(scratch: Path, times: int, pair: str) -> dict:
    """An honest calibration of this machine: measured `times` times, each in its own process as a first chat
    would measure it, and of each size the fastest reading kept (a shared machine only slows a timing)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SPECCHAT_CONFIG", None)
    code = f"import specchat; pair = specchat.load_pair({pair!r}, lookup_history=False); pair.policy(); pair.close()"
    tables = []
    for i in range(times):
        home = scratch / f"calibration-{i}"
        subprocess.run([sys.executable, "-c", code], env={**env, "SPECCHAT_HOME": str(home)}, check=True, timeout=600)
        tables.append(json.loads((home / ".cache" / "costs.json").read_text()))
    honest = tables[0]
    for key, entry in honest.items():
        others = [t[key] for t in tables[1:] if t.get(key, {}).get("sizes") == entry["sizes"]]
        entry["seconds"] = [min(values) for values in zip(entry["seconds"], *(o["seconds"] for o in others))]
    return honest


def poisoned(table: dict) -> dict:
    out = json.loads(json.dumps(table))
    for entry in out.values():
        entry["seconds"] = [s * busy_factor(n) for n, s in zip(entry["sizes"], entry["seconds"])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=4, help="chats in a row per setup")
    parser.add_argument("--pair", default="default", help="pair from models.toml (default: smollm2-135m + prompt lookup)")
    parser.add_argument("-n", type=int, default=128, help="tokens per turn (at most)")
    parser.add_argument("--calibrations", type=int, default=3, help="honest calibrations, the fastest reading kept")
    parser.add_argument("--before-code", type=Path, help="a checkout whose specchat runs the 'before' chats")
    parser.add_argument("--chat", choices=("before", "after"), help=argparse.SUPPRESS)
    parser.add_argument("--code", type=Path, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.chat:
        sys.path.insert(0, str(a.code or ROOT))
        print(json.dumps(chat(a.chat, a.n, a.pair)))
        return

    print(f"# poisoned costs · {time.strftime('%Y-%m-%d %H:%M')} · {platform.processor() or platform.machine()} · "
          f"{os.cpu_count()} cores · load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} · pair {a.pair} · "
          f"greedy · 2 turns of up to {a.n} tokens · {a.chats} chats per setup")
    scratch = Path(tempfile.mkdtemp(prefix="poisoned-costs-"))
    try:
        honest = calibrate(scratch, a.calibrations, a.pair)
        entry = next(iter(honest.values()))
        quiet = dict(zip(entry["sizes"], entry["seconds"]))
        print(f"honest calibration (fastest of {a.calibrations}): 1 token {quiet[1] * 1000:.1f} ms, 8 tokens {quiet[8] * 1000:.1f} ms; poisoned: "
              f"{quiet[1] * busy_factor(1) * 1000:.1f} / {quiet[8] * busy_factor(8) * 1000:.1f} ms")
        homes = {}
        for setup in SETUPS:
            home = scratch / setup.replace(" ", "-")
            (home / ".cache").mkdir(parents=True)
            table = poisoned(honest) if setup.endswith("poisoned") else honest
            (home / ".cache" / "costs.json").write_text(json.dumps(table, indent=1))
            homes[setup] = home
        results: dict[str, list[dict]] = {s: [] for s in SETUPS}
        for i in range(a.chats):
            order = SETUPS[i % len(SETUPS):] + SETUPS[: i % len(SETUPS)]  # rotate who goes first
            for setup in order:
                before = setup.startswith("before")
                code = a.before_code if before and a.before_code else ROOT
                results[setup].append(run_chat(homes[setup], "before" if before else "after", a.n, code, a.pair))
        print("\ntok/s per chat (generation, both turns); costs the policy started from (1 / 8 tokens, ms); "
              "+Ns: a calibration measured again at the start")
        header = f"{'chat':>4}"
        for setup in SETUPS:
            header += f"{setup:>30}"
        print(header + f"{'before p/h':>12}{'after p/h':>12}")
        ratios: dict[str, list[float]] = {"before": [], "after": []}
        for i in range(a.chats):
            row = f"{i + 1:>4}"
            for setup in SETUPS:
                r = results[setup][i]
                extra = f"+{r['start_seconds']:.0f}s" if r["start_seconds"] > 1.0 else ""
                row += f"{r['tps']:>9.1f} ({r['cost_1_ms']:6.1f}/{r['cost_8_ms']:6.1f}) {extra:>4}"
            for side in ("before", "after"):
                p, h = results[f"{side} poisoned"][i], results[f"{side} honest"][i]
                ratios[side].append(p["tps"] / h["tps"])
                same = "" if p["text"] == h["text"] else "*"
                row += f"{ratios[side][-1]:>10.2f}x{same:1}"
            print(row)
        print("(* the poisoned chat's text parted from the honest one's)")
        for side in ("before", "after"):
            later = ratios[side][1:]
            print(f"{side}: poisoned / honest, first chat {ratios[side][0]:.2f}x"
                  + (f", later chats {statistics.geometric_mean(later):.2f}x (geometric mean of {len(later)})" if later else ""))
        for setup in SETUPS:
            turns = [t for r in results[setup] for t in r["turns"]]
            drafted, accepted = sum(t["drafted"] for t in turns), sum(t["accepted"] for t in turns)
            print(f"{setup}: drafted {drafted}, accepted {accepted} ({accepted / max(drafted, 1):.0%}), "
                  f"{sum(t['tokens'] for t in turns)} tokens in {sum(t['steps'] for t in turns)} steps")
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
