"""The one draft loop every model drafter runs (drafters.DraftLoop): what it asks of its drafter's rows and
when it stops. The losslessness of what it draws is checked drafter by drafter (test_engine, test_heads,
test_dflash, test_crossvocab)."""

from __future__ import annotations

import numpy as np

from specchat.drafters import DraftLoop, ModelDrafting
from specchat.kinds import DRAFT_MODEL
from specchat.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
V = 16


def row_for(best: int, margin: float = 10.0) -> np.ndarray:
    row = np.zeros(V, dtype=np.float32)
    row[best] = margin
    return row


class Rows:
    """row_at that records which rows were asked for, and after which token."""

    def __init__(self, rows):
        self.rows = rows
        self.asked: list[tuple[int, int | None]] = []

    def __call__(self, i, token):
        self.asked.append((i, token))
        return self.rows[i] if i < len(self.rows) else None


def test_a_row_is_asked_for_only_when_its_token_is():
    rows = Rows([row_for(t) for t in (3, 5, 7, 9)])
    loop = DraftLoop([1, 2], GREEDY, np.random.default_rng(0), p_min=0.0)
    taken = []
    for token, q in loop.tokens(4, rows):
        taken.append(token)
        assert q is None  # greedy: one-hot
        if len(taken) == 2:
            break
    assert taken == [3, 5]
    assert rows.asked == [(0, None), (1, 3)]  # the row after 5 was never evaluated


def test_the_loop_ends_at_k_at_the_last_row_and_before_an_unsure_token():
    rows = Rows([row_for(3), row_for(5)])
    assert [t for t, _ in DraftLoop([], GREEDY, np.random.default_rng(0), 0.0).tokens(5, rows)] == [3, 5]
    assert rows.asked[-1] == (2, 5)  # asked for a third row, and there was none

    unsure = Rows([row_for(3), row_for(5, margin=0.1)])
    loop = DraftLoop([], GREEDY, np.random.default_rng(0), p_min=0.5)
    assert [t for t, _ in loop.tokens(5, unsure)] == [3]
    assert loop.unsure == 5  # the token it stopped before, for a drafter that reads it (cross-vocab SLEM)

    sure = DraftLoop([], GREEDY, np.random.default_rng(0), p_min=0.5)
    assert [t for t, _ in sure.tokens(1, Rows([row_for(3), row_for(5)]))] == [3] and sure.unsure is None


def test_penalties_see_the_tokens_drafted_before():
    params = SamplingParams(temperature=0.0, repeat_penalty=100.0)
    flat = np.linspace(2.0, 1.0, V).astype(np.float32)  # 0 is the favourite, 1 the next
    loop = DraftLoop([0], params, np.random.default_rng(0), 0.0)
    assert [t for t, _ in loop.tokens(3, lambda i, token: flat)] == [1, 2, 3]
    assert loop.history == [0, 1, 2, 3]


def test_a_draft_shorter_than_draft_min_is_empty():
    class Drafter(ModelDrafting):
        kind = DRAFT_MODEL

    rows = [row_for(3), row_for(5), row_for(7, margin=0.1)]
    at = lambda i, token: rows[i]  # noqa: E731
    for draft_min, want in ((2, [3, 5]), (3, [])):
        drafter = Drafter(p_min=0.5, draft_min=draft_min)
        draft = drafter._draft([], 3, GREEDY, np.random.default_rng(0), at)
        assert draft.tokens == want and draft.q == [None] * len(want)
        assert draft.source == ("draft-model" if want else "")
