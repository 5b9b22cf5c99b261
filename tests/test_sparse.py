"""The sparse path (`sampling.Dist`) against the dense sampler it replaced (tests/dense_reference.py).

For each of the 12 sampler configurations of the losslessness tests, and for a large random vocabulary
with the settings that take the other branches (whole vocabulary, top-p or min-p without top-k,
penalties and bans together), `process` must give the dense reference's distribution to 1e-9.
The losslessness tests themselves (test_sampling.py, test_engine.py) run through the same sparse path.
"""

from __future__ import annotations

import numpy as np
import pytest

from dense_reference import dense_apply_penalties, dense_process
from sampling_cases import CASES, DRAFT_FAR, DRAFT_NEAR, DRAFT_ZERO, HISTORY, TARGET
from specchat.sampling import (
    Dist,
    SamplingParams,
    apply_penalties,
    draft_confidence,
    draft_step,
    greedy_rows,
    greedy_token,
    one_hot,
    process,
    process_rows,
    residual,
    sample,
    top_k_ids,
    top_k_lists,
    _sorted,
)

RNG = np.random.default_rng(20261202)
BIG_V = 50_000
BIG = RNG.normal(0, 3, BIG_V).astype(np.float32)
BIG_HISTORY = RNG.integers(0, BIG_V, 300).tolist() + [int(np.argmax(BIG))] * 3  # penalises the favourite
# a vocabulary that splits into GROUPS slices (49152, as SmolLM2's) takes top_k_lists' fast path
WHOLE = RNG.normal(0, 3, 49_152).astype(np.float32)


def assert_same(sparse: Dist, dense: np.ndarray) -> None:
    assert isinstance(sparse, Dist)
    got = np.asarray(sparse)
    assert got.shape == dense.shape
    np.testing.assert_allclose(got, dense, rtol=0, atol=1e-9)
    assert got.sum() == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sparse_equals_dense_for_each_configuration(case):
    for logits in (TARGET, DRAFT_NEAR, DRAFT_FAR, DRAFT_ZERO, np.roll(TARGET, 3)):
        for history in (HISTORY, [], [1, 1, 2]):
            assert_same(process(logits, case.params, history), dense_process(logits, case.params, history))
    # the same settings on a real-sized vocabulary (float32 rows, as llama.cpp returns them)
    assert_same(process(BIG, case.params, BIG_HISTORY), dense_process(BIG, case.params, BIG_HISTORY))


BIG_SETTINGS = {
    "whole vocabulary": dict(top_k=0, top_p=1.0, min_p=0.0),
    "top-p only": dict(top_k=0, top_p=0.9, min_p=0.0),
    "top-p 0.999 only": dict(top_k=0, top_p=0.999, min_p=0.0),
    "min-p only": dict(top_k=0, top_p=1.0, min_p=0.01),
    "top-p and min-p": dict(top_k=0, top_p=0.5, min_p=0.001),
    "llama defaults": dict(),
    "top-k 1": dict(top_k=1),
    "top-k larger than the near window": dict(top_k=5000, top_p=1.0, min_p=0.0),
    "penalties + top-k": dict(top_k=40, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.4),
    "penalty below 1 raises logits": dict(top_k=20, repeat_penalty=0.5),
    "penalties, whole vocabulary": dict(top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.2),
    "banned + penalties": dict(top_k=40, repeat_penalty=1.5, banned=(int(np.argmax(BIG)), 7, 11)),
    "banned, whole vocabulary": dict(top_k=0, top_p=1.0, min_p=0.0, banned=(int(np.argmax(BIG)),)),
}


@pytest.mark.parametrize("temperature", [0.3, 0.8, 1.5])
@pytest.mark.parametrize("name", list(BIG_SETTINGS))
def test_sparse_equals_dense_large_vocabulary(name, temperature):
    params = SamplingParams(temperature=temperature, **BIG_SETTINGS[name])
    for logits in (BIG, WHOLE):
        for history in (BIG_HISTORY, []):
            assert_same(process(logits, params, history), dense_process(logits, params, history))


def test_truncating_samplers_stay_sparse():
    assert len(process(BIG, SamplingParams(), []).ids) <= 40
    assert len(process(BIG, SamplingParams(top_k=0, min_p=0.05), []).ids) < 200
    assert process(BIG, SamplingParams(top_k=0, top_p=1.0, min_p=0.0), []).ids is None  # the dense case


@pytest.mark.parametrize("name", list(BIG_SETTINGS))
def test_greedy_token_is_the_argmax_of_the_penalised_row(name):
    params = SamplingParams(temperature=0.0, **BIG_SETTINGS[name])
    for history in (BIG_HISTORY, [], [int(np.argmax(BIG))]):
        assert greedy_token(BIG, params, history) == int(np.argmax(dense_apply_penalties(BIG, params, history)))
    assert_same(process(BIG, params, BIG_HISTORY), dense_process(BIG, params, BIG_HISTORY))


def test_greedy_token_ties_take_the_lowest_id_like_argmax():
    logits = np.array([1.0, 3.0, 2.0, 3.0, 0.5])
    # token 1 penalised down to 2.0 ... then 3 is the best; with 3 banned, 1 and 2 tie at 2.0 -> 1
    params = SamplingParams(temperature=0.0, repeat_penalty=1.5, banned=(3,))
    dense = dense_apply_penalties(logits, params, [1])
    assert greedy_token(logits, params, [1]) == int(np.argmax(dense)) == 1


def test_apply_penalties_matches_the_reference_and_copies_only_when_needed():
    params = SamplingParams(repeat_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.1, banned=(5,))
    np.testing.assert_array_equal(apply_penalties(BIG, params, BIG_HISTORY), dense_apply_penalties(BIG, params, BIG_HISTORY))
    assert apply_penalties(BIG, SamplingParams(), BIG_HISTORY) is BIG


def test_residual_equals_the_dense_formula():
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0)):
        p = process(BIG, params, [])
        q = process(np.roll(BIG, 1) * 0.5 + BIG * 0.5, params, [])
        dense = np.maximum(np.asarray(p) - np.asarray(q), 0.0)
        assert_same(residual(p, q), dense / dense.sum())
        d = int(p.ids[0]) if p.ids is not None else int(np.argmax(p.probs))
        dense = np.asarray(p).copy()
        dense[d] = 0.0
        assert_same(residual(p, one_hot(d, BIG_V)), dense / dense.sum())


def test_dist_lookup_and_sampling():
    dist = Dist(np.array([7, 2, 9]), np.array([0.5, 0.3, 0.2]), 10)
    assert dist.prob(2) == 0.3 and dist.prob(4) == 0.0 and dist[9] == 0.2
    np.testing.assert_array_equal(dist.probs_at(np.array([9, 0, 7])), [0.2, 0.0, 0.5])
    assert dist.max() == 0.5
    draws = np.bincount([sample(dist, RNG) for _ in range(20_000)], minlength=10) / 20_000
    np.testing.assert_allclose(draws, np.asarray(dist), atol=0.015)
    assert Dist.of(np.array([0.0, 0.25, 0.75])).ids.tolist() == [1, 2]


def test_draft_confidence_is_llama_cpps_top10_probability():
    z = BIG[np.argsort(-BIG)[:10]].astype(np.float64)
    assert draft_confidence(BIG) == pytest.approx(1.0 / np.exp(z - z[0]).sum(), rel=1e-12)
    assert draft_confidence(np.array([0.0, 10.0, 0.0])) == pytest.approx(1 / (1 + 2 * np.exp(-10.0)))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", list(BIG_SETTINGS))
def test_draft_step_is_process_and_draft_confidence_in_one_pass(name, temperature):
    """The draft model's per-row work: the same q (or greedy token) and confidence as the two calls."""
    params = SamplingParams(temperature=temperature, **BIG_SETTINGS[name])
    for logits in (BIG, np.roll(BIG, 7), np.sort(BIG), WHOLE, np.sort(WHOLE)):
        for history in (BIG_HISTORY, []):
            token, q, confidence = draft_step(logits, params, history)
            assert confidence == pytest.approx(draft_confidence(logits), rel=1e-12)
            if params.greedy:
                assert q is None and token == greedy_token(logits, params, history)
            else:
                assert token is None
                assert_same(q, dense_process(logits, params, history))


def test_draft_step_greedy_ties_take_the_lowest_id():
    logits = np.zeros(64, dtype=np.float32)
    logits[[40, 9, 30]] = 5.0  # three tied at the top: the lowest id, as np.argmax
    assert draft_step(logits, SamplingParams(temperature=0.0), [])[0] == 9
    logits[:] = 1.0  # more ties than the ten candidates hold
    assert draft_step(logits, SamplingParams(temperature=0.0), [])[0] == 0


def test_sampling_a_small_support_is_the_cumulative_sum_draw():
    """The list-based draw for small supports is the cumulative-sum draw over the support's order,
    token for token, for the same generator state."""
    p = process(BIG, SamplingParams(temperature=1.3), [])
    assert p.ids is not None and 1 < len(p.ids) <= 40

    def numpy_draw(rng):
        cdf = np.cumsum(p.probs)
        return int(p.ids[np.searchsorted(cdf, rng.random() * cdf[-1], side="right")])

    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    assert [sample(p, rng_a) for _ in range(2000)] == [numpy_draw(rng_b) for _ in range(2000)]


# a verify batch as llama.cpp returns it: float32 rows over a vocabulary that splits into GROUPS slices
BATCH = RNG.normal(0, 3, (5, 49_152)).astype(np.float32)
BATCH[2, 100:140] = BATCH[2].max() + 1.0  # 40 tied favourites: the candidates lie in few columns


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", list(BIG_SETTINGS))
def test_rows_of_a_verify_batch_are_processed_as_one_by_one(name, temperature):
    params = SamplingParams(temperature=temperature, **{
        key: ([int(np.argmax(BATCH[1])), 7] if key == "banned" else value) for key, value in BIG_SETTINGS[name].items()})
    params = SamplingParams(**{**params.__dict__, "banned": tuple(params.banned)})
    history = lambda i: BIG_HISTORY[:50] + list(range(i))  # noqa: E731  (as the engine: context + d<i)
    for start in (0, 1):
        if params.greedy:
            want = [int(np.argmax(dense_apply_penalties(BATCH[i], params, history(i)))) for i in range(start, 5)]
            assert greedy_rows(BATCH, params, history, start) == want
        else:
            got = process_rows(BATCH, params, history, start)
            assert len(got) == 5 - start
            for i, dist in enumerate(got, start):
                assert_same(dist, dense_process(BATCH[i], params, history(i)))


def test_ties_at_the_top_k_boundary_keep_the_lowest_ids_in_both_paths():
    params = SamplingParams(temperature=0.8, top_k=3, top_p=1.0, min_p=0.0)
    single = process(BATCH[2], params, [])
    assert sorted(single.ids.tolist()) == [100, 101, 102]  # 40 tied at the top: the three lowest ids
    assert process_rows(BATCH, params, lambda i: [], 1)[1].ids.tolist() == single.ids.tolist()


def test_top_k_lists_is_top_k_ids_sorted_or_declines():
    """The per-token top-k: exactly top_k_ids' answer in _sorted's order, or None where it cannot be
    sure (ties at the k-th value, a vocabulary that is not a multiple of GROUPS, a short row)."""
    tied = WHOLE.copy()
    tied[[5, 9000, 30001]] = tied.max() + 2.0  # ties at the top, well inside the top k
    at_boundary = WHOLE.copy()
    at_boundary[np.argsort(-WHOLE)[39]] = WHOLE[np.argsort(-WHOLE)[40]]  # the 40th equals the 41st
    rows = [WHOLE, np.sort(WHOLE), -np.sort(WHOLE), tied, at_boundary, BATCH[2], *BATCH,
            RNG.normal(0, 3, 262_144).astype(np.float32), np.zeros(49_152, dtype=np.float32)]
    answered = 0
    for row in rows:
        for k in (1, 10, 40, 64):
            got = top_k_lists(row, k)
            if got is None:
                continue
            answered += 1
            ids = top_k_ids(row, k)
            assert got == _sorted(ids.tolist(), row[ids].tolist())
    assert answered >= 30
    assert top_k_lists(at_boundary, 40) is None and top_k_lists(np.zeros(49_152, dtype=np.float32), 10) is None
    assert top_k_lists(BIG, 40) is None and top_k_lists(WHOLE[:640], 40) is None  # 50000 % 32, 640 too short
    assert top_k_lists(tied, 3) == ([5, 9000, 30001], [float(tied[5])] * 3)


def test_small_dists_are_lists_until_asked():
    """The per-token path builds no arrays: a processed row stays Python lists through verify."""
    p = process(WHOLE, SamplingParams(temperature=0.8), [])
    assert p._probs is None and p.small()
    r = residual(p, process(np.roll(WHOLE, 1), SamplingParams(temperature=0.8), []))
    assert r._probs is None
    np.testing.assert_allclose(r.probs.sum(), 1.0)  # and the arrays appear when asked for
    assert r.ids.tolist() == r.lists()[0]
