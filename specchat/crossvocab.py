"""Drafting across tokenizers: a draft model with its own vocabulary proposes for the target.

The draft keeps the conversation in its own tokens and its own KV cache (reused across steps and turns,
like `drafters.DraftModel`): the target's committed tokens are turned into text and that text into draft
tokens, incrementally. What the draft proposes goes back to the target as target tokens, by one of two
lossless rules (Timor et al. 2025, "Accelerating LLM inference with lossless speculative decoding
algorithms for heterogeneous vocabularies"):

- SLEM (string-level exact match): the draft's text is re-tokenised with the target's tokenizer and sent
  as deterministic proposals (q = None). The engine's rule then keeps a proposal d with probability
  p(d) and otherwise samples the residual p without d: exactly the distribution of "the target samples
  its own token and keeps the proposal while they are equal". Lossless under any sampler.
- TLI (token-level intersection): the draft's distribution is restricted to the tokens both
  vocabularies share (same text), renormalised and mapped to target ids; the standard min(1, p/q) rule
  applies. Lossless, and more is accepted at temperature > 0 when the shared vocabulary is large.

Boundaries. A committed target token is never changed: proposals are always the re-tokenisation of the
draft's NEW text alone, appended after the committed tokens. The draft's tokens spell exactly the
committed text; when they cannot (an unfinished UTF-8 character at the end, a tokenizer that does not
round-trip), that step drafts nothing. Special tokens are mapped explicitly: a target special token goes
to the draft token with the same name (`<|im_start|>` in both ChatML models), the target's BOS to the
draft's BOS where the draft adds one (else nowhere), and any other is rendered as its name in plain text
(`<end_of_turn>`). A draft special token becomes the target token of the same name and ends the draft;
one the target does not have ends the draft before it.

The vocabulary map (draft id -> target id with the same text) is built once per pair of files and cached
in the cache dir (`vocab-maps/`), keyed by both files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import kinds
from .backend import Backend, HeldPrefix, common_prefix, sync
from .drafters import Draft, DraftLoop, Labelled, ModelDrafting, Retargetable, own_rows
from .sampling import Dist, SamplingParams, apply_penalties, draft_confidence, process, sample, top_k_ids
from .vocab import VocabFile

RULES = ("auto", "slem", "tli")
# auto uses TLI (at temperature > 0) only when at least this share of the draft's tokens exist in the
# target's vocabulary: below it the restricted distribution loses too much of the draft's mass
TLI_MIN_SHARED = 0.5
MAP_VERSION = 1


def check_rule(rule: str) -> str:
    """The rule name normalised, or ValueError with a one-line message."""
    name = (rule or "").strip().lower()
    if name not in RULES:
        raise ValueError(f"--cross-vocab must be one of {', '.join(RULES)}, got {rule!r}")
    return name


# -- the vocabulary map ----------------------------------------------------------------------------------


@dataclass
class VocabMap:
    """draft id -> target id whose text is identical (-1: the target has no such token). Special tokens
    (no text of their own) match by name. `target_special` maps target special ids to draft ones."""

    to_target: np.ndarray  # int64, one entry per draft token
    target_special: dict[int, int]
    n_target: int

    @property
    def shared_fraction(self) -> float:
        return float(np.count_nonzero(self.to_target >= 0)) / max(1, len(self.to_target))


def _pieces_and_names(model) -> tuple[list[bytes], dict[int, bytes]]:
    """Every token's text contribution, and the names of the special ones (empty text)."""
    pieces = [model.token_bytes(t) for t in range(model.n_vocab)]
    text = model.vocab.token_text
    names = {t: bytes(text(t)) for t, piece in enumerate(pieces) if not piece}
    return pieces, {t: n for t, n in names.items() if n}


def build_vocab_map(target, draft) -> VocabMap:
    """From two objects with n_vocab, token_bytes(t) and vocab.token_text (backends, or vocab-only files)."""
    t_pieces, t_names = _pieces_and_names(target)
    d_pieces, d_names = _pieces_and_names(draft)
    by_piece: dict[bytes, int] = {}
    for t, piece in enumerate(t_pieces):
        if piece:
            by_piece.setdefault(piece, t)  # the first of duplicate pieces, as a tokenizer would
    t_by_name = {name: t for t, name in sorted(t_names.items(), reverse=True)}
    d_by_name = {name: t for t, name in sorted(d_names.items(), reverse=True)}
    to_target = np.full(draft.n_vocab, -1, dtype=np.int64)
    for d, piece in enumerate(d_pieces):
        if piece:
            to_target[d] = by_piece.get(piece, -1)
        elif d in d_names:
            to_target[d] = t_by_name.get(d_names[d], -1)
    target_special = {t: d_by_name[name] for t, name in t_names.items() if name in d_by_name}
    return VocabMap(to_target, target_special, target.n_vocab)


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}"


def map_cache_path(target_path, draft_path) -> Path:
    from .paths import cache_dir

    ident = f"v{MAP_VERSION}|{_file_key(Path(target_path))}|{_file_key(Path(draft_path))}"
    return cache_dir() / "vocab-maps" / f"{hashlib.sha1(ident.encode()).hexdigest()[:16]}.npz"


def _load_map(path: Path) -> VocabMap | None:
    try:
        with np.load(path) as z:
            special = dict(zip(z["special_t"].tolist(), z["special_d"].tolist()))
            return VocabMap(z["to_target"].astype(np.int64), special, int(z["n_target"]))
    except (OSError, KeyError, ValueError):
        return None


def _save_map(path: Path, vmap: VocabMap) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.npz")
        np.savez(tmp, to_target=vmap.to_target.astype(np.int32), n_target=vmap.n_target,
                 special_t=np.array(list(vmap.target_special), dtype=np.int64),
                 special_d=np.array(list(vmap.target_special.values()), dtype=np.int64))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a rebuild (under a second) next time


def cached_vocab_map(target, draft) -> VocabMap:
    """The map for two loaded backends (or vocab-only files): from the cache when both have a file."""
    paths = [m.path for m in (target, draft)]
    cache = None
    if all(p is not None and Path(p).is_file() for p in paths):
        cache = map_cache_path(*paths)
        if cache.exists():
            vmap = _load_map(cache)
            if vmap is not None and len(vmap.to_target) == draft.n_vocab and vmap.n_target == target.n_vocab:
                return vmap
    vmap = build_vocab_map(target, draft)
    if cache is not None:
        _save_map(cache, vmap)
    return vmap


def file_vocab_map(target_path, draft_path) -> VocabMap:
    """The map for two files (cached; reads vocabularies only on a miss)."""
    cache = map_cache_path(target_path, draft_path)
    if cache.exists():
        vmap = _load_map(cache)
        if vmap is not None:
            return vmap
    with VocabFile(target_path) as target, VocabFile(draft_path) as draft:
        return cached_vocab_map(target, draft)


def vocabulary_note(vmap: VocabMap | None) -> str:
    """The `specchat models` wording."""
    if vmap is None:
        return "same vocabulary"
    return f"different tokenizers: {vmap.shared_fraction:.0%} of the draft's tokens are in the target's vocabulary"


# -- the rule's pure parts ----------------------------------------------------------------------------


def restrict_to_shared(q: Dist, to_target: np.ndarray, n_target: int) -> Dist | None:
    """TLI's proposal distribution: the draft's q on the tokens the target also has, renormalised, as a
    distribution over target ids (draft tokens with the same text add up). None if q has no mass there."""
    ids = np.arange(q.n_vocab) if q.ids is None else q.ids
    mapped = to_target[ids]
    keep = mapped >= 0
    mass = q.probs[keep]
    total = float(mass.sum())
    if total <= 0.0:
        return None
    mapped = mapped[keep]
    order = np.argsort(mapped, kind="stable")
    targets, mass = mapped[order], mass[order]
    starts = np.flatnonzero(np.concatenate([[True], targets[1:] != targets[:-1]]))
    if len(starts) < len(targets):  # several draft tokens spell the same target token: add them up
        targets, mass = targets[starts], np.add.reduceat(mass, starts)
    return Dist(targets, mass / total, n_target)


def valid_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a UTF-8 character."""
    try:
        data.decode("utf-8")
        return len(data)
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data":
            return e.start
        return len(data)  # invalid bytes in the middle: decoded with replacement, see _text


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


# -- the drafter ------------------------------------------------------------------------------------


class CrossVocabDrafter(ModelDrafting, Retargetable, Labelled):
    """A draft model whose vocabulary differs from the target's (see the module doc)."""

    kind = kinds.DRAFT_MODEL  # a draft model whatever its tokenizer: priced and shown as one

    def __init__(self, backend: Backend, target: Backend, vmap: VocabMap | None = None, *, rule: str = "auto",
                 p_min: float = 0.0, draft_min: int = 0):
        super().__init__(p_min, draft_min)
        self.backend = backend
        self.target = target
        self.rule = check_rule(rule)
        self.map = vmap if vmap is not None else cached_vocab_map(target, backend)
        self.rules_run: Counter = Counter()  # steps that drafted, by rule
        d_vocab = backend.vocab
        self._draft_bos = d_vocab.bos if d_vocab.add_bos and d_vocab.bos >= 0 else None
        self._target_bos = target.vocab.bos
        self._target_names: dict[int, bytes] = {}
        self._params: tuple[SamplingParams, SamplingParams] | None = None
        shared = np.flatnonzero(self.map.to_target >= 0)
        self._has_dups = len(np.unique(self.map.to_target[shared])) < len(shared)
        self._inverse = np.full(self.map.n_target, -1, dtype=np.int64)  # target id -> a draft id with its text
        self._inverse[self.map.to_target[shared][::-1]] = shared[::-1]
        self.held = HeldPrefix(backend)  # how much of _ids the draft's cache holds
        self._reset()

    # -- which rule ----------------------------------------------------------------------------------

    def retarget(self, target: Backend) -> None:
        """The target was loaded again (`/rpc off`): the same file, so the vocabulary map still holds; only
        the backend its texts are read through changes."""
        self.target = target

    def rule_for(self, params: SamplingParams) -> str:
        if self.rule != "auto":
            return self.rule
        return "tli" if not params.greedy and self.map.shared_fraction >= TLI_MIN_SHARED else "slem"

    def run_label(self, params: SamplingParams) -> str:
        return f"cross-vocab {self.rule_for(params).upper()}"

    def run_info(self, params: SamplingParams) -> dict:
        """--json's and report.json's `cross_vocab`: which rule ran, and how much of the vocabulary is shared."""
        return {"cross_vocab": {"rule": self.rule_for(params), "requested": self.rule,
                                "shared_fraction": self.map.shared_fraction, "steps_by_rule": dict(self.rules_run)}}

    # -- the committed text in draft tokens ------------------------------------------------------------

    def _reset(self) -> None:
        self._committed: list[int] = []  # target ids folded into the draft's tokens
        self._ids: list[int] = []  # draft ids spelling exactly their text (when _pending is empty)
        self._pending = b""  # committed text not yet in _ids (an unfinished UTF-8 character)
        self._marks: list[tuple[int, int]] = [(0, 0)]  # (target ids, draft ids) covering the same text
        self._proposal: tuple[int, list[int]] | None = None  # (len(_ids) then, draft ids proposed)
        self._clean = True  # False once the draft's tokenizer failed to spell the text back
        # the context list last folded in whole: the same list again has only grown (the engine's), so
        # only its new tokens are compared
        self._folded_from: Sequence[int] | None = None

    def _rewind(self, n_target: int) -> None:
        while self._marks[-1][0] > n_target:
            self._marks.pop()
        t, d = self._marks[-1]
        del self._committed[t:]
        del self._ids[d:]
        self.held.cut(d)
        self._pending = b""
        self._proposal = None
        self._clean = True

    def _target_name(self, token: int) -> bytes:
        name = self._target_names.get(token)
        if name is None:
            name = self._target_names[token] = bytes(self.target.vocab.token_text(token))
        return name

    def _fold(self, context: Sequence[int]) -> bool:
        """Bring the draft's tokens up to `context` (target ids). True when they spell it exactly."""
        n = len(self._committed)
        known = min(n, len(context)) if context is self._folded_from else 0
        common = known + common_prefix(self._committed[known:], context[known:n])
        if common < n:
            self._rewind(common)
        self._folded_from = context
        new = list(context[len(self._committed):])
        if not new:
            return self._clean and not self._pending
        for t in new:
            piece = self.target.token_bytes(t)
            self._committed.append(t)
            if piece:
                self._pending += piece
                continue
            special = self.map.target_special.get(t)
            if special is None and t == self._target_bos:
                special = self._draft_bos if self._draft_bos is not None else -1
            if special is None:  # no counterpart: the draft reads its name as text
                self._pending += self._target_name(t)
                continue
            self._flush()
            if self._pending:  # an unfinished character before a special token: the text is broken there
                self._pending = b""
                self._clean = False
            if special >= 0:
                self._ids.append(special)
            self._proposal = None
            self._mark()
        self._flush()
        return self._clean and not self._pending

    def _mark(self) -> None:
        if not self._pending and self._clean:
            self._marks.append((len(self._committed), len(self._ids)))

    def _flush(self) -> None:
        """Turn the pending text into draft tokens: first the draft's own proposal where the text is
        what it proposed (those tokens are in its cache already), then the draft's tokenizer."""
        data = self._pending
        if not data:
            return
        ready = valid_utf8_prefix(data)
        if ready == 0:
            return
        data, rest = data[:ready], data[ready:]
        if self._proposal is not None and self._proposal[0] == len(self._ids):
            used = 0
            for d in self._proposal[1]:
                piece = self.backend.token_bytes(d)
                if not piece or not data.startswith(piece, used):
                    break
                self._ids.append(d)
                used += len(piece)
            data = data[used:]
        self._proposal = None
        if data:
            # re-tokenise the last draft token with the new text: "wor" + "ld" reads better as "world"
            last = self._ids[-1] if self._ids else None
            if last is not None and self.backend.token_bytes(last):
                self._ids.pop()
                self.held.cut(len(self._ids))
                data = self.backend.token_bytes(last) + data
                while self._marks[-1][1] > len(self._ids):
                    self._marks.pop()
            ids = self.backend.tokenize(_text(data), add_special=False, parse_special=False)
            if b"".join(self.backend.token_bytes(d) for d in ids) != data:
                self._clean = False  # this tokenizer does not spell the text back (e.g. a space prefix)
            self._ids.extend(ids)
        self._pending = rest
        self._mark()

    # -- Drafter -----------------------------------------------------------------------------------------

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        self._fold(prompt_ids)
        if 0 < len(self._ids) < self.backend.n_ctx:
            sync(self.backend, self._ids[:-1], logits_last=False, turn=True)

    def room(self) -> int:
        return self.backend.n_ctx

    def _draft_params(self, params: SamplingParams) -> SamplingParams:
        # banned ids are the target's (--ignore-eos): they mean nothing in the draft's vocabulary
        if self._params is None or self._params[0] is not params:
            self._params = (params, dataclasses.replace(params, banned=()))
        return self._params[1]

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        if k <= 0 or not self._fold(context) or not self._ids:
            return Draft()
        room = self.backend.n_ctx - len(self._ids)
        if room <= 1:
            return Draft()
        row = sync(self.backend, self._ids, logits_last=True, known=self.held.known(self._ids))
        self.backend.checkpoint()  # its drafts are cut after the verify (a recurrent model copies its state)
        rule = self.rule_for(params)
        dparams = self._draft_params(params)
        banned = params.banned_set
        if rule == "tli":
            draft, drafted = self._propose_tli(row, k, room, params, dparams, banned, rng)
        else:
            draft, drafted = self._propose_slem(row, k, room, params, dparams, banned, rng)
        self._proposal = (len(self._ids), drafted)
        self.held.record(self._ids, len(self._ids))
        if len(draft.tokens) < max(1, self.draft_min):
            return Draft()
        self.rules_run[rule] += 1
        return draft

    def _retokenise(self, data: bytes) -> list[int] | None:
        """The target's tokens for new text (never touching committed ones); None if they do not spell
        it exactly."""
        data = data[: valid_utf8_prefix(data)]
        if not data:
            return []
        ids = self.target.tokenize(_text(data), add_special=False, parse_special=False)
        if b"".join(self.target.token_bytes(t) for t in ids) != data:
            return None
        return ids

    def _propose_slem(self, row, k, room, params, dparams, banned, rng) -> tuple[Draft, list[int]]:
        """SLEM: the draft drafts as a same-vocabulary draft would, until its text re-tokenised for the target
        makes more than k tokens (or does not spell it); those tokens go as deterministic proposals."""
        loop = DraftLoop(self._ids, dparams, rng, self.p_min)
        drafted: list[int] = []
        text = b""
        ids: list[int] = []
        end: int | None = None  # a target special token that ends the draft
        complete = False  # the last re-tokenised token is known to be whole
        for token, _ in loop.tokens(min(2 * k + 4, room - 1), own_rows(row, self.backend)):
            piece = self.backend.token_bytes(token)
            if not piece:
                mapped = int(self.map.to_target[token])
                if mapped >= 0 and mapped not in banned:
                    end = mapped
                    drafted.append(token)
                complete = True
                break
            drafted.append(token)
            text += piece
            retok = self._retokenise(text)
            if retok is None:
                break
            ids = retok
            if len(ids) > k:
                break
        if loop.unsure is not None:
            # the draft is unsure what follows; its best guess still says whether a word ends here
            complete = not self.backend.token_bytes(loop.unsure)[:1].isalnum()
        if end is not None:
            retok = self._retokenise(text)
            ids = (retok or []) + [end] if retok is not None else []
        elif len(ids) > k:
            ids = ids[:k]
        elif not complete:
            ids = ids[:-1]  # the draft stopped mid-text: its last token may be the start of a longer one
        return Draft(tokens=ids[:k], q=[None] * len(ids[:k]), source=self.kind.name), drafted

    def _propose_tli(self, row, k, room, params, dparams, banned, rng) -> tuple[Draft, list[int]]:
        """TLI: each token drawn from the draft's q restricted to the shared vocabulary, sent with that q."""
        draft = Draft(source=self.kind.name)
        drafted: list[int] = []
        loop = DraftLoop(self._ids, dparams, rng, self.p_min, pick=self._pick_shared)
        for token, q in loop.tokens(min(k, room - 1), own_rows(row, self.backend)):
            target_token = int(self.map.to_target[token])
            if target_token in banned:
                break
            drafted.append(token)
            draft.tokens.append(target_token)
            draft.q.append(q)
            if not self.backend.token_bytes(token):
                break  # a special token (end of turn) ends the draft
        return draft, drafted

    def _pick_shared(self, row, params, history, rng, p_min):
        """TLI's pick (see DraftLoop): (a draft token the target has, q over target ids or None (greedy),
        the draft's confidence), or None where nothing the draft would say can be said in the target's
        tokens. Unsure (under p_min), it draws nothing."""
        top = draft_confidence(row) if p_min > 0 else 1.0
        if top < p_min:
            return None, None, top
        to_target = self.map.to_target
        if params.greedy:
            z = apply_penalties(row, params, history) if params.has_penalty else row
            candidates = top_k_ids(z, min(64, len(z)))
            candidates = candidates[np.argsort(-z[candidates], kind="stable")]
            shared = candidates[to_target[candidates] >= 0]
            return (int(shared[0]), None, top) if len(shared) else None
        q = restrict_to_shared(process(row, params, history), to_target, self.map.n_target)
        if q is None:
            return None
        return self._draft_token_for(sample(q, rng), row), q, top

    def _draft_token_for(self, target_token: int, row: np.ndarray) -> int:
        """The draft token that continues the draft's text for a sampled target token (the likeliest
        of those with its text, when the draft has several)."""
        if not self._has_dups:
            return int(self._inverse[target_token])
        ids = np.flatnonzero(self.map.to_target == target_token)
        return int(ids[np.argmax(row[ids])])
