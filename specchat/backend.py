"""Models behind one small protocol: evaluate tokens, get logits only where asked, roll the KV cache back.

`LlamaCppBackend` drives llama.cpp's batch API directly through llama-cpp-python's ctypes layer: the
high-level `Llama.eval` either keeps logits for one position or (with `logits_all`) copies an
n_ctx x n_vocab array for every token, and speculative verification needs k+1 rows and nothing more.
`Llama` is still used to load the model and for the tokenizer and metadata; what its public API does not
offer (devices, flash attention auto, n_rs_seq, load_mtp) is patched in compat.py, and nowhere else.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from . import compat
from . import rpc as rpc_workers  # (`rpc` is a backend's list of endpoints)
from .errors import BackendError

GGUF_MAGIC = b"GGUF"
# batches up to this size are filled token by token (the per-step path); larger ones through numpy
SMALL_BATCH = 96


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


@runtime_checkable
class Backend(Protocol):
    """What the engine, drafters, policy, chat and report use of a model. `tests/fakes.FakeBackend`
    implements it over a pure function; `LlamaCppBackend` over llama.cpp."""

    n_vocab: int
    n_ctx: int
    tokens: list[int]  # what the KV cache holds, in order
    evaluated: int  # tokens evaluated since load (tests count KV reuse with it)
    rollback_recoveries: int  # cuts that had to re-read everything (should stay 0)
    reevaluated: int  # tokens evaluated again after a checkpoint restore
    rollback_seconds: float  # spent saving and restoring recurrent-state checkpoints
    memory: MemoryKind  # how the cache can be cut
    name: str
    path: Path | None  # the model file (None for a model with no file): the policy's cost cache key
    n_threads: int  # as the model runs (the cost cache key: costs depend on them)
    n_gpu_layers: int | None
    rpc: tuple[str, ...]  # RPC workers holding some layers; () = this machine

    def eval(self, tokens: Sequence[int], logits_at: Sequence[int], *, in_place: bool = False) -> np.ndarray:
        """Append `tokens` to the cache; return float32 rows (len(logits_at), n_vocab), one per index
        into `tokens` named in logits_at. With in_place the rows may be a view of the backend's own
        buffer, writeable but never to be written, valid only until its next eval or truncate (the
        per-step path reads each row once and needs no copy)."""

    def truncate(self, n_keep: int) -> None:
        """Keep only the first n_keep cached tokens."""

    def checkpoint(self, batch: int | None = None, *, turn: bool = False) -> None:
        """The caller will evaluate more tokens, then may cut back to the current length (a draft model
        before drafting, the engine before a verify batch of `batch` tokens, `turn`: where a reply starts):
        a recurrent model saves what it needs to make that cut cheap. A no-op for attention caches."""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation id (EOS, EOT, <|im_end|>...), for --ignore-eos."""

    def is_eog(self, token: int) -> bool: ...

    @property
    def vocab(self) -> VocabInfo: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def bos_text(self) -> str:
        """The BOS token's text, for chat templates that write it ("" when there is none)."""

    @property
    def eos_text(self) -> str: ...

    @property
    def placement(self) -> str | None:
        """Where the layers are, when some are on RPC workers (None for an ordinary local load)."""

    def close(self) -> None:
        """Free the model and its context."""


def sync(backend: Backend, tokens: Sequence[int], logits_last: bool, *, turn: bool = False,
         known: int = 0) -> np.ndarray | None:
    """Make the cache hold exactly `tokens`, evaluating only what differs from what it holds already
    (the KV reuse that makes a chat turn cost only its new tokens). With logits_last, return the logits
    row after the last token, re-evaluating that token if it was already cached (read it before the
    backend's next eval: it may be the backend's own buffer). `turn`: a new turn starts here; a recurrent
    model keeps a copy of its state where the kept part ends, for a next turn that rewrites this one.
    `known`: leading tokens the caller knows the cache holds (see HeldPrefix); only the rest is compared."""
    cached = backend.tokens
    known = min(known, len(cached), len(tokens))
    common = known + common_prefix(cached[known:], tokens[known:])
    if logits_last and common == len(tokens) and common > 0:
        common -= 1  # llama.cpp keeps no logits for old positions: evaluate the last token again
    backend.truncate(common)
    rest = list(tokens[common:])
    if not rest:
        return None
    if turn and common:
        backend.checkpoint(turn=True)
    rows = backend.eval(rest, [len(rest) - 1] if logits_last else [], in_place=True)
    return rows[0] if logits_last else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    limit = min(len(a), len(b))
    if list(a[:limit]) == list(b[:limit]):  # the usual case, compared in C: one is a prefix of the other
        return limit
    common = 0
    while a[common] == b[common]:
        common += 1
    return common


class HeldPrefix:
    """How many leading tokens of one token list a backend's cache is known to hold, so that the next sync
    compares only what follows: a drafter that follows the engine's context then costs the same per step
    at any context length. The count holds for the same list object (the engine's context, which only
    grows within a generation; an owner that edits its list lowers the count with `cut`) while nobody
    else evaluates on the backend (its `evaluated` moves); otherwise it is 0 and sync compares in full.
    A cut of the cache needs no notice: sync never counts past what the cache still holds."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self._tokens: Sequence[int] | None = None
        self._n = 0
        self._evaluated = -1

    def known(self, tokens: Sequence[int]) -> int:
        if tokens is self._tokens and self.backend.evaluated == self._evaluated:
            return self._n
        return 0

    def record(self, tokens: Sequence[int], n: int) -> None:
        """The cache holds tokens[:n] now (call after the caller's own evaluations)."""
        self._tokens, self._n, self._evaluated = tokens, n, self.backend.evaluated

    def cut(self, n: int) -> None:
        """The owner changed its list from position n on."""
        self._n = min(self._n, n)


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


_LOG_LINES: list[str] = []  # llama.cpp's last log lines, for an error message that needs them
_log_callback = None  # kept referenced: llama.cpp calls it for as long as the process runs


def quiet_llama_logs(lib) -> None:
    """Route llama.cpp's log to a short in-memory buffer instead of stderr. llama-cpp-python's own
    callback maps this llama.cpp's WARN level to logging.ERROR, so `verbose=False` still prints warnings
    ("n_ctx_seq > n_ctx_train") and allocation failures; specchat says what went wrong itself, in one line.
    SPECCHAT_LLAMA_LOG=1 shows the log again."""
    global _log_callback
    if _log_callback is not None or os.environ.get("SPECCHAT_LLAMA_LOG"):
        return

    @lib.llama_log_callback
    def keep(level, text, user_data):
        _LOG_LINES.append(text.decode("utf-8", "replace"))
        del _LOG_LINES[:-50]

    _log_callback = keep
    lib.llama_log_set(keep, ctypes.c_void_p(0))


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
    """(architecture, the integer `<arch>.*` keys, and an EAGLE-3 head's `target_layers` as a tuple) from a
    GGUF header, without loading anything; `vocab_size` is the tokenizer's token count where the header
    has no such key."""
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fixed-size value types
    ints = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}
    try:
        with path.open("rb") as f:
            def read(fmt: str):
                data = f.read(struct.calcsize(fmt))
                return struct.unpack("<" + fmt, data)[0]

            def string() -> bytes:
                return f.read(read("Q"))

            def skip(kind: int) -> None:
                if kind in sizes:
                    f.seek(sizes[kind], 1)
                elif kind == 8:
                    f.seek(read("Q"), 1)
                elif kind == 9:
                    inner, count = read("I"), read("Q")
                    if inner in sizes:
                        f.seek(sizes[inner] * count, 1)
                    else:
                        for _ in range(count):
                            skip(inner)
                else:
                    raise ValueError(kind)

            if f.read(4) != GGUF_MAGIC or read("I") < 2:
                return None, None
            read("Q")  # tensors
            values: dict[bytes, int] = {}
            arch = None
            n_vocab = 0
            for _ in range(read("Q")):
                key, kind = string(), read("I")
                if key == b"general.architecture" and kind == 8:
                    arch = string()
                elif kind in ints and not key.startswith(b"general.") and not key.startswith(b"tokenizer."):
                    values[key] = read(ints[kind])
                elif kind == 9 and key == b"tokenizer.ggml.tokens":  # the vocabulary: only its size is kept
                    read("I")  # the element type (strings)
                    n_vocab = read("Q")
                    f.seek(-12, 1)
                    skip(kind)
                elif kind == 9 and key.endswith(b".target_layers"):  # an EAGLE-3 head's layer ids
                    inner, count = read("I"), read("Q")
                    if inner not in ints:
                        f.seek(-12, 1)
                        skip(kind)
                        continue
                    values[key] = tuple(read(ints[inner]) for _ in range(count))
                else:
                    skip(kind)
            name = arch.decode("utf-8", "replace") if arch else None
            prefix = (arch or b"") + b"."
            found = {k[len(prefix):].decode(): v for k, v in values.items() if k.startswith(prefix)}
            if n_vocab and "vocab_size" not in found:
                found["vocab_size"] = n_vocab
            return name, found
    except (OSError, ValueError, struct.error):
        return None, {}


def default_gpu_layers() -> int:
    """All layers on the GPU when this build of llama.cpp can offload, else none (like LM Studio)."""
    import llama_cpp

    return -1 if llama_cpp.llama_supports_gpu_offload() else 0


FLASH_ATTN = ("auto", "on", "off")  # llama.cpp's -fa values


# -- llama.cpp's staging API for drafting heads (src/llama-ext.h) ---------------------------------------
# The target's final hidden rows ("nextn embeddings") that an MTP head reads are only reachable through
# functions in llama.cpp's staging header, which libllama exports as C++ (mangled) symbols and
# llama-cpp-python does not bind. They are bound here and nowhere else.
HEADS_VERSION = "0.3.36"  # the first llama-cpp-python whose libllama has them (and load_mtp, ctx_type)
_NEXTN_SYMBOLS = {
    "set_embeddings_nextn": "_Z26llama_set_embeddings_nextnP13llama_contextbb",
    "get_embeddings_nextn": "_Z26llama_get_embeddings_nextnP13llama_context",
    "get_embeddings_nextn_ith": "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
    "set_embeddings_layer_inp": "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
    "get_embeddings_layer_inp": "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
    "model_target_layer_ids": "_Z28llama_model_target_layer_idsPK11llama_model",
    "model_target_layer_ids_n": "_Z30llama_model_target_layer_ids_nPK11llama_model",
}


class NextnAPI:
    """llama_set_embeddings_nextn / llama_get_embeddings_nextn(_ith), bound from libllama by symbol."""

    def __init__(self, lib: ctypes.CDLL):
        f = getattr(lib, _NEXTN_SYMBOLS["set_embeddings_nextn"])
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
        self.set_embeddings_nextn = f
        f = getattr(lib, _NEXTN_SYMBOLS["get_embeddings_nextn"])
        f.argtypes, f.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)
        self.get_embeddings_nextn = f
        f = getattr(lib, _NEXTN_SYMBOLS["get_embeddings_nextn_ith"])
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)
        self.get_embeddings_nextn_ith = f
        # EAGLE-3: the target's layer inputs, and which layers a head reads
        f = getattr(lib, _NEXTN_SYMBOLS["set_embeddings_layer_inp"])
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
        self.set_embeddings_layer_inp = f
        f = getattr(lib, _NEXTN_SYMBOLS["get_embeddings_layer_inp"])
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)
        self.get_embeddings_layer_inp = f
        f = getattr(lib, _NEXTN_SYMBOLS["model_target_layer_ids"])
        f.argtypes, f.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_int32)
        self._layer_ids = f
        f = getattr(lib, _NEXTN_SYMBOLS["model_target_layer_ids_n"])
        f.argtypes, f.restype = [ctypes.c_void_p], ctypes.c_uint32
        self._layer_ids_n = f

    def target_layers(self, model) -> tuple[int, ...]:
        """The target layers an EAGLE-3 head reads (llama_model_target_layer_ids)."""
        n = self._layer_ids_n(model)
        ids = self._layer_ids(model)
        return tuple(int(ids[i]) for i in range(n)) if n else ()


_nextn_api: NextnAPI | None = None


def nextn_api() -> NextnAPI:
    """The staging API, or a one-line BackendError naming the llama-cpp-python version that has it."""
    global _nextn_api
    if _nextn_api is None:
        import llama_cpp
        import llama_cpp.llama_cpp as low

        version = getattr(llama_cpp, "__version__", "?")
        lib = compat.libllama()
        missing = [name for name, sym in _NEXTN_SYMBOLS.items() if lib is None or not hasattr(lib, sym)]
        has_c_api = all(hasattr(low, f) for f in ("llama_model_n_layer_nextn", "llama_batch_ext_set_embd_state",
                                                  "llama_process"))
        if missing or not has_c_api or not hasattr(low.llama_model_params, "load_mtp"):
            raise BackendError(
                f"drafting heads need llama-cpp-python >= {HEADS_VERSION} (its libllama exports "
                f"llama_set_embeddings_nextn, llama_get_embeddings_nextn_ith and the EAGLE-3 layer inputs); "
                f"installed: {version}: "
                f"pip install 'llama-cpp-python>={HEADS_VERSION}'"
            )
        _nextn_api = NextnAPI(lib)
    return _nextn_api


# llama.cpp's own lists (src/llama-arch.cpp), for saying what a model file is without loading it. A loaded
# model asks llama.cpp itself (llama_model_is_recurrent / _is_hybrid, llama_n_rs_seq).
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})  # llm_arch_is_recurrent
HYBRID_ARCHS = frozenset({  # llm_arch_is_hybrid: attention layers beside recurrent ones
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
    "deepseek4", "minimax-01",
})
SNAPSHOT_ARCHS = frozenset({  # llm_arch_supports_rs_rollback: n_rs_seq snapshots honoured
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h", "nemotron_h_moe",
    "lfm2", "lfm2moe", "bailingmoe3",
})
# Snapshots kept per sequence on archs that support them: a verify batch of up to this many drafts is cut
# back without a copy. Each costs one recurrent state (tens of MB on a 27B hybrid), so like llama.cpp's
# --draft-max default (16) this stays small; a longer draft takes a checkpoint instead.
MAX_SNAPSHOTS = 16
LLAMA_MAX_SEQ = 256  # llama.cpp's most sequences a context may have (src/llama-cparams.h)
STATE_PARTIAL = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: only the recurrent (or SWA) part of a sequence


@dataclass(frozen=True)
class MemoryKind:
    """How a model's cache can be cut back after a rejected draft.

    - "kv": attention only; any suffix can be removed for free (llama_memory_seq_rm).
    - "snapshots": a recurrent state with `snapshots` per-token copies written by every decode: a cut of up
      to that many tokens inside the last batch is free. Longer cuts use a checkpoint.
    - "checkpoints": a recurrent state that cannot be cut: before a batch that may be cut, its recurrent
      part is copied (`state_bytes`), restored on a partial acceptance, and the kept tokens evaluated again.
    - "none": a recurrent state this llama.cpp can neither cut nor copy: every cut re-reads the whole
      context, so the loader switches drafting off for it.
    """

    kind: str
    arch: str = ""
    snapshots: int = 0
    state_bytes: int = 0  # one copy of the recurrent part of a sequence's state

    @property
    def recurrent(self) -> bool:
        return self.kind != "kv"

    def describe(self) -> str:
        """A few words for the chat header and `--stats`."""
        if self.kind == "kv":
            return "KV cache"
        if self.kind == "none":
            return "recurrent, cannot be cut back"
        if self.kind == "snapshots":
            return f"recurrent, {self.snapshots} snapshots ({_size(self.snapshots * self.state_bytes)})"
        return f"recurrent, checkpoints ({_size(self.state_bytes)} each)"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def arch_memory(arch: str | None) -> str:
    """The memory kind an architecture name implies, before loading ("kv", "snapshots", "checkpoints")."""
    if arch in SNAPSHOT_ARCHS:
        return "snapshots"
    if arch in RECURRENT_ARCHS or arch in HYBRID_ARCHS:
        return "checkpoints"
    return "kv"


def outputs_to_reserve(path: Path, outputs: int, n_ctx: int, n_batch: int, swa_full: bool = False) -> int:
    """How many logits rows a target's context should reserve at load (see compat.context_params): the
    `outputs` its largest verify batch asks for, or 1 where that reservation does not pay.

    llama.cpp sizes its output buffer to the largest batch's outputs so far, reallocating it at each
    growth, and every reallocation is fresh memory the next decode faults in: gemma-3-270m's rows are 1 MiB
    each (262k vocabulary), and a first reply whose drafts grew 8 -> 16 -> 40 -> 48 -> 64 took 29-51
    thousand page faults where one reservation takes 13-18 thousand, 1.055x faster (medians of 6 fresh
    processes, benchmarks/output_reserve.py). The reservation is made through `n_seq_max`, which also
    sizes two other things: a recurrent model's states (one per sequence, so never there), and a
    sliding-window cache (n_swa x n_seq_max + n_batch cells, up to n_ctx). That growth, counting every
    layer as windowed, may cost no more memory than the rows themselves (gemma-3-270m at -c 4096: 57 MB
    for 68 MB of rows; gemma-3-27B would take 1.3 GB, and is left to reallocate)."""
    outputs = min(outputs, n_batch, LLAMA_MAX_SEQ)  # a verify batch fits one decode; llama.cpp's limit
    if outputs <= 1:
        return 1
    arch, values = gguf_values(path)
    if arch is None or arch_memory(arch) != "kv":
        return 1
    n_swa = 0 if swa_full else int(values.get("attention.sliding_window", 0) or 0)
    if n_swa:
        n_layer = int(values.get("block_count", 0))
        n_head = int(values.get("attention.head_count", 1)) or 1
        head_dim = int(values.get("embedding_length", 0)) // n_head
        n_kv = int(values.get("attention.head_count_kv", n_head))
        per_cell = n_layer * n_kv * (int(values.get("attention.key_length", head_dim))
                                     + int(values.get("attention.value_length", head_dim))) * 2  # f16 K and V
        grown = min(n_ctx, n_swa * outputs + n_batch) - min(n_ctx, n_swa + n_batch)
        if grown * per_cell > int(values.get("vocab_size", 0)) * outputs * 4:  # float32 logits
            return 1
    return outputs


@dataclass
class _Checkpoint:
    """The recurrent part of the sequence state after the first `n_tokens` tokens."""

    n_tokens: int
    data: object  # ctypes uint8 buffer, reused while its size fits
    size: int  # of the state in it


class LlamaCppBackend:
    """One GGUF model and its context, evaluated through llama_decode with our own batch."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_ctx: int = 4096,
        n_gpu_layers: int | None = None,
        n_threads: int | None = None,
        n_batch: int = 512,
        swa_full: bool = False,
        name: str | None = None,
        rpc: Sequence[str] = (),
        flash_attn: str = "auto",
        snapshots: int = MAX_SNAPSHOTS,
        mtp: bool = False,
        outputs: int = 1,
    ):
        """`snapshots`: recurrent-state snapshots to keep where the architecture supports them (the longest
        draft whose batch can be cut back without a copy); 0 for a model whose cache is cut after single-
        token decodes (a draft model), where snapshots of one batch cannot help. `outputs`: the logits rows
        of the largest batch to come (a target's longest verify), reserved at load where that pays (see
        outputs_to_reserve)."""
        import llama_cpp

        quiet_llama_logs(llama_cpp)
        self._lib = llama_cpp
        path = Path(path)
        check_gguf_file(path)
        self.rpc = tuple(rpc)
        self.rpc_devices, devices = _rpc_devices(self.rpc)
        if n_gpu_layers is None:
            n_gpu_layers = -1 if self.rpc else default_gpu_layers()
        self.path = path
        self.name = name or path.name
        self.outputs = outputs
        self.reserved_outputs = outputs_to_reserve(path, outputs, n_ctx, n_batch, swa_full)
        started = time.perf_counter()
        try:
            with (compat.model_devices(devices),
                  compat.context_params(flash_attn, snapshots, load_mtp=mtp, outputs=self.reserved_outputs)):
                self.llm = llama_cpp.Llama(
                    str(path),
                    n_ctx=n_ctx,
                    n_batch=n_batch,
                    n_ubatch=n_batch,
                    n_gpu_layers=n_gpu_layers,
                    n_threads=n_threads,
                    n_threads_batch=n_threads,
                    swa_full=swa_full,
                    logits_all=False,
                    verbose=False,
                )
        except (ValueError, RuntimeError, OSError) as e:
            size = path.stat().st_size
            if self.rpc:
                raise rpc_workers.load_failure(path, size, self.rpc_devices, str(e)) from None
            if "llama_context" in str(e):  # the weights loaded; the KV cache and buffers did not fit
                trained = gguf_context_length(path)
                raise BackendError(
                    f"cannot allocate the KV cache for -c {n_ctx} with {path.name}"
                    + (f"; the model was trained for {trained} tokens" if trained else "")
                    + f": use a smaller -c (e.g. -c {min(trained or 4096, 4096)})"
                ) from None
            raise BackendError(
                f"llama.cpp could not load {path} ({size / 2**20:.1f} MiB): the file is truncated, corrupt, "
                f"or of an architecture this llama.cpp does not know ({str(e).splitlines()[0]})"
            ) from None
        self.load_seconds = time.perf_counter() - started
        self.n_ctx = llama_cpp.llama_n_ctx(self.llm.ctx)
        self.n_batch = n_batch
        self.n_threads = self.llm.n_threads
        self.n_gpu_layers = n_gpu_layers
        self._model = self.llm.model
        self.n_layer = llama_cpp.llama_model_n_layer(self._model)
        self.n_layer_nextn = (llama_cpp.llama_model_n_layer_nextn(self._model)
                              if hasattr(llama_cpp, "llama_model_n_layer_nextn") else 0)
        self.mtp_loaded = mtp
        self.flash_attn = flash_attn
        # called after every decode with (position of the batch's first token, its final hidden rows):
        # how an MTP head sees the target's hidden states (see capture_hidden)
        self.hidden_sink = None
        self._capture_layers: tuple[int, ...] = ()
        self._n_embd_out = llama_cpp.llama_model_n_embd_out(self._model)
        self._n_embd = llama_cpp.llama_model_n_embd(self._model)
        self._vocab_p = llama_cpp.llama_model_get_vocab(self._model)
        self._vocabulary = Vocabulary(llama_cpp, self._vocab_p)
        self.n_vocab = self._vocabulary.n_vocab
        self.n_swa = 0 if swa_full else llama_cpp.llama_model_n_swa(self._model)
        self._mem = llama_cpp.llama_get_memory(self.llm.ctx)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        for j in range(n_batch):  # every token of ours is in sequence 0
            self._batch.n_seq_id[j] = 1
            self._batch.seq_id[j][0] = 0
        # `tokens` is what the cache holds as far as callers are concerned. The memory itself holds its
        # first `_held` tokens, which can differ between a cut and the next decode: cuts are settled then
        # (see _settle), so two cuts in a row cost one, and tokens kept after a checkpoint restore are
        # evaluated again inside the next batch instead of in a decode of their own.
        self.tokens: list[int] = []
        self._held = 0
        self._last_batch = 0  # tokens in the last decode: the snapshots cover cuts inside it only
        # recurrent-state copies: "step" (before a batch that may be cut) and "turn" (where a reply
        # started, so a next turn that rewrites the last one does not re-read the whole conversation)
        self._checkpoints: dict[str, _Checkpoint] = {}
        self.evaluated = 0
        self.rollback_recoveries = 0
        self.reevaluated = 0  # tokens evaluated again after a checkpoint restore
        self.rollback_seconds = 0.0  # spent saving and restoring checkpoints
        self._views: dict[tuple[int, int], np.ndarray] = {}  # (buffer address, rows) -> view, see eval
        self.memory = self._warm_up()

    # -- evaluation --------------------------------------------------------------------------------

    def eval(self, tokens: Sequence[int], logits_at: Sequence[int], *, in_place: bool = False) -> np.ndarray:
        n = len(tokens)
        if len(self.tokens) + n > self.n_ctx:
            raise BackendError(
                f"context full: {len(self.tokens)} + {n} tokens > -c {self.n_ctx}; raise -c or shorten the prompt"
            )
        logits_at = list(logits_at)
        if self._held != len(self.tokens):
            redo = self._settle()
            if redo:  # kept tokens after a checkpoint restore: evaluated first, in the same batch
                self.reevaluated += len(redo)
                del self.tokens[self._held :]  # _decode appends them again
                tokens = [*redo, *tokens]
                logits_at = [len(redo) + i for i in logits_at]
                n = len(tokens)
        b = self._batch
        if n <= min(SMALL_BATCH, self.n_batch):
            # The per-step path (a verify batch, one draft token). Right after a decode the CPU caches
            # hold model weights, not ours, so every Python or numpy operation here is slow: a few
            # ctypes stores cost less than building arrays to copy from.
            p0, want = len(self.tokens), set(logits_at)
            for j, t in enumerate(tokens):
                b.token[j] = t
                b.pos[j] = p0 + j
                b.logits[j] = 1 if j in want else 0
            b.n_tokens = n
            self._decode(tokens)
            # One decode with its outputs in batch order: the rows can be llama.cpp's own logits
            # buffer, read in place. Copying them costs 0.6 MB a row at a 152k vocabulary.
            if in_place and all(x < y for x, y in zip(logits_at, logits_at[1:])):
                return self._rows_in_place(logits_at)
            return self._copy_rows(logits_at, range(len(logits_at)))
        want = np.zeros(n, dtype=np.int8)
        want[logits_at] = 1
        ids = np.asarray(tokens, dtype=np.int32)
        pos = np.arange(len(self.tokens), len(self.tokens) + n, dtype=np.int32)
        rows = np.empty((len(logits_at), self.n_vocab), dtype=np.float32)
        row_of = {i: r for r, i in enumerate(logits_at)}
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            ctypes.memmove(b.token, ids[start:].ctypes.data, 4 * m)
            ctypes.memmove(b.pos, pos[start:].ctypes.data, 4 * m)
            ctypes.memmove(b.logits, want[start:].ctypes.data, m)
            b.n_tokens = m
            self._decode(tokens[start : start + m])
            here = [int(j) for j in np.flatnonzero(want[start : start + m])]
            self._copy_rows(here, [row_of[start + j] for j in here], rows)
        return rows

    def _decode(self, chunk: Sequence[int]) -> None:
        """llama_decode of the batch already filled with `chunk`."""
        # `tokens` is extended first: a Ctrl-C lands between bytecodes, after llama_decode returned,
        # so the list always covers what the cache holds and a later truncate can clean up
        n_before = len(self.tokens)
        self.tokens.extend(chunk)
        self._held, self._last_batch = len(self.tokens), len(chunk)  # likewise
        rc = self._lib.llama_decode(self.llm.ctx, self._batch)
        if rc != 0:
            del self.tokens[n_before:]
            self._held, self._last_batch = n_before, 0
            # llama.cpp restores its memory after a failed decode; if it holds more than before, drop that
            # (a recurrent state that cannot be cut is rebuilt by the next decode)
            if not self._lib.llama_memory_seq_rm(self._mem, 0, n_before, -1):
                self._lib.llama_memory_clear(self._mem, True)
                self._held = 0
            raise BackendError(f"llama_decode failed with code {rc} ({self.name})")
        self.evaluated += len(chunk)
        if self.hidden_sink is not None:
            if self._capture_layers:  # EAGLE-3: the inputs of three layers, side by side per token
                n, width = len(chunk), self._n_embd
                rows = np.empty((n, width * len(self._capture_layers)), dtype=np.float32)
                for k, lid in enumerate(self._capture_layers):
                    ptr = self._nextn.get_embeddings_layer_inp(self.llm.ctx, lid)
                    rows[:, k * width : (k + 1) * width] = np.ctypeslib.as_array(ptr, shape=(n, width))
            else:
                ptr = self._nextn.get_embeddings_nextn(self.llm.ctx)
                rows = np.ctypeslib.as_array(ptr, shape=(len(chunk), self._n_embd_out))
            self.hidden_sink(n_before, rows)

    def capture_hidden(self, sink) -> None:
        """Hand every decode's final hidden rows (one per token, as llama.cpp's MTP graph reads them) to
        `sink(p0, rows)`; the rows are llama.cpp's buffer, valid until the next decode."""
        self._nextn = nextn_api()
        self._nextn.set_embeddings_nextn(self.llm.ctx, True, False)  # unmasked: a row for every token
        self._capture_layers = ()
        self.hidden_sink = sink

    def capture_layers(self, layers: Sequence[int], sink) -> None:
        """Hand every decode's inputs of `layers` (one row per token, the layers side by side) to
        `sink(p0, rows)`: what an EAGLE-3 head reads."""
        self._nextn = nextn_api()
        for lid in layers:
            self._nextn.set_embeddings_layer_inp(self.llm.ctx, lid, True)
        self._capture_layers = tuple(layers)
        self.hidden_sink = sink

    def _copy_rows(self, batch_idx, row_idx, rows: np.ndarray | None = None) -> np.ndarray:
        """Copy the last decode's logits at batch indices `batch_idx` into rows[row_idx]."""
        if rows is None:
            rows = np.empty((len(batch_idx), self.n_vocab), dtype=np.float32)
        for j, r in zip(batch_idx, row_idx):
            ptr = self._lib.llama_get_logits_ith(self.llm.ctx, j)
            rows[r] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return rows

    def _rows_in_place(self, logits_at: list[int]) -> np.ndarray:
        """The last decode's output rows as one view (valid until the next eval; callers only read it),
        or a copy when llama.cpp does not hold them contiguously in batch order.

        The view is left writeable: numpy copies a read-only array before an argmax (its contiguous-input
        request includes WRITEABLE), 1 MB per row at a 262k vocabulary, and the first copy of a larger
        batch lands on fresh pages that can stall for 100-250 ms. The fake backend lends writeable rows
        too and checks at its next eval that none was written, so the tests still catch a caller that
        writes into one."""
        m = len(logits_at)
        if m == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        lib, ctx = self._lib, self.llm.ctx
        first = ctypes.cast(lib.llama_get_logits_ith(ctx, logits_at[0]), ctypes.c_void_p).value
        last = first if m == 1 else ctypes.cast(lib.llama_get_logits_ith(ctx, logits_at[-1]), ctypes.c_void_p).value
        if first and last and last - first == 4 * self.n_vocab * (m - 1):
            # a view costs more to make than to keep: reuse it while llama.cpp keeps its buffer there
            view = self._views.get((first, m))
            if view is None:
                if self._views and next(iter(self._views))[0] != first:
                    self._views.clear()  # the buffer moved: views of the old one must never be handed out
                view = np.frombuffer((ctypes.c_float * (m * self.n_vocab)).from_address(first), dtype=np.float32)
                view = view.reshape(m, self.n_vocab)
                self._views[(first, m)] = view
            return view
        return self._copy_rows(logits_at, range(m))

    def truncate(self, n_keep: int) -> None:
        """Keep the first n_keep tokens. The memory is cut when it is next used (_settle)."""
        if n_keep < len(self.tokens):
            del self.tokens[n_keep:]

    def checkpoint(self, batch: int | None = None, *, turn: bool = False) -> None:
        """The caller will evaluate more and may then cut back to the current length: make that cut cheap.
        `batch`: the size of the one eval that follows before the cut (None: several may), which
        recurrent snapshots can undo without a copy. `turn`: the start of a reply, kept while the reply's
        own steps take theirs. A no-op for attention-only models."""
        if self.memory.kind == "kv":
            return
        started = time.perf_counter()
        if self._held != len(self.tokens):
            redo = self._settle()
            if redo:  # a checkpoint must be taken at a decode boundary: evaluate what was kept now
                self.reevaluated += len(redo)
                del self.tokens[self._held :]
                self.eval(redo, [])
        if self.memory.kind == "snapshots" and batch is not None and batch - 1 <= self.memory.snapshots:
            self.rollback_seconds += time.perf_counter() - started
            return
        lib, ctx, slot = self._lib, self.llm.ctx, "turn" if turn else "step"
        size = lib.llama_state_seq_get_size_ext(ctx, 0, STATE_PARTIAL)
        held = self._checkpoints.pop(slot, None)
        data = held.data if held is not None and len(held.data) >= size else (ctypes.c_uint8 * size)()
        if not lib.llama_state_seq_get_data_ext(ctx, data, size, 0, STATE_PARTIAL):
            raise BackendError(f"llama.cpp could not copy the recurrent state of {self.name}")
        self._checkpoints[slot] = _Checkpoint(len(self.tokens), data, size)
        self.rollback_seconds += time.perf_counter() - started

    def _settle(self) -> list[int]:
        """Bring the memory back to a prefix of `tokens` after cuts; return the tokens after that prefix,
        which the next decode must evaluate first (none, unless a checkpoint was restored)."""
        n = len(self.tokens)
        if self._held > n:
            self._cut(n)
        return self.tokens[self._held :]

    def _cut(self, n: int) -> None:
        """Make the memory hold its first n tokens, the cheapest way this model allows."""
        lib = self._lib
        removed = self._held - n
        # a copy of a state past the cut is of tokens about to be replaced
        self._checkpoints = {k: c for k, c in self._checkpoints.items() if c.n_tokens <= n}
        # an attention cache cuts anywhere; a recurrent one at 0 (a reset) or within the last batch's
        # snapshots (llama.cpp does not check that the snapshot was written: a batch of m tokens writes m)
        can_rm = (self.memory.kind == "kv" or n == 0
                  or (self.memory.kind == "snapshots" and removed <= min(self.memory.snapshots, self._last_batch - 1)))
        if can_rm and lib.llama_memory_seq_rm(self._mem, 0, n, -1):
            ok = True
            if self.n_swa > 0 and n > 0:
                # Sliding-window layers recycle cells that fell out of the window. Rolling back past them
                # leaves the next query without keys it needs; llama.cpp's server checks the same bound.
                pos_min = lib.llama_memory_seq_pos_min(self._mem, 0)
                ok = 0 <= pos_min <= max(0, n - self.n_swa)
            if ok:
                self._held = n
                self._last_batch = 0  # a snapshot cut is single-use until the next decode
                return
        ckpt = max(self._checkpoints.values(), key=lambda c: c.n_tokens, default=None)
        if ckpt is not None:
            started = time.perf_counter()
            restored = lib.llama_state_seq_set_data_ext(self.llm.ctx, ckpt.data, ckpt.size, 0, STATE_PARTIAL)
            # the attention layers of a hybrid keep their cells: drop those after the checkpoint
            if restored and lib.llama_memory_seq_rm(self._mem, 0, ckpt.n_tokens, -1):
                self.rollback_seconds += time.perf_counter() - started
                self._held = ckpt.n_tokens
                self._last_batch = 0
                return
            # llama.cpp refused its own copy: say so rather than carry on from a state nobody knows
            self.rollback_recoveries += 1
            lib.llama_memory_clear(self._mem, True)
            self._held = self._last_batch = 0
            self._checkpoints = {}
            raise BackendError(f"restoring the recurrent-state checkpoint of {self.name} failed; its cache was "
                               "reset and the next reply reads the conversation again")
        # Nothing can cut here: start over, and the next decode reads everything again.
        self.rollback_recoveries += 1
        lib.llama_memory_clear(self._mem, True)
        self._held = 0
        self._last_batch = 0
        self._checkpoints = {}

    def _warm_up(self) -> MemoryKind:
        """One decode of one token, then an empty cache, as llama.cpp's tools do before their first request
        (common_init's warm-up): a process's first one-token decodes pay for building that graph and for
        first touches of the weights, up to 14 ms over the first two tokens on gemma-3-270m with two CPU
        cores, which would otherwise land on the first reply. The model's memory kind is read while that
        token is held (a recurrent state's size is measured after one token)."""
        self.eval([max(0, self.vocab.bos)], [0])
        memory = self._memory_kind()
        self._lib.llama_memory_clear(self._mem, True)
        self.tokens, self._held, self._last_batch, self.evaluated = [], 0, 0, 0
        return memory

    def _memory_kind(self) -> MemoryKind:
        """What llama.cpp says about this model's memory (common_context_can_seq_rm asks the same); called by
        _warm_up with one token held."""
        lib, model = self._lib, self._model
        arch = self.metadata.get("general.architecture", "")
        if not (lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model)):
            return MemoryKind("kv", arch)
        # the size of one copy of the recurrent state, as a checkpoint will take it: after the warm-up's token
        state = lib.llama_state_seq_get_size_ext(self.llm.ctx, 0, STATE_PARTIAL)
        snapshots = lib.llama_n_rs_seq(self.llm.ctx)  # 0 where the arch does not support them
        if state == 0 and snapshots == 0:  # nothing to copy it with, and no snapshots: it cannot be cut
            return MemoryKind("none", arch)
        return MemoryKind("snapshots" if snapshots > 0 else "checkpoints", arch, snapshots, state)

    # -- vocabulary --------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token contributes to the text (special tokens render as nothing)."""
        return self._vocabulary.token_bytes(token)

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation id (EOS, EOT, <|im_end|>...), for --ignore-eos."""
        if not hasattr(self, "_eog_ids"):
            self._eog_ids = tuple(t for t in range(self.n_vocab) if self._lib.llama_vocab_is_eog(self._vocab_p, t))
        return self._eog_ids

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab_p, token))

    @property
    def vocab(self) -> VocabInfo:
        return self._vocabulary.info

    @property
    def placement(self) -> str | None:
        """Where the layers are, when some are on RPC workers (None for an ordinary local load)."""
        if not self.rpc:
            return None
        return rpc_workers.placement(self.n_layer, self.n_gpu_layers, self.rpc_devices)

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.llm.metadata)

    @property
    def chat_template(self) -> str | None:
        return self.llm.metadata.get("tokenizer.chat_template")

    @property
    def bos_text(self) -> str:
        v = self.vocab
        return v.token_text(v.bos).decode("utf-8", "replace") if v.bos >= 0 else ""

    @property
    def eos_text(self) -> str:
        v = self.vocab
        return v.token_text(v.eos).decode("utf-8", "replace") if v.eos >= 0 else ""

    def close(self) -> None:
        if self.rpc and rpc_workers.unreachable(self.rpc):  # freeing buffers on a dead worker would abort the process
            rpc_workers.abandon(self)
            return
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None
        self.llm.close()


def _head_context_params(lib, target: LlamaCppBackend, ctx_type: int):
    params = lib.llama_context_default_params()
    params.n_ctx = target.n_ctx
    params.n_batch = params.n_ubatch = target.n_batch
    params.n_threads = params.n_threads_batch = target.n_threads
    params.n_seq_max = 1
    params.ctx_type = ctx_type
    params.ctx_other = target.llm.ctx  # the target's context: its weights, memory or embeddings
    params.n_rs_seq = 0
    params.flash_attn_type = {"auto": -1, "on": 1, "off": 0}[target.flash_attn]
    return params


class HeadBackend:
    """A drafting head: a llama.cpp context whose every entry is a token AND a hidden row. Which row goes
    with which token is the drafter's business (drafters.HeadDrafter); `eval` takes them paired
    (`llama_batch_ext_set_embd_token`), returns the logits rows asked for, and keeps the head's own output
    hidden rows in `hidden` for a chained draft. Backend-shaped, so the policy measures and learns its cost
    like a draft model's. Subclasses: MtpHead, Eagle3Head."""

    kind = ""
    # entry i of the head's cache holds context token i + shift (EAGLE-3 keeps no entry for token 0)
    shift = 0

    def _setup(self, target: LlamaCppBackend, ctx, n_embd: int, name: str, tag: str) -> None:
        lib = self._lib
        self.ctx = ctx
        self._api.set_embeddings_nextn(self.ctx, True, True)  # masked: hidden rows only where logits are asked
        self._mem = lib.llama_get_memory(self.ctx)
        self._batch = lib.llama_batch_ext_init(self.ctx)
        self.target = target
        self.n_embd = n_embd
        self.n_vocab = target.n_vocab
        self.n_ctx = target.n_ctx
        self.n_batch = target.n_batch
        self.name = name
        self.cost_tag = tag  # the head's costs are cached apart from the target's
        self.n_threads = target.n_threads
        self.rpc = target.rpc
        self.memory = MemoryKind("kv", self.kind)
        self.tokens: list[int] = []
        self.hidden = np.zeros((0, self.n_embd), dtype=np.float32)
        self.evaluated = 0
        self.rollback_recoveries = 0
        self.reevaluated = 0
        self.rollback_seconds = 0.0
        self._pos = ctypes.c_int32(0)

    def warm_up(self) -> None:
        """One decode now, as llama.cpp warms up every context it creates: the head's buffers are allocated
        here, not inside the first draft."""
        self.eval([0], [0])
        self.truncate(0)
        self.evaluated = 0

    def eval(self, tokens: Sequence[int], logits_at: Sequence[int], *, in_place: bool = False,
             states: np.ndarray | None = None) -> np.ndarray:
        """Append entries (tokens[i], states[i]) at the next positions; states None = zero rows (the cost
        is the same: the policy's calibration). Returns the logits rows at `logits_at`; the head's output
        hidden rows there are left in `self.hidden`."""
        lib, n = self._lib, len(tokens)
        if len(self.tokens) + n > self.n_ctx:
            raise BackendError(f"context full: {self.name} holds {len(self.tokens)} + {n} tokens > -c {self.n_ctx}")
        if states is None:
            states = np.zeros((n, self.n_embd), dtype=np.float32)
        states = np.ascontiguousarray(states, dtype=np.float32)
        want = list(logits_at)
        rows = np.empty((len(want), self.n_vocab), dtype=np.float32)
        hidden = np.empty((len(want), self.n_embd), dtype=np.float32)
        row_of = {i: r for r, i in enumerate(want)}
        rows_first = want == list(range(len(want))) and len(want) <= self.n_batch
        base = states.ctypes.data
        stride = 4 * self.n_embd
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            lib.llama_batch_ext_clear(self._batch)
            p0 = len(self.tokens)
            for j in range(m):
                idx = lib.llama_batch_ext_add_token(self._batch, 0, int(tokens[start + j]))
                self._pos.value = p0 + j
                lib.llama_batch_ext_set_pos(self._batch, idx, ctypes.byref(self._pos))
                embd = lib.llama_embd(ctypes.cast(base + (start + j) * stride, ctypes.POINTER(ctypes.c_float)),
                                      1, self.n_embd)
                # the hidden row rides as the entry's embedding beside its token id, as llama.cpp's own
                # MTP hook batches do (llama_batch_ext_set_embd_state is still a stub returning false)
                if idx < 0 or not lib.llama_batch_ext_set_embd_token(self._batch, idx, embd):
                    raise BackendError(f"llama.cpp refused an MTP batch entry ({self.name})")
                lib.llama_batch_ext_set_output_logits(self._batch, idx, (start + j) in row_of)
            rc = lib.llama_process(self.ctx, 1, self._batch)  # LLAMA_PROCESS_TYPE_DECODE
            if rc != 0:
                lib.llama_memory_seq_rm(self._mem, 0, p0, -1)
                raise BackendError(f"llama_process failed with code {rc} ({self.name})")
            self.tokens.extend(int(t) for t in tokens[start : start + m])
            self.evaluated += m
            for j in range(m):
                r = row_of.get(start + j)
                if r is not None:
                    rows[r] = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, j), shape=(self.n_vocab,))
                    if rows_first:
                        hidden[r] = np.ctypeslib.as_array(self._api.get_embeddings_nextn_ith(self.ctx, j),
                                                          shape=(self.n_embd,))
        # llama.cpp's masked hidden rows of an MTP decode are the first n_outputs rows of the batch, whatever
        # the outputs' indices: they are the outputs' own only when those come first (HeadDrafter evaluates
        # the entry it drafts from in a batch of its own, as llama.cpp does)
        self.hidden = hidden if rows_first else np.zeros((0, self.n_embd), dtype=np.float32)
        return rows

    def truncate(self, n_keep: int) -> None:
        if n_keep < len(self.tokens):
            if not self._lib.llama_memory_seq_rm(self._mem, 0, n_keep, -1):
                self._lib.llama_memory_clear(self._mem, True)
                n_keep = 0
            del self.tokens[n_keep:]

    def checkpoint(self, batch: int | None = None, *, turn: bool = False) -> None:
        pass  # an attention cache: any suffix is cut for free

    # the vocabulary is the target's
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.target.tokenize(text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.target.token_bytes(token)

    def eog_tokens(self) -> tuple[int, ...]:
        return self.target.eog_tokens()

    def is_eog(self, token: int) -> bool:
        return self.target.is_eog(token)

    @property
    def vocab(self) -> VocabInfo:
        return self.target.vocab

    @property
    def chat_template(self) -> str | None:
        return self.target.chat_template

    @property
    def bos_text(self) -> str:
        return self.target.bos_text

    @property
    def eos_text(self) -> str:
        return self.target.eos_text

    @property
    def placement(self) -> str | None:
        return None

    def close(self) -> None:
        if self.ctx:
            self.target.hidden_sink = None
            self._lib.llama_batch_ext_free(self._batch)
            self._lib.llama_free(self.ctx)
            self.ctx = None


class MtpHead(HeadBackend):
    """The target's own MTP (NextN) layers: a second context of type LLAMA_CONTEXT_TYPE_MTP on the target's
    weights (loaded with load_mtp), with a KV cache of its own for the MTP block. It reads the target's
    final hidden rows (llama_get_embeddings_nextn)."""

    kind = "mtp"
    shift = 0

    def __init__(self, target: LlamaCppBackend):
        lib = self._lib = target._lib
        if target.n_layer_nextn <= 0:
            raise BackendError(
                f"-md mtp: {target.name} has no MTP layers (llama_model_n_layer_nextn = 0); "
                "use a draft model or -md prompt-lookup"
            )
        if not target.mtp_loaded:
            raise BackendError(f"-md mtp: {target.name} was loaded without its MTP layers")
        self._api = nextn_api()
        ctx = lib.llama_init_from_model(target._model, _head_context_params(lib, target, 1))  # CONTEXT_TYPE_MTP
        if not ctx:
            raise BackendError(f"llama.cpp could not create the MTP context of {target.name}")
        self._setup(target, ctx, lib.llama_model_n_embd_out(target._model), f"{target.name} MTP", "|mtp")
        self.n_embd_in = self.n_embd  # it reads the target's final hidden rows as they are
        self.warm_up()
        self.path = target.path
        self.n_gpu_layers = target.n_gpu_layers

    def attach(self, sink) -> None:
        """Hand the drafter the target's final hidden row of every token it evaluates."""
        self.target.capture_hidden(sink)


class Eagle3Head(HeadBackend):
    """An EAGLE-3 draft head (llama.cpp's `eagle3` arch): a one-layer decoder trained for one target. Its
    encoder fuses three of the target's layer inputs (`<arch>.target_layers`) into one row g per token
    (`fc`, LLAMA_PROCESS_TYPE_ENCODE); its decoder reads (token, g) pairs. The target's token embeddings
    and LM head are read through `ctx_other` when the head has none of its own."""

    kind = "eagle3"
    shift = 1  # entry at position P is (token P+1, g_P): token 0 has none

    def __init__(self, target: LlamaCppBackend, path: str | os.PathLike, n_gpu_layers: int | None = None):
        lib = self._lib = target._lib
        path = Path(path)
        check_gguf_file(path)
        self._api = nextn_api()
        arch, values = gguf_values(path)
        if arch != "eagle3":
            raise BackendError(f"{path.name} is a {arch} model, not an EAGLE-3 head")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = target.n_gpu_layers if n_gpu_layers is None else n_gpu_layers
        self._model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise BackendError(f"llama.cpp could not load the EAGLE-3 head {path}")
        ctx = None
        try:
            problem = check_compatible(target.vocab, Vocabulary(lib, lib.llama_model_get_vocab(self._model)).info)
            if problem:
                raise BackendError(f"EAGLE-3 head {path.name} has another vocabulary than {target.name}: {problem}")
            layers = self._api.target_layers(self._model)
            n_layer = target.n_layer
            target_embd = lib.llama_model_n_embd(target._model)
            trained_embd = values.get("target_hidden_size")
            if trained_embd != target_embd:
                raise BackendError(f"EAGLE-3 head {path.name} reads hidden states of width {trained_embd}; "
                                   f"{target.name}'s are {target_embd}: it was trained for another target")
            if len(layers) != 3 or not all(0 <= lid < n_layer for lid in layers):
                raise BackendError(f"EAGLE-3 head {path.name} reads target layers {list(layers)}; {target.name} "
                                   f"has layers 0..{n_layer - 1}: it was trained for another target")
            ctx = lib.llama_init_from_model(self._model, _head_context_params(lib, target, 0))
            if not ctx:
                raise BackendError(f"llama.cpp could not create a context for the EAGLE-3 head {path.name}")
        except BaseException:
            lib.llama_model_free(self._model)
            raise
        self.layers = tuple(layers)
        self.n_embd_enc = self.n_embd_in = 3 * target_embd
        self._setup(target, ctx, lib.llama_model_n_embd(self._model), path.name, "")
        self.path = path
        self.n_gpu_layers = params.n_gpu_layers
        self.encode(np.zeros((1, self.n_embd_in), dtype=np.float32))
        self.warm_up()

    def attach(self, sink) -> None:
        """Hand the drafter the three layer inputs of every token the target evaluates (`n_embd_in` wide);
        the drafter encodes only the rows it pairs (`encode`), so a run without drafts pays a copy only."""
        self.target.capture_layers(self.layers, sink)

    def encode(self, features: np.ndarray) -> np.ndarray:
        """g rows (n, n_embd) from the target's fused features (n, 3 * target n_embd)."""
        lib, n = self._lib, len(features)
        features = np.ascontiguousarray(features, dtype=np.float32)
        out = np.empty((n, self.n_embd), dtype=np.float32)
        stride = 4 * self.n_embd_enc
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            lib.llama_batch_ext_clear(self._batch)
            # the per-token encoder reads no positions, but the batch must continue the memory's (as llama.cpp does)
            p0 = lib.llama_memory_seq_pos_max(self._mem, 0) + 1
            for j in range(m):
                embd = lib.llama_embd(ctypes.cast(features.ctypes.data + (start + j) * stride,
                                                  ctypes.POINTER(ctypes.c_float)), 1, self.n_embd_enc)
                idx = lib.llama_batch_ext_add_embd(self._batch, 0, embd)
                self._pos.value = p0 + j
                if idx < 0 or not lib.llama_batch_ext_set_pos(self._batch, idx, ctypes.byref(self._pos)):
                    raise BackendError(f"llama.cpp refused an EAGLE-3 encoder entry ({self.name})")
                lib.llama_batch_ext_set_output_embd(self._batch, idx, True)
            rc = lib.llama_process(self.ctx, 0, self._batch)  # LLAMA_PROCESS_TYPE_ENCODE
            if rc != 0:
                raise BackendError(f"the EAGLE-3 encoder failed with code {rc} ({self.name})")
            out[start : start + m] = np.ctypeslib.as_array(self._api.get_embeddings_nextn(self.ctx),
                                                           shape=(m, self.n_embd))
        return out

    def close(self) -> None:
        if self.ctx:
            super().close()
            self._lib.llama_model_free(self._model)


def _rpc_devices(endpoints: Sequence[str]):
    """(the RPC devices of `endpoints`, the device list for llama_model_params or None for the default).
    Once any worker is registered in this process, every load names its devices: the default list would
    now include the workers."""
    if endpoints:
        devices = rpc_workers.register(endpoints)
        return devices, [d.handle for d in devices] + rpc_workers.local_gpu_devices()
    if rpc_workers.any_registered():
        return [], rpc_workers.local_gpu_devices()
    return [], None


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
        import llama_cpp

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
