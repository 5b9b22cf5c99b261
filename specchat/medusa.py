"""Medusa heads (Cai et al. 2024): K small heads on the target's final hidden state h_t (the output norm's
result, what the output projection reads). Head k is one or more residual blocks x + SiLU(W x + b)
followed by a projection onto the vocabulary, and guesses the token k + 2 places after t: from the row
that predicted the context's last token, head 0 guesses the token after it, head 1 the one after that.
The K guesses are a chain (one per head), verified by specchat's rule like any draft: the output stays the
target's at any temperature (never Medusa's "typical acceptance", which changes it).

The heads run in numpy on the host, so what they cost is what the policy must know: a projection onto a
whole vocabulary per head would cost more than a small target's step. They score a shortlist of the
vocabulary instead (the most frequent tokens of the text the heads were trained on, stored in the file,
as FR-Spec does for draft models): a token outside it is never proposed, which costs acceptance, never
correctness. The heads' own time is measured when they are built and followed online (`draft_cost`).

Files (safetensors, as published):
- Medusa-1 (FasterDecoding/Medusa, text-generation-inference's v1): `{k}.{j}.linear.weight/.bias` for each
  residual block j of head k, and `{k}.{L}.weight` its own projection (vocabulary x hidden).
- text-generation-inference's v2: the blocks only; the projection is the target's own output matrix
  (`output.weight`, or the tied `token_embd.weight`), read from the target's GGUF.
- specchat's own: v2 plus `shortlist` (int32 token ids the heads score); trained by
  `python -m specchat.medusa_train` (see README).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from . import kinds
from .costs import CostModel
from .drafters import Draft, Forwards, ModelDrafting, Suspendable
from .errors import BackendError
from .sampling import SamplingParams

SHORTLIST_KEY = "shortlist"
# Without a shortlist in the file, the heads score the first this many token ids: BPE vocabularies number
# their most frequent tokens first (merges in the order they were learned).
DEFAULT_SHORTLIST = 8192


class MedusaFileError(BackendError):
    pass


@dataclass
class MedusaHeads:
    """K heads: `blocks[k]` the (W, b) of each residual block of head k; `projections[k]` its projection
    onto the shortlist (rows: shortlist ids), or one matrix all heads share; `shortlist` the token ids the
    projections score."""

    blocks: list[list[tuple[np.ndarray, np.ndarray]]]
    projections: list[np.ndarray]
    shortlist: np.ndarray
    n_vocab: int

    @property
    def n_heads(self) -> int:
        return len(self.blocks)

    @property
    def n_embd(self) -> int:
        return self.blocks[0][0][0].shape[1]

    def hidden(self, h: np.ndarray) -> np.ndarray:
        """(K, hidden): each head's input to its projection."""
        out = np.empty((self.n_heads, h.shape[-1]), dtype=np.float32)
        for k, head in enumerate(self.blocks):
            x = h
            for w, b in head:
                z = w @ x + b
                x = x + z / (1.0 + np.exp(-z))  # x + SiLU(W x + b)
            out[k] = x
        return out

    def shortlist_logits(self, h: np.ndarray) -> np.ndarray:
        """(K, len(shortlist)): each head's logits over the shortlist."""
        x = self.hidden(h)
        if len(self.projections) == 1:
            return x @ self.projections[0].T
        return np.stack([p @ x[k] for k, p in enumerate(self.projections)])

    def rows(self, h: np.ndarray) -> np.ndarray:
        """(K, n_vocab) logits rows, -inf outside the shortlist: what the sampler chain reads."""
        rows = np.full((self.n_heads, self.n_vocab), -np.inf, dtype=np.float32)
        rows[:, self.shortlist] = self.shortlist_logits(h)
        return rows


# -- files ----------------------------------------------------------------------------------------------


def _tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError  # (start-up: read only when a head file is loaded)
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise MedusaFileError(f"{path.name} is not a safetensors file of Medusa heads ({e})") from None


def layout(tensors: dict[str, Any]) -> tuple[int, int, bool]:
    """(heads, residual blocks per head, whether each head has its own projection) of a Medusa file's
    tensors, or MedusaFileError."""
    heads = sorted({int(name.split(".")[0]) for name in tensors if name.split(".")[0].isdigit()})
    if not heads or heads != list(range(len(heads))):
        raise MedusaFileError("no Medusa heads in it (tensors named '0.0.linear.weight', '1.0.linear.weight', ...)")
    n_blocks = 0
    while f"0.{n_blocks}.linear.weight" in tensors:
        n_blocks += 1
    if n_blocks == 0:
        raise MedusaFileError("head 0 has no residual block ('0.0.linear.weight')")
    own = f"0.{n_blocks}.weight" in tensors
    for k in heads:
        for j in range(n_blocks):
            if f"{k}.{j}.linear.weight" not in tensors or f"{k}.{j}.linear.bias" not in tensors:
                raise MedusaFileError(f"head {k} lacks block {j} ('{k}.{j}.linear.weight' and '.bias')")
        if (f"{k}.{n_blocks}.weight" in tensors) != own:
            raise MedusaFileError(f"head {k} {'lacks' if own else 'has'} its own projection, unlike head 0")
    return len(heads), n_blocks, own


def load_heads(path: Path, *, n_embd: int, n_vocab: int, output=None, shortlist: int | None = None) -> MedusaHeads:
    """The heads of a Medusa file, checked against a target of hidden size `n_embd` and vocabulary `n_vocab`
    (one line, MedusaFileError, where they do not fit). `output(ids)`: the target's output matrix rows for
    those token ids, for heads that share it (v2). `shortlist`: how many ids to score when the file has no
    shortlist (default DEFAULT_SHORTLIST)."""
    tensors = _tensors(path)
    n_heads, n_blocks, own = layout(tensors)
    ids = tensors.get(SHORTLIST_KEY)
    if ids is not None:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if len(ids) == 0 or ids.min() < 0 or ids.max() >= n_vocab:
            raise MedusaFileError(f"{path.name}: its shortlist holds ids outside the target's vocabulary of {n_vocab}")
    else:
        ids = np.arange(min(n_vocab, shortlist or DEFAULT_SHORTLIST))
    blocks = []
    for k in range(n_heads):
        head = []
        for j in range(n_blocks):
            w = np.asarray(tensors[f"{k}.{j}.linear.weight"], dtype=np.float32)
            b = np.asarray(tensors[f"{k}.{j}.linear.bias"], dtype=np.float32)
            if w.shape != (n_embd, n_embd) or b.shape != (n_embd,):
                raise MedusaFileError(f"{path.name}: head {k} is for a hidden size of {w.shape[-1]}, the target's is {n_embd}")
            head.append((w, b))
        blocks.append(head)
    if own:
        projections = []
        for k in range(n_heads):
            p = tensors[f"{k}.{n_blocks}.weight"]
            if p.shape != (n_vocab, n_embd):
                raise MedusaFileError(f"{path.name}: head {k} projects onto {p.shape[0]} tokens x {p.shape[1]}, "
                                      f"the target has {n_vocab} x {n_embd}")
            projections.append(np.ascontiguousarray(p[ids], dtype=np.float32))
    else:
        if output is None:
            raise MedusaFileError(f"{path.name}: its heads share the target's output matrix, which was not found")
        projections = [np.ascontiguousarray(output(ids), dtype=np.float32)]
    return MedusaHeads(blocks, projections, ids, n_vocab)


def output_rows(gguf_path: Path):
    """A function of token ids -> the target's output matrix rows (dequantized), read from its GGUF: the
    projection v2 heads share. None where the file has neither output.weight nor token_embd.weight."""
    from gguf import GGUFReader  # (start-up: read only when Medusa heads are loaded)
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    tensor = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if tensor is None:
        return None

    def rows(ids: np.ndarray) -> np.ndarray:
        return dequantize(np.asarray(tensor.data)[ids], tensor.tensor_type)

    return rows


def describe_file(path: Path) -> str:
    """What `specchat models` says of a Medusa head file."""
    try:
        tensors = _tensors(path)
        n_heads, n_blocks, own = layout(tensors)
    except MedusaFileError as e:
        return str(e)
    n_embd = tensors["0.0.linear.weight"].shape[1]
    blocks = f" x {n_blocks} blocks" if n_blocks > 1 else ""
    projection = " · own projections" if own else ""  # (else the target's output matrix, shared)
    return f"Medusa · {n_heads} heads{blocks} · hidden {n_embd}{projection}"


# -- the drafter ----------------------------------------------------------------------------------------


class MedusaDrafter(ModelDrafting, Suspendable):
    """Drafts the heads' chain from the target's final hidden row at the last accepted position: after a
    verify, the row that predicted the context's last token. Its drafts cost host time only (no model of
    its own), which it measures itself (`draft_cost`)."""

    kind = kinds.MEDUSA
    backend = None

    def __init__(self, heads: MedusaHeads, target, p_min: float = 0.0, draft_min: int = 0):
        super().__init__(p_min, draft_min)
        self.heads = heads
        self.target = target
        # numpy's BLAS threads spin for a while after each product, on the cores llama.cpp decodes on: with
        # them, target-only steps between drafts ran ~20% slower on two cores. One thread computes the heads
        # in about the same time (they are matrix-vector products), so the whole process keeps to one.
        threadpool_limits(limits=1, user_api="blas")
        self._rows: dict[int, np.ndarray] = {}  # the last decode's final hidden rows, by position
        self.suspended = True
        self.suspend(False)
        self._cost = CostModel([1], [self._time_heads()], measured=True)

    def _keep(self, positions: Sequence[int], rows: np.ndarray) -> None:
        # only the last decode's rows are ever read (the row before the context's last token is in it); the
        # backend hands over a new array each decode
        self._rows = dict(zip(positions, rows))

    def suspend(self, suspended: bool) -> None:
        if suspended == self.suspended:
            return
        self.suspended = suspended
        self.target.capture_final(None if suspended else self._keep)
        self._rows = {}

    def _time_heads(self) -> float:
        """Seconds one draft's heads take here: the fastest of a few runs (a prior the policy then follows)."""
        h = np.zeros(self.heads.n_embd, dtype=np.float32)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            self.heads.rows(h)
            best = min(best, time.perf_counter() - t0)
        return best

    def draft_cost(self) -> CostModel:
        return self._cost

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        pass

    def room(self) -> int:
        return self.target.n_ctx

    def forwards(self, drafted: int, asked: int) -> Forwards:
        """Every head runs at once, whatever the draft keeps: one 'forward' a draft."""
        return Forwards(1 if asked else 0, 1)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        h = self._rows.get(len(context) - 2)
        if k <= 0 or h is None:  # the first step of a reply: no verified row before the last token yet
            return Draft()
        rows = self.heads.rows(h)  # every head at once: head i's row is draft token i's, whatever came before
        return self._draft(context, min(k, self.heads.n_heads), params, rng, lambda i, before: rows[i])

    def offer(self, draft, limit: int):
        return super().offer(draft, min(limit, self.heads.n_heads))


def build_medusa(build) -> MedusaDrafter:
    """Medusa heads from -md (a safetensors file), on the target's final hidden state."""
    build.status(f"loading Medusa heads {build.spec.name}")
    target = build.target
    heads = load_heads(build.path, n_embd=target.n_embd_out, n_vocab=target.n_vocab,
                       output=output_rows(target.path))
    return MedusaDrafter(heads, target, p_min=build.opts.draft_p_min, draft_min=build.opts.draft_min)
