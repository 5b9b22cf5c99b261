"""specchat's own time per step outside llama_decode: sampling, the rule, the drafter's bookkeeping, the policy.

    python -m benchmarks host                                   # the step table: real models, fixed k = 4
    python -m benchmarks host --context 512,8k,32k              # by context length, tiny llama pair
    python -m benchmarks host --context 512,8k,32k --stub       # by context length, no model at all
    python -m benchmarks host --context 512,8k,32k --evict-mb 64  # caches made cold after each decode

The time inside llama_decode is measured by wrapping llama_cpp.llama_decode in the process that generates
(harness.DecodeTimer), so any version of specchat is measured the same way. Fixed k = 4 and draft p-min 0,
so every drafting step drafts 4 tokens; each figure is the best of 3 generations of -n tokens.

- step table: ms per verify step and per emitted token spent outside llama_decode, for the draft model,
  prompt lookup and target-only, at temp 0 and 0.8 (llama.cpp's default sampler), on the Qwen2.5-Coder pair
  (1.5B + 0.5B) and on gemma-3-270m drafting for itself (--models qwen,gemma).
- --context: µs per step by context length (random words, then 64 tokens of the tiny models' bigram cycle),
  every drafter and sampler, each length in a process of its own, --reps processes, the best run per cell.
  --stub replaces the models by fixed random rows (a backend with no model): what is left is specchat's work.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import harness

TITLE = "host time per step outside llama_decode"
DEFAULTS = {"n": 128, "threads": 2, "reps": 2}
CODE_PROMPT = ("Write a Python function `merge_intervals(intervals)` that merges overlapping intervals, "
               "with a docstring and three doctests.")
SUMMARY_PROMPT = ("Summarise in two sentences: The Nile is the longest river in Africa. It flows north through "
                  "eleven countries and ends in a large delta in Egypt before reaching the Mediterranean Sea.")
SETUPS = {"qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", CODE_PROMPT),
          "gemma": ("gemma-3-270m", "gemma-3-270m", SUMMARY_PROMPT)}
SAMPLERS = {"greedy": {"temperature": 0.0}, "temp 0.8": {"temperature": 0.8},
            "temp 0.8 + repeat-penalty": {"temperature": 0.8, "repeat_penalty": 1.1}}
DRAFTERS = ("target only", "prompt lookup", "draft model")


def options(p) -> None:
    p.add_argument("--models", default="qwen,gemma", help="step table: qwen, gemma or both")
    p.add_argument("--context", help="context lengths, e.g. 512,8k,32k: the by-context table instead")
    p.add_argument("--stub", action="store_true", help="--context: no model, fixed rows")
    p.add_argument("--evict-mb", type=int, default=0, help="--context: read this many MB after each decode "
                   "(inside the decode's time), so every step starts from equally cold caches")


def step_table(a, result: harness.Result) -> None:
    import specchat
    from specchat.lookup import PromptLookup

    timer = harness.DecodeTimer()
    rows = []
    for key in a.models.split(","):
        target_name, draft_name, text = SETUPS[key]
        pair = specchat.load_pair(target=target_name, draft=draft_name, n_ctx=2048, n_gpu_layers=0,
                                  n_gpu_layers_draft=0, n_threads=a.threads, draft_p_min=0.0)
        if pair.target.chat_template:
            ids = pair.chat_prompt([{"role": "user", "content": text}])
        else:
            ids = pair.target.tokenize(text + "\nAnswer:")
        for label, drafter in (("draft model", pair.drafter), ("prompt lookup", PromptLookup(1, 4)),
                               ("target only", None)):
            for temp in (0.0, 0.8):
                r = harness.host_run(timer, pair.target, drafter, ids, 4, a.n, temperature=temp)
                rows.append([target_name, label, temp, r["steps"], r["host_ms_step"], r["host_ms_token"],
                             r["decode_ms_step"], r["host_ms_step"] / (r["host_ms_step"] + r["decode_ms_step"]),
                             "-" if r["accept"] is None else f"{r['accept']:.0%}"])
        pair.close()
    result.table(f"host overhead (outside llama_decode), fixed k = 4, -n {a.n}, best of 3 runs",
                 ["model", "drafter", "temp", "steps", "host ms/step:.3f", "host ms/token:.3f", "decode ms/step:.1f",
                  "host share:.1%", "accepted"], rows)


class StubModel:
    """A backend with no model: eval appends the tokens and lends fixed random rows over a 49k vocabulary."""

    name, path, memory = "stub", None, None

    def __init__(self, n_ctx: int, seed: int):
        import numpy as np

        self.rows = np.random.default_rng(seed).normal(0, 3, (17, 49152)).astype(np.float32)
        self.n_ctx, self.n_vocab = n_ctx, self.rows.shape[1]
        self.tokens: list[int] = []
        self.evaluated = self.rollback_recoveries = self.reevaluated = 0
        self.rollback_seconds = 0.0

    def eval(self, tokens, logits_at, *, in_place=False):
        self.tokens.extend(tokens)
        self.evaluated += len(tokens)
        return self.rows[: len(list(logits_at))]

    def truncate(self, n_keep: int) -> None:
        del self.tokens[n_keep:]

    def checkpoint(self, batch=None, *, turn=False) -> None:
        pass

    def is_eog(self, token: int) -> bool:
        return False

    def eog_tokens(self) -> tuple[int, ...]:
        return ()

    def token_bytes(self, token: int) -> bytes:
        return b" w"


def context_child(length: str, models: str, n: str, threads: str, evict_mb: str) -> dict:
    """One context length in this process: the best µs per step of every drafter and sampler."""
    import numpy as np

    from specchat.backend import LlamaCppBackend
    from specchat.drafters import DraftModel
    from specchat.lookup import PromptLookup

    length, n = int(length), int(n)
    tm = harness.tiny_models()
    tail = tm.bigram_chain(int(tm.cycle_tokens()[0]), 64)
    ids = np.random.default_rng(length).choice(tm.word_tokens(), length - len(tail)).tolist() + tail
    n_ctx = length + n + 64
    if models == "stub":
        target, draft = StubModel(n_ctx, 1), StubModel(n_ctx, 1)
    else:
        target, draft = (LlamaCppBackend(Path(models) / f"{role}.gguf", n_ctx=n_ctx, n_threads=int(threads),
                                         n_gpu_layers=0) for role in ("target", "draft"))
    timer = harness.DecodeTimer(int(evict_mb))
    drafters = {"target only": None, "prompt lookup": PromptLookup(1, 4), "draft model": DraftModel(draft)}
    out = {}
    for label in DRAFTERS:
        for sampler, settings in SAMPLERS.items():
            r = harness.host_run(timer, target, drafters[label], ids, 4, n, **settings)
            out[f"{label}|{sampler}"] = 1e3 * r["host_ms_step"]
    return out


def context_table(a, result: harness.Result) -> None:
    lengths = [int(float(x[:-1]) * 1024) if x.lower().endswith("k") else int(x) for x in a.context.split(",")]
    cells: dict[int, dict] = {}
    with harness.scratch("specchat-context-") as work:
        models = "stub"
        if not a.stub:
            target, draft = harness.tiny_models().write_pair(work, "llama")
            target.rename(work / "target.gguf")
            draft.rename(work / "draft.gguf")
            models = str(work)
        for _ in range(a.reps):
            for length in lengths:
                got = harness.child("suites.host:context_child", str(length), models, str(a.n), str(a.threads),
                                    str(a.evict_mb))
                cell = cells.setdefault(length, got)
                for key, value in got.items():
                    cell[key] = min(cell[key], value)
    names = [f"{x // 1024}k" if x % 1024 == 0 else str(x) for x in lengths]
    model = "no model (--stub: specchat's work alone)" if a.stub else "tiny llama pair (49k vocabulary)"
    rows = [[label, sampler, *(cells[x][f"{label}|{sampler}"] for x in lengths),
             cells[lengths[-1]][f"{label}|{sampler}"] / cells[lengths[0]][f"{label}|{sampler}"]]
            for label in DRAFTERS for sampler in SAMPLERS]
    result.table(f"host µs per step outside llama_decode by context length, {model}, fixed k = 4, -n {a.n}, best of "
                 f"3 runs x {a.reps} processes" + (f", caches evicted after each decode ({a.evict_mb} MB)"
                                                   if a.evict_mb else ""),
                 ["drafter", "sampler", *(f"{n}:.0f" for n in names), "last/first:.2fx"], rows)
    result.keep("cells", {str(k): v for k, v in cells.items()})


def run(a, result: harness.Result) -> None:
    if a.context:
        context_table(a, result)
    else:
        step_table(a, result)
