"""Random-weight GGUF models of real shapes, built like tests/tiny_models.py's so that drafts are accepted.

    python benchmarks/gpu_models.py DIR --preset gpu      # Qwen2.5-1.5B / 0.5B-shaped pair + a qwen35 with MTP
    python benchmarks/gpu_models.py DIR --preset cpu      # the same three at smaller shapes
    python benchmarks/gpu_models.py DIR --tokenizer-only  # just the tokenizer file that travels to the GPU machine

benchmarks/gpu_check.py writes these on the lent GPU machine, where nothing can be downloaded and a real model
does not fit in what travels. Real shapes give real costs: the matrices are as wide and as many as the
model's, stored as Q8_0, with Qwen2.5's 151936-row vocabulary. What the weights say comes from
tests/tiny_models.py: its embeddings, successor map (a near-bigram model over SmolLM2's word tokens), output
head and MTP block, and its `_block_tensors` for every block. The target has tiny_models' TARGET_CONTEXT
(greedy text leaves the bigram cycle now and then) and the draft DRAFT_CONTEXT, so the draft's and the MTP
head's proposals are mostly, not always, accepted: the acceptance is whatever that gives, printed beside
every figure.

What differs from tiny_models (which writes a few-MB file with f32 blocks):
  * shapes: head size, head counts, FFN width, recurrent dims from `Shape`, not from n_embd alone;
  * the vocabulary: SmolLM2's 49152 tokens, then "[PAD<i>]" tokens of type UNUSED up to `n_vocab`, as
    convert_hf_to_gguf pads Qwen's; their embedding and head rows are 0, so they are never the argmax;
  * the block matrices are written straight as Q8_0 blocks (uniform int8 with the scale that gives
    tiny_models' standard deviation), so a 1.5B model takes seconds, not the minutes that drawing normals
    and quantizing them would take;
  * the dense pair is llama.cpp's `qwen2` architecture (llama blocks plus q/k/v biases, zero here).
The tokenizer comes from the SmolLM2 GGUF of the [models] extra, or from the file $SPECCHAT_TOKENIZER_GGUF
names (`--tokenizer-only` writes one: the tokenizer keys alone, ~2 MB), which is how it reaches the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import tiny_models as tm  # noqa: E402

QWEN_VOCAB = 151936  # Qwen2.5's embedding rows (151665 tokens, padded by convert_hf_to_gguf)
UNUSED = 5  # gguf.TokenType.UNUSED
Q8_0 = 8  # GGMLQuantizationType.Q8_0: blocks of 32 int8 with one f16 scale (34 bytes)


@dataclass(frozen=True)
class Shape:
    """One model's shape. `arch`: "qwen2" (dense) or "qwen35" (Gated DeltaNet + gated attention)."""

    name: str
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int = QWEN_VOCAB
    attn_every: int = 4  # qwen35: attention at every attn_every-th layer, DeltaNet elsewhere
    d_state: int = 128  # qwen35: DeltaNet head size (key = value head size)
    n_group: int = 16  # qwen35: DeltaNet key heads
    dt_rank: int = 16  # qwen35: DeltaNet value heads
    mtp: bool = False  # qwen35: one NextN (MTP) block after the trunk
    context: float | None = None  # tiny_models' `context` for this model (None: its TARGET_ / DRAFT_CONTEXT)

    def parameters(self) -> int:
        """Weights in the file (embeddings and head counted once each)."""
        d, hd = self.n_embd, self.head_dim
        ffn = 3 * d * self.n_ff
        attn = d * hd * (self.n_head + 2 * self.n_kv) + self.n_head * hd * d
        if self.arch == "qwen35":
            attn = d * hd * (2 * self.n_head + 2 * self.n_kv) + self.n_head * hd * d
            key, value = self.d_state * self.n_group, self.d_state * self.dt_rank
            delta = d * (2 * key + value) + d * value + value * d + 2 * d * self.dt_rank
            n_attn = self.n_layer // self.attn_every
            blocks = n_attn * (attn + ffn) + (self.n_layer - n_attn) * (delta + ffn)
            if self.mtp:
                blocks += attn + ffn + 2 * d * d + self.n_vocab * d
        else:
            blocks = self.n_layer * (attn + ffn)
        return blocks + 2 * self.n_vocab * d


# Qwen2.5-1.5B and -0.5B as their config.json has them (hidden, layers, heads, kv heads, intermediate); the
# hybrid is a ~0.8B qwen35 (Qwen3-Next's layout: attention every 4th layer, 256-wide gated attention heads,
# 128-wide DeltaNet heads), shapes chosen here, with one MTP block.
# tiny_models' TARGET_CONTEXT makes these wide, deep targets leave the bigram cycle more often than its small
# ones (greedy, 48 tokens from a cycle start, 2026-12-05): qwen2 target 1.6 -> 25% of positions, 1.45 -> 8%,
# 1.3 -> 2%; qwen35 1.3 -> 38%, 1.2 -> 15%, 1.1 -> 4%; the draft at DRAFT_CONTEXT 0.8 -> 0%. So the GPU
# targets take 1.45 and 1.2; the cpu preset's keep tiny_models' values (17% and 23%).
PRESETS: dict[str, dict[str, Shape]] = {
    "gpu": {
        "target": Shape("qwen2.5-1.5b-shaped", "qwen2", 1536, 28, 12, 2, 128, 8960, context=1.45),
        "draft": Shape("qwen2.5-0.5b-shaped", "qwen2", 896, 24, 14, 2, 64, 4864),
        "hybrid": Shape("qwen35-0.8b-shaped-mtp", "qwen35", 1024, 24, 8, 2, 256, 3584, mtp=True, context=1.2),
    },
    # the CPU proof of the pipeline: the same three kinds, a few ms a token on two cores
    "cpu": {
        "target": Shape("qwen2-small", "qwen2", 256, 4, 4, 2, 64, 1024),
        "draft": Shape("qwen2-small-draft", "qwen2", 128, 2, 2, 1, 64, 512),
        "hybrid": Shape("qwen35-small-mtp", "qwen35", 256, 4, 4, 2, 64, 512, d_state=32, n_group=4, dt_rank=4,
                        mtp=True),
    },
    # tests/test_gpu_check.py: seconds to write and load
    "test": {
        "target": Shape("qwen2-test", "qwen2", 64, 2, 2, 1, 32, 128, n_vocab=tm.N_VOCAB + 64),
        "draft": Shape("qwen2-test-draft", "qwen2", 64, 1, 2, 1, 32, 128, n_vocab=tm.N_VOCAB + 64),
        "hybrid": Shape("qwen35-test-mtp", "qwen35", 64, 2, 2, 1, 32, 128, n_vocab=tm.N_VOCAB + 64, attn_every=2,
                        d_state=16, n_group=2, dt_rank=4, mtp=True),
    },
}
ROLES = ("target", "draft", "hybrid")


def context_of(role: str, shape: Shape) -> float:
    """tiny_models' contexts (or the shape's own): the targets leave the bigram map now and then, the draft
    hardly ever."""
    if shape.context is not None:
        return shape.context
    arch = "llama" if shape.arch == "qwen2" else shape.arch
    return (tm.DRAFT_CONTEXT if role == "draft" else tm.TARGET_CONTEXT)[arch]


# ---------------------------------------------------------------------------------------------- Q8_0 matrices


class Q8:
    """A {n_in, n_out} weight drawn straight as Q8_0: uniform int8 in [-127, 127] times a scale that gives
    standard deviation `std` (tiny_models draws N(0, std^2) floats; the block costs are the same)."""

    def __init__(self, n_out: int, n_in: int, std: float, rng: np.random.Generator):
        self.n_out, self.n_in, self.std, self.rng = n_out, n_in, float(std), rng

    def __mul__(self, factor) -> Q8:
        return Q8(self.n_out, self.n_in, self.std * float(factor), self.rng)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.n_in)

    def blocks(self) -> np.ndarray:
        """The Q8_0 bytes, (n_out, n_in / 32 * 34) uint8, as gguf.quants.quantize returns them."""
        nb = self.n_in // 32
        out = np.empty((self.n_out, nb, 34), dtype=np.uint8)
        scale = self.std * np.sqrt(3.0) / 127.0  # uniform on [-127, 127] has std 127 / sqrt(3)
        out[:, :, :2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
        if scale == 0.0:
            out[:, :, 2:] = 0
        else:
            q = np.frombuffer(self.rng.bytes(self.n_out * self.n_in), dtype=np.int8).reshape(self.n_out, nb, 32)
            out[:, :, 2:] = np.where(q == -128, np.int8(0), q).view(np.uint8)
        return out.reshape(self.n_out, nb * 34)


class FastWeights(tm._Weights):
    """tiny_models' per-layer weights, with every matrix a Q8 (drawn when written); vectors unchanged."""

    def mat(self, n_out: int, n_in: int, gain: float = 1.0):
        if n_in % 32:
            return super().mat(n_out, n_in, gain)
        return Q8(n_out, n_in, gain / np.sqrt(n_in), self.rng)

    def out(self, n_out: int, n_in: int, gain: float = 1.0):
        return self.mat(n_out, n_in, gain) * self.context


def quantize_q8(x: np.ndarray) -> np.ndarray:
    """A float matrix as Q8_0 bytes (what gguf.quants.quantize gives, faster for the vocabulary-sized ones)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_out, n_in = x.shape
    b = x.reshape(n_out, n_in // 32, 32)
    d = np.abs(b).max(axis=2, keepdims=True) / 127.0
    q = np.round(np.divide(b, d, out=np.zeros_like(b), where=d > 0)).astype(np.int8)
    out = np.empty((n_out, n_in // 32, 34), dtype=np.uint8)
    out[:, :, :2] = d.astype(np.float16).view(np.uint8)
    out[:, :, 2:] = q.view(np.uint8)
    return out.reshape(n_out, n_in // 32 * 34)


def _pad_rows(x: np.ndarray, n_vocab: int) -> np.ndarray:
    """A vocabulary-sized matrix of tm.N_VOCAB rows as Q8_0 bytes of n_vocab rows (the extra rows 0)."""
    q = quantize_q8(x)
    if n_vocab == q.shape[0]:
        return q
    pad = np.zeros((n_vocab - q.shape[0], q.shape[1]), dtype=np.uint8)  # d = 0, q = 0: a zero row
    return np.concatenate([q, pad])


# ---------------------------------------------------------------------------------------------- the writer


def _params(shape: Shape) -> tuple[dict, dict]:
    """(GGUF keys without the arch prefix, dims for tm._block_tensors), from tiny_models' with this shape's
    sizes in place of its n_embd-derived ones."""
    base = "llama" if shape.arch == "qwen2" else shape.arch
    kv, dims = tm._arch_params(base, shape.n_embd, shape.n_layer, shape.attn_every)
    hd = shape.head_dim
    dims.update(hd=hd, n_head=shape.n_head, n_kv=shape.n_kv, n_ff=shape.n_ff)
    kv.update({"vocab_size": shape.n_vocab, "feed_forward_length": shape.n_ff, "attention.head_count": shape.n_head,
               "attention.head_count_kv": shape.n_kv})
    if shape.arch == "qwen2":
        if shape.n_head * hd != shape.n_embd:
            raise ValueError(f"{shape.name}: qwen2 needs n_head * head_dim == n_embd")
        kv.update({"rope.freq_base": 1000000.0, "rope.dimension_count": hd, "attention.layer_norm_rms_epsilon": 1e-6})
    else:
        n_rot = hd // 4  # Qwen3-Next's partial rotary factor 0.25
        half = n_rot // 2
        dims.update(d_state=shape.d_state, n_group=shape.n_group, dt_rank=shape.dt_rank)
        kv.update({"attention.key_length": hd, "attention.value_length": hd, "rope.dimension_count": n_rot,
                   "rope.dimension_sections": [half - 2 * (half // 3), half // 3, half // 3, 0],
                   "ssm.state_size": shape.d_state, "ssm.group_count": shape.n_group,
                   "ssm.time_step_rank": shape.dt_rank, "ssm.inner_size": shape.d_state * shape.dt_rank})
    return kv, dims


def write(path: str | os.PathLike, shape: Shape, *, context: float, seed: int = 0, cycle: int = 32,
          n_tokens: int = 2048) -> Path:
    """Write `shape` with tiny_models' weights at `context` (see its TARGET_CONTEXT / DRAFT_CONTEXT)."""
    import gguf

    if shape.n_vocab < tm.N_VOCAB:
        raise ValueError(f"n_vocab must be at least the tokenizer's {tm.N_VOCAB}")
    if shape.arch not in ("qwen2", "qwen35"):
        raise ValueError(f"unknown arch {shape.arch!r}")
    if shape.mtp and shape.arch != "qwen35":
        raise ValueError("MTP blocks are written for qwen35 only")
    path = Path(path)
    kv, dims = _params(shape)
    block_arch = "llama" if shape.arch == "qwen2" else shape.arch
    if shape.mtp:
        kv["block_count"] = shape.n_layer + 1
        kv["nextn_predict_layers"] = 1
    scale = context * tm._context_unit(shape.n_embd, shape.n_layer)
    tensors: dict[str, object] = {}
    for i in range(shape.n_layer):
        tensors.update(tm._block_tensors(block_arch, i, FastWeights(seed, i, scale), shape.n_embd, dims))
        if shape.arch == "qwen2":  # Qwen2's q/k/v biases (zero)
            for name, n in (("q", shape.n_head), ("k", shape.n_kv), ("v", shape.n_kv)):
                tensors[f"blk.{i}.attn_{name}.bias"] = np.zeros(n * shape.head_dim, dtype=np.float32)
    tensors["output_norm.weight"] = np.ones(shape.n_embd, dtype=np.float32)
    vocab_sized = {
        "token_embd.weight": np.asarray(tm._embeddings(seed, shape.n_embd)),
        "output.weight": tm._head(seed, shape.n_embd, cycle, n_tokens),
    }
    if shape.mtp:
        mtp = tm._mtp_tensors(shape.n_layer, seed, shape.n_embd, dims, cycle, n_tokens, tm.MTP_MIX)
        vocab_sized[tm._SHARED_HEAD.format(shape.n_layer)] = mtp.pop(tm._SHARED_HEAD.format(shape.n_layer))
        tensors.update(mtp)

    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_string("general.name", shape.name)
    writer.add_uint32("general.file_type", 7)  # MOSTLY_Q8_0
    tm.write_arch_keys(writer, shape.arch, kv)
    tm._write_tokenizer(writer, padded_vocabulary(shape.n_vocab))
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, data in vocab_sized.items():
        writer.add_tensor(name, _pad_rows(data, shape.n_vocab), raw_dtype=q8)
    for name, data in tensors.items():
        if isinstance(data, Q8):
            writer.add_tensor(name, data.blocks(), raw_dtype=q8)
        elif data.ndim == 2 and data.shape[1] % 32 == 0 and data.shape[0] > 1 and "norm" not in name:
            writer.add_tensor(name, quantize_q8(data), raw_dtype=q8)  # the MTP block's float matrices
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def padded_vocabulary(n_vocab: int):
    """A tm._write_tokenizer edit: SmolLM2's tokens, then "[PAD<i>]" tokens of type UNUSED up to n_vocab."""

    def edit(key, value):
        extra = n_vocab - tm.N_VOCAB
        if extra <= 0:
            return value
        if key == "tokenizer.ggml.tokens":
            return list(value) + [f"[PAD{i}]".encode() for i in range(tm.N_VOCAB, n_vocab)]
        if key == "tokenizer.ggml.token_type":
            return np.concatenate([np.asarray(value), np.full(extra, UNUSED, dtype=np.asarray(value).dtype)])
        return value

    return edit


def write_tokenizer(path: str | os.PathLike) -> Path:
    """A GGUF holding only SmolLM2's tokenizer keys: what $SPECCHAT_TOKENIZER_GGUF points tiny_models at."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "tokenizer")
    tm._write_tokenizer(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_role(args: tuple[str, str, str]) -> dict:
    directory, preset, role = args
    shape = PRESETS[preset][role]
    start = time.perf_counter()
    path = write(Path(directory) / f"{role}.gguf", shape, context=context_of(role, shape))
    return {"role": role, "path": str(path), "seconds": round(time.perf_counter() - start, 1),
            "mib": round(path.stat().st_size / 2**20, 1), "parameters": shape.parameters(),
            **asdict(shape), "context": context_of(role, shape)}  # the context used, not the shape's None


def write_preset(directory: str | os.PathLike, preset: str, parallel: bool = True) -> list[dict]:
    """target.gguf, draft.gguf and hybrid.gguf of `preset` in `directory` (one process each when parallel);
    a list of what was written (shape, seconds, MiB), also saved as models.json there."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tm.tokenizer_metadata()  # fail here, once, if there is no tokenizer
    jobs = [(str(directory), preset, role) for role in ROLES]
    if parallel:
        from multiprocessing import get_context

        with get_context("fork").Pool(len(jobs)) as pool:
            written = pool.map(_write_role, jobs)
    else:
        written = [_write_role(job) for job in jobs]
    (directory / "models.json").write_text(json.dumps(written, indent=1))
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--preset", default="gpu", help=f"one of {', '.join(PRESETS)}")
    ap.add_argument("--tokenizer-only", action="store_true", help="write DIRECTORY/tokenizer.gguf only")
    ap.add_argument("--serial", action="store_true", help="one model after another (default: in parallel)")
    a = ap.parse_args()
    if a.preset not in PRESETS:
        ap.error(f"--preset must be one of {', '.join(PRESETS)}, not {a.preset!r}")
    try:
        if a.tokenizer_only:
            print(write_tokenizer(a.directory / "tokenizer.gguf"))
            return
        for row in write_preset(a.directory, a.preset, parallel=not a.serial):
            print(f"{row['role']:<7} {row['name']:<26} {row['parameters'] / 1e9:5.2f}B params  {row['mib']:7.1f} MiB  "
                  f"{row['seconds']:5.1f} s  {row['path']}")
    except (FileNotFoundError, OSError, ValueError) as exc:
        sys.exit(f"gpu_models: {exc}")


if __name__ == "__main__":
    main()
