"""`specchat chat` against llama-server in multi-turn chats, equal tokens, side by side.

    python benchmarks/chat_server.py                          # SmolLM2 (the default pair), the eval set
    python benchmarks/chat_server.py --model gemma-3-270m --set dev
    python benchmarks/chat_server.py --model qwen2.5-coder-1.5b -n 96
    python benchmarks/chat_server.py --server-bin PATH        # an already built llama-server
    python benchmarks/chat_server.py --also "-fa on"          # a second specchat column with other flags
    python benchmarks/chat_server.py --server-flags "-fa off" # every llama-server with these flags too
    python benchmarks/chat_server.py --batch-invariant        # both tools on a batch-invariant build: one text

The conversations are benchmarks/data/chat_conversations.json: a `dev` set (tune there) and an `eval` set
(held out: report it). Each is a task and follow-ups that rewrite, repeat or update the reply, plus a long
chat of 11 turns.

specchat: `specchat chat -m MODEL` as a user runs it, its default drafter (prompt lookup), the messages piped
on stdin a line each, greedy, -n tokens a turn with --ignore-eos, in a SPECCHAT_HOME that a one-turn chat
calibrated first (a new user's first chat does the same). tok/s per turn is generation only,
from the transcript's stats.

llama-server, built from the vendored llama.cpp of the installed llama-cpp-python (vs_llamacpp.build), one
server per drafter: none, ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, all running at once (one
slot each, prompt cache on: turn 2 reuses turn 1), /v1/chat/completions with the model's own template,
temperature 0, the same -n with ignore_eos. tok/s per turn is its `timings.predicted_per_second`.

Each conversation runs in every setting before the next one starts, so a busy moment hits all alike. --reps R
makes R passes over the conversations, each from the calibrated home and with fresh servers: specchat's lookup
searches earlier replies (its transcripts) and llama-server's ngram-mod keeps a pool across requests, so a
pass remembers its own earlier conversations, as a user's day would, but never another pass's replies to the
same messages. Each
setting's tok/s on a turn is the median of its R runs. The reference per turn is the fastest server on that
turn (of the medians: the best of five single runs would favour the servers with their luckiest moment).
Geometric means are split into first turns and later turns (those that copy from earlier replies), against the
per-turn best and against each server on its own (the drafter a user would pick in advance). Texts can part between specchat and the server where
two greedy candidates tie within batched-logit noise; each side continues its own conversation. A `*`
after specchat's tok/s marks a turn whose text is not plain llama-server's (no drafting): the target's own.

--prompt-ids: llama-server is sent each turn as the ids the model saw (its own template and tokenizer, the
difference a turn adds appended to the prompt and reply ids it held, to /completion), as specchat holds a
chat, instead of the whole conversation as text that /v1/chat/completions tokenizes again: a reply's text
need not tokenize back to the ids generated (at its cut end), so the two tools may not condition on the same
tokens from turn 2 on.

--batch-invariant: both tools on llama.cpp built so that a batch's logits are bit for bit a single token's
(vs_llamacpp.build_invariant: the same source without llamafile's sgemm and repacked weights, every matmul
tiled, flash attention off on both sides; specchat loads that build's libllama; implies --prompt-ids).
Every greedy text is then the target's own, so each turn times the same text on every side and compares drafters, not texts. Single
tokens decode more slowly there than on the default build, so its ratios are not a user's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from vs_llamacpp import build, build_invariant, use_invariant  # noqa: E402

CONVERSATIONS = Path(__file__).resolve().parent / "data" / "chat_conversations.json"
SERVER_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")


def model_file(name: str) -> Path:
    from specchat.config import load_config
    from specchat.sources import resolve

    return resolve(load_config().model(name), download=False)


def has_chat_template(path: Path) -> bool:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        return bool(llm.metadata.get("tokenizer.chat_template"))
    finally:
        llm.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- specchat ---------------------------------------------------------------------------------------


def run_specchat(home: Path, model: str, turns: list[str], n: int, threads: int, ctx: int,
                 flags: Sequence[str] = ()) -> list[dict]:
    """One `specchat chat` process over the turns; per turn: tok/s, drafted, accepted, the reply."""
    transcripts = home / "share" / "transcripts"
    before = set(transcripts.glob("*.jsonl")) if transcripts.exists() else set()
    args = [sys.executable, "-m", "specchat.cli", "chat", "-m", model, "--temp", "0", "-n", str(n), "--ignore-eos",
            "-t", str(threads), "-c", str(ctx), "--no-color", *flags]
    env = {**os.environ, "SPECCHAT_HOME": str(home), "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    out = subprocess.run(args, input="\n".join(turns) + "\n", capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"specchat chat failed ({out.returncode}):\n{out.stderr[-3000:]}")
    (path,) = set(transcripts.glob("*.jsonl")) - before
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    replies = [r for r in records if r.get("role") == "assistant"]
    if len(replies) != len(turns):
        raise RuntimeError(f"specchat answered {len(replies)} of {len(turns)} turns:\n{out.stderr[-2000:]}")
    return [{"tps": r["stats"]["tokens_per_second"], "n": r["stats"]["generated_tokens"],
             "drafted": r["stats"]["drafted"], "accepted": r["stats"]["accepted"], "text": r["content"]}
            for r in replies]


# -- llama-server -----------------------------------------------------------------------------------


class Server:
    def __init__(self, binary: Path, model: Path, spec_type: str, threads: int, ctx: int, flags: Sequence[str] = ()):
        self.spec_type = spec_type
        self.retokenized = 0  # --prompt-ids turns whose rendering did not extend the held text
        self.port = free_port()
        args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-c", str(ctx),
                "-t", str(threads), "-tb", str(threads), "-ngl", "0", "-np", "1"]
        if spec_type != "none":
            args += ["--spec-type", spec_type]
        args += list(flags)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"llama-server --spec-type {spec_type} did not start:\n"
                                   f"{self.log.read().decode(errors='replace')[-3000:]}")
            time.sleep(0.3)

    def chat(self, messages: list[dict], n: int) -> dict:
        doc = self.post("/v1/chat/completions", {"messages": messages, "max_tokens": n, "temperature": 0.0,
                                                  "top_k": 1, "seed": 1, "ignore_eos": True, "cache_prompt": True})
        t = doc["timings"]
        return {"tps": t["predicted_per_second"], "n": t["predicted_n"], "drafted": t.get("draft_n", 0),
                "accepted": t.get("draft_n_accepted", 0), "text": doc["choices"][0]["message"]["content"]}

    def post(self, route: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{route}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as r:
            return json.loads(r.read())

    def conversation(self, turns: list[str], n: int, prompt_ids: bool = False) -> list[dict]:
        """The turns as a user's client sends them: /v1/chat/completions with the whole conversation as text,
        which the server renders and tokenizes again every turn. With `prompt_ids`, the way specchat's
        Conversation holds a chat: the exact ids the model saw (each prompt as sent plus each token it
        generated), the server's own template rendering of the new turn tokenized as a difference and
        appended, sent to /completion as token ids."""
        messages: list[dict] = []
        out = []
        held_text, held_ids = "", []
        for user in turns:
            messages.append({"role": "user", "content": user})
            if prompt_ids:
                text = self.post("/apply-template", {"messages": messages})["prompt"]
                if held_ids and text.startswith(held_text):
                    ids = held_ids + self.post("/tokenize", {"content": text[len(held_text):], "add_special": False,
                                                            "parse_special": True})["tokens"]
                else:
                    self.retokenized += bool(held_ids)
                    ids = self.post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
                doc = self.post("/completion", {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                                "seed": 1, "ignore_eos": True, "cache_prompt": True,
                                                "return_tokens": True})
                t = doc["timings"]
                reply = {"tps": t["predicted_per_second"], "n": t["predicted_n"], "drafted": t.get("draft_n", 0),
                         "accepted": t.get("draft_n_accepted", 0), "text": doc["content"]}
                held_text, held_ids = text + doc["content"], ids + doc["tokens"]
            else:
                reply = self.chat(messages, n)
            messages.append({"role": "assistant", "content": reply["text"]})
            out.append(reply)
        return out

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the table -------------------------------------------------------------------------------------


def median_run(runs: list[dict]) -> dict:
    """The run of median tok/s (its other fields kept: drafted, accepted, n of that same run)."""
    ordered = sorted(runs, key=lambda r: r["tps"])
    return ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else {
        **ordered[len(ordered) // 2], "tps": (ordered[len(ordered) // 2 - 1]["tps"] + ordered[len(ordered) // 2]["tps"]) / 2}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def against_each(rows: list[tuple]) -> list[str]:
    """specchat against each server on its own (the drafter a user would pick in advance), where the
    per-turn best is a drafter picked after the fact: geomeans and worst turns, first and later turns."""
    lines = []
    for t in SERVER_TYPES:
        ratio = {first: [ours["tps"] / theirs[t]["tps"] for _, i, ours, theirs, _ in rows if (i == 0) == first]
                 for first in (True, False)}
        lines.append(f"specchat / {t:<13} geomean: first turns {geomean(ratio[True]):.2f}x (worst "
                     f"{min(ratio[True], default=float('nan')):.2f}x, {sum(r < 0.9 for r in ratio[True])} below 0.9x), "
                     f"later turns {geomean(ratio[False]):.2f}x (worst {min(ratio[False], default=float('nan')):.2f}x, "
                     f"{sum(r < 0.9 for r in ratio[False])} below 0.9x)")
    return lines


def server_setup(ap: argparse.ArgumentParser, server_bin: Path | None, threads: int,
                 batch_invariant: bool) -> tuple[Path, list[str], list[str]]:
    """llama-server (built once unless given) and the flags of each side: on the batch-invariant build,
    which this process's children then load (specchat's libllama too), flash attention off on both."""
    if batch_invariant:
        binary = server_bin or build_invariant(threads, "llama-server")
        use_invariant(binary)  # the specchat processes and the servers inherit it
        ours, theirs = ["-fa", "off"], ["-fa", "off"]
    else:
        binary = server_bin or build(threads, "llama-server").parent / "llama-server"
        ours, theirs = [], []
    if not binary.exists():
        ap.error(f"--server-bin {binary}: no such file")
    return binary, ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model name from models.toml (default: smollm2-135m)")
    ap.add_argument("--set", choices=("eval", "dev", "all"), default="eval", help="which conversations (default: eval)")
    ap.add_argument("-n", type=int, default=128, help="tokens a turn (default 128)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--server-bin", type=Path, default=None, help="llama-server (default: build it once)")
    ap.add_argument("--reps", type=int, default=1, help="runs of each conversation in each setting; tok/s is their median")
    ap.add_argument("--server-flags", default="", metavar="FLAGS",
                    help="more llama-server flags for every server (e.g. \"-fa off\")")
    ap.add_argument("--also", default=None, metavar="FLAGS",
                    help="a second specchat column with these flags (e.g. \"-fa on\"), run beside the default")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="both tools on a build whose batch logits equal single-token ones (see above); "
                         "implies --prompt-ids")
    ap.add_argument("--prompt-ids", action="store_true",
                    help="send the servers each turn as the ids the model saw, not as text to tokenize again")
    a = ap.parse_args()
    for name in ("n", "threads", "ctx", "reps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1")
    data = json.loads(CONVERSATIONS.read_text())
    conversations = data["dev"] + data["eval"] if a.set == "all" else data[a.set]
    try:
        path = model_file(a.model)
    except Exception as e:
        ap.error(f"--model {a.model}: {e}")
    binary, ours_flags, server_flags = server_setup(ap, a.server_bin, a.threads, a.batch_invariant)
    server_flags += shlex.split(a.server_flags)
    prompt_ids = a.prompt_ids or a.batch_invariant
    also = shlex.split(a.also) if a.also else None
    retokenized = dict.fromkeys(SERVER_TYPES, 0)
    with tempfile.TemporaryDirectory() as tmp:
        calibrated = Path(tmp) / "calibrated"
        first = [data["dev"][0]["turns"][0]]
        run_specchat(calibrated, a.model, first, 16, a.threads, a.ctx, ours_flags)  # calibrates
        if also is not None:
            run_specchat(calibrated, a.model, first, 16, a.threads, a.ctx, also)
        shutil.rmtree(calibrated / "share")  # its costs stay, its transcript goes
        # runs[c][rep]: per conversation c, one pass each: ours, also, theirs (by server type)
        runs: list[list[tuple]] = [[] for _ in conversations]
        for rep in range(a.reps):
            # Each pass starts from the calibrated home and fresh servers: lookup's earlier replies (specchat's
            # transcripts) and ngram-mod's pool (the server's, kept across requests) then hold the pass's earlier
            # conversations, as a user's day would, and never an earlier pass's replies to the same messages.
            home = Path(tmp) / f"pass{rep}"
            shutil.copytree(calibrated, home)
            servers = [Server(binary, path, t, a.threads, a.ctx, server_flags) for t in SERVER_TYPES]
            try:
                for server in servers:  # warm-up: the first request of a process builds its graphs
                    server.chat([{"role": "user", "content": "Hello"}], 8)
                for c, convo in enumerate(conversations):
                    ours = run_specchat(home, a.model, convo["turns"], a.n, a.threads, a.ctx, ours_flags)
                    second = (run_specchat(home, a.model, convo["turns"], a.n, a.threads, a.ctx, also)
                              if also is not None else None)
                    theirs = {s.spec_type: s.conversation(convo["turns"], a.n, prompt_ids) for s in servers}
                    runs[c].append((ours, second, theirs))
            finally:
                for server in servers:
                    retokenized[server.spec_type] += server.retokenized
                    server.close()
        rows = []
        for c, convo in enumerate(conversations):
            for i in range(len(convo["turns"])):
                ours = median_run([run[0][i] for run in runs[c]])
                second = median_run([run[1][i] for run in runs[c]]) if also is not None else None
                theirs = {t: median_run([run[2][t][i] for run in runs[c]]) for t in SERVER_TYPES}
                rows.append((convo["name"], i, ours, theirs, second))
    print(f"# specchat chat vs llama-server · {a.model} · {a.set} set ({len(conversations)} conversations, "
          f"{len(rows)} turns) · greedy · {a.n} tokens a turn · {a.threads} threads · median of {a.reps}"
          + (f" · llama-server {a.server_flags}" if a.server_flags else "")
          + (" · batch-invariant build, -fa off on both sides" if a.batch_invariant else "")
          + (" · servers sent the ids the model saw" if prompt_ids else ""))
    if prompt_ids:
        print("# turns whose rendering did not extend the held text (tokenized whole again): "
              + ", ".join(f"{t} {n}" for t, n in retokenized.items()))
    if not has_chat_template(path):
        print(f"# {a.model} has no chat template: specchat writes a User:/Assistant: transcript that ends a reply at "
              "'\\nUser:', llama-server its own default template without that stop; the prompts and reply lengths "
              "differ (n), so these rows are not like for like")
    head = f"{'conversation':<14}{'turn':>5}{'specchat':>10}{'acc':>6}" + "".join(f"{t:>15}" for t in SERVER_TYPES)
    print(head + f"{'best server':>16}{'ratio':>8}" + (f"   {a.also}{'ratio':>8}" if also is not None else ""))
    firsts, laters, worst = [], [], (float("inf"), "")
    also_firsts, also_laters = [], []
    for name, i, ours, theirs, second in rows:
        best = max(SERVER_TYPES, key=lambda t: theirs[t]["tps"])
        ratio = ours["tps"] / theirs[best]["tps"]
        (firsts if i == 0 else laters).append(ratio)
        worst = min(worst, (ratio, f"{name} turn {i + 1}"))
        acc = f"{ours['accepted'] / ours['drafted']:.0%}" if ours["drafted"] else "-"
        cells = "".join(f"{theirs[t]['tps']:>15.1f}" for t in SERVER_TYPES)
        short = " (n " + ", ".join(f"{t} {theirs[t]['n']}" for t in SERVER_TYPES if theirs[t]["n"] != a.n) + ")" \
            if any(theirs[t]["n"] != a.n for t in SERVER_TYPES) or ours["n"] != a.n else ""
        extra = ""
        if second is not None:
            (also_firsts if i == 0 else also_laters).append(second["tps"] / theirs[best]["tps"])
            extra = f"{second['tps']:>{len(a.also) + 3}.1f}{second['tps'] / theirs[best]['tps']:>7.2f}x"
        own = " " if ours["text"] == theirs["none"]["text"] else "*"
        print(f"{name:<14}{i + 1:>5}{ours['tps']:>9.1f}{own}{acc:>6}{cells}{best:>16}{ratio:>7.2f}x{extra}{short}")
    parted = sum(ours["text"] != theirs["none"]["text"] for _, _, ours, theirs, _ in rows)
    print(f"(* specchat's text is not plain llama-server's: {parted} of {len(rows)} turns)")
    plain = [ours["tps"] / theirs["none"]["tps"] for _, _, ours, theirs, _ in rows]
    print(f"specchat / best llama-server, geomean: first turns {geomean(firsts):.2f}x (worst "
          f"{min(firsts):.2f}x), later turns {geomean(laters):.2f}x (worst {min(laters, default=float('nan')):.2f}x); "
          f"worst turn {worst[0]:.2f}x ({worst[1]})")
    print(f"specchat / plain llama-server (no drafting), geomean over all turns: {geomean(plain):.2f}x")
    for line in against_each(rows):
        print(line)
    if also is not None:
        print(f"specchat {a.also} / best llama-server, geomean: first turns {geomean(also_firsts):.2f}x (worst "
              f"{min(also_firsts):.2f}x), later turns {geomean(also_laters):.2f}x (worst "
              f"{min(also_laters, default=float('nan')):.2f}x)")


if __name__ == "__main__":
    main()
