"""Who proposes the draft tokens: a second (small) model, or n-gram lookup over the text so far."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .backend import Backend, BackendError, check_compatible, sync
from .sampling import Dist, SamplingParams, draft_confidence, greedy_token, process, sample


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # q[i]: the processed distribution tokens[i] was drawn from; None = deterministic proposal (one-hot)
    q: list[Dist | None] = field(default_factory=list)
    # how good the source looked: prompt lookup's matched n-gram length, a draft model's top probability
    confidence: float = 0.0


class Drafter(Protocol):
    kind: str  # "draft-model" | "prompt-lookup"

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Called before generation starts, so prompt work is not billed to the first step."""

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        """Up to k tokens that might follow `context`."""

    def room(self) -> int:
        """How many more tokens this drafter can look at (context size)."""


class IncompatibleDraft(BackendError):
    pass


class DraftModel:
    """A second GGUF model sharing the target's vocabulary: proposes by sampling its own distribution."""

    kind = "draft-model"

    def __init__(self, backend: Backend, p_min: float = 0.0, draft_min: int = 0):
        self.backend = backend
        self.p_min = p_min
        self.draft_min = draft_min

    @classmethod
    def checked(cls, backend: Backend, target: Backend, **kw) -> DraftModel:
        problem = check_compatible(target.vocab, backend.vocab)
        if problem:
            raise IncompatibleDraft(
                f"draft {backend.name} cannot draft for target {target.name}: {problem}; "
                "use a draft from the target's model family, or --draft prompt-lookup"
            )
        return cls(backend, **kw)

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        if len(prompt_ids) >= self.backend.n_ctx:
            return  # the prompt alone fills the draft's context: propose() will decline to draft
        sync(self.backend, prompt_ids[:-1], logits_last=False)

    def room(self) -> int:
        return self.backend.n_ctx

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        draft = Draft()
        room = self.backend.n_ctx - len(context)
        k = min(k, room)
        if k <= 0:
            return draft
        row = sync(self.backend, context, logits_last=True)
        history = list(context) if params.has_penalty else ()
        confidence = 1.0
        for i in range(k):
            if params.greedy:
                token, q = greedy_token(row, params, history), None
            else:
                q = process(row, params, history)
                token = sample(q, rng)
            # llama.cpp's --spec-draft-p-min: stop before a token the draft itself is unsure of
            top = draft_confidence(row) if self.p_min > 0 else 1.0
            if top < self.p_min:
                break
            confidence = min(confidence, top)
            draft.tokens.append(token)
            draft.q.append(q)
            if params.has_penalty:
                history.append(token)
            if i < k - 1:
                row = self.backend.eval([token], [0], in_place=True)[0]
        if len(draft.tokens) < self.draft_min:
            return Draft()
        draft.confidence = confidence
        return draft


class PromptLookup:
    """Prompt lookup decoding (Saxena 2023; llama.cpp's ngram-simple): find the latest earlier occurrence
    of the last n tokens (n from max_ngram down to min_ngram) and propose what followed it."""

    kind = "prompt-lookup"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4, draft_min: int = 0):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min n-gram ({min_ngram}) <= max n-gram ({max_ngram})")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.draft_min = draft_min
        self.last_match = 0  # n-gram length of the last proposal (0 = none found)

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        pass

    def room(self) -> int:
        return 1 << 30

    def find(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """(continuation of up to k tokens, matched n-gram length), longest match first, latest first."""
        ids = context if isinstance(context, np.ndarray) else np.asarray(context, dtype=np.int64)
        end = len(ids) - 1
        if end < self.min_ngram:
            return [], 0
        # positions p < end where ids[p] == ids[end] (match length >= 1), then extend each backwards
        # on the survivors only: one pass over the context instead of one per n-gram length
        starts = np.flatnonzero(ids[:end] == ids[end])
        length = 1
        best = starts
        while len(starts) and length < self.max_ngram:
            starts = starts[starts >= length]
            starts = starts[ids[starts - length] == ids[end - length]]
            if len(starts):
                length += 1
                best = starts
        if len(best) == 0 or length < self.min_ngram:
            return [], 0
        start = int(best[-1]) + 1
        return ids[start : start + k].tolist(), length

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        if k <= 0:
            return Draft()
        tokens, n = self.find(context, k)
        self.last_match = n
        if len(tokens) < max(1, self.draft_min):
            return Draft()
        return Draft(tokens=tokens, q=[None] * len(tokens), confidence=float(n))
