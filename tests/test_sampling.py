"""Losslessness of the speculative rule (Leviathan et al. 2023), plus unit tests of `specchat.sampling`.

The claim: whatever the drafter proposes, the emitted tokens are distributed exactly as plain sampling from
the target's PROCESSED distribution `process(target_logits, params, history)`. With fake backends whose
distributions are known exactly, we draw many times and chi-square-test

the first emitted token of `sampling.verify` (precomputed rows, 12 sampler / drafter configurations).
(The same check through the whole `engine.generate` loop, first two tokens jointly, is in test_engine.py.)

Draw counts are not guessed: `draws_for` picks, per configuration, enough draws that the check detects the
worst-placed 1% absolute error in one token's probability with power >= 0.9 at its own threshold
(p < 1e-4): 65k-95k draws here. `test_power_*` prove on deliberately wrong rules that the same check fails.
The chi-square p-value is computed in fakes.py (regularized incomplete gamma), so scipy is not needed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fakes import ALPHA, DELTA, POWER, chi2_isf, chi2_pvalue, chi2_sf, detection_power, draws_for
from sampling_cases import CASES, DRAFT_FAR, DRAFT_ZERO, HISTORY, TARGET, V, Case, sp
from specchat import sampling
from specchat.sampling import (
    SamplingParams,
    apply_penalties,
    greedy_token,
    lazy_rows,
    one_hot,
    process,
    residual,
    sample,
    verify,
    verify_greedy,
)


def test_chi2_sf_matches_known_values():
    # textbook critical values: P(chi2_df > x) = alpha
    for df, x, alpha in [(1, 3.841, 0.05), (9, 33.72, 1e-4), (5, 11.07, 0.05), (20, 31.41, 0.05)]:
        assert chi2_sf(x, df) == pytest.approx(alpha, rel=2e-3)
    for x in (0.3, 5.0, 40.0, 300.0):  # closed forms: df 2 is exp(-x/2), df 1 is erfc(sqrt(x/2))
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    assert chi2_sf(0.0, 3) == 1.0
    assert chi2_sf(1e4, 3) < 1e-300 or chi2_sf(1e4, 3) == 0.0
    assert chi2_isf(0.05, 1) == pytest.approx(3.841, rel=1e-3)
    # even df: Q(m, x/2) = exp(-x/2) sum_{j<m} (x/2)^j / j!  (both branches of chi2_sf are exercised)
    for df in (4, 10, 16, 40):
        for x in (0.5, 3.0, 12.0, 40.0, 90.0):
            h = x / 2
            exact = math.exp(-h) * sum(h**j / math.factorial(j) for j in range(df // 2))
            assert chi2_sf(x, df) == pytest.approx(exact, rel=1e-9, abs=1e-300)


def test_chi2_pvalue_pools_small_cells_and_rejects_impossible_draws():
    probs = np.array([0.5, 0.3, 0.19, 0.01, 0.0])
    assert chi2_pvalue(np.array([50, 30, 19, 1, 0]), probs) == pytest.approx(1.0)
    assert chi2_pvalue(np.array([50, 30, 19, 0, 1]), probs) == 0.0  # a token the target never draws
    assert chi2_pvalue(np.array([5000, 3000, 1000, 1000, 0]), probs) < 1e-12


# ---------------------------------------------------------------------------------------------------------
# verify(): first emitted token, 12 configurations

class Uniforms:
    """The only thing verify() asks of its rng is .random(): serve it from a block drawn by a seeded
    numpy Generator (same distribution, a third faster than one Generator call per number)."""

    def __init__(self, rng: np.random.Generator, block: int = 1 << 16):
        self._rng, self._block = rng, block
        self._buf: list[float] = []
        self._i = 0

    def random(self) -> float:
        if self._i >= len(self._buf):
            self._buf, self._i = self._rng.random(self._block).tolist(), 0
        self._i += 1
        return self._buf[self._i - 1]


def _draw(q: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n independent tokens from q (inverse CDF; zero-probability tokens are never drawn)."""
    q = np.asarray(q)
    cdf = np.cumsum(q)
    return np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), len(q) - 1)


def case_rows(case: Case) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """p rows (k+1) and q rows (k). Row 0 is the one that decides the first token; later rows are other
    fixed distributions (their values do not affect the first token, but verify still walks them)."""
    params, k = case.params, case.k
    p = [process(np.roll(TARGET, i), params, HISTORY) for i in range(k + 1)]
    if case.fixed is not None:
        q = [one_hot(d, V) for d in case.fixed] if case.one_hot_q else [None] * k
    else:
        q = [process(np.roll(case.draft, i), params, HISTORY) for i in range(k)]
    return p, q


def first_tokens(case: Case, n: int, seed: int, verify_fn=None) -> np.ndarray:
    """The first emitted token of each of n verify calls, each with freshly drawn drafts."""
    verify_fn = verify_fn or sampling.verify
    p, q = case_rows(case)
    rng = np.random.default_rng(seed)
    if case.fixed is not None:
        drafts = [list(case.fixed)] * n
    else:
        drafts = np.stack([_draw(q[i], n, rng) for i in range(case.k)], axis=1).tolist()
    u = Uniforms(rng)
    first = []
    for d in drafts:
        n_accepted, token = verify_fn(p, q, d, u)
        first.append(d[0] if n_accepted else token)
    return np.array(first, dtype=np.int64)


_honest: dict[str, np.ndarray] = {}


def honest_first_tokens(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(first tokens from the real verify at the case's draw count, the target distribution); memoised so
    the power test reuses the draws of the losslessness test."""
    target = np.asarray(process(TARGET, case.params, HISTORY))  # what plain sampling from the target draws from
    if case.name not in _honest:
        _honest[case.name] = first_tokens(case, draws_for(target), seed=1000 + CASES.index(case))
    return _honest[case.name], target


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_verify_first_token_is_target_distribution(case: Case):
    first, target = honest_first_tokens(case)
    n = len(first)
    counts = np.bincount(first, minlength=V)
    pvalue = chi2_pvalue(counts, target)
    assert pvalue > ALPHA, f"{case.name}: {n} draws, p={pvalue:.2e}\nobserved {counts / n}\nexpected {target}"


def test_cases_are_not_trivial():
    """The configurations exercise what they claim: drafts differ from the target, truncation and
    penalties change the target, the zero-mass draft really has zero mass where the target has mass."""
    base = np.asarray(process(TARGET, sp(temperature=1.0), HISTORY))
    by_name = {c.name: c for c in CASES}
    assert len(CASES) >= 10 and {c.k for c in CASES} >= {1, 4}
    assert {c.params.temperature for c in CASES} >= {0.3, 0.8, 1.0, 1.5}
    for name in ("top-k3-far-k1", "top-p0.6-near-k1", "min-p0.3-far-k1"):
        p = process(TARGET, by_name[name].params, HISTORY)
        assert 0 < np.count_nonzero(p) < V, name
    for name in ("repeat-penalty1.8-near-k2", "freq0.6-presence0.8-far-k1"):
        p = process(TARGET, by_name[name].params, HISTORY)
        assert np.abs(p - base).max() > 0.05, name
    q = np.asarray(process(DRAFT_ZERO, by_name["draft-zero-mass-k4"].params, HISTORY))
    p = process(TARGET, by_name["draft-zero-mass-k4"].params, HISTORY)
    assert (q[[0, 3, 8]] == 0).all() and p[[0, 3, 8]].sum() > 0.5
    q_far = np.asarray(process(DRAFT_FAR, sp(temperature=1.5), HISTORY))
    assert 0.5 * np.abs(q_far - np.asarray(process(TARGET, sp(temperature=1.5), HISTORY))).sum() > 0.3  # total variation


def test_draw_counts_give_the_power_claimed():
    """The per-configuration draw count detects a 1% error with power >= 0.9 (and is not absurdly large)."""
    counts = {}
    for case in CASES:
        target = np.asarray(process(TARGET, case.params, HISTORY))
        n = draws_for(target)
        assert detection_power(n, target) >= POWER
        counts[case.name] = n
    assert 20_000 <= min(counts.values()) and max(counts.values()) <= 200_000, counts


# --- the check has power: deliberately wrong rules must fail it ----------------------------------------------
# Gross bugs are caught with a fraction of the draws (WRONG_DRAWS); the 1% case uses the full count.
WRONG_DRAWS = 20_000


def test_power_residual_replaced_by_p(monkeypatch):
    """Resampling from p instead of normalize(max(0, p - q)) after a rejection over-weights what the
    draft already proposed. The real verify runs with sampling.residual patched."""
    case = next(c for c in CASES if c.name == "temp1.5-far-k1")
    target = np.asarray(process(TARGET, case.params, HISTORY))
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    counts = np.bincount(first_tokens(case, WRONG_DRAWS, seed=7), minlength=V)
    assert chi2_pvalue(counts, target) < 1e-12


def verify_accepting_with_p(p, q, drafts, rng):
    """WRONG on purpose: accept a sampled draft with probability p(d), ignoring q, yet correct with the
    residual normalize(max(0, p - q)). (Accepting with p/q "without the min" is no bug at all, since
    u < p/q already accepts with min(1, p/q); and treating q as one-hot in BOTH places is lossless too.)"""
    for i, d in enumerate(drafts):
        if rng.random() < p[i][d]:
            continue
        return i, sample(residual(p[i], q[i]), rng)
    return len(drafts), sample(p[len(drafts)], rng)


def test_power_acceptance_ignoring_q():
    case = next(c for c in CASES if c.name == "temp1.0-near-k1")
    target = np.asarray(process(TARGET, case.params, HISTORY))
    counts = np.bincount(first_tokens(case, WRONG_DRAWS, seed=8, verify_fn=verify_accepting_with_p), minlength=V)
    assert chi2_pvalue(counts, target) < 1e-12


def test_power_one_percent_error_is_caught():
    """A rule wrong by exactly 1% absolute on the hardest token to see (p nearest 1/2) fails the check at
    the draw count draws_for() chose. The error is injected into the real verify's draws: with probability
    0.01 / (1 - p_a) a token other than a becomes a, so P(a) grows by 0.01 and the others shrink in
    proportion."""
    for name in ("temp1.0-near-k1", "temp0.3-near-k4"):
        case = next(c for c in CASES if c.name == name)
        first, target = honest_first_tokens(case)
        n = len(first)
        assert chi2_pvalue(np.bincount(first, minlength=V), target) > ALPHA
        a = int(np.argmin(np.abs(target - 0.5)))
        flip = (first != a) & (np.random.default_rng(99).random(n) < DELTA / (1 - target[a]))
        wrong = np.bincount(np.where(flip, a, first), minlength=V)
        assert wrong[a] / n - target[a] == pytest.approx(DELTA, abs=0.004)
        assert chi2_pvalue(wrong, target) < ALPHA, (name, n)


# ---------------------------------------------------------------------------------------------------------
# process(): hand-computed values, llama.cpp semantics


def softmax(z) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def test_process_temperature():
    logits = np.array([1.0, 2.0, 3.0, 0.0], dtype=np.float32)
    out = np.asarray(process(logits, sp(temperature=0.5), []))
    assert out.dtype == np.float64 and out.shape == (4,)
    np.testing.assert_allclose(out, softmax([2.0, 4.0, 6.0, 0.0]), rtol=1e-6)
    np.testing.assert_allclose(process(logits, sp(temperature=1.0), []), softmax(logits), rtol=1e-6)
    np.testing.assert_allclose(process(logits, sp(temperature=2.0), []), softmax(logits / 2), rtol=1e-6)


def test_process_greedy_is_argmax_one_hot_and_ignores_truncation():
    logits = np.array([1.0, 5.0, 3.0])
    for params in (sp(temperature=0.0), SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9)):
        np.testing.assert_array_equal(process(logits, params, []), [0.0, 1.0, 0.0])
    # a penalty changes the argmax
    np.testing.assert_array_equal(process(logits, sp(temperature=0.0, presence_penalty=3.0), [1]), [0.0, 0.0, 1.0])
    assert greedy_token(logits, sp(temperature=0.0, presence_penalty=3.0), [1]) == 2
    assert greedy_token(logits, sp(temperature=0.0), [1]) == 1


def test_process_top_k():
    logits = np.array([1.0, 3.0, 2.0, 0.0, -1.0])
    out = process(logits, sp(temperature=1.0, top_k=2), [])
    top2 = softmax([3.0, 2.0])
    np.testing.assert_allclose(out, [0.0, top2[0], top2[1], 0.0, 0.0], rtol=1e-9)
    # top_k 0 and top_k >= vocabulary mean no truncation
    for k in (0, 5, 40):
        np.testing.assert_allclose(process(logits, sp(temperature=1.0, top_k=k), []), softmax(logits), rtol=1e-9)
    np.testing.assert_array_equal(process(logits, sp(temperature=1.0, top_k=1), []), [0, 1, 0, 0, 0])


def test_process_top_p_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)
    # cumulative 0.5, 0.8, 0.95, 1.0: keep the fewest tokens whose mass reaches top_p
    for top_p, keep in [(0.4, 1), (0.5001, 2), (0.75, 2), (0.81, 3), (0.96, 4), (1.0, 4)]:
        out = process(logits, sp(temperature=1.0, top_p=top_p), [])
        want = np.zeros(4)
        want[:keep] = probs[:keep] / probs[:keep].sum()
        np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-12, err_msg=f"top_p={top_p}")


def test_process_top_p_sees_the_top_k_renormalised_set():
    # llama.cpp order: top-k first, then top-p over the (renormalised) survivors
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    out = process(np.log(probs), sp(temperature=1.0, top_k=2, top_p=0.5), [])
    np.testing.assert_allclose(out, [1, 0, 0, 0], atol=1e-12)  # 0.4 / 0.7 = 0.57 >= 0.5
    out = process(np.log(probs), sp(temperature=1.0, top_p=0.5), [])
    np.testing.assert_allclose(out, [0.4 / 0.7, 0.3 / 0.7, 0, 0], rtol=1e-9)  # 0.4 < 0.5 without top-k


def test_process_min_p_relative_to_the_top_token():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    for min_p, keep in [(0.25, 3), (0.29, 3), (0.31, 2), (0.59, 2), (0.61, 1), (0.05, 4), (1.0, 1)]:
        out = process(np.log(probs), sp(temperature=1.0, min_p=min_p), [])
        want = np.zeros(4)
        want[:keep] = probs[:keep] / probs[:keep].sum()
        np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-12, err_msg=f"min_p={min_p}")


def test_process_temperature_applies_after_truncation():
    """Truncation is decided on the un-tempered distribution (temperature is last in llama.cpp's chain)."""
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    z = np.log(probs)
    for temp in (0.3, 2.5):
        out = process(z, sp(temperature=temp, top_p=0.75), [])
        np.testing.assert_allclose(out, [*softmax(z[:2] / temp), 0, 0], rtol=1e-9)
        out = process(z, sp(temperature=temp, min_p=0.25), [])
        np.testing.assert_allclose(out, [*softmax(z[:3] / temp), 0], rtol=1e-9)


def test_apply_penalties_llama_cpp_semantics():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0])
    history = [0, 1, 1, 4, 4, 4]
    # repeat: positive logits divided, negative multiplied, once per distinct token, counts ignored
    out = apply_penalties(logits, sp(repeat_penalty=2.0), history)
    np.testing.assert_allclose(out, [1.0, -2.0, 0.5, 3.0, -4.0])
    # frequency: count * f; presence: once
    out = apply_penalties(logits, sp(frequency_penalty=0.5, presence_penalty=0.25), history)
    np.testing.assert_allclose(out, [2.0 - 0.5 - 0.25, -1.0 - 1.0 - 0.25, 0.5, 3.0, -2.0 - 1.5 - 0.25])
    # all three: repeat first, then frequency and presence
    out = apply_penalties(logits, sp(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), history)
    np.testing.assert_allclose(out, [1.0 - 0.75, -2.0 - 1.25, 0.5, 3.0, -4.0 - 1.75])
    # the window: only the last repeat_last_n tokens count
    out = apply_penalties(logits, sp(repeat_penalty=2.0, repeat_last_n=3), history)
    np.testing.assert_allclose(out, [2.0, -1.0, 0.5, 3.0, -4.0])
    out = apply_penalties(logits, sp(frequency_penalty=1.0, repeat_last_n=4), history)
    np.testing.assert_allclose(out, [2.0, -2.0, 0.5, 3.0, -5.0])
    # -1 = whole history; 0 = off; no history = nothing to do; the input is not modified
    out = apply_penalties(logits, sp(frequency_penalty=1.0, repeat_last_n=-1), history * 30)
    np.testing.assert_allclose(out, [2.0 - 30, -1.0 - 60, 0.5, 3.0, -2.0 - 90])
    np.testing.assert_array_equal(apply_penalties(logits, sp(repeat_penalty=2.0, repeat_last_n=0), history), logits)
    np.testing.assert_array_equal(apply_penalties(logits, sp(repeat_penalty=2.0), []), logits)
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 3.0, -2.0])


def test_process_penalties_then_truncation():
    logits = np.array([3.0, 2.9, 0.0, -1.0])
    # without a penalty top_k=1 keeps token 0; with it, token 1 wins
    out = process(logits, sp(temperature=1.0, top_k=1, presence_penalty=0.5), [0])
    np.testing.assert_array_equal(out, [0, 1, 0, 0])
    out = process(logits, sp(temperature=1.0, repeat_penalty=1.5), [0, 3])
    np.testing.assert_allclose(out, softmax([2.0, 2.9, 0.0, -1.5]), rtol=1e-9)


def test_process_large_vocab_sums_to_one():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, 50_000).astype(np.float32)
    out = np.asarray(process(logits, SamplingParams(), list(range(100))))
    assert out.sum() == pytest.approx(1.0) and 1 <= np.count_nonzero(out) <= 40


def test_sample_draws_from_the_support():
    rng = np.random.default_rng(0)
    p = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    draws = np.array([sample(p, rng) for _ in range(4000)])
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 3).mean() - 0.75) < 0.03
    assert sample(one_hot(4, 5), rng) == 4


def test_residual():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.5, 0.3])
    np.testing.assert_allclose(residual(p, q), [1.0, 0.0, 0.0])
    p = np.array([0.4, 0.4, 0.2, 0.0])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(residual(p, q), [0.3 / 0.5, 0.2 / 0.5, 0.0, 0.0])
    # deterministic draft: p with the draft token removed, renormalised
    np.testing.assert_allclose(residual(p, one_hot(0, 4)), [0.0, 0.4 / 0.6, 0.2 / 0.6, 0.0])
    # p == q: a rejection cannot happen; the guard returns p
    np.testing.assert_allclose(residual(p, p.copy()), p)


def test_verify_deterministic_cases():
    rng = np.random.default_rng(0)
    p = [np.array([0.0, 1.0, 0.0]), np.array([0.0, 0.0, 1.0]), np.array([1.0, 0.0, 0.0])]
    # drafts the target is certain of: all accepted, bonus from the last row
    assert verify(p, [None, None], [1, 2], rng) == (2, 0)
    assert verify(p, [one_hot(1, 3), np.array([0.5, 0.0, 0.5])], [1, 2], rng) == (2, 0)
    # a draft with p = 0 is always rejected, the correction comes from the residual
    for _ in range(50):
        assert verify(p, [None, None], [0, 2], rng) == (0, 1)
        assert verify(p, [None, None], [1, 0], rng) == (1, 2)
    # no drafts: one token from p[0]
    assert verify(p, [], [], rng) == (0, 1)


def test_verify_acceptance_probability_is_min_one_p_over_q():
    rng = np.random.default_rng(1)
    p = [np.array([0.2, 0.8]), np.array([0.5, 0.5])]
    n = 40_000
    # q(0) = 0.5 > p(0) = 0.2: accept with probability 0.4
    acc = sum(verify(p, [np.array([0.5, 0.5])], [0], rng)[0] for _ in range(n)) / n
    assert abs(acc - 0.4) < 0.015
    # q(1) = 0.5 < p(1): always accepted
    assert all(verify(p, [np.array([0.5, 0.5])], [1], rng)[0] == 1 for _ in range(500))
    # deterministic: accept with probability p(d)
    acc = sum(verify(p, [None], [0], rng)[0] for _ in range(n)) / n
    assert abs(acc - 0.2) < 0.015


def test_verify_processes_rows_lazily():
    made = []

    def make(i):
        made.append(i)
        return np.array([1.0, 0.0]) if i == 0 else np.array([0.0, 1.0])

    rows = lazy_rows(4, make)
    assert len(rows) == 4
    # draft 1 at position 0 has p = 0: rejected; rows 1..3 are never processed
    assert verify(rows, [None, None, None], [1, 1, 1], np.random.default_rng(0)) == (0, 0)
    assert made == [0]
    argmax_made = []
    argmax = lazy_rows(4, lambda i: argmax_made.append(i) or [5, 6, 7, 8][i])
    assert verify_greedy(argmax, [5, 9, 7]) == (1, 6)
    assert argmax_made == [0, 1]


def test_verify_greedy():
    assert verify_greedy([3, 4, 5, 6], [3, 4, 5]) == (3, 6)
    assert verify_greedy([3, 4, 5, 6], [9, 4, 5]) == (0, 3)
    assert verify_greedy([3, 4, 5, 6], [3, 9, 5]) == (1, 4)
    assert verify_greedy([3, 4, 5, 6], [3, 4, 9]) == (2, 5)
    assert verify_greedy([7], []) == (0, 7)


@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(temperature=-0.1), "--temp"),
        (dict(temperature=float("nan")), "--temp"),
        (dict(temperature=float("inf")), "--temp"),
        (dict(top_k=-1), "--top-k"),
        (dict(top_p=0.0), "--top-p"),
        (dict(top_p=1.5), "--top-p"),
        (dict(min_p=-0.1), "--min-p"),
        (dict(min_p=1.1), "--min-p"),
        (dict(repeat_penalty=0.0), "--repeat-penalty"),
        (dict(repeat_penalty=float("nan")), "--repeat-penalty"),
        (dict(repeat_last_n=-2), "--repeat-last-n"),
        (dict(frequency_penalty=float("inf")), "--frequency-penalty"),
        (dict(presence_penalty=float("nan")), "--presence-penalty"),
        (dict(seed=-1), "--seed"),
        (dict(seed=2**63), "--seed"),
    ],
)
def test_sampling_params_check_names_the_bad_setting(kw, flag):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kw).check()
    msg = str(err.value)
    assert msg.startswith(flag + " "), msg
    bad = list(kw.values())[0]
    assert str(bad) in msg


def test_sampling_params_check_accepts_valid_settings():
    SamplingParams().check()
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_last_n=-1, seed=0).check()
    SamplingParams(repeat_penalty=1.1, frequency_penalty=-0.5, presence_penalty=0.5, seed=2**63 - 1).check()
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy
    assert not SamplingParams().has_penalty
    assert SamplingParams(presence_penalty=0.1).has_penalty
    assert not SamplingParams(presence_penalty=0.1, repeat_last_n=0).has_penalty
