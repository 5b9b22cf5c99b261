"""Block drafters: DFlash and DSpark draft models (llama.cpp's `dflash` architecture), which fill a whole
block of draft positions in one non-causal forward pass over [last token, mask, mask, ...], attending to
the target's own layer inputs injected into their KV cache (common/speculative.cpp,
`common_speculative_impl_draft_dflash`; src/models/dflash.cpp).

DFlash reads block slots 1.. (slot i predicts the token i after the last one). DSpark adds a low-rank
Markov head: each slot's logits get bias(prev) = markov_w2 . markov_w1[prev], prev being the token before
it, so the block is semi-autoregressive; an anchor-first DSpark (`dflash.sample_from_anchor`) reads slots
0.., and an optional confidence head says how likely each slot is kept (cut like --spec-draft-p-min).

Lossless at any temperature: each token is drawn from the draft's processed distribution q at its slot
(the target's sampler chain), and verified against that q. llama.cpp keeps a block token only where it
equals the target's own sample, and its graph conditions each Markov slot on the previous slot's argmax:
here a slot whose previous token was sampled off the argmax gets its Markov bias moved to that token
(bias(sampled) - bias(argmax), from the file's weights), so q really is "given the token before it".
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from . import kinds
from .backend import BackendError, LlamaCppBackend
from .compat import nextn_api
from .drafters import FREE, Draft, Forwards, HiddenRows, ReadsTarget, build_reader
from .gguf_header import check_gguf_file, gguf_layout
from .heads import HeadBackend
from .sampling import SamplingParams

DEFAULT_BLOCK = 16  # llama.cpp's block size where a file has no dflash.block_size


class BlockFile:
    """What a DFlash file holds beyond llama.cpp's view of it, from its header: which heads it has, its
    layout flags, and the Markov weights when a correction needs them (read from the file, dequantized by
    gguf-py, once)."""

    def __init__(self, path: Path):
        self.path = path
        layout = gguf_layout(path)
        self.arch = layout.arch if layout is not None else None
        self.values = layout.values if layout is not None else {}
        self._tensors = layout.tensors if layout is not None else {}
        self.markov = "markov_w1.weight" in self._tensors
        self.confidence = "conf_proj.weight" in self._tensors
        self.selector = "selector_hidden.weight" in self._tensors  # DFlash2's candidate selector
        self.causal = bool(self.values.get("attention.causal", False))
        # llama.cpp's default: a DSpark block starts with the anchor's own prediction unless the file says not
        self.anchor_first = self.markov and bool(self.values.get("sample_from_anchor", True))
        self.block_size = int(self.values.get("block_size", DEFAULT_BLOCK))

    def _array(self, name: str) -> np.ndarray:
        """A tensor as float32 (or int64 for d2t), numpy shape = ggml's shape reversed."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        info = self._tensors[name]
        kind = GGMLQuantizationType(info.ggml_type)
        block, size = GGML_QUANT_SIZES[kind]
        count = int(np.prod(info.shape))
        raw = np.fromfile(self.path, dtype=np.uint8, count=count // block * size, offset=info.offset)
        shape = tuple(reversed(info.shape))
        if kind == GGMLQuantizationType.I64:
            return raw.view(np.int64).reshape(shape)
        if kind == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(shape)
        return np.asarray(dequantize(raw.reshape(shape[:-1] + (-1,)), kind), dtype=np.float32).reshape(shape)

    @cached_property
    def markov_weights(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(w1 [n_vocab, rank], w2 [n_vocab_draft, rank] (times its scale), d2t: the target ids of w2's rows or
        None)."""
        w1, w2 = self._array("markov_w1.weight"), self._array("markov_w2.weight")
        if "markov_w2.scale" in self._tensors:
            w2 = w2 * np.float32(self._array("markov_w2.scale").reshape(-1)[0])
        d2t = self._array("d2t").reshape(-1) if "d2t" in self._tensors else None
        return w1, w2, d2t


class BlockHead(HeadBackend):
    """A DFlash / DSpark draft model's llama.cpp context, beside the target (`ctx_other`: its token embeddings
    and LM head where the file has none). Its cache holds one entry per context token: the target's inputs
    of the file's `target_layers` at that position, injected (`inject`); `eval` runs a block after them."""

    drafts_as = kinds.DFLASH

    def __init__(self, target: LlamaCppBackend, path: str | os.PathLike, n_gpu_layers: int | None = None):
        lib = self._lib = target._lib
        path = Path(path)
        check_gguf_file(path)
        self._api = nextn_api()
        self.file = BlockFile(path)
        if self.file.arch != "dflash":
            raise BackendError(f"{path.name} is a {self.file.arch} model, not a DFlash or DSpark draft")
        if self.file.selector:
            raise BackendError(f"{path.name} is a DFlash2 draft (a candidate selector): specchat drafts with "
                               "DFlash and DSpark files; llama.cpp's --spec-type draft-dflash runs this one")
        self.path = path
        ctx, self.layers, n_embd = self._open_own(target, path, n_gpu_layers, "DFlash draft",
                                                  # llama.cpp reads target features as wide as the draft's own rows
                                                  lib.llama_model_n_embd, check=self._check_mask)
        lib.llama_set_causal_attn(ctx, self.file.causal)  # a block attends to itself both ways
        self.block_size = self.file.block_size
        # what the target hands over per token: the inputs of each layer it reads
        self._setup(target, ctx, n_embd, path.name, "", n_embd_in=len(self.layers) * n_embd)
        self._inject_pos = ctypes.c_int32(0)
        self.warm_up()

    def _check_mask(self, model) -> None:
        """A block is [last token, mask, mask, ...]: the draft must have a mask token."""
        lib = self._lib
        self.mask = int(lib.llama_vocab_mask(lib.llama_model_get_vocab(model)))
        if self.mask < 0:
            raise BackendError(f"DFlash draft {self.path.name} has no mask token (tokenizer.ggml.mask_token_id)")

    @property
    def markov(self) -> bool:
        return self.file.markov

    @property
    def anchor_first(self) -> bool:
        return self.file.anchor_first

    def attach(self, sink) -> None:
        """Hand the drafter the file's target layer inputs of every token the target evaluates."""
        self.target.capture_layers(self.layers, sink)

    def inject(self, tokens: Sequence[int], features: np.ndarray) -> None:
        """Append entries for context tokens `tokens` from their target features (n, n_embd_in): llama.cpp's
        fused decode encodes them (`fc`) and writes each layer's K/V at the tokens' positions."""
        lib, n = self._lib, len(tokens)
        features = np.ascontiguousarray(features, dtype=np.float32)
        stride = 4 * self.n_embd_in
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            lib.llama_batch_ext_clear(self._batch)
            p0 = len(self.tokens)
            for j in range(m):
                embd = lib.llama_embd(ctypes.cast(features.ctypes.data + (start + j) * stride,
                                                  ctypes.POINTER(ctypes.c_float)), 1, self.n_embd_in)
                idx = lib.llama_batch_ext_add_embd(self._batch, 0, embd)
                self._inject_pos.value = p0 + j
                if idx < 0 or not lib.llama_batch_ext_set_pos(self._batch, idx, ctypes.byref(self._inject_pos)):
                    raise BackendError(f"llama.cpp refused a DFlash feature entry ({self.name})")
            rc = lib.llama_process(self.ctx, 1, self._batch)  # LLAMA_PROCESS_TYPE_DECODE
            if rc != 0:
                lib.llama_memory_seq_rm(self._mem, 0, p0, -1)
                raise BackendError(f"llama_process failed with code {rc} ({self.name})")
            self.tokens.extend(int(t) for t in tokens[start : start + m])
            self.evaluated += m

    def block(self, tokens: Sequence[int], read: range) -> np.ndarray:
        """One block: `tokens` at the positions after the held entries, in one forward. Returns the logits rows
        of slots `read` as a view of llama.cpp's buffer (valid until the head's next decode). The entries stay
        until `truncate` (a drafter cuts them at once: a block's entries are noise, not context)."""
        lib, n = self._lib, len(tokens)
        if n > self.n_batch or len(self.tokens) + n > self.n_ctx:
            raise BackendError(f"a DFlash block of {n} does not fit ({self.name})")
        lib.llama_batch_ext_clear(self._batch)
        p0 = len(self.tokens)
        for j, token in enumerate(tokens):
            idx = lib.llama_batch_ext_add_token(self._batch, 0, int(token))
            self._pos.value = p0 + j
            if idx < 0 or not lib.llama_batch_ext_set_pos(self._batch, idx, ctypes.byref(self._pos)):
                raise BackendError(f"llama.cpp refused a DFlash block entry ({self.name})")
            lib.llama_batch_ext_set_output_logits(self._batch, idx, True)  # (DSpark's graph needs every slot)
        rc = lib.llama_process(self.ctx, 1, self._batch)
        if rc != 0:
            lib.llama_memory_seq_rm(self._mem, 0, p0, -1)
            raise BackendError(f"llama_process failed with code {rc} ({self.name})")
        self.tokens.extend(int(t) for t in tokens)
        self.evaluated += n
        # every slot is an output, in batch order: llama.cpp holds their rows contiguously
        rows = np.ctypeslib.as_array(lib.llama_get_logits(self.ctx), shape=(n, self.n_vocab))
        return rows[read.start : read.stop]

    def eval(self, tokens: Sequence[int], logits_at: Sequence[int], *, in_place: bool = False,
             states: np.ndarray | None = None) -> np.ndarray:
        """What a drafting step of a block of len(tokens) costs, as the calibration times it (the policy
        prices a draft with this): as many feature entries injected as a verify of that size brings back
        (zero rows), then the block. Returns the block's logits rows at `logits_at` (copies)."""
        self.inject(tokens, np.zeros((len(tokens), self.n_embd_in), dtype=np.float32))
        rows = self.block(tokens, range(len(tokens)))
        return np.array(rows[list(logits_at)], dtype=np.float32)

    def confidences(self, slots: Sequence[int]) -> np.ndarray:
        """The confidence head's value at block slots `slots` of the last eval (every slot an output): llama.cpp
        broadcasts it over the slot's hidden row (llama_get_embeddings_nextn)."""
        return np.array([self._api.get_embeddings_nextn_ith(self.ctx, j)[0] for j in slots], dtype=np.float32)

    def close(self) -> None:
        if self.ctx:
            super().close()
            self._lib.llama_model_free(self._model)


class BlockDrafter(ReadsTarget):
    """Drafts a block at a time from a BlockHead. The head's cache holds the target's features of context
    tokens 0..P-1 (those the target has evaluated: it holds context[:-1]); a draft is one forward of
    [context[-1] at P, mask, ...], read at its prediction slots, then cut. A draft costs one forward of the
    block (`forwards`): `extra_slots` block slots besides the tokens asked for."""

    def __init__(self, head: BlockHead, target: LlamaCppBackend, p_min: float = 0.0, draft_min: int = 0):
        self.kind = kinds.DFLASH
        self.source = "dspark" if head.markov else self.kind.name
        self.extra_slots = 0 if head.anchor_first else 1
        self.max_tokens = head.block_size - self.extra_slots
        self.features = HiddenRows(head.n_embd_in)
        super().__init__(head, target, self.features.put, head.attach, p_min, draft_min)

    def room(self) -> int:
        return self.head.n_ctx

    def offer(self, draft: Draft | None, limit: int):
        return super().offer(draft, min(limit, self.max_tokens))

    def forwards(self, drafted: int, asked: int) -> Forwards:
        """One forward of the whole block asked for, however many of its tokens the confidence kept."""
        return Forwards(1, asked + self.extra_slots) if asked > 0 else FREE

    def _catch_up(self, context: Sequence[int], end: int) -> None:
        """Make the head hold the features of context[:end], injecting only what differs from what it holds."""
        common = self._kept(context, end)
        if common < end:
            self.head.inject(context[common:end], self.features_at(range(common, end)))

    def features_at(self, positions: range) -> np.ndarray:
        """The target features the head's entries at `positions` are made of: the target's own at each
        position (a test that pairs wrongly through this sees the tiny drafts' acceptance collapse)."""
        return self.features.states(positions)

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        if 1 < len(prompt_ids) < self.head.n_ctx:
            self._catch_up(prompt_ids, len(prompt_ids) - 1)
            self.held.record(prompt_ids, len(prompt_ids) - 1)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        n = len(context)
        k = min(k, self.max_tokens, self.head.n_ctx - n - self.extra_slots)
        if k <= 0 or n < 2:
            return Draft()
        last = n - 1
        self._catch_up(context, last)
        slots = k + self.extra_slots
        read = range(self.extra_slots, slots)
        use_confidence = self.head.file.confidence and self.p_min > 0
        try:
            rows = self.head.block([context[-1]] + [self.head.mask] * (slots - 1), read)
            confidence = self.head.confidences(read) if use_confidence else None
        finally:
            self.head.truncate(last)  # the block's entries are noise: the next verify's features replace them
            self.held.record(context, last)
        return self._sample(rows, confidence, context, params, rng)

    def _sample(self, rows: np.ndarray, confidence: np.ndarray | None, context: Sequence[int],
                params: SamplingParams, rng: np.random.Generator) -> Draft:
        """The block's tokens, slot by slot; the confidence head (where it is read) cuts the block where the
        draft's own p_min would."""

        def row_at(i: int, drawn_prev: int | None) -> np.ndarray | None:
            if confidence is not None and confidence[i] < self.p_min:
                return None
            row = rows[i]
            if self.head.markov and i:
                # DSpark's graph conditions slot i's Markov bias on slot i - 1's argmax (the first slot's on
                # the anchor, as drawn); a token drawn off that argmax moves the bias to the token drawn
                graph_prev = int(np.argmax(rows[i - 1]))
                if drawn_prev != graph_prev:
                    row = row + self._markov_bias(drawn_prev) - self._markov_bias(graph_prev)
            return row

        return self._draft(context, len(rows), params, rng, row_at, source=self.source,
                           p_min=0.0 if confidence is not None else self.p_min)

    def _markov_bias(self, prev: int) -> np.ndarray:
        w1, w2, d2t = self.head.file.markov_weights
        bias = w2 @ w1[prev]
        if d2t is None:
            return bias
        full = np.zeros(self.head.n_vocab, dtype=np.float32)
        full[d2t] = bias
        return full


def describe_file(path: Path) -> str:
    """What a DFlash file is for, as `specchat models` says it: which kind, for a target of which width, which
    of its layers it reads, its block, its extra heads."""
    file = BlockFile(path)
    values = file.values
    layers = ", ".join(str(x) for x in values.get("target_layers", ())) or "?"
    heads = [name for name, present in (("Markov head", file.markov), ("confidence head", file.confidence),
                                        ("candidate selector (DFlash2: not drafted by specchat)", file.selector))
             if present]
    kind = "DSpark" if file.markov else "DFlash"
    return (f"{kind} block draft for a target of width {values.get('embedding_length', '?')}, reading its layers "
            f"{layers} · block {file.block_size}" + "".join(f" · {h}" for h in heads)
            + " (-md it with that target)")


def build_dflash(build) -> BlockDrafter:
    """A DFlash or DSpark draft from -md (--spec-type draft-dflash / draft-dspark: the file says which)."""
    return build_reader(build, f"loading block draft {build.spec.name}",
                        lambda: BlockHead(build.target, build.path, n_gpu_layers=build.opts.n_gpu_layers_draft),
                        BlockDrafter)
