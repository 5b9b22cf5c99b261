"""Everything specchat reaches for past llama-cpp-python's public API, in one place.

llama-cpp-python's `Llama` loads a model and its context with parameters it builds itself, and frees them
through exit stacks of its own. specchat needs a few things it does not offer: naming the devices a model
loads onto (RPC workers), llama.cpp's flash-attention `auto`, recurrent-state snapshots (`n_rs_seq`), the
MTP layers (`load_mtp`), the libllama handle for symbols it does not bind, and a model that is never freed.
Each is a short patch of a private name, valid for the versions pyproject.toml pins (tested on 0.3.36);
a new llama-cpp-python release is checked here and nowhere else.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager


def libllama() -> ctypes.CDLL:
    """llama-cpp-python's handle on libllama (`llama_cpp.llama_cpp._lib`), for symbols it does not bind."""
    import llama_cpp.llama_cpp as low

    return getattr(low, "_lib", None)


@contextmanager
def model_devices(handles: Sequence[int] | None):
    """While a `Llama` loads, make its llama_model_params name `handles` (ggml_backend_dev_t) as its devices;
    None leaves llama.cpp's default list.

    `Llama(...)` builds its model params from llama_model_default_params() and exposes no `devices`; this
    wraps that one function for the duration of the load. The array only has to live through the load:
    llama.cpp copies the list into the model."""
    import llama_cpp.llama_cpp as low

    if handles is None:
        yield
        return
    original = low.llama_model_default_params
    array = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)  # NULL-terminated

    def with_devices():
        params = original()
        params.devices = ctypes.cast(array, ctypes.c_void_p)
        return params

    low.llama_model_default_params = with_devices
    try:
        yield
    finally:
        low.llama_model_default_params = original


@contextmanager
def context_params(flash_attn: str, n_rs_seq: int = 0, load_mtp: bool = False, outputs: int = 1):
    """While a `Llama` loads, give its context llama.cpp's flash-attention setting and `n_rs_seq`, and its
    model `load_mtp` (the MTP / NextN layers a model carries for drafting; skipped unless asked for).
    `outputs` > 1: logits rows the context reserves when it is created. llama.cpp reserves max(n_seq_max,
    the batch's outputs) rows, so this is `n_seq_max`, with one KV cache shared by all sequences
    (`kv_unified`) so the context is not split between them; we only ever use sequence 0.

    `Llama(...)` offers flash attention only on and off, defaulting to off; llama.cpp (llama-cli,
    llama-server, llama-bench) defaults to auto, which turns it on where every layer's device supports it.
    Off costs ~9% of decode speed on CPU (gemma-3-270m, 2 threads). `n_rs_seq` (recurrent-state snapshots
    per sequence, see backend.MemoryKind), `n_seq_max` and `load_mtp` have no keyword at all. This wraps
    the two classes that receive the params (`llama_cpp._internals.LlamaContext` / `LlamaModel`) for the
    duration of the load."""
    import llama_cpp
    import llama_cpp._internals as internals

    value = {
        "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
        "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    }[flash_attn]
    original = internals.LlamaContext
    original_model = internals.LlamaModel

    class WithOurParams(original):
        def __init__(self, *, model, params, verbose=True):
            params.flash_attn_type = value
            params.n_rs_seq = n_rs_seq
            if outputs > 1:
                params.n_seq_max = outputs
                params.kv_unified = True
            super().__init__(model=model, params=params, verbose=verbose)

    class WithOurModelParams(original_model):
        def __init__(self, *, path_model, params, verbose=True):
            params.load_mtp = load_mtp
            super().__init__(path_model=path_model, params=params, verbose=verbose)

    internals.LlamaContext = WithOurParams
    internals.LlamaModel = WithOurModelParams
    try:
        yield
    finally:
        internals.LlamaContext = original
        internals.LlamaModel = original_model


def never_free(llm) -> None:
    """Make a `Llama` never free its model and context, not on close() and not from __del__ at exit: it
    frees them through the exit stacks of the Llama (`_stack`) and of its `_model` and `_ctx`
    (`_exit_stack`), which are replaced by empty ones. The caller keeps `llm` referenced."""
    for owner in (llm, getattr(llm, "_model", None), getattr(llm, "_ctx", None)):
        if owner is not None:
            for attr in ("_stack", "_exit_stack"):
                if hasattr(owner, attr):
                    setattr(owner, attr, ExitStack())
