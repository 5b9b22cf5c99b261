"""Where a chat turn's time goes: `specchat chat` step by step beside llama-server's drafters, one conversation.

    python benchmarks/chat_trace.py                                   # dev-long, default build
    python benchmarks/chat_trace.py --batch-invariant --servers ngram-simple,ngram-map-k
    python benchmarks/chat_trace.py --conversation dev-stack -n 96

specchat: `specchat chat` as chat_server.py runs it (a home that calibrated first, the messages on stdin,
greedy, -n tokens a turn with --ignore-eos), in a process of its own where every llama_decode, every verify
step and every turn's start is timed (the wrapper below patches `llama_cpp.llama_decode` and the engine's
`verify_step` / `sync` before the CLI starts). Per turn: tok/s over the verify steps, steps, tokens drafted and
accepted, the mean batch (drafts + 1), ms a step, and of that the ms inside llama_decode: what is left is
specchat's own host time.

llama-server: each drafter in --servers, one at a time, the same turns sent as the ids the model saw
(chat_server.Server.conversation with prompt ids). Its steps are read off `timings`: every step but the
prompt's emits its accepted drafts plus one token, so steps = tokens - 1 - accepted; the mean batch and ms a
step follow (its ms include its own host time).

Single turns swing with the machine (docs/benchmarks.md, "Chat against llama-server"): read the batches and
the split of a step, not one turn's tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from chat_server import CONVERSATIONS, SERVER_TYPES, Server, model_file, run_specchat, server_setup  # noqa: E402

# Run in the specchat process: time llama_decode, each verify step and each turn's start, dump them at exit.
WRAPPER = r"""
import atexit, json, os, sys, time
import llama_cpp
import specchat.engine as engine
events = []
decode = llama_cpp.llama_decode
def timed_decode(ctx, batch):
    t = time.perf_counter(); rc = decode(ctx, batch)
    events.append(("decode", batch.n_tokens, t, time.perf_counter() - t)); return rc
llama_cpp.llama_decode = timed_decode
verify = engine.verify_step
def timed_verify(target, context, drafts, q, params, rng):
    t = time.perf_counter(); verified = verify(target, context, drafts, q, params, rng)
    events.append(("verify", len(drafts), t, time.perf_counter() - t, verified.accepted)); return verified
engine.verify_step = timed_verify
sync = engine.sync
def turn_start(target, ids, **kw):
    events.append(("turn", len(ids), time.perf_counter(), 0.0)); return sync(target, ids, **kw)
engine.sync = turn_start
atexit.register(lambda: json.dump(events, open(os.environ["SPECCHAT_TRACE"], "w")))
from specchat.cli import main
main(sys.argv[1:])
"""


def trace_specchat(home: Path, model: str, turns: list[str], n: int, threads: int, ctx: int,
                   flags: list[str]) -> list[dict]:
    trace = home / "trace.json"
    args = [sys.executable, "-c", WRAPPER, "chat", "-m", model, "--temp", "0", "-n", str(n), "--ignore-eos",
            "-t", str(threads), "-c", str(ctx), "--no-color", *flags]
    env = {**os.environ, "SPECCHAT_HOME": str(home), "PYTHONPATH": str(ROOT), "NO_COLOR": "1",
           "SPECCHAT_TRACE": str(trace)}
    out = subprocess.run(args, input="\n".join(turns) + "\n", capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"specchat chat failed ({out.returncode}):\n{out.stderr[-3000:]}")
    rows: list[dict] = []
    for event in json.loads(trace.read_text()):
        kind, size, start, seconds = event[:4]
        if kind == "turn":
            rows.append({"depth": size, "steps": [], "decodes": []})
        elif kind == "verify" and rows:
            rows[-1]["steps"].append((size, start, seconds, event[4]))
        elif kind == "decode" and rows:
            rows[-1]["decodes"].append((start, seconds))
    table = []
    for row in rows:
        steps = row["steps"]
        if not steps:
            continue
        begin, end = steps[0][1], steps[-1][1] + steps[-1][2]
        decoding = sum(s for t, s in row["decodes"] if begin <= t <= end)  # the prompt's own excluded
        emitted = sum(accepted + 1 for _, _, _, accepted in steps)
        table.append({"depth": row["depth"], "tps": emitted / (end - begin), "steps": len(steps),
                      "drafted": sum(d for d, *_ in steps), "accepted": sum(a for *_, a in steps),
                      "ms": 1000 * (end - begin) / len(steps), "decode_ms": 1000 * decoding / len(steps)})
    return table


def trace_server(server: Server, turns: list[str], n: int) -> list[dict]:
    timings: list[tuple[dict, int]] = []
    post = server.post

    def recording(route: str, body: dict) -> dict:
        doc = post(route, body)
        if route == "/completion":
            timings.append((doc["timings"], len(body["prompt"])))
        return doc

    server.post = recording
    server.conversation(turns, n, prompt_ids=True)
    table = []
    for t, depth in timings:
        accepted, drafted = t.get("draft_n_accepted", 0), t.get("draft_n", 0)
        steps = max(1, t["predicted_n"] - 1 - accepted)
        table.append({"depth": depth, "tps": t["predicted_per_second"], "steps": steps, "drafted": drafted,
                      "accepted": accepted, "ms": t["predicted_ms"] / steps, "decode_ms": None})
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model name from models.toml (default: smollm2-135m)")
    ap.add_argument("--conversation", default="dev-long", help="a conversation's name (default: dev-long)")
    ap.add_argument("--servers", default="ngram-simple,ngram-map-k",
                    help=f"llama-server drafters, comma-separated, of: {', '.join(SERVER_TYPES)}")
    ap.add_argument("-n", type=int, default=128, help="tokens a turn (default 128)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--server-bin", type=Path, default=None, help="llama-server (default: build it once)")
    ap.add_argument("--batch-invariant", action="store_true", help="both tools on the batch-invariant build")
    a = ap.parse_args()
    for name in ("n", "threads", "ctx"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1")
    servers = [s for s in a.servers.split(",") if s]
    if unknown := [s for s in servers if s not in SERVER_TYPES]:
        ap.error(f"--servers: unknown drafter {unknown[0]!r} (one of {', '.join(SERVER_TYPES)})")
    data = json.loads(CONVERSATIONS.read_text())
    by_name = {c["name"]: c for part in ("dev", "eval") for c in data[part]}
    if a.conversation not in by_name:
        ap.error(f"--conversation {a.conversation}: none such (one of {', '.join(by_name)})")
    turns = by_name[a.conversation]["turns"]
    try:
        path = model_file(a.model)
    except Exception as e:
        ap.error(f"--model {a.model}: {e}")
    binary, ours, theirs = server_setup(ap, a.server_bin, a.threads, a.batch_invariant)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        run_specchat(home, a.model, [data["dev"][0]["turns"][0]], 16, a.threads, a.ctx, ours)  # calibrates
        shutil.rmtree(home / "share")
        tables = {"specchat": trace_specchat(home, a.model, turns, a.n, a.threads, a.ctx, ours)}
    for spec_type in servers:
        server = Server(binary, path, spec_type, a.threads, a.ctx, theirs)
        try:
            server.chat([{"role": "user", "content": "Hello"}], 8)  # the first request builds its graphs
            tables[spec_type] = trace_server(server, turns, a.n)
        finally:
            server.close()
    print(f"# where a turn's time goes · {a.model} · {a.conversation} · greedy · {a.n} tokens a turn · "
          f"{a.threads} threads" + (" · batch-invariant build, -fa off on both sides" if a.batch_invariant else ""))
    print(f"{'':<14}{'turn':>5}{'depth':>6}{'tok/s':>8}{'steps':>6}{'drafted':>8}{'accepted':>9}{'batch':>7}"
          f"{'ms/step':>9}{'in decode':>10}")
    for i in range(len(turns)):
        for name, table in tables.items():
            if i >= len(table):
                continue
            r = table[i]
            decode = f"{r['decode_ms']:>10.1f}" if r["decode_ms"] is not None else f"{'':>10}"
            print(f"{name:<14}{i + 1:>5}{r['depth']:>6}{r['tps']:>8.1f}{r['steps']:>6}{r['drafted']:>8}"
                  f"{r['accepted']:>9}{(r['drafted'] + r['steps']) / r['steps']:>7.1f}{r['ms']:>9.1f}{decode}")


if __name__ == "__main__":
    main()
