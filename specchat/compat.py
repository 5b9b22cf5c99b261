"""Everything specchat reaches for past llama-cpp-python's public API, in one place.

llama-cpp-python's `Llama` loads a model and its context with parameters it builds itself, and frees them
through exit stacks of its own. specchat needs a few things it does not offer: naming the devices a model
loads onto (RPC workers), llama.cpp's flash-attention `auto`, recurrent-state snapshots (`n_rs_seq`), the
MTP layers (`load_mtp`), the libllama handle for symbols it does not bind (the drafting heads' staging API,
which libllama exports only as C++ symbols: `nextn_api`), a llama.cpp log kept off stderr, and a model that
is never freed.
Each is a short patch of a private name, valid for the versions pyproject.toml pins (tested on 0.3.36);
a new llama-cpp-python release is checked here and nowhere else.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager

from .errors import BackendError


def libllama() -> ctypes.CDLL:
    """llama-cpp-python's handle on libllama (`llama_cpp.llama_cpp._lib`), for symbols it does not bind."""
    import llama_cpp.llama_cpp as low  # start-up: llama_cpp takes 0.4 s to import

    return getattr(low, "_lib", None)


@contextmanager
def model_devices(handles: Sequence[int] | None):
    """While a `Llama` loads, make its llama_model_params name `handles` (ggml_backend_dev_t) as its devices;
    None leaves llama.cpp's default list.

    `Llama(...)` builds its model params from llama_model_default_params() and exposes no `devices`; this
    wraps that one function for the duration of the load. The array only has to live through the load:
    llama.cpp copies the list into the model."""
    import llama_cpp.llama_cpp as low  # start-up: llama_cpp takes 0.4 s to import

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
    Off costs decode speed on a CPU too at a shallow context (docs/decisions.md, "Flash attention on a
    CPU"). `n_rs_seq` (recurrent-state snapshots
    per sequence, see memory.MemoryKind), `n_seq_max` and `load_mtp` have no keyword at all. This wraps
    the two classes that receive the params (`llama_cpp._internals.LlamaContext` / `LlamaModel`) for the
    duration of the load."""
    import llama_cpp  # start-up: llama_cpp takes 0.4 s to import
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
        import llama_cpp  # start-up: llama_cpp takes 0.4 s to import
        import llama_cpp.llama_cpp as low

        version = getattr(llama_cpp, "__version__", "?")
        lib = libllama()
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
