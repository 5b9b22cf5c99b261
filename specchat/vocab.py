"""Vocabularies: `Vocabulary`, the one reader of a loaded llama_vocab (each token's piece and text);
`VocabInfo`, what llama.cpp's draft/target compatibility rule compares (every backend's `vocab`);
`check_compatible`, that rule; and `VocabFile` / `read_vocab`, a GGUF file's vocabulary without its
weights (for `specchat models` and the cross-vocabulary map).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from .compat import quiet_llama_logs
from .errors import BackendError
from .gguf_header import check_gguf_file


@dataclass(frozen=True)
class VocabInfo:
    """What llama.cpp's draft/target compatibility rule compares."""

    vocab_type: int
    n_vocab: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool
    token_text: object = field(repr=False, compare=False)  # Callable[[int], bytes]


class Vocabulary:
    """A loaded llama_vocab, the one reader of it: each token's piece (the bytes it adds to a text,
    cached) and text, and what the compatibility rule compares. Backends and VocabFile read through it."""

    def __init__(self, lib, vocab_p):
        self._lib, self._v = lib, vocab_p
        self.n_vocab = lib.llama_vocab_n_tokens(vocab_p)
        self._pieces: dict[int, bytes] = {}
        self._buf = ctypes.create_string_buffer(256)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token contributes to the text (special tokens render as nothing)."""
        piece = self._pieces.get(token)
        if piece is None:
            n = self._lib.llama_token_to_piece(self._v, token, self._buf, len(self._buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._lib.llama_token_to_piece(self._v, token, buf, -n, 0, False)
                piece = buf.raw[:n]
            else:
                piece = self._buf.raw[:n]
            self._pieces[token] = piece
        return piece

    def token_text(self, token: int) -> bytes:
        """The token's text as the vocabulary stores it (a special token's name)."""
        return self._lib.llama_vocab_get_text(self._v, token) or b""

    @property
    def info(self) -> VocabInfo:
        lib, v = self._lib, self._v
        return VocabInfo(
            vocab_type=lib.llama_vocab_type(v),
            n_vocab=self.n_vocab,
            bos=lib.llama_vocab_bos(v),
            eos=lib.llama_vocab_eos(v),
            add_bos=bool(lib.llama_vocab_get_add_bos(v)),
            add_eos=bool(lib.llama_vocab_get_add_eos(v)),
            token_text=self.token_text,
        )


def check_compatible(target: VocabInfo, draft: VocabInfo) -> str | None:
    """llama.cpp's rule for a draft model (common/speculative.cpp): None if compatible, else which check
    failed, in words a user can act on."""
    if target.vocab_type != draft.vocab_type:
        return f"tokenizer types differ (target {target.vocab_type}, draft {draft.vocab_type})"
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        return f"BOS tokens differ (target {target.bos} add={target.add_bos}, draft {draft.bos} add={draft.add_bos})"
    if target.add_eos != draft.add_eos or target.eos != draft.eos:
        return f"EOS tokens differ (target {target.eos}, draft {draft.eos})"
    if abs(target.n_vocab - draft.n_vocab) > 128:
        return f"vocabulary sizes differ by more than 128 (target {target.n_vocab}, draft {draft.n_vocab})"
    for t in range(5, min(target.n_vocab, draft.n_vocab)):
        a, b = target.token_text(t), draft.token_text(t)
        if a != b:
            return f"token {t} differs (target {a!r}, draft {b!r})"
    return None


class VocabFile:
    """A GGUF file's vocabulary without its weights: path, n_vocab, token_bytes and vocab, as a backend
    has them (for `specchat models`: the compatibility rule and the cross-vocabulary map)."""

    def __init__(self, path: str | os.PathLike):
        import llama_cpp  # start-up: llama_cpp takes 0.4 s to import

        quiet_llama_logs(llama_cpp)
        self.path = Path(path)
        check_gguf_file(self.path)
        try:
            self._llm = llama_cpp.Llama(str(self.path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError, OSError):
            raise BackendError(f"llama.cpp could not read the vocabulary of {self.path}") from None
        self._vocabulary = Vocabulary(llama_cpp, llama_cpp.llama_model_get_vocab(self._llm.model))
        self.n_vocab = self._vocabulary.n_vocab

    def token_bytes(self, token: int) -> bytes:
        return self._vocabulary.token_bytes(token)

    @property
    def vocab(self) -> VocabInfo:
        return self._vocabulary.info

    def close(self) -> None:
        self._llm.close()

    def __enter__(self) -> VocabFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_vocab(path: str | os.PathLike) -> VocabInfo:
    """The vocabulary of a GGUF file without loading its weights (for `specchat models`), its token texts
    copied out: the vocabulary is freed with the file."""
    with VocabFile(path) as file:
        info = file.vocab
        texts = [info.token_text(t) for t in range(info.n_vocab)]
    return replace(info, token_text=texts.__getitem__)
