"""`specchat chat` against llama-server in multi-turn chats, equal tokens, side by side.

    python -m benchmarks chat --reps 3                     # SmolLM2-135M-Instruct, the held-out eval set
    python -m benchmarks chat --reps 3 --batch-invariant   # both tools on one text: the drafters compared
    python -m benchmarks chat --model gemma-3-270m --set dev
    python -m benchmarks chat --also "-fa on"              # a second specchat column with other flags

The conversations are benchmarks/data/chat_conversations.json: a `dev` set (tune there) and an `eval` set
(held out: report it), each a task and follow-ups that rewrite, repeat or update the reply, plus a long chat.

specchat: `specchat chat -m MODEL` as a user runs it, its default drafter, the messages piped on stdin, greedy,
-n tokens a turn with --ignore-eos, in a home that a one-turn chat calibrated first; tok/s per turn from its
transcript. llama-server from the same llama.cpp, one server per drafter (none, ngram-simple, ngram-map-k,
ngram-map-k4v, ngram-mod), one slot each, prompt cache on, /v1/chat/completions with the model's template,
the same -n with ignore_eos; tok/s per turn is its `timings.predicted_per_second`.

Each conversation runs in every setting before the next starts. --reps R makes R passes, each from the
calibrated home and with fresh servers (a pass remembers its own earlier conversations, as a user's day would,
never another pass's replies to the same messages); a turn's tok/s is the median of its R runs. The verdict is
specchat against each server on its own (the drafter a user picks in advance): first turns and later turns
(geometric means), worst turn, and whole-chat wall time (the sum of the turns' generation times); the fastest
server per turn, picked after the fact, is a diagnostic. A `*` after specchat's tok/s marks a turn whose text
is not plain llama-server's. --prompt-ids (implied by --batch-invariant): the servers get each turn as the ids
the model saw, as specchat holds a chat, not as text tokenized again.
"""

from __future__ import annotations

import json
import shlex
import shutil

from benchmarks import harness
from benchmarks.harness import geomean

TITLE = "specchat chat vs llama-server"
DEFAULTS = {"n": 128, "threads": 2, "reps": 1, "model": "smollm2-135m", "llama_dir": None, "jobs": None,
            "batch_invariant": False}
SERVERS = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")


def options(p) -> None:
    p.add_argument("--set", choices=("eval", "dev", "all"), default="eval", help="which conversations")
    p.add_argument("--limit", type=int, help="only the first N conversations of the set")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--server-flags", default="", metavar="FLAGS", help="more flags for every llama-server")
    p.add_argument("--also", default=None, metavar="FLAGS", help="a second specchat column with these flags")
    p.add_argument("--prompt-ids", action="store_true", help="send the servers the ids the model saw (see above)")


def wall(turns: list[dict]) -> float:
    """A chat's generation time: the sum of its turns'."""
    return sum(t["n"] / t["tps"] for t in turns if t["tps"] > 0)


def run(a, result: harness.Result) -> None:
    data = json.loads((harness.DATA / "chat_conversations.json").read_text())
    conversations = (data["dev"] + data["eval"] if a.set == "all" else data[a.set])[: a.limit]
    path = harness.model_file(a.model)
    binary = harness.tool(a, "llama-server")
    ours_flags = ["-fa", "off"] if a.batch_invariant else []
    server_flags = [*ours_flags, *shlex.split(a.server_flags)]
    prompt_ids = a.prompt_ids or a.batch_invariant
    columns = {"specchat": ours_flags, **({a.also: shlex.split(a.also)} if a.also else {})}
    retokenized = dict.fromkeys(SERVERS, 0)
    runs: list[list[dict]] = [[] for _ in conversations]  # per conversation, one pass each: {who: turns}
    with harness.scratch("specchat-chat-") as tmp:
        calibrated = tmp / "calibrated"
        for flags in columns.values():
            harness.run_chat(calibrated, a.model, [data["dev"][0]["turns"][0]], n=16, threads=a.threads, ctx=a.ctx,
                             flags=flags)
        shutil.rmtree(calibrated / "share")  # its costs stay, its transcript goes
        for rep in range(a.reps):
            home = tmp / f"pass{rep}"
            shutil.copytree(calibrated, home)
            servers = [harness.Server(binary, path, t, a.threads, a.ctx, server_flags) for t in SERVERS]
            try:
                for server in servers:  # warm-up: the first request of a process builds its graphs
                    server.chat([{"role": "user", "content": "Hello"}], 8)
                for c, convo in enumerate(conversations):
                    got = {who: harness.run_chat(home, a.model, convo["turns"], n=a.n, threads=a.threads, ctx=a.ctx,
                                                 flags=flags) for who, flags in columns.items()}
                    got.update({s.spec_type: s.conversation(convo["turns"], a.n, prompt_ids) for s in servers})
                    runs[c].append(got)
            finally:
                for server in servers:
                    retokenized[server.spec_type] += server.retokenized
                    server.close()
    rows = []  # (conversation, turn, {who: the median run})
    for c, convo in enumerate(conversations):
        for i in range(len(convo["turns"])):
            rows.append((convo["name"], i, {who: harness.median_run([p[who][i] for p in runs[c]])
                                            for who in runs[c][0]}))
    result.keep("turns", [{"conversation": c, "turn": i + 1, **m} for c, i, m in rows])
    result.note(f"{a.model} · {a.set} set ({len(conversations)} conversations, {len(rows)} turns) · greedy · "
                f"{a.n} tokens a turn · {a.threads} threads · median of {a.reps}"
                + (f" · llama-server {a.server_flags}" if a.server_flags else "")
                + (" · batch-invariant build, -fa off on both sides" if a.batch_invariant else "")
                + (" · servers sent the ids the model saw: " + ", ".join(f"{t} {n} retokenized"
                                                                          for t, n in retokenized.items())
                   if prompt_ids else ""))
    table = []
    for name, i, m in rows:
        best = max(SERVERS, key=lambda t: m[t]["tps"])
        ours = m["specchat"]
        own = "" if ours["text"] == m["none"]["text"] else "*"
        table.append([name, i + 1, f"{ours['tps']:.1f}{own}", harness.rate(ours["accepted"], ours["drafted"]),
                      *(m[t]["tps"] for t in SERVERS), best, ours["tps"] / m[best]["tps"],
                      *(m[w]["tps"] / m[best]["tps"] for w in columns if w != "specchat")])
    result.table("tok/s per turn", ["conversation", "turn", "specchat", "acc", *(f"{t}:.1f" for t in SERVERS),
                                    "best server", "ratio:.2fx", *(f"{w}:.2fx" for w in columns if w != "specchat")],
                 table)
    parted = sum(m["specchat"]["text"] != m["none"]["text"] for _, _, m in rows)
    result.note(f"(* specchat's text is not plain llama-server's: {parted} of {len(rows)} turns)")
    verdict = []
    chats = list(dict.fromkeys(name for name, _, _ in rows))
    for who in columns:
        for t in SERVERS:
            ratio = {first: [m[who]["tps"] / m[t]["tps"] for _, i, m in rows if (i == 0) == first]
                     for first in (True, False)}
            walls = [wall([m[t] for n, _, m in rows if n == c]) / wall([m[who] for n, _, m in rows if n == c])
                     for c in chats]
            verdict.append([who, t, geomean(ratio[True]), min(ratio[True], default=None), geomean(ratio[False]),
                            min(ratio[False], default=None), min(ratio[True] + ratio[False]),
                            sum(r < 0.9 for r in ratio[True] + ratio[False]), geomean(walls)])
    result.table("specchat / each llama-server on its own (geomeans)",
                 ["specchat", "against", "first turns:.2fx", "worst:.2fx", "later turns:.2fx", "worst:.2fx",
                  "worst turn:.2fx", "below 0.9x", "whole chat:.2fx"], verdict)
    bests = {first: [m["specchat"]["tps"] / max(m[t]["tps"] for t in SERVERS) for _, i, m in rows if (i == 0) == first]
             for first in (True, False)}
    result.note(f"diagnostic, specchat / the fastest server on each turn (picked after the fact): first turns "
                f"{geomean(bests[True]):.2f}x (worst {min(bests[True]):.2f}x), later turns {geomean(bests[False]):.2f}x "
                f"(worst {min(bests[False], default=float('nan')):.2f}x)")
