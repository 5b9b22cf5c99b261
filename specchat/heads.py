"""Drafting heads that read the target's hidden states: `MtpHead` (the target's own MTP / NextN layers)
and `Eagle3Head` (an EAGLE-3 head trained for one target), on their shared base `HeadBackend`, a llama.cpp
context whose entries are (token, hidden row) pairs. They sit beside a `LlamaCppBackend` target and reach
its hidden states through llama.cpp's staging API (compat.nextn_api); Backend-shaped, so the policy
measures and learns their cost like a draft model's.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from . import kinds
from . import rpc as rpc_workers
from .backend import LlamaCppBackend
from .compat import nextn_api
from .errors import BackendError
from .gguf_header import check_gguf_file, gguf_values
from .kinds import DrafterKind
from .memory import MemoryKind
from .vocab import VocabInfo, Vocabulary, check_compatible


def _head_context_params(lib, target: LlamaCppBackend, ctx_type: int):
    params = lib.llama_context_default_params()
    params.n_ctx = target.n_ctx
    params.n_batch = params.n_ubatch = target.n_batch
    params.n_threads = params.n_threads_batch = target.n_threads
    params.n_seq_max = 1
    params.ctx_type = ctx_type
    params.ctx_other = target.llm.ctx  # the target's context: its weights, memory or embeddings
    params.n_rs_seq = 0
    params.flash_attn_type = {"auto": -1, "on": 1, "off": 0}[target.flash_attn_used]
    return params


def load_head_model(target: LlamaCppBackend, path: Path, n_gpu_layers: int | None, what: str):
    """(llama_model pointer, its n_gpu_layers) of a head trained for `target` (EAGLE-3, DFlash), loaded on this
    machine's devices (never on an RPC worker: the default device list would include them), its vocabulary
    checked against the target's (one line, BackendError, and nothing left loaded, where it differs)."""
    lib = target._lib
    params = lib.llama_model_default_params()
    params.n_gpu_layers = target.n_gpu_layers if n_gpu_layers is None else n_gpu_layers
    here = rpc_workers.devices_here()
    if here is not None:
        devices = (ctypes.c_void_p * (len(here) + 1))(*here, None)  # NULL-terminated, lives through the load
        params.devices = ctypes.cast(devices, ctypes.c_void_p)
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise BackendError(f"llama.cpp could not load the {what} {path}")
    problem = check_compatible(target.vocab, Vocabulary(lib, lib.llama_model_get_vocab(model)).info)
    if problem:
        lib.llama_model_free(model)
        raise BackendError(f"{what} {path.name} has another vocabulary than {target.name}: {problem}")
    return model, params.n_gpu_layers


@runtime_checkable
class DraftingHead(Protocol):
    """What a head declares to the drafter that pairs it with the target (drafters.HeadDrafter)."""

    drafts_as: DrafterKind  # the kind its drafts are
    shift: int  # entry i of the head's cache holds context token i + shift (EAGLE-3 keeps no entry for token 0)
    n_embd_in: int  # how wide a row the target hands over per token

    def attach(self, sink: Callable[[int, np.ndarray], None]) -> None:
        """Have the target hand `sink` (first position, rows) the rows this head reads, as it evaluates."""

    def encode(self, features: np.ndarray) -> np.ndarray:
        """The rows the head's entries pair with, from what the target handed over."""


def describe_eagle3_file(path: Path) -> str:
    """What an EAGLE-3 file is for, as `specchat models` says it: a target of this width, these layers read."""
    values = gguf_values(path)[1]
    layers = ", ".join(str(x) for x in values.get("target_layers", ())) or "?"
    return (f"EAGLE-3 head for a target of width {values.get('target_hidden_size', '?')}, reading its layers "
            f"{layers} (-md it with that target)")


class HeadBackend(DraftingHead):
    """A drafting head: a llama.cpp context whose every entry is a token AND a hidden row. Which row goes
    with which token is the drafter's business (drafters.HeadDrafter); `eval` takes them paired
    (`llama_batch_ext_set_embd_token`), returns the logits rows asked for, and keeps the head's own output
    hidden rows in `hidden` for a chained draft. Backend-shaped, so the policy measures and learns its cost
    like a draft model's. Subclasses: MtpHead, Eagle3Head."""

    shift = 0

    def _setup(self, target: LlamaCppBackend, ctx, n_embd: int, name: str, tag: str,
               n_embd_in: int | None = None) -> None:
        lib = self._lib
        self.ctx = ctx
        self._api.set_embeddings_nextn(self.ctx, True, True)  # masked: hidden rows only where logits are asked
        self._mem = lib.llama_get_memory(self.ctx)
        self._batch = lib.llama_batch_ext_init(self.ctx)
        self.target = target
        self.n_embd = n_embd
        self.n_embd_in = n_embd if n_embd_in is None else n_embd_in
        self.n_vocab = target.n_vocab
        self.n_ctx = target.n_ctx
        self.n_batch = target.n_batch
        self.name = name
        self.cost_tag = tag  # the head's costs are cached apart from the target's
        self.n_threads = target.n_threads
        self.rpc = target.rpc
        self.memory = MemoryKind("kv")
        self.tokens: list[int] = []
        self.hidden = np.zeros((0, self.n_embd), dtype=np.float32)
        self.evaluated = 0
        self.rollback_recoveries = 0
        self.reevaluated = 0
        self.rollback_seconds = 0.0
        self._pos = ctypes.c_int32(0)

    def _open_own(self, target: LlamaCppBackend, path: Path, n_gpu_layers: int | None, what: str,
                  trained_width: Callable[[Any], Any], n_layers: int | None = None,
                  check: Callable[[Any], None] | None = None) -> tuple[Any, tuple[int, ...], int]:
        """The head's own file (an EAGLE-3 head, a DFlash draft) loaded beside `target` into `_model`, checked
        to be trained for it (`trained_width(model)`: the width of the hidden states it reads; the target
        layers it reads, `n_layers` of them where it says; `check(model)`: anything more), and its context
        made: (context, the layers it reads, the target's width). Nothing stays loaded where anything fails."""
        lib = self._lib
        self._model, self.n_gpu_layers = load_head_model(target, path, n_gpu_layers, what)
        try:
            layers = tuple(self._api.target_layers(self._model))
            target_embd = lib.llama_model_n_embd(target._model)
            width = trained_width(self._model)
            if width != target_embd:
                raise BackendError(f"{what} {path.name} reads hidden states of width {width}; "
                                   f"{target.name}'s are {target_embd}: it was trained for another target")
            in_target = all(0 <= lid < target.n_layer for lid in layers)
            if not layers or n_layers not in (None, len(layers)) or not in_target:
                raise BackendError(f"{what} {path.name} reads target layers {list(layers)}; {target.name} "
                                   f"has layers 0..{target.n_layer - 1}: it was trained for another target")
            if check is not None:
                check(self._model)
            ctx = lib.llama_init_from_model(self._model, _head_context_params(lib, target, 0))
            if not ctx:
                raise BackendError(f"llama.cpp could not create a context for the {what} {path.name}")
        except BaseException:
            lib.llama_model_free(self._model)
            raise
        return ctx, layers, target_embd

    def attach(self, sink: Callable[[int, np.ndarray], None]) -> None:
        """The target's final hidden row of every token it evaluates, as they are."""
        self.target.capture_hidden(sink)

    def encode(self, features: np.ndarray) -> np.ndarray:
        return features

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

    drafts_as = kinds.MTP

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
        self.warm_up()
        self.path = target.path
        self.n_gpu_layers = target.n_gpu_layers


class Eagle3Head(HeadBackend):
    """An EAGLE-3 draft head (llama.cpp's `eagle3` arch): a one-layer decoder trained for one target. Its
    encoder fuses three of the target's layer inputs (`<arch>.target_layers`) into one row g per token
    (`fc`, LLAMA_PROCESS_TYPE_ENCODE); its decoder reads (token, g) pairs. The target's token embeddings
    and LM head are read through `ctx_other` when the head has none of its own."""

    drafts_as = kinds.EAGLE3
    shift = 1  # entry at position P is (token P+1, g_P): token 0 has none

    def __init__(self, target: LlamaCppBackend, path: str | os.PathLike, n_gpu_layers: int | None = None):
        lib = self._lib = target._lib
        path = Path(path)
        check_gguf_file(path)
        self._api = nextn_api()
        arch, values = gguf_values(path)
        if arch != "eagle3":
            raise BackendError(f"{path.name} is a {arch} model, not an EAGLE-3 head")
        ctx, self.layers, target_embd = self._open_own(target, path, n_gpu_layers, "EAGLE-3 head",
                                                       lambda model: values.get("target_hidden_size"), n_layers=3)
        self.n_embd_enc = 3 * target_embd
        self._setup(target, ctx, lib.llama_model_n_embd(self._model), path.name, "", n_embd_in=self.n_embd_enc)
        self.path = path
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
