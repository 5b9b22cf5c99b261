"""Train Medusa heads for a GGUF model on text the model itself writes (self-distillation), on the CPU:

    python -m specchat.medusa_train MODEL OUT.safetensors [--heads 4] [--prompts N] [--tokens N]

MODEL is anything `-m` takes (a models.toml name, a .gguf path). It writes replies to made-up instructions
(TOPICS x TASKS below: no evaluation prompt of specchat's is among them), reads the model's final hidden
state at every position of each reply (one batch per reply), and fits each head's residual block,
x + SiLU(W x + b) with W and b from zero, to the token k + 2 places ahead, through the model's own output
matrix restricted to the replies' most frequent tokens (the shortlist, stored in the file). Only the blocks
are trained, with Adam in numpy; the output matrix is the target's (text-generation-inference's v2
layout), so a file holds K x (hidden^2 + hidden) numbers and the shortlist. It prints each head's top-1
accuracy on the replies of held-out instructions (every fifth).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .backend import LlamaCppBackend
from .config import load_config
from .engine import Finished, generate
from .medusa import SHORTLIST_KEY, output_rows
from .sampling import SamplingParams
from .sources import resolve
from .template import render

TOPICS = [
    "volcanoes", "the water cycle", "photosynthesis", "black holes", "the printing press", "honey bees",
    "compound interest", "the immune system", "plate tectonics", "recycling plastic", "the Roman roads",
    "sourdough bread", "electric cars", "the moon landing", "coral reefs", "sleep", "public libraries",
    "chess openings", "rainbows", "the internet", "glaciers", "vaccines", "wind turbines", "the violin",
    "tea", "bicycles", "migratory birds", "earthquakes", "solar panels", "the stock market", "penguins",
    "lighthouses", "the metric system", "composting", "submarines", "paper money", "deserts", "gardening",
]
TASKS = [
    "Explain {t} to a ten-year-old.", "Write three short facts about {t}.",
    "Give me a short history of {t}.", "What are the advantages and disadvantages of {t}?",
    "Write a short poem about {t}.", "Describe {t} in one paragraph.", "List five questions a student might ask about {t}.",
    "Write a short story that involves {t}.", "How would you teach a friend about {t}?",
    "Write a Python function related to {t}, with a docstring.",
]


def instructions(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    pairs = [(t, task) for t in TOPICS for task in TASKS]
    order = rng.permutation(len(pairs))[:n]
    return [pairs[i][1].format(t=pairs[i][0]) for i in order]


def write_replies(target: LlamaCppBackend, prompts: list[str], max_tokens: int, log) -> list[tuple[list[int], int]]:
    """(prompt + reply ids, where the reply starts) for each instruction: greedy, as the model answers
    most often, and sampled at 0.7 every other prompt, so the heads see its distribution, not one path."""
    out = []
    for i, text in enumerate(prompts):
        ids = render(target, [{"role": "user", "content": text}]).token_ids
        params = SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=0.7, seed=i)
        finished = None
        for event in generate(target, None, ids, params, max_tokens=max_tokens):
            if isinstance(event, Finished):
                finished = event
        target.truncate(0)
        out.append((ids + finished.token_ids, len(ids)))
        log(f"reply {i + 1}/{len(prompts)}: {len(finished.token_ids)} tokens")
    return out


def hidden_rows(target: LlamaCppBackend, ids: list[int]) -> np.ndarray:
    """The final hidden row at every position of `ids`, in one evaluation."""
    rows: list[np.ndarray] = []
    target.capture_final(lambda positions, r: rows.append(r.copy()))
    try:
        target.truncate(0)
        target.eval(ids, range(len(ids)))
    finally:
        target.capture_final(None)
        target.truncate(0)
    return np.concatenate(rows)


def pairs(sequences, hidden, n_heads: int, shortlist_index: np.ndarray):
    """Per head: (hidden rows h_t, shortlist index of x_{t+k+2}) over reply positions whose target is listed."""
    xs, ys = [[] for _ in range(n_heads)], [[] for _ in range(n_heads)]
    for (ids, start), h in zip(sequences, hidden):
        for k in range(n_heads):
            # h_t for t from the prompt's last position: head k guesses ids[t + k + 2]
            for t in range(start - 1, len(ids) - k - 2):
                y = shortlist_index[ids[t + k + 2]]
                if y >= 0:
                    xs[k].append(h[t])
                    ys[k].append(y)
    return [(np.array(x, np.float32).reshape(-1, hidden[0].shape[1]), np.array(y, np.int64)) for x, y in zip(xs, ys)]


def train_head(x: np.ndarray, y: np.ndarray, projection: np.ndarray, epochs: int, lr: float, seed: int,
               log) -> tuple[np.ndarray, np.ndarray]:
    """W, b of one residual block minimising the cross-entropy of softmax(P (h + SiLU(W h + b))) over the
    shortlist, with Adam; W and b start at zero (the head starts as the model's own next-token guess)."""
    d = x.shape[1]
    w, b = np.zeros((d, d), np.float32), np.zeros(d, np.float32)
    m = [np.zeros_like(w), np.zeros_like(b)]
    v = [np.zeros_like(w), np.zeros_like(b)]
    rng = np.random.default_rng(seed)
    step, batch = 0, 256
    for epoch in range(epochs):
        total = 0.0
        for idx in np.array_split(rng.permutation(len(x)), max(1, len(x) // batch)):
            h, target = x[idx], y[idx]
            z = h @ w.T + b
            sig = 1.0 / (1.0 + np.exp(-z))
            u = h + z * sig
            logits = u @ projection.T
            logits -= logits.max(axis=1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=1, keepdims=True)
            total += float(-np.log(p[np.arange(len(idx)), target] + 1e-12).sum())
            p[np.arange(len(idx)), target] -= 1.0
            du = (p @ projection) / len(idx)
            dz = du * (sig * (1.0 + z * (1.0 - sig)))  # d SiLU(z) / dz
            grads = [dz.T @ h, dz.sum(axis=0)]
            step += 1
            for i, (param, g) in enumerate(zip((w, b), grads)):
                m[i] = 0.9 * m[i] + 0.1 * g
                v[i] = 0.999 * v[i] + 0.001 * g * g
                param -= lr * (m[i] / (1 - 0.9 ** step)) / (np.sqrt(v[i] / (1 - 0.999 ** step)) + 1e-8)
        log(f"  epoch {epoch + 1}/{epochs}: loss {total / len(x):.3f}")
    return w, b


def accuracy(x, y, w, b, projection) -> float:
    z = x @ w.T + b
    u = x + z / (1.0 + np.exp(-z))
    return float(np.mean(np.argmax(u @ projection.T, axis=1) == y)) if len(y) else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specchat.medusa_train", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a models.toml name or a .gguf path")
    parser.add_argument("out", type=Path, help="the head file to write (.safetensors)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=200, help="made-up instructions to answer")
    parser.add_argument("--tokens", type=int, default=192, help="most tokens of each reply")
    parser.add_argument("--shortlist", type=int, default=4096, help="the most frequent reply tokens the heads score")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.heads < 1 or args.prompts < 5 or args.tokens < 8 or args.shortlist < 16:
        parser.error("need --heads >= 1, --prompts >= 5, --tokens >= 8, --shortlist >= 16")

    def log(line: str) -> None:
        sys.stderr.write(line + "\n")

    started = time.perf_counter()
    path = resolve(load_config().model(args.model))
    target = LlamaCppBackend(path, n_ctx=2048, n_threads=args.threads, name=args.model, outputs=1)
    output = output_rows(path)
    if output is None:
        parser.error(f"{path.name} has neither output.weight nor token_embd.weight")
    sequences = write_replies(target, instructions(args.prompts), args.tokens, log)
    log(f"replies written in {time.perf_counter() - started:.0f} s; reading hidden states")
    hidden = [hidden_rows(target, ids) for ids, _ in sequences]
    # the shortlist: the replies' most frequent tokens (their share of reply tokens is printed)
    counts = np.bincount(np.concatenate([np.asarray(ids[start:]) for ids, start in sequences]), minlength=target.n_vocab)
    shortlist = np.argsort(-counts, kind="stable")[: args.shortlist]
    shortlist = np.sort(shortlist[counts[shortlist] > 0])
    index = np.full(target.n_vocab, -1, np.int64)
    index[shortlist] = np.arange(len(shortlist))
    log(f"shortlist: {len(shortlist)} tokens cover {counts[shortlist].sum() / counts.sum():.1%} of the reply tokens")
    projection = np.ascontiguousarray(output(shortlist), dtype=np.float32)
    held_out = [i % 5 == 4 for i in range(len(sequences))]
    train = pairs([s for s, h in zip(sequences, held_out) if not h], [x for x, h in zip(hidden, held_out) if not h],
                  args.heads, index)
    test = pairs([s for s, h in zip(sequences, held_out) if h], [x for x, h in zip(hidden, held_out) if h],
                 args.heads, index)
    tensors: dict[str, np.ndarray] = {SHORTLIST_KEY: shortlist.astype(np.int32)}
    for k in range(args.heads):
        log(f"head {k} (token t + {k + 2}): {len(train[k][1])} training pairs")
        w, b = train_head(*train[k], projection, args.epochs, args.lr, seed=k, log=log)
        tensors[f"{k}.0.linear.weight"] = w.astype(np.float16)
        tensors[f"{k}.0.linear.bias"] = b.astype(np.float16)
        before = accuracy(*test[k], np.zeros_like(w), np.zeros_like(b), projection)
        log(f"head {k}: held-out top-1 {accuracy(*test[k], w, b, projection):.1%} "
            f"(untrained, the model's own next-token guess: {before:.1%})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out))
    log(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - started:.0f} s")
    target.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
