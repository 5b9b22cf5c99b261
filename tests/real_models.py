"""Helpers for the tests that run real models (marked `real`): the teacher-forced greedy check, prompts
in a model's own chat template, a quiet chat session, and `specchat` as a subprocess.

Greedy speculative output cannot be bit-identical to plain greedy decoding here: llama.cpp's logits for a
batch differ from single-token logits by up to ~0.12 (measured with llama-cpp-python 0.3.36). So greedy
losslessness is a teacher-forced check: evaluate prompt + generated once with the target and require every
emitted token to be within a small tolerance of that position's best logit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from specchat.config import load_config
from specchat.engine import Finished, TokenEvent, generate
from specchat.policy import FixedPolicy
from specchat.sampling import SamplingParams
from specchat.sources import resolve
from specchat.template import render

# batch vs single-token logit noise is <= ~0.12 here; a wrong token is typically several logits below
TOLERANCE = 0.3
GREEDY = SamplingParams(temperature=0.0)


def model_path(name: str):
    return resolve(load_config().model(name))


def run(target, drafter, prompt_ids, params, k, max_tokens=48):
    events = list(generate(target, drafter, prompt_ids, params, max_tokens=max_tokens, policy=FixedPolicy(k)))
    finished = events[-1]
    assert isinstance(finished, Finished)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [e.id for e in tokens] == finished.token_ids
    return finished, tokens


def teacher_forced_gaps(target, prompt_ids, generated) -> np.ndarray:
    """For each generated token: (best logit at its position) - (its logit), from one fresh batch."""
    target.truncate(0)
    sequence = list(prompt_ids) + list(generated)
    first = len(prompt_ids) - 1
    rows = target.eval(sequence[:-1], range(first, len(sequence) - 1))
    target.truncate(0)
    chosen = rows[np.arange(len(generated)), generated]
    return rows.max(axis=1) - chosen


def prompt_ids_for(target, text):
    """Instruct models get their chat template (a raw prompt makes SmolLM2 stop at once)."""
    return render(target, [{"role": "user", "content": text}]).token_ids


def quiet_chat_session(loaded, run_opts, transcript_path):
    """A ChatSession writing to string buffers (no terminal), for driving turns from a test."""
    import io

    from specchat import chat, ui

    return chat.ChatSession(
        loaded, run_opts, console=ui.make_console(file=io.StringIO()), info=ui.make_console(file=io.StringIO()),
        out=io.StringIO(), transcript=chat.Transcript(transcript_path), live=False,
    )


def count_draft_prefills(drafter) -> list[int]:
    """Wrap drafter.prefill to record how many tokens each call evaluated on the draft's backend."""
    prefilled: list[int] = []
    real_prefill = drafter.prefill

    def counting_prefill(ids):
        before = drafter.backend.evaluated
        real_prefill(ids)
        prefilled.append(drafter.backend.evaluated - before)

    drafter.prefill = counting_prefill
    return prefilled


def specchat(*args: str, home, stdin: str | None = None, env: dict | None = None, timeout: int = 180):
    """`specchat ARGS` as a subprocess with SPECCHAT_HOME=home (the user's SPECCHAT_CONFIG left out unless
    `env` sets one)."""
    environment = {**os.environ, "SPECCHAT_HOME": str(home), **(env or {})}
    environment.pop("SPECCHAT_CONFIG", None) if env is None or "SPECCHAT_CONFIG" not in env else None
    return subprocess.run(
        [sys.executable, "-m", "specchat.cli", *args],
        input=stdin, capture_output=True, text=True, env=environment, timeout=timeout,
    )
