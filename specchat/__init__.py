"""specchat: local speculative decoding over llama.cpp, lossless for greedy and sampled decoding.

    import sys

    import specchat

    pair = specchat.load_pair("default")                  # SmolLM2-135M-Instruct + prompt lookup
    ids = pair.chat_prompt([{"role": "user", "content": "Name three rivers."}])
    for event in specchat.generate(pair.target, pair.drafter, ids, specchat.SamplingParams(temperature=0),
                                   max_tokens=64, policy=pair.policy()):
        if isinstance(event, specchat.TokenEvent):           # event.source: accepted|resampled|bonus|target
            sys.stdout.write(event.text)

    chat = specchat.Conversation(pair.target, pair.drafter, policy=pair.policy())   # KV kept across turns
    for event in chat.send("Name three rivers."): ...
    for event in chat.send("Which is the longest?"): ...                          # evaluates only this turn
"""

from __future__ import annotations

from .config import load_config
from .conversation import Conversation
from .engine import Finished, StepEvent, TokenEvent, generate
from .loader import Loaded, LoadOptions, Selection, load, select
from .sampling import SamplingParams
from .stats import RunStats, StepStats

__version__ = "0.1.0"

__all__ = [
    "Conversation", "Finished", "LoadOptions", "Loaded", "RunStats", "SamplingParams", "Selection", "StepEvent", "StepStats",
    "TokenEvent", "generate", "load", "load_pair",
]


def load_pair(pair: str | None = None, *, target: str | None = None, draft: str | None = None,
              **options) -> Loaded:
    """Load a pair by name from models.toml, or a target (-m) and drafter (-md) by name, path or hub ref.
    `options` are LoadOptions fields (n_ctx, n_gpu_layers, n_threads, draft_p_min, ...)."""
    config = load_config()
    selection = select(config, pair=pair, target=target, draft=draft, no_spec=False)
    return load(config, selection, LoadOptions(**options))
