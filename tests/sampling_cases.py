"""The sampler / drafter configurations of the losslessness checks (test_sampling.py), which the sparse
path's comparison with the dense reference (test_sparse.py) runs too: a 10-token target row, three
draft rows, a history the penalties read, and the 12 cases."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specchat.sampling import SamplingParams

V = 10
HISTORY = [3, 3, 3, 5, 0, 8, 5]  # the context so far: contains the target's favourite candidates
TARGET = np.array([1.0, 0.2, -0.5, 2.0, 0.0, 1.6, -1.0, 0.7, 1.2, -2.0])
DRAFT_NEAR = TARGET + np.array([0.3, -0.4, 0.2, -0.5, 0.6, 0.1, -0.2, 0.4, -0.6, 0.3])
DRAFT_FAR = np.array([-1.0, 1.5, 1.0, -0.5, 2.0, 0.0, 1.2, -1.5, 0.3, 0.8])
# no mass at all on three tokens the target likes most
DRAFT_ZERO = np.where(np.isin(np.arange(V), [0, 3, 8]), -np.inf, DRAFT_FAR)

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)


def sp(**kw) -> SamplingParams:
    return SamplingParams(**{**OFF, **kw})


@dataclass
class Case:
    name: str
    params: SamplingParams
    k: int
    draft: np.ndarray | None = None  # draft logits (q = process(draft, params, history))
    fixed: list[int] | None = None  # deterministic drafter (prompt lookup): q = None
    one_hot_q: bool = False  # the deterministic drafts, but q passed as explicit one-hot rows


CASES = [
    Case("temp1.0-near-k1", sp(temperature=1.0), 1, DRAFT_NEAR),
    Case("temp0.3-near-k4", sp(temperature=0.3), 4, DRAFT_NEAR),
    Case("temp0.8-llama-defaults-k2", SamplingParams(temperature=0.8), 2, DRAFT_NEAR),
    Case("temp1.5-far-k1", sp(temperature=1.5), 1, DRAFT_FAR),
    Case("top-k3-far-k1", sp(temperature=1.0, top_k=3), 1, DRAFT_FAR),
    Case("top-p0.6-near-k1", sp(temperature=0.8, top_p=0.6), 1, DRAFT_NEAR),
    Case("min-p0.3-far-k1", sp(temperature=1.0, min_p=0.3), 1, DRAFT_FAR),
    Case("repeat-penalty1.8-near-k2", sp(temperature=1.0, repeat_penalty=1.8), 2, DRAFT_NEAR),
    Case("freq0.6-presence0.8-far-k1", sp(temperature=1.0, frequency_penalty=0.6, presence_penalty=0.8), 1, DRAFT_FAR),
    Case("draft-zero-mass-k4", sp(temperature=0.8, top_p=0.9), 4, DRAFT_ZERO),
    Case("lookup-k4", sp(temperature=0.8, top_p=0.9), 4, fixed=[5, 3, 0, 8]),
    Case("one-hot-q-k1", sp(temperature=1.0, repeat_penalty=1.3), 1, fixed=[8], one_hot_q=True),
]
