"""Plain decoding on a chat's first turn: specchat against llama-server, each with flash attention on and off.

    python benchmarks/first_turn.py                       # SmolLM2, the eval set's first turns, 3 rounds
    python benchmarks/first_turn.py --model gemma-3-270m --rounds 5

A first turn copies little, so most of its steps are one-token decodes at a shallow depth, where llama.cpp's
CPU flash-attention kernel is the cheaper one (benchmarks/flash_attn.py) and specchat's `-fa auto` (off on
the CPU alone) gives that up for the later turns. This separates the kernel from everything else: the eval
set's first messages (benchmarks/data/chat_conversations.json, the model's chat template), greedy, -n tokens
with end-of-generation ignored; `specchat prompt --no-spec` with `-fa auto` and `-fa on`, `specchat prompt`
with its default drafter, and a plain llama-server (no drafting) with its default (on) and `-fa off`, all in
turn for each message, each round. Reported: each setting's median and geometric mean tok/s (generation only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_server import CONVERSATIONS, ROOT, Server, model_file  # noqa: E402
from vs_llamacpp import build  # noqa: E402

SPECCHAT = {"specchat --no-spec (-fa auto)": ["--no-spec"], "specchat --no-spec -fa on": ["--no-spec", "-fa", "on"],
            "specchat (lookup, -fa auto)": []}
SERVERS = {"llama-server (-fa auto: on)": [], "llama-server -fa off": ["-fa", "off"]}


def run_specchat(home: Path, model: str, message: str, n: int, threads: int, extra: list[str]) -> float:
    out = subprocess.run([sys.executable, "-m", "specchat.cli", "prompt", message, "-m", model, "--temp", "0", "-n",
                          str(n), "--ignore-eos", "--json", "-t", str(threads), *extra],
                         capture_output=True, text=True, env={**os.environ, "SPECCHAT_HOME": str(home)}, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"specchat failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)["stats"]["tokens_per_second"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model name from models.toml (default: smollm2-135m)")
    ap.add_argument("-n", type=int, default=128, help="tokens a turn (default 128)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-bin", type=Path, default=None, help="llama-server (default: build it once)")
    a = ap.parse_args()
    for name in ("n", "rounds", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1")
    try:
        path = model_file(a.model)
    except Exception as e:
        ap.error(f"--model {a.model}: {e}")
    binary = a.server_bin or build(a.threads, "llama-server").parent / "llama-server"
    if not binary.exists():
        ap.error(f"--server-bin {binary}: no such file")
    messages = [c["turns"][0] for c in json.loads(CONVERSATIONS.read_text())["eval"]]
    tps: dict[str, list[float]] = {name: [] for name in (*SERVERS, *SPECCHAT)}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        for extra in SPECCHAT.values():  # calibrate each setting's costs first, untimed
            run_specchat(home, a.model, "Hello", 8, a.threads, extra)
        servers = {name: Server(binary, path, "none", a.threads, 4096, flags) for name, flags in SERVERS.items()}
        try:
            for server in servers.values():  # the first request of a process builds its graphs
                server.chat([{"role": "user", "content": "Hello"}], 8)
            for _ in range(a.rounds):
                for message in messages:
                    for name, server in servers.items():
                        tps[name].append(server.chat([{"role": "user", "content": message}], a.n)["tps"])
                    for name, extra in SPECCHAT.items():
                        tps[name].append(run_specchat(home, a.model, message, a.n, a.threads, extra))
        finally:
            for server in servers.values():
                server.proc.terminate()
                server.proc.wait()
    print(f"# first turns, plain decoding · {a.model} · {len(messages)} eval first messages x {a.rounds} rounds · "
          f"greedy · {a.n} tokens · {a.threads} threads · tok/s")
    reference = statistics.geometric_mean(tps["llama-server (-fa auto: on)"])
    print(f"{'setting':<34}{'median':>8}{'geomean':>9}  vs llama-server default")
    for name, values in tps.items():
        geomean = statistics.geometric_mean(values)
        print(f"{name:<34}{statistics.median(values):>8.1f}{geomean:>9.1f}  {geomean / reference:.2f}x")


if __name__ == "__main__":
    main()
