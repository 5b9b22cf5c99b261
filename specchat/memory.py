"""How a model's cache can be cut back after a rejected draft: `MemoryKind` (attention KV, recurrent-state
snapshots, checkpoints, or none), llama.cpp's architecture lists that say which a model file has before
it is loaded (`arch_memory`), and how many snapshots a recurrent target keeps (`MAX_SNAPSHOTS`). The cuts
themselves are LlamaCppBackend's (backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass

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
