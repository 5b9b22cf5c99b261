"""Models behind one small protocol: evaluate tokens, get logits only where asked, roll the KV cache back.

`LlamaCppBackend` drives llama.cpp's batch API directly through llama-cpp-python's ctypes layer: the
high-level `Llama.eval` either keeps logits for one position or (with `logits_all`) copies an
n_ctx x n_vocab array for every token, and speculative verification needs k+1 rows and nothing more.
`Llama` is still used to load the model and for the tokenizer and metadata; what its public API does not
offer (devices, flash attention auto, n_rs_seq, load_mtp) is patched in compat.py, and nowhere else.
Beside it: gguf_header.py reads a file's header, memory.py how a cache is cut back, vocab.py the
vocabularies, heads.py the drafting heads.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from . import compat
from . import rpc as rpc_workers  # (`rpc` is a backend's list of endpoints)
from .compat import nextn_api, quiet_llama_logs
from .errors import BackendError
from .gguf_header import check_gguf_file, gguf_context_length, gguf_values
from .memory import MAX_SNAPSHOTS, MemoryKind, arch_memory
from .vocab import VocabInfo, Vocabulary

# batches up to this size are filled token by token (the per-step path); larger ones through numpy
SMALL_BATCH = 96


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

def default_gpu_layers() -> int:
    """All layers on the GPU when this build of llama.cpp can offload, else none (like LM Studio)."""
    import llama_cpp

    return -1 if llama_cpp.llama_supports_gpu_offload() else 0


FLASH_ATTN = ("auto", "on", "off")  # llama.cpp's -fa values
SCORES_MAX = 256 * 2**20  # bytes of attention scores a CPU context may hold to run without flash attention


def flash_attn_for(path: Path, flash_attn: str, n_ctx: int, n_batch: int, cpu_alone: bool) -> str:
    """What `-fa auto` means for a context: llama.cpp's auto (on wherever the device supports it) with any
    layer off the CPU, and off on a context that runs on the CPU alone.

    llama.cpp's CPU flash-attention kernel reads the whole KV cache once per query row, where the plain
    path's matrix product reads it once per batch, so a verify batch costs more with it the longer the
    conversation (at a shallow context the two cost about the same; docs/decisions.md, "Flash attention on
    a CPU"). The plain path holds the scores of a whole batch against the whole context (n_ctx x n_batch x heads floats): where that passes SCORES_MAX, auto stays on.
    `cpu_alone`: no layer offloaded, to a GPU here or an RPC worker (see cpu_alone)."""
    if flash_attn != "auto" or not cpu_alone:
        return flash_attn
    arch, values = gguf_values(path)
    n_head = values.get("attention.head_count", 0)
    n_head = max(n_head) if isinstance(n_head, tuple) else int(n_head or 0)
    if arch is None or n_head == 0 or arch_memory(arch) == "recurrent":  # no attention to choose for
        return flash_attn
    return "off" if n_ctx * min(n_batch, n_ctx) * n_head * 4 <= SCORES_MAX else flash_attn


def cpu_alone(n_gpu_layers: int, rpc: Sequence[str]) -> bool:
    """Whether a model runs on this machine's CPU alone. Not `llama_supports_gpu_offload()`: a build with
    the RPC backend says yes to that on a machine without a GPU (and -ngl -1 then offloads nothing)."""
    return not rpc and (n_gpu_layers == 0 or not rpc_workers.local_gpu_devices())


LLAMA_MAX_SEQ = 256  # llama.cpp's most sequences a context may have (src/llama-cparams.h)
STATE_PARTIAL = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: only the recurrent (or SWA) part of a sequence


def outputs_to_reserve(path: Path, outputs: int, n_ctx: int, n_batch: int, swa_full: bool = False) -> int:
    """How many logits rows a target's context should reserve at load (see compat.context_params): the
    `outputs` its largest verify batch asks for, or 1 where that reservation does not pay.

    llama.cpp sizes its output buffer to the largest batch's outputs so far, reallocating it at each
    growth, and every reallocation is fresh memory the next decode faults in: a 262k vocabulary's rows are
    1 MiB each, and a first reply whose drafts grow takes about twice the page faults of one reservation
    (docs/decisions.md, "Reserving the output rows"). The reservation is made through `n_seq_max`, which also
    sizes two other things: a recurrent model's states (one per sequence, so never there), and a
    sliding-window cache (n_swa x n_seq_max + n_batch cells, up to n_ctx). That growth, counting every
    layer as windowed, may cost no more memory than the rows themselves: where it would cost more, the
    buffer is left to reallocate."""
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
        self.chat_format = None  # template.ChatFormat: the loader's choice of chat template (None: the GGUF's)
        self.outputs = outputs
        self.reserved_outputs = outputs_to_reserve(path, outputs, n_ctx, n_batch, swa_full)
        # what -fa auto means here (see flash_attn_for); `flash_attn` stays what was asked, for a reload elsewhere
        self.flash_attn_used = flash_attn_for(path, flash_attn, n_ctx, n_batch, cpu_alone(n_gpu_layers, self.rpc))
        started = time.perf_counter()
        try:
            with (compat.model_devices(devices),
                  compat.context_params(self.flash_attn_used, snapshots, load_mtp=mtp, outputs=self.reserved_outputs)):
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
        # called after every decode with (positions, rows): the final hidden state (after the output norm,
        # before the output projection) at each position whose logits were asked for, what Medusa heads read
        self.final_sink = None
        self._n_embd_out = llama_cpp.llama_model_n_embd_out(self._model)
        self.n_embd_out = self._n_embd_out  # the width of the final hidden rows (capture_final)
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
        self._tree_batch = None  # a batch whose tokens may carry several sequence ids (eval_tree)
        self._tree = None  # (position of the root, the tree, its leaves) between eval_tree and keep_branch
        self.memory = self._warm_up()

    # -- evaluation --------------------------------------------------------------------------------

    def eval(self, tokens: Sequence[int], logits_at: Sequence[int], *, in_place: bool = False) -> np.ndarray:
        if not self.rpc:
            return self._eval(tokens, logits_at, in_place=in_place)
        # On workers, llama.cpp's calls (the decode, the logits' read that waits for it) block for good on
        # one that stops answering: rpc.Watchdog ends the command past a deadline or on a signal.
        with rpc_workers.watchdog().waiting_on(self.rpc, len(tokens)):
            return self._eval(tokens, logits_at, in_place=in_place)

    def _eval(self, tokens: Sequence[int], logits_at: Sequence[int], *, in_place: bool = False) -> np.ndarray:
        n = len(tokens)
        if len(self.tokens) + n > self.n_ctx:
            raise BackendError(
                f"context full: {len(self.tokens)} + {n} tokens > -c {self.n_ctx}; raise -c or shorten the prompt"
            )
        logits_at = list(logits_at)
        if self._tree is not None:  # a tree left open: keep only its root
            self.keep_branch([])
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
        if self.final_sink is not None:
            b = self._batch
            at = [j for j in range(len(chunk)) if b.logits[j]]
            rows = np.empty((len(at), self._n_embd_out), dtype=np.float32)
            for r, j in enumerate(at):
                rows[r] = np.ctypeslib.as_array(self._lib.llama_get_embeddings_ith(self.llm.ctx, j),
                                                shape=(self._n_embd_out,))
            self.final_sink([n_before + j for j in at], rows)

    def capture_final(self, sink) -> None:
        """Hand every decode's final hidden rows at the positions whose logits it computed (llama.cpp's
        token embeddings of a context with embeddings on: the output norm's result) to `sink(positions,
        rows)`; None stops it. The logits are computed as before."""
        self._lib.llama_set_embeddings(self.llm.ctx, sink is not None)
        self.final_sink = sink

    # -- draft trees (tree.py) -----------------------------------------------------------------------

    def tree_capacity(self) -> int:
        """The most leaves a draft tree may have in one batch here: the context's sequences (n_seq_max,
        one KV cache shared by all: compat.context_params). 0 where trees cannot be decoded: recurrent and
        hybrid memories split a batch by sequence and refuse tokens that several sequences share, and while a
        head reads this model's rows by position (a tree's branches share positions)."""
        if self.memory.kind != "kv" or self.hidden_sink is not None or self.final_sink is not None:
            return 0
        return int(self._lib.llama_n_seq_max(self.llm.ctx))

    def eval_tree(self, root: int, tree) -> np.ndarray:
        """Evaluate `root` (the context's last token, not yet cached) and every node of `tree` in one
        decode; return len(tree) + 1 rows: the root's, then one after each node, each conditioned on the
        node's own path. Leaf s's branch is sequence s (the prefix is copied to each first); a node
        carries the ids of every leaf below it, at position prefix + depth. Until `keep_branch` the cache
        holds the context and the root as far as `tokens` says; the rows are valid until the next eval."""
        leaves = tree.leaf_sets()
        n_leaves = max(1, len(tree.leaves()))
        n = len(tree) + 1
        if n_leaves > self.tree_capacity() or n > self.n_batch:
            raise BackendError(f"a tree of {len(tree)} nodes and {n_leaves} leaves does not fit {self.name}'s "
                               f"context ({self.tree_capacity()} sequences, batches of {self.n_batch})")
        if len(self.tokens) + 1 + tree.depth() > self.n_ctx:
            raise BackendError(f"context full: {len(self.tokens)} + {1 + tree.depth()} tokens > -c {self.n_ctx}")
        if self._tree is not None:
            self.keep_branch([])
        if self._held != len(self.tokens):
            redo = self._settle()
            if redo:  # kept tokens after a checkpoint restore: evaluated on their own first
                self.reevaluated += len(redo)
                del self.tokens[self._held :]
                self._eval(redo, [])
        lib, mem = self._lib, self._mem
        if self._tree_batch is None:
            self._tree_batch = lib.llama_batch_init(self.n_batch, 0, self.tree_capacity())
        b = self._tree_batch
        p0 = len(self.tokens)
        for s in range(1, n_leaves):
            lib.llama_memory_seq_cp(mem, 0, s, -1, -1)
        b.token[0], b.pos[0], b.logits[0], b.n_seq_id[0] = root, p0, 1, n_leaves
        for s in range(n_leaves):
            b.seq_id[0][s] = s
        for i, (token, depth, seqs) in enumerate(zip(tree.tokens, tree.depths(), leaves), 1):
            b.token[i], b.pos[i], b.logits[i], b.n_seq_id[i] = token, p0 + depth, 1, len(seqs)
            for j, s in enumerate(seqs):
                b.seq_id[i][j] = s
        b.n_tokens = n
        self.tokens.append(root)
        self._held, self._last_batch = len(self.tokens), 0
        self._tree = (p0, tree, n_leaves)
        rc = lib.llama_decode(self.llm.ctx, b)
        if rc != 0:
            self._tree = None
            for s in range(1, n_leaves):
                lib.llama_memory_seq_rm(mem, s, -1, -1)
            lib.llama_memory_seq_rm(mem, 0, p0, -1)
            del self.tokens[p0:]
            self._held = p0
            raise BackendError(f"llama_decode failed with code {rc} on a draft tree ({self.name})")
        self.evaluated += n
        return self._rows_in_place(list(range(n)))

    def keep_branch(self, path: Sequence[int]) -> None:
        """After eval_tree: keep the root and the nodes of `path` (root to deepest, each a child of the one
        before) as sequence 0, and drop every other branch."""
        p0, tree, n_leaves = self._tree
        self._tree = None
        lib, mem = self._lib, self._mem
        kept = p0 + 1 + len(path)
        s = tree.leaf_sets()[path[-1]][0] if path else 0  # a branch through the path's last node
        lib.llama_memory_seq_rm(mem, s, kept, -1)
        if s != 0:
            lib.llama_memory_seq_rm(mem, 0, -1, -1)
            lib.llama_memory_seq_cp(mem, s, 0, -1, -1)
        if n_leaves > 1:
            lib.llama_memory_seq_keep(mem, 0)
        self.tokens.extend(tree.tokens[i] for i in path)
        self._held, self._last_batch = len(self.tokens), 0

    def capture_hidden(self, sink) -> None:
        """Hand every decode's final hidden rows (one per token, as llama.cpp's MTP graph reads them) to
        `sink(p0, rows)`; the rows are llama.cpp's buffer, valid until the next decode."""
        self._nextn = nextn_api()
        self._nextn.set_embeddings_nextn(self.llm.ctx, True, False)  # unmasked: a row for every token
        self._capture_layers = ()
        self.hidden_sink = sink

    def stop_capture(self) -> None:
        """Stop handing rows to a sink (capture_hidden, capture_layers) and stop llama.cpp extracting them."""
        if self.hidden_sink is None:
            return
        if self._capture_layers:
            for lid in self._capture_layers:
                self._nextn.set_embeddings_layer_inp(self.llm.ctx, lid, False)
        else:
            self._nextn.set_embeddings_nextn(self.llm.ctx, False, False)
        self._capture_layers = ()
        self.hidden_sink = None

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
        batch lands on fresh pages, which can stall a step several times over. The fake backend lends writeable rows
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
        if self._tree is not None:
            self.keep_branch([])
        if n_keep < len(self.tokens):
            del self.tokens[n_keep:]

    def checkpoint(self, batch: int | None = None, *, turn: bool = False) -> None:
        """The caller will evaluate more and may then cut back to the current length: make that cut cheap.
        `batch`: the size of the one eval that follows before the cut (None: several may), which
        recurrent snapshots can undo without a copy. `turn`: the start of a reply, kept while the reply's
        own steps take theirs. A no-op for attention-only models."""
        if not self.rpc:
            return self._checkpoint(batch, turn=turn)
        with rpc_workers.watchdog().waiting_on(self.rpc, 1):  # (a state copy reads the workers' memory)
            return self._checkpoint(batch, turn=turn)

    def _checkpoint(self, batch: int | None, *, turn: bool) -> None:
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
        first touches of the weights, which would otherwise land on the first reply. The model's memory kind is read while that
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
        if getattr(self, "_tree_batch", None) is not None:
            self._lib.llama_batch_free(self._tree_batch)
            self._tree_batch = None
        self.llm.close()


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
