"""Does llama.cpp's backend sampling pay on this machine? (issue: the loop's own cost)

llama.cpp 0.3.36 can run a sampler chain inside llama_decode (`llama_context_params.samplers`, or
`llama_set_sampler`), returning per output position the surviving candidates and their probabilities.
This compares, in one process and alternating, three contexts on the same model:

- plain: llama_decode, then specchat's own work on the logits row (argmax, or `sampling.process`)
- greedy chain: llama.cpp's greedy sampler inside decode (an argmax node in the graph)
- top-k chain: top-k 40, top-p 0.95, min-p 0.05, temp 0.8, dist inside decode, read back as
  (candidates, probabilities)

for one-token decodes (target-only decoding, a draft model's steps) and for a 5-token verify batch
(`n_outputs_max_per_seq` = 5), with the context memory each needs and whether the top-k chain's
probabilities equal `sampling.process` on the same logits.

    python benchmarks/backend_sampling.py [--model gemma-3-270m] [-n 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_cpp as L  # noqa: E402

from specchat.config import load_config  # noqa: E402
from specchat.sampling import SamplingParams, greedy_token, process, sample  # noqa: E402
from specchat.sources import resolve  # noqa: E402

PARAMS = SamplingParams()  # llama.cpp's defaults: top-k 40, top-p 0.95, min-p 0.05, temp 0.8
VERIFY = 5


@L.llama_log_callback
def _quiet(level, text, user_data):  # llama.cpp's log lines would bury the table
    pass


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Context:
    def __init__(self, model, kind: str, threads: int):
        self.kind = kind
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 2048, 512, 512
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.chain = None
        if kind != "plain":
            chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
            if kind == "greedy chain":
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            else:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(PARAMS.top_k))
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(PARAMS.top_p, 1))
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(PARAMS.min_p, 1))
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(PARAMS.temperature))
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(1))
            self.configs = (L.llama_sampler_seq_config * 1)()
            self.configs[0].seq_id = 0
            self.configs[0].sampler = ctypes.cast(chain, ctypes.c_void_p)
            cp.samplers, cp.n_samplers = self.configs, 1
            cp.n_outputs_max_per_seq = VERIFY
            self.chain = chain
        before = rss_mib()
        self.ctx = L.llama_init_from_model(model, cp)
        if not self.ctx:
            raise SystemExit(f"could not create the {kind} context")
        self.batch = L.llama_batch_init(512, 0, 1)
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        self.pos = 0
        self.alloc_mib = rss_mib() - before

    def decode(self, tokens, outputs) -> None:
        b = self.batch
        for j, t in enumerate(tokens):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = t, self.pos + j, 1, int(j in outputs)
            b.seq_id[j][0] = 0
        b.n_tokens = len(tokens)
        if L.llama_decode(self.ctx, b) != 0:
            raise SystemExit(f"llama_decode failed ({self.kind})")
        self.pos += len(tokens)

    def next_token(self, i: int, temp: float, rng) -> int:
        """The token after output i, as each path gets it."""
        if self.kind == "plain":
            row = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
            params = SamplingParams(temperature=temp)
            return greedy_token(row, params, ()) if params.greedy else sample(process(row, params, ()), rng)
        if self.kind == "greedy chain":
            return int(L.llama_get_sampled_token_ith(self.ctx, i))
        n = L.llama_get_sampled_candidates_count_ith(self.ctx, i)
        ids = np.ctypeslib.as_array(L.llama_get_sampled_candidates_ith(self.ctx, i), shape=(n,))
        probs = np.ctypeslib.as_array(L.llama_get_sampled_probs_ith(self.ctx, i),
                                      shape=(L.llama_get_sampled_probs_count_ith(self.ctx, i),))
        return int(ids[int(np.argmax(probs))]) if len(ids) else int(L.llama_get_sampled_token_ith(self.ctx, i))

    def reset(self, keep: int) -> None:
        L.llama_memory_seq_rm(self.mem, 0, keep, -1)
        self.pos = keep


def compare_probs(plain: Context, chain: Context, prompt: list[int]) -> float:
    """Max |p_llama.cpp - p_specchat| over the candidates, same prompt, same single-output decode."""
    for c in (plain, chain):
        c.reset(0)
        c.decode(prompt, {len(prompt) - 1})
    row = np.ctypeslib.as_array(L.llama_get_logits_ith(plain.ctx, -1), shape=(plain.n_vocab,)).copy()
    ours = process(row, PARAMS, ())
    n = L.llama_get_sampled_candidates_count_ith(chain.ctx, -1)
    ids = np.ctypeslib.as_array(L.llama_get_sampled_candidates_ith(chain.ctx, -1), shape=(n,)).astype(np.int64)
    probs = np.ctypeslib.as_array(L.llama_get_sampled_probs_ith(chain.ctx, -1),
                                  shape=(L.llama_get_sampled_probs_count_ith(chain.ctx, -1),)).astype(np.float64)
    theirs = np.zeros(plain.n_vocab)
    theirs[ids[: len(probs)]] = probs
    print(f"top-k chain: {n} candidates, {int((theirs > 0).sum())} with probability; specchat keeps {len(ours.ids)}")
    return float(np.abs(theirs - np.asarray(ours)).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("-t", "--threads", type=int, default=2)
    a = parser.parse_args()
    path = resolve(load_config().model(a.model))
    L.llama_backend_init()
    L.llama_log_set(_quiet, ctypes.c_void_p())
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    vocab = L.llama_model_get_vocab(model)
    buf = (L.llama_token * 64)()
    text = b"Write a short story about a river that flows to the sea."
    prompt = list(buf[: L.llama_tokenize(vocab, text, len(text), buf, 64, True, False)])
    contexts = [Context(model, kind, a.threads) for kind in ("plain", "greedy chain", "top-k chain")]
    print(f"# backend sampling vs specchat's own, {a.model}, {a.threads} threads, -n {a.n}, {a.rounds} alternating rounds (median)")
    for c in contexts:
        print(f"{c.kind:<14} context allocation: +{c.alloc_mib:.0f} MiB peak RSS")
    diff = compare_probs(contexts[0], contexts[2], prompt)
    print(f"top-k chain probabilities vs sampling.process on the same logits: max |diff| = {diff:.2e}")
    rng = np.random.default_rng(1)
    one = {(c.kind, t): [] for c in contexts for t in (0.0, 0.8)}
    verify = {c.kind: [] for c in contexts}
    for _ in range(a.rounds):
        for c in contexts:
            for temp in (0.0, 0.8):
                if c.kind != "plain" and (temp == 0.0) != (c.kind == "greedy chain"):
                    continue
                c.reset(0)
                c.decode(prompt, {len(prompt) - 1})
                token = c.next_token(-1, temp, rng)
                started = time.perf_counter()
                for _ in range(a.n):
                    c.decode([token], {0})
                    token = c.next_token(0, temp, rng)
                one[(c.kind, temp)].append(1e3 * (time.perf_counter() - started) / a.n)
            keep = c.pos
            started = time.perf_counter()
            for _ in range(8):
                c.decode(prompt[:VERIFY], set(range(VERIFY)))
                for i in range(VERIFY):
                    c.next_token(i, 0.8 if c.kind != "greedy chain" else 0.0, rng)
                c.reset(keep)
            verify[c.kind].append(1e3 * (time.perf_counter() - started) / 8)
    print(f"\n{'path':<14}{'temp':>6}{'ms per token (decode + sampling)':>36}")
    for (kind, temp), values in one.items():
        if values:
            print(f"{kind:<14}{temp:>6}{statistics.median(values):>36.3f}")
    print(f"\n{'path':<14}{'ms per ' + str(VERIFY) + '-token verify batch, all rows read':>48}")
    for kind, values in verify.items():
        print(f"{kind:<14}{statistics.median(values):>48.2f}")


if __name__ == "__main__":
    main()
