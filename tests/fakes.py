"""Test doubles: a Backend whose logits are a pure function of the token context, and scripted drafters.

`FakeBackend` implements `specchat.backend.Backend` exactly. Its logits for the next token depend only on
the tokens before it (`logits_fn(context) -> row`), so any KV-cache bookkeeping mistake (a rollback to the
wrong length, a stale token) shows up as wrong logits, and every eval / truncate is recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import math

import numpy as np

from specchat.backend import BackendError
from specchat.drafters import Draft, DraftModel, ModelDrafting
from specchat.kinds import DrafterKind
from specchat.lookup import Evidence, PromptLookup
from specchat.memory import MemoryKind
from specchat.policy import AdaptivePolicy
from specchat.costs import CostModel
from specchat.sampling import SamplingParams, sample
from specchat.vocab import VocabInfo

LogitsFn = Callable[[tuple[int, ...]], np.ndarray]

# a ChatML chat template (SmolLM2's and Qwen's shape), for fakes that need one
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# "é" is two UTF-8 bytes; byte_vocab() gives each its own token so the character spans two tokens
E_ACUTE = "é".encode()
assert len(E_ACUTE) == 2


def byte_vocab(n_vocab: int, extra: dict[int, bytes] | None = None) -> list[bytes]:
    """Token i -> one ASCII letter (a, b, c, ... wrapping), overridden by `extra`.

    `split_char_vocab` below is the usual override: two tokens that are the halves of a 2-byte character.
    """
    pieces = [bytes([ord("a") + i % 26]) for i in range(n_vocab)]
    for t, b in (extra or {}).items():
        pieces[t] = b
    return pieces


def split_char_vocab(n_vocab: int, first: int, second: int, char: str = "é", **more: bytes) -> list[bytes]:
    """A byte vocab where token `first` + token `second` spell `char` (a 2-byte UTF-8 character)."""
    b = char.encode()
    assert len(b) == 2, char
    return byte_vocab(n_vocab, {first: b[:1], second: b[1:]})


class FakeBackend:
    """Backend protocol over a pure function of the context.

    eval(tokens, logits_at) appends tokens and returns, for each index j in logits_at, logits_fn applied to
    the cached context up to and including tokens[j]. `calls` records (tokens, logits_at) per eval and
    `truncations` every truncate(n_keep) argument (no-op calls included).
    """

    def __init__(
        self,
        logits_fn: LogitsFn,
        n_vocab: int,
        *,
        n_ctx: int = 4096,
        eog: Sequence[int] = (),
        pieces: Sequence[bytes] | None = None,
        name: str = "fake",
        bos: int = -1,
        eos: int | None = None,
        add_bos: bool = False,
        vocab_type: int = 1,
        chat_template: str | None = None,
        cache: bool = True,
        memory: str = "kv",
        fail_restore: bool = False,
    ):
        """memory="checkpoints": a recurrent model whose state cannot be cut (see MemoryKind): the rows
        come from the tokens its state has really seen (`held`), so a cut that is not undone through a
        checkpoint shows up as wrong logits or as a counted recovery. fail_restore: restoring raises.
        The other failure switches are fail_after (a decode) and fail_cuts (a cut of the cache)."""
        self._logits_fn = logits_fn
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.name = name
        self.tokens: list[int] = []
        self.evaluated = 0
        self.rollback_recoveries = 0
        self.reevaluated = 0
        self.rollback_seconds = 0.0
        self.memory = MemoryKind(memory)
        self.fail_restore = fail_restore
        self.held: list[int] = []  # what a recurrent state has seen (== tokens for an attention cache)
        self.checkpoints: list[int] = []  # the length at each checkpoint taken
        self.restores = 0
        self._saved: dict[str, list[int]] = {}  # checkpoint slot ("step", "turn") -> the tokens it holds
        self.eog = frozenset(eog)
        self.pieces = list(pieces) if pieces is not None else byte_vocab(n_vocab)
        assert len(self.pieces) == n_vocab
        self.bos = bos
        self.eos = eos if eos is not None else (min(self.eog) if self.eog else -1)
        self.add_bos = add_bos
        self.vocab_type = vocab_type
        self._chat_template = chat_template
        self.calls: list[tuple[list[int], list[int]]] = []
        self._lent: np.ndarray | None = None  # the rows the last eval lent in place ...
        self._lent_bytes: bytes | None = None  # ... as they were lent
        self.truncations: list[int] = []
        self.removed: list[int] = []  # tokens each truncate call actually dropped (0 = no-op), parallel to truncations
        self._cache: dict[tuple[int, ...], np.ndarray] | None = {} if cache else None
        # the rest of the protocol: no file, no threads, no GPU or RPC, no BOS/EOS text
        self.path = None
        self.n_threads = 0
        self.n_gpu_layers = 0
        self.rpc: tuple[str, ...] = ()
        self.placement = None
        self.bos_text = self.eos_text = ""
        self.closed = False
        self._fail_in: int | None = None  # see fail_after
        self.tree_calls: list[tuple[int, list[int], list[int]]] = []  # (root, tokens, parents) per eval_tree
        self.kept_branches: list[list[int]] = []  # the tokens each keep_branch kept
        self._open_tree = None
        self._cuts_to_fail = 0  # see fail_cuts

    def fail_after(self, n_evals: int, message: str = "llama_decode returned -1") -> None:
        """The decode failure switch: the next `n_evals` evals work, the one after raises BackendError (as
        LlamaCppBackend does when llama_decode fails), once. As there, the failed eval leaves `tokens`
        and the cache as they were before it."""
        self._fail_in, self._fail_message = n_evals, message

    def fail_cuts(self, n: int | None = None) -> None:
        """The cut failure switch (an attention cache): the next `n` truncates that drop tokens (every one
        with None) fail as LlamaCppBackend's do when llama_memory_seq_rm refuses or the sliding window has
        recycled the cells: the cache starts over, a counted recovery, and the next eval reads every kept
        token again before its own."""
        assert self.memory.kind == "kv", "a recurrent fake cuts through checkpoints (see fail_restore)"
        self._cuts_to_fail = -1 if n is None else n

    # -- the protocol --------------------------------------------------------------------------------

    def logits_for(self, context: Sequence[int]) -> np.ndarray:
        """The row eval returns after `context` (float32, shape (n_vocab,))."""
        key = tuple(int(t) for t in context)
        return self._row(key)

    def _row(self, key: tuple[int, ...]) -> np.ndarray:
        if self._cache is not None:
            row = self._cache.get(key)
            if row is not None:
                return row
        row = np.asarray(self._logits_fn(key), dtype=np.float32)
        assert row.shape == (self.n_vocab,), row.shape
        if self._cache is not None:
            self._cache[key] = row
        return row

    def eval(self, tokens: Sequence[int], logits_at: Sequence[int], *, in_place: bool = False) -> np.ndarray:
        # the losslessness checks run this some 10^5 times a test: plain loops, no per-row numpy calls
        tokens = [int(t) for t in tokens]
        logits_at = [int(i) for i in logits_at]
        if self._fail_in is not None:
            if self._fail_in == 0:
                self._fail_in = None
                raise BackendError(self._fail_message)
            self._fail_in -= 1
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise BackendError(f"context full: {len(self.tokens)} + {len(tokens)} tokens > -c {self.n_ctx}")
        if tokens and not (0 <= min(tokens) and max(tokens) < self.n_vocab):
            bad = next(t for t in tokens if not 0 <= t < self.n_vocab)
            raise BackendError(f"token {bad} out of range for vocabulary of {self.n_vocab}")
        assert all(0 <= i < len(tokens) for i in logits_at), (logits_at, tokens)
        assert self._open_tree is None, "eval with a draft tree open (keep_branch first)"
        self.calls.append((tokens, logits_at))
        self._take_back_lent_rows()
        self._settle()
        start = len(self.held)
        self.tokens.extend(tokens)
        self.held.extend(tokens)
        self.evaluated += len(tokens)
        held = self.held
        # a new array (never the cached rows themselves: lent rows are poisoned later)
        rows = np.array([self._row(tuple(held[: start + i + 1])) for i in logits_at], dtype=np.float32)
        rows = rows.reshape(len(logits_at), self.n_vocab)
        if in_place:
            # writeable, as LlamaCppBackend's view of llama.cpp's buffer is (a read-only array would make
            # numpy copy it before an argmax); a caller must still never write one: see _take_back_lent_rows
            self._lent, self._lent_bytes = rows, rows.tobytes()
        return rows

    # -- draft trees: as LlamaCppBackend.eval_tree / keep_branch ------------------------------------------

    tree_sequences = 64  # what tree_capacity answers for an attention cache (n_seq_max)

    def tree_capacity(self) -> int:
        return self.tree_sequences if self.memory.kind == "kv" else 0

    def eval_tree(self, root: int, tree) -> np.ndarray:
        """Rows after the root and after each node, each from the context plus the node's own path; the
        cache then holds the context and the root until keep_branch adds the kept path."""
        n_leaves = max(1, len(tree.leaves()))
        assert n_leaves <= self.tree_capacity(), (n_leaves, self.tree_capacity())
        if self._fail_in is not None:
            if self._fail_in == 0:
                self._fail_in = None
                raise BackendError(self._fail_message)
            self._fail_in -= 1
        if len(self.tokens) + 1 + tree.depth() > self.n_ctx:
            raise BackendError(f"context full: {len(self.tokens)} + {1 + tree.depth()} tokens > -c {self.n_ctx}")
        self.tree_calls.append((int(root), list(tree.tokens), list(tree.parents)))
        self._take_back_lent_rows()
        self._settle()
        self.tokens.append(int(root))
        self.held.append(int(root))
        self.evaluated += len(tree) + 1
        base = tuple(self.held)
        rows = np.array([self._row(base)] + [self._row(base + tuple(tree.path_tokens(i))) for i in range(len(tree))],
                        dtype=np.float32)
        self._open_tree = tree
        self._lent, self._lent_bytes = rows, rows.tobytes()
        return rows

    def keep_branch(self, path) -> None:
        tree, self._open_tree = self._open_tree, None
        assert tree is not None, "keep_branch without eval_tree"
        assert all(tree.parents[b] == a for a, b in zip([-1, *path], path)), path
        kept = [tree.tokens[i] for i in path]
        self.kept_branches.append(kept)
        self.tokens.extend(kept)
        self.held.extend(kept)

    def _take_back_lent_rows(self) -> None:
        """Rows lent in place are llama.cpp's buffer in the real backend, valid until the next eval and
        never to be written. Check that nobody wrote them, then poison them, so a caller that kept them
        past this eval reads NaN instead of silently stale logits."""
        if self._lent is None:
            return
        self.check_lent_rows()
        self._lent.fill(np.nan)
        self._lent = self._lent_bytes = None

    def check_lent_rows(self) -> None:
        """Fail if a caller wrote into the rows the last eval lent in place (each eval checks it too)."""
        if self._lent is not None:
            assert self._lent.tobytes() == self._lent_bytes, \
                f"a caller wrote into rows {self.name} lent in place (llama.cpp's own logits buffer)"

    def truncate(self, n_keep: int) -> None:
        assert n_keep >= 0, n_keep
        if self._open_tree is not None:  # as LlamaCppBackend: a tree left open keeps only its root
            self.keep_branch([])
        self.truncations.append(n_keep)
        self.removed.append(max(0, len(self.tokens) - n_keep))
        if n_keep < len(self.tokens):
            del self.tokens[n_keep:]
        if self.memory.kind == "kv" and not self._cuts_to_fail:
            del self.held[n_keep:]  # an attention cache cuts anywhere (a cut set to fail waits for _settle)

    def checkpoint(self, batch: int | None = None, *, turn: bool = False) -> None:
        if self.memory.kind == "kv":
            return
        self._settle()
        self.checkpoints.append(len(self.tokens))
        self._saved["turn" if turn else "step"] = list(self.held)

    def _settle(self) -> None:
        """Bring the cache back to a prefix of `tokens` before it is used. A recurrent state that has seen
        more goes back to the checkpoint and evaluates the kept tokens again; without a usable checkpoint,
        or when fail_cuts made an attention cache's cut fail, it starts over (a counted recovery)."""
        if self.held == self.tokens:
            return
        if self.memory.kind == "kv" and len(self.held) > len(self.tokens):  # a cut fail_cuts made fail
            # as LlamaCppBackend._cut with nothing to restore: clear the cache, read what is kept again
            self._cuts_to_fail -= 1
            self.rollback_recoveries += 1
            self.held = []
        elif self.held != self.tokens[: len(self.held)]:  # the state has seen tokens that were cut since
            usable = [c for c in self._saved.values() if c == self.tokens[: len(c)]]
            saved = max(usable, key=len, default=None)
            if saved is not None:
                if self.fail_restore:  # as the real backend: start over, and say so
                    self.held, self._saved = [], {}
                    self.rollback_recoveries += 1
                    raise BackendError(f"restoring the recurrent-state checkpoint of {self.name} failed")
                self.restores += 1
                self.held = list(saved)
            else:
                self.rollback_recoveries += 1
                self.held, self._saved = [], {}
        redo = self.tokens[len(self.held):]
        self.reevaluated += len(redo)
        self.evaluated += len(redo)
        self.held.extend(redo)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Greedy longest match over the pieces (the first token wins among equal pieces)."""
        data = text.encode("utf-8")
        by_piece: dict[bytes, int] = {}
        for t, piece in enumerate(self.pieces):
            if piece and t not in self.eog:
                by_piece.setdefault(piece, t)
        longest = max((len(p) for p in by_piece), default=1)
        out = [self.bos] if add_special and self.add_bos and self.bos >= 0 else []
        i = 0
        while i < len(data):
            for n in range(min(longest, len(data) - i), 0, -1):
                t = by_piece.get(data[i : i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                raise ValueError(f"fake vocab cannot spell byte {data[i:i + 1]!r}")
        return out

    def token_bytes(self, token: int) -> bytes:
        return b"" if token in self.eog else self.pieces[token]

    def is_eog(self, token: int) -> bool:
        return token in self.eog

    def eog_tokens(self) -> tuple[int, ...]:
        return tuple(sorted(self.eog))

    def close(self) -> None:
        self.closed = True

    @property
    def vocab(self) -> VocabInfo:
        pieces = self.pieces
        return VocabInfo(
            vocab_type=self.vocab_type,
            n_vocab=self.n_vocab,
            bos=self.bos,
            eos=self.eos,
            add_bos=self.add_bos,
            add_eos=False,
            token_text=lambda t: pieces[t],
        )

    @property
    def chat_template(self) -> str | None:
        return self._chat_template


# -- logits functions ----------------------------------------------------------------------------------


def const_logits(row: Sequence[float]) -> LogitsFn:
    """The same row after every context."""
    arr = np.asarray(row, dtype=np.float32)
    return lambda ctx: arr


def markov_logits(table: np.ndarray) -> LogitsFn:
    """Row table[last token] (a first-order Markov model)."""
    table = np.asarray(table, dtype=np.float32)
    return lambda ctx: table[ctx[-1]]


def script_logits(n_vocab: int, prompt_len: int, wanted: Sequence[int], high: float = 10.0, after: int | None = None) -> LogitsFn:
    """A target whose argmax after prompt + wanted[:i] is wanted[i] whatever the earlier tokens were (it
    only looks at the context length); past the end of `wanted` it prefers `after` (default token 0)."""

    def fn(ctx: tuple[int, ...]) -> np.ndarray:
        row = np.zeros(n_vocab, dtype=np.float32)
        i = len(ctx) - prompt_len
        want = wanted[i] if 0 <= i < len(wanted) else (0 if after is None else after)
        row[want] = high
        return row

    return fn


def logits_of(p: Sequence[float]) -> np.ndarray:
    """Logits whose softmax is p (zeros become -inf: never sampled)."""
    p = np.asarray(p, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.log(p / p.sum())


# -- drafters ------------------------------------------------------------------------------------------


SCRIPTED = DrafterKind("scripted", "scripted drafter", factory=lambda build: ScriptedDrafter())


class ScriptedDrafter(ModelDrafting):
    """A Drafter that proposes what the test says.

    script: a list consumed one entry per propose() call; an entry is a list of tokens (deterministic,
    q = None each), a Draft (tokens, q rows), or None (propose nothing). When the script runs out it
    proposes nothing, or calls `fallback(context, k)` if given.
    q_fn: instead of a script, sample k tokens autoregressively from q_fn(context + drafts so far) with the
    engine's rng (a stochastic drafter whose q is exactly known).
    Proposals are cut to k, as a real drafter does. `proposals` records (context, k) per call.
    """

    kind = SCRIPTED  # priced like a draft model (per-position acceptance), costing nothing unless told
    backend = None

    def __init__(
        self,
        script: Sequence[list[int] | Draft | None] = (),
        *,
        q_fn: Callable[[tuple[int, ...]], np.ndarray] | None = None,
        fallback: Callable[[Sequence[int], int], Draft] | None = None,
        room: int = 1 << 30,
    ):
        super().__init__()
        self.script = list(script)
        self.q_fn = q_fn
        self.fallback = fallback
        self._room = room
        self.prefilled: list[list[int]] = []
        self.proposals: list[tuple[list[int], int]] = []

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self.prefilled.append(list(prompt_ids))

    def room(self) -> int:
        return self._room

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        self.proposals.append((list(context), k))
        if k <= 0:
            return Draft()
        if self.q_fn is not None:
            draft = Draft()
            ctx = tuple(context)
            for _ in range(k):
                q = np.asarray(self.q_fn(ctx), dtype=np.float64)
                t = sample(q, rng)
                draft.tokens.append(t)
                draft.q.append(q)
                ctx = ctx + (t,)
            return draft
        if self.script:
            entry = self.script.pop(0)
        elif self.fallback is not None:
            entry = self.fallback(context, k)
        else:
            entry = None
        if entry is None:
            return Draft()
        if isinstance(entry, Draft):
            return Draft(tokens=list(entry.tokens[:k]), q=list(entry.q[:k]))
        tokens = [int(t) for t in entry[:k]]
        return Draft(tokens=tokens, q=[None] * len(tokens))


# -- the policy's view of a step, for tests that drive it by hand ------------------------------------------


class SetLookup(PromptLookup):
    """Prompt lookup whose next proposal the test sets (`next`); its estimate and learning are the real ones."""

    def __init__(self):
        super().__init__()
        self.next = Draft()

    def propose(self, context, k, params, rng):
        return self.next


def found(tokens, match_len: int, history: bool = False) -> Draft:
    """A lookup proposal of `tokens` continuing a `match_len`-token match in the conversation (or, with
    `history`, in earlier replies)."""
    return Draft(list(tokens), [None] * len(tokens), source="history" if history else "prompt-lookup",
                 evidence=Evidence(match_len, history=history))


def sent(policy, drafter, proposal: Draft | None = None, limit: int = 16) -> int:
    """How many tokens the policy sends this step (the engine's call), lookup proposing `proposal`."""
    if proposal is not None:
        drafter.next = proposal
    return len(policy.draft(drafter, [1, 2, 3], limit, SamplingParams(temperature=0.0), np.random.default_rng(0)).tokens)


def modelled(verify: CostModel, draft_cost: CostModel | None, draft_max: int = 8) -> tuple[AdaptivePolicy, ScriptedDrafter]:
    """An adaptive policy over a draft model (a scripted one that drafts whatever k it is asked for)."""
    drafter = ScriptedDrafter(fallback=lambda context, k: list(range(1, k + 1)))
    return AdaptivePolicy(drafter, verify, draft_max=draft_max, draft_costs=[draft_cost]), drafter


class Alternating:
    """A policy that hands the step to the chain's drafters in turn, k tokens each: which drafter drafts
    must not depend on the target's future, and this depends on nothing but the step count."""

    drafting_possible = True

    def __init__(self, k: int, start: int = 0):
        self.k = k
        self.calls = start

    def draft(self, drafter, context, limit, params, rng):
        self.calls += 1
        member = drafter.members[self.calls % len(drafter.members)]
        draft = member.propose(context, min(self.k, limit), params, rng)
        draft.drafter = member
        return draft

    def observe(self, step, emitted):
        pass

    def enter(self, phase):
        pass

    def finish(self):
        pass


def make_draft_model(
    logits_fn: LogitsFn, n_vocab: int, *, n_ctx: int = 4096, p_min: float = 0.0, draft_min: int = 0, **kw
) -> tuple[DraftModel, FakeBackend]:
    """The real specchat DraftModel over a FakeBackend (returned too, to inspect its KV cache)."""
    backend = FakeBackend(logits_fn, n_vocab, n_ctx=n_ctx, name="fake-draft", **kw)
    return DraftModel(backend, p_min=p_min, draft_min=draft_min), backend


# ---------------------------------------------------------------------------------------------------------
# chi-square goodness of fit, for the losslessness tests (no scipy needed)

ALPHA = 1e-4  # a losslessness check fails when its chi-square p-value is below this
DELTA = 0.01  # the absolute error in one token's probability a check must catch ...
POWER = 0.9  # ... with this probability


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)
    (series for small x, Lentz continued fraction for large x, as in Numerical Recipes)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(100000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 100000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        step = d * c
        h *= step
        if abs(step - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_isf(alpha: float, df: int) -> float:
    """The x with chi2_sf(x, df) == alpha (bisection)."""
    lo, hi = 0.0, 10.0 * df + 200.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi2_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _cells(probs: np.ndarray, n: int, min_expected: float = 5.0) -> list[np.ndarray]:
    """Index groups of the chi-square cells: one per token (or pair) with enough expected count, the
    rest of the non-zero ones pooled into one cell."""
    flat = probs.ravel()
    ids = np.flatnonzero(flat > 0)
    big = ids[flat[ids] * n >= min_expected]
    small = ids[flat[ids] * n < min_expected]
    cells = [np.array([i]) for i in big]
    if len(small):
        if flat[small].sum() * n >= min_expected or not cells:
            cells.append(small)
        else:  # too little even pooled: pool it with the smallest big cell
            j = int(np.argmin(flat[big]))
            cells[j] = np.concatenate([cells[j], small])
    return cells


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of observed counts to probabilities. A draw in a zero-probability cell is an
    outright failure (p = 0): it can never happen under the target."""
    counts, probs = np.asarray(counts).ravel(), np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape
    assert abs(probs.sum() - 1) < 1e-9
    if counts[probs <= 0].sum() > 0:
        return 0.0
    n = int(counts.sum())
    cells = _cells(probs, n)
    if len(cells) < 2:
        return 1.0
    obs = np.array([counts[c].sum() for c in cells], dtype=np.float64)
    exp = np.array([probs[c].sum() for c in cells]) * n
    stat = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(stat, len(cells) - 1)


def detection_power(n: int, probs: np.ndarray, delta: float = DELTA, alpha: float = ALPHA) -> float:
    """Power of chi2_pvalue(., probs) < alpha against the hardest-to-see error of size delta: one token's
    probability off by delta, the difference spread proportionally over the others. Its non-centrality is
    n * delta^2 / (p (1 - p)), smallest for the token whose p is nearest 1/2. (Monte Carlo over numpy's
    non-central chi-square, fixed seed.)"""
    flat = np.asarray(probs, dtype=np.float64).ravel()
    pos = flat[flat > 0]
    candidates = pos[(pos >= delta) & (pos <= 1 - delta)]
    if len(candidates) == 0:
        return 1.0
    lam = n * delta**2 * float(np.min(1.0 / (candidates * (1 - candidates))))
    df = len(_cells(flat, n)) - 1
    crit = chi2_isf(alpha, df)
    sims = np.random.default_rng(0).noncentral_chisquare(df, lam, 40_000)
    return float(np.mean(sims > crit))


def draws_for(probs: np.ndarray, delta: float = DELTA, power: float = POWER) -> int:
    """Fewest draws (a multiple of 5k, at least 20k) detecting a `delta` error with the wanted power."""
    n = 20_000
    while detection_power(n, probs, delta) < power:
        n += 5_000
        assert n <= 400_000, "distribution needs too many draws for a unit test"
    return n


def first_two_emitted(gen) -> tuple[int, int]:
    """The first two tokens a `generate` run emits; the generator is closed after them (its cache
    bookkeeping runs as it would for a consumer that stops there)."""
    from specchat.engine import TokenEvent

    got = []
    for event in gen:
        if isinstance(event, TokenEvent):
            got.append(event.id)
            if len(got) == 2:
                break
    gen.close()
    return got[0], got[1]


def assert_user_error(result, *needles: str):
    """A command that failed as every bad input must: exit 2, one line on stderr, nothing on stdout."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("specchat: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""
