"""What a GGUF file's header says, read without llama.cpp: `check_gguf_file` looks at its magic before
llama.cpp sees the file, and `gguf_values` reads its metadata (architecture, trained context length, MTP
layers, an EAGLE-3 head's target layers, vocabulary size) for `specchat models`, the loader and the
backends, without loading anything. Not `gguf.py`: that would shadow the `gguf` package.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import BackendError

GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: Path) -> None:
    """Fail with a clear message before llama.cpp sees a file it would reject with a generic error."""
    if not path.exists():
        raise BackendError(f"model file not found: {path}")
    if path.is_dir():
        raise BackendError(f"model path is a directory, not a GGUF file: {path}")
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as e:
        raise BackendError(f"cannot read model file {path}: {e.strerror}") from None
    if head[:4] != GGUF_MAGIC:
        raise BackendError(f"not a GGUF file (no GGUF header): {path}")
    if len(head) < 8:
        raise BackendError(f"GGUF file is truncated: {path}")


def gguf_context_length(path: Path) -> int | None:
    """The context length a GGUF file says its model was trained for (`<arch>.context_length`), read
    from the header without loading anything; None when it cannot be read."""
    return gguf_header(path)[1]


def gguf_arch(path: Path) -> str | None:
    """The file's `general.architecture` ("llama", "qwen35", "mamba2", ...), or None."""
    return gguf_header(path)[0]


def gguf_header(path: Path) -> tuple[str | None, int | None]:
    """(architecture, trained context length) from a GGUF header, without loading anything."""
    arch, values = gguf_values(path)
    return arch, values.get("context_length")


def gguf_nextn_layers(path: Path) -> int:
    """How many MTP / NextN layers the file's model carries (`<arch>.nextn_predict_layers`, what
    llama_model_n_layer_nextn reports once loaded); 0 when none or unreadable."""
    return int(gguf_values(path)[1].get("nextn_predict_layers", 0))


def gguf_values(path: Path) -> tuple[str | None, dict[str, int]]:
    """(architecture, the integer and boolean `<arch>.*` keys, and an EAGLE-3 / DFlash head's
    `target_layers` as a tuple) from a GGUF header, without loading anything; `vocab_size` is the
    tokenizer's token count where the header has no such key."""
    layout = gguf_layout(path, tensors=False)
    return (layout.arch, layout.values) if layout is not None else (None, {})


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]  # ggml's order (ne0 first): a [rows, cols] numpy matrix is (cols, rows)
    ggml_type: int
    offset: int  # where its data starts in the file


@dataclass
class GGUFLayout:
    arch: str | None
    values: dict[str, int]  # as gguf_values
    tensors: dict[str, TensorInfo]  # by name; empty unless asked for


def gguf_layout(path: Path, tensors: bool = True) -> GGUFLayout | None:
    """The header in one pass: architecture, values (see gguf_values) and, with `tensors`, the tensors by
    name (their shapes, types and where their data lies); None when unreadable.

    Read through a memory map, not file reads and seeks: a vocabulary and its merges are some 100k-300k
    strings that only need skipping, a noticeable part of a load read that way."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fixed-size value types
    ints = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}
    length = struct.Struct("<Q").unpack_from
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            pos = 0

            def read(fmt: str):
                nonlocal pos
                value = struct.unpack_from("<" + fmt, buf, pos)[0]
                pos += struct.calcsize(fmt)
                return value

            def string() -> bytes:
                nonlocal pos
                n = read("Q")
                if pos + n > len(buf):
                    raise ValueError("string past the end of the file")
                pos += n
                return buf[pos - n:pos]

            def skip(kind: int) -> None:
                nonlocal pos
                if kind in sizes:
                    pos += sizes[kind]
                elif kind == 8:
                    pos += 8 + read("Q")
                elif kind == 9:
                    inner, count = read("I"), read("Q")
                    if inner in sizes:
                        pos += sizes[inner] * count
                    elif inner == 8:  # strings: the vocabulary, its merges
                        at = pos
                        for _ in range(count):
                            at += 8 + length(buf, at)[0]
                        pos = at
                    else:
                        for _ in range(count):
                            skip(inner)
                else:
                    raise ValueError(kind)

            if buf[:4] != GGUF_MAGIC:
                return None
            pos = 4
            if read("I") < 2:
                return None
            n_tensors = read("Q")
            values: dict[bytes, int] = {}
            arch = None
            n_vocab = 0
            alignment = 32
            for _ in range(read("Q")):
                key, kind = string(), read("I")
                if key == b"general.architecture" and kind == 8:
                    arch = string()
                elif key == b"general.alignment" and kind in ints:
                    alignment = read(ints[kind])
                elif kind in ints and not key.startswith(b"general.") and not key.startswith(b"tokenizer."):
                    values[key] = read(ints[kind])
                elif kind == 7 and not key.startswith(b"general.") and not key.startswith(b"tokenizer."):
                    values[key] = bool(read("B"))
                elif kind == 9 and key == b"tokenizer.ggml.tokens":  # the vocabulary: only its size is kept
                    read("I")  # the element type (strings)
                    n_vocab = read("Q")
                    pos -= 12
                    skip(kind)
                elif kind == 9 and key.endswith(b".target_layers"):  # a head's layer ids
                    inner, count = read("I"), read("Q")
                    if inner not in ints:
                        pos -= 12
                        skip(kind)
                        continue
                    values[key] = tuple(read(ints[inner]) for _ in range(count))
                else:
                    skip(kind)
            found_tensors: dict[str, TensorInfo] = {}
            if tensors:
                infos = []
                for _ in range(n_tensors):
                    name = string().decode("utf-8", "replace")
                    shape = tuple(read("Q") for _ in range(read("I")))
                    infos.append((name, shape, read("I"), read("Q")))
                start = -(-pos // alignment) * alignment
                found_tensors = {name: TensorInfo(shape, kind, start + offset) for name, shape, kind, offset in infos}
            name = arch.decode("utf-8", "replace") if arch else None
            prefix = (arch or b"") + b"."
            found = {k[len(prefix):].decode(): v for k, v in values.items() if k.startswith(prefix)}
            if n_vocab and "vocab_size" not in found:
                found["vocab_size"] = n_vocab
            return GGUFLayout(name, found, found_tensors)
    except (OSError, ValueError, OverflowError, struct.error):  # OverflowError: a length past 2**63
        return None
