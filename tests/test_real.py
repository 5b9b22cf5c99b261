"""The engine on the two real GGUF models from PyPI (the [models] extra).

Greedy losslessness is the teacher-forced check of real_models.py: batched and single-token logits differ
by up to ~0.12 here, so every emitted token must be within a small tolerance of that position's best
logit in one fresh evaluation, not equal to plain greedy decoding's.
"""

from __future__ import annotations

import numpy as np
import pytest

from real_models import GREEDY, TOLERANCE, model_path, prompt_ids_for, run, teacher_forced_gaps
from specchat.backend import LlamaCppBackend, outputs_to_reserve, sync
from specchat.drafters import DraftModel, IncompatibleDraft
from specchat.lookup import PromptLookup
from specchat.sampling import SamplingParams

pytestmark = pytest.mark.real

PROMPTS = [
    "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape.",
    "Write a Python function that returns the sum of the squares of a list of numbers, then explain it.",
]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma-3-270m"])
def name(request):
    return request.param


@pytest.fixture(scope="module")
def target(name):
    backend = LlamaCppBackend(model_path(name), n_ctx=2048, n_threads=2, name=name)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def self_draft(name):
    backend = LlamaCppBackend(model_path(name), n_ctx=2048, n_threads=2, name=f"{name}-draft")
    yield backend
    backend.close()


@pytest.mark.parametrize("drafter_kind", ["prompt-lookup", "self-pair"])
def test_greedy_speculation_is_the_targets_greedy_choice(target, self_draft, drafter_kind):
    drafter = PromptLookup(1, 4) if drafter_kind == "prompt-lookup" else DraftModel.checked(self_draft, target, p_min=0.0)
    accepted = drafted = 0
    for text in PROMPTS:
        prompt_ids = prompt_ids_for(target, text)
        finished, tokens = run(target, drafter, prompt_ids, GREEDY, k=6)
        assert len(finished.token_ids) > 10
        gaps = teacher_forced_gaps(target, prompt_ids, finished.token_ids)
        assert gaps.max() <= TOLERANCE, f"token {int(gaps.argmax())} is {gaps.max():.3f} below the best logit"
        if drafter_kind == "self-pair":
            # the same model drafting greedily for itself: near-total acceptance is the point of the test.
            # A batch's logits differ slightly from a single token's, so a near-tie may flip once in a reply
            # (one rejected draft of 6 in a 20-token reply is 75% acceptance)
            assert sum(e.source == "resampled" for e in tokens) <= 1
            assert {"accepted", "bonus"} <= {e.source for e in tokens}
            accepted, drafted = accepted + finished.stats.accepted, drafted + finished.stats.drafted
        assert finished.stats.rollback_recoveries == 0
    if drafter_kind == "self-pair":
        assert accepted > 0.8 * drafted


def test_teacher_forced_check_catches_a_wrong_token(target):
    """The check above has teeth: one swapped token shows up far outside the tolerance."""
    prompt_ids = prompt_ids_for(target, PROMPTS[0])
    finished, _ = run(target, PromptLookup(1, 4), prompt_ids, GREEDY, k=4, max_tokens=16)
    corrupted = list(finished.token_ids)
    middle = len(corrupted) // 2
    corrupted[middle] = (corrupted[middle] + 1234) % target.n_vocab
    assert teacher_forced_gaps(target, prompt_ids, corrupted).max() > TOLERANCE


def test_same_seed_reproduces_a_sampled_run(target, self_draft):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=1234)
    prompt_ids = prompt_ids_for(target, "Tell me a short story about a lighthouse keeper.")
    drafter = DraftModel.checked(self_draft, target, p_min=0.0)
    first, _ = run(target, drafter, prompt_ids, params, k=4, max_tokens=40)
    second, _ = run(target, drafter, prompt_ids, params, k=4, max_tokens=40)
    other, _ = run(target, drafter, prompt_ids, SamplingParams(**{**params.__dict__, "seed": 99}), k=4, max_tokens=40)
    assert first.token_ids == second.token_ids
    assert first.text == second.text
    assert other.token_ids != first.token_ids


def test_rollback_never_fails_over_a_long_run(target, name):
    """Across gemma-3's 512-token sliding window and past it, with a rollback nearly every step. The prompt
    counts most of the way there (one batch is cheap), the run crosses it 100+ tokens in (SmolLM2 has no
    window: a short prompt and a third of the run show the same)."""
    upto = 125 if name == "gemma-3-270m" else 3
    text = "Count upwards from one, one number per line: " + "".join(f"{i}\n" for i in range(1, upto + 1))
    prompt_ids = prompt_ids_for(target, text)
    params = SamplingParams(temperature=0.7, seed=7, banned=target.eog_tokens())  # --ignore-eos
    n = 200 if name == "gemma-3-270m" else 240
    if name == "gemma-3-270m":
        assert len(prompt_ids) + 64 < 512 < len(prompt_ids) + n - 64, len(prompt_ids)
    finished, _ = run(target, PromptLookup(1, 3), prompt_ids, params, k=8, max_tokens=n)
    assert len(finished.token_ids) == n
    assert finished.stats.steps > n // 13
    assert finished.stats.drafted > finished.stats.accepted  # rejections happened, so rollbacks did
    assert finished.stats.rollback_recoveries == 0
    assert target.tokens == prompt_ids + finished.token_ids[:-1]


def test_kv_cache_matches_a_fresh_evaluation_after_rollbacks(target):
    """After many accepted/rejected steps, the next-token logits from the rolled-back cache equal those
    of a fresh evaluation of the same tokens (up to batch noise)."""
    prompt_ids = prompt_ids_for(target, PROMPTS[1])
    finished, _ = run(target, PromptLookup(1, 4), prompt_ids, SamplingParams(temperature=0.8, seed=3), k=8,
                      max_tokens=120)
    context = prompt_ids + finished.token_ids
    kept = sync(target, context, logits_last=True)
    target.truncate(0)
    sync(target, context[:-1], logits_last=False)
    fresh = sync(target, context, logits_last=True)

    def probs(x):
        e = np.exp(x.astype(np.float64) - x.max())
        return e / e.sum()

    total_variation = 0.5 * np.abs(probs(kept) - probs(fresh)).sum()
    assert int(kept.argmax()) == int(fresh.argmax())
    # token-by-token vs batched evaluation alone moves SmolLM2 by TV ~0.02; a wrong cache moves it far more
    assert total_variation < 0.06, total_variation


def test_gemma_target_refuses_smollm2_draft():
    gemma = LlamaCppBackend(model_path("gemma-3-270m"), n_ctx=256, n_threads=2, name="gemma-3-270m")
    smol = LlamaCppBackend(model_path("smollm2-135m"), n_ctx=256, n_threads=2, name="smollm2-135m")
    try:
        with pytest.raises(IncompatibleDraft) as err:
            DraftModel.checked(smol, gemma)
        message = str(err.value)
        assert "smollm2-135m" in message and "gemma-3-270m" in message
        assert "prompt-lookup" in message
        assert "\n" not in message
    finally:
        gemma.close()
        smol.close()


def test_flash_attention_setting_reaches_llama_cpp():
    """-fa: `on` and `off` are different attention kernels (same favourite, logits not identical); two loads with
    the same setting give identical logits; the default `auto` is off on a context that runs on the CPU alone
    (see backend.flash_attn_for) and llama.cpp's auto where layers are offloaded."""
    path = model_path("smollm2-135m")

    def last_row(mode):
        backend = LlamaCppBackend(path, n_ctx=256, n_threads=2, flash_attn=mode)
        try:
            ids = backend.tokenize("The river flows north through eleven countries and", add_special=True)
            return backend.eval(ids, [len(ids) - 1])[0].copy(), backend.llm.context_params.flash_attn_type
        finally:
            backend.close()

    on, on_type = last_row("on")
    off, off_type = last_row("off")
    again, _ = last_row("on")
    _, auto_type = last_row("auto")
    import llama_cpp

    from specchat.backend import cpu_alone, default_gpu_layers

    auto_expected = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED if cpu_alone(default_gpu_layers(), ())
                     else llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO)
    assert (on_type, off_type, auto_type) == (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                              llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED, auto_expected)
    np.testing.assert_array_equal(on, again)
    assert not np.array_equal(on, off)
    # the same model either way: the kernels differ in accumulation (seen here: up to ~0.8 on a logit)
    assert int(np.argmax(on)) == int(np.argmax(off))
    assert np.corrcoef(on, off)[0, 1] > 0.99


def test_a_reserved_target_gives_the_same_logits_and_reserves_only_where_it_pays():
    """outputs=65 makes gemma's context reserve 65 logits rows at load (llama.cpp would otherwise reallocate
    its output buffer at each larger verify batch). Only sequence 0 is used and the KV cache is one, so the
    logits are bit for bit those of a plain context; the sliding-window cache grows with the reservation,
    so it is made only where that costs no more memory than the rows themselves."""
    import llama_cpp

    path = model_path("gemma-3-270m")
    plain = LlamaCppBackend(path, n_ctx=2048, n_threads=2)
    reserved = LlamaCppBackend(path, n_ctx=2048, n_threads=2, outputs=65)
    try:
        assert (plain.reserved_outputs, reserved.reserved_outputs) == (1, 65)
        assert llama_cpp.llama_n_seq_max(reserved.llm.ctx) == 65 and llama_cpp.llama_n_ctx(reserved.llm.ctx) == 2048
        ids = plain.tokenize(PROMPTS[1], add_special=True)
        rows = list(range(len(ids) - 8, len(ids)))
        np.testing.assert_array_equal(plain.eval(ids, rows).copy(), reserved.eval(ids, rows).copy())
        batch = [int(t) for t in (ids * 3)[:40]]  # a 40-row verify batch on top: the buffer would grow here
        np.testing.assert_array_equal(plain.eval(batch, range(40)).copy(), reserved.eval(batch, range(40)).copy())
    finally:
        plain.close()
        reserved.close()
    # gemma: 18 layers x 512 K+V halves per cell; the window cache grows from 1024 cells to n_ctx
    assert outputs_to_reserve(path, 65, 4096, 512) == 65  # 3072 cells: 57 MB, under 65 x 1 MiB of rows
    assert outputs_to_reserve(path, 65, 8192, 512) == 1  # 7168 cells: 132 MB
    assert outputs_to_reserve(path, 1000, 2048, 512) == 256  # llama.cpp's most sequences
    assert outputs_to_reserve(path, 1, 4096, 512) == 1
    assert outputs_to_reserve(model_path("smollm2-135m"), 65, 8192, 512) == 65  # no sliding window


def test_auto_flash_attention_is_off_only_for_attention_on_the_cpu_alone():
    """-fa auto: off for a CPU-only context whose attention scores fit SCORES_MAX; llama.cpp's auto with any
    layer offloaded, on RPC workers, or where the scores would not fit; on and off as asked. The cost
    calibration of an `off` context is its own (another kernel, other costs)."""
    from specchat import rpc
    from specchat.backend import SCORES_MAX, cpu_alone, flash_attn_for
    from specchat.costs import cost_cache_key
    from specchat.gguf_header import gguf_values

    path = model_path("smollm2-135m")
    n_head = gguf_values(path)[1]["attention.head_count"]
    assert flash_attn_for(path, "auto", 4096, 512, True) == "off"
    assert flash_attn_for(path, "auto", 4096, 512, False) == "auto"  # layers on a GPU or a worker: llama.cpp's choice
    too_long = SCORES_MAX // (512 * n_head * 4) + 1  # a context whose scores pass SCORES_MAX
    assert flash_attn_for(path, "auto", too_long, 512, True) == "auto"
    assert flash_attn_for(path, "on", 4096, 512, True) == "on" and flash_attn_for(path, "off", 4096, 512, False) == "off"
    # what counts as the CPU alone: -ngl 0, or no GPU here (a build with RPC offers offload without one);
    # never with RPC workers
    assert cpu_alone(0, ()) and not cpu_alone(0, ("127.0.0.1:50052",)) and not cpu_alone(-1, ("127.0.0.1:50052",))
    assert cpu_alone(-1, ()) == (not rpc.local_gpu_devices())

    class Timed:  # what cost_cache_key reads of a backend
        def __init__(self, used):
            self.path, self.name, self.n_threads, self.n_gpu_layers, self.rpc = path, "m", 2, 0, ()
            self.flash_attn_used = used

    assert cost_cache_key(Timed("on")) == cost_cache_key(Timed("auto")) != cost_cache_key(Timed("off"))
