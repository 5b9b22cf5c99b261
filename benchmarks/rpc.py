"""The target on a llama.cpp RPC worker on this machine: all layers remote, half, and none (local), with
plain decoding, prompt lookup (fixed k) and the adaptive policy side by side, plus what one evaluation
costs over RPC.

    python benchmarks/rpc.py                        # SmolLM2-135M, a worker on 127.0.0.1
    python benchmarks/rpc.py --model gemma-3-270m -n 64 --prompts sum-library,code-rename
    python benchmarks/rpc.py --rpc 10.0.0.2:50052   # a worker you started elsewhere (not stopped here)

Per placement it measures the target's cost of evaluating k tokens (median ms, k = 1 2 4 8 16) and fits
cost(k) = fixed + per_token * k: the fixed part's growth over the local fit is the per-evaluation round
trip (socket, graph send, result copy) that a verify of k tokens pays once. The policy gets its cost
model from costs.json keyed per endpoint set (calibrated on first use), so it sees these RPC costs.
A localhost worker shares this machine's cores with the client: this measures the protocol's overhead,
not a second machine's compute.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# a scratch cost cache: a random port would add a new costs.json key to the user's on every run
os.environ.setdefault("SPECCHAT_HOME", tempfile.mkdtemp(prefix="specchat-rpc-bench-"))

from specchat import rpc  # noqa: E402
from specchat.backend import LlamaCppBackend  # noqa: E402
from specchat.config import load_config  # noqa: E402
from specchat.lookup import PromptLookup  # noqa: E402
from specchat.engine import Finished, generate  # noqa: E402
from specchat.loader import Loaded  # noqa: E402
from specchat.policy import FixedPolicy  # noqa: E402
from specchat.loader import make_policy
from specchat.report import load_prompts  # noqa: E402
from specchat.sampling import SamplingParams  # noqa: E402
from specchat.sources import resolve  # noqa: E402
from specchat.template import render  # noqa: E402

SIZES = (1, 2, 4, 8, 16)


def start_worker(threads: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "specchat.cli", "rpc-server", "--port", str(port), "-t", str(threads)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )
    endpoint = f"127.0.0.1:{port}"
    for _ in range(150):
        try:
            rpc.probe(endpoint, timeout=1)
            return proc, endpoint
        except rpc.RpcError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the RPC worker did not start")


def eval_costs(target, ids: list[int], reps: int) -> list[float]:
    """Median seconds of one eval of k tokens after the prompt, for k in SIZES."""
    target.truncate(0)
    target.eval(ids, [len(ids) - 1])
    keep = len(target.tokens)
    times: dict[int, list[float]] = {k: [] for k in SIZES}
    for rep in range(reps + 1):  # sizes interleaved, so a burst of other load hits them all alike
        for k in SIZES:
            t0 = time.perf_counter()
            target.eval(ids[:k], range(k))
            if rep:  # round 0 warms up (compute buffers per batch size)
                times[k].append(time.perf_counter() - t0)
            target.truncate(keep)
    return [statistics.median(times[k]) for k in SIZES]


def fit(costs: list[float]) -> tuple[float, float]:
    """(fixed, per-token) seconds of cost(k) = fixed + per_token * k, least squares."""
    per_token, fixed = np.polyfit(np.array(SIZES, dtype=float), np.array(costs), 1)
    return float(fixed), float(per_token)


def decode(target, drafter, ids, policy, n: int) -> tuple[float, float, float]:
    """(generation tok/s, mean accepted length, acceptance rate)."""
    target.truncate(0)
    params = SamplingParams(temperature=0.0, banned=target.eog_tokens())
    finished = None
    for event in generate(target, drafter, ids, params, max_tokens=n, policy=policy):
        if isinstance(event, Finished):
            finished = event
    s = finished.stats
    return s.emitted / s.generate_seconds, s.mean_accepted_length, s.acceptance_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2, help="client threads")
    parser.add_argument("--worker-threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--prompts", default="sum-library,qa-museum,code-rename,chat-weekend")
    parser.add_argument("--k", type=int, default=4, help="fixed draft length for the prompt-lookup column")
    parser.add_argument("--reps", type=int, default=2, help="rounds per setting and prompt (median kept)")
    parser.add_argument("--cost-reps", type=int, default=5)
    parser.add_argument("--rpc", default=None, help="use this worker instead of starting one here")
    a = parser.parse_args()

    items, _ = load_prompts(None)
    wanted = a.prompts.split(",")
    chosen = [i for i in items if i.id in wanted]
    config = load_config()
    spec = config.model(a.model)
    path = resolve(spec)
    worker = None
    if a.rpc:
        endpoint = rpc.parse_endpoints(a.rpc)[0]
    else:
        worker, endpoint = start_worker(a.worker_threads)
    print(f"# RPC benchmark · {time.strftime('%Y-%m-%d %H:%M')} · {platform.processor() or platform.machine()} · "
          f"{os.cpu_count()} cores · {a.model} · worker {endpoint} (-t {a.worker_threads}) · client -t {a.threads} · "
          f"-n {a.n} --ignore-eos · greedy · {len(chosen)} prompts · {a.reps} rotating rounds, median")
    try:
        probe_times = []
        for _ in range(5):
            t0 = time.perf_counter()
            rpc.probe(endpoint)
            probe_times.append(time.perf_counter() - t0)
        print(f"connect + HELLO round trip: {1000 * statistics.median(probe_times):.2f} ms (median of 5)")
        placements = [("local", (), 0), ("rpc all", (endpoint,), -1), ("rpc half", (endpoint,), None)]
        rows = []
        local_fit = None
        for label, endpoints, ngl in placements:
            if ngl is None:
                ngl = rows[-1]["n_layer"] // 2
            target = LlamaCppBackend(path, n_ctx=2048, n_threads=a.threads, n_gpu_layers=ngl, name=a.model,
                                     rpc=endpoints)
            where = target.placement or f"all {target.n_layer + 1} layers on this CPU"
            ids_of = {i.id: render(target, [{"role": "user", "content": i.turns[0]}]).token_ids for i in chosen}
            costs = eval_costs(target, next(iter(ids_of.values())), a.cost_reps)
            fixed, per_token = fit(costs)
            if local_fit is None:
                local_fit = (fixed, per_token)
            loaded = Loaded(target, PromptLookup(1, 4), spec, None, "prompt-lookup")
            speeds: dict[str, list[float]] = {"plain": [], "lookup": [], "policy": []}
            taus: dict[str, list[float]] = {"lookup": [], "policy": []}
            for j, item in enumerate(chosen):
                per: dict[str, list[tuple]] = {k: [] for k in speeds}
                for rep in range(a.reps):
                    names = list(speeds)
                    names = names[(j + rep) % 3:] + names[: (j + rep) % 3]
                    for name in names:
                        if name == "plain":
                            r = decode(target, None, ids_of[item.id], FixedPolicy(0), a.n)
                        elif name == "lookup":
                            r = decode(target, PromptLookup(1, 4), ids_of[item.id], FixedPolicy(a.k), a.n)
                        else:
                            r = decode(target, PromptLookup(1, 4), ids_of[item.id], make_policy(loaded, 16, None), a.n)
                        per[name].append(r)
                for name, runs in per.items():
                    speeds[name].append(statistics.median(r[0] for r in runs))
                    if name in taus:
                        taus[name].append(statistics.median(r[1] for r in runs))
            policy_costs = make_policy(loaded, 16, None).verify_cost
            rows.append(dict(label=label, where=where, n_layer=target.n_layer, costs=costs, fixed=fixed,
                             per_token=per_token, speeds=speeds, taus=taus,
                             policy=[policy_costs(k) for k in (1, 4, 16)]))
            target.close()

        print("\n## one target evaluation of k tokens (median ms) and the fit cost(k) = fixed + per_token * k")
        print(f"{'placement':<10}" + "".join(f"{'k=' + str(k):>9}" for k in SIZES)
              + f"{'fixed':>9}{'per tok':>9}{'+RTT/eval':>11}   policy's model k=1/4/16   where")
        for r in rows:
            extra = r["fixed"] - local_fit[0]
            print(f"{r['label']:<10}" + "".join(f"{1000 * c:>9.1f}" for c in r["costs"])
                  + f"{1000 * r['fixed']:>9.1f}{1000 * r['per_token']:>9.2f}"
                  + (f"{1000 * extra:>+11.1f}" if r["label"] != "local" else f"{'':>11}")
                  + "   " + "/".join(f"{1000 * c:.0f}" for c in r["policy"]) + f"   {r['where']}")
        print("\n## decoding (generation tok/s, geometric mean over prompts; ratio to plain in the same placement; tau)")
        print(f"{'placement':<10}{'plain':>9}{'lookup k=' + str(a.k):>24}{'policy':>24}")
        for r in rows:
            s, t = r["speeds"], r["taus"]
            plain = statistics.geometric_mean(s["plain"])
            cells = ""
            for name in ("lookup", "policy"):
                ratio = statistics.geometric_mean([x / y for x, y in zip(s[name], s["plain"])])
                cells += f"{statistics.geometric_mean(s[name]):>9.1f} ({ratio:4.2f}x, τ {statistics.mean(t[name]):.2f})"
            print(f"{r['label']:<10}{plain:>9.1f}{cells}")
        print("\n## per-evaluation overhead seen by plain decoding (one eval per token), vs local")
        base = 1 / statistics.geometric_mean(rows[0]["speeds"]["plain"])
        for r in rows[1:]:
            per = 1 / statistics.geometric_mean(r["speeds"]["plain"])
            print(f"{r['label']:<10}{1000 * per:>7.2f} ms per token ({1000 * (per - base):+.2f} ms vs local {1000 * base:.2f} ms)")
        print("\nper prompt (" + ", ".join(i.id for i in chosen) + "):")
        for r in rows:
            print(f"  {r['label']:<9} " + " | ".join(
                f"{name} " + " ".join(f"{x:.0f}" for x in r["speeds"][name]) for name in ("plain", "lookup", "policy")))
    finally:
        if worker is not None:
            worker.kill()
            worker.wait()


if __name__ == "__main__":
    main()
