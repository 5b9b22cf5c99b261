"""The target on a llama.cpp RPC worker: all layers remote, half, and none (local), with plain decoding, prompt
lookup at fixed k and the adaptive policy side by side, and what one evaluation costs over RPC.

    python -m benchmarks rpc                            # SmolLM2-135M, a worker on 127.0.0.1
    python -m benchmarks rpc --model gemma-3-270m -n 64 --prompts sum-library,code-rename
    python -m benchmarks rpc --rpc 10.0.0.2:50052       # a worker started elsewhere (not stopped here)

Per placement: the target's cost of evaluating k tokens (median ms, k = 1 2 4 8 16) and the fit cost(k) =
fixed + per_token * k: the fixed part's growth over the local fit is the round trip a verify of k tokens pays
once. The policy gets its cost model from costs.json keyed per endpoint set (calibrated on first use, in a
scratch SPECCHAT_HOME). Prompts: ids of `specchat report`'s built-in set, greedy, --ignore-eos, rotating rounds.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import harness

TITLE = "RPC workers"
DEFAULTS = {"n": 64, "threads": 2, "reps": 2, "model": "smollm2-135m"}
SIZES = (1, 2, 4, 8, 16)


def options(p) -> None:
    p.add_argument("--worker-threads", type=int, default=2)
    p.add_argument("--prompts", default="sum-library,qa-museum,code-rename,chat-weekend")
    p.add_argument("--k", type=int, default=4, help="fixed draft length of the prompt-lookup column")
    p.add_argument("--cost-reps", type=int, default=5)
    p.add_argument("--rpc", default=None, help="use this worker instead of starting one here")


def start_worker(threads: int) -> tuple[subprocess.Popen, str]:
    from specchat import rpc

    port = harness.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specchat.cli", "rpc-server", "--port", str(port), "-t", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=harness.specchat_env(),
                            cwd=harness.ROOT)
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
    """Median seconds of one eval of k tokens after the prompt, for k in SIZES, sizes interleaved."""
    target.truncate(0)
    target.eval(ids, [len(ids) - 1])
    keep = len(target.tokens)
    times: dict[int, list[float]] = {k: [] for k in SIZES}
    for rep in range(reps + 1):
        for k in SIZES:
            t0 = time.perf_counter()
            target.eval(ids[:k], range(k))
            if rep:  # round 0 warms up (compute buffers per batch size)
                times[k].append(time.perf_counter() - t0)
            target.truncate(keep)
    return [statistics.median(times[k]) for k in SIZES]


def decode(target, drafter, ids, policy, n: int) -> tuple[float, float]:
    """(generation tok/s, mean accepted length)."""
    from specchat.engine import Finished, generate
    from specchat.sampling import SamplingParams

    target.truncate(0)
    params = SamplingParams(temperature=0.0, banned=target.eog_tokens())
    s = [e for e in generate(target, drafter, ids, params, max_tokens=n, policy=policy) if isinstance(e, Finished)][-1].stats
    return s.emitted / s.generate_seconds, s.mean_accepted_length


def run(a, result: harness.Result) -> None:
    import numpy as np

    from specchat import rpc
    from specchat.backend import LlamaCppBackend
    from specchat.config import load_config
    from specchat.loader import Loaded, make_policy
    from specchat.lookup import PromptLookup
    from specchat.policy import FixedPolicy
    from specchat.report import load_prompts
    from specchat.template import render

    # a scratch cost cache: a random port would add a new costs.json key to the user's on every run
    os.environ["SPECCHAT_HOME"] = tempfile.mkdtemp(prefix="specchat-rpc-")
    items, _ = load_prompts(None)
    chosen = [i for i in items if i.id in a.prompts.split(",")]
    spec = load_config().model(a.model)
    path = harness.model_file(a.model)
    worker = None
    if a.rpc:
        endpoint = rpc.parse_endpoints(a.rpc)[0]
    else:
        worker, endpoint = start_worker(a.worker_threads)
    try:
        probes = []
        for _ in range(5):
            t0 = time.perf_counter()
            rpc.probe(endpoint)
            probes.append(time.perf_counter() - t0)
        result.note(f"{a.model} · worker {endpoint} (-t {a.worker_threads}) · client -t {a.threads} · -n {a.n} "
                    f"--ignore-eos · greedy · {len(chosen)} prompts · {a.reps} rotating rounds, median · connect + "
                    f"HELLO round trip {1000 * statistics.median(probes):.2f} ms")
        rows = []
        for label, endpoints, ngl in (("local", (), 0), ("rpc all", (endpoint,), -1), ("rpc half", (endpoint,), None)):
            if ngl is None:
                ngl = rows[-1]["n_layer"] // 2
            target = LlamaCppBackend(path, n_ctx=2048, n_threads=a.threads, n_gpu_layers=ngl, name=a.model,
                                     rpc=endpoints)
            ids_of = {i.id: render(target, [{"role": "user", "content": i.turns[0]}]).token_ids for i in chosen}
            costs = eval_costs(target, next(iter(ids_of.values())), a.cost_reps)
            per_token, fixed = np.polyfit(np.array(SIZES, dtype=float), np.array(costs), 1)
            loaded = Loaded(target, PromptLookup(1, 4), spec, None, "prompt-lookup")
            speeds: dict[str, list[float]] = {"plain": [], "lookup": [], "policy": []}
            taus: dict[str, list[float]] = {"lookup": [], "policy": []}
            for j, item in enumerate(chosen):
                per: dict[str, list[tuple]] = {k: [] for k in speeds}
                for rep in range(a.reps):
                    for name in harness.rotate(list(speeds), j + rep):
                        if name == "plain":
                            drafter, policy = None, FixedPolicy(0)
                        elif name == "lookup":
                            drafter, policy = PromptLookup(1, 4), FixedPolicy(a.k)
                        else:
                            drafter, policy = PromptLookup(1, 4), make_policy(loaded, 16, None)
                        per[name].append(decode(target, drafter, ids_of[item.id], policy, a.n))
                for name, got in per.items():
                    speeds[name].append(statistics.median(r[0] for r in got))
                    if name in taus:
                        taus[name].append(statistics.median(r[1] for r in got))
            policy_cost = make_policy(loaded, 16, None).verify_cost
            rows.append(dict(label=label, where=target.placement or f"all {target.n_layer + 1} layers on this CPU",
                             n_layer=target.n_layer, costs=costs, fixed=float(fixed), per_token=float(per_token),
                             speeds=speeds, taus=taus, policy=[policy_cost(k) for k in (1, 4, 16)]))
            target.close()
    finally:
        if worker is not None:
            worker.kill()
            worker.wait()
    result.keep("placements", rows)
    local = rows[0]
    result.table("one target evaluation of k tokens (median ms) and the fit cost(k) = fixed + per_token * k",
                 ["placement", *(f"k={k}:.1f" for k in SIZES), "fixed:.1f", "per tok:.2f", "+RTT/eval:+.1f",
                  "policy's model k=1/4/16", "where"],
                 [[r["label"], *(1000 * c for c in r["costs"]), 1000 * r["fixed"], 1000 * r["per_token"],
                   None if r is local else 1000 * (r["fixed"] - local["fixed"]),
                   "/".join(f"{1000 * c:.0f}" for c in r["policy"]), r["where"]] for r in rows])
    table = []
    for r in rows:
        s, t = r["speeds"], r["taus"]
        cells = []
        for name in ("lookup", "policy"):
            cells += [statistics.geometric_mean(s[name]),
                      statistics.geometric_mean([x / y for x, y in zip(s[name], s["plain"])]), statistics.mean(t[name])]
        table.append([r["label"], statistics.geometric_mean(s["plain"]), *cells])
    result.table("decoding (generation tok/s, geometric mean over prompts; ratio to plain in the same placement; tau)",
                 ["placement", "plain:.1f", f"lookup k={a.k}:.1f", "ratio:.2fx", "tau:.2f", "policy:.1f", "ratio:.2fx",
                  "tau:.2f"], table)
    base = 1 / statistics.geometric_mean(local["speeds"]["plain"])
    result.table("per-evaluation overhead seen by plain decoding (one eval per token), vs local",
                 ["placement", "ms per token:.2f", "vs local:+.2f"],
                 [[r["label"], 1000 / statistics.geometric_mean(r["speeds"]["plain"]),
                   1000 * (1 / statistics.geometric_mean(r["speeds"]["plain"]) - base)] for r in rows[1:]])
